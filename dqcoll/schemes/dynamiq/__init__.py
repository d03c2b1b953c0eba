"""DynamiQ (arXiv 2602.08923): the flagship scheme. The format is :mod:`dqcoll.kernels.codec`
and :mod:`dqcoll.kernels.rng`; here :mod:`.options`, :mod:`.allocation`,
:mod:`.scheme` and the per-call planning :mod:`.call`."""

from __future__ import annotations

from ...kernels.codec import CodecConfig, Levels, RoundingMode, Scales
from .allocation import Allocation, allocate_widths, min_bits
from .call import DynamiqCall
from .options import FORMATS, AllocationRule, DynamiqFormat, register_format
from .scheme import DynamiqScheme

__all__ = [
    "FORMATS",
    "Allocation",
    "AllocationRule",
    "CodecConfig",
    "DynamiqCall",
    "DynamiqFormat",
    "DynamiqScheme",
    "Levels",
    "RoundingMode",
    "Scales",
    "allocate_widths",
    "min_bits",
    "register_format",
]
