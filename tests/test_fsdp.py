"""FSDP2 with dqcoll's collectives, and the drop-in ``dqcoll`` backend, on real gloo groups.

Each multi-process test spawns its 2 ranks once (a FileStore rendezvous in the test's tmp_path),
runs everything it checks inside them and hands the results back through files; the assertions
run in pytest. The policy tests run in the pytest process.
"""

from __future__ import annotations

import datetime
import math
import os
import pathlib
import sys
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import dqcoll
from dqcoll import metrics
from dqcoll.errors import InvalidArgumentError
from dqcoll.integrations import fsdp as dqfsdp
from dqcoll.integrations.policy import CompressionPolicy, Role, RoleRule

WORLD = 2


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, backend: str,
            body: Callable[[int, int], Any]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("DQCOLL_TIMEOUT_S", "120")
    if backend == "dqcoll":
        import dqcoll.integrations.torch_backend as torch_backend

        torch_backend.set_policy(CompressionPolicy(min_nbytes=4096))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = body(rank, world_size)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # leave without the interpreter's teardown (gloo's C++ teardown occasionally aborts a
    # finished process; see tests/test_ddp_hook.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(tmp_path: pathlib.Path, body: Callable[[int, int], Any],
           backend: str = "gloo") -> list[Any]:
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "store"), str(tmp_path), backend, body),
             nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


