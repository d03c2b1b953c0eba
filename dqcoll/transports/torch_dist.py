"""The ``torch`` transport: any ``torch.distributed`` process group (gloo on CPU, nccl on GPU).

This is how dqcoll drops into a job launched by torchrun: dqcoll runs among the ranks of the
job's process group, its grouped point-to-point messages and small all-reduces on a connection
of its own (below). Every wait goes through ``Work.wait(timeout)``; a timeout or a broken
connection becomes a :class:`~dqcoll.errors.CollectiveTimeoutError` /
:class:`~dqcoll.errors.PeerError` that names the peer and the step. The group's own timeout
(``init_process_group(timeout=...)``) still bounds gloo's internals.

**A private connection for CPU traffic.** Over a registered group whose CPU backend is gloo
(``"gloo"``, or a per-device ``"cpu:gloo,cuda:nccl"``) the transport opens, when it is made, a
``ProcessGroupGloo`` of its own among the group's ranks (:func:`open_private_group`, from the
group's store under a prefix of its own: :func:`private_prefix`), and every CPU message goes
there: point-to-point exchanges, the small all-reduces and :meth:`TorchTransport.native_allreduce`
(gloo's all-reduce on that connection). gloo matches a point-to-point message by (peer, tag)
and a collective by the order in which a process issues them on a group; a caller that sends,
receives or all-reduces on its own group while a dqcoll call runs on a worker thread (an
``async_op`` call, the DDP hook's buckets beside DDP's reducer with
``find_unused_parameters=True``) would otherwise have its messages matched with dqcoll's, in
orders that differ between ranks, and gloo aborts a process on a message longer than the
receive it landed in (SIGABRT, no error). Opening it is collective: every rank of the group
makes its transports over that group in the same order (as ``dqcoll.init()``, the DDP hook and
the integrations do).

**A private connection for CUDA traffic.** Over a registered group whose CUDA backend is NCCL
(``"nccl"``, ``"cpu:gloo,cuda:nccl"``) the transport likewise makes an NCCL process group of its
own among the same ranks (a ``ProcessGroup`` with a ``ProcessGroupNCCL`` registered for CUDA,
from the group's store under the private prefix + ``cuda/``; NCCL makes its communicator at the
first message), and every CUDA message goes there, the native all-reduce included: NCCL runs a
communicator's operations in the order a process issues them, so a caller's collective on its
own group from another thread (DDP's reducer beside the hook's worker) could otherwise pair
with one of dqcoll's on another rank. A group whose CUDA backend is another (a custom one)
keeps the caller's group for CUDA messages.
**Message headers (gloo).** gloo accepts a message *shorter* than the receive buffer without a
word (the tail keeps whatever it held) and aborts the process on a *longer* one. So every payload
goes with a 16-byte header: its length in bytes and a CRC of the step label. Where the header
travels: in the payload's own message when the caller passed *frames*
(:meth:`TorchTransport.exchange_framed`: the header is written into the room the frame leaves in
front of the payload, no copy) or when the payload is small (up to :data:`FRAME_COPY_NBYTES`,
copied behind the header); otherwise as a message of its own just before the payload, to the
same peer (gloo keeps the order of messages between two ranks). One message instead of two per
DynamiQ payload cut ~3 ms of a 78 ms all-reduce of 7.3 M coordinates over 4 ranks sharing 2
cores (loopback; each gloo message costs wake-ups of its loop thread and of the waiting one).
The receiver checks both once the exchange completed and raises on a short message or one from
another step, naming the peer.
Longer messages cannot be caught here (the abort happens inside gloo): the argument check of
:mod:`dqcoll.validate` makes every rank agree on everything that sets message sizes before any
payload moves. Header bytes count in ``bytes_sent`` but not in ``payload_bytes_sent``.

**CUDA exchanges (nccl).** Headers are decided per exchange, by the tensors' device (an exchange
is all on the CPU or all on CUDA; a mix raises :class:`~dqcoll.errors.InvalidArgumentError`):
CPU tensors carry them on any backend, CUDA tensors never do (reading a header would synchronise
the host with the device at every step; sizes are right by construction, from the argument
check). A CUDA exchange is posted as one ``batch_isend_irecv`` of its payloads only, so NCCL
runs it as one group launch in which every rank's sends and receives progress together; this
holds on a mixed group (``"cpu:gloo,cuda:nccl"``, what ``init_process_group()`` picks on a GPU
machine) too, where a CPU header in front of a CUDA payload would split the batch into single
sends and receives, send-then-receive on one NCCL stream on both ranks: a deadlock once a
payload exceeds NCCL's buffering.

**Works.** A backend without coalescing (gloo) gives one Work per message; one that coalesces
(NCCL: ``batch_isend_irecv`` runs the batch under ``_coalescing_manager(async_ops=True)``) gives
one Work for the whole batch. The transport waits on what torch returns, whatever its count: a
failure of a per-message Work names its peer, one of a batch's Work names every peer of the batch.

**Groups of survivors.** ``group`` may also be a process group built outside
``torch.distributed``'s registry (``ProcessGroupGloo(store, rank, size)``, as
:mod:`dqcoll.membership` builds for the survivors of a lost rank, since ``new_group`` would need
the dead rank too): rank and size then come from the group itself. ``store`` (the job's
key-value store, by default the default group's) is kept for that shrink; :meth:`abort` closes
the connections of the gloo group dqcoll's CPU messages travel on, so that peers blocked on this
rank fail at once.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import envs
from ..errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
    one_line,
)
from ..types import FRAME_HEADROOM
from .base import ALLREDUCE_OPS, Counters, combine_in_rank_order, reduce_in_rank_order

__all__ = [
    "TorchTransport",
    "backend_devices",
    "open_private_group",
    "private_prefix",
    "release_private_group",
]

HEADER_NUMEL = 2  # int64: payload bytes, CRC-32 of the step label
HEADER_NBYTES = 8 * HEADER_NUMEL
assert HEADER_NBYTES == FRAME_HEADROOM  # a framed payload's header fills its frame's room
# Messages up to this many bytes travel in one gloo message with their header (copied into a
# frame): a message fewer per payload, a copy too small to matter. Larger ones are sent framed by
# their caller (exchange_framed: the header's room is in the buffer, no copy) or after their
# header.
FRAME_COPY_NBYTES = 1 << 16
# n x the bytes of a small all-reduce up to which every rank sends it to every other in one
# exchange (TorchTransport.allreduce): the argument check's vector. Larger ones (a scheme's
# statistics) keep the scatter-and-gather, whose bytes are those a scheme's ``bits`` budget
# counts for them (sending every copy to every rank costs n / 2 times as many).
GATHERED_ALLREDUCE_NBYTES = 4096
_ABORT_TAG = 0x7A5E  # a tag no message uses: abort()'s receives never complete
# private connections opened so far in this process, per group name (see private_prefix)
_private_counts: dict[str, int] = {}
_private_lock = threading.Lock()


def private_prefix(group_name: str) -> str:
    """The store prefix of the next private connection over the group named ``group_name``:
    ``dqcoll-private/<group name>/<k>/`` for the ``k``-th one this process opens over that
    group. Every rank opens its connections over a group in the same order, so the ``k``-th
    has the same prefix on every rank (as FSDP2's lanes count their instances)."""
    with _private_lock:
        count = _private_counts.get(group_name, 0) + 1
        _private_counts[group_name] = count
    return f"dqcoll-private/{group_name}/{count}/"


def open_private_group(store: Any, prefix: str, rank: int, world_size: int,
                       timeout_s: float, backend: str = "gloo") -> Any:
    """A process group of dqcoll's own among ``world_size`` ranks (this one ``rank``),
    rendezvoused in ``store`` under ``prefix`` (the same on every rank; only these ranks
    join): a ``ProcessGroupGloo`` (``backend="gloo"``, CPU messages) or a ``ProcessGroup``
    with a ``ProcessGroupNCCL`` for CUDA tensors (``backend="nccl"``). Nothing but dqcoll posts
    on it, so none of its messages can match a message of the caller's. Collective: blocks
    until every rank opened it (gloo; NCCL makes its communicator at the first message), at
    most ``timeout_s``; a failure raises :class:`~dqcoll.errors.CollectiveTimeoutError` (a rank
    did not come) or :class:`~dqcoll.errors.CommAbortedError`, naming the rank and the prefix.
    Every private connection of dqcoll (the torch transport's, the lanes', the DDP hook's) is
    opened here."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, world_size,
                                          timeout)
        elif backend == "nccl":
            group = _nccl_group(dist.PrefixStore(prefix, store), rank, world_size, timeout)
        else:
            raise InvalidArgumentError(f"rank {rank}: dqcoll opens private gloo or nccl "
                                       f"connections, not {backend!r}")
    except InvalidArgumentError:
        raise
    except Exception as exc:
        text = one_line(exc)
        kind = CollectiveTimeoutError if "imeout" in text or "imed out" in text \
            else CommAbortedError
        raise kind(f"rank {rank} of {world_size}: opening dqcoll's {backend} connection under "
                   f"{prefix!r} failed (every rank of the group opens it at the same point, "
                   f"within {timeout_s:g} s): {text}") from None
    with _PRIVATE_LOCK:
        _PRIVATE.append(group)
    return group


def _nccl_group(store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    """A ``ProcessGroup`` whose CUDA backend is a ``ProcessGroupNCCL`` of its own (as
    ``init_process_group("nccl")`` builds one, outside torch's registry): it takes the
    backend's point-to-point calls, ``_start_coalescing`` / ``_end_coalescing`` (one NCCL group
    launch per exchange) and ``allreduce``."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(store, rank, world_size, options)
    group = dist.ProcessGroup(store, rank, world_size)
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    return group


# Every private connection still open. A ProcessGroupGloo destroyed while the interpreter
# finalises (no one released it) can end the process in std::terminate ("terminate called
# without an active exception", SIGABRT) after the program finished; so each is shut down when
# its owner closes (release_private_group) or, at the latest, at exit, newest first.
_PRIVATE: list[Any] = []
_PRIVATE_LOCK = threading.Lock()


def release_private_group(group: Any) -> None:
    """Shut down a connection :func:`open_private_group` opened (once; errors of a connection
    that a lost peer already broke are ignored: nothing is sent on it any more)."""
    with _PRIVATE_LOCK:
        if not any(g is group for g in _PRIVATE):
            return
        _PRIVATE[:] = [g for g in _PRIVATE if g is not group]
    try:
        group.shutdown()
    except Exception:  # already broken by a lost peer, or shut down by torch
        pass


@atexit.register
def _release_all_private_groups() -> None:
    with _PRIVATE_LOCK:
        groups = list(reversed(_PRIVATE))
    for group in groups:
        release_private_group(group)


def _cpu_is_gloo(backend: str) -> bool:
    """Whether a group of ``backend`` moves CPU tensors with gloo (``"gloo"``, or a per-device
    string naming ``cpu:gloo``)."""
    name = backend.lower().replace(" ", "")
    return name == "gloo" or "cpu:gloo" in name.split(",")


def _write_header(frame: torch.Tensor, nbytes: int, tag: int) -> None:
    """The header (payload bytes, label CRC) into the first HEADER_NBYTES bytes of ``frame``."""
    frame[:HEADER_NBYTES].copy_(torch.tensor([nbytes, tag], dtype=torch.int64).view(torch.uint8))


def _cuda_backend(backend: str) -> str | None:
    """The private connection's backend for the CUDA messages of a group of ``backend``:
    ``"nccl"`` where the group moves CUDA tensors with NCCL (``"nccl"``, or a per-device
    string naming ``cuda:nccl``), else None (the caller's group carries them)."""
    name = backend.lower().replace(" ", "")
    return "nccl" if name == "nccl" or "cuda:nccl" in name.split(",") else None


# (peer, header bytes, expected payload bytes, frame to copy out of or None, buffer)
_Check = tuple[int, torch.Tensor, int, torch.Tensor | None, torch.Tensor]


def _send_posts(sends: Sequence[tuple[int, torch.Tensor]], framed: bool,
                tag: int) -> list[tuple[bool, int, torch.Tensor]]:
    """The messages of ``sends`` over gloo: a header travels in its payload's frame or, for a
    large unframed payload, as a message just before it."""
    posts: list[tuple[bool, int, torch.Tensor]] = []
    for peer, tensor in sends:
        if framed:
            _write_header(tensor, tensor.numel() - HEADER_NBYTES, tag)
            posts.append((True, peer, tensor))
            continue
        payload = tensor.contiguous()
        nbytes = payload.numel() * payload.element_size()
        if nbytes <= FRAME_COPY_NBYTES:  # one message: header and a copy
            frame = torch.empty(HEADER_NBYTES + nbytes, dtype=torch.uint8)
            frame[HEADER_NBYTES:].copy_(payload.reshape(-1).view(torch.uint8))
            _write_header(frame, nbytes, tag)
            posts.append((True, peer, frame))
        else:
            header = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
            _write_header(header, nbytes, tag)
            posts += [(True, peer, header), (True, peer, payload)]
    return posts


def _recv_posts(recvs: Sequence[tuple[int, torch.Tensor]], framed: bool
                ) -> tuple[list[tuple[bool, int, torch.Tensor]], list[_Check]]:
    """The messages of ``recvs`` over gloo (as :func:`_send_posts` sends them) and what to
    check of each header once they arrived."""
    posts: list[tuple[bool, int, torch.Tensor]] = []
    checks: list[_Check] = []
    for peer, buffer in recvs:
        # a header slot reads -1 until a message fills it (a message too short to)
        if framed:
            buffer[:HEADER_NBYTES].fill_(0xFF)
            posts.append((False, peer, buffer))
            checks.append((peer, buffer[:HEADER_NBYTES], buffer.numel() - HEADER_NBYTES,
                           None, buffer))
            continue
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes <= FRAME_COPY_NBYTES:
            frame = torch.empty(HEADER_NBYTES + nbytes, dtype=torch.uint8)
            frame[:HEADER_NBYTES].fill_(0xFF)
            posts.append((False, peer, frame))
            checks.append((peer, frame[:HEADER_NBYTES], nbytes, frame, buffer))
        else:
            header = torch.full((HEADER_NBYTES,), 0xFF, dtype=torch.uint8)
            posts += [(False, peer, header), (False, peer, buffer)]
            checks.append((peer, header, nbytes, None, buffer))
    return posts, checks


def _is_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in CUDA memory (an exchange of such tensors goes to NCCL)."""
    return tensor.device.type == "cuda"


def backend_devices(backend: str) -> tuple[str, ...]:
    """The device types a group's backend moves: ``"gloo"`` -> cpu, ``"nccl"`` -> cuda, a
    per-device string (``"cpu:gloo,cuda:nccl"``) -> the devices it names; another backend
    (mpi, ucc, a custom one) is assumed to move both."""
    name = backend.lower()
    if name == "gloo":
        return ("cpu",)
    if name == "nccl":
        return ("cuda",)
    if ":" in name:
        return tuple(sorted({part.split(":", 1)[0].strip() for part in name.split(",")}
                            & {"cpu", "cuda"})) or ("cpu", "cuda")
    return ("cpu", "cuda")


class TorchTransport:
    name = "torch"

    def __init__(self, group: Any = None, *, timeout_s: float | None = None,
                 store: Any = None, store_prefix: str = "dqcoll/",
                 gather_nbytes: int = GATHERED_ALLREDUCE_NBYTES) -> None:
        standalone = group is not None and not isinstance(group, dist.ProcessGroup)
        if not standalone and (not dist.is_available() or not dist.is_initialized()):
            raise InvalidArgumentError(
                "the torch transport needs an initialised torch.distributed process group "
                "(call torch.distributed.init_process_group first, or dqcoll.init(backend='gloo'))"
            )
        if standalone:  # a backend object (ProcessGroupGloo) of survivors: not in the registry
            self.group = group
            self.rank, self.world_size = int(group.rank()), int(group.size())
            self.backend = str(group.name()).lower()
            self._global = list(range(self.world_size))
        else:
            world = dist.group.WORLD
            assert world is not None  # initialised above
            self.group = group if group is not None else world
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
            self.backend = str(dist.get_backend(self.group))
            self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
        self.timeout_s = envs.timeout_s() if timeout_s is None else timeout_s
        self.gather_nbytes = int(gather_nbytes)  # see allreduce
        self.counters = Counters()
        self.devices = backend_devices(self.backend)
        # The device of the small all-reduces and barriers: a CUDA-only group (nccl) takes
        # the current CUDA device (torchrun jobs set it per rank), anything else the CPU.
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.devices == ("cuda",) else torch.device("cpu"))
        # -- what a shrink after a lost rank needs (dqcoll.membership) --
        self.store = store if store is not None else _default_store()
        self.store_prefix = store_prefix  # keys of this group's shrinks live under it
        # The gloo group that carries CPU messages with gloo's own send / recv / allreduce: a
        # bare ProcessGroupGloo itself; over a registered group whose CPU backend is gloo, a
        # private connection (module docstring); otherwise None (batch_isend_irecv on the group)
        self.cpu_group: Any = None
        # The group that carries CUDA messages: over a registered group whose CUDA backend is
        # NCCL, a private NCCL group (module docstring); otherwise None (the caller's group)
        self.cuda_group: Any = None
        self.private_prefix: str | None = None
        cuda_backend = None if standalone else _cuda_backend(self.backend)
        if standalone:
            self.cpu_group = self.group if self.backend == "gloo" else None
        elif (_cpu_is_gloo(self.backend) or cuda_backend is not None) and self.world_size > 1:
            self.private_prefix = private_prefix(str(getattr(self.group, "group_name", "")))
            group_store = dist.distributed_c10d._get_process_group_store(self.group)
            if _cpu_is_gloo(self.backend):
                self.cpu_group = open_private_group(group_store, self.private_prefix,
                                                    self.rank, self.world_size, self.timeout_s)
            if cuda_backend is not None:
                self.cuda_group = open_private_group(
                    group_store, self.private_prefix + "cuda/", self.rank, self.world_size,
                    self.timeout_s, backend=cuda_backend)

    def _wait(self, works: list[tuple[str, dist.Work]], what: str) -> None:
        """Wait for every (whom it concerns, e.g. ``"receiving from rank 1"``, Work)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for whom, work in works:
            try:
                ok = work.wait(timeout)
            except RuntimeError as exc:
                text = str(exc)
                if "imed out" in text or "imeout" in text:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out after {self.timeout_s:g} s on {whom} "
                        f"at {what}: {text.splitlines()[0]}"
                    ) from exc
                raise PeerError(
                    f"rank {self.rank}: {whom} failed at {what}: {text.splitlines()[0]}"
                ) from exc
            if ok is False:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s on {whom} at {what}"
                )

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        what: str,
    ) -> None:
        self._exchange(sends, recvs, what, framed=False)

    def exchange_framed(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        what: str,
    ) -> None:
        """:meth:`exchange` of uint8 frames (:func:`dqcoll.transports.base.exchange_framed`):
        over gloo each payload's header goes in its frame's first bytes, one message per
        payload instead of two and no copy; the checks are those of :meth:`exchange`."""
        self._exchange(sends, recvs, what, framed=True)

    def _exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                  recvs: Sequence[tuple[int, torch.Tensor]], what: str, *, framed: bool) -> None:
        """Post, wait, check, then count the payloads (a frame's room is not payload)."""
        self._post(sends, recvs, what, framed=framed)
        room = HEADER_NBYTES if framed else 0
        for _, tensor in sends:
            self.counters.count_send(tensor.numel() * tensor.element_size() - room)
        for _, buffer in recvs:
            self.counters.count_recv(buffer.numel() * buffer.element_size() - room)

    def _post(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        what: str,
        framed: bool = False,
    ) -> None:
        """Post one grouped exchange and wait for it (no counting). ``framed``: every tensor is
        a uint8 frame whose first :data:`HEADER_NBYTES` bytes are the header's (see
        :meth:`exchange_framed`)."""
        if not sends and not recvs:
            return
        on_cuda = [_is_cuda(t) for _, t in sends] + [_is_cuda(b) for _, b in recvs]
        if any(on_cuda):
            if not all(on_cuda):
                peers = _batch_peers([(True, p, t) for p, t in sends]
                                     + [(False, p, b) for p, b in recvs])
                raise InvalidArgumentError(
                    f"rank {self.rank}: the exchange at {what} ({peers}) mixes CUDA and CPU "
                    f"tensors: an exchange is all on one device")
            # CUDA (nccl): the payloads only, in one batch (see the module docstring)
            skip = HEADER_NBYTES if framed else 0
            self._run([(True, peer, tensor[skip:] if skip else tensor.contiguous())
                       for peer, tensor in sends]
                      + [(False, peer, buffer[skip:] if skip else buffer)
                         for peer, buffer in recvs], what)
            return
        # (is a send, peer, tensor) in posting order: sends first
        tag = zlib.crc32(what.encode())
        posts = _send_posts(sends, framed, tag)
        recv_posts, checks = _recv_posts(recvs, framed)
        self._run(posts + recv_posts, what)
        self._check_headers(checks, tag, what)
        for _, _, _, copied, buffer in checks:
            if copied is not None:
                buffer.reshape(-1).view(torch.uint8).copy_(copied[HEADER_NBYTES:])
        self.counters["bytes_sent"] += HEADER_NBYTES * len(sends)
        self.counters["bytes_recv"] += HEADER_NBYTES * len(recvs)

    def _check_headers(self, checks: list[_Check], tag: int, what: str) -> None:
        """Every received header carries this exchange's tag and the size the receiver
        expects."""
        headers = (torch.stack([h for _, h, _, _, _ in checks]).view(torch.int64).tolist()
                   if checks else [])
        for (peer, _, expected, _, _), (got, their_tag) in zip(checks, headers,
                                                              strict=True):
            if their_tag != tag:
                raise MismatchError(
                    f"rank {self.rank}: the message from rank {peer} at {what} belongs to another "
                    f"step (label CRC {their_tag:#x}, expected {tag:#x}): the ranks are out of "
                    f"step (different collectives, or DQCOLL_VALIDATE=0 with mismatched calls)")
            if got != expected:
                raise PeerError(
                    f"rank {self.rank}: rank {peer} sent {got} bytes at {what}, {expected} "
                    f"expected; the message is refused (gloo would have kept the buffer's stale "
                    f"tail as data)")

    def _run(self, posts: list[tuple[bool, int, torch.Tensor]], what: str) -> None:
        """Post every message and wait for what torch returns: a Work per message (gloo) or
        one for the whole batch (a coalescing backend: NCCL)."""
        try:
            works = self._start(posts)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: posting messages ({_batch_peers(posts)}) "
                            f"failed at {what}: {exc}") from exc
        if len(works) == len(posts):
            waits = [(f"{'sending to' if is_send else 'receiving from'} rank {peer}", work)
                     for (is_send, peer, _), work in zip(posts, works, strict=True)
                     if work is not None]
        else:
            whom = f"the batch of {len(posts)} messages ({_batch_peers(posts)})"
            waits = [(whom, work) for work in works if work is not None]
        self._wait(waits, what)

    def _start(self, posts: list[tuple[bool, int, torch.Tensor]]) -> list[dist.Work]:
        """Post every (is a send, peer, tensor) in order; the Works torch returns for them:
        one per message, in the same order, or (a backend that coalesces: NCCL) one for all.

        gloo has no coalescing, so ``batch_isend_irecv`` posts one ``isend`` / ``irecv`` after
        the other, each through ``torch.distributed``'s argument checks and group look-ups:
        over a gloo group, CPU messages go straight to the group's ``send`` / ``recv``, in the
        same order, which saves that per-message overhead of the calling thread. Everything
        else keeps ``batch_isend_irecv`` (nccl: one group launch for the whole batch). CPU
        messages go to :attr:`cpu_group` where there is one (dqcoll's own gloo connection), CUDA
        messages to :attr:`cuda_group` where there is one (dqcoll's own NCCL group: the batch
        as one coalesced launch, as ``batch_isend_irecv`` posts it)."""
        on_cuda = _is_cuda(posts[0][2])
        group = self.cuda_group if on_cuda else self.cpu_group
        if group is not None:
            coalesce = on_cuda and _coalesces(group, posts[0][2].device)
            if coalesce:
                group._start_coalescing(posts[0][2].device)
            try:
                works = [group.send([tensor], peer, 0) if is_send
                         else group.recv([tensor], peer, 0) for is_send, peer, tensor in posts]
            finally:
                if coalesce:
                    works = [group._end_coalescing(posts[0][2].device)]
            return works
        ops = [dist.P2POp(dist.isend if is_send else dist.irecv, tensor, self._global[peer],
                          self.group) for is_send, peer, tensor in posts]
        return list(dist.batch_isend_irecv(ops))

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Small all-reduce in rank order, not gloo's or NCCL's own all-reduce: the same bits as
        every other dqcoll transport (see :func:`~dqcoll.transports.base.reduce_in_rank_order`).

        Over gloo (a CPU tensor), a tensor whose ``n`` copies fit ``gather_nbytes`` (by default
        :data:`GATHERED_ALLREDUCE_NBYTES`: the argument check's vector of every call) goes to
        every rank in one grouped exchange and every rank combines the ``n`` copies in rank
        order itself (:meth:`_gathered_allreduce`): one synchronisation of the ranks instead
        of two exchanges, which on a machine whose ranks share cores costs a scheduling round
        each. Larger tensors, and other backends, take
        :func:`~dqcoll.transports.base.reduce_in_rank_order`'s scatter and gather."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        nbytes = tensor.numel() * tensor.element_size()
        if self.world_size > 1 and tensor.numel():
            flat = tensor.detach().contiguous().reshape(-1)
            if (self.cpu_group is not None and not _is_cuda(flat)
                    and self.world_size * nbytes <= self.gather_nbytes):
                self._gathered_allreduce(flat, op, what)
                tensor.copy_(flat.view(tensor.shape))
                return
            reduced = reduce_in_rank_order(self._post, self.rank, self.world_size, flat, op, what)
            tensor.copy_(reduced.view(tensor.shape))
        self.counters.count_allreduce(nbytes, self.world_size)

    def _gathered_allreduce(self, flat: torch.Tensor, op: str, what: str) -> None:
        """``flat`` (contiguous, on the CPU) combined in place over the ranks in rank order
        (``((x_0 + x_1) + x_2) + ...``, the bits of ``reduce_in_rank_order``) from one grouped
        exchange in which every rank sends its copy to every other: one synchronisation. The
        messages carry the usual headers (length and step label, checked: a rank at another
        step raises :class:`~dqcoll.errors.MismatchError`). Point-to-point rather than gloo's
        all-gather: a process that had run gloo collectives sometimes aborted in gloo's
        teardown at exit ("terminate called without an active exception")."""
        n, rank = self.world_size, self.rank
        peers = [p for p in range(n) if p != rank]
        copies = torch.empty(n, flat.numel(), dtype=flat.dtype)
        copies[rank] = flat
        self._post([(p, flat) for p in peers], [(p, copies[p]) for p in peers],
                   f"{what} (small all-reduce, all to all)")
        flat.copy_(combine_in_rank_order(list(copies), op))
        wire = (n - 1) * flat.numel() * flat.element_size()  # headers: counted by _post
        self.counters["bytes_sent"] += wire
        self.counters["bytes_recv"] += wire
        self.counters["allreduce_bytes_sent"] += wire
        self.counters["allreduces"] += 1

    def native_allreduce(self, tensor: torch.Tensor, *, what: str) -> None:
        """Sum ``tensor`` in place with gloo's or NCCL's own all-reduce (what DDP runs without
        a hook; its result is the same on every rank), waiting at most the transport's
        timeout. For large buffers where no compression pays (``scheme="auto"``); the small
        all-reduces keep :meth:`allreduce`'s rank order. A CPU tensor is all-reduced on
        :attr:`cpu_group` where there is one (dqcoll's own gloo connection: a caller's
        all-reduce on its group meanwhile, from another thread, cannot take its place), a CUDA
        tensor on :attr:`cuda_group` where there is one (likewise, NCCL), else on the caller's
        group."""
        if self.world_size > 1 and tensor.numel():
            group = self.cuda_group if _is_cuda(tensor) else self.cpu_group
            if group is not None:
                work = group.allreduce([tensor])
            else:
                work = dist.all_reduce(tensor, group=self.group, async_op=True)
            assert work is not None
            self._wait([(f"the all_reduce over the group's {self.world_size} ranks", work)], what)
        self.counters.count_allreduce(tensor.numel() * tensor.element_size(), self.world_size)

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1, device=self.device), "sum", what=what)

    def abort(self, reason: str) -> None:
        """Close the connections of :attr:`cpu_group` (where dqcoll's CPU messages travel), so
        that peers blocked on this rank fail at once (they would otherwise wait for their
        timeout). Without one: nothing (peers learn of it through their timeouts). The
        caller's own group is left as it is.

        gloo has no call for it (``ProcessGroup.abort()`` and ``shutdown()`` leave the sockets
        open: a peer blocked in a receive from this rank failed only when this process exited,
        9 s later in a probe), but a timed-out wait closes its connection ("Application timeout
        caused pair closure", and the peer sees "Connection closed by peer"): so post, to each
        peer, a receive under a tag nobody sends and let it time out after 1 ms."""
        if self.cpu_group is None:
            return
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                work = self.cpu_group.recv([torch.empty(1)], peer, _ABORT_TAG)
                work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # the expected timeout, or the connection was already closed
                pass

    def close(self) -> None:
        """Shut down the private connections this transport carries its messages on (those
        that :func:`open_private_group` opened; a group of the caller's stays open)."""
        for group in (self.cpu_group, self.cuda_group):
            if group is not None:
                release_private_group(group)


def _coalesces(group: Any, device: torch.device) -> bool:
    """Whether ``group`` runs a batch of point-to-point messages on ``device`` as one
    coalesced launch (NCCL), as ``batch_isend_irecv`` asks it."""
    try:
        backend = group._get_backend(device) if hasattr(group, "_get_backend") else group
        return bool(backend.supports_coalescing)
    except (AttributeError, RuntimeError):
        return False


def _batch_peers(posts: list[tuple[bool, int, torch.Tensor]]) -> str:
    """The peers of a batch of (is a send, peer, tensor): "to ranks 1, 2; from rank 1"."""
    parts = []
    for label, sending in (("to", True), ("from", False)):
        peers = sorted({peer for is_send, peer, _ in posts if is_send == sending})
        if peers:
            parts.append(f"{label} rank{'s' if len(peers) > 1 else ''} "
                         + ", ".join(map(str, peers)))
    return "; ".join(parts)


def _default_store() -> Any:
    """The default process group's key-value store, or None (no default group)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
