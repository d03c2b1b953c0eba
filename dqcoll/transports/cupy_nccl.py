"""The ``nccl`` transport: CuPy's NCCL bindings (``cupy.cuda.nccl.NcclCommunicator``).

For jobs that want dqcoll's quantized collectives on GPUs without a ``torch.distributed`` NCCL
process group (or beside one: the communicators are independent). One process per GPU, as
torchrun starts them.

**Rendezvous.** Rank 0 makes the NCCL unique id (``nccl.get_unique_id()``, 128 signed bytes) and
publishes it in a torch ``TCPStore``; every rank reads it and joins ``ncclCommInitRank``. The store
is, in this order: the torchrun agent's store when torchrun says it hosts one
(``TORCHELASTIC_USE_AGENT_STORE=True``), the default store of an initialised
``torch.distributed`` (so dqcoll can share ``MASTER_PORT`` with the job's own process group), or a
store that rank 0 hosts at ``MASTER_ADDR:MASTER_PORT``. Keys live under
``dqcoll/nccl/attempt_<restart>/<n>/`` with ``n`` counting this process's communicators, so
several communicators in one job, and the attempts of a restarted torchrun job, do not collide.
Rank, world size and address come from the arguments or the torchrun variables (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the GPU is ``cuda:LOCAL_RANK`` (modulo the visible
devices) unless ``device`` is given, and is made the current device.

**Streams.** Everything is queued on the caller's current stream - torch's
(``torch.cuda.current_stream``); the API makes CuPy's current stream torch's for CuPy arrays
(:func:`dqcoll.interop.stream_scope`). ``exchange`` posts its sends and receives between
``nccl.groupStart()`` and ``nccl.groupEnd()`` and returns without waiting: the data is there for
anything queued after it on the same stream (``stream_ordered = True``, which lets the executor
overlap the transfers of one tile with the kernels of another on a side stream). There is no
device-wide synchronisation anywhere. The small ``allreduce`` (statistics, argument checks) is read
by the host right after it, so it waits - by polling an event, with the timeout - for its own
transfers only.

**Deterministic small all-reduce.** The small all-reduce is a reduce-scatter by all-to-all
(grouped send/recv), a sum *in rank order* of each shard, and an all-gather of the shards (grouped
send/recv again): the bytes of a bandwidth-optimal ring, ``2 (n-1)/n`` of the tensor per rank, and
every rank gets the very same values as the ``local`` transport, which also adds in rank order.
``ncclAllReduce`` would be as cheap but adds in an order of its own choosing, so DynamiQ's bit
allocation (a function of the summed norms) could differ in the last bit from the ``local``
result that tests compare against.

**Timeouts and aborts.** Each queued group records a CUDA event; a watchdog thread polls the
pending events and ``ncclCommGetAsyncError``. When a group has not completed after ``timeout_s``
(or NCCL reports an asynchronous error - a peer died), the watchdog calls ``ncclCommAbort``, which
makes the stuck kernels return so the stream drains, and the next call on this transport (or the
waiting handle) raises :class:`~dqcoll.errors.CollectiveTimeoutError` /
:class:`~dqcoll.errors.PeerError` naming the step and the peers of the group. Limits: the rendezvous
(``ncclCommInitRank``) and the first exchange with a new peer (NCCL connects lazily inside
``groupEnd``) block the host with no timeout of their own.

**Message sizes.** NCCL sends and receives carry no length: a receive posted for more bytes
than the peer sends waits until the timeout, and fewer is undefined. Sizes are right by
construction: both sides derive them from the same plan, and the argument check of
:mod:`dqcoll.api` makes every rank agree, before any payload moves, on everything that sets them
(collective, lengths, scheme and options, algorithm, tiling). No per-message header is sent:
reading one would synchronise the host with the device at every step.

The module imports without CuPy; :func:`nccl_unavailable_reason` says why NCCL cannot run here and
:func:`init_transport` raises :class:`~dqcoll.errors.UnsupportedError` with that reason.

Rejected: ``cupyx.distributed.NCCLBackend``. It wraps the same communicator but owns the store
and its own stream choice, and does its point-to-point calls one by one rather than in a group.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import envs
from ..errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    InvalidArgumentError,
    PeerError,
    UnsupportedError,
)
from .base import ALLREDUCE_OPS, Counters, check_peers

__all__ = ["NcclTransport", "init_transport", "nccl_unavailable_reason", "supports_nccl"]

log = logging.getLogger("dqcoll")

_UNIQUE_ID_BYTES = 128
_STORE_PREFIX = "dqcoll/nccl"
_generation = itertools.count()  # one per communicator this process creates
# Watchdog poll period: a timeout is noticed within this much of its deadline.
_WATCHDOG_PERIOD_S = 0.05


def _import_nccl() -> Any:
    """CuPy's NCCL module; raises UnsupportedError saying what is missing."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise UnsupportedError(f"backend='nccl' cannot run here: {reason}")
    from cupy.cuda import nccl

    return nccl


