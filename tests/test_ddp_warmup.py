"""The DDP hook's warm-up iterations on real multi-process gloo groups: 16 bits on the wire.

The ranks are spawned as in tests/test_ddp_hook.py (its helpers); everything is checked in the
ranks and handed back through files, the assertions run in pytest.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_ddp_hook import _MLP, _batch, _grads, _paired_steps, _spawn
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dqcoll.integrations import torch_ddp
from dqcoll.integrations.torch_ddp import DynamiqState, HookRuntime, dynamiq_hook

WARMUP = 3  # warm-up iterations of the trained model
STEPS = 6


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
                "bf16_values": all(torch.equal(g, g.bfloat16().float()) for g in grads),
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
            "bits_history": [i for i, _ in state.bits_history],
            "vnmse_history": [i for i, _ in state.vnmse_history],
            "allocation": sorted(state.allocation_u)}


def _torch_bf16_hook(process_group: dist.ProcessGroup | None,
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's bf16_compress_hook (DDP refuses it by name without CUDA and NCCL; gloo runs it)."""
    return default_hooks.bf16_compress_hook(process_group, bucket)  # type: ignore[arg-type]


_torch_bf16_hook.__annotations__.update({"bucket": dist.GradBucket,  # DDP checks the real types
                                         "return": torch.futures.Future[torch.Tensor]})


def _against_torch_bf16_hook(rank: int, world_size: int) -> list[bool]:
    """Per warm-up step: the averaged gradients of DynamiqState() (the defaults) equal those of
    torch's bf16_compress_hook, bit for bit (same model, data and buckets)."""
    ours = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    ours.register_comm_hook(DynamiqState(warmup_steps=WARMUP), dynamiq_hook)
    theirs = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    theirs.register_comm_hook(None, _torch_bf16_hook)
    return _paired_steps(rank, (ours, theirs), WARMUP)


def _job(rank: int, world_size: int) -> dict[str, Any]:
    return {"training": _training(rank, world_size),
            "torch_bf16": _against_torch_bf16_hook(rank, world_size)}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 3-rank gloo job (no power of two, several DDP buckets) for the tests below."""
    return _spawn(tmp_path_factory.mktemp("warmup3"), 3, _job)


def test_warmup_buckets_travel_as_bf16(three_ranks: list[dict[str, Any]]) -> None:
    """In each warm-up iteration every bucket is all-reduced once by the process group as a bf16
    tensor (every coordinate once: half of fp32's bytes), dqcoll's lanes carry nothing, the
    averaged gradients are bf16 values, the same on every rank and within bf16's rounding of
    the exact average; state.last_info says bf16 and no residual is kept."""
    for rank, result in enumerate(r["training"] for r in three_ranks):
        for step, it in enumerate(result["steps"][:WARMUP]):
            where = (rank, step, it)
            assert {dtype for dtype, _ in it["torch_calls"]} == {"bfloat16"}, where
            assert sum(n for _, n in it["torch_calls"]) == it["bucket_numel"] > 0, where
            assert it["dqcoll_schemes"] == [], where
            assert it["bf16_values"] and it["identical"], where
            assert 0 < it["vnmse"] < 1e-4, where
            assert it["last_scheme"] == "bf16" and it["residuals"] == 0, where
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
            assert "bfloat16" not in {dtype for dtype, _ in it["torch_calls"]}, where
            assert it["identical"] and it["residuals"] > 0, where
            assert it["last_scheme"] == "dynamiq", where
        assert result["bits_history"] == list(range(WARMUP, STEPS)), result["bits_history"]
        assert result["vnmse_history"] == list(range(WARMUP, STEPS)), result["vnmse_history"]
        assert len(result["allocation"]) >= 2
        assert result["params_identical"]


def test_warmup_is_torchs_bf16_hook(three_ranks: list[dict[str, Any]]) -> None:
    """DynamiqState()'s warm-up iterations give the gradients of torch's bf16_compress_hook bit
    for bit, on every rank (the fp16 hook's collective, in bf16: the same wire bytes)."""
    for rank, same in enumerate(r["torch_bf16"] for r in three_ranks):
        assert same == [True] * WARMUP, (rank, same)


def test_warmup_path_by_bucket() -> None:
    """Which buckets a warm-up averages how: fp32 buckets (CPU or CUDA) in bf16; fp16 and bf16
    buckets, scheme="none" and every bucket after a shrink with the exact average."""
    state = DynamiqState(scheme="dynamiq", runtime=HookRuntime(device="cpu"))
    cpu32 = torch.zeros(4)
    cuda32 = types.SimpleNamespace(dtype=torch.float32, is_cuda=True)  # no GPU here
    assert torch_ddp._warmup_path(state, cpu32) == "bf16"
    assert torch_ddp._warmup_path(state, cuda32) == "bf16"  # type: ignore[arg-type]
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
