"""Calls the planner decides (``scheme="auto"``, ``algorithm="auto"``, :mod:`dqcoll.planner`):
the plan is the same on every rank, its result is bit for bit the result of running that plan
explicitly, measured calls calibrate every rank's planner alike, and the refusals hold."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import dqcoll
from dqcoll import planner
from dqcoll import prepare as prepare_module
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local
from dqcoll.topology.cost import KernelRates


def _inputs(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def _calls(comm: dqcoll.Communicator, scheme: str, sizes: list[int]) -> list[dict[str, Any]]:
    """Planned all-reduces of ``sizes``; each checked against the explicit call of its plan
    (same scheme, algorithm, seed and step) on the same input."""
    out = []
    for numel in sizes:
        x = _inputs(comm.rank, numel)
        y = x.clone()
        step = comm._calls  # the planned call's step: its call counter
        dqcoll.allreduce(x, scheme=scheme, op="avg", comm=comm)
        info = dict(comm.last_info)
        plan = info["planned"]
        dqcoll.allreduce(y, scheme=plan["scheme"], algorithm=plan["algorithm"], op="avg",
                         comm=comm, step=step)
        out.append({"x": x, "same_as_explicit": torch.equal(x, y), "plan": plan,
                    "factors": dict(comm.planner.factors)})
    return out


@pytest.mark.parametrize(("world_size", "scheme"), [(3, "auto"), (4, "dynamiq"), (4, "auto")])
def test_every_rank_runs_the_same_plan_and_gets_what_the_plan_gives(world_size: int,
                                                                     scheme: str) -> None:
    """Over in-process ranks every rank reports the same plan and the same calibration after
    each call, ends bit-identical, and each result equals the explicit call of the plan."""
    sizes = [3 * 4096 + 5, 1 << 16, 3 * 4096 + 5, 1 << 16]
    results = run_local(world_size, _calls, scheme, sizes)
    for call in range(len(sizes)):
        plans = [r[call]["plan"] for r in results]
        assert all(p == plans[0] for p in plans), plans
        assert plans[0]["algorithm"] in ("ring", "butterfly")
        assert all(r[call]["factors"] == results[0][call]["factors"] for r in results)
        for r in results:
            assert r[call]["same_as_explicit"]
            assert torch.equal(r[call]["x"], results[0][call]["x"])
    # measured calls calibrated the planner (the same factors on every rank, checked above)
    assert results[0][-1]["factors"]


def _two_level_planner(comm: dqcoll.Communicator) -> planner.Planner:
    """A planner that sees 2 hosts x 2 ranks with a slow port between them (two levels win)."""
    job = planner.JobTopology(((0, 1), (2, 3)), (0, 0, 0, 0))
    kernels = (("none", KernelRates(0.1, 0.2)), ("bf16", KernelRates(0.3, 0.6)),
               ("dynamiq", KernelRates(4.0, 0.8, 1.6)))
    return planner.Planner(job, planner.MeasuredRates(40.0, 0.5, kernels, 2))


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_a_two_level_plan_runs_as_the_explicit_two_level_call(collective: str) -> None:
    """Where the planner picks two levels, the call runs them, and the result is bit for bit the
    explicit two-level call (``algorithm=plan``) of the same plan, seed and step."""
    numel = 4 * 50_000

    def body(comm: dqcoll.Communicator) -> dict[str, Any]:
        comm.planner = _two_level_planner(comm)
        x = _inputs(comm.rank, numel)
        y = x.clone()
        step = comm._calls
        if collective == "allreduce":
            dqcoll.allreduce(x, scheme="dynamiq", op="avg", comm=comm, seed=3)
            got = x
        else:
            got = torch.empty(numel // 4)
            dqcoll.reduce_scatter(x, got, scheme="dynamiq", op="avg", comm=comm, seed=3)
        plan = comm.planner.plan(collective, numel * 4, "float32", scheme="dynamiq", bits=5.0)
        assert plan.is_two_level
        info = dict(comm.last_info)
        out = None if collective == "allreduce" else torch.empty(numel // 4)
        if collective == "allreduce":
            dqcoll.allreduce(y, op="avg", comm=comm, seed=3, step=step, algorithm=plan.levels)
        else:
            dqcoll.reduce_scatter(y, out, op="avg", comm=comm, seed=3, step=step,
                                  algorithm=plan.levels)
        expected = y if collective == "allreduce" else out
        return {"plan": info["planned"], "same": torch.equal(got, expected), "got": got}

    results = run_local(4, body)
    for r in results:
        assert r["plan"]["algorithm"] == "two-level" and "levels" in r["plan"]
        assert r["plan"] == results[0]["plan"]
        assert r["same"]
    if collective == "allreduce":
        assert all(torch.equal(r["got"], results[0]["got"]) for r in results)


@pytest.mark.parametrize(("force", "own_passes"), [("dynamiq", 0), ("bf16", 1)])
def test_auto_takes_the_range_check_from_dynamiq_statistics(
        monkeypatch: pytest.MonkeyPatch, force: str, own_passes: int) -> None:
    """``auto`` checks its input's range in dynamiq's statistics pass (the survey a dynamiq plan
    reuses; a plan of another scheme ignores it, test above), so no separate range-check pass
    runs; forced to another scheme it takes the range check's own pass. Results stay the
    explicit plan's."""
    monkeypatch.setenv("DQCOLL_AUTO_FORCE", force)
    passes: list[int] = []  # the threads (ranks) that ran the range check's own pass
    real = prepare_module.max_exponent
    monkeypatch.setattr(prepare_module, "max_exponent",
                        lambda t: passes.append(threading.get_ident()) or real(t))

    def body(comm: dqcoll.Communicator) -> tuple[str, bool, int]:
        x, y = _inputs(comm.rank, 1 << 14), _inputs(comm.rank, 1 << 14)
        step = comm._calls
        dqcoll.allreduce(x, scheme="auto", op="avg", comm=comm)
        plan = comm.last_info["planned"]
        checks = passes.count(threading.get_ident())
        dqcoll.allreduce(y, scheme=plan["scheme"], algorithm=plan["algorithm"], op="avg",
                         comm=comm, step=step)
        return plan["scheme"], torch.equal(x, y), checks

    results = run_local(4, body)
    assert all(same for _, same, _ in results)
    assert {scheme for scheme, _, _ in results} == {force}
    assert [checks for _, _, checks in results] == [own_passes] * 4


