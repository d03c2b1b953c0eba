"""Reduce plans (the schedule's reduce phase as arrays): the closed forms of ring, butterfly and
direct are the built and placed schedules' transfers, roles, leaves, arrivals and counts."""

from __future__ import annotations

import numpy as np
import pytest

from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.graph import Topology
from dqcoll.topology.placement import build_placed_schedule, relabel_schedule
from dqcoll.topology.steps import flat_plan, placed_plan, plan_of_schedule


def _same(a, b) -> None:
    assert a.num_steps == b.num_steps
    n = a.world_size
    for k in range(a.num_steps):
        assert a.step(k).as_set() == b.step(k).as_set(), k
        chunks = np.array([c for c in (0, n // 2, n - 1)], dtype=np.int64)
        assert a.step(k, chunks).as_set() == b.step(k, chunks).as_set(), k
    assert np.array_equal(a.subtree(), b.subtree())


@pytest.mark.parametrize("algorithm", ["ring", "butterfly", "direct"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17])
def test_closed_forms_match_the_schedules(algorithm: str, n: int) -> None:
    """Identity order and a shuffled one (placement relabels positions and chunks)."""
    _same(flat_plan(algorithm, n), plan_of_schedule(build_schedule(algorithm, n)))
    order = np.random.default_rng(n).permutation(n).tolist()
    _same(flat_plan(algorithm, n, order),
          plan_of_schedule(relabel_schedule(build_schedule(algorithm, n), order)))


def test_placed_plan_and_profile() -> None:
    """placed_plan follows build_placed_schedule on a round-robin host numbering; the profile
    (per chunk: most transfers in a step, payloads and partial sums held) is chunk 0's."""
    base = Topology.cluster(3, 4)
    hosts = tuple(r % 3 for r in range(12))  # ranks dealt to hosts round-robin
    ports = tuple(base.ports[h * 4 + r // 3] for r, h in enumerate(hosts))
    topo = Topology("rr", hosts, ports, base.nics, base.links, tuple(range(12)), "h100")
    for algorithm in ("ring", "butterfly", "direct"):
        if algorithm != "direct":  # direct is the same whatever the order
            assert build_placed_schedule(algorithm, topo) != build_schedule(algorithm, 12)
        _same(placed_plan(algorithm, topo),
              plan_of_schedule(build_placed_schedule(algorithm, topo)))
    ring = flat_plan("ring", 16).profile()
    assert ring == (1, 1, 0)
    assert flat_plan("butterfly", 16).profile() == plan_of_schedule(
        build_schedule("butterfly", 16)).profile()
    assert flat_plan("direct", 16).profile() == (15, 0, 0)
