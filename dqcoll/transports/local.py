"""The ``local`` transport: ``n`` ranks as threads of one process (:class:`LocalHub`), for tests.

Messages are copied into the receiver's mailbox when sent (on CUDA with an event, so ranks may
run on streams of their own). A message of the wrong size raises
:class:`~dqcoll.errors.PeerError` and aborts the group; :meth:`LocalHub.abort` wakes every
waiting rank with :class:`~dqcoll.errors.CommAbortedError`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch

from .. import envs
from ..errors import CollectiveTimeoutError, CommAbortedError, InvalidArgumentError, PeerError
from .base import ALLREDUCE_OPS, Counters, check_peers, combine_in_rank_order

__all__ = ["LocalHub", "LocalTransport"]


class LocalHub:
    """State shared by the ranks of one local group."""

    def __init__(self, world_size: int, *, timeout_s: float | None = None) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = envs.timeout_s() if timeout_s is None else timeout_s
        self._cond = threading.Condition()
        self._mailboxes: dict[tuple[int, int], collections.deque[torch.Tensor]] = (
            collections.defaultdict(collections.deque)
        )
        # small all-reduces: sequence number -> deposited tensors, and how many ranks read them
        self._reduce_slots: dict[int, list[torch.Tensor | None]] = {}
        self._reduce_reads: dict[int, int] = {}
        self._reduce_seq = [0] * world_size
        self._aborted: str | None = None

    def transport(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)

    def abort(self, reason: str) -> None:
        with self._cond:
            if self._aborted is None:
                self._aborted = reason
            self._cond.notify_all()

    def _check_aborted(self) -> None:
        if self._aborted is not None:
            raise CommAbortedError(f"communicator aborted: {self._aborted}")

    def _wait(self, ready, *, rank: int, waiting_for: str, what: str) -> None:  # type: ignore[no-untyped-def]
        if not self._cond.wait_for(lambda: self._aborted is not None or ready(), self.timeout_s):
            raise CollectiveTimeoutError(f"rank {rank}: timed out after {self.timeout_s:g} s "
                                         f"waiting for {waiting_for} at {what}")
        self._check_aborted()


class LocalTransport:
    name = "local"
    devices = ("cpu", "cuda")  # mailboxes copy on the tensors' own device

    def __init__(self, hub: LocalHub, rank: int) -> None:
        if not 0 <= rank < hub.world_size:
            raise InvalidArgumentError(f"rank {rank} outside [0, {hub.world_size})")
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size
        self.counters = Counters()

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, what: str) -> None:
        hub = self.hub
        check_peers(sends, recvs, self.rank, self.world_size)
        with hub._cond:
            hub._check_aborted()
            for peer, tensor in sends:
                hub._mailboxes[(self.rank, peer)].append(_deposit(tensor))
                self.counters.count_send(tensor.nbytes)
            hub._cond.notify_all()
            for peer, buffer in recvs:
                box = hub._mailboxes[(peer, self.rank)]
                hub._wait(lambda box=box: len(box) > 0, rank=self.rank,
                          waiting_for=f"a message from rank {peer}", what=what)
                message = _read(box.popleft())
                if message.nbytes != buffer.nbytes:
                    reason = (f"rank {self.rank}: rank {peer} sent {message.nbytes} bytes at "
                              f"{what}, {buffer.nbytes} expected; the message is refused")
                    hub.abort(reason)  # the condition's lock is re-entrant
                    raise PeerError(reason)
                buffer.copy_(message.view(buffer.dtype).view(buffer.shape))
                self.counters.count_recv(buffer.nbytes)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        hub = self.hub
        n = self.world_size
        with hub._cond:
            hub._check_aborted()
            seq = hub._reduce_seq[self.rank]
            hub._reduce_seq[self.rank] += 1
            slots = hub._reduce_slots.setdefault(seq, [None] * n)
            slots[self.rank] = _deposit(tensor)
            hub._cond.notify_all()
            hub._wait(lambda: all(s is not None for s in slots), rank=self.rank,
                      waiting_for="every rank's contribution to a small all-reduce", what=what)
            shapes = {tuple(s.shape) for s in slots if s is not None}
            if len(shapes) != 1:
                raise InvalidArgumentError(
                    f"rank {self.rank}: small all-reduce at {what} got shapes {sorted(shapes)}"
                )
            copies = [_read(s) for s in slots if s is not None]  # all are, after the wait
            result = combine_in_rank_order([c.to(copies[0].device) for c in copies], op)
            hub._reduce_reads[seq] = hub._reduce_reads.get(seq, 0) + 1
            if hub._reduce_reads[seq] == n:
                del hub._reduce_slots[seq]
                del hub._reduce_reads[seq]
        tensor.copy_(result)
        self.counters.count_allreduce(tensor.nbytes, n)

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), "sum", what=what)

    def abort(self, reason: str) -> None:
        self.hub.abort(f"rank {self.rank}: {reason}")

    def close(self) -> None:
        pass


def _deposit(tensor: torch.Tensor) -> torch.Tensor:
    """A private copy of ``tensor`` for a mailbox; on CUDA with an event marking it ready."""
    copy = tensor.detach().clone()
    if copy.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(copy.device))
        copy._dqcoll_ready = event  # type: ignore[attr-defined]
    return copy


def _read(copy: torch.Tensor) -> torch.Tensor:
    """``copy`` made safe to read on the reader's current stream."""
    event = getattr(copy, "_dqcoll_ready", None)
    if event is not None:
        stream = torch.cuda.current_stream(copy.device)
        stream.wait_event(event)
        copy.record_stream(stream)  # its memory is not reused before this stream has read it
    return copy
