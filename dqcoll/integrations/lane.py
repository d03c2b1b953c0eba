"""A compression lane: dqcoll's collectives on a connection of their own, as ``torch`` Work.

The FSDP2 classes (:mod:`dqcoll.integrations.fsdp`) and the ``dqcoll`` backend
(:mod:`dqcoll.integrations.torch_backend`) hand their compressed calls to a :class:`Lane`:

* **Its own gloo connection.** The lane makes a ``ProcessGroupGloo`` from the group's store
  under a prefix of its own (only the group's ranks join; no ``new_group`` over the world), and
  dqcoll's ``torch`` transport runs over it. dqcoll's point-to-point messages thus never share a
  connection with the exact collectives the caller issues on the wrapped group meanwhile, from
  another thread.
* **One worker thread, in issue order.** Every call, synchronous or not, is queued on the lane's
  thread, so calls run in the order the caller issued them (the same on every rank, as FSDP2 and
  DDP issue them) and one dqcoll communicator runs one collective at a time. A call returns a
  ``torch.distributed.Work`` made from a ``torch.futures.Future`` that the thread completes
  (torch's own Python process groups do the same); a synchronous caller waits on it at once.
  Errors (a mismatch on one rank, a timeout) surface at ``wait()`` on every rank.
* **One or two levels.** With nodes (:meth:`CompressionPolicy.nodes`), reduce-scatter,
  all-gather and all-reduce run exact (scheme ``none``) among a node's ranks and with the role's
  scheme across nodes, over :class:`~dqcoll.transports.subgroup.SubgroupTransport` views of the
  same connection; ranks are numbered node-major (rank = node x L + local rank, as torchrun does).
* **Block codecs in one exchange.** On one level, a block codec whose payload depends on its
  chunk alone (``int8_block``, ``int4_block``, ``bf16``) runs as one point-to-point exchange
  after a one-exchange argument check (:meth:`Lane._gather_blocks`,
  :meth:`Lane._scatter_blocks`), with the bytes of dqcoll's own all-gather and direct
  reduce-scatter; other schemes run dqcoll's schedules.
* **Counters.** Per role: calls, coordinates, bytes this rank put on the wire, and the bytes a
  bandwidth-optimal exact collective of the same tensor would have sent
  (``(n-1)/n x nbytes`` for reduce-scatter and all-gather, twice that for all-reduce).

Rejected: dqcoll's own ``async_op=True`` handles (:mod:`dqcoll.handles`). They complete a
``concurrent.futures.Future`` that FSDP2 and DDP cannot wait on, and a synchronous dqcoll call
first drains them from the caller's thread; a lane keeps every call of one group on one thread.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import api, schemes
from ..comm import Communicator
from ..errors import InvalidArgumentError, MismatchError
from ..schemes.elementwise import BlockCodec
from ..transports.subgroup import SubgroupTransport
from ..transports.torch_dist import TorchTransport
from .policy import CompressionPolicy, Role, RoleRule

__all__ = ["Lane", "LaneWork", "RoleCounters", "exact_nbytes"]

log = logging.getLogger("dqcoll.integrations")


# The lane's small all-reduces (argument checks, DynamiQ's statistics) up to n x this many bytes
# go to every rank in one exchange (TorchTransport.allreduce): FSDP2's calls are a few million
# coordinates, where the statistics' second synchronisation of the ranks costs more than the
# n / 2 x their bytes that this sends (~0.02 bit per coordinate at n = 4; the counters count
# them).
LANE_GATHER_NBYTES = 256 * 1024
_GATHER_FIELDS = ("numel", "output numel", "dtype", "output dtype", "scheme")
_SCATTER_FIELDS = ("numel", "input numel", "dtype", "output dtype", "scheme", "op")


def _plain_block_codec(rule: RoleRule) -> BlockCodec | None:
    """The rule's scheme when it is a block codec whose payload depends on its chunk alone (no
    per-call statistics shared between the ranks): :meth:`Lane._gather_blocks` runs it."""
    if rule.is_exact:
        return None
    scheme = schemes.get(rule.scheme, **({"bits": rule.bits} if rule.bits is not None else {}))
    if isinstance(scheme, BlockCodec) and type(scheme).prepare is BlockCodec.prepare:
        return scheme
    return None


class _GlooTransport(TorchTransport):
    """dqcoll's ``torch`` transport over a bare ``ProcessGroupGloo`` (one not registered with
    ``torch.distributed``: the transport takes its rank and size from the group itself)."""

    def __init__(self, group: Any, rank: int, world_size: int, timeout_s: float) -> None:
        super().__init__(group, timeout_s=timeout_s, gather_nbytes=LANE_GATHER_NBYTES)
        assert (self.rank, self.world_size) == (rank, world_size), (self.rank, rank)


class RoleCounters(dict[str, int]):
    """Per-role totals: ``calls``, ``numel``, ``wire_bytes`` (what this rank sent),
    ``exact_bytes`` (what a bandwidth-optimal exact collective would have sent)."""

    KEYS = ("calls", "numel", "wire_bytes", "exact_bytes")

    def __init__(self) -> None:
        super().__init__({key: 0 for key in self.KEYS})


def exact_nbytes(role: Role, tensor_nbytes: int, world_size: int) -> int:
    """Bytes per rank of a bandwidth-optimal exact collective whose *full* buffer has
    ``tensor_nbytes`` (the reduce-scatter input, the all-gather output, the all-reduce buffer)."""
    share = tensor_nbytes * (world_size - 1) // world_size
    return 2 * share if role is Role.ALLREDUCE else share


class LaneWork(dist.Work):
    """The Work of one lane call: ``wait()`` blocks until the lane's thread ran the call and
    raises its error, if any (a Work made by ``_create_work_from_future`` returns True from
    ``wait()`` even when its future failed, so a failed collective would pass unnoticed);
    ``get_future()`` gives a ``torch.futures.Future`` for DDP's reducer and other chainers."""

    def __init__(self, done: concurrent.futures.Future[Any], result: Any) -> None:
        super().__init__()
        self._done = done
        self._result = result

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        try:
            self._done.result(timeout=seconds if seconds > 0 else None)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"lane call not finished after {seconds:g} s") from None
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def is_success(self) -> bool:
        return self._done.done() and self._done.exception() is None

    def exception(self) -> BaseException | None:
        return self._done.exception() if self._done.done() else None

    def get_future(self) -> torch.futures.Future[Any]:
        future: torch.futures.Future[Any] = torch.futures.Future()

        def finish(done: concurrent.futures.Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(self._result)

        self._done.add_done_callback(finish)
        return future


class Lane:
    """dqcoll collectives for one group of ranks, run on one thread (see the module docstring).

    Args:
        store: the group's store (``torch.distributed`` key-value store); the lane's gloo
            connection rendezvouses under ``prefix`` in it, so every rank of the group must
            create its lane at the same point.
        rank, world_size: this rank in the group and the group's size.
        policy: schemes per role, nodes.
        timeout_s: bound of every wait (gloo's own and dqcoll's).
        name: for the thread and messages.
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, policy: CompressionPolicy,
                 timeout_s: float, name: str, prefix: str = "dqcoll-lane/") -> None:
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.name = name
        self._connect(store, prefix, timeout_s)
        self._split_levels()
        self.counters = {role: RoleCounters() for role in Role}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"dqcoll-lane {name} rank {rank}")
        self._lock = threading.Lock()
        self._calls = 0  # the lane's own block collectives (their labels)
        self._buffers: dict[str, torch.Tensor] = {}  # _scratch's, one per purpose

    def _connect(self, store: Any, prefix: str, timeout_s: float) -> None:
        """The lane's own gloo connection and the dqcoll communicator over it."""
        timeout = datetime.timedelta(seconds=timeout_s)
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), self.rank,
                                          self.world_size, timeout)
        self.transport = _GlooTransport(self.gloo, self.rank, self.world_size, timeout_s)
        self.comm = Communicator(self.transport, seed=self.policy.seed)

    def _split_levels(self) -> None:
        """Communicators of this rank's node and of its peers on other nodes (two levels)."""
        local = self.policy.nodes(self.world_size)
        self.local_world_size = local
        self.intra: Communicator | None = None
        self.inter: Communicator | None = None
        if not local:
            return
        node, index = divmod(self.rank, local)
        nodes = self.world_size // local
        self.intra = Communicator(
            SubgroupTransport(self.transport, [node * local + j for j in range(local)]),
            seed=self.policy.seed)
        self.inter = Communicator(
            SubgroupTransport(self.transport, [k * local + index for k in range(nodes)]),
            seed=self.policy.seed)

    # -- submission ----------------------------------------------------------------------------

    def submit(self, role: Role, tensor_nbytes: int, numel: int,
               run: Callable[[], Any], result: Any) -> dist.Work:
        """Queue ``run()`` (one whole collective) on the lane's thread; a Work for its end."""
        counters = self.counters[role]

        def job() -> None:
            before = self.transport.counters["bytes_sent"]
            run()  # an error goes to the Work's wait()
            counters["calls"] += 1
            counters["numel"] += numel
            counters["wire_bytes"] += self.transport.counters["bytes_sent"] - before
            counters["exact_bytes"] += exact_nbytes(role, tensor_nbytes, self.world_size)

        with self._lock:
            done = self._pool.submit(job)
        return LaneWork(done, result)

    def close(self) -> None:
        """End the thread after the calls queued so far."""
        self._pool.shutdown(wait=True)

    # -- collectives (each queued whole; ``avg`` divides by the world size) --------------------

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, *, avg: bool,
                       rule: RoleRule) -> dist.Work:
        """``out`` = shard ``rank`` of the sum (or average) of every rank's ``inp``."""
        op = "avg" if avg else "sum"
        codec = _plain_block_codec(rule)

        def run() -> None:
            if self.intra is None or self.inter is None:
                if codec is not None and inp.device.type == "cpu":
                    self._scatter_blocks(inp.reshape(-1), out.view(-1), codec, avg)
                    return
                api.reduce_scatter(inp.view(-1), out.view(-1), op=op, comm=self.comm,
                                   **rule.options())
                return
            local = self.local_world_size
            nodes = self.world_size // local
            shard = out.numel()
            # [nodes, local, shard] -> [local, nodes, shard]: part j holds the shards of the
            # ranks with local index j, which the exact intra-node step leaves on local rank j
            by_local = inp.view(nodes, local, shard).transpose(0, 1).contiguous()
            mine = torch.empty(nodes * shard, dtype=inp.dtype)
            api.reduce_scatter(by_local.view(-1), mine, op=op, scheme="none", comm=self.intra)
            api.reduce_scatter(mine, out.view(-1), op=op, comm=self.inter, **rule.options())

        return self.submit(Role.GRADIENTS, inp.numel() * inp.element_size(), inp.numel(), run,
                           out)

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor, *,
                   rule: RoleRule) -> dist.Work:
        """``out`` = every rank's ``shard`` in rank order, decoded alike on every rank."""
        codec = _plain_block_codec(rule)

        def run() -> None:
            if self.intra is None or self.inter is None:
                if codec is not None and shard.device.type == "cpu":
                    self._gather_blocks(shard.reshape(-1), out.view(-1), codec)
                    return
                api.all_gather(shard.view(-1), out.view(-1), comm=self.comm, **rule.options())
                return
            local = self.local_world_size
            nodes = self.world_size // local
            numel = shard.numel()
            across = torch.empty(nodes * numel, dtype=shard.dtype)
            api.all_gather(shard.view(-1), across, comm=self.inter, **rule.options())
            gathered = torch.empty(local * nodes * numel, dtype=shard.dtype)
            api.all_gather(across, gathered, scheme="none", comm=self.intra)
            # [local, nodes, shard] -> [nodes, local, shard]: rank order
            out.view(nodes, local, numel).copy_(
                gathered.view(local, nodes, numel).transpose(0, 1))

        return self.submit(Role.WEIGHTS, out.numel() * out.element_size(), out.numel(), run, out)

    def _scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat CPU buffer of the lane's own for one purpose of its block collectives, kept
        between calls (FSDP2's calls repeat a few sizes; fresh multi-MB buffers cost page
        faults and zero-filling on every call). Each purpose keeps one buffer of its largest
        size so far (bounded by the largest call; freed with the lane); only the lane's thread
        uses them, one call at a time, and nothing of them is returned to the caller."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def _begin(self, kind: str, names: tuple[str, ...], shard: torch.Tensor, full: torch.Tensor,
               source: torch.Tensor, codec: BlockCodec, *extra: int) -> str:
        """The label of one block collective, its argument check over the ranks (sizes of
        ``shard`` and of the n-shard ``full``, the dtypes of ``source`` and of the other, the
        codec, ``extra``) and this rank's size check; returns the label."""
        self._calls += 1
        what = f"lane {self.name} {kind}#{self._calls}"
        target = full if source is shard else shard
        fields = (shard.numel(), full.numel(), zlib.crc32(str(source.dtype).encode()),
                  zlib.crc32(str(target.dtype).encode()), zlib.crc32(repr(codec).encode()), *extra)
        self._check(what, fields, names)
        if full.numel() != self.world_size * shard.numel():
            raise InvalidArgumentError(f"rank {self.rank}: {what}: {full.numel()} elements for "
                                       f"{self.world_size} shards of {shard.numel()}")
        return what

    def _check(self, what: str, fields: tuple[int, ...], names: tuple[str, ...]) -> None:
        """The argument check of the lane's own collectives: one small all-reduce of ``fields``
        (and their negatives); ranks that disagree on any all raise :class:`MismatchError`."""
        check = torch.tensor([*fields, *(-f for f in fields)], dtype=torch.int64)
        self.transport.allreduce(check, "max", what=f"{what} argument check")
        high, low = check[: len(fields)].tolist(), [-v for v in check[len(fields):].tolist()]
        differ = [name for name, lo, hi in zip(names, low, high, strict=True) if lo != hi]
        if differ:
            raise MismatchError(f"rank {self.rank}: {what}: ranks disagree on {', '.join(differ)} "
                                f"(this rank: {dict(zip(names, fields, strict=True))})")

    def _scatter_blocks(self, inp: torch.Tensor, out: torch.Tensor, codec: BlockCodec,
                        avg: bool) -> None:
        """The reduce-scatter of a block codec (``int8_block``, ``int4_block``, ...; ZeRO++'s
        qgZ) as one exchange of payloads (every rank to every other at once): each rank
        encodes the ``n - 1`` shards it does not keep (one quantization per contribution, no
        hop re-quantizing partial sums), and the owner of each shard adds the decoded
        contributions to its own exact one in rank order. The result is bit for bit that of
        ``dqcoll.reduce_scatter`` with the same scheme and ``algorithm="direct"`` (tested): the
        last contribution is added by the fused decode-accumulate-encode and the shard is
        decoded from those bytes, as there."""
        n, rank, numel = self.world_size, self.rank, out.numel()
        what = self._begin("reduce_scatter", _SCATTER_FIELDS, out, inp, inp, codec, int(avg))
        padded = -(-numel // codec.block) * codec.block
        if padded == numel and inp.dtype == torch.float32:
            values = inp.view(n, numel)
        else:
            values = self._scratch("values", n * padded, torch.float32).view(n, padded)
            values[:, :numel] = inp.view(n, numel)
            values[:, numel:] = 0.0
        if avg and codec.avg_mode == "pre":
            values = values / n
        nbytes = codec.chunk_nbytes(padded, 1, None)
        send = self._scratch("send", n * nbytes, torch.uint8).view(n, nbytes)
        for r in range(n):
            if r != rank:  # the own slot is not sent (it stays here)
                send[r].copy_(codec.encode_values(values[r].contiguous(), 1, None))
        received = self._scratch("received", n * nbytes, torch.uint8).view(n, nbytes)
        peers = [r for r in range(n) if r != rank]
        self.transport.exchange([(r, send[r]) for r in peers], [(r, received[r]) for r in peers],
                                what=what)
        acc = self._scratch("acc", padded, torch.float32)
        acc.copy_(values[rank])
        for r in peers[:-1]:
            if not codec.decode_into(received[r], acc, 1, None, True):
                acc.add_(codec.decode_values(received[r], padded, 1, None))
        if peers:  # the last contribution: fused, then the shard from its own bytes
            last = received[peers[-1]]
            final = codec.decode_accumulate_encode(last, acc, 1, n, None)
            if final is None:
                if not codec.decode_into(last, acc, 1, None, True):
                    acc.add_(codec.decode_values(last, padded, 1, None))
                final = codec.encode_values(acc, n, None)
            if not codec.decode_into(final, acc, n, None, False):
                acc.copy_(codec.decode_values(final, padded, n, None))
        result = acc[:numel]
        if avg and codec.avg_mode == "post":
            result = result / n
        out.copy_(result)

    def _gather_blocks(self, shard: torch.Tensor, out: torch.Tensor, codec: BlockCodec) -> None:
        """The all-gather of a block codec (``int8_block``, ``int4_block``, ...; ZeRO++'s qwZ)
        as one exchange of payloads: each rank encodes its own shard once and sends it to every
        other rank at once (one synchronisation), and every rank decodes all ``n``, its own too,
        from the same bytes (so every replica holds the same weights). The bytes are those of
        ``dqcoll.all_gather`` with the same scheme (the shard padded with zeros to whole
        blocks, one payload per shard), without its range scaling (nothing is summed) and
        without its zero-filled full-size input, padded copy and copy-out: on a machine whose
        ranks share cores those passes over the output, and the ring's ``n - 1`` steps, cost
        more than the codec. The argument check (sizes, dtypes, the codec) is one small
        all-reduce of a vector, in one exchange; ranks that disagree all raise
        :class:`MismatchError`. Point-to-point, not gloo's own all-gather or all-to-all: those
        left processes that sometimes aborted in gloo's teardown at exit, and the messages'
        headers check lengths and step labels."""
        n, numel = self.world_size, shard.numel()
        what = self._begin("all_gather", _GATHER_FIELDS, shard, out, shard, codec)
        padded = -(-numel // codec.block) * codec.block
        if padded == numel and shard.dtype == torch.float32:
            values = shard.contiguous()
        else:
            values = self._scratch("values", padded, torch.float32)
            values[:numel] = shard
            values[numel:] = 0.0
        payload = codec.encode_values(values, 1, None)
        rows = self._scratch("received", n * payload.numel(), torch.uint8).view(n, -1)
        rows[self.rank] = payload
        peers = [r for r in range(n) if r != self.rank]
        self.transport.exchange([(r, payload) for r in peers], [(r, rows[r]) for r in peers],
                                what=what)
        dst = out.view(n, numel)
        in_place = padded == numel and out.dtype == torch.float32
        scratch = None if in_place else self._scratch("acc", padded, torch.float32)
        for r in range(n):
            target = dst[r] if in_place else scratch
            assert target is not None
            if not codec.decode_into(rows[r], target, 1, None, False):
                target.copy_(codec.decode_values(rows[r], padded, 1, None))
            if not in_place:
                dst[r].copy_(target[:numel])

    def allreduce(self, buf: torch.Tensor, *, avg: bool, rule: RoleRule) -> dist.Work:
        """``buf`` = the sum (or average) of every rank's ``buf``, in place."""
        op = "avg" if avg else "sum"

        def run() -> None:
            if self.intra is None or self.inter is None:
                api.allreduce(buf.view(-1), op=op, comm=self.comm, **rule.options())
                return
            local = self.local_world_size
            flat = buf.view(-1)
            shard = -(-flat.numel() // local)
            padded = torch.zeros(local * shard, dtype=buf.dtype)
            padded[: flat.numel()] = flat
            mine = torch.empty(shard, dtype=buf.dtype)
            api.reduce_scatter(padded, mine, op=op, scheme="none", comm=self.intra)
            api.allreduce(mine, op=op, comm=self.inter, **rule.options())
            api.all_gather(mine, padded, scheme="none", comm=self.intra)
            flat.copy_(padded[: flat.numel()])

        return self.submit(Role.ALLREDUCE, buf.numel() * buf.element_size(), buf.numel(), run,
                           [buf])

    def summary(self) -> dict[str, dict[str, int]]:
        """The counters per role, as plain dicts (for JSON)."""
        return {role.value: dict(c) for role, c in self.counters.items()}
