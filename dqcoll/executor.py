"""Runs any :class:`~dqcoll.topology.Schedule` with any scheme call over any transport.

The executor knows nothing of codecs: it walks the steps of the schedule, bundles the payloads a
rank sends to one peer in one step into one message (one ``exchange`` per step, at most one message
per peer and direction), and tells the scheme call what each arriving payload is for (see the table
in :mod:`dqcoll.schemes.base`). Payload sizes come from the call on both sides, so receive buffers
are exact and zero-byte messages are skipped by sender and receiver alike.

A leaf compresses a chunk right before the step that sends it, and an internal node keeps only
the one payload it will forward, so at most one compressed copy of the buffer is alive at a time
besides the all-gather's.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .schemes.base import SchemeCall
from .topology.schedule import Role, Schedule
from .types import Collective
from .transports.base import Transport

__all__ = ["RankPlan", "rank_plan", "run_schedule"]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    # (peer, chunks in send order); payloads for one peer travel as one message
    sends: tuple[tuple[int, tuple[int, ...]], ...]
    # (peer, ((chunk, role), ...)) in processing order
    recvs: tuple[tuple[int, tuple[tuple[int, Role], ...]], ...]


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's view of a schedule."""

    reduce: tuple[StepPlan, ...]
    gather: tuple[StepPlan, ...]
    # contributions summed in the partial sum rank r holds for chunk c once its children arrived:
    subtree: tuple[tuple[int, ...], ...]  # subtree[rank][chunk]


@functools.lru_cache(maxsize=256)
def rank_plan(schedule: Schedule, rank: int) -> RankPlan:
    def plan(steps):  # type: ignore[no-untyped-def]
        result = []
        for step in steps:
            sends: dict[int, list[int]] = {}
            recvs: dict[int, list[tuple[int, Role]]] = {}
            for t in step.transfers:  # sorted by (src, dst, chunk)
                if t.src == rank:
                    sends.setdefault(t.dst, []).append(t.chunk)
                if t.dst == rank:
                    recvs.setdefault(t.src, []).append((t.chunk, t.role))
            result.append(
                StepPlan(
                    sends=tuple((p, tuple(c)) for p, c in sorted(sends.items())),
                    recvs=tuple((p, tuple(c)) for p, c in sorted(recvs.items())),
                )
            )
        return tuple(result)

    return RankPlan(plan(schedule.reduce), plan(schedule.gather), schedule.subtree_sizes())


def run_schedule(
    schedule: Schedule,
    call: SchemeCall,
    transport: Transport,
    *,
    what: str,
    collective: Collective = Collective.ALLREDUCE,
) -> None:
    """Run ``collective`` on ``call.work`` across the ranks of ``transport`` along ``schedule``.

    * all-reduce: on return every rank's ``call.work`` holds the decoded result of every chunk,
      decoded from the same bytes on every rank;
    * reduce-scatter: only the reduce steps; chunk ``rank`` holds the decoded result;
    * all-gather: only the gather steps, starting from each rank's own chunk, which its owner
      compresses and decodes like everyone else (so all ranks hold identical values).
    """
    rank = transport.rank
    n = transport.world_size
    if schedule.world_size != n:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, transport has {n}")
    plan = rank_plan(schedule, rank)
    subtree = plan.subtree
    device = call.work.device
    outgoing: dict[int, torch.Tensor] = {}  # reduce phase: the payload this rank forwards
    final: dict[int, torch.Tensor] = {}  # gather phase: each chunk's result, compressed

    def bundle(chunks: tuple[int, ...], payload_of) -> torch.Tensor:  # type: ignore[no-untyped-def]
        parts = [payload_of(c) for c in chunks]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def leaf_or_forward(chunk: int) -> torch.Tensor:
        if chunk in outgoing:
            return outgoing.pop(chunk)
        return call.compress(chunk, 1)  # a leaf: nothing arrived for this chunk

    phases = []
    if collective is not Collective.ALL_GATHER:
        phases.append(("reduce", plan.reduce))
    gather_count = n
    if collective is Collective.ALL_GATHER:
        gather_count = 1  # each chunk is one rank's data, not a sum
        final[rank] = call.compress(rank, 1)
        call.decompress(rank, final[rank], 1)
    if collective is not Collective.REDUCE_SCATTER:
        phases.append(("gather", plan.gather))
    for phase, steps in phases:
        for index, step in enumerate(steps):
            label = f"{what} {phase} step {index}"
            sends = []
            for peer, chunks in step.sends:
                payload_of = leaf_or_forward if phase == "reduce" else final.__getitem__
                message = bundle(chunks, payload_of)
                if message.numel():
                    sends.append((peer, message))
            recvs = []
            layouts = []
            for peer, items in step.recvs:
                sizes = [
                    call.payload_nbytes(c, subtree[peer][c] if phase == "reduce" else gather_count)
                    for c, _ in items
                ]
                buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
                if buffer.numel():
                    recvs.append((peer, buffer))
                layouts.append((peer, items, sizes, buffer))
            transport.exchange(sends, recvs, what=label)
            for peer, items, sizes, buffer in layouts:
                offset = 0
                for (chunk, role), size in zip(items, sizes, strict=True):
                    payload = buffer[offset : offset + size]
                    offset += size
                    if role is Role.GATHER:
                        final[chunk] = payload
                        call.decompress(chunk, payload, gather_count)
                        continue
                    count = subtree[peer][chunk]
                    if role is Role.ACCUMULATE:
                        call.decompress_accumulate(chunk, payload, count)
                    elif role is Role.FORWARD:
                        outgoing[chunk] = call.decompress_accumulate_recompress(
                            chunk, payload, count, subtree[rank][chunk]
                        )
                    else:  # Role.FINAL: the sink recompresses once more and decodes its own bytes
                        final[chunk] = call.decompress_accumulate_recompress(
                            chunk, payload, count, n
                        )
                        call.decompress(chunk, final[chunk], n)
