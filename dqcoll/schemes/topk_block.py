"""``topk_block``: Omni-Reduce-style block sparsification: keep the largest 256-coordinate blocks.

Each rank marks its top ``ceil(density * blocks)`` blocks by L2 norm in a uint8 bitmap; one max
all-reduce agrees on their union, whose blocks travel densely as fp32 and are summed at each hop;
other blocks are zero in the result (biased). Reduce-scatter / all-gather: chunk ``c`` is the
union's blocks inside shard ``c``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..types import ReduceOp
from .base import CallContext, SchemeSpec
from .elementwise import BlockLayout, LayoutCall, split_blocks, view_payload

__all__ = ["TOPK_BLOCK", "TopKBlockCall", "TopKBlockScheme"]

TOPK_BLOCK = 256


class TopKBlockScheme:
    spec = SchemeSpec(
        name="topk_block",
        description="Omni-Reduce style: each rank's largest 256-coordinate blocks, union agreed "
        "by a bitmap max all-reduce, dense fp32 sums of the union",
        bits_per_coord=None,  # data-dependent: 32 bits x (union blocks / blocks) + bitmap
        unbiased=False,
        exact_sums=False,
        needs_global_stats=True,
        options=("density",),
    )
    block = TOPK_BLOCK

    def __init__(self, density: float = 0.125) -> None:
        self.density = float(density)
        if not 0.0 < self.density <= 1.0:
            raise InvalidArgumentError(f"topk_block: density must be in (0, 1], got {self.density}")

    def __repr__(self) -> str:
        return f"TopKBlockScheme(density={self.density:g})"

    def keep_blocks(self, nblocks: int) -> int:
        return min(nblocks, max(1, math.ceil(self.density * nblocks)))

    def local_bitmap(self, work: torch.Tensor) -> torch.Tensor:
        """uint8 ``[blocks]``: 1 for this rank's top blocks by L2 norm (NaN counts as largest)."""
        blocks = work.view(-1, TOPK_BLOCK)
        norm2 = blocks.double().square().sum(dim=1)
        norm2 = torch.nan_to_num(norm2, nan=math.inf)
        keep = self.keep_blocks(blocks.shape[0])
        order = torch.argsort(-norm2, stable=True)[:keep]
        bitmap = torch.zeros(blocks.shape[0], dtype=torch.uint8, device=work.device)
        bitmap[order] = 1
        return bitmap

    def begin(self, x: torch.Tensor, ctx: CallContext) -> TopKBlockCall:
        return TopKBlockCall(self, x, ctx)

    # -- single-shot codec: block indices + fp32 values of the kept blocks -----------------------

    def wire_nbytes(self, numel: int) -> int:
        nblocks = -(-numel // TOPK_BLOCK)
        return self.keep_blocks(nblocks) * TOPK_BLOCK * 4 + nblocks

    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        padded = BlockLayout(x.numel(), TOPK_BLOCK, 1, False).pad(x.detach())
        bitmap = self.local_bitmap(padded)
        kept = torch.nonzero(bitmap).squeeze(1)
        return {"numel": x.numel(), "shape": tuple(x.shape), "bitmap": bitmap,
                "data": padded.view(-1, TOPK_BLOCK)[kept].reshape(-1)}

    def decode(self, payload: dict[str, Any]) -> torch.Tensor:
        bitmap = payload["bitmap"]
        out = torch.zeros(bitmap.numel(), TOPK_BLOCK, device=bitmap.device)
        out[torch.nonzero(bitmap).squeeze(1)] = payload["data"].view(-1, TOPK_BLOCK)
        return out.reshape(-1)[: payload["numel"]].reshape(payload["shape"])


class TopKBlockCall(LayoutCall):
    """One call: the bitmap all-reduce, the compacted union, dense fp32 hops."""

    def __init__(self, scheme: TopKBlockScheme, x: torch.Tensor, ctx: CallContext) -> None:
        super().__init__(x, ctx, TOPK_BLOCK)
        padded = self.layout.pad(x)
        bitmap = scheme.local_bitmap(padded)
        ctx.reduce(bitmap, "max", f"{ctx.what} block bitmap")
        self.union = torch.nonzero(bitmap).squeeze(1)  # sorted block indices
        self.work = padded.view(-1, TOPK_BLOCK)[self.union].reshape(-1)  # fp32, union only
        rows = self.union.numel()
        if self.layout.sharded:  # the union's blocks inside each shard
            edges = torch.tensor(self.chunk_bounds, device=self.union.device) // TOPK_BLOCK
            row_bounds = torch.searchsorted(self.union, edges).tolist()
        else:
            row_bounds = split_blocks(rows, self.world_size)
        self.chunk_bounds = [r * TOPK_BLOCK for r in row_bounds]
        total_blocks = padded.numel() // TOPK_BLOCK
        self.info = {"kept_blocks": rows, "blocks": total_blocks,
                     "density": rows / max(total_blocks, 1)}

    def payload_nbytes(self, chunk: int, count: int) -> int:
        return 4 * self._chunk(chunk).numel()

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        return self._chunk(chunk).contiguous().view(torch.uint8).clone()

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self._chunk(chunk).copy_(view_payload(payload, torch.float32))

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self._chunk(chunk).add_(view_payload(payload, torch.float32))

    def finish(self, out: torch.Tensor) -> None:
        full = self.work.new_zeros(self.layout.padded_numel // TOPK_BLOCK, TOPK_BLOCK)
        full[self.union] = self.work.view(-1, TOPK_BLOCK)
        result = self.layout.unpad(full.view(-1))
        if self.op is ReduceOp.AVG:
            result = result / self.world_size
        out.copy_(result.reshape(out.shape))
