"""Compiled CPU (numba) kernels of the baseline codecs: MX formats, int blocks, bit packing, and
the quantizers of the integer-sum schemes (THC, global QSGD).

Same bytes and decoded values as the torch references in :mod:`dqcoll.schemes` (``mx``,
``int_block``, ``bitpack``, ``thc``, ``global_qsgd``), which define the formats; the tests hold
them together bit for bit. The references are vectorised torch, which costs one pass over the
buffer per elementwise op: the MX encoder makes ~40 passes, many in int64, and packs 6-bit codes
through a 6-bytes-per-code bit-plane expansion, an order of magnitude slower than
``int8_block``'s (benchmarks/results/codec-rates-baselines-cpu.json). Here one loop per block of
32 (or 128) coordinates keeps the block in registers/L1 from load to packed bytes.

How the bytes stay identical (docs/design.md §3.4, docs/kernels.md):

* every fp32 operation of the reference is one fp32 operation here, in the same order (no
  fastmath, no FMA: :data:`~dqcoll.kernels.cpu_runtime.JIT_OPTIONS`); multiplications by powers
  of two come from an exact table built by the reference's own
  :func:`~dqcoll.kernels.mx_elements.pow2`;
* ``floor(log2 |x|)`` and the block absmax are read from the fp32 bit pattern (the integer max of
  ``bits & 0x7FFFFFFF`` orders finite values like their magnitudes and puts Inf, then NaN, above
  them: exactly when torch's ``amax`` is non-finite);
* round-half-to-even is ``np.rint`` (LLVM ``rint`` in the default rounding mode);
* the 32-bit hash of :mod:`dqcoll.kernels.rng` runs in uint64 masked to 32 bits after
  each multiply (numba types uint32 * uint32 as uint64 anyway).

Every kernel is a top-level ``@njit(**JIT_OPTIONS)`` function over rows ``[lo, hi)`` (a row is a
block, or a group of 8 codes for bit packing) for :func:`~dqcoll.kernels.cpu_runtime.run_rows`;
the launchers below check, allocate and launch, and hold no policy (which implementation runs is
decided by :mod:`dqcoll.kernels.baselines`). Scale mode and packing width are branches per block,
outside the per-element loops, so each inner loop stays a straight-line loop over 32 elements.

Rejected: a vectorised torch rewrite of the MX encoder (still ~15 passes and gathers; ~20 M
coords/s for DynamiQ's comparable encoder, docs/design.md §7) and numba ``parallel=True`` (see
:mod:`.cpu_runtime`).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .cpu_runtime import JIT_OPTIONS, run_rows
from .mx_elements import FORMATS, decode_table, pow2

__all__ = [
    "int_block_decode",
    "int_block_decode_accumulate_encode",
    "int_block_encode",
    "mx_decode",
    "mx_decode_accumulate_encode",
    "mx_encode",
    "pack_bits",
    "qsgd_dequantize",
    "qsgd_quantize",
    "thc_dequantize",
    "thc_quantize",
    "unpack_accumulate",
    "unpack_bits",
]

MX_BLOCK = 32
_POW2_MIN = -149  # _pow2_table()[e - _POW2_MIN] == 2**e for e in [-149, 127]
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_MASK32 = np.uint64(0xFFFFFFFF)
_M1 = np.uint64(0x21F0AAAD)  # mix32 multipliers (dqcoll.kernels.rng)
_M2 = np.uint64(0x735A2D97)
_NAN32 = np.float32(np.nan)
_TWO_M24 = np.float32(2.0**-24)


@functools.lru_cache(maxsize=1)
def _pow2_table() -> np.ndarray:
    """Exact fp32 ``2**e`` for e in [-149, 127] (1 KiB), built once per process."""
    return pow2(torch.arange(_POW2_MIN, 128)).numpy().copy()


def _np(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy()


def _out(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """The numpy view of an output written in place: it must be a contiguous CPU ``dtype``
    tensor (a copy would drop the writes)."""
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"expected a contiguous CPU {dtype} output, got {t.dtype} on {t.device} with "
            f"strides {t.stride()}"
        )
    return t.numpy()


# -- shared pieces -----------------------------------------------------------------------------


@numba.njit(**JIT_OPTIONS)
def _encode_element(f, u, sbit, mbits, emin, max_bits, max_code, pow2):  # type: ignore[no-untyped-def]
    """One fp32 value ``f`` (bits ``u``) -> element code: RNE, saturating, NaN -> 0.

    ``code = sign << sbit | ((e - emin) << mbits) + rint(|f| / 2**(e - mbits))`` with
    ``e = max(floor(log2 |f|), emin)``: in the normal range ``rint`` gives ``2**mbits + mant``
    (a carry to ``2**(mbits+1)`` is the next binade, mantissa 0), in the subnormal range the
    mantissa alone; the same codes as the reference's ``q = steps * 2**qe`` decomposition.
    """
    au = u & _ABS
    sign = np.int64(u >> np.uint32(31)) << sbit
    if au > _INF_BITS:  # NaN
        return np.int64(0)
    if au >= max_bits:  # saturate (Inf included); the largest value is representable
        return sign | max_code
    e = max(np.int64(au >> np.uint32(23)) - 127, emin)  # fp32 subnormals: below 2**emin
    steps = np.int64(np.rint(np.abs(f) * pow2[mbits - e - _POW2_MIN]))
    return sign | (((e - emin) << mbits) + steps)


@numba.njit(**JIT_OPTIONS)
def _pack_block(codes, width, out, base):  # type: ignore[no-untyped-def]
    """``len(codes)`` (a multiple of 8) codes of ``width`` in {4, 6, 8} bits -> bytes from
    ``out[base]``, LSB-first (:mod:`dqcoll.schemes.bitpack`)."""
    n = codes.shape[0]
    if width == 8:
        for j in range(n):
            out[base + j] = np.uint8(codes[j])
    elif width == 4:
        for j in range(n // 2):
            out[base + j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
    else:  # 6: four codes in three bytes
        for j in range(n // 4):
            word = (codes[4 * j] | (codes[4 * j + 1] << 6) | (codes[4 * j + 2] << 12)
                    | (codes[4 * j + 3] << 18))
            out[base + 3 * j] = np.uint8(word & 0xFF)
            out[base + 3 * j + 1] = np.uint8((word >> 8) & 0xFF)
            out[base + 3 * j + 2] = np.uint8((word >> 16) & 0xFF)


@numba.njit(**JIT_OPTIONS)
def _unpack_block(data, base, width, codes):  # type: ignore[no-untyped-def]
    """Inverse of :func:`_pack_block`: bytes from ``data[base]`` -> ``codes``."""
    n = codes.shape[0]
    if width == 8:
        for j in range(n):
            codes[j] = np.int64(data[base + j])
    elif width == 4:
        for j in range(n // 2):
            byte = np.int64(data[base + j])
            codes[2 * j] = byte & 0xF
            codes[2 * j + 1] = byte >> 4
    else:
        for j in range(n // 4):
            word = (np.int64(data[base + 3 * j]) | (np.int64(data[base + 3 * j + 1]) << 8)
                    | (np.int64(data[base + 3 * j + 2]) << 16))
            codes[4 * j] = word & 0x3F
            codes[4 * j + 1] = (word >> 6) & 0x3F
            codes[4 * j + 2] = (word >> 12) & 0x3F
            codes[4 * j + 3] = (word >> 18) & 0x3F


# -- MX ----------------------------------------------------------------------------------------


@numba.njit(**JIT_OPTIONS)
def _mx_block_encode(x, xb, b, ocp, gscale, scale_out, codes_out, width, sbit, mbits, emin,
                     emax, max_bits, max_code, pow2, scaled, sb, codes):  # type: ignore[no-untyped-def]
    """Block ``b`` of ``x`` (fp32, bits ``xb``) -> its scale byte (OCP) and packed codes."""
    base = b * MX_BLOCK
    if ocp:
        amax = np.uint32(0)
        for j in range(MX_BLOCK):
            amax = max(amax, xb[base + j] & _ABS)
        if amax >= _INF_BITS:  # NaN or Inf in the block: scale NaN, codes 0
            scale_out[b] = np.uint8(0xFF)
            for j in range(MX_BLOCK):
                codes[j] = 0
        else:
            # floor(log2 amax) - emax, clamped to E8M0's [-127, 127]; fp32 subnormals and zero
            # land below -127 for every element format (emax >= 2)
            shared = min(max(np.int64(amax >> np.uint32(23)) - 127 - emax, -127), 127)
            scale_out[b] = np.uint8(shared + 127)
            factor = pow2[-shared - _POW2_MIN]
            for j in range(MX_BLOCK):
                scaled[j] = x[base + j] * factor
            for j in range(MX_BLOCK):
                codes[j] = _encode_element(scaled[j], sb[j], sbit, mbits, emin, max_bits,
                                           max_code, pow2)
    else:
        s = gscale[b]
        if s > 0 and s < np.inf:
            for j in range(MX_BLOCK):
                scaled[j] = x[base + j] / s
            for j in range(MX_BLOCK):
                codes[j] = _encode_element(scaled[j], sb[j], sbit, mbits, emin, max_bits,
                                           max_code, pow2)
        else:
            for j in range(MX_BLOCK):
                codes[j] = 0
    _pack_block(codes, width, codes_out, b * (MX_BLOCK * width // 8))


@numba.njit(**JIT_OPTIONS)
def _mx_encode_kernel(lo, hi, x, ocp, gscale, scale_out, codes_out, width, sbit, mbits, emin,
                      emax, max_bits, max_code, pow2):  # type: ignore[no-untyped-def]
    xb = x.view(np.uint32)
    scaled = np.empty(MX_BLOCK, np.float32)
    sb = scaled.view(np.uint32)
    codes = np.empty(MX_BLOCK, np.int64)
    for b in range(lo, hi):
        _mx_block_encode(x, xb, b, ocp, gscale, scale_out, codes_out, width, sbit, mbits, emin,
                         emax, max_bits, max_code, pow2, scaled, sb, codes)


@numba.njit(**JIT_OPTIONS)
def _mx_block_scale(b, ocp, scale_in, gscale, pow2):  # type: ignore[no-untyped-def]
    """Decoded scale of block ``b``: 2**(byte - 127) or NaN (OCP); the bf16 scale, Inf -> NaN."""
    if ocp:
        byte = np.int64(scale_in[b])
        return _NAN32 if byte == 0xFF else pow2[byte - 127 - _POW2_MIN]
    s = gscale[b]
    return _NAN32 if s == np.inf else s


@numba.njit(**JIT_OPTIONS)
def _mx_decode_kernel(lo, hi, scale_in, codes_in, ocp, gscale, width, table, pow2, out,
                      accumulate):  # type: ignore[no-untyped-def]
    codes = np.empty(MX_BLOCK, np.int64)
    nbytes = MX_BLOCK * width // 8
    for b in range(lo, hi):
        s = _mx_block_scale(b, ocp, scale_in, gscale, pow2)
        _unpack_block(codes_in, b * nbytes, width, codes)
        base = b * MX_BLOCK
        if accumulate:
            for j in range(MX_BLOCK):
                out[base + j] = out[base + j] + table[codes[j]] * s
        else:
            for j in range(MX_BLOCK):
                out[base + j] = table[codes[j]] * s


@numba.njit(**JIT_OPTIONS)
def _mx_dae_kernel(lo, hi, scale_in, codes_in, gscale_in, work, ocp, gscale_out, scale_out,
                   codes_out, width, table, sbit, mbits, emin, emax, max_bits, max_code,
                   pow2):  # type: ignore[no-untyped-def]
    """Fused decode, accumulate into ``work``, encode ``work`` (block by block, in cache)."""
    wb = work.view(np.uint32)
    scaled = np.empty(MX_BLOCK, np.float32)
    sb = scaled.view(np.uint32)
    codes = np.empty(MX_BLOCK, np.int64)
    nbytes = MX_BLOCK * width // 8
    for b in range(lo, hi):
        s = _mx_block_scale(b, ocp, scale_in, gscale_in, pow2)
        _unpack_block(codes_in, b * nbytes, width, codes)
        base = b * MX_BLOCK
        for j in range(MX_BLOCK):
            work[base + j] = work[base + j] + table[codes[j]] * s
        _mx_block_encode(work, wb, b, ocp, gscale_out, scale_out, codes_out, width, sbit, mbits,
                         emin, emax, max_bits, max_code, pow2, scaled, sb, codes)


def _mx_format_args(fmt) -> tuple[int, int, int, int, np.uint32, int]:  # type: ignore[no-untyped-def]
    max_bits = np.array([fmt.max_value], np.float32).view(np.uint32)[0]
    max_mag = round(fmt.max_value / 2.0 ** (fmt.emax - fmt.mbits))  # 2**mbits + mantissa
    max_code = ((fmt.emax - fmt.emin) << fmt.mbits) + max_mag
    return fmt.ebits + fmt.mbits, fmt.mbits, fmt.emin, fmt.emax, np.uint32(max_bits), max_code


@functools.lru_cache(maxsize=16)
def _mx_table(name: str) -> np.ndarray:
    """The decode table of element format ``name`` (at most 256 fp32), built once per process
    and format (5 formats)."""
    return decode_table(FORMATS[name]).numpy().copy()


def _check_mx(numel: int, fmt) -> None:  # type: ignore[no-untyped-def]
    if numel % MX_BLOCK:
        raise ValueError(f"MX codecs take whole blocks of {MX_BLOCK}, got {numel} values")
    if fmt.bits not in (4, 6, 8):
        raise ValueError(f"no packing kernel for {fmt.bits}-bit elements")


def _mx_layout(payload: torch.Tensor, nblocks: int, ocp: bool) -> tuple[np.ndarray, np.ndarray]:
    data = _np(payload.reshape(-1))
    if ocp:
        return data[:nblocks], data[nblocks:]
    return data[:0], data


def mx_encode(values: torch.Tensor, fmt, gscale: torch.Tensor | None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``mx_encode_torch`` (``gscale`` None) or the global variant's codes (``gscale``: the fp32
    per-block scales of :meth:`~dqcoll.schemes.mx.MXScheme.global_scale`)."""
    numel = values.numel()
    _check_mx(numel, fmt)
    nblocks = numel // MX_BLOCK
    ocp = gscale is None
    out = torch.empty((nblocks if ocp else 0) + nblocks * MX_BLOCK * fmt.bits // 8,
                      dtype=torch.uint8)
    scale_out, codes_out = _mx_layout(out, nblocks, ocp)
    g = np.empty(0, np.float32) if gscale is None else _np(gscale.to(torch.float32))
    run_rows(_mx_encode_kernel, nblocks, _np(values.reshape(-1).float()), ocp, g, scale_out,
             codes_out, fmt.bits, *_mx_format_args(fmt), _pow2_table())
    return out