class _Net(nn.Module):
    """Odd sizes: FSDP2 pads every shard (301 rows over 2 ranks, 37 columns...)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(37, 301), nn.GELU()),
                                     nn.Sequential(nn.Linear(301, 129), nn.GELU())])
        self.head = nn.Linear(129, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sharded(policy: CompressionPolicy | None,
             mixed: MixedPrecisionPolicy | None = None) -> tuple[nn.Module, Any]:
    model = _Net()
    kwargs = {"mp_policy": mixed} if mixed is not None else {}
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    state = dqfsdp.compress(model, policy) if policy is not None else None
    return model, state


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 37, generator=g), torch.randn(8, 5, generator=g)


def _train(model: nn.Module, rank: int, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = nn.functional.mse_loss(model(x).float(), y)  # bf16 outputs: a float loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _crc(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().clone().view(torch.uint8).numpy().tobytes(), crc)
    return crc


def _unsharded_crc(model: nn.Module) -> int:
    """CRC of the weights this rank computes with (FSDP2's all-gather output, unsharded)."""
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in modules:
        m.unshard()
    crc = _crc([p for p in model.parameters()])
    for m in modules:
        m.reshard()
    return crc


# -- FSDP2 classes -----------------------------------------------------------------------------


def _fsdp_job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # FSDP2's own collectives, the exact policy, and dqcoll's defaults (every call compressed)
    own, _ = _sharded(None)
    exact, exact_state = _sharded(CompressionPolicy.exact())
    warm, warm_state = _sharded(CompressionPolicy(min_nbytes=0, warmup_steps=3))
    quant, state = _sharded(CompressionPolicy(min_nbytes=0))
    out["losses"] = {name: _train(m, rank) for name, m in
                     (("own", own), ("exact", exact), ("warm", warm), ("quant", quant))}
    out["params"] = {name: [p.full_tensor().detach() for p in m.parameters()]
                     for name, m in (("own", own), ("exact", exact), ("warm", warm),
                                     ("quant", quant))}
    out["unsharded_crc"] = _unsharded_crc(quant)
    # bf16 compute and bf16 gradient reduction (FSDP2's mixed precision)
    half, half_state = _sharded(CompressionPolicy(min_nbytes=0), MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    out["bf16_losses"] = _train(half, rank)
    out["bf16_crc"] = _unsharded_crc(half)
    out["bf16_summary"] = half_state.summary()
    half_state.close()
    out["summary"] = state.summary()
    out["exact_summary"] = exact_state.summary()
    out["warm_summary"] = warm_state.summary()
    x, _ = _batch(0, 99)
    with torch.no_grad():
        out["output_crc"] = _crc([quant(x)])

    # the reduce-scatter's ops on one buffer: AVG, SUM, PREMUL_SUM(1/n), gloo's exact SUM
    g = torch.Generator().manual_seed(7 + rank)
    grads = torch.randn(world_size * 5003, generator=g)  # 5003: no multiple of 256
    group = dist.group.WORLD
    results = {}
    for name, op in (("avg", dist.ReduceOp.AVG), ("sum", dist.ReduceOp.SUM),
                     ("premul", dist._make_nccl_premul_sum(1.0 / world_size))):
        rs = dqfsdp.ReduceScatter(dqfsdp.FsdpCompression(CompressionPolicy(min_nbytes=0)))
        shard = torch.empty(5003)
        rs(shard, grads.clone(), group, op)  # each its own lane: same seed, same call number
        results[name] = shard
        rs.state.close()
    exact_sum = torch.empty(5003)
    dqfsdp.exact_reduce_scatter(exact_sum, grads.clone(), op=dist.ReduceOp.SUM)
    results["exact_sum"] = exact_sum
    out["ops"] = results

    # all-gather of bf16 shards (FSDP2's mixed precision) with an async Work
    ag = dqfsdp.AllGather(dqfsdp.FsdpCompression(CompressionPolicy(min_nbytes=0)))
    shard = torch.randn(3001, generator=g).to(torch.bfloat16)
    gathered = torch.full((world_size * 3001,), float("nan"), dtype=torch.bfloat16)
    work = ag(gathered, shard, group, async_op=True)
    out["ag_work"] = isinstance(work, dist.Work)
    work.wait()
    out["ag_shard"], out["ag_out"] = shard, gathered
    ag.state.close()
    for s in (exact_state, warm_state, state):
        s.close()
    return out


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("fsdp"), _fsdp_job)


def test_exact_policy_equals_fsdp2_own_collectives(fsdp_job: list[dict[str, Any]]) -> None:
    """Every role exact, and dqcoll during its warm-up steps: the losses and the trained
    parameters are bit for bit those of FSDP2 with its own collectives."""
    for result in fsdp_job:
        assert result["losses"]["exact"] == result["losses"]["own"]
        assert result["losses"]["warm"] == result["losses"]["own"]
        for name in ("exact", "warm"):
            for a, b in zip(result["params"]["own"], result["params"][name], strict=True):
                assert torch.equal(a, b), name
        assert result["exact_summary"]["compressed"]["weights"]["calls"] == 0
        assert result["exact_summary"]["exact_calls"]["gradients"] == 9  # 3 modules x 3 steps
        assert result["warm_summary"]["compressed"]["gradients"]["calls"] == 0


def test_compressed_replicas_bit_identical(fsdp_job: list[dict[str, Any]]) -> None:
    """With every call compressed, all ranks compute with the same unsharded weights (the
    all-gather decodes every shard from the same bytes) and give bit-identical outputs; the
    training stays close to exact FSDP2."""
    assert fsdp_job[0]["unsharded_crc"] == fsdp_job[1]["unsharded_crc"]
    assert fsdp_job[0]["output_crc"] == fsdp_job[1]["output_crc"]
    for result in fsdp_job:
        summary = result["summary"]["compressed"]
        assert summary["weights"]["calls"] >= 6 and summary["gradients"]["calls"] == 9
        own, quant = result["losses"]["own"], result["losses"]["quant"]
        assert own[0] != quant[0] or own[1:] != quant[1:]  # lossy: not the same numbers
        for a, b in zip(own, quant, strict=True):
            assert abs(a - b) < 0.05 * abs(a), (own, quant)
        # AdamW normalises each coordinate's step: small gradients' errors flip a few signs
        err = metrics.vnmse(result["params"]["quant"], result["params"]["own"])
        assert err < 0.02, err


def test_bf16_mixed_precision(fsdp_job: list[dict[str, Any]]) -> None:
    """bf16 parameters and bf16 gradient reduction: both roles compressed (dqcoll takes bf16),
    replicas bit-identical, losses close to fp32 FSDP2's."""
    assert fsdp_job[0]["bf16_crc"] == fsdp_job[1]["bf16_crc"]
    for result in fsdp_job:
        summary = result["bf16_summary"]["compressed"]
        assert summary["weights"]["calls"] >= 6 and summary["gradients"]["calls"] == 9
        for a, b in zip(result["losses"]["own"], result["bf16_losses"], strict=True):
            assert abs(a - b) < 0.05 * abs(a)


def test_compressed_bytes_fewer(fsdp_job: list[dict[str, Any]]) -> None:
    """Counters: int8 blocks for weights ~3.9x fewer bytes than fp32, dynamiq at 5 bits more
    than 3x fewer (small buffers pay their statistics and headers)."""
    for result in fsdp_job:
        for role in ("weights", "gradients"):
            counters = result["summary"]["compressed"][role]
            assert 0 < 3 * counters["wire_bytes"] < counters["exact_bytes"], (role, counters)


def test_reduce_ops(fsdp_job: list[dict[str, Any]]) -> None:
    """AVG, SUM and PREMUL_SUM(1/n) of the same buffer: AVG and PREMUL_SUM(1/n) agree bit for
    bit (both code x/n with the same random numbers), SUM/n is AVG within quantization error,
    and SUM is gloo's exact sum within the error of 5-bit dynamiq."""
    for result in fsdp_job:
        ops = result["ops"]
        assert torch.equal(ops["avg"], ops["premul"])
        assert metrics.vnmse(ops["sum"] / WORLD, ops["avg"]) < 0.02
        assert metrics.vnmse(ops["sum"], ops["exact_sum"]) < 0.02
        assert not torch.equal(ops["sum"], ops["exact_sum"])


def test_all_gather_bf16_async(fsdp_job: list[dict[str, Any]]) -> None:
    """The all-gather returns a Work (async_op=True), fills every element (NaN-poisoned output),
    puts each rank's shard at its place within int8 error and is the same on every rank."""
    outs = [r["ag_out"] for r in fsdp_job]
    assert torch.equal(outs[0], outs[1])
    for rank, result in enumerate(fsdp_job):
        assert result["ag_work"]
        out = result["ag_out"].float().view(WORLD, -1)
        assert not torch.isnan(out).any()
        assert metrics.vnmse(out[rank], result["ag_shard"].float()) < 1e-3


# -- a mismatch on one rank --------------------------------------------------------------------


def _mismatch_job(rank: int, world_size: int) -> dict[str, Any]:
    rs = dqfsdp.ReduceScatter(dqfsdp.FsdpCompression(CompressionPolicy(min_nbytes=0),
                                                     timeout_s=60))
    numel = 4000 + 8 * rank  # rank 1 passes a longer buffer
    try:
        rs(torch.empty(numel), torch.randn(world_size * numel), dist.group.WORLD,
           dist.ReduceOp.AVG)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


def test_mismatch_on_one_rank_raises_on_all(tmp_path: pathlib.Path) -> None:
    """Ranks that pass different sizes to a compressed reduce-scatter all raise, naming the
    disagreement, instead of hanging."""
    results = _spawn(tmp_path, _mismatch_job)
    for result in results:
        assert result["error"] == "MismatchError", result
        assert "numel" in result["message"] and "rank" in result["message"], result


# -- the lane's one-collective block all-gather ----------------------------------------------


def _gather_blocks_job(rank: int, world_size: int) -> dict[str, Any]:
    from dqcoll import api
    from dqcoll.integrations.lane import Lane, _plain_block_codec

    lane = Lane(dist.distributed_c10d._get_default_store(), rank, world_size,
                policy=CompressionPolicy(), timeout_s=60, name="test")
    same: dict[str, bool] = {}
    for scheme in ("int8_block", "int4_block", "bf16"):
        rule = RoleRule(scheme)
        codec = _plain_block_codec(rule)
        assert codec is not None, scheme
        for numel in (4096, 3001, 1):
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(31 * rank + numel)
                shard = (torch.randn(numel, generator=g) * 3).to(dtype)
                fast = torch.full((world_size * numel,), float("nan"), dtype=dtype)
                lane._gather_blocks(shard, fast, codec)
                generic = torch.full_like(fast, float("nan"))
                api.all_gather(shard, generic, comm=lane.comm, **rule.options())
                key = f"{scheme} {numel} {dtype}"
                same[key] = bool(torch.equal(fast.view(torch.uint8), generic.view(torch.uint8)))
    assert _plain_block_codec(RoleRule("dynamiq", 5.0)) is None  # shared statistics: generic
    for scheme in ("int8_block", "int4_block"):
        rule = RoleRule(scheme)
        codec = _plain_block_codec(rule)
        assert codec is not None
        for numel in (4096, 3001):
            for dtype in (torch.float32, torch.bfloat16):
                for avg in (True, False):
                    g = torch.Generator().manual_seed(17 * rank + numel)
                    inp = (torch.randn(world_size * numel, generator=g) * 3).to(dtype)
                    fast = torch.full((numel,), float("nan"), dtype=dtype)
                    lane._scatter_blocks(inp.clone(), fast, codec, avg)
                    generic = torch.full_like(fast, float("nan"))
                    api.reduce_scatter(inp.clone(), generic, comm=lane.comm, algorithm="direct",
                                       op="avg" if avg else "sum", **rule.options())
                    key = f"rs {scheme} {numel} {dtype} {avg}"
                    same[key] = bool(torch.equal(fast.view(torch.uint8),
                                                 generic.view(torch.uint8)))
    out: dict[str, Any] = {"same": same, "sent": lane.transport.counters["payload_bytes_sent"]}
    numel = 4096 + 128 * rank  # rank 1 passes a longer shard
    try:
        lane._gather_blocks(torch.randn(numel), torch.empty(world_size * numel),
                            _plain_block_codec(RoleRule("int8_block")))  # type: ignore[arg-type]
        out["mismatch"] = None
    except Exception as exc:
        out["mismatch"] = (type(exc).__name__, str(exc))
    try:
        lane._scatter_blocks(torch.randn(world_size * numel), torch.empty(numel),
                             _plain_block_codec(RoleRule("int4_block")),  # type: ignore[arg-type]
                             avg=True)
        out["rs_mismatch"] = None
    except Exception as exc:
        out["rs_mismatch"] = (type(exc).__name__, str(exc))
    lane.close()
    return out


def test_lane_block_collectives_equal_dqcoll_collectives(tmp_path: pathlib.Path) -> None:
    """The lane's all-gather of a block codec (one gloo all-gather of payloads) gives the bytes
    of ``dqcoll.all_gather`` with the same scheme, and its reduce-scatter (one gloo all-to-all)
    those of ``dqcoll.reduce_scatter(algorithm="direct")``, for whole and partial blocks, fp32
    and bf16, sum and average; ranks whose sizes differ all raise MismatchError naming the
    field."""
    results = _spawn(tmp_path, _gather_blocks_job)
    for result in results:
        assert len(result["same"]) == 18 + 16 and all(result["same"].values()), result["same"]
        assert result["sent"] > 0
        for key in ("mismatch", "rs_mismatch"):
            name, message = result[key]
            assert name == "MismatchError" and "numel" in message, result[key]


# -- the drop-in backend -----------------------------------------------------------------------


def _backend_job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": dist.get_backend()}
    pg = dist.group.WORLD
    # DDP without a hook: its buckets go through the compressed all-reduce
    ddp = nn.parallel.DistributedDataParallel(_Net(), bucket_cap_mb=0.05)
    out["ddp_losses"] = _train(ddp, rank)
    out["ddp_crc"] = _crc(list(ddp.parameters()))
    after_ddp = pg.summary()
    out["after_ddp"] = after_ddp
    # small, integer and MAX all-reduces, broadcast, object collectives: exact
    loss = torch.tensor([1.5 + rank])
    dist.all_reduce(loss)
    big_int = torch.arange(100_000, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(big_int)
    big_max = torch.full((100_000,), float(rank))
    dist.all_reduce(big_max, op=dist.ReduceOp.MAX)
    b = torch.full((10,), float(rank))
    dist.broadcast(b, src=1)
    objects: list[Any] = [None] * world_size
    dist.all_gather_object(objects, {"rank": rank})
    dist.barrier()
    out["exact"] = {"loss": loss, "int": bool(torch.equal(big_int, torch.arange(100_000) * 3)),
                    "max": bool((big_max == 1.0).all()), "bcast": bool((b == 1.0).all()),
                    "objects": objects}
    out["after_exact"] = pg.summary()
    # FSDP2 without custom classes
    model = _Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    out["fsdp_losses"] = _train(model, rank)
    out["fsdp_crc"] = _unsharded_crc(model)
    out["after_fsdp"] = pg.summary()
    return out


def test_backend_trains_ddp_and_fsdp2(tmp_path: pathlib.Path) -> None:
    """init_process_group("dqcoll"): DDP without a hook and FSDP2 without custom classes train;
    DDP's bucket all-reduces and FSDP2's all-gathers and reduce-scatters are compressed (the
    counters show them, with more than 3x fewer bytes) and the replicas are bit-identical; a
    1-element loss all-reduce, integer and MAX all-reduces, broadcast and object collectives
    are exact."""
    results = _spawn(tmp_path, _backend_job, backend="dqcoll")
    assert results[0]["ddp_crc"] == results[1]["ddp_crc"]
    assert results[0]["fsdp_crc"] == results[1]["fsdp_crc"]
    for result in results:
        assert result["backend"] == "dqcoll"
        ddp = result["after_ddp"]["compressed"]["allreduce"]
        assert ddp["calls"] >= 3 and 0 < 3 * ddp["wire_bytes"] < ddp["exact_bytes"], ddp
        exact = result["exact"]
        assert torch.equal(exact["loss"], torch.tensor([4.0]))
        assert exact["int"] and exact["max"] and exact["bcast"]
        assert exact["objects"] == [{"rank": 0}, {"rank": 1}]
        # the exact calls above did not touch the compressed counters
        assert result["after_exact"]["compressed"]["allreduce"] == ddp
        assert result["after_exact"]["exact_calls"]["allreduce"] >= 3
        fsdp = result["after_fsdp"]["compressed"]
        assert fsdp["weights"]["calls"] >= 6 and fsdp["gradients"]["calls"] >= 6  # head: small
        ddp_losses, fsdp_losses = result["ddp_losses"], result["fsdp_losses"]
        # same initial model and batches: close (FSDP2 computes with int8-coded weights)
        for a, b in zip(ddp_losses, fsdp_losses, strict=True):
            assert math.isfinite(b) and abs(a - b) < 0.05 * abs(a), (ddp_losses, fsdp_losses)


# -- the policy --------------------------------------------------------------------------------


def test_policy_parse_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_POLICY sets any field; the text form round-trips; bad text raises naming it."""
    text = ("weights=none,gradients=dynamiq:4,allreduce=int8_block,min_nbytes=1024,"
            "warmup_steps=5,intra_node=flat,seed=3")
    monkeypatch.setenv("DQCOLL_POLICY", text)
    policy = CompressionPolicy.from_env()
    assert policy.weights.is_exact and policy.gradients == RoleRule("dynamiq", 4.0)
    assert policy.allreduce == RoleRule("int8_block") and policy.min_nbytes == 1024
    assert policy.warmup_steps == 5 and policy.intra_node == "flat" and policy.seed == 3
    assert CompressionPolicy.parse(str(policy)) == policy
    monkeypatch.delenv("DQCOLL_POLICY")
    assert CompressionPolicy.from_env() == CompressionPolicy()
    zeropp = CompressionPolicy.zeropp(warmup_steps=2)
    assert zeropp == CompressionPolicy.parse("weights=int8_block,gradients=int4_block,"
                                             "warmup_steps=2")
    for bad, words in (("weights=nosuch", "nosuch"), ("speed=3", "speed"),
                       ("int8_block", "key=value"), ("min_nbytes=x", "min_nbytes"),
                       ("weights=int8_block:4", "bits"), ("intra_node=ring", "intra_node")):
        with pytest.raises(InvalidArgumentError, match=words):
            CompressionPolicy.parse(bad)


def test_policy_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    """What is exact: role none, small tensors, integers, other ops, warm-up steps; and the
    nodes of the two-level path."""
    policy = CompressionPolicy(min_nbytes=1024, warmup_steps=2)
    big, small = torch.zeros(256), torch.zeros(255)
    assert policy.decide(Role.GRADIENTS, big, step=2).compress
    assert not policy.decide(Role.GRADIENTS, small, step=2).compress
    assert not policy.decide(Role.GRADIENTS, big, step=1).compress
    assert not policy.decide(Role.GRADIENTS, big, reducing_op_ok=False, step=2).compress
    assert not policy.decide(Role.ALLREDUCE, torch.zeros(1024, dtype=torch.int64),
                             step=2).compress
    assert not CompressionPolicy.exact().decide(Role.WEIGHTS, big).compress
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's: the planner finds the hosts
    assert policy.nodes(8) == 0
    assert CompressionPolicy(local_world_size=2).nodes(8) == 2
    assert CompressionPolicy(local_world_size=2).nodes(2) == 0
    assert CompressionPolicy(local_world_size=2).nodes(5) == 0
    assert CompressionPolicy(intra_node="flat", local_world_size=4).nodes(8) == 0
    assert CompressionPolicy(local_world_size=4).nodes(8) == 4


# -- two levels: exact inside a node, compressed across nodes ------------------------------------


def _two_level_job(rank: int, world_size: int) -> dict[str, Any]:
    from dqcoll.integrations.lane import Lane

    store = dist.distributed_c10d._get_default_store()
    out: dict[str, Any] = {}
    for name, rule in (("none", RoleRule("none")), ("dynamiq", RoleRule("dynamiq", 5.0))):
        policy = CompressionPolicy(weights=RoleRule("none") if name == "none" else
                                   RoleRule("int8_block"), gradients=rule, allreduce=rule,
                                   min_nbytes=0, local_world_size=2)
        lane = Lane(store, rank, world_size, policy=policy, timeout_s=60, name=name,
                    prefix=f"two-level-{name}/")
        g = torch.Generator().manual_seed(rank)
        numel = 1001  # per shard: no multiple of anything
        # integers: every order of summation gives the same floats
        grads = torch.randint(-50, 50, (world_size * numel,), generator=g).float()
        shard = torch.full((numel,), float("nan"))
        lane.reduce_scatter(grads, shard, avg=False, rule=policy.gradients).wait()
        mine = torch.arange(numel, dtype=torch.float32) + 10_000 * rank
        gathered = torch.full((world_size * numel,), float("nan"))
        lane.all_gather(mine, gathered, rule=policy.weights).wait()
        summed = grads.clone()
        lane.allreduce(summed, avg=True, rule=policy.allreduce).wait()
        # the same calls straight through dqcoll's collectives, with the lane's plans, seed and
        # the steps the lane's calls took (its communicator's call counter: 0, 1, 2)
        direct_rs = torch.full((numel,), float("nan"))
        dqcoll.reduce_scatter(grads.clone(), direct_rs, op="sum", comm=lane.comm,
                              seed=policy.seed, step=0,
                              algorithm=lane.two_level_plan(policy.gradients))
        direct_ag = torch.full((world_size * numel,), float("nan"))
        dqcoll.all_gather(mine.clone(), direct_ag, comm=lane.comm, seed=policy.seed, step=1,
                          algorithm=lane.two_level_plan(policy.weights))
        direct_ar = grads.clone()
        dqcoll.allreduce(direct_ar, op="avg", comm=lane.comm, seed=policy.seed, step=2,
                         algorithm=lane.two_level_plan(policy.allreduce))
        exact_rs = torch.empty(numel)
        dqfsdp.exact_reduce_scatter(exact_rs, grads.clone())
        exact_ar = grads.clone()
        dist.all_reduce(exact_ar)
        out[name] = {"rs": shard, "exact_rs": exact_rs, "ag": gathered, "ar": summed,
                     "exact_ar": exact_ar / world_size, "levels": lane.local_world_size,
                     "direct": (direct_rs, direct_ag, direct_ar)}
        lane.close()
    return out


def test_two_levels(tmp_path: pathlib.Path) -> None:
    """With 2 nodes of 2 ranks, reduce-scatter, all-gather and all-reduce run exact inside a
    node and with the role's scheme across nodes: with scheme none they equal gloo's exact
    collectives bit for bit (integer inputs), shards land at their rank; with dynamiq they are
    close and every rank holds the same all-reduce and all-gather. Each lane call's result is
    bit for bit that of dqcoll's collective run directly with the lane's plan, seed and step."""
    mp.spawn(_worker, args=(4, str(tmp_path / "store"), str(tmp_path), "gloo", _two_level_job),
             nprocs=4, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for result in results:
        exact, quant = result["none"], result["dynamiq"]
        assert exact["levels"] == 2
        assert torch.equal(exact["rs"], exact["exact_rs"])
        assert torch.equal(exact["ar"], exact["exact_ar"])
        expected = torch.cat([torch.arange(1001, dtype=torch.float32) + 10_000 * r
                              for r in range(4)])
        assert torch.equal(exact["ag"], expected)
        assert metrics.vnmse(quant["rs"], quant["exact_rs"]) < 0.02
        assert metrics.vnmse(quant["ar"], quant["exact_ar"]) < 0.02
        assert metrics.vnmse(quant["ag"], expected) < 1e-3
        assert torch.equal(quant["ar"], results[0]["dynamiq"]["ar"])
        assert torch.equal(quant["ag"], results[0]["dynamiq"]["ag"])
        for got in (exact, quant):
            for key, direct in zip(("rs", "ag", "ar"), got["direct"], strict=True):
                assert torch.equal(got[key], direct), key
