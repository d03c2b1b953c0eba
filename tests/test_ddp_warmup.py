"""The DDP hook's warm-up iterations on real multi-process gloo groups: 16 bits on the wire, in
the 16-bit format (fp16 or bf16) that rounds the job's gradients closer.

The ranks are spawned as in tests/test_ddp_hook.py (its helpers); everything is checked in the
ranks and handed back through files, the assertions run in pytest.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_ddp_hook import _MLP, _batch, _grads, _spawn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dqcoll.integrations import torch_ddp
from dqcoll.integrations.step_choice import FP16_MAX, sixteen_bit_wire
from dqcoll.integrations.torch_ddp import DynamiqState, HookRuntime, dynamiq_hook

WARMUP = 3  # warm-up iterations of the trained model
STEPS = 6
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _comms(state: DynamiqState) -> list[Any]:
    return [c for c in (state.comm, *state.lane_comms) if c is not None]


def _exact_average(grads: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """Every rank's own gradients, all-reduced in fp64 and divided by the world size."""
    out = []
    for g in grads:
        total = g.double()
        dist.all_reduce(total)
        out.append(total / world_size)
    return out


def _identical_everywhere(tensors: list[torch.Tensor], world_size: int) -> bool:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


class _Recorder:
    """``dist.all_reduce`` of this process, recording (dtype, numel) of each call while on."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, int]] = []
        self.real = dist.all_reduce

    def __call__(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.on:
            self.calls.append((str(tensor.dtype).replace("torch.", ""), tensor.numel()))
        return self.real(tensor, *args, **kwargs)


def _training(rank: int, world_size: int) -> dict[str, Any]:
    """dynamiq at 5 bits with error feedback and the monitor on every compressed iteration, and
    WARMUP warm-up iterations; per iteration: the all-reduces torch.distributed ran during
    backward, the calls dqcoll ran, the gradients' agreement and error, what the state kept."""
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    reference = _MLP()  # the same weights without DDP: every rank's own gradients
    state = DynamiqState(scheme="dynamiq", bits=5, warmup_steps=WARMUP, error_feedback=True,
                         monitor_every=1)
    model.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    recorder = _Recorder()
    dist.all_reduce = recorder  # the hook calls torch.distributed.all_reduce
    steps = []
    try:
        for step in range(STEPS):
            seen = [len(c.metrics.records) for c in _comms(state)]
            x, y = _batch(rank, step)
            optimizer.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            recorder.calls, recorder.on = [], True
            nn.functional.mse_loss(model(x), y).backward()
            state.drain()
            recorder.on = False
            nn.functional.mse_loss(reference(x), y).backward()
            grads = _grads(model)
            exact = _exact_average(_grads(reference), world_size)
            error2 = sum(float((g.double() - e).square().sum())
                         for g, e in zip(grads, exact, strict=True))
            norm2 = sum(float(e.square().sum()) for e in exact)
            calls = [r for c, n in zip(_comms(state), seen, strict=True)
                     for r in c.metrics.records[n:]]
            steps.append({
                "torch_calls": list(recorder.calls),
                "bucket_numel": sum(state.bucket_numel.values()),
                "dqcoll_schemes": sorted({r.scheme for r in calls}),
                "dqcoll_wire_ratio": (sum(r.wire_bytes for r in calls)
                                      / max(1, sum(r.exact_wire_bytes for r in calls))),
                "sixteen_bit_values": {
                    name: all(torch.equal(g, g.to(dtype).float()) for g in grads)
                    for name, dtype in DTYPES.items()},
                "identical": _identical_everywhere(grads, world_size),
                "vnmse": error2 / norm2,
                "last_scheme": state.last_info.get("scheme"),
                "residuals": len(state.residuals),
                "iteration": state.iteration,
            })
            optimizer.step()
            with torch.no_grad():  # the reference follows the replicas' weights
                for p, q in zip(reference.parameters(), model.module.parameters(), strict=True):
                    p.copy_(q)
    finally:
        dist.all_reduce = recorder.real
    params = [p.detach() for p in model.parameters()]
    return {"steps": steps, "params_identical": _identical_everywhere(params, world_size),
            "formats": list(state.sixteen_bit.history),
            "bits_history": [i for i, _ in state.bits_history],
            "vnmse_history": [i for i, _ in state.vnmse_history],
            "allocation": sorted(state.allocation_u)}


