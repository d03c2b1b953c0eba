"""``bf16``: every hop sends bfloat16, rounded to nearest even from the fp32 partial sum.

16 bits per coordinate, no metadata; re-rounded at every hop, so biased, with a relative error
of at most 2**-9 per hop: ``none`` with ``wire_dtype=torch.bfloat16``, under its own name."""

from __future__ import annotations

import torch

from .base import SchemeSpec
from .none import NoneScheme

__all__ = ["BF16Scheme"]


class BF16Scheme(NoneScheme):
    spec = SchemeSpec(
        name="bf16",
        description="bfloat16 on the wire (round-to-nearest-even at every hop)",
        bits_per_coord=16.0,
        unbiased=False,
        exact_sums=False,
    )

    def __init__(self) -> None:
        super().__init__(wire_dtype=torch.bfloat16)
