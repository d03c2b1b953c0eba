"""Shared machinery for schemes whose partial sums are exact integers (``thc``, ``global_qsgd``).

Each rank quantizes once, stochastically, to non-negative integer codes on a grid every rank
shares (coordinate ``i``'s uniform: ``rng.uniform24(rng.coord_hash(key, i))``, ``key =
rng.rank_key(rng.stream_key(rng.call_key(seed, step), stream), rank)``); hops only add
integers, packed at the width :meth:`IntegerSumCodec.code_bits` gives for ``count``, and only
the final sum is dequantized, so every schedule gives the same bits. Non-finite inputs:
:func:`global_statistic`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ..kernels import rng
from ..kernels.baselines import cpu_kernels
from ..types import Collective, ReduceOp
from .base import CallContext, SchemeSpec
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .elementwise import BlockCodec, BlockLayout, LayoutCall
from .none import copy_saturating

__all__ = ["SUPER_GROUP", "IntegerSumCall", "IntegerSumCodec", "NonFiniteGroups",
           "global_statistic"]

SUPER_GROUP = 256  # coordinates a non-finite input may affect (DynamiQ's super-group)


@dataclasses.dataclass(frozen=True)
class NonFiniteGroups:
    """The coordinates of the super-groups where some rank's input is non-finite, and the result
    there: ``+inf`` or ``-inf`` where only that met, else NaN. The same on every rank."""

    bad: torch.Tensor  # bool [numel]
    value: torch.Tensor  # fp32 [numel]: the result's value where ``bad``

    @classmethod
    def reduce(cls, work: torch.Tensor, ctx: CallContext, what: str) -> NonFiniteGroups | None:
        """The non-finite super-groups agreed by one max all-reduce; None where no rank has any."""
        numel = work.numel()
        groups = -(-numel // SUPER_GROUP)
        rows = BlockLayout(numel, SUPER_GROUP, 1, False).pad(work).view(groups, SUPER_GROUP)
        flags = torch.cat((torch.isposinf(rows).any(1), torch.isneginf(rows).any(1),
                           torch.isnan(rows).any(1))).float()
        ctx.reduce(flags, "max", f"{what}: non-finite super-groups")
        pos, neg, nan = (flags.view(3, groups) > 0).unbind(0)
        bad = pos | neg | nan
        if not bool(bad.any()):
            return None
        value = torch.where(nan | (pos & neg), math.nan,
                            torch.where(pos, math.inf, -math.inf)).float()
        return cls(*(t.repeat_interleave(SUPER_GROUP)[:numel] for t in (bad, value)))


def global_statistic(
    work: torch.Tensor,
    ctx: CallContext,
    local: Callable[[torch.Tensor], tuple[torch.Tensor, Any]],
    what: str,
) -> tuple[float, Any, NonFiniteGroups | None]:
    """The max over the ranks of ``local(work)``'s statistic (1-element fp32, ``inf`` where
    ``work`` holds a non-finite value), what ``local`` computed beside it, and the non-finite
    super-groups: where the max is ``inf``, two more all-reduces zero them and retake it."""
    stat, extra = local(work)
    ctx.reduce(stat, "max", what)
    value = float(stat[0])
    groups = None if math.isfinite(value) else NonFiniteGroups.reduce(work, ctx, what)
    if groups is None:  # finite, or no rank has a non-finite value: the statistic overflowed
        return value, extra, None
    work.masked_fill_(groups.bad, 0.0)  # the statistic of the finite super-groups only
    stat, extra = local(work)
    ctx.reduce(stat, "max", f"{what} (finite super-groups)")
    return float(stat[0]), extra, groups


class IntegerSumCodec(abc.ABC):
    """A scheme that quantizes once and sums integer codes exactly."""

    spec: SchemeSpec
    block: int = 1  # coordinates per layout block (chunks hold whole blocks)
    stream: int = 0  # random stream of the scheme
    seed: int = 0  # single-shot encode/decode only

    @abc.abstractmethod
    def prepare(self, work: torch.Tensor, ctx: CallContext) -> Any:
        """Per-call state (global statistics); may transform ``work`` in place (a rotation)."""

    @abc.abstractmethod
    def code_bits(self, count: int, state: Any) -> int:
        """Wire width of a payload summing ``count`` ranks (``state`` None: single-shot)."""

    @abc.abstractmethod
    def quantize(self, values: torch.Tensor, uniforms: torch.Tensor, state: Any) -> torch.Tensor:
        """fp32 values -> non-negative int64 codes, stochastic rounding by ``uniforms``."""

    @abc.abstractmethod
    def dequantize(self, sums: torch.Tensor, count: int, state: Any) -> torch.Tensor:
        """int64 sums of ``count`` ranks' codes -> fp32 values."""

    def finish_values(self, work: torch.Tensor, state: Any) -> torch.Tensor:
        """Undo what :meth:`prepare` did to the layout (e.g. the inverse rotation)."""
        return work

    def quantize_fast(
        self, kernels: ModuleType, values: torch.Tensor, key: int, index_base: int, state: Any
    ) -> torch.Tensor | None:
        """:meth:`quantize` by the compiled ``kernels``, on the uniforms of coordinates
        ``index_base + i`` under the rank's hash ``key``; None where none applies."""
        return None

    def dequantize_fast(
        self, kernels: ModuleType, sums: torch.Tensor, count: int, state: Any, out: torch.Tensor
    ) -> bool:
        """:meth:`dequantize` into the fp32 ``out`` by the compiled ``kernels``; False: none."""
        return False

    __repr__ = BlockCodec.__repr__

    def begin(self, x: torch.Tensor, ctx: CallContext) -> IntegerSumCall:
        return IntegerSumCall(self, x, ctx)

    def wire_nbytes(self, numel: int) -> int:
        padded = BlockLayout(numel, self.block, 1, False).padded_numel
        return packed_nbytes(padded, self.code_bits(1, None))

    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        """One rank's codes for ``x`` alone (statistics local, world size 1)."""
        ctx = CallContext(0, 1, ReduceOp.SUM, self.seed, 0, Collective.ALLREDUCE, "encode")
        call = self.begin(x.detach().reshape(-1), ctx)
        return {"shape": tuple(x.shape), "call": call, "data": call.compress(0, 1)}

    def decode(self, payload: dict[str, Any]) -> torch.Tensor:
        call: IntegerSumCall = payload["call"]
        call.decompress(0, payload["data"], 1)
        out = torch.empty(call.numel, dtype=torch.float32, device=call.work.device)
        call.finish(out)
        return out.reshape(payload["shape"])


