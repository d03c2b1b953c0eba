"""``none``: no compression, over the same schedules as every other scheme, with exact sums.

The result is the sum of the ranks' inputs rounded once to the input dtype, saturating, the same
bits on every rank for every algorithm and collective: one rank's values travel in the input
dtype, partial sums of ``2 .. n-1`` ranks in fp64, and the sink's final payload (``avg``: divided
first) in the input dtype again (a ring: ``(s + 8 (n - 2) + s (n - 1)) / n`` bytes a coordinate,
``s`` the dtype's size). Non-finite inputs stay in their coordinate; no range scaling.
``wire_dtype=`` forces one dtype for every payload (rounded at every hop; not exact).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import scratch
from ..types import Collective, ReduceOp
from .base import CallContext, SchemeSpec
from .elementwise import BlockCall, BlockCodec, LayoutCall, same_memory, view_payload

__all__ = ["ExactSumCall", "NoneScheme", "copy_saturating"]

_WIDE = torch.float64  # partial sums of 2..n-1 ranks


def _widen_into(acc: torch.Tensor, values: torch.Tensor, *, add: bool) -> None:
    """``acc`` (fp64) ``+=`` (``add=False``: ``=``) ``values``; through NumPy on CPU (faster)."""
    if acc.device.type != "cpu":
        (acc.add_ if add else acc.copy_)(values)
        return
    if values.dtype == torch.bfloat16:
        values = values.float()
    out, src = acc.numpy(), values.reshape(-1).numpy()
    with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf: NaN, as torch gives
        if add:
            np.add(out, src, out=out)
        else:
            np.copyto(out, src)


def copy_saturating(out: torch.Tensor, values: torch.Tensor) -> None:
    """``out.copy_(values)``, where a finite value beyond ``out``'s dtype's largest finite value
    saturates there (rounding once, as the cast does below it); non-finite values stay."""
    top = torch.finfo(out.dtype).max
    if values.numel() and torch.finfo(values.dtype).max > top:
        low, high = torch.aminmax(values.reshape(-1))
        if not (float(low) >= -top and float(high) <= top):  # NaN lands here too
            values = torch.where(torch.isfinite(values), values.clamp(-top, top), values)
    out.copy_(values.reshape(out.shape))


class NoneScheme(BlockCodec):
    spec = SchemeSpec(
        name="none",
        description="uncompressed, exact: one rank's values and the final sums in the input "
        "dtype (fp32/bf16/fp16), partial sums of 2..n-1 ranks as fp64, rounded once "
        "(saturating) at the sink; wire_dtype= forces one dtype per hop instead (not exact)",
        bits_per_coord=None,
        unbiased=True,
        exact_sums=True,
        options=("wire_dtype",),
    )

    def __init__(self, wire_dtype: torch.dtype | None = None) -> None:
        self.wire_dtype = wire_dtype

    @property
    def range_scaled(self) -> bool:
        """Whether the argument check's range shift applies (only with a forced ``wire_dtype``)."""
        return self.wire_dtype is not None

    def begin(  # type: ignore[override]  # the exact path is not a block codec's call
        self, x: torch.Tensor, ctx: CallContext
    ) -> BlockCall | ExactSumCall:
        return ExactSumCall(x, ctx) if self.wire_dtype is None else super().begin(x, ctx)

    def _dtype(self, state: Any) -> torch.dtype:
        """The payload dtype: the state (an exact call's input dtype), ``wire_dtype``, or fp32."""
        return state or self.wire_dtype or torch.float32

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        return numel * self._dtype(state).itemsize

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        return values.to(self._dtype(ctx)).view(torch.uint8).reshape(-1)

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        return view_payload(payload, self._dtype(ctx)).float()

    def decode_into(
        self, payload: torch.Tensor, out: torch.Tensor, count: int, ctx: Any, accumulate: bool
    ) -> bool:
        """Values that fp32 holds exactly go into ``out`` in one pass, without an fp32 copy."""
        dtype = self._dtype(ctx)
        if dtype.itemsize > 4:
            return False
        (out.add_ if accumulate else out.copy_)(view_payload(payload, dtype))
        return True


