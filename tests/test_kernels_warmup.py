"""Warm-up of the Triton kernels: every variant a call can launch on a CUDA device is compiled
when the communicator is created, and calls launch nothing else. Checked without a GPU: the
launchers run (their argument checks included) with each launch's variant computed by Triton's
own argument binder for a CUDA target (the specialisation and options its kernel cache is keyed
on: types, 16-byte alignment of pointers, divisibility of integers, constexprs, warps), as on
CUDA (launch configurations of a GPU, compiled kernel module); the calls' kernels then run in
Triton's interpreter on the same arguments."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

import dqcoll
from dqcoll import kernels
from dqcoll.kernels import _dynamiq_kernels, dynamiq_triton
from dqcoll.kernels._launch import compile_options
from dqcoll.testing import run_local
from dqcoll_lab.dynamiq import PAPER

# A variant: (kernel name, constexprs, ((argument, type, specialisation), ...), options).
Variant = tuple[str, tuple[tuple[str, Any], ...], tuple[tuple[str, str, Any], ...],
                tuple[tuple[str, Any], ...]]


@functools.cache
def _binder(kernel: Any) -> Any:
    """Triton's argument binder of ``kernel`` for an H100/H200 (sm_90) target: what
    ``JITFunction.run`` computes its kernel-cache key from."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as exc:  # a Triton older than these tests know
        pytest.skip(f"this Triton has no create_function_from_signature ({exc})")
    backend = make_backend(GPUTarget("cuda", 90, 32))
    return create_function_from_signature(kernel.signature, kernel.params, backend)


def _variant(kernel: Any, num_warps: int, args: tuple[Any, ...],
             constexprs: dict[str, Any]) -> Variant:
    """The variant Triton compiles for this launch on a GPU (its cache key, with names)."""
    _, specialization, options = _binder(kernel)(*args, **constexprs, num_warps=num_warps,
                                                 **compile_options())
    names = [p.name for p in kernel.params]
    spec = tuple((name, *s) for name, s in zip(names, specialization, strict=True)
                 if s[0] != "constexpr")
    return (kernel.__name__, tuple(sorted(constexprs.items())), spec,
            tuple(sorted(options.items())))


def _gpu_launches(monkeypatch: pytest.MonkeyPatch, *, run: bool) -> list[Variant]:
    """Record every launch's GPU variant from here on; with ``run``, also run it (interpreted)."""
    launches: list[Variant] = []
    real_launch = dynamiq_triton._launch
    interpreted = dynamiq_triton._interpreted_kernels()

    def record(kernel: Any, cfg: Any, n_rows: int, is_interpreted: bool, *args: Any,
               **constexprs: Any) -> None:
        assert not is_interpreted
        launches.append(_variant(kernel, cfg.num_warps, args,
                                 {"ROWS": cfg.rows_per_program, **constexprs}))
        if run:
            real_launch(getattr(interpreted, kernel.__name__), cfg, n_rows, True, *args,
                        **constexprs)

    monkeypatch.setattr(dynamiq_triton, "_launch", record)
    monkeypatch.setattr(dynamiq_triton, "_kernels_for", lambda device: (_dynamiq_kernels, False))
    return launches


def _recorded_warm_up(monkeypatch: pytest.MonkeyPatch) -> list[Variant]:
    with monkeypatch.context() as scope:
        launches = _gpu_launches(scope, run=False)
        scope.setattr(dynamiq_triton, "_warmed", set())
        dynamiq_triton.warm_up(torch.device("cpu"))
    return launches


def _spec(v: Variant, arg: str) -> tuple[str, Any]:
    return next((t, s) for name, t, s in v[2] if name == arg)


