"""The DDP communication hook on real multi-process gloo groups (torch.multiprocessing.spawn).

Each test spawns its ranks once (a FileStore rendezvous in the test's tmp_path), runs everything
it checks inside them and hands the results back through files; the assertions run in pytest.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dqcoll import schemes
from dqcoll.errors import InvalidArgumentError
from dqcoll.integrations.torch_ddp import DynamiqState, HookRuntime, dynamiq_hook

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("ddp_train", ROOT / "examples" / "ddp_train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_train"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _worker(rank: int, world_size: int, store_path: str, out_dir: str,
            body: Callable[[int, int], Any]) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("DQCOLL_TIMEOUT_S", "120")
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = body(rank, world_size)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, as the reliability workers do: gloo's C++
    # teardown at exit occasionally aborts a finished process ("terminate called without an
    # active exception"), which mp.spawn would report as a failure of this rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(tmp_path: pathlib.Path, world_size: int, body: Callable[[int, int], Any]) -> list[Any]:
    mp.spawn(_worker, args=(world_size, str(tmp_path / "store"), str(tmp_path), body),
             nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class _MLP(nn.Module):
    """Odd layer sizes, so that DDP's buckets have sizes that are no multiple of anything."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(37, 301), nn.GELU(), nn.Linear(301, 129), nn.GELU(),
                                 nn.Linear(129, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 37, generator=g), torch.randn(16, 5, generator=g)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _paired_steps(rank: int, models: tuple[nn.Module, nn.Module], steps: int) -> list[bool]:
    """Train both models ``steps`` SGD steps on the same batches; per step, whether their
    averaged gradients were bit-identical."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    same: list[bool] = []
    for step in range(steps):
        x, y = _batch(rank, step)
        grads = []
        for model, optimizer in zip(models, optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append(_grads(model))
            optimizer.step()
        same.append(all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True)))
    return same


# -- scheme="none": exactly DDP --------------------------------------------------------------------


def _none_vs_plain(rank: int, world_size: int) -> dict[str, Any]:
    plain = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    hooked = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="none")
    hooked.register_comm_hook(state, dynamiq_hook)
    same = _paired_steps(rank, (plain, hooked), 4)
    return {"none": same, "buckets": dict(state.bucket_numel)}


def _three_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {"none": _none_vs_plain(rank, world_size),
            "dynamiq": _dynamiq_replicas(rank, world_size),
            "async": _async_vs_sync(rank, world_size),
            "auto": _auto_hook(rank, world_size)}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 3-rank gloo job (a world size that is no power of two) for the next two tests."""
    return _spawn(tmp_path_factory.mktemp("gloo3"), 3, _three_ranks)


def test_none_gives_the_gradients_of_plain_ddp(three_ranks: list[dict[str, Any]]) -> None:
    """With scheme="none" the averaged gradients are bit for bit those of DDP without a hook, at
    every step and on every rank, over several buckets (warm-up iterations average in bf16:
    tests/test_ddp_warmup.py)."""
    for rank, result in enumerate(r["none"] for r in three_ranks):
        assert all(result["none"]), (rank, result)
        assert len(result["buckets"]) >= 2, result


# -- dynamiq: replicas stay bit-identical ----------------------------------------------------------


def _dynamiq_replicas(rank: int, world_size: int) -> dict[str, Any]:
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="dynamiq", bits=5, warmup_steps=2, error_feedback=True,
                         monitor_every=5, runtime=HookRuntime(algorithm="ring"))
    model.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    hints = []
    for step in range(25):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        hints.append(dict(state.allocation_u))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "identical": all(torch.equal(gathered[0], g) for g in gathered),
        "iteration": state.iteration,
        "vnmse": state.vnmse_history,
        "hints": hints,
        "residual_norm": sum(float(r.norm()) for r in state.residuals.values()),
        "bits": state.last_info.get("bits"),
        "buckets": dict(state.bucket_numel),
        "bytes_sent": state.comm.counters["bytes_sent"] if state.comm else 0,
    }


