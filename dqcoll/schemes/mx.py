"""``mxfp8`` / ``mxfp6`` / ``mxfp4``: OCP Microscaling (MX v1.0) block formats, over any schedule.

Per block of 32 (OCP MX v1.0 §5, §6.3): a shared scale ``X = 2**e`` as E8M0 (byte ``e + 127``;
``0xFF`` = NaN, for a non-finite block), ``e = floor(log2(amax)) - emax_elem`` clamped to
[-127, 127] (``amax = 0``: -127); elements ``P_i = quantize(V_i / X)``, round-to-nearest-even,
saturating (:data:`FORMATS`); decoded as ``X * P_i``. Payload: the blocks' scale bytes, then the
element codes packed LSB-first. Every hop re-encodes with fresh scales (biased).
``scale="global"`` (the DynamiQ paper's variant): a bf16 max all-reduce of each block's absmax
``G`` first; a payload summing ``count`` ranks uses the scale ``bf16_up(count * G / max_elem)``,
so no scale travels. The ``*_torch`` functions are the spec; CPU tensors run compiled kernels.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..kernels.baselines import cpu_kernels
from ..kernels.mx_elements import FORMATS, ElementFormat, decode_table, pow2
from .base import CallContext, SchemeSpec
from .bitpack import pack_bits_torch, packed_nbytes, unpack_bits_torch
from .elementwise import BlockCall, BlockCodec

__all__ = ["FORMATS", "MX_BLOCK", "ElementFormat", "MXFP4Scheme", "MXFP6Scheme", "MXFP8Scheme",
           "MXScheme", "ScaleMode", "bf16_round_up", "decode_table", "encode_elements",
           "mx_decode_global_torch", "mx_decode_torch", "mx_encode_global_torch",
           "mx_encode_torch", "pow2"]

MX_BLOCK = 32  # elements per shared scale (OCP MX v1.0)
E8M0_BIAS = 127
E8M0_NAN = 0xFF


class ScaleMode(enum.Enum):
    OCP = "ocp"  # E8M0 per block, from the block's own amax (OCP MX v1.0)
    GLOBAL = "global"  # bf16 per block from the all-reduced block max (DynamiQ paper's variant)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """``floor(log2(a))`` for positive finite fp32 ``a`` (subnormals included), exact, int64."""
    _, exponent = torch.frexp(a)  # a = m * 2**exponent, m in [0.5, 1)
    return exponent.to(torch.int64) - 1


def encode_elements(v: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fp32 values -> int64 element codes (sign, biased exponent, mantissa; biased exponent 0
    holds subnormals), round-to-nearest-even, saturating; NaN -> code 0."""
    v = v.to(torch.float32)
    sign = torch.signbit(v).to(torch.int64)
    a = v.abs().nan_to_num(nan=0.0, posinf=fmt.max_value)
    a = torch.clamp(a, max=fmt.max_value)  # saturate first: max is representable, so RNE keeps it
    positive = a > 0
    exponent = torch.where(positive, _floor_log2(torch.where(positive, a, 1.0)),
                           torch.full_like(sign, fmt.emin)).clamp(min=fmt.emin)
    quantum_exp = exponent - fmt.mbits  # spacing of representable values at this exponent
    steps = torch.round(a * pow2(-quantum_exp))  # exact scaling, then round half to even
    q = steps * pow2(quantum_exp)  # exact; may have carried into the next binade
    q = torch.clamp(q, max=fmt.max_value)
    normal = q >= 2.0**fmt.emin
    e2 = torch.where(normal, _floor_log2(torch.where(normal, q, 1.0)), torch.full_like(sign, 0))
    mant_normal = (q * pow2(fmt.mbits - e2)).to(torch.int64) - (1 << fmt.mbits)
    mant_sub = (q * pow2(torch.full_like(e2, fmt.mbits - fmt.emin))).to(torch.int64)
    biased = torch.where(normal, e2 + fmt.bias, torch.zeros_like(e2))
    mant = torch.where(normal, mant_normal, mant_sub)
    code = (sign << (fmt.ebits + fmt.mbits)) | (biased << fmt.mbits) | mant
    return torch.where(v.isnan(), torch.zeros_like(code), code)


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Smallest bf16 >= ``x`` (non-negative fp32), returned as fp32; NaN/Inf stay."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
    low = bits & 0xFFFF
    up = (bits >> 16) + (low != 0).to(torch.int64)  # truncate, then one ulp up if anything was cut
    rounded = (up << 16).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), rounded, x.to(torch.float32))


