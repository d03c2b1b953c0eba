"""The ``local`` transport: ``n`` ranks as threads of one process (:class:`LocalHub`), for tests.

Messages are copied into the receiver's mailbox when sent (on CUDA with an event, so ranks may
run on streams of their own); one of the wrong size raises :class:`~dqcoll.errors.PeerError`
and aborts the group, whose ranks then raise :class:`~dqcoll.errors.CommAbortedError`."""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Sequence

import torch

from .. import envs
from ..errors import CollectiveTimeoutError, CommAbortedError, InvalidArgumentError, PeerError
from .base import ALLREDUCE_OPS, Counters, check_peers, gather_in_rank_order

__all__ = ["LocalHub", "LocalTransport"]


class LocalHub:
    """State shared by the ranks of one local group."""

    def __init__(self, world_size: int, *, timeout_s: float | None = None) -> None:
        if world_size < 1:
            raise InvalidArgumentError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout_s = envs.timeout_s() if timeout_s is None else timeout_s
        self._cond = threading.Condition()
        # (channel, sender, receiver) -> messages; small all-reduces have a channel of their own
        self._mailboxes: dict[tuple[str, int, int], collections.deque[torch.Tensor]] = (
            collections.defaultdict(collections.deque)
        )
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
        check_peers(sends, recvs, self.rank, self.world_size)
        self._post(sends, recvs, what, self.counters, "exchange")

    def _post(self, sends: Sequence[tuple[int, torch.Tensor]],
              recvs: Sequence[tuple[int, torch.Tensor]], what: str, counters: Counters,
              channel: str) -> None:
        hub = self.hub
        with hub._cond:
            hub._check_aborted()
            for peer, tensor in sends:
                hub._mailboxes[(channel, self.rank, peer)].append(_deposit(tensor))
                counters.count_send(tensor.nbytes)
            hub._cond.notify_all()
            for peer, buffer in recvs:
                box = hub._mailboxes[(channel, peer, self.rank)]
                ready = lambda: hub._aborted is not None or len(box) > 0  # noqa: B023, E731
                if not hub._cond.wait_for(ready, hub.timeout_s):
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out after {hub.timeout_s:g} s waiting for a "
                        f"message from rank {peer} at {what}")
                hub._check_aborted()
                message = _read(box.popleft())
                if message.nbytes != buffer.nbytes:
                    reason = (f"rank {self.rank}: rank {peer} sent {message.nbytes} bytes at "
                              f"{what}, {buffer.nbytes} expected; the message is refused")
                    hub.abort(reason)  # the condition's lock is re-entrant
                    raise PeerError(reason)
                buffer.copy_(message.view(buffer.dtype).view(buffer.shape))
                counters.count_recv(buffer.nbytes)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Every rank's copy in one exchange on a channel of its own, counted as a ring's bytes."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        post = functools.partial(self._post, counters=Counters(), channel="allreduce")
        flat = tensor.detach().reshape(-1)
        tensor.copy_(gather_in_rank_order(post, self.rank, self.world_size, flat, op, what)
                     .view(tensor.shape))
        self.counters.count_allreduce(tensor.nbytes, self.world_size)

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
