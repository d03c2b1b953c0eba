"""Warm-up of the Triton kernels (issue 15 item 3): every variant a call can launch on a CUDA
device is compiled when the communicator is created. Checked without a GPU: the launchers run
(their argument checks included) with the launch itself recorded instead of compiled, as on CUDA
(launch configurations of a GPU, compiled kernel module)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from dqcoll import kernels
from dqcoll.kernels import _dynamiq_kernels, dynamiq_triton


def _variant(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any]) -> tuple[Any, ...]:
    """What Triton compiles a variant for: constexprs, pointer dtypes and 16-byte alignment,
    integers' divisibility by 16 and equality to 1 (except ``do_not_specialize`` ones)."""
    names = kernel.arg_names
    skip = {names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    spec = []
    for name, value in zip([n for n in names if n not in constexprs], args, strict=True):
        if isinstance(value, torch.Tensor):
            spec.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and name not in skip:
            spec.append((name, value % 16 == 0, value == 1))
    return (kernel.__name__, tuple(sorted(constexprs.items())), tuple(spec))


def _recorded_warm_up(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    launches: list[tuple[Any, ...]] = []

    def record(kernel: Any, cfg: Any, n_rows: int, interpreted: bool, *args: Any,
               **constexprs: Any) -> None:
        assert not interpreted
        launches.append(_variant(kernel, args, {"ROWS": cfg.rows_per_program, **constexprs}))

    monkeypatch.setattr(dynamiq_triton, "_launch", record)
    monkeypatch.setattr(dynamiq_triton, "_kernels_for", lambda device: (_dynamiq_kernels, False))
    monkeypatch.setattr(dynamiq_triton, "_warmed", set())
    dynamiq_triton.warm_up(torch.device("cpu"))
    return launches


def test_warm_up_launches_every_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    launches = _recorded_warm_up(monkeypatch)
    seen = set(launches)

    def variants(name: str) -> list[tuple[Any, ...]]:
        return [v for v in seen if v[0] == name]

    def consts(v: tuple[Any, ...]) -> dict[str, Any]:
        return dict(v[1])

    def aligned(v: tuple[Any, ...], arg: str) -> bool:
        return bool(next(s[2] for s in v[2] if s[0] == arg))

    def dtype(v: tuple[Any, ...], arg: str) -> str:
        return str(next(s[1] for s in v[2] if s[0] == arg))

    # Every (width, scale encoding) the kernels declare (dynamiq_triton.FORMATS).
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
    assert {(w, s, c, "torch.float32", a) for (w, s), c, a in itertools.product(
        formats, (False, True), (False, True))} <= got
    assert {(w, s, c, d) for w, s, c, d, _ in got} == {(w, s, c, d) for (w, s), c, d in
                                                       itertools.product(
        formats, (False, True), ("torch.float32", "torch.bfloat16", "torch.float16"))}
    for name in ("_decode_kernel", "_decode_accumulate_kernel"):
        got = {(consts(v)["WIDTH"], consts(v)["SCALES"], aligned(v, "rec_ptr"))
               for v in variants(name)}
        assert got == {(w, s, a) for (w, s), a in itertools.product(formats, (False, True))}, name
    for name, arg in (("_stats_center_kernel", "x_ptr"), ("_restore_kernel", "out_ptr")):
        dtypes = {dtype(v, arg) for v in variants(name)}
        assert dtypes == {"torch.float32", "torch.bfloat16", "torch.float16"}, name
    # Keys and row counts never specialise: the variants do not depend on them.
    assert not any(s[0] in ("n_rows", "jitter_key", "perm_key") for v in seen for s in v[2])


def test_warm_up_runs_once_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _recorded_warm_up(monkeypatch)
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