def nccl_unavailable_reason() -> str | None:
    """None when the NCCL transport can run in this process, else why it cannot."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that does not match the CUDA driver
        return (
            f"CuPy is not importable ({exc.__class__.__name__}: {exc}); install "
            "'dqcoll[cuda12]' or 'dqcoll[cuda13]' (CuPy and the NCCL wheel for your CUDA)"
        )
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CuPy imports fine on machines without a driver or a GPU
        return f"no CUDA GPU is usable ({exc.__class__.__name__}: {exc})"
    if count < 1:
        return "no CUDA GPU is visible (cupy.cuda.runtime.getDeviceCount() == 0)"
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return f"CuPy has no NCCL bindings ({exc.__class__.__name__}: {exc})"
    if not getattr(nccl, "available", False):
        return (
            "CuPy cannot load NCCL (cupy.cuda.nccl.available is False); install the NCCL wheel "
            "matching CuPy's CUDA (nvidia-nccl-cu12 / nvidia-nccl-cu13)"
        )
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU build of torch?); dqcoll moves torch tensors"
    return None


def supports_nccl() -> bool:
    return nccl_unavailable_reason() is None


# -- rendezvous -------------------------------------------------------------------------------


def _env_int(name: str, value: int | None, default: int | None = None) -> int:
    if value is not None:
        return int(value)
    if name in os.environ:
        return int(os.environ[name])
    if default is not None:
        return default
    raise InvalidArgumentError(
        f"{name} is not set: pass it to dqcoll.init(backend='nccl', ...) or launch with torchrun"
    )


def _make_store(rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> Any:
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


def _exchange_unique_id(
    nccl: Any, store: Any, rank: int, key: str, timeout_s: float
) -> tuple[int, ...]:
    if rank == 0:
        unique_id = tuple(int(b) for b in nccl.get_unique_id())
        store.set(key, struct.pack(f"{_UNIQUE_ID_BYTES}b", *unique_id))
        return unique_id
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
        data = store.get(key)
    except Exception as exc:
        raise CollectiveTimeoutError(
            f"rank {rank}: no NCCL unique id from rank 0 under {key!r} within {timeout_s:g} s "
            f"({exc.__class__.__name__}: {exc})"
        ) from exc
    if len(data) != _UNIQUE_ID_BYTES:
        raise PeerError(f"rank {rank}: NCCL unique id under {key!r} has {len(data)} bytes, "
                        f"expected {_UNIQUE_ID_BYTES}")
    return tuple(struct.unpack(f"{_UNIQUE_ID_BYTES}b", data))


def init_transport(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    store: Any = None,
) -> NcclTransport:
    """Create the NCCL communicator of this process (collective: every rank must call it).

    Arguments default to the torchrun variables; ``device`` to ``cuda:LOCAL_RANK``; ``store`` to
    the store chosen as described in the module docstring. Raises UnsupportedError where NCCL
    cannot run (no CuPy, no GPU, no NCCL library).
    """
    nccl = _import_nccl()
    timeout = envs.timeout_s() if timeout_s is None else float(timeout_s)
    r = _env_int("RANK", rank)
    n = _env_int("WORLD_SIZE", world_size)
    if not 0 <= r < n:
        raise InvalidArgumentError(f"rank {r} outside [0, {n})")
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
    if store is None:
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
        store = _make_store(r, n, addr, port, timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted job: fresh keys
    key = f"{_STORE_PREFIX}/attempt_{attempt}/{next(_generation)}/unique_id"
    unique_id = _exchange_unique_id(nccl, store, r, key, timeout)
    import cupy

    with cupy.cuda.Device(device.index):
        comm = nccl.NcclCommunicator(n, unique_id, r)
    return NcclTransport(comm, rank=r, world_size=n, device=device, timeout_s=timeout,
                         store=store, nccl_module=nccl)


# -- the transport ----------------------------------------------------------------------------


class _Group:
    """One queued NCCL group: its completion event, deadline and description."""

    __slots__ = ("deadline", "event", "label")

    def __init__(self, event: Any, deadline: float, label: str) -> None:
        self.event, self.deadline, self.label = event, deadline, label


class NcclTransport:
    name = "nccl"
    stream_ordered = True  # exchange() returns once queued; the data is ordered on the stream

    def __init__(
        self,
        comm: Any,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        store: Any = None,
        nccl_module: Any = None,
    ) -> None:
        self.comm = comm
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        self.counters = Counters()
        self._store = store  # rank 0 may host it: keep it alive with the communicator
        self._nccl = nccl_module if nccl_module is not None else _import_nccl()
        self._pending: collections.deque[_Group] = collections.deque()
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._closed = False
        self._stop = threading.Event()
        self._watchdog = threading.Thread(
            target=self._watch, name=f"dqcoll-nccl-watchdog r{rank}", daemon=True
        )
        self._watchdog.start()

    # -- failure handling ---------------------------------------------------------------------

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise CommAbortedError(f"rank {self.rank}: the nccl communicator is closed")

    def _fail(self, error: BaseException) -> None:
        """Record the first failure and abort the communicator (stuck kernels then return)."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = error
        log.error("dqcoll: %s; aborting the NCCL communicator", error)
        try:
            self.comm.abort()
        except Exception as exc:
            log.error("dqcoll: ncclCommAbort failed: %s", exc)

    def _check_async_error(self, label: str) -> None:
        try:
            self.comm.check_async_error()
        except Exception as exc:
            self._fail(PeerError(f"rank {self.rank}: NCCL reported an error at {label} "
                                 f"(a peer died or a link failed): {exc}"))

    def _watch(self) -> None:
        torch.cuda.set_device(self.device)  # event queries and NCCL calls for this device
        while not self._stop.wait(_WATCHDOG_PERIOD_S):
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
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
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

    # -- the protocol -------------------------------------------------------------------------

    def _check_tensor(self, tensor: torch.Tensor, role: str, peer: int, what: str) -> None:
        if tensor.device != self.device:
            raise InvalidArgumentError(
                f"rank {self.rank}: nccl transport on {self.device} cannot {role} rank {peer} a "
                f"tensor on {tensor.device} at {what}"
            )
        if not tensor.is_contiguous():
            raise InvalidArgumentError(
                f"rank {self.rank}: nccl transport needs contiguous tensors, got strides "
                f"{tensor.stride()} to {role} rank {peer} at {what}"
            )

    def _group(self, sends: Sequence[tuple[int, torch.Tensor]],
               recvs: Sequence[tuple[int, torch.Tensor]], what: str) -> None:
        nccl = self._nccl
        stream = torch.cuda.current_stream(self.device).cuda_stream
        try:
            with torch.cuda.device(self.device):
                nccl.groupStart()
                try:
                    for peer, tensor in sends:
                        nbytes = tensor.numel() * tensor.element_size()
                        self.comm.send(tensor.data_ptr(), nbytes, nccl.NCCL_UINT8, peer, stream)
                    for peer, buffer in recvs:
                        nbytes = buffer.numel() * buffer.element_size()
                        self.comm.recv(buffer.data_ptr(), nbytes, nccl.NCCL_UINT8, peer, stream)
                finally:
                    nccl.groupEnd()
        except Exception as exc:  # NcclError: invalid usage, or the communicator was aborted
            self._fail(PeerError(
                f"rank {self.rank}: posting NCCL {self._describe(sends, recvs, what)} failed: {exc}"
            ))
            raise self._failure from exc  # type: ignore[misc]
        self._raise_if_failed()

    @staticmethod
    def _describe(sends: Sequence[tuple[int, torch.Tensor]],
                  recvs: Sequence[tuple[int, torch.Tensor]], what: str) -> str:
        parts = []
        if sends:
            parts.append("sending to rank " + ", ".join(str(p) for p, _ in sends))
        if recvs:
            parts.append("receiving from rank " + ", ".join(str(p) for p, _ in recvs))
        return f"{what} ({'; '.join(parts)})"

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
        self._track(self._describe(sends, recvs, what))
        for _, tensor in sends:
            self.counters.count_send(tensor.numel() * tensor.element_size())
        for _, buffer in recvs:
            self.counters.count_recv(buffer.numel() * buffer.element_size())

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Small in-place all-reduce, summed in rank order (see the module docstring); the
        host waits for it. CPU tensors are staged through the GPU."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        self._raise_if_failed()
        n = self.world_size
        nbytes = tensor.numel() * tensor.element_size()
        if n > 1 and tensor.numel():
            work = tensor.detach().to(self.device).contiguous().reshape(-1)
            reduced = self._reduce_in_rank_order(work, op, what)
            tensor.copy_(reduced.view(tensor.shape))
        self.counters.count_allreduce(nbytes, n)

    def _reduce_in_rank_order(self, flat: torch.Tensor, op: str, what: str) -> torch.Tensor:
        n, me = self.world_size, self.rank
        numel = flat.numel()
        bounds = [c * numel // n for c in range(n + 1)]
        mine = slice(bounds[me], bounds[me + 1])
        shard = bounds[me + 1] - bounds[me]
        peers = [p for p in range(n) if p != me]
        # 1. all-to-all: shard p of my tensor to rank p; every rank's copy of my shard to me
        received = {p: torch.empty(shard, dtype=flat.dtype, device=self.device) for p in peers}
        sends = [(p, flat[bounds[p] : bounds[p + 1]].view(torch.uint8)) for p in peers]
        recvs = [(p, received[p].view(torch.uint8)) for p in peers]
        self._post(sends, recvs, f"{what} (small all-reduce, scatter)")
        # 2. my shard, reduced in rank order (the local transport's order)
        parts = [flat[mine] if p == me else received[p] for p in range(n)]
        acc = parts[0].clone()
        for other in parts[1:]:
            if op == "sum":
                acc.add_(other)
            elif op == "max":
                torch.maximum(acc, other, out=acc)
            else:
                torch.minimum(acc, other, out=acc)
        # 3. all-gather of the reduced shards
        out = torch.empty_like(flat)
        out[mine] = acc
        sends = [(p, acc.view(torch.uint8)) for p in peers]
        recvs = [(p, out[bounds[p] : bounds[p + 1]].view(torch.uint8)) for p in peers]
        event = self._post(sends, recvs, f"{what} (small all-reduce, gather)")
        if event is not None:
            self._wait_event(event, f"{what} (small all-reduce)")
        return out

    def _post(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
              label: str) -> Any:
        sends = [(p, t) for p, t in sends if t.numel()]
        recvs = [(p, t) for p, t in recvs if t.numel()]
        if not sends and not recvs:
            return None
        self._group(sends, recvs, label)
        return self._track(self._describe(sends, recvs, label))

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(self.world_size, device=self.device), "sum", what=what)

    def synchronize(self, *, what: str = "synchronize") -> None:
        """Host wait, with the timeout, until everything queued so far has completed."""
        self._raise_if_failed()
        with self._lock:
            pending = list(self._pending)
        for group in pending:
            self._wait_event(group.event, group.label)

    def abort(self, reason: str) -> None:
        self._fail(CommAbortedError(f"rank {self.rank}: communicator aborted: {reason}"))

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._failure is None:
                self.synchronize(what="close")
        finally:
            self._stop.set()
            self._closed = True
            if self._failure is None:
                self.comm.destroy()
