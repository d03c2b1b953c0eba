"""What the NCCL transports (:mod:`.cupy_nccl`, :mod:`.nccl4py`) share: the rendezvous
(:func:`plan_rendezvous`) and :class:`StreamOrderedNcclTransport` over any :class:`NcclBinding`.

``exchange`` posts one NCCL group on the caller's current stream and returns once queued; the
small ``allreduce`` sums in rank order and the host polls an event for it. A watchdog thread
aborts the communicator when a posted group outlives ``timeout_s`` or NCCL reports an error.
The communicator's states, ``usable`` -> ``aborting`` or ``destroying`` -> ``freed``, and its one
call slot sit under a condition no call into NCCL holds; abort or destroy runs on a background
thread once no call is in flight, never both. Design and limits: docs/gpu_transport.md, "The
NCCL transports".
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    InvalidArgumentError,
    PeerError,
)
from .base import ALLREDUCE_OPS, Counters, check_peers, reduce_in_rank_order

__all__ = [
    "UNIQUE_ID_NBYTES",
    "CudaStreams",
    "NcclBinding",
    "RendezvousPlan",
    "StreamOrderedNcclTransport",
    "exchange_unique_id",
    "make_store",
    "plan_rendezvous",
    "select_device",
]

log = logging.getLogger("dqcoll")

UNIQUE_ID_NBYTES = 128  # sizeof(ncclUniqueId)
STORE_PREFIX = "dqcoll/nccl"
_generation = itertools.count()  # one per communicator this process creates
WATCHDOG_PERIOD_S = 0.05  # a timeout is noticed within this much of its deadline

USABLE = "usable"
ABORTING = "aborting"
DESTROYING = "destroying"
FREED = "freed"


def _env_int(name: str, value: int | None, default: int | None = None) -> int:
    """An explicit argument, else the torchrun variable ``name``, else ``default``."""
    if value is not None:
        return int(value)
    if name in os.environ:
        return int(os.environ[name])
    if default is not None:
        return default
    raise InvalidArgumentError(
        f"{name} is not set: pass it to dqcoll.init(backend='nccl', ...) or launch with torchrun"
    )


def make_store(rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> Any:
    """The store the unique id travels over: torchrun's agent store, the default group's, or
    one that rank 0 serves."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT: join it as a client
        return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timeout,
                             wait_for_workers=False)
    if dist.is_available() and dist.is_initialized():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception as exc:  # a private helper: fall back to a store of our own
            log.info("dqcoll: not reusing torch.distributed's store (%s)", exc)
    return dist.TCPStore(addr, port, world_size, is_master=(rank == 0), timeout=timeout,
                         wait_for_workers=False)


def exchange_unique_id(make_id: Callable[[], bytes], store: Any, rank: int, key: str,
                       timeout_s: float) -> bytes:
    """Rank 0 publishes ``make_id()`` (128 bytes) under ``key``; every rank returns those bytes.
    Raises :class:`~dqcoll.errors.CollectiveTimeoutError` or, for a wrong length, ``PeerError``."""
    if rank == 0:
        unique_id = make_id()
        if not isinstance(unique_id, bytes) or len(unique_id) != UNIQUE_ID_NBYTES:
            raise PeerError(
                f"rank 0: the NCCL binding made a unique id of type {type(unique_id).__name__} "
                f"and length {len(unique_id)}, expected {UNIQUE_ID_NBYTES} bytes")
        store.set(key, unique_id)
        return unique_id
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        data = store.get(key)
    except Exception as exc:
        raise CollectiveTimeoutError(
            f"rank {rank}: no NCCL unique id from rank 0 under {key!r} within {timeout_s:g} s "
            f"({exc.__class__.__name__}: {exc})"
        ) from exc
    data = bytes(data)
    if len(data) != UNIQUE_ID_NBYTES:
        raise PeerError(f"rank {rank}: NCCL unique id under {key!r} has {len(data)} bytes, "
                        f"expected {UNIQUE_ID_NBYTES}")
    return data


