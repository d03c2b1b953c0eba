"""Schedules as plain data.

Over ``n`` ranks the buffer is cut into ``n`` chunks; chunk ``c`` is reduced onto its *sink*, rank
``c``. The reduce part is, per chunk, an in-tree towards the sink (a rank sends a chunk once, after
all its children arrived); the gather part an out-tree from the sink that forwards its compressed
bytes unchanged, so every rank decodes the same bytes. The transfers of a :class:`Step` are posted
together; a transfer's :class:`Role` (derived by :func:`assign_roles`) says what its receiver does
with it. :mod:`dqcoll.topology.checker` proves schedules correct.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Sequence

__all__ = ["Phase", "Role", "Schedule", "Step", "Transfer", "assign_roles"]


class Phase(enum.Enum):
    REDUCE = "reduce"  # reduce-scatter: partial sums travel towards each chunk's sink
    GATHER = "gather"  # all-gather: the sink's compressed result travels to everyone


class Role(enum.Enum):
    """What the *receiver* of a transfer does with it."""

    ACCUMULATE = "accumulate"  # a child that is not the last: decompress-accumulate
    FORWARD = "forward"  # last child of an internal node: fused decompress-accumulate-recompress
    FINAL = "final"  # the last child at the sink: decompress-accumulate, recompress, self-decode
    GATHER = "gather"  # all-gather: keep the bytes (to forward them) and decode them


@dataclasses.dataclass(frozen=True, order=True)
class Transfer:
    src: int
    dst: int
    chunk: int
    role: Role = dataclasses.field(default=Role.ACCUMULATE, compare=False)


@dataclasses.dataclass(frozen=True)
class Step:
    phase: Phase
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A whole all-reduce: ``reduce`` steps (reduce-scatter) then ``gather`` steps (all-gather)."""

    algorithm: str
    world_size: int
    reduce: tuple[Step, ...]
    gather: tuple[Step, ...]

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.reduce + self.gather

    def depth(self, chunk: int) -> int:
        """Longest path (in transfers) from a leaf to the sink of ``chunk`` in the reduce phase."""
        depth = {r: 0 for r in range(self.world_size)}
        for step in self.reduce:
            for t in step.transfers:
                if t.chunk == chunk:
                    depth[t.dst] = max(depth[t.dst], depth[t.src] + 1)
        return depth[chunk]

    def subtree_sizes(self) -> tuple[tuple[int, ...], ...]:
        """``sizes[rank][chunk]``: how many ranks' contributions the partial sum that ``rank``
        holds for ``chunk`` sums once all of its children arrived (1 at a leaf, n at the sink)."""
        n = self.world_size
        size = [[1] * n for _ in range(n)]
        for step in self.reduce:
            for t in step.transfers:
                size[t.dst][t.chunk] += size[t.src][t.chunk]
        return tuple(tuple(row) for row in size)

    def to_json(self) -> str:
        def steps(seq: Sequence[Step]) -> list[list[list[int | str]]]:
            return [[[t.src, t.dst, t.chunk, t.role.value] for t in s.transfers] for s in seq]

        return json.dumps({"algorithm": self.algorithm, "world_size": self.world_size,
                           "reduce": steps(self.reduce), "gather": steps(self.gather)})

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)

        def steps(phase: Phase) -> tuple[Step, ...]:
            return tuple(Step(phase, tuple(Transfer(int(a), int(b), int(c), Role(str(r)))
                                           for a, b, c, r in s)) for s in data[phase.value])

        return cls(data["algorithm"], int(data["world_size"]), steps(Phase.REDUCE),
                   steps(Phase.GATHER))


def assign_roles(
    algorithm: str,
    world_size: int,
    reduce: Iterable[Iterable[tuple[int, int, int]]],
    gather: Iterable[Iterable[tuple[int, int, int]]],
) -> Schedule:
    """A :class:`Schedule` from bare ``(src, dst, chunk)`` triples per step: a rank's last receipt
    of a chunk (by step, then source rank) is ``FORWARD`` (``FINAL`` at the sink), earlier ones
    ``ACCUMULATE``, gather ones ``GATHER``. Sorted per step: the schedule fixes the order."""
    reduce_steps = [sorted(set(step)) for step in reduce]
    gather_steps = [sorted(set(step)) for step in gather]
    # (dst, chunk) -> (step index, src) of its last receipt: steps are sorted, so the last written
    last = {(d, c): (i, s) for i, step in enumerate(reduce_steps) for s, d, c in step}

    def role(index: int, src: int, dst: int, chunk: int) -> Role:
        if last[(dst, chunk)] != (index, src):
            return Role.ACCUMULATE
        return Role.FINAL if dst == chunk else Role.FORWARD

    reduce_out = tuple(
        Step(Phase.REDUCE, tuple(Transfer(s, d, c, role(i, s, d, c)) for s, d, c in step))
        for i, step in enumerate(reduce_steps) if step)
    gather_out = tuple(Step(Phase.GATHER, tuple(Transfer(s, d, c, Role.GATHER) for s, d, c in step))
                       for step in gather_steps if step)
    return Schedule(algorithm, world_size, reduce_out, gather_out)