def _torch_hook(state: DynamiqState,
                bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's fp16_compress_hook or bf16_compress_hook, whichever ``state`` (the other model's)
    sent its last bucket in (DDP refuses the bf16 one by name without CUDA and NCCL; gloo runs
    it)."""
    if state.last_info["scheme"] == "fp16":
        return default_hooks.fp16_compress_hook(None, bucket)  # type: ignore[arg-type]
    return default_hooks.bf16_compress_hook(None, bucket)  # type: ignore[arg-type]


_torch_hook.__annotations__.update({"bucket": dist.GradBucket,  # DDP checks the real types
                                    "return": torch.futures.Future[torch.Tensor]})


def _against_torch_hooks(rank: int, world_size: int, scale: float) -> dict[str, Any]:
    """Per warm-up step: the averaged gradients of DynamiqState() (the defaults) equal, bit for
    bit, those of torch's hook of the 16-bit format the state chose (same model, data and
    buckets; the loss scaled by ``scale``), and the format it chose."""
    state = DynamiqState(warmup_steps=WARMUP)
    ours = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    ours.register_comm_hook(state, dynamiq_hook)
    theirs = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    theirs.register_comm_hook(state, _torch_hook)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05 / scale) for m in (ours, theirs)]
    same, used = [], []
    for step in range(WARMUP):
        x, y = _batch(rank, step)
        grads = []
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            (scale * nn.functional.mse_loss(model(x), y)).backward()
            grads.append(_grads(model))
            if model is ours:
                used.append(state.last_info["scheme"])
            optimizer.step()
        same.append(all(torch.equal(a, b) for a, b in zip(*grads, strict=True)))
    return {"same": same, "used": used, "history": list(state.sixteen_bit.history)}


def _expected_format(rank: int, world_size: int, scale: float) -> str:
    """The format whose rounding of iteration 0's gradients (the loss scaled by ``scale``) has
    the smaller squared error summed over the ranks, computed here from torch's own casts."""
    model = _MLP()
    x, y = _batch(rank, 0)
    (scale * nn.functional.mse_loss(model(x), y)).backward()
    flat = torch.cat([g.reshape(-1) for g in _grads(model)])
    exact = flat.double() / world_size
    errors = torch.tensor([float((flat.to(d).div_(world_size).double() - exact).square().sum())
                           for d in DTYPES.values()], dtype=torch.float64)
    dist.all_reduce(errors)
    return "fp16" if errors[0] < errors[1] else "bf16"


