"""``bf16``: every hop sends bfloat16, rounded to nearest even from the fp32 partial sum.

16 bits per coordinate, no metadata; re-rounded at every hop, so biased, with a relative error
of at most 2**-9 per hop. Moves the same bytes as ``none`` with ``wire_dtype=torch.bfloat16``."""

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
        """bf16 upcasts exactly, so accumulate in one pass without an fp32 copy."""
        values = payload.view(torch.bfloat16)
        if accumulate:
            out.add_(values)
        else:
            out.copy_(values)
        return True