def test_warm_up_launches_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up launches, for every (width, scale encoding) the kernels declare, both
    roundings and ``WRITE_ACC``, records at aligned and unaligned addresses in and out, the
    encode's and the statistics' three input dtypes (the statistics' input at both alignments)
    and the restore's three output dtypes; keys, row counts and the per-row arrays never
    specialise."""
    seen = set(_recorded_warm_up(monkeypatch))

    def variants(name: str) -> list[Variant]:
        return [v for v in seen if v[0] == name]

    def consts(v: Variant) -> dict[str, Any]:
        return dict(v[1])

    def aligned(v: Variant, arg: str) -> bool:
        return _spec(v, arg)[1] == "D"

    def dtype(v: Variant, arg: str) -> str:
        return _spec(v, arg)[0]

    formats = {(w, s.value) for s, widths in dynamiq_triton.FORMATS.items() for w in widths}
    fused = variants("_decode_accumulate_encode_kernel")
    got = {(c["WIDTH"], c["SCALES"], c["CORRELATED"], c["WRITE_ACC"],
            aligned(v, "rec_ptr"), aligned(v, "out_ptr"))
           for v in fused for c in [consts(v)]}
    want = {(w, s, *rest) for (w, s), rest in itertools.product(
        formats, itertools.product((False, True), repeat=4))}
    assert got == want
    encode = variants("_encode_kernel")
    got = {(c["WIDTH"], c["SCALES"], c["CORRELATED"], dtype(v, "x_ptr"),
            aligned(v, "out_ptr")) for v in encode for c in [consts(v)]}
    assert {(w, s, c, "*fp32", a) for (w, s), c, a in itertools.product(
        formats, (False, True), (False, True))} <= got
    assert {(w, s, c, d) for w, s, c, d, _ in got} == {(w, s, c, d) for (w, s), c, d in
                                                       itertools.product(
        formats, (False, True), ("*fp32", "*bf16", "*fp16"))}
    for name in ("_decode_kernel", "_decode_accumulate_kernel"):
        got = {(consts(v)["WIDTH"], consts(v)["SCALES"], aligned(v, "rec_ptr"))
               for v in variants(name)}
        assert got == {(w, s, a) for (w, s), a in itertools.product(formats, (False, True))}, name
    got = {(dtype(v, "x_ptr"), aligned(v, "x_ptr")) for v in variants("_stats_center_kernel")}
    assert got == set(itertools.product(("*fp32", "*bf16", "*fp16"), (False, True)))
    assert {dtype(v, "out_ptr") for v in variants("_restore_kernel")} == {
        "*fp32", "*bf16", "*fp16"}
    # Keys, row counts, the per-row arrays the callers slice and the restore's output (the
    # caller's tensor) never specialise: no variant depends on them.
    unspecialised = {
        "_stats_center_kernel": {"valid_ptr"},
        "_encode_kernel": {"index_ptr", "jitter_key", "perm_key"},
        "_decode_accumulate_encode_kernel": {"index_ptr", "jitter_key", "perm_key"},
        "_restore_kernel": {"mean_ptr", "index_ptr", "valid_ptr", "out_ptr"},
    }
    for v in seen:
        for name, _, spec in v[2]:
            if name == "n_rows" or name in unspecialised.get(v[0], ()):
                assert spec is None, (v[0], name, spec)


def _data(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randn(numel, generator=g) * torch.exp(torch.randn(1, generator=g))


def _view_at(offset: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` copied into a view at element ``offset`` of a larger tensor (a gradient inside a
    flat buffer): its address is 16-byte aligned only where ``offset`` is a multiple of 4."""
    buf = torch.zeros(offset + x.numel(), dtype=x.dtype)
    view = buf[offset:]
    view.copy_(x)
    return view


def test_calls_launch_only_warmed_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch of real DynamiQ collectives (3 ranks; all-reduce over the ring and the
    butterfly in dqcoll's and the paper's format, reduce-scatter, all-gather; odd sizes, tiles of
    a few rows, so chunks and tiles start at odd rows; inputs and outputs that are views at odd
    element offsets) is a variant the warm-up compiled: no call compiles a kernel mid-training."""
    warmed = set(_recorded_warm_up(monkeypatch))
    monkeypatch.setenv("DQCOLL_KERNELS", "triton")
    launches = _gpu_launches(monkeypatch, run=True)
    n = 3

    def body(comm: Any) -> None:
        rank = comm.rank
        for numel, offset, algorithm, tile, fmt in (
                (3 * 1280 + 7, 1, "ring", 3 * 1024, "dqcoll"),
                (5 * 256 * 3, 3, "butterfly", 5 * 1024, PAPER),  # statistics in Triton
                (7 * 256 + 5, 2, "ring", 0, PAPER)):
            x = _view_at(offset, _data(rank, numel))
            dqcoll.allreduce(x, algorithm=algorithm, seed=1, step=numel, tile_nbytes=tile,
                             format=fmt)
        shard = 5 * 256 + 3
        out = _view_at(1, torch.zeros(shard))
        dqcoll.reduce_scatter(_view_at(2, _data(rank, n * shard)), out, algorithm="ring", seed=2,
                              step=0, tile_nbytes=3 * 1024)
        gathered = _view_at(3, torch.zeros(n * 300))
        dqcoll.all_gather(_view_at(1, _data(rank, 300)), gathered, seed=3, step=0)

    run_local(n, body, timeout_s=600)
    assert launches
    kinds = {v[0] for v in launches}
    assert {"_stats_center_kernel", "_encode_kernel", "_decode_accumulate_encode_kernel",
            "_restore_kernel"} <= kinds, kinds
    unwarmed = sorted({v for v in launches if v not in warmed})
    assert not unwarmed, f"{len(unwarmed)} variants launched but not warmed, e.g. {unwarmed[0]}"


def test_warm_up_runs_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second warm-up of the same device launches nothing."""
    assert _recorded_warm_up(monkeypatch)
    monkeypatch.setattr(dynamiq_triton, "_warmed", {"cpu"})
    launches: list[Any] = []
    monkeypatch.setattr(dynamiq_triton, "_launch", lambda *a, **k: launches.append(a))
    dynamiq_triton.warm_up(torch.device("cpu"))
    assert not launches


def test_communicator_warm_up_reaches_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.warm_up`` (which the communicator calls at creation for CPU and CUDA devices)
    runs the Triton warm-up where the Triton kernels serve a CUDA device."""
    calls: list[torch.device] = []
    monkeypatch.setattr(kernels, "dynamiq_ops", lambda device: dynamiq_triton.OPS)
    monkeypatch.setattr(dynamiq_triton, "warm_up", calls.append)
    kernels.warm_up(torch.device("cuda"))
    assert calls == [torch.device("cuda")]
