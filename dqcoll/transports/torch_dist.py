"""The ``torch`` transport: any ``torch.distributed`` process group (gloo on CPU, nccl on GPU).

A gloo (NCCL) group's CPU (CUDA) messages go on a private group of dqcoll's own
(:func:`open_private_group`; docs/reliability.md, "dqcoll's own connection"); ``group`` may be a
bare ``ProcessGroupGloo`` (:mod:`dqcoll.membership`).

**Message framing (gloo).** Every CPU payload carries a 16-byte header (int64 payload length,
int64 CRC-32 of the step label): in the frame of :meth:`TorchTransport.exchange_framed`, copied
in front of a payload up to :data:`FRAME_COPY_NBYTES`, else as a message just before it. The
receiver refuses a short message or one from another step (docs/reliability.md, "Message
headers (gloo)"). Header bytes count in ``bytes_sent``, not ``payload_bytes_sent``.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
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
from .base import ALLREDUCE_OPS, Counters, gather_in_rank_order, reduce_in_rank_order

__all__ = [
    "TorchTransport",
    "backend_devices",
    "open_private_group",
    "private_prefix",
    "release_private_group",
]

HEADER_NBYTES = FRAME_HEADROOM  # int64 payload bytes, int64 CRC-32 of the step label
# Unframed payloads up to this size are copied behind their header: one gloo message, not two.
FRAME_COPY_NBYTES = 1 << 16
# n x bytes up to which a small all-reduce goes all-to-all (larger: the budgeted scatter-gather)
GATHERED_ALLREDUCE_NBYTES = 4096
_ABORT_TAG = 0x7A5E  # a tag no message uses: abort()'s receives never complete
_private_counts: collections.Counter[str] = collections.Counter()
# Every private connection still open; shut down at the latest at exit, since a ProcessGroupGloo
# destroyed during interpreter finalisation can SIGABRT the process.
_PRIVATE: list[Any] = []
_PRIVATE_LOCK = threading.Lock()


def private_prefix(group_name: str) -> str:
    """The store prefix ``dqcoll-private/<group name>/<k>/`` of the ``k``-th private connection
    this process opens over a group; identical on every rank that opens them in the same order."""
    with _PRIVATE_LOCK:
        _private_counts[group_name] += 1
        return f"dqcoll-private/{group_name}/{_private_counts[group_name]}/"


def open_private_group(store: Any, prefix: str, rank: int, world_size: int,
                       timeout_s: float, backend: str = "gloo") -> Any:
    """A process group of dqcoll's own (gloo, or NCCL for CUDA) in ``store`` under ``prefix``.

    Collective: blocks until every rank opened it, at most ``timeout_s``; raises
    :class:`~dqcoll.errors.CollectiveTimeoutError` or :class:`~dqcoll.errors.CommAbortedError`."""
    if backend not in ("gloo", "nccl"):
        raise InvalidArgumentError(f"rank {rank}: dqcoll opens private gloo or nccl "
                                   f"connections, not {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        prefixed = dist.PrefixStore(prefix, store)
        group = (dist.ProcessGroupGloo(prefixed, rank, world_size, timeout) if backend == "gloo"
                 else _nccl_group(prefixed, rank, world_size, timeout))
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
    """A ``ProcessGroup`` with a ``ProcessGroupNCCL`` of its own for CUDA, outside the registry."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    nccl = dist.ProcessGroupNCCL(store, rank, world_size, options)
    group = dist.ProcessGroup(store, rank, world_size)
    group._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    return group


def release_private_group(group: Any) -> None:
    """Shut down a connection :func:`open_private_group` opened (once; errors are ignored)."""
    with _PRIVATE_LOCK:
        if not any(g is group for g in _PRIVATE):
            return
        _PRIVATE[:] = [g for g in _PRIVATE if g is not group]
    with contextlib.suppress(Exception):  # already broken by a lost peer, or shut down by torch
        group.shutdown()


