"""``int8_block`` / ``int4_block``: ZeRO++-style symmetric block quantization with fp32 scales.

Per block of ``block`` coordinates (default 128): ``scale = amax / qmax`` in fp32 (``qmax`` = 127
or 7), codes ``q = clamp(round(x / scale), -qmax, qmax)`` (half to even), decoded as ``q * scale``.
Payload of ``B`` blocks: ``B`` little-endian fp32 scales, then the codes ``q + qmax`` packed
LSB-first. Every hop requantizes with fresh scales (biased); a non-finite block decodes as NaN.
The ``*_torch`` functions are the spec; CPU tensors run compiled kernels (same bytes).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..kernels.baselines import cpu_kernels
from .base import SchemeSpec
from .bitpack import pack_bits_torch, packed_nbytes, unpack_bits_torch
from .elementwise import BlockCodec

__all__ = ["DEFAULT_BLOCK", "Int4BlockScheme", "Int8BlockScheme", "IntBlockScheme",
           "int_block_decode_torch", "int_block_encode_torch"]

# 128: the MX formats' metadata rate (0.25 bit per coordinate), so the two compare at equal cost.
DEFAULT_BLOCK = 128


def int_block_encode_torch(values: torch.Tensor, block: int, code_bits: int) -> torch.Tensor:
    """fp32 ``[B * block]`` -> ``B`` fp32 scales (bytes), then codes ``q + qmax`` packed."""
    qmax = (1 << (code_bits - 1)) - 1
    blocks = values.view(-1, block)
    amax = blocks.abs().amax(dim=1)
    scale = amax / qmax  # fp32 division, one rounding; NaN/Inf stay non-finite
    usable = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(usable, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp(-qmax, qmax)
    q = torch.where(usable[:, None], q, torch.zeros_like(q)).to(torch.int64)
    scale_bytes = scale.contiguous().view(torch.uint8)
    return torch.cat([scale_bytes, pack_bits_torch(q + qmax, code_bits)])


def int_block_decode_torch(
    payload: torch.Tensor, numel: int, block: int, code_bits: int
) -> torch.Tensor:
    """Inverse of :func:`int_block_encode_torch` (a non-finite scale decodes as NaN)."""
    qmax = (1 << (code_bits - 1)) - 1
    nblocks = numel // block
    scale = payload[: 4 * nblocks].clone().view(torch.float32)
    codes = unpack_bits_torch(payload[4 * nblocks :], code_bits, numel) - qmax
    values = codes.view(nblocks, block).to(torch.float32) * scale[:, None]
    return torch.where(torch.isfinite(scale)[:, None], values, math.nan).reshape(-1)


class IntBlockScheme(BlockCodec):
    code_bits: int = 8

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        self.block = int(block)
        if self.block < 2 or self.block % 2:
            raise InvalidArgumentError(
                f"{self.spec.name}: block must be an even number >= 2, got {self.block}")
        self.spec = _int_spec(self.spec.name, self.code_bits, self.block)

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        return 4 * (numel // self.block) + packed_nbytes(numel, self.code_bits)

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        kernels = cpu_kernels(values.device)
        encode = int_block_encode_torch if kernels is None else kernels.int_block_encode
        return encode(values, self.block, self.code_bits)  # type: ignore[no-any-return]

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        return int_block_decode_torch(payload, numel, self.block, self.code_bits)

    def decode_into(
        self, payload: torch.Tensor, out: torch.Tensor, count: int, ctx: Any, accumulate: bool
    ) -> bool:
        kernels = cpu_kernels(out.device)
        if kernels is not None:
            kernels.int_block_decode(payload, out, self.block, self.code_bits, accumulate)
        return kernels is not None

    def decode_accumulate_encode(
        self, payload: torch.Tensor, work: torch.Tensor, count: int, out_count: int, ctx: Any
    ) -> torch.Tensor | None:
        kernels = cpu_kernels(work.device)
        if kernels is None:
            return None
        return kernels.int_block_decode_accumulate_encode(  # type: ignore[no-any-return]
            payload, work, self.block, self.code_bits)


def _int_spec(name: str, bits: int, block: int) -> SchemeSpec:
    return SchemeSpec(
        name=name,
        description=f"ZeRO++-style int{bits} blocks of {block} with an fp32 scale, "
        "round-to-nearest, requantized at every hop",
        bits_per_coord=bits + 32 / block,
        unbiased=False,
        exact_sums=False,
        options=("block",),
    )


class Int8BlockScheme(IntBlockScheme):
    spec = _int_spec("int8_block", 8, DEFAULT_BLOCK)
    code_bits = 8


class Int4BlockScheme(IntBlockScheme):
    spec = _int_spec("int4_block", 4, DEFAULT_BLOCK)
    code_bits = 4
