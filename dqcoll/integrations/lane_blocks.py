"""The block codecs' collectives of a CPU lane on one level, each in one exchange after a
one-exchange argument check: docs/fsdp.md ("One exchange per block-codec collective").
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
    """Block-codec reduce-scatter and all-gather over ``transport``, one call at a time on one
    thread. Subclasses set the attributes below and call :meth:`_init_blocks` first."""

    rank: int
    world_size: int
    name: str
    transport: Any

    def _init_blocks(self) -> None:
        self._calls = 0  # the block collectives so far (their labels)
        self._buffers: dict[str, torch.Tensor] = {}

    def _scratch(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat CPU buffer per purpose, kept between calls at its largest size so far."""
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def _padded(self, src: torch.Tensor, rows: int, numel: int, block: int) -> torch.Tensor:
        """``src`` as ``rows`` float32 rows zero-padded to whole blocks (``src`` where it is)."""
        padded = -(-numel // block) * block
        if padded == numel and src.dtype == torch.float32:
            return src.reshape(rows, numel)
        values = self._scratch("values", rows * padded, torch.float32).view(rows, padded)
        values[:, :numel] = src.reshape(rows, numel)
        values[:, numel:] = 0.0
        return values

    def _begin(self, kind: str, names: tuple[str, ...], shard: torch.Tensor, full: torch.Tensor,
               source: torch.Tensor, codec: BlockCodec, *extra: int) -> tuple[str, int]:
        """Label and argument-check one block collective; returns the label and the agreed
        range-scaling shift (0: none)."""
        self._calls += 1
        what = f"lane {self.name} {kind}#{self._calls}"
        target = full if source is shard else shard
        fields = (shard.numel(), full.numel(), zlib.crc32(str(source.dtype).encode()),
                  zlib.crc32(str(target.dtype).encode()), zlib.crc32(repr(codec).encode()), *extra)
        error = None if target.dtype == source.dtype else InvalidArgumentError(
            f"rank {self.rank}: {what}: out dtype {target.dtype} differs from input {source.dtype}")
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
        """The lane's argument check: one small max all-reduce of ``fields``, their negatives, a
        slot per rank's ``error`` and ``exponent``. A rank with an error raises it, the others
        :class:`PeerError`; ranks that disagree on a field all raise :class:`MismatchError`.
        Returns the largest ``exponent`` over the ranks."""
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
        """A block codec's reduce-scatter (qgZ) in one exchange: each owner adds the decoded
        shards to its own in rank order, bit for bit ``reduce_scatter(algorithm="direct")``."""
        n, rank, numel = self.world_size, self.rank, out.numel()
        what, shift = self._begin("reduce_scatter", _SCATTER_FIELDS, out, inp, inp, codec,
                                  int(avg))
        if shift:
            inp = scaled(inp, shift)  # in the input's dtype, as the API path scales
        values = self._padded(inp, n, numel, codec.block)
        padded = values.shape[1]
        if avg and codec.avg_mode == "pre":
            values = values / n
        nbytes = codec.chunk_nbytes(padded, 1, None)
        send = self._scratch("send", n * nbytes, torch.uint8).view(n, nbytes)
        peers = [r for r in range(n) if r != rank]
        for r in peers:
            send[r].copy_(codec.encode_values(values[r].contiguous(), 1, None))
        received = self._scratch("received", n * nbytes, torch.uint8).view(n, nbytes)
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
        """A block codec's all-gather (qwZ) in one exchange: every rank decodes all ``n`` payloads,
        its own too, so every replica holds the same weights; ``dqcoll.all_gather``'s bytes."""
        n, numel = self.world_size, shard.numel()
        what, shift = self._begin("all_gather", _GATHER_FIELDS, shard, out, shard, codec)
        if shift:
            shard = scaled(shard, shift)
        values = self._padded(shard, 1, numel, codec.block)[0]
        padded = values.numel()
        payload = codec.encode_values(values, 1, None)
        rows = self._scratch("received", n * payload.numel(), torch.uint8).view(n, -1)
        rows[self.rank] = payload
        peers = [r for r in range(n) if r != self.rank]
        self.transport.exchange([(r, payload) for r in peers], [(r, rows[r]) for r in peers],
                                what=what)
        dst = out.view(n, numel)
        in_place = padded == numel and out.dtype == torch.float32
        for r in range(n):
            target = dst[r] if in_place else self._scratch("acc", padded, torch.float32)
            if not codec.decode_into(rows[r], target, 1, None, False):
                target.copy_(codec.decode_values(rows[r], padded, 1, None))
            if shift:  # in the output's dtype, then multiplied back (saturating)
                unscale_into(target[:numel].to(out.dtype), shift, dst[r])
            elif not in_place:
                dst[r].copy_(target[:numel])