@atexit.register
def _release_all_private_groups() -> None:
    for group in reversed(_PRIVATE[:]):
        release_private_group(group)


def _device_backends(backend: str) -> dict[str, str]:
    """{device type: backend} of a group's backend string ("gloo", "cpu:gloo,cuda:nccl")."""
    name = backend.lower().replace(" ", "")
    if ":" not in name:
        return {"gloo": {"cpu": "gloo"}, "nccl": {"cuda": "nccl"}}.get(name, {})
    return dict(part.partition(":")[::2] for part in name.split(","))


def _cuda_backend(backend: str) -> str | None:
    """``"nccl"`` where a group of ``backend`` moves CUDA tensors with NCCL, else None."""
    return "nccl" if _device_backends(backend).get("cuda") == "nccl" else None


_Pairs = Sequence[tuple[int, torch.Tensor]]
_Post = tuple[bool, int, torch.Tensor]  # (is a send, peer, tensor): one gloo message
# (peer, header bytes, expected payload bytes, frame to copy out of or None, buffer)
_Check = tuple[int, torch.Tensor, int, torch.Tensor | None, torch.Tensor]


def _gloo_posts(pairs: _Pairs, framed: bool, sending: bool,
                tag: int) -> tuple[list[_Post], list[_Check]]:
    """The gloo messages of ``pairs``, headers included, and (receiving) the header checks."""
    posts: list[_Post] = []
    checks: list[_Check] = []
    for peer, tensor in pairs:
        frame: torch.Tensor | None = tensor
        copied = None
        if framed:
            nbytes = tensor.numel() - HEADER_NBYTES
        else:
            nbytes = tensor.numel() * tensor.element_size()
            # a small payload goes as one message: header and a copy
            frame = copied = (torch.empty(HEADER_NBYTES + nbytes, dtype=torch.uint8)
                              if nbytes <= FRAME_COPY_NBYTES else None)
        if frame is None:
            header = torch.empty(HEADER_NBYTES, dtype=torch.uint8)
            messages = [header, tensor.contiguous() if sending else tensor]
        else:
            header, messages = frame[:HEADER_NBYTES], [frame]
        if sending:
            if copied is not None:
                copied[HEADER_NBYTES:].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
            header.copy_(torch.tensor([nbytes, tag], dtype=torch.int64).view(torch.uint8))
        else:  # a header slot reads -1 until a message fills it (a message too short to)
            header.fill_(0xFF)
            checks.append((peer, header, nbytes, copied, tensor))
        posts += [(sending, peer, message) for message in messages]
    return posts, checks