def mx_encode_torch(values: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """OCP MX: fp32 ``[B * 32]`` -> uint8 payload (``B`` E8M0 scales, then packed elements)."""
    blocks = values.view(-1, MX_BLOCK)
    amax = blocks.abs().amax(dim=1)
    finite = torch.isfinite(amax)
    positive = amax > 0
    shared = _floor_log2(torch.where(positive & finite, amax, 1.0)) - fmt.emax
    shared = torch.where(positive, shared, torch.full_like(shared, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)  # E8M0 covers 2**-127 .. 2**127
    scale_bytes = torch.where(finite, shared + E8M0_BIAS, torch.full_like(shared, E8M0_NAN))
    # dividing by a power of two is exact unless it underflows; a NaN scale zeroes the codes
    scale = torch.where(finite, pow2(shared), math.nan)
    return torch.cat([scale_bytes.to(torch.uint8), mx_encode_global_torch(values, scale, fmt)])


def mx_decode_torch(payload: torch.Tensor, numel: int, fmt: ElementFormat) -> torch.Tensor:
    """Inverse of :func:`mx_encode_torch`: uint8 payload -> fp32 ``[numel]``."""
    nblocks = numel // MX_BLOCK
    scale_bytes = payload[:nblocks].to(torch.int64)
    scale = pow2(scale_bytes - E8M0_BIAS)
    scale = torch.where(scale_bytes == E8M0_NAN, torch.full_like(scale, math.nan), scale)
    return mx_decode_global_torch(payload[nblocks:], numel, scale, fmt)


def mx_encode_global_torch(
    values: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat
) -> torch.Tensor:
    """Global variant: fp32 ``[B * 32]`` and fp32 block scales ``[B]`` -> packed element codes
    of ``values / scale`` (codes 0 where the scale is zero or not finite)."""
    usable = (scale > 0) & torch.isfinite(scale)
    safe = torch.where(usable, scale, torch.ones_like(scale))
    codes = encode_elements(values.view(-1, MX_BLOCK) / safe[:, None], fmt)
    codes = torch.where(usable[:, None], codes, torch.zeros_like(codes))
    return pack_bits_torch(codes, fmt.bits)


def mx_decode_global_torch(
    payload: torch.Tensor, numel: int, scale: torch.Tensor, fmt: ElementFormat
) -> torch.Tensor:
    """Inverse of :func:`mx_encode_global_torch` (an Inf scale decodes as NaN)."""
    codes = unpack_bits_torch(payload, fmt.bits, numel).view(-1, MX_BLOCK)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, math.nan), scale)
    return (decode_table(fmt, payload.device)[codes] * scale[:, None]).reshape(-1)


