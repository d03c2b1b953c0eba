"""The reduce phase of a schedule as arrays, step by step, without the :class:`Schedule` object.

A :class:`~.schedule.Schedule` holds one Python object per transfer: a ring over ``n`` ranks
has ``2 n (n - 1)`` of them, 1.3e8 at n = 8192 (~60 GB and ~15 minutes to build). The simulator
needs much less: for each reduce step, the transfers of the chunks it is working on, with what
the executor derives from the tree (the receiver's role, whether the sender is a leaf, the order
of arrivals at a receiver, and the partial-sum sizes of sender and receiver). A
:class:`ReducePlan` hands out exactly that, one step and one set of chunks at a time:

* :func:`plan_of_schedule`: any schedule (the arrays derived from its transfers, as the executor
  derives them: :func:`.schedule.assign_roles`, :meth:`.schedule.Schedule.subtree_sizes`);
* :func:`flat_plan` / :func:`placed_plan`: ``ring``, ``butterfly`` and ``direct``, placed on an
  order of ranks (:func:`.placement.placement_order`), in closed form: O(transfers of the step)
  work and memory per call, nothing kept per transfer. ``tests/test_topology_steps.py`` checks
  them against :func:`plan_of_schedule` of the built and placed schedules.

Roles are coded :data:`ACCUMULATE`, :data:`FORWARD`, :data:`FINAL` (int8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .schedule import Role, Schedule

__all__ = ["ACCUMULATE", "FINAL", "FORWARD", "ReducePlan", "StepArrays", "flat_plan",
           "placed_plan", "plan_of_schedule"]

ACCUMULATE, FORWARD, FINAL = 0, 1, 2
_ROLE_CODE = {Role.ACCUMULATE: ACCUMULATE, Role.FORWARD: FORWARD, Role.FINAL: FINAL}


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """The transfers of one reduce step (for some chunks), one entry each."""

    src: np.ndarray  # int64 sender rank
    dst: np.ndarray  # int64 receiver rank
    chunk: np.ndarray  # int64 chunk (its sink is rank ``chunk``)
    role: np.ndarray  # int8: what the receiver does (ACCUMULATE, FORWARD, FINAL)
    leaf: np.ndarray  # bool: the sender compresses its own data (nothing arrived for the chunk)
    arrival: np.ndarray  # int64: k-th arrival at (dst, chunk) in this step, by source rank
    src_count: np.ndarray  # int64: ranks the sent partial sum holds (the executor's ``count``)
    dst_count: np.ndarray  # int64: ranks the receiver's partial sum holds once complete

    def __len__(self) -> int:
        return int(self.src.shape[0])

    def take(self, index: np.ndarray) -> StepArrays:
        return StepArrays(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))

    def as_set(self) -> set[tuple[int, ...]]:
        """The transfers as tuples (for comparisons in tests)."""
        return set(zip(*(getattr(self, f.name).tolist() for f in dataclasses.fields(self)),
                       strict=True))


class ReducePlan:
    """The reduce phase of an all-reduce schedule of ``world_size`` ranks and as many chunks."""

    algorithm: str
    world_size: int
    num_steps: int

    def step(self, index: int, chunks: np.ndarray | None = None) -> StepArrays:
        """The transfers of reduce step ``index`` whose chunk is in ``chunks`` (all: None)."""
        raise NotImplementedError

    def subtree(self) -> np.ndarray:
        """int64 ``[rank, chunk]``: :meth:`.schedule.Schedule.subtree_sizes` as an array."""
        raise NotImplementedError

    def symmetric(self) -> bool:
        """Whether every chunk's tree has the same shape (then chunk 0 stands for all)."""
        return False

    def profile(self) -> tuple[int, int, int]:
        """Per chunk, the most ``(transfers in one step, sent payloads held between steps,
        unfinished partial sums held between steps)``: what the simulator holds per chunk in
        flight (the maximum over chunks, or chunk 0's when :meth:`symmetric`)."""
        n = self.world_size
        chunks = np.zeros(1, np.int64) if self.symmetric() else np.arange(n, dtype=np.int64)
        column = np.full(n, -1, np.int64)
        column[chunks] = np.arange(chunks.shape[0])
        records = np.zeros((n, chunks.shape[0]), bool)  # (holder, chunk): a payload to send
        partial = np.zeros((n, chunks.shape[0]), bool)  # (receiver, chunk): an unfinished sum
        per_step = held = unfinished = 0
        for k in range(self.num_steps):
            s = self.step(k, chunks)
            if not len(s):
                continue
            c = column[s.chunk]
            per_step = max(per_step, int(np.bincount(c).max()))
            records[s.src[~s.leaf], c[~s.leaf]] = False
            forward = s.role == FORWARD
            records[s.dst[forward], c[forward]] = True
            partial[s.dst, c] = s.role == ACCUMULATE  # the last arrival of a step decides
            last = s.role != ACCUMULATE
            partial[s.dst[last], c[last]] = False
            held = max(held, int(records.sum(0).max()))
            unfinished = max(unfinished, int(partial.sum(0).max()))
        return per_step, held, unfinished


