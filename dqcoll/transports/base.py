"""The transport protocol (:class:`Transport`), contract in docs/design.md §5 ("A transport"):
``exchange`` receives into buffers of exactly the size sent; :class:`Counters` count an
``allreduce`` as a ring's bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import InvalidArgumentError
from ..types import FRAME_HEADROOM

__all__ = ["ALLREDUCE_OPS", "FRAME_HEADROOM", "Counters", "Transport", "combine_in_rank_order",
           "exchange_framed", "ring_allreduce_nbytes"]

ALLREDUCE_OPS = ("sum", "max", "min")


class Counters(dict[str, int]):
    """Per-rank traffic counters (bytes and message counts), all plain ints."""

    KEYS = ("bytes_sent", "bytes_recv", "payload_bytes_sent", "allreduce_bytes_sent",
            "messages_sent", "messages_recv", "allreduces")

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(self.KEYS, 0))

    def reset(self) -> None:
        self.update(dict.fromkeys(self.KEYS, 0))

    def count_send(self, nbytes: int) -> None:
        self["bytes_sent"] += nbytes
        self["payload_bytes_sent"] += nbytes
        self["messages_sent"] += 1

    def count_recv(self, nbytes: int) -> None:
        self["bytes_recv"] += nbytes
        self["messages_recv"] += 1

    def count_allreduce(self, nbytes: int, world_size: int, *, gathered: bool = False) -> None:
        wire = (world_size - 1) * nbytes if gathered else ring_allreduce_nbytes(nbytes, world_size)
        self["bytes_sent"] += wire
        self["bytes_recv"] += wire
        self["allreduce_bytes_sent"] += wire
        self["allreduces"] += 1


Exchange = Callable[[Sequence[tuple[int, torch.Tensor]], Sequence[tuple[int, torch.Tensor]], str],
                    None]


def combine_in_rank_order(copies: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """Rank 0's to rank n-1's copies combined left to right into a new tensor."""
    combine = getattr(torch, {"sum": "add", "max": "maximum", "min": "minimum"}[op])
    acc = copies[0].clone()
    for other in copies[1:]:
        combine(acc, other, out=acc)
    return acc


def gather_in_rank_order(post: Exchange, rank: int, world_size: int, flat: torch.Tensor, op: str,
                         what: str) -> torch.Tensor:
    """:func:`reduce_in_rank_order`'s bits from one exchange of every rank's copy (as bytes)."""
    copies = torch.empty(world_size, flat.numel(), dtype=flat.dtype, device=flat.device)
    copies[rank] = flat
    peers = [p for p in range(world_size) if p != rank]
    post([(p, flat.view(torch.uint8)) for p in peers],
         [(p, copies[p].view(torch.uint8)) for p in peers], what)
    return combine_in_rank_order(list(copies), op)


def reduce_in_rank_order(post: Exchange, rank: int, world_size: int, flat: torch.Tensor, op: str,
                         what: str) -> torch.Tensor:
    """A small all-reduce whose result is the same bits on every transport (native ones add in
    their own order, so DynamiQ's widths would depend on the transport): scatter, combine in
    rank order, gather. ``post(sends, recvs, what)`` runs one grouped exchange."""
    n = world_size
    numel = flat.numel()
    bounds = [c * numel // n for c in range(n + 1)]
    mine = slice(bounds[rank], bounds[rank + 1])
    peers = [p for p in range(n) if p != rank]
    shard = bounds[rank + 1] - bounds[rank]
    received = {p: torch.empty(shard, dtype=flat.dtype, device=flat.device) for p in peers}
    sends = [(p, flat[bounds[p] : bounds[p + 1]]) for p in peers if bounds[p + 1] > bounds[p]]
    recvs = [(p, received[p]) for p in peers if shard]
    post(sends, recvs, f"{what} (small all-reduce, scatter)")
    acc = combine_in_rank_order([flat[mine] if p == rank else received[p] for p in range(n)], op)
    out = torch.empty_like(flat)
    out[mine] = acc
    sends = [(p, acc) for p in peers if shard]
    recvs = [(p, out[bounds[p] : bounds[p + 1]]) for p in peers if bounds[p + 1] > bounds[p]]
    post(sends, recvs, f"{what} (small all-reduce, gather)")
    return out


def check_peers(sends: Sequence[tuple[int, torch.Tensor]],
                recvs: Sequence[tuple[int, torch.Tensor]], rank: int, world_size: int) -> None:
    """An exchange sends to and receives from each peer at most once, and only real peers."""
    for kind, items in (("send to", sends), ("receive from", recvs)):
        peers = [peer for peer, _ in items]
        if len(set(peers)) != len(peers):
            raise InvalidArgumentError(
                f"rank {rank}: one exchange may {kind} each peer once: {peers}")
        for peer in peers:
            if not 0 <= peer < world_size or peer == rank:
                raise InvalidArgumentError(f"rank {rank}: cannot {kind} rank {peer}")


def exchange_framed(transport: Transport, sends: Sequence[tuple[int, torch.Tensor]],
                    recvs: Sequence[tuple[int, torch.Tensor]], *, what: str) -> None:
    """``transport.exchange`` of uint8 frames: the first :data:`FRAME_HEADROOM` bytes are the
    transport's to use (gloo's header), the payload follows; checks and counts as ``exchange``."""
    own = getattr(transport, "exchange_framed", None)
    if own is not None:
        own(sends, recvs, what=what)
        return
    transport.exchange([(peer, frame[FRAME_HEADROOM:]) for peer, frame in sends],
                       [(peer, frame[FRAME_HEADROOM:]) for peer, frame in recvs], what=what)


def ring_allreduce_nbytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: 2 (n-1)/n * nbytes, rounded up."""
    if world_size <= 1:
        return 0
    return -(-2 * (world_size - 1) * nbytes // world_size)


@runtime_checkable
class Transport(Protocol):
    rank: int
    world_size: int
    counters: Counters
    name: str

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, what: str) -> None: ...

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None: ...

    def barrier(self, *, what: str = "barrier") -> None: ...

    def abort(self, reason: str) -> None: ...

    def close(self) -> None: ...