def test_forced_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_AUTO_FORCE makes ``auto`` plan that scheme only (the algorithm still planned)."""
    monkeypatch.setenv("DQCOLL_AUTO_FORCE", "bf16")

    def body(comm: dqcoll.Communicator) -> dict:
        x = _inputs(comm.rank, 2048)
        dqcoll.allreduce(x, scheme="auto", comm=comm)
        return dict(comm.last_info)

    for info in run_local(3, body):
        assert info["scheme"] == "bf16" and info["planned"]["scheme"] == "bf16"


def test_named_scheme_on_two_ranks_needs_no_planner() -> None:
    """Two ranks and a named scheme have one plan (direct): no planner is made, nothing probed."""

    def body(comm: dqcoll.Communicator) -> tuple[Any, str]:
        x = _inputs(comm.rank, 4096)
        dqcoll.allreduce(x, comm=comm)
        return comm.planner, comm.last_info["algorithm"]

    assert run_local(2, body) == [(None, "direct"), (None, "direct")]


def test_auto_against_an_explicit_scheme_raises_on_every_rank() -> None:
    """One rank auto, another dynamiq: a MismatchError on both before data moves."""

    def body(comm: dqcoll.Communicator) -> str:
        x = _inputs(comm.rank, 4096)
        try:
            dqcoll.allreduce(x, scheme="auto" if comm.rank == 0 else "dynamiq", comm=comm)
        except DqcollError as exc:
            return type(exc).__name__
        return "no error"

    assert run_local(2, body) == ["MismatchError", "MismatchError"]


def test_planned_against_a_named_algorithm_raises_on_every_rank() -> None:
    """One rank algorithm='auto', another 'ring': a MismatchError on every rank (the planned
    call is fingerprinted as 'auto'), before the planner probes anything."""

    def body(comm: dqcoll.Communicator) -> str:
        x = _inputs(comm.rank, 4096)
        try:
            dqcoll.allreduce(x, algorithm="auto" if comm.rank == 0 else "ring", comm=comm)
        except DqcollError as exc:
            return type(exc).__name__ + ("" if comm.planner is None else " after probing")
        return "no error"

    assert run_local(3, body) == ["MismatchError"] * 3


def test_auto_refuses_all_gather() -> None:
    def body(comm: dqcoll.Communicator) -> str:
        try:
            dqcoll.all_gather(torch.zeros(8), torch.zeros(16), scheme="auto", comm=comm)
        except DqcollError as exc:
            return str(exc)
        return ""

    assert all("allreduce and reduce_scatter" in text for text in run_local(2, body))


def test_without_the_argument_check_plans_agree_uncalibrated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_VALIDATE=0 skips the argument check, and with it the calibration: the ranks plan
    from the agreed measured rates alone and still run the same plan."""
    monkeypatch.setenv("DQCOLL_VALIDATE", "0")

    def body(comm: dqcoll.Communicator) -> list[Any]:
        plans = []
        for numel in (1 << 14, 1 << 16, 1 << 14):
            x = _inputs(comm.rank, numel)
            dqcoll.allreduce(x, scheme="auto", comm=comm)
            plans.append(comm.last_info["planned"]["label"])
        return [plans, dict(comm.planner.factors)]

    results = run_local(3, body)
    assert all(r == results[0] for r in results)
    assert results[0][1] == {}
