"""Flat schedules placed on a topology host-major (:func:`build_placed_schedule`; why:
docs/topology.md §2). Rejected: searching rank orders with the cost model; host-major order is
optimal for the ring and within a few percent for the butterfly.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import InvalidArgumentError
from .algorithms import build_schedule
from .graph import Topology
from .schedule import Schedule, Step, assign_roles

__all__ = ["build_placed_schedule", "placement_order", "relabel_schedule"]


def placement_order(topology: Topology) -> tuple[int, ...]:
    """Ranks host-major: position ``p`` of a flat algorithm is rank ``order[p]``."""
    return tuple(sorted(range(topology.world_size), key=lambda r: (topology.hosts[r], r)))


def relabel_schedule(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """Positions and chunks ``p`` renamed rank ``order[p]`` (chunk ``c`` still ends on rank
    ``c``), the roles derived again."""
    n = schedule.world_size
    if sorted(order) != list(range(n)):
        raise InvalidArgumentError(f"order must be a permutation of 0..{n - 1}, got {list(order)}")

    def relabel(steps: Sequence[Step]) -> list[list[tuple[int, int, int]]]:
        return [[(order[t.src], order[t.dst], order[t.chunk]) for t in s.transfers] for s in steps]

    return assign_roles(schedule.algorithm, n, relabel(schedule.reduce), relabel(schedule.gather))


def build_placed_schedule(name: str, topology: Topology) -> Schedule:
    """Algorithm ``name`` (ring, butterfly, direct, ...) placed host-major on ``topology``."""
    base = build_schedule(name, topology.world_size)
    order = placement_order(topology)
    if order == tuple(range(topology.world_size)):
        return base
    return relabel_schedule(base, order)