def mx_decode(payload: torch.Tensor, out: torch.Tensor, fmt, gscale: torch.Tensor | None,
              accumulate: bool) -> None:  # type: ignore[no-untyped-def]
    """Decode ``payload`` into the fp32 ``out`` (contiguous), or add it (``accumulate``)."""
    numel = out.numel()
    _check_mx(numel, fmt)
    nblocks = numel // MX_BLOCK
    ocp = gscale is None
    scale_in, codes_in = _mx_layout(payload, nblocks, ocp)
    g = np.empty(0, np.float32) if gscale is None else _np(gscale.to(torch.float32))
    run_rows(_mx_decode_kernel, nblocks, scale_in, codes_in, ocp, g, fmt.bits,
             _mx_table(fmt.name), _pow2_table(), _out(out), accumulate)


def mx_decode_accumulate_encode(
    payload: torch.Tensor, work: torch.Tensor, fmt, gscale_in: torch.Tensor | None,
    gscale_out: torch.Tensor | None,
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """``work += decode(payload)`` then ``encode(work)``, in one pass over the blocks."""
    numel = work.numel()
    _check_mx(numel, fmt)
    nblocks = numel // MX_BLOCK
    ocp = gscale_in is None
    scale_in, codes_in = _mx_layout(payload, nblocks, ocp)
    out = torch.empty((nblocks if ocp else 0) + nblocks * MX_BLOCK * fmt.bits // 8,
                      dtype=torch.uint8)
    scale_out, codes_out = _mx_layout(out, nblocks, ocp)
    empty = np.empty(0, np.float32)
    g_in = empty if gscale_in is None else _np(gscale_in.to(torch.float32))
    g_out = empty if gscale_out is None else _np(gscale_out.to(torch.float32))
    run_rows(_mx_dae_kernel, nblocks, scale_in, codes_in, g_in, _out(work), ocp, g_out,
             scale_out, codes_out, fmt.bits, _mx_table(fmt.name), *_mx_format_args(fmt),
             _pow2_table())
    return out


# -- int blocks --------------------------------------------------------------------------------


@numba.njit(**JIT_OPTIONS)
def _int_block_code(v, scale, qmax):  # type: ignore[no-untyped-def]
    """The block code of one value, ``q + qmax`` (round to nearest even, clamped)."""
    q = np.rint(v / scale)
    q = min(max(q, np.float32(-qmax)), np.float32(qmax))
    return np.int32(q) + np.int32(qmax)


@numba.njit(**JIT_OPTIONS)
def _int_block_encode_one(x, xb, b, block, qmax, width, scales, codes_out, codes, one, one_bits):  # type: ignore[no-untyped-def]
    """Block ``b``: its fp32 scale and packed codes. Widths 8 and 4 write the code bytes in the
    value loop (no code buffer: one pass, vectorised); 6 goes through :func:`_pack_block`."""
    base = b * block
    amax = np.uint32(0)
    for j in range(block):
        amax = max(amax, xb[base + j] & _ABS)
    # fp32 amax / qmax, one rounding (NaN/Inf stay non-finite); the bits of amax are the max
    # magnitude's (NaN: the NaN with the largest payload)
    one_bits[0] = amax
    scale = one[0] / np.float32(qmax)
    scales[b] = scale
    finite = scale > 0 and scale < np.inf
    if width == 8:
        out = b * block
        if finite:
            for j in range(block):
                codes_out[out + j] = np.uint8(_int_block_code(x[base + j], scale, qmax))
        else:
            for j in range(block):
                codes_out[out + j] = np.uint8(qmax)
        return
    if width == 4:
        out = b * (block // 2)
        if finite:
            for j in range(block // 2):
                lo = _int_block_code(x[base + 2 * j], scale, qmax)
                hi = _int_block_code(x[base + 2 * j + 1], scale, qmax)
                codes_out[out + j] = np.uint8(lo | (hi << 4))
        else:
            for j in range(block // 2):
                codes_out[out + j] = np.uint8(qmax | (qmax << 4))
        return
    if finite:
        for j in range(block):
            codes[j] = np.int64(_int_block_code(x[base + j], scale, qmax))
    else:
        for j in range(block):
            codes[j] = qmax
    _pack_block(codes, width, codes_out, b * (block * width // 8))


@numba.njit(**JIT_OPTIONS)
def _int_block_encode_kernel(lo, hi, x, block, qmax, width, scales, codes_out):  # type: ignore[no-untyped-def]
    xb = x.view(np.uint32)
    codes = np.empty(block, np.int64)
    one = np.empty(1, np.float32)  # the block's absmax bits, read back as fp32
    one_bits = one.view(np.uint32)
    for b in range(lo, hi):
        _int_block_encode_one(x, xb, b, block, qmax, width, scales, codes_out, codes, one,
                              one_bits)


@numba.njit(**JIT_OPTIONS)
def _int_block_decode_one(b, block, qmax, width, scales, codes_in, codes, out, accumulate):  # type: ignore[no-untyped-def]
    """Block ``b`` of ``codes_in`` into ``out`` (added when ``accumulate``). Widths 8 and 4
    read the code bytes in the value loop; 6 unpacks through :func:`_unpack_block`."""
    s = scales[b]
    base = b * block
    if not (s > -np.inf and s < np.inf):  # NaN or +-Inf
        for j in range(block):
            out[base + j] = out[base + j] + _NAN32 if accumulate else _NAN32
        return
    q0 = np.int32(qmax)
    if width == 8:
        src = b * block
        if accumulate:
            for j in range(block):
                out[base + j] = out[base + j] + np.float32(np.int32(codes_in[src + j]) - q0) * s
        else:
            for j in range(block):
                out[base + j] = np.float32(np.int32(codes_in[src + j]) - q0) * s
        return
    if width == 4:
        src = b * (block // 2)
        if accumulate:
            for j in range(block // 2):
                byte = np.int32(codes_in[src + j])
                out[base + 2 * j] = out[base + 2 * j] + np.float32((byte & 0xF) - q0) * s
                out[base + 2 * j + 1] = out[base + 2 * j + 1] + np.float32((byte >> 4) - q0) * s
        else:
            for j in range(block // 2):
                byte = np.int32(codes_in[src + j])
                out[base + 2 * j] = np.float32((byte & 0xF) - q0) * s
                out[base + 2 * j + 1] = np.float32((byte >> 4) - q0) * s
        return
    _unpack_block(codes_in, b * (block * width // 8), width, codes)
    if accumulate:
        for j in range(block):
            out[base + j] = out[base + j] + np.float32(codes[j] - qmax) * s
    else:
        for j in range(block):
            out[base + j] = np.float32(codes[j] - qmax) * s


@numba.njit(**JIT_OPTIONS)
def _int_block_decode_kernel(lo, hi, block, qmax, width, scales, codes_in, out, accumulate):  # type: ignore[no-untyped-def]
    codes = np.empty(block, np.int64)
    for b in range(lo, hi):
        _int_block_decode_one(b, block, qmax, width, scales, codes_in, codes, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def _int_block_dae_kernel(lo, hi, block, qmax, width, scales_in, codes_in, work, scales_out,
                          codes_out):  # type: ignore[no-untyped-def]
    wb = work.view(np.uint32)
    codes = np.empty(block, np.int64)
    one = np.empty(1, np.float32)
    one_bits = one.view(np.uint32)
    for b in range(lo, hi):
        _int_block_decode_one(b, block, qmax, width, scales_in, codes_in, codes, work, True)
        _int_block_encode_one(work, wb, b, block, qmax, width, scales_out, codes_out, codes, one,
                              one_bits)


def _int_block_split(payload: np.ndarray, nblocks: int) -> tuple[np.ndarray, np.ndarray]:
    scales = payload[: 4 * nblocks]
    if scales.ctypes.data % 4:  # fp32 view needs alignment
        scales = scales.copy()
    return scales.view(np.float32), payload[4 * nblocks :]


def _check_int_block(numel: int, block: int, width: int) -> int:
    if numel % block or block % 2 or width not in (4, 8):
        raise ValueError(f"int blocks: {numel} values, block {block}, {width} bits not supported")
    return numel // block


def int_block_encode(values: torch.Tensor, block: int, width: int) -> torch.Tensor:
    """``IntBlockScheme.encode_values`` (fp32 scales, then codes ``q + qmax`` packed)."""
    nblocks = _check_int_block(values.numel(), block, width)
    out = torch.empty(4 * nblocks + values.numel() * width // 8, dtype=torch.uint8)
    data = out.numpy()
    scales, codes = data[: 4 * nblocks].view(np.float32), data[4 * nblocks :]
    qmax = (1 << (width - 1)) - 1
    run_rows(_int_block_encode_kernel, nblocks, _np(values.reshape(-1).float()), block, qmax, width,
             scales, codes)
    return out


def int_block_decode(payload: torch.Tensor, out: torch.Tensor, block: int, width: int,
                     accumulate: bool) -> None:
    nblocks = _check_int_block(out.numel(), block, width)
    scales, codes = _int_block_split(_np(payload.reshape(-1)), nblocks)
    qmax = (1 << (width - 1)) - 1
    run_rows(_int_block_decode_kernel, nblocks, block, qmax, width, scales, codes, _out(out),
             accumulate)


def int_block_decode_accumulate_encode(payload: torch.Tensor, work: torch.Tensor, block: int,
                                       width: int) -> torch.Tensor:
    nblocks = _check_int_block(work.numel(), block, width)
    scales_in, codes_in = _int_block_split(_np(payload.reshape(-1)), nblocks)
    out = torch.empty(4 * nblocks + work.numel() * width // 8, dtype=torch.uint8)
    data = out.numpy()
    qmax = (1 << (width - 1)) - 1
    run_rows(_int_block_dae_kernel, nblocks, block, qmax, width, scales_in, codes_in,
             _out(work), data[: 4 * nblocks].view(np.float32), data[4 * nblocks :])
    return out


# -- bit packing of any width (integer-sum payloads) -------------------------------------------


@numba.njit(**JIT_OPTIONS)
def _pack_kernel(lo, hi, codes, count, width, out):  # type: ignore[no-untyped-def]
    """Rows are groups of 8 codes, ``width`` bytes each; the last group may be partial."""
    nbytes = out.shape[0]
    for g in range(lo, hi):
        acc = np.uint64(0)
        nbits = 0
        pos = g * width
        for j in range(8):
            i = g * 8 + j
            if i < count:
                acc |= np.uint64(codes[i]) << np.uint64(nbits)
            nbits += width
            while nbits >= 8:
                if pos < nbytes:
                    out[pos] = np.uint8(acc & np.uint64(0xFF))
                pos += 1
                acc >>= np.uint64(8)
                nbits -= 8


@numba.njit(**JIT_OPTIONS)
def _unpack_kernel(lo, hi, data, count, width, sums, out):  # type: ignore[no-untyped-def]
    """``out = sums + codes`` (``sums`` empty: ``out = codes``) for groups of 8 codes."""
    nbytes = data.shape[0]
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1)
    add = sums.shape[0] > 0
    for g in range(lo, hi):
        acc = np.uint64(0)
        nbits = 0
        pos = g * width
        for j in range(8):
            while nbits < width:
                if pos < nbytes:
                    acc |= np.uint64(data[pos]) << np.uint64(nbits)
                pos += 1
                nbits += 8
            i = g * 8 + j
            if i < count:
                code = np.int64(acc & mask)
                out[i] = sums[i] + code if add else code
            acc >>= np.uint64(width)
            nbits -= width


def _check_width(width: int) -> None:
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in [1, 32], got {width}")


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`dqcoll.schemes.bitpack.pack_bits_torch` on CPU: int codes -> flat uint8."""
    _check_width(width)
    flat = codes.reshape(-1).to(torch.int64)
    count = flat.numel()
    out = torch.empty(-(-count * width // 8), dtype=torch.uint8)
    run_rows(_pack_kernel, -(-count // 8), _np(flat), count, width, out.numpy())
    return out


def _unpack(
    payload: torch.Tensor, width: int, count: int, sums: torch.Tensor | None
) -> torch.Tensor:
    _check_width(width)
    nbytes = -(-count * width // 8)
    if payload.numel() < nbytes:
        raise ValueError(
            f"{count} codes of {width} bits need {nbytes} bytes, got {payload.numel()}"
        )
    out = torch.empty(count, dtype=torch.int64)
    s = np.empty(0, np.int64) if sums is None else _np(sums.to(torch.int64))
    run_rows(_unpack_kernel, -(-count // 8), _np(payload.reshape(-1)[:nbytes]), count, width, s,
             out.numpy())
    return out


def unpack_bits(payload: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """:func:`dqcoll.schemes.bitpack.unpack_bits_torch` on CPU: uint8 -> int64 codes."""
    return _unpack(payload, width, count, None)


def unpack_accumulate(sums: torch.Tensor, payload: torch.Tensor, width: int) -> torch.Tensor:
    """``sums + unpack_bits(payload, width, len(sums))`` in one pass (a new int64 tensor)."""
    return _unpack(payload, width, sums.numel(), sums)


# -- integer-sum quantizers (THC, global QSGD) -----------------------------------------------------


@numba.njit(**JIT_OPTIONS)
def _mix32(x):  # type: ignore[no-untyped-def]
    """``mix32`` of :mod:`dqcoll.kernels.rng` on a uint64 holding 32 bits."""
    x ^= x >> np.uint64(16)
    x = (x * _M1) & _MASK32
    x ^= x >> np.uint64(15)
    x = (x * _M2) & _MASK32
    return x ^ (x >> np.uint64(15))


@numba.njit(**JIT_OPTIONS)
def _uniform(key, index):  # type: ignore[no-untyped-def]
    """``uniform24(coord_hash(key, index))``: fp32 on [0, 1) with 24 random bits."""
    g = np.uint64(index)
    h = _mix32(_mix32(key ^ (g >> np.uint64(32))) ^ (g & _MASK32))
    return np.float32(h >> np.uint64(8)) * _TWO_M24


@numba.njit(**JIT_OPTIONS)
def _thc_quantize_kernel(lo, hi, values, key, index_base, limit, delta, out):  # type: ignore[no-untyped-def]
    for i in range(lo, hi):
        v = min(max(values[i], -limit), limit)
        y = (v + limit) / delta
        q = np.floor(y + _uniform(key, index_base + i))
        out[i] = np.int64(min(max(q, np.float32(0.0)), np.float32(15.0)))


@numba.njit(**JIT_OPTIONS)
def _qsgd_quantize_kernel(lo, hi, values, key, index_base, levels, delta, out):  # type: ignore[no-untyped-def]
    fl = np.float32(levels)
    for i in range(lo, hi):
        y = min(max(values[i] / delta, -fl), fl)
        q = np.floor(y + _uniform(key, index_base + i))
        out[i] = np.int64(min(max(q, -fl), fl)) + levels


@numba.njit(**JIT_OPTIONS)
def _thc_dequantize_kernel(lo, hi, sums, delta, offset, out):  # type: ignore[no-untyped-def]
    for i in range(lo, hi):
        out[i] = np.float32(sums[i]) * delta - offset


@numba.njit(**JIT_OPTIONS)
def _qsgd_dequantize_kernel(lo, hi, sums, centre, delta, out):  # type: ignore[no-untyped-def]
    for i in range(lo, hi):
        out[i] = np.float32(sums[i] - centre) * delta


_ELEMENT_ROWS = 256  # elementwise kernels: rows of this many coordinates for run_rows


@numba.njit(**JIT_OPTIONS)
def _rows_thc_quantize(lo, hi, n, values, key, index_base, limit, delta, out):  # type: ignore[no-untyped-def]
    _thc_quantize_kernel(lo * 256, min(hi * 256, n), values, key, index_base, limit, delta, out)


@numba.njit(**JIT_OPTIONS)
def _rows_qsgd_quantize(lo, hi, n, values, key, index_base, levels, delta, out):  # type: ignore[no-untyped-def]
    _qsgd_quantize_kernel(lo * 256, min(hi * 256, n), values, key, index_base, levels, delta, out)


@numba.njit(**JIT_OPTIONS)
def _rows_thc_dequantize(lo, hi, n, sums, delta, offset, out):  # type: ignore[no-untyped-def]
    _thc_dequantize_kernel(lo * 256, min(hi * 256, n), sums, delta, offset, out)


@numba.njit(**JIT_OPTIONS)
def _rows_qsgd_dequantize(lo, hi, n, sums, centre, delta, out):  # type: ignore[no-untyped-def]
    _qsgd_dequantize_kernel(lo * 256, min(hi * 256, n), sums, centre, delta, out)


def _element_rows(n: int) -> int:
    return -(-n // _ELEMENT_ROWS)


def thc_quantize(values: torch.Tensor, key: int, index_base: int, limit: float,
                 delta: float) -> torch.Tensor:
    """THC's codes ``floor((clamp(v, -T, T) + T) / delta + u)`` in [0, 15] (fp32 ops), ``u`` the
    24-bit uniform of coordinate ``index_base + i`` under ``key``; finite, positive ``delta``."""
    n = values.numel()
    out = torch.empty(n, dtype=torch.int64)
    run_rows(_rows_thc_quantize, _element_rows(n), n, _np(values.reshape(-1).float()),
             np.uint64(key),
             index_base, np.float32(limit), np.float32(delta), out.numpy())
    return out


def qsgd_quantize(values: torch.Tensor, key: int, index_base: int, levels: int,
                  delta: float) -> torch.Tensor:
    """Global QSGD's codes ``clamp(floor(clamp(v / delta, -L, L) + u), -L, L) + L``."""
    n = values.numel()
    out = torch.empty(n, dtype=torch.int64)
    run_rows(_rows_qsgd_quantize, _element_rows(n), n, _np(values.reshape(-1).float()),
             np.uint64(key),
             index_base, levels, np.float32(delta), out.numpy())
    return out


def thc_dequantize(sums: torch.Tensor, delta: float, offset: float, out: torch.Tensor) -> None:
    """``out = fp32(sums) * fp32(delta) - fp32(offset)`` (two roundings, as the reference)."""
    n = sums.numel()
    run_rows(_rows_thc_dequantize, _element_rows(n), n, _np(sums), np.float32(delta),
             np.float32(offset), _out(out))


def qsgd_dequantize(sums: torch.Tensor, centre: int, delta: float, out: torch.Tensor) -> None:
    """``out = fp32(sums - centre) * fp32(delta)``."""
    n = sums.numel()
    run_rows(_rows_qsgd_dequantize, _element_rows(n), n, _np(sums), centre, np.float32(delta),
             _out(out))
