"""Flat schedules placed on a topology: which rank plays which position of ring/butterfly/direct.

The builders of :mod:`.algorithms` know rank numbers only. Placed on a cluster, the heavy steps
should stay on fast links: the ring should cross each NIC once per direction, and the butterfly's
first steps - which carry the most chunks (step ``k`` moves about ``n / 2^(k+1)`` chunks per rank
to the rank ``2^k`` positions away) - should stay inside a host. Ordering positions host-major
(every rank of host 0, then host 1, ...) does both; :func:`placement_order` returns that order.

A schedule built over positions ``0..n-1`` is mapped onto ranks by :func:`relabel_schedule`:
position ``p`` becomes rank ``order[p]`` *and* chunk ``p`` becomes chunk ``order[p]``, so chunk
``c``'s sink is still rank ``c`` (the convention reduce-scatter relies on). Roles are derived
again, because "the last child" is decided by source rank within a step.

Rejected: searching rank orders with the cost model (simulated annealing, as some MPI libraries
do). For the host-shaped topologies dqcoll models, host-major order is optimal for the ring and
within a few percent for the butterfly in the cost model, and it is what torchrun already gives.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidArgumentError
from .algorithms import build_schedule
from .graph import Topology
from .schedule import Schedule, assign_roles

__all__ = ["build_placed_schedule", "placement_order", "relabel_schedule"]


def placement_order(topology: Topology) -> tuple[int, ...]:
    """Ranks host-major: position ``p`` of a flat algorithm is rank ``order[p]``."""
    return tuple(sorted(range(topology.world_size), key=lambda r: (topology.hosts[r], r)))


def relabel_schedule(schedule: Schedule, order: Sequence[int], *, algorithm: str | None = None
                     ) -> Schedule:
    """Map positions (and chunks) ``p`` to ranks ``order[p]``; see the module docstring."""
    n = schedule.world_size
    if sorted(order) != list(range(n)):
        raise InvalidArgumentError(f"order must be a permutation of 0..{n - 1}, got {list(order)}")

    def steps(seq):  # type: ignore[no-untyped-def]
        return [[(order[t.src], order[t.dst], order[t.chunk]) for t in s.transfers] for s in seq]

    return assign_roles(algorithm or schedule.algorithm, n, steps(schedule.reduce),
                        steps(schedule.gather))


def build_placed_schedule(name: str, topology: Topology) -> Schedule:
    """Algorithm ``name`` (ring, butterfly, direct, ...) placed host-major on ``topology``."""
    base = build_schedule(name, topology.world_size)
    order = placement_order(topology)
    if order == tuple(range(topology.world_size)):
        return base
    return relabel_schedule(base, order)