def select_device(device: torch.device | str | int | None) -> torch.device:
    """This rank's CUDA device (default ``cuda:LOCAL_RANK`` mod the device count), made current."""
    if device is None:
        local = _env_int("LOCAL_RANK", None, default=0)
        device = torch.device("cuda", local % torch.cuda.device_count())
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":
        raise InvalidArgumentError(f"the nccl transport runs on a CUDA device, got {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


class RendezvousPlan:
    """Rank, world size, device, store and key of one communicator's rendezvous."""

    __slots__ = ("device", "key", "rank", "store", "timeout_s", "world_size")

    def __init__(self, rank: int, world_size: int, device: torch.device, store: Any, key: str,
                 timeout_s: float) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store, self.key, self.timeout_s = store, key, timeout_s


def plan_rendezvous(*, rank: int | None, world_size: int | None, master_addr: str | None,
                    master_port: int | None, timeout_s: float,
                    device: torch.device | str | int | None, store: Any) -> RendezvousPlan:
    """Resolve the arguments (or the torchrun variables), select the device, make the store."""
    r = _env_int("RANK", rank)
    n = _env_int("WORLD_SIZE", world_size)
    if not 0 <= r < n:
        raise InvalidArgumentError(f"rank {r} outside [0, {n})")
    chosen = select_device(device)
    if store is None:
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
        store = make_store(r, n, addr, port, timeout_s)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job: fresh keys
    key = f"{STORE_PREFIX}/attempt_{attempt}/{next(_generation)}/unique_id"
    return RendezvousPlan(r, n, chosen, store, key, timeout_s)


class CudaStreams:
    """The stream and event calls of the transport, on one CUDA device (torch's)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current_handle(self) -> int:
        """The ``cudaStream_t`` of the caller's current stream on the device."""
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def record(self) -> Any:
        """An event recorded on the current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def scope(self) -> Any:
        return torch.cuda.device(self.device)

    def bind_thread(self) -> None:
        """Make the device current in the calling thread (the watchdog's)."""
        torch.cuda.set_device(self.device)


class NcclBinding(Protocol):
    """One NCCL communicator through one library's bindings (CuPy's or nccl4py's)."""

    name: str

    def group(self) -> contextlib.AbstractContextManager[None]: ...

    def send(self, tensor: torch.Tensor, peer: int, stream: int) -> None: ...

    def recv(self, tensor: torch.Tensor, peer: int, stream: int) -> None: ...

    def check_async_error(self) -> None:
        """Raise if NCCL reports an asynchronous error (a peer died, a link failed)."""

    def abort(self) -> None: ...

    def destroy(self) -> None: ...


class _Group:
    """One posted NCCL group: its completion event, deadline and description."""

    __slots__ = ("deadline", "event", "label")

    def __init__(self, event: Any, deadline: float, label: str) -> None:
        self.event, self.deadline, self.label = event, deadline, label


def describe(sends: Sequence[tuple[int, torch.Tensor]],
             recvs: Sequence[tuple[int, torch.Tensor]], what: str) -> str:
    parts = []
    if sends:
        parts.append("sending to rank " + ", ".join(str(p) for p, _ in sends))
    if recvs:
        parts.append("receiving from rank " + ", ".join(str(p) for p, _ in recvs))
    return f"{what} ({'; '.join(parts)})"


class StreamOrderedNcclTransport:
    """The transport protocol over one :class:`NcclBinding`."""

    stream_ordered = True  # exchange() returns once queued; the data is ordered on the stream
    devices = ("cuda",)  # device types of the tensors it moves

    def __init__(
        self,
        binding: NcclBinding,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        store: Any = None,
        streams: Any = None,
        name: str = "nccl",
    ) -> None:
        self.binding = binding
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.counters = Counters()
        self.streams = streams if streams is not None else CudaStreams(device)
        self._store = store  # rank 0 may host it: keep it alive with the communicator
        # guarded by _lock: groups posted and not yet seen complete, the first failure, closed
        self._pending: collections.deque[_Group] = collections.deque()
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._closed = False
        # state and call slot, guarded by _cond (which no call into NCCL holds)
        self._cond = threading.Condition()
        self._state = USABLE
        self._in_call = False
        self._retirer: threading.Thread | None = None
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch, name=f"dqcoll-{name}-watchdog r{rank}", daemon=True
        )
        self._watchdog.start()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: the {self.name} communicator is closed")

    @property
    def state(self) -> str:
        """``usable``, ``aborting``, ``destroying`` or ``freed``."""
        with self._cond:
            return self._state

    def _enter_call(self, wait_s: float | None) -> bool:
        """Take the call slot; False when the communicator is (or becomes) unusable, or the slot
        is still taken after ``wait_s`` seconds (None: no bound)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        with self._cond:
            while self._state == USABLE and self._in_call:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            if self._state != USABLE:
                return False
            self._in_call = True
            return True

    def _leave_call(self) -> None:
        with self._cond:
            self._in_call = False
            self._cond.notify_all()

    def _retire(self, state: str, action: Callable[[], None], what: str) -> threading.Thread | None:
        """Move ``usable`` -> ``state`` and start the thread that runs ``action`` (abort or
        destroy) once no call is in flight; None if the state had already left ``usable``."""
        with self._cond:
            if self._state != USABLE:
                return None
            self._state = state
            self._cond.notify_all()

        def run() -> None:
            try:
                self.streams.bind_thread()
            except Exception as exc:  # the call below may still work on the current device
                log.warning("dqcoll: rank %d: cannot select %s before %s: %s", self.rank,
                            self.device, what, exc)
            try:
                with self._cond:
                    self._cond.wait_for(lambda: not self._in_call)
                action()
            except Exception as exc:
                log.error("dqcoll: rank %d: %s of the %s communicator failed: %s", self.rank, what,
                          self.name, exc)
            finally:
                with self._cond:
                    self._state = FREED
                    self._cond.notify_all()

        thread = threading.Thread(target=run, name=f"dqcoll-{self.name}-{state} r{self.rank}",
                                  daemon=True)
        self._retirer = thread
        thread.start()
        return thread

    def _fail(self, error: BaseException) -> None:
        """Record the first failure and abort the communicator in the background."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
        log.error("dqcoll: %s; aborting the NCCL communicator", error)
        self._retire(ABORTING, self.binding.abort, "ncclCommAbort")

    def _check_async_error(self, label: str) -> None:
        if not self._enter_call(WATCHDOG_PERIOD_S):  # not usable, or a post holds the slot
            return
        error: BaseException | None = None
        try:
            self.binding.check_async_error()
        except Exception as exc:
            error = exc
        finally:
            self._leave_call()
        if error is not None:
            self._fail(PeerError(f"rank {self.rank}: NCCL reported an error at {label} "
                                 f"(a peer died or a link failed): {error}"))

    def _watch(self) -> None:
        try:
            self.streams.bind_thread()  # event queries and NCCL calls for this device
        except Exception as exc:
            log.error("dqcoll: the NCCL watchdog cannot select %s: %s", self.device, exc)
            return
        while not self._stop.wait(WATCHDOG_PERIOD_S):
            if self._failure is not None:
                return
            with self._lock:
                while self._pending and self._pending[0].event.query():
                    self._pending.popleft()
                overdue = next((g for g in self._pending if time.monotonic() > g.deadline), None)
                oldest = self._pending[0].label if self._pending else None
            if oldest is not None:
                self._check_async_error(oldest)
            if overdue is not None:
                self._fail(CollectiveTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s at {overdue.label}"
                ))
                return

    def _track(self, label: str) -> Any:
        event = self.streams.record()
        with self._lock:
            self._pending.append(_Group(event, time.monotonic() + self.timeout_s, label))
        return event

    def _wait_event(self, event: Any, label: str) -> None:
        """Host wait for one event, polling, bounded by the timeout (no device synchronise)."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-5
        while not event.query():
            if self._failure is not None:
                raise self._failure
            if time.monotonic() > deadline:
                self._fail(CollectiveTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s at {label}"
                ))
                raise self._failure  # type: ignore[misc]
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        self._raise_if_failed()

    def _check_tensor(self, tensor: torch.Tensor, role: str, peer: int, what: str) -> None:
        if tensor.device != self.device:
            raise InvalidArgumentError(
                f"rank {self.rank}: {self.name} transport on {self.device} cannot {role} rank "
                f"{peer} a tensor on {tensor.device} at {what}"
            )
        if not tensor.is_contiguous():
            raise InvalidArgumentError(
                f"rank {self.rank}: {self.name} transport needs contiguous tensors, got strides "
                f"{tensor.stride()} to {role} rank {peer} at {what}"
            )

    def _group(self, sends: Sequence[tuple[int, torch.Tensor]],
               recvs: Sequence[tuple[int, torch.Tensor]], what: str) -> None:
        """Post one group of sends and receives (bytes) on the current stream."""
        stream = self.streams.current_handle()
        if not self._enter_call(None):  # aborted or closed: raise without touching it
            self._raise_if_failed()
            raise CommAbortedError(
                f"rank {self.rank}: the {self.name} communicator was aborted before "
                f"{describe(sends, recvs, what)} could be posted")
        error: Exception | None = None
        try:
            with self.streams.scope(), self.binding.group():
                for peer, tensor in sends:
                    self.binding.send(tensor.view(-1).view(torch.uint8), peer, stream)
                for peer, buffer in recvs:
                    self.binding.recv(buffer.view(-1).view(torch.uint8), peer, stream)
        except Exception as exc:  # invalid usage, or NCCL failed
            error = exc
        finally:
            self._leave_call()
        if error is not None:
            self._raise_if_failed()
            self._fail(PeerError(
                f"rank {self.rank}: posting NCCL {describe(sends, recvs, what)} failed: {error}"
            ))
            raise self._failure from error  # type: ignore[misc]
        self._raise_if_failed()

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        what: str,
    ) -> None:
        self._raise_if_failed()
        check_peers(sends, recvs, self.rank, self.world_size)
        sends = [(p, t) for p, t in sends if t.numel()]
        recvs = [(p, t) for p, t in recvs if t.numel()]
        for peer, tensor in sends:
            self._check_tensor(tensor, "send to", peer, what)
        for peer, buffer in recvs:
            self._check_tensor(buffer, "receive from", peer, what)
        if not sends and not recvs:
            return
        self._group(sends, recvs, what)
        self._track(describe(sends, recvs, what))
        for _, tensor in sends:
            self.counters.count_send(tensor.numel() * tensor.element_size())
        for _, buffer in recvs:
            self.counters.count_recv(buffer.numel() * buffer.element_size())

    def _post(self, sends: Sequence[tuple[int, torch.Tensor]],
              recvs: Sequence[tuple[int, torch.Tensor]], label: str) -> None:
        sends = [(p, t) for p, t in sends if t.numel()]
        recvs = [(p, t) for p, t in recvs if t.numel()]
        if not sends and not recvs:
            return
        self._group(sends, recvs, label)
        self._track(describe(sends, recvs, label))

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Small in-place all-reduce in rank order; the host waits for it. Tensors on another
        device are staged through this one."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        self._raise_if_failed()
        n = self.world_size
        nbytes = tensor.numel() * tensor.element_size()
        if n > 1 and tensor.numel():
            work = tensor.detach().to(self.device).contiguous().reshape(-1)
            reduced = reduce_in_rank_order(self._post, self.rank, n, work, op, what)
            self._wait_event(self._track(f"{what} (small all-reduce)"),
                             f"{what} (small all-reduce)")
            tensor.copy_(reduced.view(tensor.shape))
        self.counters.count_allreduce(nbytes, n)

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(self.world_size, device=self.device), "sum", what=what)

    def synchronize(self, *, what: str = "synchronize") -> None:
        """Host wait, with the timeout, for everything posted so far; raises the failure if any."""
        self._raise_if_failed()
        with self._lock:
            pending = list(self._pending)
        for group in pending:
            self._wait_event(group.event, group.label)
        self._raise_if_failed()

    def abort(self, reason: str) -> None:
        """Fail every later call with CommAbortedError; abort in the background, return at once."""
        self._fail(CommAbortedError(f"rank {self.rank}: communicator aborted: {reason}"))

    def close(self) -> None:
        """Wait for what is posted (unless failed), stop the watchdog, then destroy the
        communicator once no call is in flight (at most ``timeout_s``); nothing after an abort."""
        if self._closed:
            return
        try:
            if self._failure is None:
                self.synchronize(what="close")
        finally:
            self._stop.set()
            if self._watchdog is not threading.current_thread():
                self._watchdog.join(timeout=max(1.0, 10 * WATCHDOG_PERIOD_S))
            self._closed = True
            destroyer = self._retire(DESTROYING, self.binding.destroy, "ncclCommDestroy")
            if destroyer is not None:
                destroyer.join(timeout=self.timeout_s)
                if destroyer.is_alive():
                    log.error("dqcoll: rank %d: destroying the %s communicator took more than "
                              "%g s; it goes on in the background", self.rank, self.name,
                              self.timeout_s)