class ExactSumCall(LayoutCall):
    """One call of ``none`` without ``wire_dtype``: partial sums accumulate in fp64; ``work``
    (fp32) receives the final sums and gathered shards, input-dtype values exact in fp32."""

    def __init__(self, x: torch.Tensor, ctx: CallContext) -> None:
        super().__init__(x, ctx, 1)  # blocks of 1: no padding
        # state: the simulator replays ``none`` as a block codec in this dtype
        self.dtype = self.state = x.dtype
        self.values = x.reshape(-1)  # this rank's own values, sent as they are
        # the communicator's reused buffers on the CPU (dqcoll.scratch); None elsewhere
        self.pool = scratch.pool_for(ctx.state, x.device)
        self._wide: torch.Tensor | None = None  # fp64 partial sums, widened at first use
        self._widened: set[int] = set()
        if (ctx.own_input and ctx.collective is Collective.ALL_GATHER
                and x.dtype == torch.float32 and x.is_contiguous()):
            self.work = self.values  # the library's own buffer: every chunk lands in place
        else:
            self.work = self._take(self.numel, torch.float32)
        if ctx.schedule is not None:  # the bytes all ranks send: the partial sums, then shards
            n = self.world_size
            sums = 0 if ctx.collective is Collective.ALL_GATHER else sum(
                self.payload_nbytes(chunk, count) for row in ctx.schedule.subtree_sizes()
                for chunk, count in enumerate(row) if count < n)
            gathers = 0 if ctx.collective is Collective.REDUCE_SCATTER else n - 1
            self.info["wire_payload_nbytes"] = sums + gathers * self.numel * self.dtype.itemsize

    def _wire_dtype(self, count: int) -> torch.dtype:
        return self.dtype if count in (1, self.world_size) else _WIDE

    def _take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised ``dtype`` buffer of ``numel`` for this call (pooled on the CPU)."""
        if self.pool is None:
            return torch.empty(numel, dtype=dtype, device=self.values.device)
        return self.pool.take(numel * dtype.itemsize).view(dtype)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer for this call's messages. No ``frame``: partial sums
        travel from the fp64 buffer without header room, and every rank must frame alike."""
        return self._take(nbytes, torch.uint8)

    def _sums(self, chunk: int) -> torch.Tensor:
        """The fp64 partial sums of ``chunk`` (this rank's values widened at first use)."""
        if self._wide is None:
            self._wide = self._take(self.numel, _WIDE)
        sums = self._wide[self._bounds(chunk)]
        if chunk not in self._widened:
            _widen_into(sums, self.values[self._bounds(chunk)], add=False)
            self._widened.add(chunk)
        return sums

    def payload_nbytes(self, chunk: int, count: int) -> int:
        return self._chunk(chunk).numel() * self._wire_dtype(count).itemsize

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        if count == 1:  # one rank's own values, as they are
            values = self.values[self._bounds(chunk)]
        else:
            values = self._sums(chunk)
            if count < self.world_size:
                return values.view(torch.uint8)
            if self.op is ReduceOp.AVG:  # the final sum: rounded once, saturating
                values = values / self.world_size
        payload = self._take(values.numel(), self.dtype)
        copy_saturating(payload, values)
        return payload.view(torch.uint8)

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        # a final sum, or (all-gather) one rank's shard: values of the input dtype
        self._chunk(chunk).copy_(view_payload(payload, self._wire_dtype(count)))

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        _widen_into(self._sums(chunk), view_payload(payload, self._wire_dtype(count)), add=True)

    def finish_shard(self, rank: int, out: torch.Tensor) -> None:
        """Reduce-scatter: this rank's shard (its decoded final sums)."""
        out.copy_(self._chunk(rank).view(out.shape))

    def finish(self, out: torch.Tensor) -> None:
        """All-reduce and all-gather: every chunk holds input-dtype values, so the cast is exact."""
        if not same_memory(self.work, out):
            out.copy_(self.work.view(out.shape))
