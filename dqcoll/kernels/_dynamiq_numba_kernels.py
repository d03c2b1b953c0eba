"""Compiled CPU kernels of the DynamiQ codec (numba): the same bytes as
:mod:`dqcoll.kernels.codec`, ~20x faster than the torch reference on one core.

Every kernel is a top-level ``@njit`` function over rows ``[lo, hi)`` of whole NumPy arrays (views
of the caller's torch tensors), with no policy: checks, allocation, thread split and the per-call
tables live in :mod:`.dynamiq_numba`. Each width has its own entry point (``encode_w4h``, ...),
which inlines one generic row body with the width (and, for the encodes and hops, the scale
encoding) as a literal, so that the inner loops over the 256 coordinates of a row have constant
trip counts and no width branch, and LLVM vectorises them (a width branch in the loop measured
291 -> 76 M coordinates/s at 2 bits). Widths 3, 5, 6, 7 (HIERARCHICAL4X32 only) pack their codes
as codec._pack_bitstream does: 8 codes in one ``8w``-bit word, ``w`` bytes.

Byte-exactness rules, besides :data:`.cpu_runtime.JIT_OPTIONS` (no fastmath, so no FMA):

* every fp32 operation has fp32 operands: constants are ``np.float32``, and fp32 values are
  never mixed with Python floats (numba would compute in float64 and round once, not twice);
* uint32 arithmetic is wrapped in ``np.uint32`` after every multiply and shift (numba types
  ``uint32 * uint32`` as uint64), so the hash is the reference's ``mod 2**32`` arithmetic;
* ``max |x|`` is an integer max over the bit patterns with the sign cleared (``x_bits`` is the
  same memory as ``x`` viewed as uint32): the order of non-negative patterns is the order of the
  values and every NaN pattern sorts above ``+inf``, so NaN propagates as ``torch.amax`` does;
* sums over 256 coordinates use the reference's fixed halving tree;
* the level is the reference's ``searchsorted`` done another way: at 2 to 5 bits a chain of
  compares and selects against the interior magnitudes (vectorises; a table lookup needs gathers,
  which kept the loop scalar: 180 vs 1090 M coordinates/s for that loop alone); at 6 to 8 bits a
  table over ``[0, 1]`` in ``bins`` equal bins (``a * bins`` is an exact power-of-two scaling)
  plus one compare, exact because no bin holds more than one level boundary (checked where the
  tables are built). No index is derived from a value that can be NaN (``a`` is 0 where the
  scale is not finite).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import rng
from .cpu_runtime import JIT_OPTIONS

SUPER = 256
GROUP = 16
GROUPS = 16
FLAT_BLOCK = 32
FLAT_BLOCKS = 8
FEISTEL_ROUNDS = 8
# Scale encodings, as the launchers pass them (a literal in the encode and hop entry points).
SCALES_FLAT = 0
SCALES_H = 1  # uint8 code per group of 16 + bf16 unit
SCALES_H4X32 = 2  # 4-bit code per group of 32 + bf16 unit
H4_BLOCKS = 8
# Widths up to this one find the level by a chain of compares and selects, wider ones by the bin
# table (see _encode_row). 5 bits (14 interior magnitudes), HIERARCHICAL4X32, one thread: encode
# 3.21 -> 2.63, hop 3.69 -> 2.80 ns per coordinate with the chain; 6 bits (30) is slower with it
# (hop 3.57 -> 3.94).
CHAIN_WIDTH = 5

_M1 = np.uint32(0x21F0AAAD)
_M2 = np.uint32(0x735A2D97)
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_F0 = np.float32(0.0)
_F1 = np.float32(1.0)
_FM1 = np.float32(-1.0)
_F255 = np.float32(255.0)
_F16 = np.float32(16.0)
_INF = np.float32(np.inf)
_TWO_M24 = np.float32(2.0**-24)
_TINY = np.float32(2.0**-64)
_PRESCALE = np.float32(2.0**64)
_TINY_NORMAL = np.float32(np.finfo(np.float32).tiny)  # the underflow check's norm
_SEL_SHIFT = np.uint32(rng.PERMUTATION_SHIFT)

_inline = dict(JIT_OPTIONS, inline="always")


# -- prefetch --------------------------------------------------------------------------------------


def _prefetch_intrinsic(write: int):  # type: ignore[no-untyped-def]
    def prefetch(typingctx, arr, idx):  # type: ignore[no-untyped-def]
        sig = types.void(arr, idx)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            ary, i = args
            aryty = signature.args[0]
            array = context.make_array(aryty)(context, builder, ary)
            ptr = cgutils.get_item_pointer(context, builder, aryty, array, [i])
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            # (address, rw, locality 3 = keep in all cache levels, data cache)
            builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, write),
                              ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(prefetch)


# ``llvm.prefetch`` of ``arr[i]``'s cache line: a hint, no fault, no effect on results. The rows
# an all-reduce restores go to their original places, in width-class order: a forward stream
# with gaps, which the hardware prefetcher does not follow. Prefetching a row's lines for
# writing a few rows ahead took such a scatter from 1.03 to 0.34 ns per coordinate.
_prefetch_write = _prefetch_intrinsic(1)
_prefetch_read = _prefetch_intrinsic(0)
PREFETCH_ROWS = 4  # rows ahead
_LINE = 16  # fp32 values per 64-byte cache line


@numba.njit(**_inline)
def _write_plus_mean(out, b, v, row, m):
    """``out[b + j] = row[j] + m`` for ``j < v`` (a restored row at its original place; a whole
    row's constant trip count vectorises: 2.2 vs 0.6 G coordinates/s)."""
    if v == SUPER:
        o = out[b : b + SUPER]
        for j in range(SUPER):
            o[j] = row[j] + m
    else:
        for j in range(v):
            out[b + j] = row[j] + m


@numba.njit(**_inline)
def _prefetch_row_write(out, index_base, valid, i, hi):
    """Prefetch for writing the destination of row ``i + PREFETCH_ROWS`` (if below ``hi``)."""
    k = i + PREFETCH_ROWS
    if k < hi:
        b = index_base[k]
        end = min(b + valid[k], out.shape[0])
        for c in range(b, end, _LINE):
            _prefetch_write(out, c)



@intrinsic
def _prefer_wide_vectors(typingctx):  # type: ignore[no-untyped-def]
    """Mark the calling kernel ``"prefer-vector-width"="512"``: LLVM's X86 tuning for these
    cores (``rocketlake``, Sapphire Rapids) vectorises with 256-bit registers unless a function
    asks for more. A hint: on CPUs without 512-bit registers it changes nothing; on CPUs with
    them format 3's encode runs ~12-15 % faster. (llvmlite accepts only a fixed list of
    attribute names, so the string attribute goes into the set directly.)"""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _always_inline(typingctx):  # type: ignore[no-untyped-def]
    """Mark the calling function ``alwaysinline`` for LLVM (:func:`_window_level`). A scalar
    step of the row loop compiled once per width as a plain call and inlined by LLVM gives the
    same machine code as numba's inlining (``inline="always"``), whose passes re-run on the
    inlined body in every entry point, so the cold compile is about a third shorter. Without the
    attribute LLVM's cost model left the large step a call per
    coordinate. Steps that take arrays stay numba-inlined: as plain calls each call costs an
    NRT incref/decref pair per array argument unless the function calls nothing, and their
    loops would be vectorised apart from the row loop's context (a third slower at 2 bits)."""
    sig = types.void()

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        builder.function.attributes.add("alwaysinline")
        return context.get_dummy_value()

    return sig, codegen


# -- scalar helpers ----------------------------------------------------------------------------
# Plain calls, not numba-level inlining: LLVM inlines them anyway (the hash loops still vectorise:
# the 4-bit rates did not move), and numba's inliner cost ~1 s of cold compile per kernel for them.


@numba.njit(**JIT_OPTIONS)
def _mix32(x):
    """rng.mix32 in uint32: ``x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 15``."""
    x = np.uint32(x ^ (x >> np.uint32(16)))
    x = np.uint32(x * _M1)  # the uint64 product, truncated: mod 2**32
    x = np.uint32(x ^ (x >> np.uint32(15)))
    x = np.uint32(x * _M2)
    return np.uint32(x ^ (x >> np.uint32(15)))


@numba.njit(**JIT_OPTIONS)
def _row_key(key, base):
    """The inner hash of ``rng.coord_hash(key, g)``, ``mix32(key ^ g_hi)``: the same for every
    coordinate of a row starting at ``base`` (a multiple of 256)."""
    return _mix32(np.uint32(key ^ np.uint32(base >> 32)))


@numba.njit(**JIT_OPTIONS)
def _lo32(g):
    return np.uint32(g & 0xFFFFFFFF)


@numba.njit(**_inline)
def _feistel(v, ck, half):
    """One pass of the balanced Feistel network over ``2 * half`` bits (rng.feistel_rounds)."""
    mask = np.uint32((1 << half) - 1)
    left = np.uint32(v >> np.uint32(half))
    right = np.uint32(v & mask)
    for j in range(FEISTEL_ROUNDS):
        f = np.uint32(_mix32(np.uint32(ck ^ np.uint32(right | np.uint32(j << 24)))) & mask)
        new_right = np.uint32(left ^ f)
        left = right
        right = new_right
    return np.uint32(np.uint32(left << np.uint32(half)) | right)


@numba.njit(**JIT_OPTIONS)
def perm_table(table_key, rank, world_size, half, out):
    """``rng.permutation_table``: ``out[t] = sigma_t(rank)``, the Feistel network keyed by
    ``mix32(table_key ^ t)`` applied until the value falls below ``world_size``."""
    n = np.uint32(world_size)
    for t in range(out.shape[0]):
        ck = _mix32(np.uint32(table_key ^ np.uint32(t)))
        v = _feistel(np.uint32(rank), ck, half)
        while v >= n:
            v = _feistel(v, ck, half)
        out[t] = np.int32(v)


@numba.njit(**JIT_OPTIONS)
def _bf16_ceil_bits(bits):
    """bf16 pattern of the non-negative fp32 with pattern ``bits``, rounded up; NaN -> 0x7FC0."""
    if bits > _INF_BITS:
        return np.uint32(0x7FC0)
    return np.uint32((bits + np.uint32(0xFFFF)) >> np.uint32(16))


@numba.njit(**_inline)
def _tree_sum_128(t):
    """The last 7 levels of codec.tree_sum on 128 fp32 values in ``t`` (overwritten)."""
    h = 64
    while h >= 1:
        for j in range(h):
            t[j] = t[j] + t[j + h]
        h //= 2
    return t[0]


@numba.njit(**_inline)
def _tree_sum_256(t):
    """codec.tree_sum of the 256 fp32 values in ``t`` (overwritten): ``t[:h] + t[h:]``."""
    h = 128
    while h >= 1:
        for j in range(h):
            t[j] = t[j] + t[j + h]
        h //= 2
    return t[0]


# -- scales --------------------------------------------------------------------------------------


@numba.njit(**_inline)
def _scales_encode(
    xrow_bits, scales, d, meta, f32, u32, qscale, gbits, ginv, gpre, hbits, qbits, tree
):
    """Scales of one row from its fp32 bit patterns: the scale bytes into ``meta`` (18 or 16
    bytes for ``scales`` SCALES_H or SCALES_FLAT, a literal; format 3's SCALES_H4X32 rows go
    through :func:`_q_scales`), the decoded scale of each group of 16 into ``qscale`` [16] (a
    block of 32 gives both its groups its scale), and
    codec._normalise's factors: ``ginv``/``gpre`` [16] per group (``inv``, 0 where the scale is
    unusable, and the prescale ``s``) and ``d`` [256], ``inv`` per coordinate. Returns whether a
    prescale is not 1 (a denormal scale: rare). ``f32``/``u32`` are one scratch word seen as fp32
    and as uint32 (a bit cast); ``gbits`` [16], ``hbits`` [128], ``qbits`` [64] scratch. With
    ``tree`` (a literal) the group maxima come from a halving tree inside each group, whose every
    step vectorises: the encode's scales 0.53 -> 0.3 ns per coordinate; in the fused hop (the row
    was just written) the plain per-group loop measured faster."""
    if scales != SCALES_FLAT:
        top = np.uint32(0)
        if tree:
            for j in range(SUPER // 2):  # halving tree inside each group: contiguous halves
                g = j >> 3
                k = j & 7
                a0 = np.uint32(xrow_bits[g * GROUP + k] & _ABS)
                a1 = np.uint32(xrow_bits[g * GROUP + 8 + k] & _ABS)
                hbits[j] = a0 if a0 > a1 else a1
            for j in range(SUPER // 4):
                g = j >> 2
                k = j & 3
                a0 = hbits[g * 8 + k]
                a1 = hbits[g * 8 + 4 + k]
                qbits[j] = a0 if a0 > a1 else a1
            for j in range(SUPER // 8):
                g = j >> 1
                k = j & 1
                a0 = qbits[g * 4 + k]
                a1 = qbits[g * 4 + 2 + k]
                hbits[j] = a0 if a0 > a1 else a1
            for g in range(GROUPS):
                a0 = hbits[2 * g]
                a1 = hbits[2 * g + 1]
                gbits[g] = a0 if a0 > a1 else a1
        else:
            for g in range(GROUPS):
                m = np.uint32(0)
                for j in range(GROUP):
                    b = np.uint32(xrow_bits[g * GROUP + j] & _ABS)
                    m = b if b > m else m
                gbits[g] = m
        for g in range(GROUPS):
            m = gbits[g]
            top = m if m > top else top
    if scales == SCALES_H:
        u32[0] = top
        f32[0] = f32[0] / _F255  # fp32 division, as the reference's ``top / 255.0``
        unit_bits = _bf16_ceil_bits(u32[0])
        u32[0] = np.uint32(unit_bits << np.uint32(16))
        unit = f32[0]
        usable = unit > _F0 and unit < _INF  # False for 0, inf and NaN
        gmax = gbits.view(np.float32)  # the group maxima as fp32 (same memory, a bit cast)
        den = unit if usable else _F1
        # Three short loops instead of one: no byte store between a group's load and the next,
        # so each vectorises (scales 0.97 -> 1.26 G coordinates/s).
        for g in range(GROUPS):
            ratio = np.float32(np.ceil(gmax[g] / den))
            qscale[g] = min(max(ratio, _F1), _F255) if usable else _F1  # q
        for g in range(GROUPS):
            meta[g] = np.uint8(np.int32(qscale[g]))
        for g in range(GROUPS):
            qscale[g] = qscale[g] * unit  # exact: 8-bit times 8-bit significands
        meta[GROUPS] = np.uint8(unit_bits & np.uint32(0xFF))
        meta[GROUPS + 1] = np.uint8(unit_bits >> np.uint32(8))
    else:
        for blk in range(FLAT_BLOCKS):
            m = np.uint32(0)
            for j in range(FLAT_BLOCK):
                b = np.uint32(xrow_bits[blk * FLAT_BLOCK + j] & _ABS)
                m = b if b > m else m
            sbits = _bf16_ceil_bits(m)
            meta[2 * blk] = np.uint8(sbits & np.uint32(0xFF))
            meta[2 * blk + 1] = np.uint8(sbits >> np.uint32(8))
            u32[0] = np.uint32(sbits << np.uint32(16))
            s = f32[0]
            qscale[2 * blk] = s  # per group of 16 too (both groups of the block)
            qscale[2 * blk + 1] = s
    # codec._normalise: inv = fp32(1 / (D * s)), 0 where D is unusable; s = 2**64 below 2**-64
    # (exact prescale). Short branch-free loops (each vectorises).
    tiny = False
    for g in range(GROUPS):
        dg = qscale[g]
        pre = _PRESCALE if dg < _TINY else _F1
        gpre[g] = pre
        ok = (dg > _F0) & (dg < _INF)
        ginv[g] = dg * pre if ok else _F0
    for g in range(GROUPS):
        tiny |= gpre[g] != _F1
    for g in range(GROUPS):
        den = ginv[g]
        ginv[g] = _F1 / den if den > _F0 else _F0
    for g in range(GROUPS):
        inv = ginv[g]
        for j in range(GROUP):
            d[g * GROUP + j] = inv
    return tiny


@numba.njit(**_inline)
def _scales_decode(meta, scales, d, f32, u32):
    """Decoded scale of each group of 16 coordinates of one record into ``d`` [16]."""
    if scales == SCALES_H:
        u32[0] = np.uint32((np.uint32(meta[GROUPS]) | (np.uint32(meta[GROUPS + 1]) << 8)) << 16)
        unit = f32[0]
        for g in range(GROUPS):
            d[g] = np.float32(meta[g]) * unit
    elif scales == SCALES_H4X32:
        k = H4_BLOCKS // 2
        u32[0] = np.uint32((np.uint32(meta[k]) | (np.uint32(meta[k + 1]) << 8)) << 16)
        unit = f32[0]
        for b in range(H4_BLOCKS):
            q = np.uint32(meta[b >> 1]) >> np.uint32(4 * (b & 1))
            s = np.float32(np.int32(q & np.uint32(0xF)) + 1) * unit
            d[2 * b] = s  # both groups of 16 of the block of 32
            d[2 * b + 1] = s
    else:
        for blk in range(FLAT_BLOCKS):
            u32[0] = np.uint32(
                (np.uint32(meta[2 * blk]) | (np.uint32(meta[2 * blk + 1]) << 8)) << 16)
            d[2 * blk] = f32[0]  # one scale per 32 coordinates: both of its groups of 16
            d[2 * blk + 1] = f32[0]


# -- the row codec ----------------------------------------------------------------------------


@numba.njit(**_inline)
def _pack_codes(codes, width, out_row):
    """The 256 ``codes`` of ``width`` bits into the first ``32 * width`` bytes of ``out_row``,
    LSB-first: code j goes to byte j*b//8 at bit j*b%8."""
    if 8 % width == 0:
        per_byte = 8 // width
        for i in range(32 * width):
            v = np.uint8(0)
            for k in range(per_byte):
                v |= np.uint8(codes[i * per_byte + k] << (k * width))
            out_row[i] = v
    else:
        # codec._pack_bitstream: 8 codes in one 8w-bit word, stored as w bytes (LLVM merges the
        # byte stores of one word's shifts into wider stores).
        for i in range(SUPER // 8):
            word = np.uint64(0)
            for k in range(8):
                word |= np.uint64(codes[i * 8 + k]) << np.uint64(k * width)
            for b in range(width):
                out_row[i * width + b] = np.uint8(word >> np.uint64(8 * b) & np.uint64(0xFF))


@numba.njit(**_inline)
def _encode_row(
    xrow, xrow_bits, base, out_row, width, scales, mags, nxt, rtab, bins,
    jitter_key, perm_key, ptab, inv_n, correlated, scratch, tree,
):
    """codec._encode_rows for one row ``xrow`` (fp32 [256], ``xrow_bits`` its uint32 view) whose
    first coordinate has global index ``base``, into ``out_row`` (uint8 [record_nbytes]).
    ``scratch`` is the tuple of arrays :func:`_encode_scratch` makes; ``ptab`` this rank's
    column of the call's permutation table (rng.permutation_table)."""
    (d, p, u, codes, f32, u32, qscale, gbits, ginv, gpre, piv, selv,
     av, neg, binv, rv, lov, hiv, hbits, qbits) = scratch
    top = (1 << (width - 1)) - 1  # R
    code_nbytes = 32 * width
    tiny = _scales_encode(xrow_bits, scales, d, out_row[code_nbytes:], f32, u32, qscale,
                          gbits, ginv, gpre, hbits, qbits, tree)
    xs = xrow
    if tiny:  # codec._normalise's x * s, exact, into scratch (only rows with denormal scales)
        for g in range(GROUPS):
            for j in range(GROUP):
                p[g * GROUP + j] = xrow[g * GROUP + j] * gpre[g]
        xs = p
    # rng.coord_hash: the inner hash depends on g_hi only, so it is the row's (two of them where
    # the row crosses a multiple of 2**32: then coordinates past the wrap of g_lo take the
    # second); one mix32 per coordinate.
    lo32 = _lo32(base)
    jrow = _row_key(jitter_key, base)
    jend = _row_key(jitter_key, base + SUPER - 1)
    if correlated:  # pi(rank) of each run of 16: the table permutation its first index selects
        prow = _row_key(perm_key, base)
        pend = _row_key(perm_key, base + SUPER - 1)
        for g in range(GROUPS):
            f_lo = np.uint32(lo32 + np.uint32(g * GROUP))
            k = pend if f_lo < lo32 else prow
            selv[g] = np.int32(_mix32(np.uint32(k ^ f_lo)) >> _SEL_SHIFT)
        for g in range(GROUPS):
            piv[g] = np.float32(ptab[selv[g]])

    if width <= CHAIN_WIDTH:
        for j in range(SUPER):
            g_lo = np.uint32(lo32 + np.uint32(j))  # wraps mod 2**32
            k = jend if g_lo < lo32 else jrow
            h = _mix32(np.uint32(k ^ g_lo))
            u[j] = np.float32(h >> np.uint32(8)) * _TWO_M24  # gamma: 24 bits, exact
        if correlated:
            for g in range(GROUPS):
                pi = piv[g]
                for j in range(GROUP):
                    u[g * GROUP + j] = (pi + u[g * GROUP + j]) * inv_n  # two roundings
        # Up to CHAIN_WIDTH bits: the level and its neighbours by a chain of compares and selects
        # against the interior magnitudes (no gather, so the loop vectorises: ~6x the table
        # lookup).
        for j in range(SUPER):
            inv = d[j]
            q = xs[j] * inv  # inv > 0 exactly where the scale is usable
            y = min(max(q if inv > _F0 else _F0, _FM1), _F1)
            a = abs(y)
            r = 0
            lo = _F0  # m_0
            for t in range(1, top):  # lo = m_r, the largest interior magnitude <= a
                mt = mags[t]
                below = mt <= a
                r += 1 if below else 0
                lo = mt if below else lo
            hi = _F1  # m_R
            for t in range(top - 1, 0, -1):  # hi = m_{r+1}, the smallest one above a
                mt = mags[t]
                hi = mt if mt > a else hi
            level = r + (1 if (a - lo) > u[j] * (hi - lo) else 0)
            codes[j] = np.uint8(top - level if y < _F0 else top + level)
    else:
        # Wider: the level from the bin table, in a scalar loop of its own (gathers), between
        # two loops that vectorise.
        # Per group of 16, with its factors and pi(rank) as scalars.
        bins_f = np.float32(bins)
        for g in range(GROUPS):
            inv = ginv[g]
            pi = piv[g] if correlated else _F0
            for k in range(GROUP):
                j = g * GROUP + k
                g_lo = np.uint32(lo32 + np.uint32(j))  # wraps mod 2**32
                h = _mix32(np.uint32((jend if g_lo < lo32 else jrow) ^ g_lo))
                gamma = np.float32(h >> np.uint32(8)) * _TWO_M24  # 24 bits, exact
                u[j] = (pi + gamma) * inv_n if correlated else gamma  # two roundings
                q = xs[j] * inv
                y = min(max(q if inv > _F0 else _F0, _FM1), _F1)
                a = abs(y)
                av[j] = a
                neg[j] = y < _F0
                binv[j] = np.int32(a * bins_f)  # a in [0, 1]: exact scaling, floor
        for j in range(SUPER):
            a = av[j]
            r = rtab[binv[j]]
            if nxt[r] <= a:
                r += 1
            rv[j] = r
            lov[j] = mags[r]
            hiv[j] = mags[r + 1]
        for j in range(SUPER):
            a = av[j]
            lo = lov[j]
            level = rv[j] + (1 if (a - lo) > u[j] * (hiv[j] - lo) else 0)
            codes[j] = np.uint8(top - level if neg[j] else top + level)

    _pack_codes(codes, width, out_row)


@numba.njit(**_inline)
def _decode_row(
    rec, width, scales, table, d, f32, u32, out_row, accumulate
):
    """codec.decode_torch for one record: ``table[code] * D``; with ``accumulate`` added to
    ``out_row`` (one rounding each), else stored."""
    code_nbytes = 32 * width
    _scales_decode(rec[code_nbytes:], scales, d, f32, u32)
    if 8 % width == 0:
        # Per group of 16: its scale in a register, one lookup per byte (``table`` holds the
        # values of a byte's codes side by side): 1.2 -> 1.9 (4 bits) / 2.4 (2 bits) G
        # coordinates/s.
        per_byte = 8 // width
        group_nbytes = GROUP // per_byte
        for g in range(GROUPS):
            scale = d[g]
            for i in range(group_nbytes):
                base = np.int64(rec[g * group_nbytes + i]) * per_byte
                for k in range(per_byte):
                    c = g * GROUP + i * per_byte + k
                    value = table[base + k] * scale
                    if accumulate:
                        out_row[c] = out_row[c] + value
                    else:
                        out_row[c] = value
    else:
        # Bitstream widths: ``table`` is indexed by code; 8 codes per w-byte word, 2 per group,
        # each word read as one unaligned 8-byte load (the bytes past its w are the next word's
        # or the record's scale bytes, >= 5 of them: read, never used) instead of w byte loads,
        # which makes the decodes ~5-10 % faster.
        mask = np.uint64((1 << width) - 1)
        for g in range(GROUPS):
            scale = d[g]
            for h in range(2):
                i = 2 * g + h
                word = _load_u64_1d(rec, i * width)
                for k in range(8):
                    c = i * 8 + k
                    value = table[np.int64(word >> np.uint64(k * width) & mask)] * scale
                    if accumulate:
                        out_row[c] = out_row[c] + value
                    else:
                        out_row[c] = value


@numba.njit(**_inline)
def _encode_scratch():
    """Per-call scratch of :func:`_encode_row` (allocated once per row range, not per row):
    ``(d, p, u, codes, f32, u32, qscale, gbits, ginv, gpre, piv, selv, av, neg, binv, rv,
    lov, hiv, hbits, qbits)``."""
    f32 = np.empty(1, np.float32)
    return (np.empty(SUPER, np.float32), np.empty(SUPER, np.float32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.uint8), f32, f32.view(np.uint32),
            np.empty(GROUPS, np.float32), np.empty(GROUPS, np.uint32),
            np.empty(GROUPS, np.float32), np.empty(GROUPS, np.float32),
            np.empty(GROUPS, np.float32), np.empty(GROUPS, np.int32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.bool_),
            np.empty(SUPER, np.int32), np.empty(SUPER, np.int32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.float32),
            np.empty(SUPER // 2, np.uint32), np.empty(SUPER // 4, np.uint32))


# -- format 3 (HIERARCHICAL4X32): the row codec written for LLVM's loop vectorizer -----------------
# The generic row codec above spends its time in the scales, the level chain and per-row
# overhead (NRT reference counting); this one is written so that LLVM vectorises each of them,
# about 2.5x faster at 5 bits (docs/kernels.md, "CPU kernels (numba)", has the rates):
#
# * one function holds the row loop (:func:`_q_rows`, inlined into each entry point with the
#   width as a literal), and no array view is made per row (``x[i]``, ``out[i][a:]``,
#   ``a.view(...)``): each array passed to a numba-inlined function or viewed costs an NRT
#   incref/decref call pair, and the per-row version made ~40 of them per row. Rows are
#   addressed as ``x[i, j]``; helpers that take arrays are plain calls (LLVM inlines them);
# * every per-coordinate step is one flat loop ``for j in range(N)`` with affine indices (``j``,
#   ``2 * j``, ``2 * j + 1``): LLVM's loop vectorizer takes those, stride-2 loads and stores
#   included, while a short constant loop nested in another (``for k in range(16)`` inside
#   ``for g in range(16)``) is unrolled first and left scalar (the group maxima) or turned into
#   gathers. So the block maxima are an adjacent-pair tree (256 -> 128 -> ... -> 8: each level
#   one loop) and per-block values reach the coordinates by doubling copies (8 -> ... -> 256);
# * the level search halves a window of magnitudes held in registers (selects, no table lookup:
#   a gather per coordinate is slower than 36 selects on this CPU), and the kernels ask LLVM for
#   512-bit vectors (:func:`_prefer_wide_vectors`);
# * packed words are stored 8 bytes at a time and decoded from 8-byte loads.
#
# The bytes are those of codec.encode_torch (tests/test_kernels_numba.py compares them).

_NO_LEVEL = np.float32(np.inf)  # past the last interior magnitude: never <= a


@numba.njit(**JIT_OPTIONS)
def _window_table(mags):
    """``ext[t] = m_t`` for m_0 and the interior magnitudes (t < R), ``+inf`` past them: fp32
    ``[40]``, room for the level search's window up to 6 bits (``ext[32]``)."""
    top = mags.shape[0] - 1
    ext = np.empty(40, np.float32)
    for t in range(ext.shape[0]):
        ext[t] = mags[t] if t < top else _NO_LEVEL
    return ext


@numba.njit(**JIT_OPTIONS)
def _dup(src, dst, n):
    """``dst[2k] = dst[2k + 1] = src[k]`` for ``k < n`` (one vectorised loop)."""
    for k in range(n):
        v = src[k]
        dst[2 * k] = v
        dst[2 * k + 1] = v


@numba.njit(**JIT_OPTIONS)
def _q_scales(xb, i, t, tf, f32, u32, bs):
    """HIERARCHICAL4X32 scales of row ``i`` (``xb``: the rows' fp32 bit patterns). Per block of
    32, ``bs[b]`` = fp32(1 / (D_b * s_b)) (0 where the block's scale is unusable) and the
    prescale ``bs[8 + b]`` (2**64 below 2**-64, else 1), as codec._normalise; ``bs[16 + b]``
    the block's code q in [1, 16]. ``t`` is uint32 scratch [192], ``tf`` the same memory as fp32.
    Returns ``(tiny, unit_bits)``: whether a usable block has a prescale (rare) and the bf16
    unit. (The 6 scale bytes are written by the caller after the codes: the packing's 8-byte
    stores overrun the codes.)"""
    # |x| as bit patterns (sign cleared): integer order is value order, NaN above +inf, so the
    # maxima propagate NaN as torch.amax does. Adjacent pairs: level k holds maxima of 2**k.
    h = SUPER // 2  # levels alternate between t[:128] and t[128:]
    for j in range(SUPER // 2):
        t[j] = max(np.uint32(xb[i, 2 * j] & _ABS), np.uint32(xb[i, 2 * j + 1] & _ABS))
    for j in range(SUPER // 4):
        t[h + j] = max(t[2 * j], t[2 * j + 1])
    for j in range(SUPER // 8):
        t[j] = max(t[h + 2 * j], t[h + 2 * j + 1])
    for j in range(SUPER // 16):
        t[h + j] = max(t[2 * j], t[2 * j + 1])
    for j in range(H4_BLOCKS):
        t[j] = max(t[h + 2 * j], t[h + 2 * j + 1])  # block maxima
    top = t[0]
    for b in range(1, H4_BLOCKS):
        top = max(top, t[b])
    u32[0] = top
    f32[0] = f32[0] / _F16  # fp32 division, as the reference's ``top / 16.0``
    unit_bits = _bf16_ceil_bits(u32[0])
    u32[0] = np.uint32(unit_bits << np.uint32(16))
    unit = f32[0]
    usable = unit > _F0 and unit < _INF  # False for 0, inf and NaN
    den = unit if usable else _F1
    for b in range(H4_BLOCKS):  # one vector: the maxima read as fp32 through ``tf``
        q = min(max(np.float32(np.ceil(tf[b] / den)), _F1), _F16) if usable else _F1
        s = q * unit  # the decoded scale: exact (5-bit times 8-bit significands)
        ok = (s > _F0) & (s < _INF)
        pre = _PRESCALE if (ok and s < _TINY) else _F1
        den2 = s * pre
        bs[b] = _F1 / den2 if ok else _F0
        bs[H4_BLOCKS + b] = pre
        bs[2 * H4_BLOCKS + b] = q
    tiny = False
    for b in range(H4_BLOCKS):
        tiny |= bs[H4_BLOCKS + b] != _F1
    return tiny, unit_bits


@intrinsic
def _load_u64(typingctx, arr, i, offset):  # type: ignore[no-untyped-def]
    """``arr[i, offset : offset + 8]`` as one little-endian uint64 (an unaligned load; the bytes
    past a record's codes are its scale bytes or the next record's: read, never used)."""
    sig = types.uint64(arr, i, offset)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary, row, col = args
        aryty = signature.args[0]
        array = context.make_array(aryty)(context, builder, ary)
        ptr = cgutils.get_item_pointer(context, builder, aryty, array, [row, col])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


@intrinsic
def _load_u64_1d(typingctx, arr, offset):  # type: ignore[no-untyped-def]
    """``arr[offset : offset + 8]`` of a 1-d uint8 array (one record) as one little-endian
    uint64: :func:`_load_u64` for a record passed as a row."""
    sig = types.uint64(arr, offset)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary, col = args
        aryty = signature.args[0]
        array = context.make_array(aryty)(context, builder, ary)
        ptr = cgutils.get_item_pointer(context, builder, aryty, array, [col])
        return builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)

    return sig, codegen


@intrinsic
def _store_u64(typingctx, arr, i, offset, value):  # type: ignore[no-untyped-def]
    """``arr[i, offset : offset + 8] = value`` (uint64, little-endian) as one unaligned store:
    a packed word of 8 codes is ``w`` bytes, and storing all 8 bytes of each word in order
    (the next word and then the scale bytes overwrite the excess) replaces ``w`` byte stores."""
    sig = types.void(arr, i, offset, value)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        ary, row, col, val = args
        aryty = signature.args[0]
        array = context.make_array(aryty)(context, builder, ary)
        ptr = cgutils.get_item_pointer(context, builder, aryty, array, [row, col])
        i64p = ir.IntType(64).as_pointer()
        builder.store(val, builder.bitcast(ptr, i64p), align=1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_inline)
def _q_accumulate_record(records, i, x, r, width, table, d, f32, u32):
    """codec.decode_accumulate_torch of record ``i`` into row ``r`` of ``x`` (HIERARCHICAL4X32;
    ``table``: the decode table; ``d`` [16] scratch for the scales of the groups of 16)."""
    code_nbytes = 32 * width
    dk = code_nbytes + H4_BLOCKS // 2
    u32[0] = np.uint32(
        (np.uint32(records[i, dk]) | (np.uint32(records[i, dk + 1]) << 8)) << 16)
    dunit = f32[0]
    for db in range(H4_BLOCKS):
        dq = np.uint32(records[i, code_nbytes + (db >> 1)]) >> np.uint32(4 * (db & 1))
        ds = np.float32(np.int32(dq & np.uint32(0xF)) + 1) * dunit
        d[2 * db] = ds
        d[2 * db + 1] = ds
    if 8 % width == 0:
        per_byte = 8 // width
        group_nbytes = GROUP // per_byte
        for dg in range(GROUPS):
            dscale = d[dg]
            for dm in range(group_nbytes):
                dat = np.int64(records[i, dg * group_nbytes + dm]) * per_byte
                for dk in range(per_byte):
                    dc = dg * GROUP + dm * per_byte + dk
                    dvalue = table[dat + dk] * dscale
                    x[r, dc] = x[r, dc] + dvalue
    else:
        # Bitstream widths: 8 codes per w bytes, read as one 8-byte word
        dmask = np.uint64((1 << width) - 1)
        for dm in range(SUPER // 8):
            dscale = d[dm >> 1]
            dword = _load_u64(records, i, dm * width)
            for dk in range(8):
                dc = dm * 8 + dk
                code = np.int64(dword >> np.uint64(dk * width) & dmask)
                x[r, dc] = x[r, dc] + table[code] * dscale


@numba.njit(**JIT_OPTIONS)
def _window_level(a, window, width):
    """``(r, m_r, m_{r+1})`` for a magnitude ``a`` in [0, 1] at up to 6 bits: r = #{interior
    m_t <= a}, by halving a window of magnitudes held in registers. ``window`` is ``ext[1..32]``
    (:func:`_window_table`, a tuple of scalars: a select between two loads of ``ext`` inside the
    coordinate loop became a gather). v0..v(2h) hold the window ext[r .. r + 2h]; each step
    compares its middle and keeps the upper or the lower half with the same mask (selects of
    values: no gather). ``ext`` is +inf past the last interior magnitude, so hi = min(first
    magnitude above a, 1). 6 bits: 5 compares and 36 selects per lane; the steps a width does
    not need are dead code (``width`` is a literal)."""
    _always_inline()
    (v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, v16,
     v17, v18, v19, v20, v21, v22, v23, v24, v25, v26, v27, v28, v29, v30, v31, v32) = window
    v0 = _F0
    r = 0
    if width >= 6:
        below = v16 <= a
        r += 16 if below else 0
        v0 = v16 if below else v0
        v1 = v17 if below else v1
        v2 = v18 if below else v2
        v3 = v19 if below else v3
        v4 = v20 if below else v4
        v5 = v21 if below else v5
        v6 = v22 if below else v6
        v7 = v23 if below else v7
        v8 = v24 if below else v8
        v9 = v25 if below else v9
        v10 = v26 if below else v10
        v11 = v27 if below else v11
        v12 = v28 if below else v12
        v13 = v29 if below else v13
        v14 = v30 if below else v14
        v15 = v31 if below else v15
        v16 = v32 if below else v16
    if width >= 5:
        below = v8 <= a
        r += 8 if below else 0
        v0 = v8 if below else v0
        v1 = v9 if below else v1
        v2 = v10 if below else v2
        v3 = v11 if below else v3
        v4 = v12 if below else v4
        v5 = v13 if below else v5
        v6 = v14 if below else v6
        v7 = v15 if below else v7
        v8 = v16 if below else v8
    if width >= 4:
        below = v4 <= a
        r += 4 if below else 0
        v0 = v4 if below else v0
        v1 = v5 if below else v1
        v2 = v6 if below else v2
        v3 = v7 if below else v3
        v4 = v8 if below else v4
    if width >= 3:
        below = v2 <= a
        r += 2 if below else 0
        v0 = v2 if below else v0
        v1 = v3 if below else v1
        v2 = v4 if below else v2
    below = v1 <= a
    r += 1 if below else 0
    return r, v1 if below else v0, min(v2 if below else v1, _F1)


@numba.njit(**_inline)
def _q_levels_table(p, d, u, codes, width, mags, nxt, rtab, bins, av, rv, sa, sb):
    """Codes of the row ``p`` (scale factors ``d``, uniforms ``u``) into ``codes`` at 7 and 8
    bits: the level from the bin table (a gather, scalar) between two vectorised loops. ``p``
    is overwritten with the clamped values; ``av``, ``rv``, ``sa``, ``sb`` [256] scratch."""
    top = (1 << (width - 1)) - 1  # R
    bins_f = np.float32(bins)
    for j in range(SUPER):
        inv = d[j]
        q = p[j] * inv
        y = min(max(q if inv > _F0 else _F0, _FM1), _F1)
        a = abs(y)
        av[j] = a
        p[j] = y
        rv[j] = np.int32(a * bins_f)  # a in [0, 1]: exact scaling, floor
    for j in range(SUPER):
        a = av[j]
        r = rtab[rv[j]]
        if nxt[r] <= a:
            r += 1
        rv[j] = r
        sa[j] = mags[r]
        sb[j] = mags[r + 1]
    for j in range(SUPER):
        a = av[j]
        lo = sa[j]
        level = rv[j] + (1 if (a - lo) > u[j] * (sb[j] - lo) else 0)
        codes[j] = np.uint8(top - level if p[j] < _F0 else top + level)


@numba.njit(**_inline)
def _q_store_record(out, i, codes, width, bs, unit_bits):
    """Record ``i`` of ``out``: the ``codes`` packed LSB-first (code j at bit j*w of the code
    bytes), then the scale bytes (q - 1 as nibbles, block 2k in the low one, from ``bs``; then
    the bf16 unit)."""
    code_nbytes = 32 * width
    if 8 % width == 0:
        per_byte = 8 // width
        for m in range(code_nbytes):
            v = np.uint8(0)
            for k in range(per_byte):
                v |= np.uint8(codes[m * per_byte + k] << (k * width))
            out[i, m] = v
    else:
        # codec._pack_bitstream: 8 codes in one 8w-bit word, stored as w bytes (8 stored,
        # in order, so the next word's store overwrites the excess)
        for m in range(SUPER // 8):
            word = np.uint64(0)
            for k in range(8):
                word |= np.uint64(codes[m * 8 + k]) << np.uint64(k * width)
            _store_u64(out, i, m * width, word)
    for k in range(H4_BLOCKS // 2):
        n0 = np.uint32(np.int32(bs[2 * H4_BLOCKS + 2 * k]) - 1)
        n1 = np.uint32(np.int32(bs[2 * H4_BLOCKS + 2 * k + 1]) - 1)
        out[i, code_nbytes + k] = np.uint8(n0 | (n1 << np.uint32(4)))
    out[i, code_nbytes + H4_BLOCKS // 2] = np.uint8(unit_bits & np.uint32(0xFF))
    out[i, code_nbytes + H4_BLOCKS // 2 + 1] = np.uint8(unit_bits >> np.uint32(8))


@numba.njit(**_inline)
def _gather_row(src, order, smean, svalid, divide, halve, inverse, divisor, k, hi, o):
    """``o = `` row ``k`` of :func:`center_gather` (``src[order[k]]`` divided and centred,
    padding exactly 0, the same expressions), prefetching the source row ``PREFETCH_ROWS``
    ahead (rows in width-class order: a stream with gaps)."""
    if k + PREFETCH_ROWS < hi:
        ahead = src[order[k + PREFETCH_ROWS]]
        for c in range(0, SUPER, _LINE):
            _prefetch_read(ahead, c)
    i = order[k]
    row = src[i]
    m = smean[i]
    v = svalid[i]
    if divide and halve:  # x * 2**-k: x / 2**k, bit for bit
        for j in range(SUPER):
            o[j] = row[j] * inverse - m if j < v else _F0
    elif divide:
        for j in range(SUPER):
            o[j] = row[j] / divisor - m if j < v else _F0
    elif v == SUPER:
        for j in range(SUPER):
            o[j] = row[j] - m
    else:
        for j in range(SUPER):
            o[j] = row[j] - m if j < v else _F0


@numba.njit(**_inline)
def _q_rows(lo, hi, x, index_base, out, width, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, hop, src, order, smean, svalid, divisor):
    """codec._encode_rows of rows ``[lo, hi)`` of ``x`` (fp32 ``[rows, 256]``; row ``i``'s first
    coordinate has global index ``index_base[i]``) into ``out`` (uint8 ``[rows,
    record_nbytes]``), HIERARCHICAL4X32. With ``hop`` (a literal) each row first adds
    ``decode(records[i])`` (``table``: the decode table) into ``x[i]``: the fused hop. One
    function holds the row loop, so the arrays are acquired once per launch, not per row. Its
    steps that take arrays (the hop's decode, the 7-8 bit level table, the packing) are
    numba-inlined leaves (no call inside, so numba prunes their reference counts); the level
    window is a scalar function LLVM inlines (:func:`_always_inline`); the steps that call
    other functions (the scale spreading, the uniforms) stay here. The machine code is the
    one-function version's (the same instruction counts, to within spill slots).

    Where ``order`` is not empty, row ``i`` is not read from ``x`` (nor written there): it is
    :func:`center_gather`'s row ``i`` of ``src`` (rows in the original order, divided by
    ``divisor`` and centred on ``smean``, ``svalid`` valid values each), made in a scratch row
    while the row is encoded: the same values, so the same bytes, without the pass that writes
    the centred rows out and the encode's read of them back."""
    _prefer_wide_vectors()
    (t, f32, u32, bs, sa, sb, d, p, u, pv, codes, av, rv) = _q_scratch()
    grow = np.empty((1, SUPER), np.float32)  # the gathered row
    growb = grow.view(np.uint32)
    gather = order.shape[0] != 0
    divide = divisor != _F1
    halve, inverse = _power_of_two(divisor)
    ext = _window_table(mags)
    window = (ext[1], ext[2], ext[3], ext[4], ext[5], ext[6], ext[7], ext[8],
              ext[9], ext[10], ext[11], ext[12], ext[13], ext[14], ext[15], ext[16],
              ext[17], ext[18], ext[19], ext[20], ext[21], ext[22], ext[23], ext[24],
              ext[25], ext[26], ext[27], ext[28], ext[29], ext[30], ext[31], ext[32])
    top = (1 << (width - 1)) - 1  # R
    xb = x.view(np.uint32)
    tf = t.view(np.float32)
    for i in range(lo, hi):
        if gather:
            _gather_row(src, order, smean, svalid, divide, halve, inverse, divisor, i, hi,
                        grow[0])
            row, rowb, r = grow, growb, 0
        else:
            row, rowb, r = x, xb, i
        if hop:  # codec.decode_accumulate_torch of record i into its row
            _q_accumulate_record(records, i, row, r, width, table, d, f32, u32)
        tiny, unit_bits = _q_scales(rowb, r, t, tf, f32, u32, bs)
        # the per-block inverse scales at every coordinate: 8 -> 256 by doubling
        _dup(bs, sa, 8)
        _dup(sa, sb, 16)
        _dup(sb, sa, 32)
        _dup(sa, sb, 64)
        _dup(sb, d, 128)
        if tiny:  # codec._normalise's x * s (exact), for rows with a denormal block scale
            for b in range(H4_BLOCKS):
                sb[b] = bs[H4_BLOCKS + b]
            _dup(sb, sa, 8)
            _dup(sa, sb, 16)
            _dup(sb, sa, 32)
            _dup(sa, sb, 64)
            _dup(sb, pv, 128)
            for j in range(SUPER):
                p[j] = row[r, j] * pv[j]
        else:
            for j in range(SUPER):
                p[j] = row[r, j]
        # Uniforms (rng.rounding_uniforms): gamma from one mix32 per coordinate (the row's inner
        # hash, two where the row crosses a multiple of 2**32 of the global index); correlated:
        # u = (pi(rank) + gamma) / n, pi per run of 16 from the permutation table.
        base = index_base[i]
        lo32 = _lo32(base)
        jrow = _row_key(jitter_key, base)
        jend = _row_key(jitter_key, base + SUPER - 1)
        if correlated:
            prow = _row_key(perm_key, base)
            pend = _row_key(perm_key, base + SUPER - 1)
            for g in range(GROUPS):
                f_lo = np.uint32(lo32 + np.uint32(g * GROUP))
                k = pend if f_lo < lo32 else prow
                sa[g] = np.float32(ptab[np.int32(_mix32(np.uint32(k ^ f_lo)) >> _SEL_SHIFT)])
            _dup(sa, sb, 16)
            _dup(sb, sa, 32)
            _dup(sa, sb, 64)
            _dup(sb, pv, 128)
            for j in range(SUPER):
                g_lo = np.uint32(lo32 + np.uint32(j))  # wraps mod 2**32
                k = jend if g_lo < lo32 else jrow
                gamma = np.float32(_mix32(np.uint32(k ^ g_lo)) >> np.uint32(8)) * _TWO_M24
                u[j] = (pv[j] + gamma) * inv_n  # two roundings, as the reference
        else:
            for j in range(SUPER):
                g_lo = np.uint32(lo32 + np.uint32(j))
                k = jend if g_lo < lo32 else jrow
                u[j] = np.float32(_mix32(np.uint32(k ^ g_lo)) >> np.uint32(8)) * _TWO_M24
        if width <= 6:  # the level by a window search in registers, per coordinate
            for j in range(SUPER):
                inv = d[j]
                q = p[j] * inv  # inv > 0 exactly where the scale is usable
                y = min(max(q if inv > _F0 else _F0, _FM1), _F1)
                a = abs(y)
                r, m_lo, m_hi = _window_level(a, window, width)
                level = r + (1 if (a - m_lo) > u[j] * (m_hi - m_lo) else 0)
                codes[j] = np.uint8(top - level if y < _F0 else top + level)
        else:
            _q_levels_table(p, d, u, codes, width, mags, nxt, rtab, bins, av, rv, sa, sb)
        _q_store_record(out, i, codes, width, bs, unit_bits)


@numba.njit(**_inline)
def _q_scratch():
    """Per-launch scratch of :func:`_q_encode_row`: ``(t, f32, u32, bs, sa, sb, d, p, u, pv,
    codes, av, rv)``."""
    f32 = np.empty(1, np.float32)
    return (np.empty(SUPER // 2 + SUPER // 4, np.uint32), f32, f32.view(np.uint32),
            np.empty(3 * H4_BLOCKS, np.float32), np.empty(SUPER, np.float32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.float32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.float32),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.uint8),
            np.empty(SUPER, np.float32), np.empty(SUPER, np.int32))



# -- the decodes' row loop (inlined into the per-width entry points) ----------------------------


@numba.njit(**_inline)
def _decode_rows(
    lo, hi, width, records, scales, table, out, accumulate
):
    d = np.empty(GROUPS, np.float32)
    f32 = np.empty(1, np.float32)
    u32 = f32.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], width, scales, table, d, f32, u32, out[i], accumulate)


# -- entry points: one per width -----------------------------------------------------------------


# Scale mode as a literal too (``h``: hierarchical, ``f``: flat, ``q``: HIERARCHICAL4X32): the
# dead branch of a runtime flag cost the encode ~8 % (2-bit encode 2.61 -> 2.38 ns per coordinate
# without it). The decodes take it at run time: it is read once per record, outside the loops.


# The encodes and hops write their row loop out instead of inlining a generic one: numba's
# inliner re-runs its passes on an inlined body at every level it is inlined through, so one
# level less took a kernel's cold compile from ~7.4 to ~5.2 s (26 of them).
#
# The hop accumulates the partial sum in ``acc``'s row itself and encodes it from there while it
# is in cache (with ``keep_sum=False`` the reference leaves ``acc`` unspecified; the executor
# never reads it again). ``d`` of the scratch is free until the encode.


@numba.njit(**JIT_OPTIONS)
def encode_w2h(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 2, SCALES_H, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


@numba.njit(**JIT_OPTIONS)
def encode_w2f(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 2, SCALES_FLAT, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


@numba.njit(**JIT_OPTIONS)
def encode_w4h(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 4, SCALES_H, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


@numba.njit(**JIT_OPTIONS)
def encode_w4f(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 4, SCALES_FLAT, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


@numba.njit(**JIT_OPTIONS)
def encode_w8h(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 8, SCALES_H, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


@numba.njit(**JIT_OPTIONS)
def encode_w8f(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated):
    x_bits = x.view(np.uint32)
    scratch = _encode_scratch()
    for i in range(lo, hi):
        _encode_row(x[i], x_bits[i], index_base[i], out[i], 8, SCALES_FLAT, mags, nxt, rtab, bins,
                    jitter_key, perm_key, ptab, inv_n, correlated, scratch, True)


# HIERARCHICAL4X32 at every width of codec.FINE_WIDTHS; the other scale modes at 2, 4, 8 only
# (each entry point is seconds of cold compile, and format 3 is the one with the fine widths).


@numba.njit(**JIT_OPTIONS)
def encode_w2q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 2, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w3q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 3, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w4q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 4, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w5q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 5, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w6q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 6, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w7q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 7, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def encode_w8q(lo, hi, x, index_base, out, mags, nxt, rtab, bins,
               jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid, divisor):
    _q_rows(lo, hi, x, index_base, out, 8, mags, nxt, rtab, bins, jitter_key, perm_key, ptab,
            inv_n, correlated, out, mags, False, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def decode_w2(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 2, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w3(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 3, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w4(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 4, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w5(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 5, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w6(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 6, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w7(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 7, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def decode_w8(lo, hi, records, scales, table, out, accumulate):
    _decode_rows(lo, hi, 8, records, scales, table, out, accumulate)


@numba.njit(**JIT_OPTIONS)
def hop_w2h(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 2, SCALES_H, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 2, SCALES_H, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w2f(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 2, SCALES_FLAT, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 2, SCALES_FLAT, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w4h(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 4, SCALES_H, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 4, SCALES_H, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w4f(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 4, SCALES_FLAT, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 4, SCALES_FLAT, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w8h(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 8, SCALES_H, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 8, SCALES_H, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w8f(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated):
    scratch = _encode_scratch()
    d, f32, u32 = scratch[0], scratch[4], scratch[5]
    acc_bits = acc.view(np.uint32)
    for i in range(lo, hi):
        _decode_row(records[i], 8, SCALES_FLAT, table, d, f32, u32, acc[i], True)
        _encode_row(acc[i], acc_bits[i], index_base[i], out[i], 8, SCALES_FLAT, mags, nxt, rtab,
                    bins, jitter_key, perm_key, ptab, inv_n, correlated, scratch, False)


@numba.njit(**JIT_OPTIONS)
def hop_w2q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 2, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w3q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 3, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w4q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 4, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w5q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 5, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w6q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 6, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w7q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 7, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**JIT_OPTIONS)
def hop_w8q(lo, hi, records, table, acc, index_base, out, mags, nxt,
            rtab, bins, jitter_key, perm_key, ptab, inv_n, correlated, src, order, smean, svalid,
            divisor):
    _q_rows(lo, hi, acc, index_base, out, 8, mags, nxt, rtab, bins, jitter_key, perm_key,
            ptab, inv_n, correlated, records, table, True, src, order, smean, svalid, divisor)


@numba.njit(**_inline)
def _decode_restore_rows(lo, hi, width, records, scales, table, mean, index_base, valid,
                         out):
    """The last decode of an all-reduce fused with the restore: ``out[index_base[i] + j] =
    decode(records[i])[j] + mean[i]`` for ``j < valid[i]`` (two roundings, as decoding into the
    work row and restoring it), without the work row in between."""
    d = np.empty(GROUPS, np.float32)
    row = np.empty(SUPER, np.float32)
    f32 = np.empty(1, np.float32)
    u32 = f32.view(np.uint32)
    for i in range(lo, hi):
        _prefetch_row_write(out, index_base, valid, i, hi)
        _decode_row(records[i], width, scales, table, d, f32, u32, row, False)
        _write_plus_mean(out, index_base[i], valid[i], row, mean[i])


@numba.njit(**JIT_OPTIONS)
def decode_restore_w2(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 2, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w3(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 3, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w4(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 4, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w5(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 5, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w6(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 6, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w7(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 7, records, scales, table, mean, index_base, valid, out)


@numba.njit(**JIT_OPTIONS)
def decode_restore_w8(lo, hi, records, scales, table, mean, index_base, valid, out):
    _decode_restore_rows(lo, hi, 8, records, scales, table, mean, index_base, valid, out)


# -- raw width 16: fp16 values relative to one bf16 unit ----------------------------------------
# codec._encode_raw / _decode_raw on records of 514 bytes: 256 fp16 patterns, then the unit's
# bf16 pattern, little-endian (byte arithmetic: a record may start at an odd payload offset).
# fp32 <-> fp16 by bit arithmetic, branch-free so the loops vectorise, rounding to nearest even
# as torch's conversion does: normal results by adding ``0xFFF`` plus the kept LSB, subnormal
# ones by the hardware's own rounding of ``|y| + 0.5``, whose ULP is fp16's subnormal step 2**-24.

_F_HALF = np.float32(0.5)
_TWO_M14 = np.float32(2.0**-14)
_HALF_BITS = np.uint32(0x3F000000)  # 0.5
_EXP_ADJ = np.uint32(0x38000000)  # (127 - 15) << 23
_MIN_NORMAL16 = np.uint32(0x38800000)  # 2**-14, fp16's smallest normal, as fp32 bits


@numba.njit(**_inline)
def _raw_encode_row(row, rowb, o8, t, tb, u, ub):
    """codec._encode_raw of one row into the record ``o8`` (514 bytes); ``t``/``u`` are fp32
    scratch rows and ``tb``/``ub`` the same memory as uint32."""
    m = np.uint32(0)
    for j in range(SUPER):
        m = max(m, np.uint32(rowb[j] & _ABS))
    if m > _INF_BITS:  # NaN: bf16_ceil's canonical NaN
        unit = np.uint32(0x7FC0)
    else:
        unit = np.uint32(np.uint32(m + np.uint32(0xFFFF)) >> np.uint32(16))
    ub[0] = np.uint32(unit << np.uint32(16))
    d = u[0]
    ok = d > _F0 and d < _INF
    pre = _PRESCALE if d < _TINY else _F1
    inv = _F1 / (d * pre) if ok else _F0
    if ok:
        for j in range(SUPER):
            y = min(max((row[j] * pre) * inv, _FM1), _F1)
            t[j] = y
            u[j] = abs(y) + _F_HALF
    else:
        for j in range(SUPER):
            t[j] = _F0
            u[j] = _F_HALF
    for j in range(SUPER):
        bits = tb[j]
        a = np.uint32(bits & _ABS)
        sign = np.uint32(np.uint32(bits >> np.uint32(16)) & np.uint32(0x8000))
        lsb = np.uint32(np.uint32(a >> np.uint32(13)) & np.uint32(1))
        normal = np.uint32(np.uint32(a - _EXP_ADJ + np.uint32(0xFFF) + lsb) >> np.uint32(13))
        small = np.uint32(ub[j] - _HALF_BITS)
        h = np.uint32((small if a < _MIN_NORMAL16 else normal) | sign)
        o8[2 * j] = np.uint8(h & np.uint32(0xFF))
        o8[2 * j + 1] = np.uint8(h >> np.uint32(8))
    o8[2 * SUPER] = np.uint8(unit & np.uint32(0xFF))
    o8[2 * SUPER + 1] = np.uint8(unit >> np.uint32(8))


@numba.njit(**_inline)
def _raw_decode_row(r8, out, accumulate, t, tb, z, zb):
    """codec._decode_raw of one record (514 bytes) into ``out`` (or added to it), the fp16 ->
    fp32 conversion exact for zeros, subnormals, inf and NaN."""
    zb[0] = np.uint32(np.uint32(r8[2 * SUPER]) << np.uint32(16)) | np.uint32(
        np.uint32(r8[2 * SUPER + 1]) << np.uint32(24))
    unit = z[0]
    for j in range(SUPER):
        h = np.uint32(np.uint32(r8[2 * j]) | np.uint32(np.uint32(r8[2 * j + 1]) << np.uint32(8)))
        m = np.uint32(h & np.uint32(0x7FFF))
        o = np.uint32(np.uint32(m << np.uint32(13)) + _EXP_ADJ)
        e = np.uint32(m & np.uint32(0x7C00))
        tb[j] = np.uint32(o + _EXP_ADJ) if e == np.uint32(0x7C00) else o
        zb[j] = np.uint32(o + np.uint32(0x00800000))
    for j in range(SUPER):
        subnormal = np.uint32(r8[2 * j + 1]) & np.uint32(0x7C) == np.uint32(0)
        t[j] = z[j] - _TWO_M14 if subnormal else t[j]
    for j in range(SUPER):
        sign = np.uint32(np.uint32(r8[2 * j + 1]) & np.uint32(0x80))
        tb[j] = np.uint32(tb[j] | np.uint32(sign << np.uint32(24)))
    if accumulate:
        for j in range(SUPER):
            out[j] = out[j] + t[j] * unit
    else:
        for j in range(SUPER):
            out[j] = t[j] * unit


@numba.njit(**JIT_OPTIONS)
def encode_raw(lo, hi, x, xb, out):
    """Raw width 16 records of rows ``[lo, hi)`` of ``x`` (``xb``: its uint32 patterns) into
    ``out`` ``[rows, 514]`` uint8."""
    t = np.empty(SUPER, np.float32)
    u = np.empty(SUPER, np.float32)
    tb = t.view(np.uint32)
    ub = u.view(np.uint32)
    for i in range(lo, hi):
        _raw_encode_row(x[i], xb[i], out[i], t, tb, u, ub)


@numba.njit(**JIT_OPTIONS)
def decode_raw(lo, hi, records, out, accumulate):
    """Raw width 16 records ``[rows, 514]`` uint8 -> fp32 rows of ``out`` (added with
    ``accumulate``: the reference's product rounded, then the sum)."""
    t = np.empty(SUPER, np.float32)
    z = np.empty(SUPER, np.float32)
    tb = t.view(np.uint32)
    zb = z.view(np.uint32)
    for i in range(lo, hi):
        _raw_decode_row(records[i], out[i], accumulate, t, tb, z, zb)


@numba.njit(**JIT_OPTIONS)
def hop_raw(lo, hi, records, acc, accb, out):
    """The raw width's hop per row: ``acc += decode(records)``, then ``acc`` encoded into
    ``out`` (``accb``: ``acc``'s uint32 patterns)."""
    t = np.empty(SUPER, np.float32)
    z = np.empty(SUPER, np.float32)
    tb = t.view(np.uint32)
    zb = z.view(np.uint32)
    for i in range(lo, hi):
        _raw_decode_row(records[i], acc[i], True, t, tb, z, zb)
        _raw_encode_row(acc[i], accb[i], out[i], t, tb, z, zb)


@numba.njit(**JIT_OPTIONS)
def decode_restore_raw(lo, hi, records, mean, index_base, valid, out):
    """:func:`decode_raw` fused with the restore, as ``_decode_restore_rows`` for the coded
    widths: ``out[index_base[i] + j] = decode(records[i])[j] + mean[i]`` for ``j < valid[i]``."""
    t = np.empty(SUPER, np.float32)
    z = np.empty(SUPER, np.float32)
    tb = t.view(np.uint32)
    zb = z.view(np.uint32)
    row = np.empty(SUPER, np.float32)
    for i in range(lo, hi):
        _prefetch_row_write(out, index_base, valid, i, hi)
        _raw_decode_row(records[i], row, False, t, tb, z, zb)
        _write_plus_mean(out, index_base[i], valid[i], row, mean[i])


# -- statistics and restore ------------------------------------------------------------------------


@numba.njit(**JIT_OPTIONS)
def stats_center(lo, hi, x, valid, centred, mean, norm2):
    """codec.stats_center_torch on rows ``[lo, hi)``: tree-sum mean over the valid
    coordinates (padding is zero), centring (padding stays exactly 0), tree-sum squared norm."""
    t = np.empty(SUPER, np.float32)
    for i in range(lo, hi):
        row = x[i]
        for j in range(SUPER):
            t[j] = row[j]
        m = _tree_sum_256(t) / np.float32(valid[i])
        c = centred[i]
        v = valid[i]
        for j in range(SUPER):
            c[j] = row[j] - m if j < v else _F0
        for j in range(SUPER):
            t[j] = c[j] * c[j]
        mean[i] = m
        norm2[i] = _tree_sum_256(t)


@numba.njit(**JIT_OPTIONS)
def max_finite_abs_bits(xb):
    """The bit pattern of the largest finite ``|x|`` of fp32 values given as uint32 patterns
    (0 when none is finite and non-zero): the API's range check, one vectorised pass (several
    times faster than ``torch.aminmax``)."""
    m = np.uint32(0)
    for j in range(xb.shape[0]):
        b = np.uint32(xb[j] & _ABS)
        m = max(m, b if b < _INF_BITS else np.uint32(0))
    return m

@numba.njit(**JIT_OPTIONS)
def restore_f32(lo, hi, work, mean, index_base, valid, out):
    """``out[index_base[i] + j] = work[i, j] + mean[i]`` for ``j < valid[i]`` (fp32 out)."""
    for i in range(lo, hi):
        _prefetch_row_write(out, index_base, valid, i, hi)
        _write_plus_mean(out, index_base[i], valid[i], work[i], mean[i])


@numba.njit(**JIT_OPTIONS)
def restore_mean_f32(lo, hi, mean, index_base, valid, out):
    """``out[index_base[i] + j] = mean[i] + 0`` for ``j < valid[i]``: the restore of rows whose
    centred values are all +-0 on every rank (width 0), without reading them (``c + m`` is
    ``m + 0`` for ``c`` = +-0: see ``DynamiqCall._decode_restore``)."""
    for i in range(lo, hi):
        _prefetch_row_write(out, index_base, valid, i, hi)
        m = mean[i] + _F0
        b = index_base[i]
        if valid[i] == SUPER:
            o = out[b : b + SUPER]
            for j in range(SUPER):
                o[j] = m
        else:
            for j in range(valid[i]):
                out[b + j] = m


@numba.njit(**JIT_OPTIONS)
def restore_bf16(lo, hi, work, mean, index_base, valid, out):
    """As :func:`restore_f32` into bf16 patterns (uint16), rounded to nearest even as torch
    does: add ``0x7FFF`` plus the kept LSB to the fp32 pattern; NaN becomes ``0x7FC0``."""
    f32 = np.empty(1, np.float32)
    u32 = f32.view(np.uint32)
    for i in range(lo, hi):
        row = work[i]
        m = mean[i]
        b = index_base[i]
        for j in range(valid[i]):
            v = row[j] + m
            f32[0] = v
            bits = u32[0]
            if v != v:
                out[b + j] = np.uint16(0x7FC0)
            else:
                rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                out[b + j] = np.uint16(np.uint32(rounded) >> np.uint32(16))


@numba.njit(**JIT_OPTIONS)
def restore_add(lo, hi, work, mean, out):
    """``out[i, j] = work[i, j] + mean[i]`` in fp32 (rows in place; fp16 targets then cast)."""
    for i in range(lo, hi):
        row = work[i]
        m = mean[i]
        o = out[i]
        for j in range(SUPER):
            o[j] = row[j] + m


@numba.njit(**JIT_OPTIONS)
def stats_only(lo, hi, x, xb, valid, divisor, centre, keep, mean, norm2, top, plus_zero):
    """The statistics of :func:`stats_center` on ``x / divisor`` (fp32 division, as the
    reference's ``flat / n`` for ``op="avg"``; none when ``divisor`` is 1) without writing the
    centred rows (they are written later, already in sorted order, by :func:`center_gather`).
    Without ``centre`` the mean is +0 (codec.stats_center_rounded_torch's ``centre=False``):
    ``v - 0`` is ``v`` for every fp32 ``v``, -0 and NaN included, so the norm is the uncentred
    rows' and center_gather with that mean writes ``x / divisor`` itself. With ``keep``, a row
    whose norm is 0 but which holds a non-zero centred value (its squares underflowed) gets the
    smallest normal norm, as the call's underflow check would give it, tested while the row is
    in cache (no second pass over the zero rows; ``xb`` is ``x``'s bit patterns, so that a row
    of zeros is one vectorised OR). Where ``top`` has one entry per row, ``top[i]`` is the bit
    pattern of row ``i``'s largest finite ``|x|`` (of ``x`` itself, before the division; 0 for
    none), as :func:`max_finite_abs_bits` of the row: the range check in the same pass; and
    ``plus_zero[i]`` whether every bit of the row is 0 (all +0: what a restore of ``+0`` would
    write there already)."""
    t = np.empty(SUPER // 2, np.float32)
    r = np.empty(SUPER, np.float32)
    divide = divisor != _F1
    halve, inverse = _power_of_two(divisor)
    half = SUPER // 2
    ranged = top.shape[0] != 0
    for i in range(lo, hi):
        src = x[i]
        if ranged:
            bits = xb[i]
            mx = np.uint32(0)
            any_bit = np.uint32(0)
            for j in range(SUPER):
                b = np.uint32(bits[j] & _ABS)
                mx = max(mx, b if b < _INF_BITS else np.uint32(0))
                any_bit |= bits[j]
            top[i] = mx
            plus_zero[i] = any_bit == 0
        if divide and halve:
            for j in range(SUPER):
                r[j] = src[j] * inverse  # x * 2**-k: x / 2**k, bit for bit
            src = r
        elif divide:
            for j in range(SUPER):
                r[j] = src[j] / divisor
            src = r
        # codec.tree_sum, its first level read straight from the row (no copies)
        for j in range(half):
            t[j] = src[j] + src[j + half]
        m = _tree_sum_128(t) / np.float32(valid[i]) if centre else _F0
        v = valid[i]
        if v == SUPER:
            for j in range(half):
                a = src[j] - m
                b = src[j + half] - m
                t[j] = a * a + b * b  # products rounded, then the first level's add
        else:
            for j in range(half):
                a = src[j] - m if j < v else _F0
                b = src[j + half] - m if j + half < v else _F0
                t[j] = a * a + b * b
        nrm = _tree_sum_128(t)
        if keep and nrm == _F0:
            bits = xb[i]
            acc = np.uint32(0)
            for j in range(v):  # a row of zeros (the common case): one vectorised OR
                acc |= bits[j] & _ABS
            if acc != 0:
                for j in range(v):
                    if src[j] - m != _F0:
                        nrm = _TINY_NORMAL
                        break
        mean[i] = m
        norm2[i] = nrm


@numba.njit(**JIT_OPTIONS)
def _power_of_two(divisor):
    """``(divisor is a power of two, 1 / divisor)`` for an integer-valued fp32 ``divisor`` in
    [1, 2**24). Where it is, ``x * (1 / divisor)`` is ``x / divisor`` bit for bit (both are the
    correctly rounded ``x * 2**-k``, subnormal results included) and a multiply where the
    division cost the statistics' and the reorder's passes ~0.2 ns per coordinate."""
    d = np.int64(divisor)
    return (d & (d - 1)) == 0, _F1 / divisor


@numba.njit(**JIT_OPTIONS)
def center_gather(lo, hi, x, mean, valid, order, divisor, skip, out):
    """``out[k] = centred[order[k]]`` with ``centred`` as :func:`stats_center` writes it for
    ``x / divisor``: row ``order[k]`` of ``x`` (divided, see :func:`stats_only`) minus its mean,
    padding exactly 0 (division, centring and reorder in one pass). Rows ``k`` with ``skip[k]``
    (when ``skip`` is not empty) are not written."""
    divide = divisor != _F1
    halve, inverse = _power_of_two(divisor)
    skipping = skip.shape[0] > 0
    for k in range(lo, hi):
        if skipping and skip[k]:
            continue
        _gather_row(x, order, mean, valid, divide, halve, inverse, divisor, k, hi, out[k])
