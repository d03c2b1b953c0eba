"""The block codecs' collectives of a lane, each in one exchange (:class:`BlockCollectives`).

On one level and on CPU, a block codec whose payload depends on its chunk alone (``int8_block``,
``int4_block``, ``bf16``; ZeRO++'s qwZ and qgZ) runs as one point-to-point exchange after a
one-exchange argument check, with the bytes of dqcoll's own all-gather and direct
reduce-scatter (range scaling included: finite inputs give finite results, saturated where a sum
leaves the dtype's range) and an output dtype other than the input's refused on every rank, as
there. :class:`~dqcoll.integrations.lane.Lane` is one; its path check uses the same argument
check (:meth:`BlockCollectives._check`).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ..errors import DqcollError, InvalidArgumentError, MismatchError, PeerError
from ..prepare import NO_EXPONENT, max_exponent, range_shift, scaled, unscale_into
from ..schemes.elementwise import BlockCodec

__all__ = ["BlockCollectives"]

_GATHER_FIELDS = ("numel", "output numel", "dtype", "output dtype", "scheme")
_SCATTER_FIELDS = ("numel", "input numel", "dtype", "output dtype", "scheme", "op")


class BlockCollectives:
    """Block-codec reduce-scatter and all-gather over ``transport`` among ``world_size`` ranks
    (this one ``rank``), one call at a time on one thread, with scratch buffers kept between
    calls. Subclasses set the attributes below before the first call."""

    rank: int
    world_size: int
    name: str
    transport: Any

    def _init_blocks(self) -> None:
        self._calls = 0  # the block collectives so far (their labels)
        self._buffers: dict[str, torch.Tensor] = {}  # _scratch's, one per purpose

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
               source: torch.Tensor, codec: BlockCodec, *extra: int) -> tuple[str, int]:
        """The label of one block collective, its argument check over the ranks (sizes of
        ``shard`` and of the n-shard ``full``, the dtypes of ``source`` and of the other, the
        codec, ``extra``; this rank's refusal of an output whose dtype is not the input's, as
        ``dqcoll``'s own collectives refuse it, raised on every rank) and this rank's size
        check. Returns the label and the range scaling the ranks agreed in the same check: the
        power of two ``s`` every rank divides its input by (:func:`dqcoll.prepare.range_shift`
        of the largest binary exponent of ``source`` over the ranks, as the API path's check
        gives it), 0 for none."""
        self._calls += 1
        what = f"lane {self.name} {kind}#{self._calls}"
        target = full if source is shard else shard
        fields = (shard.numel(), full.numel(), zlib.crc32(str(source.dtype).encode()),
                  zlib.crc32(str(target.dtype).encode()), zlib.crc32(repr(codec).encode()), *extra)
        error = None
        if target.dtype != source.dtype:
            error = InvalidArgumentError(
                f"rank {self.rank}: {what}: out dtype {target.dtype} differs from input "
                f"{source.dtype}")
        exponent = max_exponent(source) if error is None else NO_EXPONENT
        exponent = self._check(what, fields, names, exponent, error)
        if full.numel() != self.world_size * shard.numel():
            raise InvalidArgumentError(f"rank {self.rank}: {what}: {full.numel()} elements for "
                                       f"{self.world_size} shards of {shard.numel()}")
        if exponent == NO_EXPONENT or not getattr(codec, "range_scaled", True):
            return what, 0
        return what, range_shift(exponent, dtype=source.dtype, world_size=self.world_size,
                                 exact_sums=False)

    def _check(self, what: str, fields: tuple[int, ...], names: tuple[str, ...],
               exponent: int = NO_EXPONENT, error: DqcollError | None = None) -> int:
        """The argument check of the lane's own collectives: one small all-reduce (max) of
        ``fields`` and their negatives, one slot per rank (1 where that rank's ``error`` is
        set) and ``exponent``. A rank with an error raises it and the others
        :class:`PeerError` naming it; otherwise ranks that disagree on any field all raise
        :class:`MismatchError`. Returns the largest ``exponent`` over the ranks."""
        n, k = self.world_size, len(fields)
        check = torch.zeros(2 * k + n + 1, dtype=torch.int64)
        if error is None:
            check[:k] = torch.tensor(fields, dtype=torch.int64)
            check[k : 2 * k] = -check[:k]
        else:
            check[2 * k + self.rank] = 1
        check[-1] = exponent
        self.transport.allreduce(check, "max", what=f"{what} argument check")
        if error is not None:
            raise error
        failed = [r for r, code in enumerate(check[2 * k : 2 * k + n].tolist()) if code]
        if failed:
            raise PeerError(f"rank {self.rank}: {what} not run: invalid arguments on rank"
                            f"{'s' if len(failed) > 1 else ''} {', '.join(map(str, failed))}")
        high, low = check[:k].tolist(), [-v for v in check[k : 2 * k].tolist()]
        differ = [name for name, lo, hi in zip(names, low, high, strict=True) if lo != hi]
        if differ:
            raise MismatchError(f"rank {self.rank}: {what}: ranks disagree on {', '.join(differ)} "
                                f"(this rank: {dict(zip(names, fields, strict=True))})")
        return int(check[-1])

    def _scatter_blocks(self, inp: torch.Tensor, out: torch.Tensor, codec: BlockCodec,
                        avg: bool) -> None:
        """The reduce-scatter of a block codec (``int8_block``, ``int4_block``, ...; ZeRO++'s
        qgZ) as one exchange of payloads (every rank to every other at once): each rank
        encodes the ``n - 1`` shards it does not keep (one quantization per contribution, no
        hop re-quantizing partial sums), and the owner of each shard adds the decoded
        contributions to its own exact one in rank order. The result is bit for bit that of
        ``dqcoll.reduce_scatter`` with the same scheme and ``algorithm="direct"`` (tested): the
        last contribution is added by the fused decode-accumulate-encode and the shard is
        decoded from those bytes, as there.

        Range scaling as there: inputs whose sum could leave the dtype's range (fp16 30000 on
        3 ranks) or whose magnitude would take the codec's scales out of fp32's range (fp32
        2e38) are divided by the power of two the ranks agreed in the argument check, and the
        result is multiplied back, saturating at the output dtype's largest finite value:
        finite inputs give finite results."""
        n, rank, numel = self.world_size, self.rank, out.numel()
        what, shift = self._begin("reduce_scatter", _SCATTER_FIELDS, out, inp, inp, codec,
                                  int(avg))
        if shift:
            inp = scaled(inp, shift)  # in the input's dtype, as the API path scales
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
        if shift:  # rounded to the output's dtype, then multiplied back (saturating)
            unscale_into(result.to(out.dtype), shift, out)
        else:
            out.copy_(result)

    def _gather_blocks(self, shard: torch.Tensor, out: torch.Tensor, codec: BlockCodec) -> None:
        """The all-gather of a block codec (``int8_block``, ``int4_block``, ...; ZeRO++'s qwZ)
        as one exchange of payloads: each rank encodes its own shard once and sends it to every
        other rank at once (one synchronisation), and every rank decodes all ``n``, its own too,
        from the same bytes (so every replica holds the same weights). The bytes are those of
        ``dqcoll.all_gather`` with the same scheme (the shard padded with zeros to whole
        blocks, one payload per shard, range-scaled alike: magnitudes that would take the
        codec's scales out of fp32's range, or round up past the dtype's largest value, are
        divided by a power of two agreed in the argument check and multiplied back,
        saturating), without its zero-filled full-size input, padded copy and copy-out: on a
        machine whose
        ranks share cores those passes over the output, and the ring's ``n - 1`` steps, cost
        more than the codec. The argument check (sizes, dtypes, the codec) is one small
        all-reduce of a vector, in one exchange; ranks that disagree all raise
        :class:`MismatchError`. Point-to-point, not gloo's own all-gather or all-to-all: those
        left processes that sometimes aborted in gloo's teardown at exit, and the messages'
        headers check lengths and step labels."""
        n, numel = self.world_size, shard.numel()
        what, shift = self._begin("all_gather", _GATHER_FIELDS, shard, out, shard, codec)
        if shift:
            shard = scaled(shard, shift)
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
            if shift:  # in the output's dtype, then multiplied back (saturating)
                unscale_into(target[:numel].to(out.dtype), shift, dst[r])
            elif not in_place:
                dst[r].copy_(target[:numel])