def test_dynamiq_keeps_replicas_bit_identical(three_ranks: list[dict[str, Any]]) -> None:
    """25 steps of Adam with dynamiq at 5 bits (error feedback and monitor on, 3 ranks, odd bucket
    sizes): every rank's parameters are bit-identical; the monitor logged vNMSE every 5 compressed
    steps; u is carried per bucket; error feedback keeps non-zero residuals."""
    results = [r["dynamiq"] for r in three_ranks]
    for rank, result in enumerate(results):
        assert result["identical"], f"rank {rank}: replicas differ"
        assert result["iteration"] == 25
        steps = [it for it, _ in result["vnmse"]]
        assert steps == [2, 7, 12, 17, 22], steps
        assert all(0 < v < 0.05 for _, v in result["vnmse"]), result["vnmse"]
        assert len(result["hints"][2]) >= 2, "one carried u per bucket after the first step"
        assert result["hints"][-1] != result["hints"][2]
        assert result["residual_norm"] > 0
        # buckets under 64 super-groups also budget their tail's padding (< 256 coordinates)
        assert result["bits"] <= 5.0 * (1 + 255 / min(result["buckets"].values())) + 1e-9
        assert result["bytes_sent"] > 0
    assert results[0]["vnmse"] == results[1]["vnmse"] == results[2]["vnmse"]


# -- overlap: the asynchronous hook ----------------------------------------------------------------


def _async_vs_sync(rank: int, world_size: int) -> dict[str, Any]:
    """The same training with the hook's futures completed by the lanes' workers (async_op=True,
    the default: two lanes on CPU), by one worker (lanes=1) and inside the hook
    (async_op=False)."""
    results: dict[str, Any] = {}
    for async_op, lanes in ((True, None), (True, 1), (False, None)):
        model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
        state = DynamiqState(scheme="dynamiq", bits=5, warmup_steps=1,
                             runtime=HookRuntime(algorithm="butterfly", async_op=async_op,
                                                 lanes=lanes))
        prepared = state.comm is not None  # made with the state, before any backward
        order: list[list[int]] = []  # per iteration, bucket indices as their futures completed
        pending_at_return: list[bool] = []

        def hook(state: DynamiqState, bucket: dist.GradBucket,
                 ) -> torch.futures.Future[torch.Tensor]:
            future = dynamiq_hook(state, bucket)
            pending_at_return.append(not future.done())  # noqa: B023 (used within the loop body)
            index = bucket.index()

            done = order[-1]  # noqa: B023 (used within the loop body)

            def finished(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                done.append(index)
                return fut.value()

            return future.then(finished)

        hook.__annotations__.update(dynamiq_hook.__annotations__)  # DDP checks the real types
        model.register_comm_hook(state, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(6):
            x, y = _batch(rank, step)
            optimizer.zero_grad(set_to_none=True)
            order.append([])
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        lane_bytes = [comm.counters["payload_bytes_sent"]
                      for comm in (state.comm, *state.lane_comms) if comm is not None]
        results[f"async={async_op} lanes={lanes}"] = {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "order": order, "pending": pending_at_return, "prepared": prepared,
            "iteration": state.iteration, "bits": state.bits_history,
            "lanes": state.lane_count(), "lane_bytes": lane_bytes,
            "algorithm": state.last_info.get("algorithm")}
    # algorithm="auto" (the default): the planner's choice, made when the state was made
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="dynamiq", bits=5, warmup_steps=1)
    made = state.comm is not None and state.comm.planner is not None
    model.register_comm_hook(state, dynamiq_hook)
    for step in range(3):
        x, y = _batch(rank, step)
        nn.functional.mse_loss(model(x), y).backward()
    state.drain()
    results["auto algorithm"] = {"planner made by the state": made,
                                 "ran": state.last_info.get("algorithm"),
                                 "planned": state.last_info.get("planned", {}).get("algorithm"),
                                 "named": DynamiqState(
                                     runtime=HookRuntime(algorithm="direct")
                                 ).bucket_algorithm(torch.zeros(4))}
    return results


def test_async_hook_overlaps_and_matches_the_synchronous_one(
        three_ranks: list[dict[str, Any]]) -> None:
    """async_op=True returns futures that are still pending when the hook returns (backward goes
    on), completes each iteration's buckets in bucket order, keeps the end-of-iteration
    bookkeeping, and trains to bit-identical parameters with the synchronous hook, with two
    lanes (the CPU default: both carried buckets) and with one; the communicators exist before
    the first backward."""
    for rank, result in enumerate(r["async"] for r in three_ranks):
        sync = result["async=False lanes=None"]
        assert sync["lanes"] == 1 and len(sync["lane_bytes"]) == 1
        for lanes in (None, 1):
            run = result[f"async=True lanes={lanes}"]
            assert torch.equal(run["params"], sync["params"]), f"rank {rank}"
            assert run["prepared"] and sync["prepared"]
            assert run["iteration"] == sync["iteration"] == 6
            assert run["bits"] == sync["bits"] and len(run["bits"]) == 5
            # DDP rebuilds its buckets after the first iteration (one bucket, then several);
            # it calls the hook in bucket order 0, 1, ... and the futures complete in that order
            assert len(run["order"][-1]) >= 2, run["order"]
            for done in run["order"]:
                assert done == sorted(done), (rank, lanes, run["order"])
            assert any(run["pending"][1:]), "every compressed bucket was already done"
        two = result["async=True lanes=None"]
        assert two["lanes"] == 2 and len(two["lane_bytes"]) == 2
        assert all(nbytes > 0 for nbytes in two["lane_bytes"]), two["lane_bytes"]
        assert result["async=True lanes=1"]["lanes"] == 1
        assert two["algorithm"] == sync["algorithm"] == "butterfly"  # as named
        auto = result["auto algorithm"]
        assert auto["planner made by the state"] and auto["named"] == "direct"
        assert auto["ran"] == auto["planned"] and auto["ran"] in ("ring", "butterfly")
        assert not any(sync["pending"][1:])  # the first (warm-up) bucket is gloo's own


def _auto_hook(rank: int, world_size: int) -> dict[str, Any]:
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="auto", bits=5, warmup_steps=0)
    assert state.comm is not None and state.comm.planner is not None  # made with the state
    rates = state.comm.planner.rates
    model.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    planned = []
    for step in range(4):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        state.drain()
        planned.append([comm.last_info.get("planned") for comm in (state.comm,
                                                                   *state.lane_comms)])
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {"identical": all(torch.equal(gathered[0], g) for g in gathered),
            "intra_gbps": rates.intra_gbps, "kernels": dict(rates.kernels), "planned": planned,
            "lanes": state.lane_count()}


