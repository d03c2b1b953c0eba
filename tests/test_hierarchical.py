"""All-reduce, reduce-scatter and all-gather of a caller's two-level plan (``algorithm=plan``).

In-process ranks (``run_local``) on 2 x 2, 2 x 3 and 3 x 2 hosts x ranks, numbered node-major
(torchrun's numbering), local-major (the layout needs no reordering) and scattered. ``none`` at
both levels must be exact; with ``dynamiq`` across hosts every rank must hold the same bits, and
a reduce-scatter's shard must be the matching part of the all-reduce of the same buffer with the
same plan, seed and step (it holds with an exact intra level and the inter level's all-reduce on
the reduce-scatter layout: docs/topology.md §2).
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
import torch
from conftest import heavy_tailed, integer_input

import dqcoll
from dqcoll.errors import CommAbortedError, DqcollError, InvalidArgumentError
from dqcoll.testing import run_local
from dqcoll.topology.hierarchical import HierarchicalPlan, LevelSpec

HOSTS = {
    "2x2": ((0, 1), (2, 3)),
    "2x2-local-major": ((0, 2), (1, 3)),
    "2x3": ((0, 1, 2), (3, 4, 5)),
    "3x2": ((0, 1), (2, 3), (4, 5)),
    "2x3-scattered": ((4, 0, 2), (1, 5, 3)),
}
EXACT = (LevelSpec("none", algorithm="ring"), LevelSpec("none", algorithm="butterfly"))
# dynamiq across hosts on its reduce-scatter layout, so the all-reduce's parts are the
# reduce-scatter's shards
COMPRESSED = (LevelSpec("none", algorithm="direct"),
              LevelSpec("dynamiq", 5.0, "ring", (("balance", "shards"),)))
SEED, STEP = 7, 11


def _plan(hosts: str, levels: tuple[LevelSpec, LevelSpec]) -> HierarchicalPlan:
    return HierarchicalPlan(HOSTS[hosts], *levels)


def test_local_major_ranks() -> None:
    """Position j x H + h of the local-major order holds local rank j of host h."""
    assert _plan("2x3", EXACT).local_major_ranks == (0, 3, 1, 4, 2, 5)
    assert _plan("2x2-local-major", EXACT).local_major_ranks == (0, 1, 2, 3)
    assert _plan("2x3-scattered", EXACT).local_major_ranks == (4, 1, 0, 5, 2, 3)


def _exact_body(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> dict[str, Any]:
    n, r = comm.world_size, comm.rank
    out: dict[str, Any] = {}
    for numel in (777, n - 1, 0):  # no multiple of n, fewer elements than ranks, empty
        x = integer_input(r, numel)
        out[f"ar{numel}"] = dqcoll.allreduce(x, comm=comm, algorithm=plan)
        y = integer_input(r, numel) * n
        out[f"avg{numel}"] = dqcoll.allreduce(y, op="avg", comm=comm, algorithm=plan)
    for shard in (1001, 1):
        rs = torch.full((shard,), float("nan"))
        dqcoll.reduce_scatter(integer_input(r, n * shard), rs, comm=comm, algorithm=plan)
        avg = torch.full((shard,), float("nan"))
        dqcoll.reduce_scatter(integer_input(r, n * shard) * n, avg, op="avg", comm=comm,
                              algorithm=plan)
        ag = torch.full((n * shard,), float("nan"))
        dqcoll.all_gather(integer_input(r, shard), ag, comm=comm, algorithm=plan)
        out[f"rs{shard}"], out[f"rsavg{shard}"], out[f"ag{shard}"] = rs, avg, ag
    return out


@pytest.mark.parametrize("hosts", list(HOSTS))
def test_exact_levels_are_exact(hosts: str) -> None:
    """With none at both levels: the all-reduce (sum and avg, odd lengths, fewer elements than
    ranks, empty) equals the exact sum on every rank, each rank's reduce-scatter output is its
    own shard (global rank order) of the exact sum, and the all-gather is every rank's shard in
    global rank order, bit for bit."""
    plan = _plan(hosts, EXACT)
    n = plan.world_size
    results = run_local(n, _exact_body, plan)
    for rank, got in enumerate(results):
        for numel in (777, n - 1, 0):
            expected = sum(integer_input(r, numel) for r in range(n))
            assert torch.equal(got[f"ar{numel}"], expected), (rank, numel)
            assert torch.equal(got[f"avg{numel}"], expected), (rank, numel)
        for shard in (1001, 1):
            total = sum(integer_input(r, n * shard) for r in range(n))
            mine = total[rank * shard : (rank + 1) * shard]
            assert torch.equal(got[f"rs{shard}"], mine), (rank, shard)
            assert torch.equal(got[f"rsavg{shard}"], mine), (rank, shard)
            gathered = torch.cat([integer_input(r, shard) for r in range(n)])
            assert torch.equal(got[f"ag{shard}"], gathered), (rank, shard)


def _compressed_body(comm: dqcoll.Communicator, plan: HierarchicalPlan, shard: int,
                     op: str) -> dict[str, Any]:
    n, r = comm.world_size, comm.rank
    x = heavy_tailed(r, n * shard, seed=3)
    rs = torch.full((shard,), float("nan"))
    dqcoll.reduce_scatter(x.clone(), rs, op=op, comm=comm, seed=SEED, step=STEP, algorithm=plan)
    ar = dqcoll.allreduce(x.clone(), op=op, comm=comm, seed=SEED, step=STEP, algorithm=plan)
    odd = dqcoll.allreduce(x[: n * shard - 3].clone(), op=op, comm=comm, algorithm=plan)
    ag = torch.full((n * shard,), float("nan"))
    dqcoll.all_gather(x[:shard].clone(), ag, comm=comm, seed=SEED, step=STEP, algorithm=plan)
    return {"rs": rs, "ar": ar, "odd": odd, "ag": ag, "info": dict(comm.last_info)}


@pytest.mark.parametrize("hosts,shard,op", [("2x2", 1024, "sum"), ("2x3", 1001, "avg"),
                                            ("3x2", 700, "sum"), ("2x3-scattered", 513, "avg"),
                                            ("2x2-local-major", 1001, "sum")])
def test_compressed_across_hosts(hosts: str, shard: int, op: str) -> None:
    """none inside hosts, dynamiq across them: the all-reduce (also of a length that is no
    multiple of n) and the all-gather are bit-identical on every rank; each rank's
    reduce-scatter output is bit for bit its shard of the all-reduce with the same plan, seed
    and step; the results are close to the exact ones."""
    plan = _plan(hosts, COMPRESSED)
    n = plan.world_size
    results = run_local(n, _compressed_body, plan, shard, op)
    first = results[0]
    data = [heavy_tailed(r, n * shard, seed=3).double() for r in range(n)]
    exact = sum(data) / (n if op == "avg" else 1)
    for rank, got in enumerate(results):
        for key in ("ar", "odd", "ag"):
            assert torch.equal(got[key], first[key]), (rank, key)
        assert not torch.isnan(got["rs"]).any(), rank
        assert torch.equal(got["rs"], got["ar"][rank * shard : (rank + 1) * shard]), rank
    assert dqcoll.metrics.vnmse(first["ar"], exact) < 0.01
    assert dqcoll.metrics.vnmse(first["odd"], exact[: n * shard - 3]) < 0.01
    shards = torch.cat([d[:shard].float() for d in data])
    assert 0 < dqcoll.metrics.vnmse(first["ag"], shards) < 0.01


def _seeded(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> list[torch.Tensor]:
    x = heavy_tailed(comm.rank, 4096, seed=4)
    return [dqcoll.allreduce(x.clone(), comm=comm, seed=seed, step=step, algorithm=plan)
            for seed, step in ((1, 5), (1, 5), (2, 5), (1, 6))]


def test_seed_and_step_key_every_level() -> None:
    """The same seed and step give the same bits; another seed or step gives others (dynamiq
    at both levels, so every phase draws random numbers)."""
    plan = HierarchicalPlan(HOSTS["2x2"], LevelSpec("dynamiq", 6.0, "ring"),
                            LevelSpec("dynamiq", 4.0, "ring"))
    for a, b, other_seed, other_step in run_local(4, _seeded, plan):
        assert torch.equal(a, b)
        assert not torch.equal(a, other_seed) and not torch.equal(a, other_step)


def _infos(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> list[dict[str, Any]]:
    infos = []
    x = torch.randn(4 * 512)
    dqcoll.allreduce(x, comm=comm, algorithm=plan)
    infos.append(comm.last_info)
    dqcoll.reduce_scatter(x, torch.empty(512), comm=comm, algorithm=plan)
    infos.append(comm.last_info)
    dqcoll.all_gather(x[:512], torch.empty(4 * 512), comm=comm, algorithm=plan)
    infos.append(comm.last_info)
    return infos


def test_last_info_names_the_levels() -> None:
    """comm.last_info names the plan, the collective, each level's scheme and every phase in
    the order it ran."""
    plan = _plan("2x2", COMPRESSED)
    ar, rs, ag = run_local(4, _infos, plan)[0]
    assert ar["algorithm"] == rs["algorithm"] == ag["algorithm"] == plan.name
    assert (ar["collective"], rs["collective"], ag["collective"]) == (
        "allreduce", "reduce_scatter", "all_gather")
    for info in (ar, rs, ag):
        assert info["intra"]["scheme"] == "none" and info["inter"]["scheme"] == "dynamiq"
    phases = [[(p["level"], p["collective"]) for p in info["phases"]] for info in (ar, rs, ag)]
    assert phases == [
        [("intra", "reduce_scatter"), ("inter", "allreduce"), ("intra", "all_gather")],
        [("intra", "reduce_scatter"), ("inter", "reduce_scatter")],
        [("inter", "all_gather"), ("intra", "all_gather")],
    ]


def _bad_arguments(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> list[str]:
    errors = []
    for call in (
        lambda: dqcoll.reduce_scatter(torch.zeros(10), torch.zeros(3), comm=comm, algorithm=plan),
        lambda: dqcoll.all_gather(torch.zeros(3), torch.zeros(10), comm=comm, algorithm=plan),
        lambda: dqcoll.allreduce(torch.zeros(8), comm=comm, algorithm=HierarchicalPlan(
            ((0, 1, 2), (3, 4, 5)), *EXACT)),
    ):
        with pytest.raises(InvalidArgumentError) as info:
            call()
        errors.append(str(info.value))
    x = integer_input(comm.rank, 8)
    dqcoll.allreduce(x, comm=comm, algorithm=plan)  # the communicator still works
    return errors


def test_local_argument_errors_raise_before_anything_moves() -> None:
    """Wrong output sizes and a plan for another world size raise InvalidArgumentError naming the
    rank; the communicator stays usable."""
    results = run_local(4, _bad_arguments, _plan("2x2", EXACT))
    for rank, errors in enumerate(results):
        assert all(f"rank {rank}" in e for e in errors), errors
        assert "world_size x out.numel()" in errors[0] and "6 ranks" in errors[2]


def _failing_level(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> tuple[str, str]:
    with pytest.raises(DqcollError) as first:
        # every rank a step of its own: the first level's argument check fails on every host
        dqcoll.allreduce(torch.zeros(64), comm=comm, step=comm.rank, algorithm=plan)
    assert comm.dead is not None
    with pytest.raises(CommAbortedError) as later:
        dqcoll.allreduce(torch.zeros(64), comm=comm, algorithm=plan)
    return str(first.value), str(later.value)


def test_failed_level_marks_the_communicator_dead() -> None:
    """A level that fails raises a dqcoll error on every rank and leaves the communicator dead:
    the next call raises CommAbortedError naming the failed call."""
    for first, later in run_local(4, _failing_level, _plan("2x2", EXACT)):
        assert "step" in first
        assert "allreduce#0 failed" in later


def test_one_two_level_implementation() -> None:
    """dqcoll.levels is the package's only two-level implementation: no other module (the
    transports package, which defines them, aside) makes a SubgroupTransport; the caller-given
    plans and the planner's both run through it from dqcoll.execute, and the FSDP2 lane hands
    its plans to the public collectives."""
    root = pathlib.Path(dqcoll.__file__).parent
    makers = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root).as_posix()
        if relative == "levels.py" or relative.startswith("transports/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if name == "SubgroupTransport":
                    makers.append(f"{relative}:{node.lineno}")
    assert makers == []
    users = sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                   if "run_levels(" in path.read_text())
    assert users == ["execute.py", "levels.py"]
    lane = (root / "integrations" / "lane.py").read_text()
    assert lane.count("algorithm=plan") == 3  # its reduce-scatter, all-gather and all-reduce


def _avg_error_body(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> float:
    """vNMSE of the plan's averaging all-reduce of Gaussian rows against the exact fp64 mean."""
    n, r = comm.world_size, comm.rank
    rows = [torch.randn(30001, generator=torch.Generator().manual_seed(100 + k)) for k in range(n)]
    exact = torch.stack([t.double() for t in rows]).mean(0)
    got = dqcoll.allreduce(rows[r].clone(), op="avg", comm=comm, algorithm=plan)
    return float((got.double() - exact).square().sum() / exact.square().sum())


