"""``bf16``: every hop sends bfloat16, rounded to nearest even from the fp32 partial sum.

The cheapest baseline that every accelerator supports natively: 16 bits per coordinate, no
metadata, no statistics. Partial sums are re-rounded at every hop (decompress to fp32, add, round
again), so the result is biased and not exact, but the relative error per hop is at most 2**-9.
``none`` with ``wire_dtype=torch.bfloat16`` moves the same bytes; this name exists so that
the lab's ``eval`` and the tuner can list it beside the other schemes with its own metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import SchemeSpec
from .elementwise import BlockCodec

__all__ = ["BF16Scheme"]


class BF16Scheme(BlockCodec):
    spec = SchemeSpec(
        name="bf16",
        description="bfloat16 on the wire (round-to-nearest-even at every hop)",
        bits_per_coord=16.0,
        unbiased=False,
        exact_sums=False,
    )
    block = 1
    avg_mode = "post"

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        return 2 * numel

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        return values.to(torch.bfloat16).view(torch.uint8).reshape(-1)

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        return payload.view(torch.bfloat16).float()

    def decode_into(
        self, payload: torch.Tensor, out: torch.Tensor, count: int, ctx: Any, accumulate: bool
    ) -> bool:
        """bf16 upcasts exactly: ``out += bf16`` is ``out + float(bf16)``, in one pass without
        the fp32 copy."""
        values = payload.view(torch.bfloat16)
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)
        return True
