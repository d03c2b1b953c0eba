"""Shared machinery for schemes that code each block of coordinates on its own (``none``,
``bf16``, MX, int blocks): a :class:`BlockCodec` codes a run of whole blocks, a
:class:`BlockCall` pads (:class:`BlockLayout`), cuts ``n`` chunks, runs the hops and writes back."""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch

from .. import scratch
from ..errors import InvalidArgumentError
from ..types import Collective, ReduceOp
from .base import CallContext, SchemeCall, SchemeSpec

__all__ = ["BlockCall", "BlockCodec", "BlockLayout", "LayoutCall", "same_memory", "split_blocks",
           "view_payload"]


def split_blocks(num_blocks: int, parts: int) -> list[int]:
    """Bounds cutting ``num_blocks`` into ``parts`` runs whose lengths differ by at most one."""
    return [c * num_blocks // parts for c in range(parts + 1)]


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same contiguous elements (a copy would change nothing)."""
    return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous())


def view_payload(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat uint8 payload as ``dtype`` values (copied first where its offset is unaligned)."""
    if payload.storage_offset() % dtype.itemsize:
        payload = payload.clone()
    return payload.view(dtype)


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Where a call's ``numel`` input elements sit in its padded fp32 buffer of whole blocks:
    all-reduce pads the tail and cuts ``n`` balanced chunks; reduce-scatter / all-gather
    (``sharded``) pad each shard on its own, so that chunk ``c`` is shard ``c``."""

    numel: int
    block: int
    world_size: int
    sharded: bool

    @property
    def shard_padded(self) -> int:
        return -(-(self.numel // self.world_size) // self.block) * self.block

    @property
    def padded_numel(self) -> int:
        return self.chunk_bounds()[-1]

    def chunk_bounds(self) -> list[int]:
        if self.sharded:
            return [c * self.shard_padded for c in range(self.world_size + 1)]
        return [b * self.block for b in split_blocks(-(-self.numel // self.block), self.world_size)]

    def pad(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """An fp32 buffer holding ``x`` (any float dtype) with zero padding: ``out`` (fp32,
        :attr:`padded_numel` long, any contents) where given, else a fresh one."""
        if out is None:
            alloc = torch.empty if self.padded_numel == self.numel else torch.zeros
            work = alloc(self.padded_numel, dtype=torch.float32, device=x.device)
        else:
            work = out
            if self.padded_numel != self.numel:
                work.zero_()
        inner = self.unpad(work)
        inner.copy_(x.reshape(inner.shape))
        return work

    def unpad(self, work: torch.Tensor) -> torch.Tensor:
        """The input's elements of a padded buffer, in the input's order (a view)."""
        if self.sharded:
            return work.view(self.world_size, self.shard_padded)[:, : self.numel // self.world_size]
        return work[: self.numel]


class BlockCodec(abc.ABC):
    """A scheme whose payload is a function of one chunk of whole blocks (and ``count``)."""

    spec: SchemeSpec
    block: int = 1  # coordinates per block; chunks hold whole blocks
    # "pre": divide inputs by n before compressing; "post": divide the decoded sum.
    avg_mode: str = "post"

    @abc.abstractmethod
    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        """Payload bytes for ``numel`` coordinates summing ``count`` ranks' contributions."""

    @abc.abstractmethod
    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        """fp32 ``values`` (a multiple of ``block`` long) -> flat uint8 payload."""

    @abc.abstractmethod
    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        """Flat uint8 payload -> fp32 values."""

    def __repr__(self) -> str:
        # The factory's options; stable across processes: the argument check compares it.
        options = ", ".join(f"{k}={getattr(self, k)!r}" for k in sorted(self.spec.options))
        return f"{type(self).__name__}({options})"

    def prepare(self, work: torch.Tensor, ctx: CallContext) -> Any:
        """Per-call state (global statistics, ...); ``work`` is the padded fp32 input."""
        return None

    def begin(self, x: torch.Tensor, ctx: CallContext) -> BlockCall:
        return BlockCall(self, x, ctx)

    def wire_nbytes(self, numel: int) -> int:
        return self.chunk_nbytes(BlockLayout(numel, self.block, 1, False).padded_numel, 1, None)

    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        """One rank's payload of ``x`` alone (its state :meth:`prepare`'s over one rank)."""
        padded = BlockLayout(x.numel(), self.block, 1, False).pad(x.detach())
        ctx = CallContext(0, 1, ReduceOp.SUM, 0, 0, Collective.ALLREDUCE, "encode")
        state = self.prepare(padded, ctx)
        return {"numel": x.numel(), "shape": tuple(x.shape), "state": state,
                "data": self.encode_values(padded, 1, state)}

    def decode(self, payload: dict[str, Any]) -> torch.Tensor:
        data, state = payload["data"], payload["state"]
        padded = -(-payload["numel"] // self.block) * self.block
        values = torch.empty(padded, dtype=torch.float32, device=data.device)
        if not self.decode_into(data, values, 1, state, False):
            values = self.decode_values(data, padded, 1, state)
        return values[: payload["numel"]].reshape(payload["shape"])

    def decode_into(
        self, payload: torch.Tensor, out: torch.Tensor, count: int, ctx: Any, accumulate: bool
    ) -> bool:
        """Decode into (``accumulate``: add to) the fp32 ``out``; False where no fast path."""
        return False

    def decode_accumulate_encode(
        self, payload: torch.Tensor, work: torch.Tensor, count: int, out_count: int, ctx: Any
    ) -> torch.Tensor | None:
        """``work += decode(payload)``, encoded for ``out_count`` ranks; None: no fast path."""
        return None


class LayoutCall(SchemeCall):
    """The chunks of a call laid out by :class:`BlockLayout` (subclasses set ``work``)."""

    def __init__(self, x: torch.Tensor, ctx: CallContext, block: int) -> None:
        self.numel = x.numel()
        self.op = ctx.op
        self.world_size = ctx.world_size
        sharded = ctx.collective is not Collective.ALLREDUCE
        if sharded and self.numel % self.world_size:
            raise InvalidArgumentError(f"{ctx.what}: {self.numel} elements do not split into "
                                       f"{self.world_size} equal shards")
        self.layout = BlockLayout(self.numel, block, self.world_size, sharded)
        self.chunk_bounds = self.layout.chunk_bounds()
        self.tile_unit = block  # the executor may cut chunks into tiles of whole blocks
        self.info: dict[str, Any] = {}

    def _bounds(self, chunk: int) -> slice:
        return slice(self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1])

    def _chunk(self, chunk: int) -> torch.Tensor:
        return self.work[self._bounds(chunk)]


class BlockCall(LayoutCall):
    """One collective call of a :class:`BlockCodec`; on the CPU its padded buffer comes from the
    communicator's :mod:`~dqcoll.scratch` pool (no page faults from one call to the next)."""

    def __init__(self, codec: BlockCodec, x: torch.Tensor, ctx: CallContext) -> None:
        super().__init__(x, ctx, codec.block)
        self.codec = codec
        pool = scratch.pool_for(ctx.state, x.device)
        if (ctx.own_input and x.dtype == torch.float32 and x.is_contiguous()
                and self.layout.padded_numel == self.numel):
            self.work = x.view(-1)  # the library's own buffer: reduced in place, no copy
        else:
            out = (None if pool is None
                   else pool.take(4 * self.layout.padded_numel).view(torch.float32))
            self.work = self.layout.pad(x, out)
        if ctx.op is ReduceOp.AVG and codec.avg_mode == "pre":
            self.work.div_(ctx.world_size)
        self.state = codec.prepare(self.work, ctx)

    def _state(self, chunk: int) -> Any:
        """The codec state of one chunk (the call's state, unless a subclass slices it)."""
        return self.state

    def payload_nbytes(self, chunk: int, count: int) -> int:
        return self.codec.chunk_nbytes(self._chunk(chunk).numel(), count, self._state(chunk))

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        return self.codec.encode_values(self._chunk(chunk), count, self._state(chunk))

    def _decode(self, chunk: int, payload: torch.Tensor, count: int, accumulate: bool) -> None:
        values, state = self._chunk(chunk), self._state(chunk)
        if not self.codec.decode_into(payload, values, count, state, accumulate):
            decoded = self.codec.decode_values(payload, values.numel(), count, state)
            (values.add_ if accumulate else values.copy_)(decoded)

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self._decode(chunk, payload, count, accumulate=False)

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self._decode(chunk, payload, count, accumulate=True)

    def decompress_accumulate_recompress(
        self, chunk: int, payload: torch.Tensor, count: int, out_count: int
    ) -> torch.Tensor:
        fused = self.codec.decode_accumulate_encode(payload, self._chunk(chunk), count,
                                                    out_count, self._state(chunk))
        if fused is not None:
            return fused
        return super().decompress_accumulate_recompress(chunk, payload, count, out_count)

    def finish_shard(self, rank: int, out: torch.Tensor) -> None:
        """Reduce-scatter: this rank's shard only (chunk ``rank`` of the sharded layout)."""
        self._write(self.layout.unpad(self.work)[rank], out)

    def finish(self, out: torch.Tensor) -> None:
        self._write(self.layout.unpad(self.work), out)

    def _write(self, result: torch.Tensor, out: torch.Tensor) -> None:
        average = self.op is ReduceOp.AVG and self.codec.avg_mode == "post"
        if not average and same_memory(result, out):
            return  # reduced in the output itself (an all-gather into the library's buffer)
        if average:
            if out.dtype == torch.float32 and out.is_contiguous():
                torch.div(result.reshape(out.shape), self.world_size, out=out)
                return
            result = result / self.world_size
        out.copy_(result.reshape(out.shape))
