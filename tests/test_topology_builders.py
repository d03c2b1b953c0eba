"""Schedules placed on topologies and hierarchical plans: checked correct on 1..8 nodes x 1..8
GPUs, executed exactly, with per-level schemes over subgroup transports."""

from __future__ import annotations

import pytest
import torch

import dqcoll
from dqcoll.context import call_context
from dqcoll.executor import run_schedule
from dqcoll.testing import run_local
from dqcoll.topology.checker import check_schedule
from dqcoll.topology.graph import Topology
from dqcoll.topology.hierarchical import (
    HierarchicalPlan,
    Level,
    LevelSpec,
    build_hierarchical_plan,
)
from dqcoll.topology.placement import build_placed_schedule, placement_order, relabel_schedule
from dqcoll.transports.subgroup import SubgroupTransport
from dqcoll.types import Collective, ReduceOp

SHAPES = [(h, g) for h in range(1, 9) for g in range(1, 9)]
# Every flat algorithm with every shape; hierarchical with a spread of level algorithms.
HIER = [("ring", "ring"), ("ring", "butterfly"), ("butterfly", "direct"), ("direct", "ring")]


def _integers(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randint(-50, 51, (numel,), generator=g).float()


@pytest.mark.parametrize("nodes,gpus", SHAPES, ids=[f"{h}x{g}" for h, g in SHAPES])
def test_builders_pass_checker(nodes, gpus):
    """Ring, butterfly and direct placed on the topology and the hierarchical plans' flat
    schedules are correct reduce-scatter/all-gather schedules (the checker proves it)."""
    topology = Topology.cluster(nodes, gpus)
    for name in ("ring", "butterfly", "direct"):
        check_schedule(build_placed_schedule(name, topology))
    intra, inter = HIER[(nodes + gpus) % len(HIER)]
    plan = build_hierarchical_plan(topology, intra=LevelSpec("none", algorithm=intra),
                                   inter=LevelSpec("dynamiq", 5, inter))
    schedule = plan.flat_schedule()
    check_schedule(schedule)
    assert len(plan.step_levels()) == len(schedule.steps)


def _round_robin(nodes: int, gpus: int) -> Topology:
    """Ranks dealt to hosts round-robin (rank r on host r % nodes), as some launchers do."""
    base = Topology.cluster(nodes, gpus)
    hosts = tuple(r % nodes for r in range(nodes * gpus))
    ports = tuple(base.ports[h * gpus + r // nodes] for r, h in enumerate(hosts))
    return Topology("rr", hosts, ports, base.nics, base.links, tuple(range(nodes * gpus)), "h100")


def test_placed_ring_crosses_each_nic_once_per_step():
    """Placed host-major, a ring sends at most one chunk per NIC and direction in each step,
    however the job numbered its ranks; the unplaced ring on a round-robin numbering sends
    through every NIC from every rank."""
    topology = _round_robin(4, 4)
    order = placement_order(topology)
    assert [topology.hosts[r] for r in order] == sorted(topology.hosts)

    def max_nic_load(schedule):
        worst = 0
        for step in schedule.steps:
            load: dict[tuple[int, str], int] = {}
            for t in step.transfers:
                if not topology.is_intra(t.src, t.dst):
                    for res in topology.route(t.src, t.dst):
                        load[res] = load.get(res, 0) + 1
            worst = max(worst, *load.values(), 0)
        return worst

    placed = build_placed_schedule("ring", topology)
    check_schedule(placed)
    assert max_nic_load(placed) == 1
    assert max_nic_load(dqcoll.topology.build_schedule("ring", 16)) == 4


def test_relabel_keeps_sink_convention():
    """Relabelled schedules reduce chunk c onto rank c."""
    schedule = relabel_schedule(dqcoll.topology.build_schedule("butterfly", 6), [3, 1, 5, 0, 2, 4])
    check_schedule(schedule)
    finals = {(t.dst, t.chunk) for s in schedule.reduce for t in s.transfers
              if t.role.value == "final"}
    assert finals == {(c, c) for c in range(6)}


def test_flat_hierarchical_schedule_runs_exactly():
    """The flat schedule of a 2x3 plan, run by the executor with `none`, sums integers exactly
    on every rank."""
    topology = Topology.cluster(2, 3)
    plan = build_hierarchical_plan(topology, intra=LevelSpec("none", algorithm="butterfly"),
                                   inter=LevelSpec("none", algorithm="ring"))
    schedule = plan.flat_schedule()
    scheme = dqcoll.schemes.get("none")

    def body(comm):
        x = _integers(comm.rank, 1001)
        ctx = call_context(comm.transport, ReduceOp.SUM, 0, 0, Collective.ALLREDUCE, "t")
        call = scheme.begin(x, ctx)
        run_schedule(schedule, call, comm.transport, what="t")
        out = torch.empty_like(x)
        call.finish(out)
        return out

    expected = sum(_integers(r, 1001) for r in range(6))
    for out in run_local(6, body):
        assert torch.equal(out, expected)


@pytest.mark.parametrize("nodes,gpus", [(2, 3), (3, 2), (1, 4), (4, 1)])
def test_hierarchical_allreduce_exact_with_none(nodes, gpus):
    """Per-level execution over subgroup transports with `none` at both levels is exact, also
    for lengths that do not split evenly and for op=avg."""
    topology = Topology.cluster(nodes, gpus)
    plan = build_hierarchical_plan(topology, intra=LevelSpec("none", algorithm="ring"),
                                   inter=LevelSpec("none", algorithm="butterfly"))
    n = nodes * gpus

    def body(comm):
        x = _integers(comm.rank, 777)
        dqcoll.allreduce(x, comm=comm, algorithm=plan)
        y = _integers(comm.rank, 777) * n
        dqcoll.allreduce(y, comm=comm, op="avg", algorithm=plan)
        return x, y

    expected = sum(_integers(r, 777) for r in range(n))
    for x, y in run_local(n, body):
        assert torch.equal(x, expected)
        assert torch.equal(y, expected)


def test_hierarchical_per_level_schemes():
    """none inside hosts, dynamiq across them: every rank ends bit-identical, the error is that
    of a 2-rank dynamiq all-reduce, and only the inter level's compressed bytes cross hosts."""
    topology = Topology.cluster(2, 4)
    plan = build_hierarchical_plan(topology, intra=LevelSpec("none", algorithm="direct"),
                                   inter=LevelSpec("dynamiq", 6.0, "ring"))
    numel = 64 * 256

    def data(rank):
        return torch.randn(numel, generator=torch.Generator().manual_seed(rank))

    def body(comm):
        x = data(comm.rank)
        before = comm.counters["payload_bytes_sent"]
        dqcoll.allreduce(x, comm=comm, seed=3, algorithm=plan)
        return x, comm.counters["payload_bytes_sent"] - before, comm.last_info

    results = run_local(8, body)
    first = results[0][0]
    assert all(torch.equal(x, first) for x, _, _ in results)
    exact = sum(data(r).double() for r in range(8))
    error = dqcoll.metrics.vnmse(first, exact)
    assert 1e-4 < error < 0.05
    info = results[0][2]
    assert info["inter"]["scheme"] == "dynamiq" and info["intra"]["scheme"] == "none"
    # Part per local rank: numel/4 fp32 coords; the intra direct reduce-scatter and all-gather
    # (none: leaves and final sums in fp32) each move 3/4 of the buffer.
    intra_bytes = 2 * 3 * (numel // 4) * 4
    sent = results[0][1]
    assert intra_bytes < sent < intra_bytes + (numel // 4) * 4 // 2


def test_plan_groups_and_levels():
    """A plan knows each rank's host group and same-local-rank group, and labels its steps."""
    plan = HierarchicalPlan(((0, 2), (1, 3)), LevelSpec("none"), LevelSpec("dynamiq", 5, "ring"))
    assert plan.intra_group(3) == (1, 3) and plan.inter_group(3) == (2, 3)
    assert plan.position(2) == (0, 1)
    check_schedule(plan.flat_schedule())
    assert set(plan.step_levels()) == {Level.INTRA, Level.INTER}
    with pytest.raises(dqcoll.DqcollError, match="same number of ranks"):
        HierarchicalPlan(((0, 1), (2,)), LevelSpec(), LevelSpec())


def test_subgroup_transport_allreduce_and_exchange():
    """A subgroup's small all-reduce gives identical sums/maxima on its members, and its
    exchange reaches the right global peers."""
    def body(comm):
        members = (0, 2, 3) if comm.rank != 1 else (1,)
        sub = SubgroupTransport(comm.transport, members)
        t = torch.tensor([float(comm.rank), -float(comm.rank)])
        sub.allreduce(t, "sum", what="sum")
        m = torch.tensor([float(comm.rank)])
        sub.allreduce(m, "max", what="max")
        got = None
        if sub.world_size > 1:
            peer = (sub.rank + 1) % sub.world_size
            src = (sub.rank - 1) % sub.world_size
            buf = torch.empty(1)
            sub.exchange([(peer, torch.tensor([float(comm.rank)]))], [(src, buf)], what="x")
            got = buf.item()
        return t.tolist(), m.item(), got

    results = run_local(4, body)
    assert results[0][0] == results[2][0] == results[3][0] == [5.0, -5.0]
    assert results[0][1] == 3.0 and results[1] == ([1.0, -1.0], 1.0, None)
    assert results[0][2] == 3.0 and results[2][2] == 0.0 and results[3][2] == 2.0
    with pytest.raises(dqcoll.DqcollError, match="not a member"):
        run_local(2, lambda comm: SubgroupTransport(comm.transport, (1,)) if comm.rank == 0
                  else None)
