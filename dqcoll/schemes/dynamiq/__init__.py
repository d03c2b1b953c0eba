"""DynamiQ (arXiv 2602.08923): the flagship scheme. See :mod:`dqcoll.kernels.codec` for the
format and :mod:`dqcoll.kernels.rng` for the random numbers (with the kernels, which implement
them), :mod:`.options` for the scheme's options and format presets, :mod:`.allocation` for
dqcoll's bit allocation (:mod:`.allocation_paper` for the paper's), :mod:`.scheme` for the scheme
and :mod:`.call` for the per-call planning."""

from __future__ import annotations

from ...kernels.codec import CodecConfig, Levels, RoundingMode, Scales, Widths
from .allocation import Allocation, allocate_widths, min_bits
from .call import DynamiqCall
from .options import FORMATS, DynamiqFormat
from .scheme import DynamiqScheme

__all__ = [
    "FORMATS",
    "Allocation",
    "CodecConfig",
    "DynamiqCall",
    "DynamiqFormat",
    "DynamiqScheme",
    "Levels",
    "RoundingMode",
    "Scales",
    "Widths",
    "allocate_widths",
    "min_bits",
]