def test_auto_hook_trains_with_the_same_plan_everywhere(
        three_ranks: list[dict[str, Any]]) -> None:
    """DynamiqState(scheme="auto") makes the planner when it is made (the link and the kernels
    measured then), every rank's lanes run the same plan for every bucket (the group's own
    all-reduce for none and bf16, dqcoll's schedule for dynamiq), and the replicas stay
    bit-identical."""
    results = [r["auto"] for r in three_ranks]
    for result in results:
        assert result["identical"]
        assert result["intra_gbps"] is not None and result["intra_gbps"] > 0
        assert set(result["kernels"]) == {"none", "bf16", "dynamiq", "native-none", "native-bf16"}
        assert result["lanes"] == 2
        for step, plans in enumerate(result["planned"]):
            for lane, plan in enumerate(plans):
                if plan is None:  # DDP's first iteration has one bucket: lane 0's
                    assert step == 0 and lane > 0
                    continue
                assert plan["scheme"] in ("none", "bf16", "dynamiq")
                assert (plan["algorithm"] == "native") == (plan["scheme"] != "dynamiq")
    assert results[0]["planned"] == results[1]["planned"] == results[2]["planned"]


# -- training: within 1 % of uncompressed ----------------------------------------------------------


def _short_training(rank: int, world_size: int) -> dict[str, Any]:
    example = _example()
    base = example.TrainConfig(steps=120, warmup_steps=5, batch=8, width=32, layers=1, context=32,
                               lr=3e-3, monitor_every=40, bucket_cap_mb=1.0,
                               corpus_nbytes=1 << 19)
    runs = {}
    for scheme in ("none", "dynamiq"):
        config = dataclasses.replace(base, scheme=scheme)
        runs[scheme] = example.train(config, rank, world_size, verbose=False)
    return runs


def test_training_loss_within_one_percent(tmp_path: pathlib.Path) -> None:
    """The example's model (tiny byte-level LM, 120 AdamW steps, 2 ranks, same data and seed):
    with dynamiq at 5 bits the final training loss (mean of the last 20 steps) and the held-out
    loss are within 1 % of the uncompressed run's."""
    runs = _spawn(tmp_path, 2, _short_training)[0]
    none, dq = runs["none"], runs["dynamiq"]
    assert none["final_train_loss"] < 0.8 * none["losses"][0], "the model did not train"
    for key in ("final_train_loss", "held_out_loss"):
        gap = abs(dq[key] - none[key]) / none[key]
        assert gap < 0.01, (key, dq[key], none[key])
    assert all(v < 0.05 for _, v in dq["vnmse_history"]), dq["vnmse_history"]