@pytest.mark.parametrize("intra", ["none", "bf16", "int8_block"])
def test_avg_with_a_coded_intra_level_is_the_average(intra: str) -> None:
    """op="avg" with a coded scheme inside hosts: the intra all-gather carries the average, it
    does not divide it again (which would halve the result on 2 x 2: vNMSE 0.25). dynamiq 5 bits
    across hosts; every rank within its error."""
    levels = (LevelSpec(intra, algorithm="ring"), LevelSpec("dynamiq", 5.0, "ring"))
    errors = run_local(4, lambda comm: _avg_error_body(comm, _plan("2x2", levels)))
    assert len(set(errors)) == 1 and errors[0] < 0.03, errors


def _pooled_body(comm: dqcoll.Communicator, plan: HierarchicalPlan) -> dict[str, Any]:
    from dqcoll import levels, scratch

    x = heavy_tailed(comm.rank, 40_000, seed=5)
    out: dict[str, Any] = {"results": [], "made": []}
    for _ in range(4):  # the same call, again and again: the same buffers, the same bits
        out["results"].append(
            dqcoll.allreduce(x.clone(), comm=comm, seed=SEED, step=STEP, algorithm=plan))
        comms = [comm, *levels._groups[comm].values()]
        made = [pool.made for c in comms
                if (pool := scratch.pool_for(c.scheme_state, x.device)) is not None]
        out["made"].append(made)
    return out


@pytest.mark.parametrize("intra", ["none", "bf16"])
def test_repeated_two_level_calls_reuse_their_buffers(intra: str) -> None:
    """A two-level all-reduce called again allocates no new buffer (the caller's communicator's
    pool and its levels' keep what the first calls took, though the intra level alternates a
    reduce-scatter and an all-gather on one communicator) and gives the same bits on every call
    and every rank."""
    levels = (LevelSpec(intra, algorithm="ring"), LevelSpec("dynamiq", 5.0, "ring"))
    results = run_local(4, _pooled_body, _plan("2x2", levels))
    first = results[0]["results"][0]
    for got in results:
        assert all(torch.equal(r, first) for r in got["results"])
        made = got["made"]
        assert made[-1] == made[0] and made[0][0] > 0, made  # [0]: the reorder buffer, the part