def _job(rank: int, world_size: int) -> dict[str, Any]:
    return {"training": _training(rank, world_size),
            "torch_hooks": {scale: _against_torch_hooks(rank, world_size, scale)
                            for scale in (1.0, 1e-5)},
            "expected": {scale: _expected_format(rank, world_size, scale)
                         for scale in (1.0, 1e-5)}}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 3-rank gloo job (no power of two, several DDP buckets) for the tests below."""
    return _spawn(tmp_path_factory.mktemp("warmup3"), 3, _job)


def test_warmup_buckets_travel_in_16_bits(three_ranks: list[dict[str, Any]]) -> None:
    """In each warm-up iteration every bucket is all-reduced once by the process group as a
    16-bit tensor of the step's format (every coordinate once: half of fp32's bytes): fp16 in
    iteration 0, then the format the ranks agreed at iteration 1 (one all-reduce of two float64
    sums, the same format on every rank);
    dqcoll's lanes carry nothing, the averaged gradients are values of that format, the same on
    every rank and within its rounding of the exact average; no residual is kept."""
    formats = {tuple(r["training"]["formats"]) for r in three_ranks}
    assert len(formats) == 1, formats
    (history,) = formats
    assert [entry[0] for entry in history] == [1], history
    for rank, result in enumerate(r["training"] for r in three_ranks):
        for step, it in enumerate(result["steps"][:WARMUP]):
            where = (rank, step, it)
            name = "fp16" if step == 0 else history[0][1]
            torch_dtype = str(DTYPES[name]).replace("torch.", "")
            sixteen = [(d, n) for d, n in it["torch_calls"] if d != "float64"]
            agreements = [(d, n) for d, n in it["torch_calls"] if d == "float64"]
            assert agreements == ([("float64", 2)] if step == 1 else []), where
            assert {dtype for dtype, _ in sixteen} == {torch_dtype}, where
            assert sum(n for _, n in sixteen) == it["bucket_numel"] > 0, where
            assert it["dqcoll_schemes"] == [], where
            assert it["sixteen_bit_values"][name] and it["identical"], where
            assert 0 < it["vnmse"] < 1e-4, where
            assert it["last_scheme"] == name and it["residuals"] == 0, where
            assert it["iteration"] == step + 1, where
        # DDP's first iteration has one bucket, the next ones several
        assert len(result["steps"][1]["torch_calls"]) >= 2, result["steps"][1]


def test_the_scheme_takes_over_at_warmup_steps(three_ranks: list[dict[str, Any]]) -> None:
    """From iteration warmup_steps on, every bucket is dynamiq's through dqcoll (5 bits: under a
    third of fp32's bytes) and none goes through torch.distributed in bf16, with the residuals,
    monitor, bits and allocation recorded from that iteration only; the replicas' gradients
    and parameters stay bit-identical."""
    for rank, result in enumerate(r["training"] for r in three_ranks):
        for step, it in enumerate(result["steps"][WARMUP:], WARMUP):
            where = (rank, step, it)
            assert it["dqcoll_schemes"] == ["dynamiq"], where
            assert it["dqcoll_wire_ratio"] < 0.33, where
            assert not {"bfloat16", "float16"} & {dtype for dtype, _ in it["torch_calls"]}, where
            assert it["identical"] and it["residuals"] > 0, where
            assert it["last_scheme"] == "dynamiq", where
        assert result["bits_history"] == list(range(WARMUP, STEPS)), result["bits_history"]
        assert result["vnmse_history"] == list(range(WARMUP, STEPS)), result["vnmse_history"]
        assert len(result["allocation"]) >= 2
        assert result["params_identical"]


@pytest.mark.parametrize("scale", [1.0, 1e-5])
def test_warmup_is_torchs_hook_of_the_closer_format(three_ranks: list[dict[str, Any]],
                                                    scale: float) -> None:
    """DynamiqState()'s warm-up iterations give the gradients of torch's fp16_compress_hook or
    bf16_compress_hook bit for bit, on every rank: fp16 in iteration 0, from iteration 1 the
    format whose rounding of iteration 0's gradients has the smaller error summed over the
    ranks (computed in the test from torch's casts). Gradients of ordinary size take fp16;
    gradients 1e5 times smaller, in fp16's subnormal range, take bf16."""
    expected = {r["expected"][scale] for r in three_ranks}
    assert expected == {"fp16" if scale == 1.0 else "bf16"}, expected
    (name,) = expected
    for rank, result in enumerate(r["torch_hooks"][scale] for r in three_ranks):
        assert result["same"] == [True] * WARMUP, (rank, result)
        assert result["used"] == ["fp16"] + [name] * (WARMUP - 1), (rank, result)
        assert [(i, n) for i, n, *_ in result["history"]] == [(1, name)], result


def test_sixteen_bit_wire_saturates_fp16_only_beyond_its_range() -> None:
    """In range, the wire is torch's hooks' ``buf.to(dtype).div_(n)`` bit for bit; finite values
    beyond fp16's range saturate so that the sum of n saturated terms stays finite, while
    infinite and NaN inputs stay infinite and NaN (bf16 needs no saturation)."""
    n = 3
    buf = torch.tensor([1.5, -2e-3, 7e4, -1e9, float("inf"), float("nan"), 65504.0])
    for dtype in DTYPES.values():
        inside = buf[:2]
        assert torch.equal(sixteen_bit_wire(inside, n, dtype), inside.to(dtype).div_(n))
    wire = sixteen_bit_wire(buf, n, torch.float16)
    assert torch.equal(wire[:2], buf[:2].half().div_(n))
    assert torch.isfinite(wire[2:4]).all() and bool((wire[2] > 0) & (wire[3] < 0))
    assert torch.isfinite(wire[2:4] * n).all()  # n saturated terms sum below fp16's maximum
    assert float(wire[2]) * n <= FP16_MAX
    assert torch.isposinf(wire[4]) and torch.isnan(wire[5])
    assert torch.equal(wire[6:], buf[6:].half().div_(n))
    bf16 = sixteen_bit_wire(buf, n, torch.bfloat16)
    assert torch.equal(bf16[:5], buf[:5].bfloat16().div_(n))


def test_warmup_path_by_bucket() -> None:
    """Which buckets a warm-up averages how: fp32 buckets (CPU or CUDA) in 16 bits; fp16 and bf16
    buckets, scheme="none" and every bucket after a shrink with the exact average."""
    state = DynamiqState(scheme="dynamiq", runtime=HookRuntime(device="cpu"))
    cpu32 = torch.zeros(4)
    cuda32 = types.SimpleNamespace(dtype=torch.float32, is_cuda=True)  # no GPU here
    assert torch_ddp._warmup_path(state, cpu32) == "16-bit"
    assert torch_ddp._warmup_path(state, cuda32) == "16-bit"  # type: ignore[arg-type]
    for dtype in (torch.float16, torch.bfloat16):
        assert torch_ddp._warmup_path(state, cpu32.to(dtype)) == "exact"
    assert torch_ddp._warmup_path(DynamiqState(scheme="none"), cpu32) == "exact"
    state.shrunk = True
    assert torch_ddp._warmup_path(state, cpu32) == "exact"


def test_warmup_steps_counts_iterations() -> None:
    """should_compress: iterations 0 .. warmup_steps - 1 are warm-up, warmup_steps on are the
    scheme's; scheme="none" never compresses."""
    state = DynamiqState(scheme="dynamiq", warmup_steps=WARMUP,
                         runtime=HookRuntime(device="cpu"))
    assert [state.should_compress(i) for i in range(WARMUP + 2)] == \
        [False] * WARMUP + [True, True]
    assert not DynamiqState(scheme="none", warmup_steps=0).should_compress(5)