def _counts_from_subtree(subtree: np.ndarray, src: np.ndarray, dst: np.ndarray,
                         chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return subtree[src, chunk], subtree[dst, chunk]


class _SchedulePlan(ReducePlan):
    def __init__(self, schedule: Schedule) -> None:
        self.algorithm = schedule.algorithm
        self.world_size = n = schedule.world_size
        self._subtree = np.asarray(schedule.subtree_sizes(), dtype=np.int64).reshape(n, n)
        self._steps: list[StepArrays] = []
        received: set[tuple[int, int]] = set()
        for step in schedule.reduce:
            ts = step.transfers
            src = np.array([t.src for t in ts], dtype=np.int64)
            dst = np.array([t.dst for t in ts], dtype=np.int64)
            chunk = np.array([t.chunk for t in ts], dtype=np.int64)
            role = np.array([_ROLE_CODE[t.role] for t in ts], dtype=np.int8)
            leaf = np.array([(t.src, t.chunk) not in received for t in ts], dtype=bool)
            seen: dict[tuple[int, int], int] = {}
            arrival = np.empty(len(ts), dtype=np.int64)
            order = sorted(range(len(ts)), key=lambda i: (ts[i].src, ts[i].dst, ts[i].chunk))
            for i in order:  # by source rank: the executor's order of accumulation
                t = ts[i]
                arrival[i] = seen.get((t.dst, t.chunk), 0)
                seen[(t.dst, t.chunk)] = int(arrival[i]) + 1
            received.update((t.dst, t.chunk) for t in ts)
            sc, dc = _counts_from_subtree(self._subtree, src, dst, chunk)
            self._steps.append(StepArrays(src, dst, chunk, role, leaf, arrival, sc, dc))
        self.num_steps = len(self._steps)

    def step(self, index: int, chunks: np.ndarray | None = None) -> StepArrays:
        s = self._steps[index]
        if chunks is None:
            return s
        return s.take(np.flatnonzero(np.isin(s.chunk, chunks)))

    def subtree(self) -> np.ndarray:
        return self._subtree


def plan_of_schedule(schedule: Schedule) -> ReducePlan:
    """The reduce phase of any :class:`Schedule` as arrays (holds them all: for moderate n)."""
    return _SchedulePlan(schedule)


def _lowbit_index(v: np.ndarray) -> np.ndarray:
    """``log2(v & -v)`` for positive int64 ``v``."""
    low = v & -v
    return np.log2(low.astype(np.float64)).astype(np.int64)  # exact for powers of two


class _FlatPlan(ReducePlan):
    """``ring`` / ``butterfly`` / ``direct`` over positions ``0..n-1``, position ``p`` played by
    rank ``order[p]`` and chunk ``q`` renamed ``order[q]`` (:func:`.placement.relabel_schedule`)."""

    def __init__(self, algorithm: str, world_size: int, order: Sequence[int] | None) -> None:
        n = world_size
        if algorithm not in ("ring", "butterfly", "direct"):
            raise InvalidArgumentError(
                f"no closed-form plan for {algorithm!r}; use plan_of_schedule")
        self.algorithm = algorithm
        self.world_size = n
        self.order = (np.arange(n, dtype=np.int64) if order is None
                      else np.asarray(order, dtype=np.int64))
        if sorted(self.order.tolist()) != list(range(n)):
            raise InvalidArgumentError(f"order must be a permutation of 0..{n - 1}")
        self.inverse = np.empty(n, np.int64)
        self.inverse[self.order] = np.arange(n, dtype=np.int64)
        if n == 1:
            self.num_steps = 0
        elif algorithm == "ring":
            self.num_steps = n - 1
        elif algorithm == "butterfly":
            self.num_steps = (n - 1).bit_length()
            self._levels = self.num_steps
        else:
            self.num_steps = 1

    def symmetric(self) -> bool:
        return True

    def _positions(self, chunks: np.ndarray | None) -> np.ndarray:
        if chunks is None:
            return np.arange(self.world_size, dtype=np.int64)
        return self.inverse[np.asarray(chunks, dtype=np.int64)]

    def step(self, index: int, chunks: np.ndarray | None = None) -> StepArrays:
        if not 0 <= index < self.num_steps:
            raise IndexError(f"reduce step {index} of {self.num_steps}")
        n, order = self.world_size, self.order
        q = self._positions(chunks)
        if self.algorithm == "ring":
            m = q.shape[0]
            p = (q + 1 + index) % n
            last = index == n - 2
            return StepArrays(
                order[p], order[(p + 1) % n], order[q],
                np.full(m, FINAL if last else FORWARD, np.int8),
                np.full(m, index == 0, bool), np.zeros(m, np.int64),
                np.full(m, index + 1, np.int64), np.full(m, index + 2, np.int64))
        if self.algorithm == "butterfly":
            k = index
            v = (1 << k) * (2 * np.arange(max(0, -(-(n - (1 << k)) // (1 << (k + 1)))),
                                          dtype=np.int64) + 1)
            v = v[v < n]
            qq = np.repeat(q, v.shape[0])
            vv = np.tile(v, q.shape[0])
            w = vv - (1 << k)
            leaf = np.full(vv.shape, k == 0) | (vv + 1 >= n)
            src_count = np.minimum(1 << k, n - vv)
            safe_w = np.where(w > 0, w, 1)
            dst_count = np.where(w == 0, n, np.minimum(1 << _lowbit_index(safe_w), n - w))
            m_even = ((w >> (k + 1)) & 1) == 0
            has_next = np.where(w == 0, (1 << (k + 1)) < n,
                                m_even & (w + (1 << (k + 1)) < n))
            role = np.where(has_next, ACCUMULATE, np.where(w == 0, FINAL, FORWARD)).astype(np.int8)
            return StepArrays(order[(qq + vv) % n], order[(qq + w) % n], order[qq], role, leaf,
                              np.zeros(vv.shape, np.int64), src_count, dst_count)
        # direct: every rank sends chunk c straight to rank c (ranks, not positions: the set of
        # transfers does not depend on the order)
        c = np.sort(order[q])
        r = np.arange(n, dtype=np.int64)
        cc = np.repeat(c, n)
        rr = np.tile(r, c.shape[0])
        keep = rr != cc
        cc, rr = cc[keep], rr[keep]
        last_src = np.where(cc == n - 1, n - 2, n - 1)
        role = np.where(rr == last_src, FINAL, ACCUMULATE).astype(np.int8)
        size = cc.shape[0]
        return StepArrays(rr, cc, cc, role, np.ones(size, bool), rr - (rr > cc),
                          np.ones(size, np.int64), np.full(size, n, np.int64))

    def subtree(self) -> np.ndarray:
        n = self.world_size
        p = np.arange(n, dtype=np.int64)[:, None]
        q = np.arange(n, dtype=np.int64)[None, :]
        if self.algorithm == "ring":
            pos = (p - q - 1) % n + 1
        elif self.algorithm == "butterfly":
            v = (p - q) % n
            safe = np.where(v > 0, v, 1)
            pos = np.where(v == 0, n, np.minimum(1 << _lowbit_index(safe), n - v))
        else:
            pos = np.where(p == q, n, 1)
        pos = pos.astype(np.int64)
        if n == 1:
            pos = np.ones((1, 1), np.int64)
        return pos[self.inverse][:, self.inverse]


def flat_plan(algorithm: str, world_size: int,
              order: Sequence[int] | None = None) -> ReducePlan:
    """``ring``, ``butterfly`` or ``direct`` on ``world_size`` ranks in closed form, placed on
    ``order`` (position ``p`` is rank ``order[p]``; None: the identity)."""
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    return _FlatPlan(algorithm, world_size, order)


def placed_plan(algorithm: str, topology) -> ReducePlan:  # type: ignore[no-untyped-def]
    """:func:`.placement.build_placed_schedule`'s schedule as a closed-form plan."""
    from .placement import placement_order

    return flat_plan(algorithm, topology.world_size, placement_order(topology))