class MXScheme(BlockCodec):
    """Shared implementation; the registered names fix the element family."""

    elements: tuple[str, ...] = ()
    block = MX_BLOCK

    def __init__(self, element: str | None = None, scale: str | ScaleMode = "ocp") -> None:
        self.element = (element or self.elements[0]).lower()
        if self.element not in self.elements:
            raise InvalidArgumentError(f"{self.spec.name}: element must be one of "
                                       f"{list(self.elements)}, got {self.element!r}")
        try:
            self.scale = scale if isinstance(scale, ScaleMode) else ScaleMode(str(scale).lower())
        except ValueError:
            raise InvalidArgumentError(
                f"{self.spec.name}: scale must be one of {[m.value for m in ScaleMode]}, "
                f"got {scale!r}") from None
        self.format = FORMATS[self.element]
        if self.scale is ScaleMode.GLOBAL:
            # the bf16 block maxima (16 bits per block) travel through the statistics all-reduce
            self.spec = dataclasses.replace(
                type(self).spec, bits_per_coord=self.format.bits + 16 / MX_BLOCK,
                needs_global_stats=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(element={self.element!r}, scale={self.scale.value!r})"

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        scales = 0 if self.scale is ScaleMode.GLOBAL else numel // MX_BLOCK
        return scales + packed_nbytes(numel, self.format.bits)

    def wire_nbytes(self, numel: int) -> int:
        """Single-shot bytes: codes and scales (global variant: 2 bytes of block maximum)."""
        maxima = 2 * -(-numel // MX_BLOCK) if self.scale is ScaleMode.GLOBAL else 0
        return super().wire_nbytes(numel) + maxima

    def prepare(self, work: torch.Tensor, ctx: CallContext) -> Any:
        """Global variant: each block's absmax rounded up to bf16, max-reduced over the ranks (Inf
        marks a non-finite block: a max all-reduce of NaN is not portable across backends)."""
        if self.scale is ScaleMode.OCP:
            return None
        amax = work.view(-1, MX_BLOCK).abs().amax(dim=1)
        amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.inf))
        gmax = bf16_round_up(amax).to(torch.bfloat16)  # exact: bf16 values
        ctx.reduce(gmax, "max", f"{ctx.what} block maxima")
        return gmax.float()

    def global_scale(self, block_max: torch.Tensor, count: int) -> torch.Tensor:
        """bf16 scale of a payload summing ``count`` ranks: ``bf16_up(count * G / max_elem)``."""
        return bf16_round_up(block_max * float(count) / self.format.max_value)

    def _scale(self, ctx: Any, count: int) -> torch.Tensor | None:
        """The fp32 block scales of a payload (None: OCP, the scales travel in the payload)."""
        return None if self.scale is ScaleMode.OCP else self.global_scale(ctx, count)

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        scale = self._scale(ctx, count)
        kernels = cpu_kernels(values.device)
        if kernels is not None:
            return kernels.mx_encode(values, self.format, scale)  # type: ignore[no-any-return]
        if scale is None:
            return mx_encode_torch(values, self.format)
        return mx_encode_global_torch(values, scale, self.format)

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        scale = self._scale(ctx, count)
        if scale is None:
            return mx_decode_torch(payload, numel, self.format)
        return mx_decode_global_torch(payload, numel, scale, self.format)

    def decode_into(
        self, payload: torch.Tensor, out: torch.Tensor, count: int, ctx: Any, accumulate: bool
    ) -> bool:
        kernels = cpu_kernels(out.device)
        if kernels is not None:
            kernels.mx_decode(payload, out, self.format, self._scale(ctx, count), accumulate)
        return kernels is not None

    def decode_accumulate_encode(
        self, payload: torch.Tensor, work: torch.Tensor, count: int, out_count: int, ctx: Any
    ) -> torch.Tensor | None:
        kernels = cpu_kernels(work.device)
        if kernels is None:
            return None
        return kernels.mx_decode_accumulate_encode(  # type: ignore[no-any-return]
            payload, work, self.format, self._scale(ctx, count), self._scale(ctx, out_count))

    def begin(self, x: torch.Tensor, ctx: CallContext) -> BlockCall:
        return (_GlobalScaleCall if self.scale is ScaleMode.GLOBAL else BlockCall)(self, x, ctx)


class _GlobalScaleCall(BlockCall):
    """The global variant's codec state per chunk is that chunk's slice of the block maxima."""

    def _state(self, chunk: int) -> torch.Tensor:
        bounds = self._bounds(chunk)
        return self.state[bounds.start // MX_BLOCK : bounds.stop // MX_BLOCK]  # type: ignore


def _mx_spec(name: str, bits: int, elements: str) -> SchemeSpec:
    return SchemeSpec(
        name=name,
        description=f"OCP MX v1.0: blocks of 32, E8M0 scale, {elements} elements, "
        "round-to-nearest-even, saturating (scale='global': DynamiQ paper's bf16 scale from an "
        "all-reduced block max)",
        bits_per_coord=bits + 8 / MX_BLOCK,
        unbiased=False,
        exact_sums=False,
        options=("element", "scale"),
    )


class MXFP8Scheme(MXScheme):
    spec = _mx_spec("mxfp8", 8, "E4M3 (default) or E5M2")
    elements = ("e4m3", "e5m2")


class MXFP6Scheme(MXScheme):
    spec = _mx_spec("mxfp6", 6, "E2M3 (default) or E3M2")
    elements = ("e2m3", "e3m2")


class MXFP4Scheme(MXScheme):
    spec = _mx_spec("mxfp4", 4, "E2M1")
    elements = ("e2m1",)