class IntegerSumCall(LayoutCall):
    """One collective call: integer accumulators per chunk, dequantization only of final sums."""

    def __init__(self, codec: IntegerSumCodec, x: torch.Tensor, ctx: CallContext) -> None:
        super().__init__(x, ctx, codec.block)
        self.codec = codec
        self.key = rng.rank_key(rng.stream_key(rng.call_key(ctx.seed, ctx.step), codec.stream),
                                ctx.rank)
        self.work = self.layout.pad(x)
        self.state = codec.prepare(self.work, ctx)
        self.kernels = cpu_kernels(self.work.device)  # None: the torch reference
        self.sums: dict[int, torch.Tensor] = {}  # chunk -> int64 partial sum of codes

    def _own_codes(self, chunk: int) -> torch.Tensor:
        lo, values = self.chunk_bounds[chunk], self._chunk(chunk)
        if self.kernels is not None:
            codes = self.codec.quantize_fast(self.kernels, values, self.key, lo, self.state)
            if codes is not None:
                return codes
        index = torch.arange(lo, lo + values.numel(), dtype=torch.int64, device=values.device)
        uniforms = rng.uniform24(rng.coord_hash(self.key, index))
        return self.codec.quantize(values, uniforms, self.state)

    def _sum(self, chunk: int) -> torch.Tensor:
        if chunk not in self.sums:
            self.sums[chunk] = self._own_codes(chunk)
        return self.sums[chunk]

    def payload_nbytes(self, chunk: int, count: int) -> int:
        return packed_nbytes(self._chunk(chunk).numel(), self.codec.code_bits(count, self.state))

    def _unpack(self, chunk: int, payload: torch.Tensor, count: int) -> torch.Tensor:
        width = self.codec.code_bits(count, self.state)
        return unpack_bits(payload, width, self._chunk(chunk).numel())

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        return pack_bits(self._sum(chunk), self.codec.code_bits(count, self.state))

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        sums, values = self._unpack(chunk, payload, count), self._chunk(chunk)
        if self.kernels is None or not self.codec.dequantize_fast(self.kernels, sums, count,
                                                                  self.state, values):
            values.copy_(self.codec.dequantize(sums, count, self.state))

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        if self.kernels is None:
            self.sums[chunk] = self._sum(chunk) + self._unpack(chunk, payload, count)
        else:
            width = self.codec.code_bits(count, self.state)
            self.sums[chunk] = self.kernels.unpack_accumulate(self._sum(chunk), payload, width)

    def finish(self, out: torch.Tensor) -> None:
        values = self.codec.finish_values(self.work, self.state)
        nonfinite: NonFiniteGroups | None = getattr(self.state, "nonfinite", None)
        if nonfinite is not None:
            values[nonfinite.bad] = nonfinite.value[nonfinite.bad]
        result = self.layout.unpad(values)
        if self.op is ReduceOp.AVG:
            result = result / self.world_size
        copy_saturating(out, result)  # finite sums beyond a 16-bit dtype's range saturate
