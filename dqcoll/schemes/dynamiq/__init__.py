"""DynamiQ (arXiv 2602.08923): the flagship scheme. See :mod:`.codec` for the format,
:mod:`.allocation` for the bit allocation, :mod:`.rng` for the random numbers and :mod:`.scheme`
for the per-call planning."""

from __future__ import annotations

from .allocation import Allocation, allocate_widths, min_bits
from .codec import CodecConfig, Levels, RoundingMode, Scales, Widths
from .scheme import DynamiqCall, DynamiqScheme

__all__ = [
    "Allocation",
    "CodecConfig",
    "DynamiqCall",
    "DynamiqScheme",
    "Levels",
    "RoundingMode",
    "Scales",
    "Widths",
    "allocate_widths",
    "min_bits",
]
