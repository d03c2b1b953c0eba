"""``int8_block`` / ``int4_block``: ZeRO++-style symmetric block quantization with fp32 scales.

Per block of ``block`` coordinates (default 128): ``scale = amax / qmax`` in fp32 (``qmax`` = 127
or 7), codes ``q = clamp(round(x / scale), -qmax, qmax)`` with round-half-to-even, decoded as
``q * scale``. Payload of a run of ``B`` blocks: ``B`` fp32 scales (little-endian), then the codes
``q + qmax`` packed LSB-first (two per byte at 4 bits). Bits per coordinate: ``b + 32 / block``
(8.25 and 4.25 at the default block of 128, the same metadata rate as MX's 8-bit scale per 32).

Every hop decompresses, accumulates in fp32 and recompresses with fresh scales (ZeRO++'s qgZ
does the same per hop): round-to-nearest re-rounds the partial sum each time, so the result is
biased and the error grows with the schedule's depth. A non-finite block gets a non-finite scale
and decodes as NaN on every rank.

Rejected: ZeRO++'s asymmetric (min/max) variant, which doubles the metadata for little gain on
gradients, whose blocks are close to zero-mean.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError
from .base import SchemeSpec
from .bitpack import pack_bits, packed_nbytes, unpack_bits
from .elementwise import BlockCodec

__all__ = ["DEFAULT_BLOCK", "Int4BlockScheme", "Int8BlockScheme", "IntBlockScheme"]

# 128: the same metadata rate (0.25 bit per coordinate) as the MX formats, so the two families
# compare at equal cost; ZeRO++ itself uses larger groups in practice.
DEFAULT_BLOCK = 128


class IntBlockScheme(BlockCodec):
    spec: SchemeSpec
    code_bits: int = 8
    avg_mode = "post"

    def __init__(self, block: int = DEFAULT_BLOCK) -> None:
        block = int(block)
        if block < 2 or block % 2:
            raise InvalidArgumentError(
                f"{self.spec.name}: block must be an even number >= 2, got {block}"
            )
        self.block = block
        self.qmax = (1 << (self.code_bits - 1)) - 1
        self.spec = _int_spec(self.spec.name, self.code_bits, block)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block={self.block})"

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        return 4 * (numel // self.block) + packed_nbytes(numel, self.code_bits)

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        blocks = values.view(-1, self.block)
        amax = blocks.abs().amax(dim=1)
        scale = amax / self.qmax  # fp32 division, one rounding; NaN/Inf stay non-finite
        usable = (scale > 0) & torch.isfinite(scale)
        safe = torch.where(usable, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp(-self.qmax, self.qmax)
        q = torch.where(usable[:, None], q, torch.zeros_like(q)).to(torch.int64)
        scale_bytes = scale.contiguous().view(torch.uint8)
        return torch.cat([scale_bytes, pack_bits(q + self.qmax, self.code_bits)])

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        nblocks = numel // self.block
        scale = payload[: 4 * nblocks].clone().view(torch.float32)
        codes = unpack_bits(payload[4 * nblocks :], self.code_bits, numel) - self.qmax
        values = codes.view(nblocks, self.block).to(torch.float32) * scale[:, None]
        nonfinite = ~torch.isfinite(scale)
        values = torch.where(nonfinite[:, None], torch.full_like(values, float("nan")), values)
        return values.reshape(-1)


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