def _is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def backend_devices(backend: str) -> tuple[str, ...]:
    """The device types a group's backend moves; an unknown backend is assumed to move both."""
    return tuple(sorted(_device_backends(backend).keys() & {"cpu", "cuda"})) or ("cpu", "cuda")


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
        # small all-reduces and barriers: the current CUDA device on a CUDA-only group
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if self.devices == ("cuda",) else torch.device("cpu"))
        if store is None:  # the default group's, if any: for dqcoll.membership
            with contextlib.suppress(Exception):
                store = dist.distributed_c10d._get_default_store()
        self.store = store
        self.store_prefix = store_prefix  # keys of this group's shrinks live under it
        # CPU / CUDA messages go to these where set (private connections), else to self.group
        self.cpu_group: Any = self.group if standalone and self.backend == "gloo" else None
        self.cuda_group: Any = None
        self.private_prefix: str | None = None
        cpu_gloo = not standalone and _device_backends(self.backend).get("cpu") == "gloo"
        cuda_backend = None if standalone else _cuda_backend(self.backend)
        if (cpu_gloo or cuda_backend) and self.world_size > 1:
            self.private_prefix = private_prefix(str(getattr(self.group, "group_name", "")))
            group_store = dist.distributed_c10d._get_process_group_store(self.group)
            if cpu_gloo:
                self.cpu_group = open_private_group(group_store, self.private_prefix,
                                                    self.rank, self.world_size, self.timeout_s)
            if cuda_backend is not None:
                self.cuda_group = open_private_group(
                    group_store, self.private_prefix + "cuda/", self.rank, self.world_size,
                    self.timeout_s, backend=cuda_backend)

    def _wait(self, works: list[tuple[str, dist.Work]], what: str) -> None:
        """Wait for every (whom, e.g. ``"receiving from rank 1"``, Work)."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for whom, work in works:
            try:
                ok = work.wait(timeout)
            except RuntimeError as exc:
                text = str(exc)
                if "imed out" in text or "imeout" in text:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out after {self.timeout_s:g} s on {whom} "
                        f"at {what}: {text.splitlines()[0]}") from exc
                raise PeerError(
                    f"rank {self.rank}: {whom} failed at {what}: {text.splitlines()[0]}") from exc
            if ok is False:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s on {whom} at {what}")

    def exchange(self, sends: _Pairs, recvs: _Pairs, *, what: str) -> None:
        self._exchange(sends, recvs, what, framed=False)

    def exchange_framed(self, sends: _Pairs, recvs: _Pairs, *, what: str) -> None:
        """:meth:`exchange` of uint8 frames whose first bytes take the gloo header (no copy)."""
        self._exchange(sends, recvs, what, framed=True)

    def _exchange(self, sends: _Pairs, recvs: _Pairs, what: str, *, framed: bool) -> None:
        """Post, wait, check, then count the payloads (a frame's room is not payload)."""
        self._post(sends, recvs, what, framed=framed)
        room = HEADER_NBYTES if framed else 0
        for _, tensor in sends:
            self.counters.count_send(tensor.numel() * tensor.element_size() - room)
        for _, buffer in recvs:
            self.counters.count_recv(buffer.numel() * buffer.element_size() - room)

    def _post(self, sends: _Pairs, recvs: _Pairs, what: str, framed: bool = False) -> None:
        """Post one grouped exchange and wait for it (no counting)."""
        if not sends and not recvs:
            return
        posts = [(True, p, t) for p, t in sends] + [(False, p, b) for p, b in recvs]
        on_cuda = [_is_cuda(t) for _, _, t in posts]
        if any(on_cuda):
            if not all(on_cuda):
                raise InvalidArgumentError(
                    f"rank {self.rank}: the exchange at {what} ({_batch_peers(posts)}) mixes "
                    f"CUDA and CPU tensors: an exchange is all on one device")
            # no header: a CPU one would split the NCCL group launch (and can deadlock)
            skip = HEADER_NBYTES if framed else 0
            self._run([(is_send, peer, t[skip:] if skip else t.contiguous() if is_send else t)
                       for is_send, peer, t in posts], what)
            return
        tag = zlib.crc32(what.encode())
        send_posts, _ = _gloo_posts(sends, framed, True, tag)
        recv_posts, checks = _gloo_posts(recvs, framed, False, tag)
        self._run(send_posts + recv_posts, what)
        headers = (torch.stack([h for _, h, _, _, _ in checks]).view(torch.int64).tolist()
                   if checks else [])
        for (peer, _, expected, _, _), (got, their_tag) in zip(checks, headers, strict=True):
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
        for _, _, _, copied, buffer in checks:
            if copied is not None:
                buffer.reshape(-1).view(torch.uint8).copy_(copied[HEADER_NBYTES:])
        self.counters["bytes_sent"] += HEADER_NBYTES * len(sends)
        self.counters["bytes_recv"] += HEADER_NBYTES * len(recvs)

    def _run(self, posts: list[_Post], what: str) -> None:
        """Post every message in order (on a private group: no ``batch_isend_irecv`` overhead)
        and wait: a Work per message, or one for all on a coalescing backend (NCCL)."""
        device = posts[0][2].device
        group = self.cuda_group if _is_cuda(posts[0][2]) else self.cpu_group
        coalesce = group is not None and _is_cuda(posts[0][2]) and _coalesces(group, device)
        try:
            if group is None:
                works = list(dist.batch_isend_irecv([
                    dist.P2POp(dist.isend if is_send else dist.irecv, tensor, self._global[peer],
                               self.group) for is_send, peer, tensor in posts]))
            else:
                if coalesce:
                    group._start_coalescing(device)
                try:
                    works = [group.send([tensor], peer, 0) if is_send
                             else group.recv([tensor], peer, 0) for is_send, peer, tensor in posts]
                finally:
                    if coalesce:
                        works = [group._end_coalescing(device)]
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

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Small all-reduce in rank order: the same bits as every other dqcoll transport. Over
        gloo a tensor whose ``n`` copies fit ``gather_nbytes`` goes all-to-all in one exchange."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        nbytes = tensor.numel() * tensor.element_size()
        # all to all, not gloo's all-gather (whose users sometimes aborted at exit)
        gathered = (self.cpu_group is not None and not _is_cuda(tensor)
                    and self.world_size * nbytes <= self.gather_nbytes)
        if self.world_size > 1 and tensor.numel():
            reduce = gather_in_rank_order if gathered else reduce_in_rank_order
            label = f"{what} (small all-reduce, all to all)" if gathered else what
            flat = tensor.detach().contiguous().reshape(-1)
            tensor.copy_(reduce(self._post, self.rank, self.world_size, flat, op, label)
                         .view(tensor.shape))
        self.counters.count_allreduce(nbytes, self.world_size, gathered=gathered)

    def native_allreduce(self, tensor: torch.Tensor, *, what: str) -> None:
        """Sum ``tensor`` in place with gloo's or NCCL's own all-reduce (identical on every rank;
        ``scheme="auto"``'s exact path), on the private group where there is one."""
        if self.world_size > 1 and tensor.numel():
            group = self.cuda_group if _is_cuda(tensor) else self.cpu_group
            work = (group.allreduce([tensor]) if group is not None
                    else dist.all_reduce(tensor, group=self.group, async_op=True))
            assert work is not None
            self._wait([(f"the all_reduce over the group's {self.world_size} ranks", work)], what)
        self.counters.count_allreduce(tensor.numel() * tensor.element_size(), self.world_size)

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1, device=self.device), "sum", what=what)

    def abort(self, reason: str) -> None:
        """Close the connections of :attr:`cpu_group` so that peers blocked on this rank fail at
        once; the caller's own group is left as it is. gloo has no call for it, so each peer
        gets a receive that times out after 1 ms (docs/reliability.md, "Surviving a lost rank")."""
        if self.cpu_group is None:
            return
        for peer in (p for p in range(self.world_size) if p != self.rank):
            # the expected timeout, or the connection was already closed
            with contextlib.suppress(Exception):
                work = self.cpu_group.recv([torch.empty(1)], peer, _ABORT_TAG)
                work.wait(datetime.timedelta(milliseconds=1))

    def close(self) -> None:
        """Shut down this transport's private connections (a group of the caller's stays open)."""
        for group in (self.cpu_group, self.cuda_group):
            if group is not None:
                release_private_group(group)


def _coalesces(group: Any, device: torch.device) -> bool:
    """Whether ``group`` runs a point-to-point batch on ``device`` as one launch (NCCL)."""
    try:
        backend = group._get_backend(device) if hasattr(group, "_get_backend") else group
        return bool(backend.supports_coalescing)
    except (AttributeError, RuntimeError):
        return False


def _batch_peers(posts: list[_Post]) -> str:
    """The peers of a batch of (is a send, peer, tensor): "to ranks 1, 2; from rank 1"."""
    parts = []
    for label, sending in (("to", True), ("from", False)):
        peers = sorted({peer for is_send, peer, _ in posts if is_send == sending})
        if peers:
            parts.append(f"{label} rank{'s' if len(peers) > 1 else ''} "
                         + ", ".join(map(str, peers)))
    return "; ".join(parts)
