"""Proves a :class:`~dqcoll.topology.schedule.Schedule` correct by symbolic execution.

:func:`check_schedule` fails if, in the reduce phase, a contribution is counted twice, a rank
sends a chunk twice or before all its children arrived, or a sink ends without every rank's
contribution exactly once; in the gather phase, if a rank forwards a result it does not hold or
any rank does not receive every chunk's result exactly once; or if roles do not match the tree
shape (:func:`~dqcoll.topology.schedule.assign_roles`).
"""

from __future__ import annotations

from collections import Counter

from .schedule import Phase, Role, Schedule, Transfer, assign_roles

__all__ = ["ScheduleError", "check_schedule"]


class ScheduleError(ValueError):
    """A schedule violates a property of the module docstring."""


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` naming the first violated property; return None if correct."""
    n = schedule.world_size
    if n < 1:
        raise ScheduleError(f"world_size must be >= 1, got {n}")
    held = [[frozenset([r]) for _ in range(n)] for r in range(n)]  # held[rank][chunk]
    sent = [[False] * n for _ in range(n)]
    if any(step.phase is not Phase.REDUCE for step in schedule.reduce):
        raise ScheduleError("a gather step inside the reduce phase")
    pending_children = Counter((t.dst, t.chunk) for step in schedule.reduce for t in step.transfers)
    for index, step in enumerate(schedule.reduce):
        incoming: list[tuple[int, int, frozenset[int]]] = []
        for t in step.transfers:
            _check_ranks(t, n, index)
            if sent[t.src][t.chunk]:
                raise ScheduleError(f"reduce step {index}: rank {t.src} sends chunk {t.chunk} "
                                    "twice")
            if pending_children[(t.src, t.chunk)]:
                raise ScheduleError(f"reduce step {index}: rank {t.src} sends chunk {t.chunk} "
                                    "before all its children arrived")
            if t.src == t.chunk:
                raise ScheduleError(f"reduce step {index}: sink {t.src} sends its own chunk")
            sent[t.src][t.chunk] = True
            incoming.append((t.dst, t.chunk, held[t.src][t.chunk]))
        for dst, chunk, contribution in incoming:
            if sent[dst][chunk]:
                raise ScheduleError(f"reduce step {index}: rank {dst} receives chunk {chunk} "
                                    "after sending it")
            overlap = held[dst][chunk] & contribution
            if overlap:
                raise ScheduleError(f"reduce step {index}: chunk {chunk} counts ranks "
                                    f"{sorted(overlap)} twice at rank {dst}")
            held[dst][chunk] = held[dst][chunk] | contribution
            pending_children[(dst, chunk)] -= 1
    _check_roles(schedule)
    everyone = frozenset(range(n))
    for chunk in range(n):
        if held[chunk][chunk] != everyone:
            missing = sorted(everyone - held[chunk][chunk])
            raise ScheduleError(f"chunk {chunk}: sink {chunk} misses contributions of ranks "
                                f"{missing}")  # so every other rank has sent its contribution

    final = [[c == r for c in range(n)] for r in range(n)]
    for index, step in enumerate(schedule.gather):
        if step.phase is not Phase.GATHER:
            raise ScheduleError("a reduce step inside the gather phase")
        arrivals = []
        for t in step.transfers:
            _check_ranks(t, n, index)
            if t.role is not Role.GATHER:
                raise ScheduleError(f"gather step {index}: transfer {t} has role {t.role.value}")
            if not final[t.src][t.chunk]:
                raise ScheduleError(f"gather step {index}: rank {t.src} forwards chunk {t.chunk} "
                                    "before it has it")
            arrivals.append((t.dst, t.chunk))
        for dst, chunk in arrivals:
            if final[dst][chunk]:
                raise ScheduleError(f"gather step {index}: rank {dst} receives chunk {chunk} twice")
            final[dst][chunk] = True
    for rank in range(n):
        for chunk in range(n):
            if not final[rank][chunk]:
                raise ScheduleError(f"rank {rank} never receives the result of chunk {chunk}")


def _check_ranks(t: Transfer, n: int, index: int) -> None:
    for name in ("src", "dst", "chunk"):
        if not 0 <= getattr(t, name) < n:
            raise ScheduleError(f"step {index}: {name}={getattr(t, name)} outside [0, {n})")
    if t.src == t.dst:
        raise ScheduleError(f"step {index}: rank {t.src} sends chunk {t.chunk} to itself")


def _check_roles(schedule: Schedule) -> None:
    """Each reduce transfer has the role :func:`assign_roles` derives from the tree's shape."""
    triples = [[(t.src, t.dst, t.chunk) for t in step.transfers] for step in schedule.reduce]
    derived = {(t.src, t.dst, t.chunk): t.role for step in assign_roles(
        schedule.algorithm, schedule.world_size, triples, ()).reduce for t in step.transfers}
    for step in schedule.reduce:
        for t in step.transfers:
            expected = derived[(t.src, t.dst, t.chunk)]
            if t.role is not expected:
                raise ScheduleError(f"chunk {t.chunk} at rank {t.dst}: child {t.src} has role "
                                    f"{t.role.value}, expected {expected.value}")