# -- arguments -------------------------------------------------------------------------------------


def test_state_validates_its_arguments() -> None:
    """DynamiqState refuses unknown schemes, bad scheme options and negative counts at
    construction, naming what is accepted; every registered scheme can be chosen."""
    with pytest.raises(InvalidArgumentError, match="registered schemes"):
        DynamiqState(scheme="nope")
    with pytest.raises(InvalidArgumentError, match="error_feedback needs a fixed scheme"):
        DynamiqState(scheme="auto", error_feedback=True)
    with pytest.raises(InvalidArgumentError, match="does not take"):
        DynamiqState(scheme="dynamiq", runtime=HookRuntime(scheme_options={"colour": "red"}))
    with pytest.raises(InvalidArgumentError, match="bits"):
        DynamiqState(scheme="dynamiq", bits=1.0)
    with pytest.raises(InvalidArgumentError, match="warmup_steps"):
        DynamiqState(warmup_steps=-1)
    for lanes in (0, -1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="lanes"):
            DynamiqState(runtime=HookRuntime(lanes=lanes))  # type: ignore[arg-type]
    # before the device is known, and for CUDA buckets, one lane; CPU buckets take two
    assert DynamiqState().lane_count() == 1
    assert DynamiqState(runtime=HookRuntime(device="cuda")).lane_count() == 1
    assert DynamiqState(runtime=HookRuntime(device="cpu")).lane_count() == 2
    assert DynamiqState(runtime=HookRuntime(device="cpu", lanes=3)).lane_count() == 3
    assert DynamiqState(runtime=HookRuntime(device="cpu", async_op=False)).lane_count() == 1
    assert DynamiqState(scheme="auto", runtime=HookRuntime(device="cpu")).lane_count() == 2
    assert DynamiqState(scheme="auto", runtime=HookRuntime(device="cpu", lanes=1)).lane_count() == 1
    for name in schemes.list_schemes():
        state = DynamiqState(scheme=name)
        assert state.should_compress(10) == (name != "none")


# -- error target: the monitor calibrates the error model -----------------------------------------


def _targeted_training(rank: int, world_size: int) -> dict[str, Any]:
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="dynamiq", target_vnmse=1e-3, warmup_steps=1, monitor_every=1,
                         runtime=HookRuntime(algorithm="butterfly"))
    model.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(12):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert state.comm is not None
    info = state.comm.last_info
    return {"identical": all(torch.equal(gathered[0], g) for g in gathered),
            "vnmse": state.vnmse_history, "kappa": state.kappa_history,
            "bits": state.bits_history,
            "info": {k: info.get(k) for k in ("predicted_vnmse", "measured_vnmse")}}


def test_error_target_is_calibrated_by_the_monitor(tmp_path: pathlib.Path) -> None:
    """With target_vnmse=1e-3 the hook logs the bits of every compressed iteration, the monitor
    moves kappa (every rank the same), the replicas stay bit-identical, and once calibrated the
    measured vNMSE sits within 0.5..1.5 of the target (median of the last 6 iterations); a
    monitored call's last_info holds measured_vnmse beside predicted_vnmse."""
    runs = _spawn(tmp_path, 3, _targeted_training)
    for run in runs:
        assert run["identical"]
        assert run["kappa"] == runs[0]["kappa"]
    first = runs[0]
    assert [i for i, _ in first["bits"]] == list(range(1, 12))
    assert all(2.8 < b < 17 for _, b in first["bits"])
    assert len(first["kappa"]) == 11 and first["kappa"][-1][1] != 1.0
    # a monitored call's last_info carries the measured vNMSE beside the predicted one
    assert 0 < first["info"]["measured_vnmse"] < 1 and 0 < first["info"]["predicted_vnmse"] < 1
    late = sorted(v for _, v in first["vnmse"][-6:])
    median = 0.5 * (late[2] + late[3])
    assert 0.5e-3 <= median <= 1.5e-3, first["vnmse"]
