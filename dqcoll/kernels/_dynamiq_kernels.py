"""Triton kernels of the DynamiQ codec: the same bytes as :mod:`dqcoll.kernels.codec`.

Every kernel here is a pure ``@triton.jit`` function with no policy: block sizes, warps, dtype
checks and allocation live in :mod:`.dynamiq_triton` (launchers) and :mod:`._launch` (heuristics).
The torch reference is the spec; each step below names the reference line it reproduces.

One program handles ``ROWS`` super-groups of 256 coordinates cut into ``NB`` scale blocks of
``BS`` coordinates (``16 x 16``, hierarchical scales: one uint8 code per group of 16, and
``hierarchical4x32``, whose 4-bit code per 32 coordinates is taken over a pair of blocks; or
``8 x 32``, flat scales: one bf16 per 32 coordinates), held as a ``[BS // 4, ROWS * NB, 4]``
tile with the blocks along the middle axis (:func:`_tile_coords`). The compiler's layout keeps 4
consecutive values per thread along the last axis and spreads the threads along the blocks, so
with 8 rows over 4 warps (:mod:`._launch`) each thread holds one whole block of 16: the block's
max is a reduction inside the thread, its scale divisions and scale byte are computed once (not
once per thread sharing the block), and the row's max is a shuffle among the 16 threads of the
row.

Byte-exactness rules (the reference is fp32 IEEE, round to nearest, one rounding per operation):

* launched with ``enable_fp_fusion=False`` (see :mod:`._launch`): ``a * b + c`` must stay two
  roundings, as in torch;
* every division is :func:`tl.math.div_rn` (IEEE), never ``/`` (approximate on NVIDIA);
* sums over 256 coordinates use the reference's fixed halving tree (``v[:h] + v[h:]``);
* ``max |x|`` is an integer ``max`` of the bit patterns with the sign cleared: for non-negative
  floats the order of the patterns is the order of the values, and every NaN pattern sorts above
  ``+inf``, so NaN propagates exactly as ``torch.amax`` does (``tl.max`` leaves NaN undefined);
* the random numbers are the uint32 hash of :mod:`dqcoll.kernels.rng`, in uint32
  arithmetic (wrapping multiplies, logical shifts);
* the level search reads one 16-byte row of a table over equal bins of ``[0, 1]`` (the
  magnitudes around the bin and the level count of its start) and corrects by one compare against
  the stored fp32 magnitude, so it equals the reference's ``searchsorted`` exactly;
* row offsets are int64 (row index times row stride), so buffers above 2**31 elements work.
* the per-row arrays (``index``, ``mean``, ``valid``) and the restore's scattered output are
  ``do_not_specialize``: callers pass them as slices at any row offset (``index_base[a:b]``) or
  as their own tensors, and Triton would otherwise compile one variant per 16-byte alignment of
  each, mid-training. One value per row, and a store at a loaded offset, gain nothing from the
  alignment (``benchmarks/kernels_aot.py`` counts the same SASS per coordinate and registers for
  sm_90 either way). The row tiles (``x``, ``acc``, records) keep their alignment
  specialisation, and ``dynamiq_triton.warm_up`` compiles both alignments where a caller can
  pass either.

Rejected: one ``tl.sum`` over 256 coordinates for the statistics (its order is unspecified, so its
bits could not match the reference), ``tl.where``-free NaN handling through ``tl.maximum`` (NaN
behaviour undefined), a binary search over the magnitude table for the level (7 dependent
gathers at 8 bits), a ``[ROWS, NB, BS]`` tile (the compiler then splits each block over 4
threads, which all repeat the block's three divisions: 117 instead of 70 SASS per coordinate in
the 4-bit fused hop), and a 16-byte vector load of the level row (its 4-wide layout differs from
the tile's, and the conversion goes through shared memory: 153 SASS per coordinate).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import rng

# Constants of the hash, taken from the reference (a kernel reads module globals only as
# constexprs). The shift amounts are written out in _mix32, as in rng.mix32.
_M1 = tl.constexpr(rng._M1)
_M2 = tl.constexpr(rng._M2)
_SEL_SHIFT = tl.constexpr(rng.PERMUTATION_SHIFT)

# Only builtins of ``triton.language`` are used, never its ``@triton.jit`` helpers (``tl.sum``,
# ``tl.max``, ``tl.zeros``, ...): those live in ``triton.language.standard`` and are
# compiled-only when Triton was imported without ``TRITON_INTERPRET``, so the interpreted copy of
# this module (see dynamiq_triton) could not call them. Reductions are ``tl.reduce`` with Triton's
# own combine functions: the interpreter recognises them (numpy fast path) and they compile
# exactly as ``tl.sum``/``tl.max`` do on the GPU.
_ADD = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max  # only ever applied to uint32 here: exact, no NaN


# -- random numbers (rng.py, in uint32) ----------------------------------------------------------


@triton.jit
def _mix32(x):
    """rng.mix32: ``x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 15`` (mod 2**32)."""
    x = x ^ (x >> 16)  # logical shift: x is uint32
    x = x * _M1  # wraps mod 2**32
    x = x ^ (x >> 15)
    x = x * _M2
    x = x ^ (x >> 15)
    return x


@triton.jit
def _row_keys(key, base):
    """The inner hash of ``rng.coord_hash(key, g) = mix32(mix32(key ^ g_hi) ^ g_lo)`` depends on
    ``g_hi`` only: per row (``base`` [ROWS] int64), the key at its first coordinate and at its
    last (they differ only where the row crosses a multiple of 2**32)."""
    k = key.to(tl.uint32)
    first = _mix32(k ^ (base >> 32).to(tl.uint32))  # base >= 0: the shift is logical
    last = _mix32(k ^ ((base + 255) >> 32).to(tl.uint32))
    return first, last


@triton.jit
def _hash_in_row(first, last, base_lo, g_lo):
    """``coord_hash`` of coordinates whose low halves are ``g_lo``, in rows with the keys of
    :func:`_row_keys` and low halves ``base_lo`` (broadcast): one ``mix32`` per coordinate; the
    coordinates past a wrap of the low half take the row's second key."""
    return _mix32(tl.where(g_lo < base_lo, last, first) ^ g_lo)


@triton.jit
def _rounding_uniforms(
    base, coord, first_coord, jitter_key, perm_key, ptab_ptr, inv_n, CORRELATED: tl.constexpr,
):
    """fp32 uniforms of this rank (rng.rounding_uniforms) at the coordinates ``base + coord`` of
    rows starting at global indices ``base`` (int64 ``[1, G, 1]``, the row of each block;
    ``coord`` the tile's ``[Q, G, 4]`` coordinates in their rows): ``gamma``, or
    ``(pi(rank) + gamma) * fp32(1/n)`` with ``pi(rank)`` this rank's entry of the table
    permutation each run of 16 selects by the hash of its first index ``base + first_coord``
    (``first_coord`` e.g. ``[1, G, 1]``: one hash and one table load per run)."""
    base_lo = base.to(tl.uint32)  # truncation: the low 32 bits
    j_first, j_last = _row_keys(jitter_key, base)
    g_lo = base_lo + coord.to(tl.uint32)  # wraps mod 2**32
    h = _hash_in_row(j_first, j_last, base_lo, g_lo)
    gamma = (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # top 24 bits * 2**-24, exact
    if CORRELATED:
        p_first, p_last = _row_keys(perm_key, base)
        f_lo = base_lo + first_coord.to(tl.uint32)
        sel = _hash_in_row(p_first, p_last, base_lo, f_lo)
        pi = tl.load(ptab_ptr + (sel >> _SEL_SHIFT).to(tl.int32))
        u = (pi.to(tl.float32) + gamma) * inv_n  # two roundings, as in torch
    else:
        u = gamma
    return u


# -- shared tile steps ---------------------------------------------------------------------------


@triton.jit
def _bf16_ceil_bits(bits):
    """bf16 pattern (in a uint32) of a non-negative fp32 given by its pattern, rounded *up*
    (codec.bf16_ceil): adding 0xFFFF carries into the kept half unless the dropped half is zero;
    NaN becomes the canonical 0x7FC0."""
    rounded = (bits + 0xFFFF) >> 16
    return tl.where(bits > 0x7F800000, 0x7FC0, rounded)  # patterns above +inf are NaN


@triton.jit
def _bf16_bits_to_fp32(bits):
    """fp32 value of a bf16 pattern held in the low 16 bits of a uint32 (exact)."""
    return (bits << 16).to(tl.float32, bitcast=True)


@triton.jit
def _to_fp32(x):
    """Exact upcast of fp32/bf16/fp16 values. bf16 goes through its bit pattern (a 16-bit shift),
    which is what the hardware does and keeps bf16 denormals exact in the interpreter too."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _from_fp32(v, dtype: tl.constexpr):
    """fp32 to ``dtype`` rounding to nearest even, as torch does. bf16 is rounded on the bit
    pattern (torch's ``round_to_nearest_even``: add 0x7FFF plus the kept LSB, NaN to 0x7FC0)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(dtype)


@triton.jit
def _halve(v, ROWS: tl.constexpr, W: tl.constexpr):
    """``v[:, :W/2] + v[:, W/2:]`` of a ``[ROWS, W]`` tile: one level of the halving tree."""
    return tl.reduce(tl.reshape(v, [ROWS, 2, W // 2]), 1, _ADD)


@triton.jit
def _tree_sum_256(v, ROWS: tl.constexpr):
    """codec.tree_sum over the 256 coordinates of each row: 8 fixed halvings."""
    v = _halve(v, ROWS, 256)
    v = _halve(v, ROWS, 128)
    v = _halve(v, ROWS, 64)
    v = _halve(v, ROWS, 32)
    v = _halve(v, ROWS, 16)
    v = _halve(v, ROWS, 8)
    v = _halve(v, ROWS, 4)
    v = _halve(v, ROWS, 2)
    return tl.reshape(v, [ROWS])


@triton.jit
def _tile_coords(pid, n_rows, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr):
    """Index of the ``[Q, G, 4]`` tile (``G = ROWS * NB`` blocks, ``Q = BS // 4``): element
    ``(j, g, i)`` is coordinate ``(g % NB) * BS + 4 * j + i`` of row ``g // NB`` of the program.
    Returns the rows (int64 ``[1, G, 1]``), their mask, the block in its row (``[1, G, 1]``) and
    the coordinate in its row (``[Q, G, 4]``).

    The blocks run along the middle axis so that the compiler's layout (4 contiguous values per
    thread along the last axis, threads along the next one) puts a whole block in one thread when
    ``G`` covers the threads: the block's max, its scale divisions and its scale byte are then
    computed once, not once per thread holding a part of it."""
    Q: tl.constexpr = BS // 4
    g = tl.arange(0, ROWS * NB)[None, :, None]
    rows = pid.to(tl.int64) * ROWS + (g // NB).to(tl.int64)
    blk = g % NB
    coord = blk * BS + tl.arange(0, Q)[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]
    return rows, rows < n_rows, blk, coord


@triton.jit
def _decode_tile(
    rec_ptr, rec_row, row_mask, blk, coord, table_ptr,
    WIDTH: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr, SCALES: tl.constexpr,
):
    """fp32 ``[Q, G, 4]`` values (see :func:`_tile_coords`) of the records starting at byte
    offsets ``rec_row`` (codec.decode_torch): ``table[code] * D`` with ``D = q * unit`` or the
    flat bf16 scale (``table_ptr``: at 2, 4, 8 bits the byte table, value of code k of byte b at
    ``b * (8 // WIDTH) + k``; at 3, 5, 6, 7 bits the ``2**WIDTH`` code values)."""
    CODE_NBYTES: tl.constexpr = 32 * WIDTH
    rec = rec_ptr + rec_row
    if 8 % WIDTH == 0:
        PER_BYTE: tl.constexpr = 8 // WIDTH
        # Code j sits in byte j*b//8 at bit j*b%8 (LSB-first); the table holds the values of the
        # PER_BYTE codes of each byte value side by side (_params.LevelTables.table): no shift or
        # mask per code, and the coordinates of one byte share an address (immediate offsets).
        byte = tl.load(rec + coord // PER_BYTE, mask=row_mask, other=0).to(tl.int32)
        value = tl.load(table_ptr + (byte * PER_BYTE + coord % PER_BYTE))
    else:
        # Bitstream (codec._unpack_bitstream): code j at bit j*w may straddle two bytes. A block
        # starts on a byte (BS*w is a multiple of 8), so each coordinate's two bytes and shift are
        # constants from the block's first byte: the 2w + 1 bytes of a block of 16 are loaded
        # once each (shared immediate offsets) and a code costs a shift, an or and a mask.
        Q: tl.constexpr = BS // 4
        bit = (tl.arange(0, Q)[:, None, None] * 4 + tl.arange(0, 4)[None, None, :]) * WIDTH
        at = rec + blk * (BS * WIDTH // 8) + (bit >> 3)  # [Q, G, 4]
        lo = tl.load(at, mask=row_mask, other=0).to(tl.uint32)
        hi = tl.load(at + 1, mask=row_mask, other=0).to(tl.uint32)  # at most a scale byte
        code = ((lo | (hi << 8)) >> (bit & 7).to(tl.uint32)) & ((1 << WIDTH) - 1)
        value = tl.load(table_ptr + code.to(tl.int32))
    scale_row = rec + CODE_NBYTES  # [1, G, 1] pointers to the scale bytes
    if SCALES == "hierarchical":
        q = tl.load(scale_row + blk, mask=row_mask, other=0).to(tl.float32)
        unit_lo = tl.load(scale_row + NB, mask=row_mask, other=0).to(tl.uint32)
        unit_hi = tl.load(scale_row + NB + 1, mask=row_mask, other=0).to(tl.uint32)
        unit = _bf16_bits_to_fp32(unit_lo | (unit_hi << 8))  # bf16, little-endian
        scale = q * unit  # exact: 8-bit times 8-bit significands
    elif SCALES == "hierarchical4x32":
        # One nibble q - 1 per 32 coordinates (two blocks of 16), two per byte, low nibble first.
        packed = tl.load(scale_row + blk // 4, mask=row_mask, other=0).to(tl.uint32)
        q = ((packed >> (((blk // 2) % 2) * 4).to(tl.uint32)) & 0xF) + 1
        unit_lo = tl.load(scale_row + NB // 4, mask=row_mask, other=0).to(tl.uint32)
        unit_hi = tl.load(scale_row + NB // 4 + 1, mask=row_mask, other=0).to(tl.uint32)
        unit = _bf16_bits_to_fp32(unit_lo | (unit_hi << 8))
        scale = q.to(tl.float32) * unit  # exact: 5-bit times 8-bit significands
    else:
        lo = tl.load(scale_row + 2 * blk, mask=row_mask, other=0).to(tl.uint32)
        hi = tl.load(scale_row + 2 * blk + 1, mask=row_mask, other=0).to(tl.uint32)
        scale = _bf16_bits_to_fp32(lo | (hi << 8))
    return value * scale


@triton.jit
def _encode_scales(
    x, row_mask, blk, scale_row, ROWS: tl.constexpr, NB: tl.constexpr, SCALES: tl.constexpr,
):
    """Scales of the fp32 ``[Q, G, 4]`` tile ``x``: stores the scale bytes of each row at
    ``scale_row`` (``[1, G, 1]`` pointers past the codes) and returns the decoded scale of each
    block (``[1, G, 1]``): ``q * unit`` (hierarchical scales) or the flat bf16 scale."""
    G: tl.constexpr = ROWS * NB
    # |x| as a bit pattern (sign cleared); integer max = NaN-propagating float max.
    abs_bits = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    block_bits = tl.reduce(tl.reduce(abs_bits, 2, _MAX, keep_dims=True), 0, _MAX,
                           keep_dims=True)  # [1, G, 1]
    if SCALES == "hierarchical":
        # The row's max over its NB blocks, back on every block of the row.
        by_row = tl.reshape(block_bits, [ROWS, NB])
        top_bits = tl.reduce(by_row, 1, _MAX, keep_dims=True)  # [ROWS, 1]
        top_bits = tl.reshape(tl.broadcast_to(top_bits, [ROWS, NB]), [1, G, 1])
        top = top_bits.to(tl.float32, bitcast=True)
        unit_bits = _bf16_ceil_bits(tl.math.div_rn(top, 255.0).to(tl.uint32, bitcast=True))
        unit = _bf16_bits_to_fp32(unit_bits)
        group = block_bits.to(tl.float32, bitcast=True)
        ratio = tl.math.ceil(tl.math.div_rn(group, unit))
        usable = (unit > 0.0) & (unit < float("inf"))  # False for 0, inf and NaN
        q = tl.where(usable, tl.minimum(tl.maximum(ratio, 1.0), 255.0), 1.0)
        scale = q * unit  # [1, G, 1], exact
        tl.store(scale_row + blk, q.to(tl.uint8), mask=row_mask)
        first = row_mask & (blk == 0)  # the unit once per row
        tl.store(scale_row + NB, (unit_bits & 0xFF).to(tl.uint8), mask=first)
        tl.store(scale_row + NB + 1, (unit_bits >> 8).to(tl.uint8), mask=first)
    elif SCALES == "hierarchical4x32":
        # A scale per pair of blocks (32 coordinates), computed on the [ROWS, NB // 2] pairs and
        # broadcast back, so that the division runs once per pair and the byte of two nibbles
        # needs no exchange between the threads of its blocks.
        pair_bits = tl.reduce(tl.reshape(block_bits, [ROWS, NB // 2, 2]), 2, _MAX)
        top_bits = tl.reduce(pair_bits, 1, _MAX, keep_dims=True)  # [ROWS, 1]
        # top * 2**-4 is top / 16 rounded once: the same real number, so the same fp32
        # (denormals included), without a division.
        unit_bits = _bf16_ceil_bits((top_bits.to(tl.float32, bitcast=True) * 0.0625)
                                    .to(tl.uint32, bitcast=True))
        unit = _bf16_bits_to_fp32(unit_bits)  # [ROWS, 1]
        ratio = tl.math.ceil(tl.math.div_rn(pair_bits.to(tl.float32, bitcast=True), unit))
        usable = (unit > 0.0) & (unit < float("inf"))  # False for 0, inf and NaN
        q = tl.where(usable, tl.minimum(tl.maximum(ratio, 1.0), 16.0), 1.0)  # [ROWS, NB // 2]
        nibbles = tl.reshape(q.to(tl.uint32) - 1, [ROWS, NB // 4, 2])
        packed = tl.reduce(nibbles << (tl.arange(0, 2) * 4).to(tl.uint32)[None, None, :], 2,
                           _ADD)  # [ROWS, NB // 4]: pair 2p in the low nibble
        scale = tl.reshape(tl.broadcast_to((q * unit)[:, :, None], [ROWS, NB // 2, 2]),
                           [1, G, 1])  # exact
        packed = tl.reshape(tl.broadcast_to(packed[:, :, None], [ROWS, NB // 4, 4]), [1, G, 1])
        unit_bits = tl.reshape(tl.broadcast_to(unit_bits, [ROWS, NB]), [1, G, 1])
        tl.store(scale_row + blk // 4, packed.to(tl.uint8), mask=row_mask & (blk % 4 == 0))
        first = row_mask & (blk == 0)  # the unit once per row
        tl.store(scale_row + NB // 4, (unit_bits & 0xFF).to(tl.uint8), mask=first)
        tl.store(scale_row + NB // 4 + 1, (unit_bits >> 8).to(tl.uint8), mask=first)
    else:
        scale_bits = _bf16_ceil_bits(block_bits)
        scale = _bf16_bits_to_fp32(scale_bits)
        tl.store(scale_row + 2 * blk, (scale_bits & 0xFF).to(tl.uint8), mask=row_mask)
        tl.store(scale_row + 2 * blk + 1, (scale_bits >> 8).to(tl.uint8), mask=row_mask)
    return scale


@triton.jit
def _normalise(x, scale):
    """codec._normalise: y = clamp((x * s) * inv, -1, 1) with inv = 1 / (D * s) per block (one
    division per block, none per coordinate), s = 2**64 below 2**-64, y = 0 where D is 0 or not
    finite."""
    ok = (scale > 0.0) & (scale < float("inf"))
    pre = tl.where(scale < 5.421010862427522e-20, 1.8446744073709552e19, 1.0)  # 2**-64, 2**64
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(ok, scale * pre, 1.0))
    y = tl.where(ok, (x * pre) * inv, 0.0)
    return tl.minimum(tl.maximum(y, -1.0), 1.0)


@triton.jit
def _level_bracket(a, lvl_ptr, WIDTH: tl.constexpr, BINS: tl.constexpr):
    """For magnitudes ``a`` in [0, 1]: ``r``, the number of interior magnitudes m_1..m_{R-1}
    that are <= a, and ``lo, hi = m_r, m_{r+1}``."""
    if WIDTH == 2:  # R = 1: no interior level, m = [0, 1]
        r = tl.full(a.shape, 0, tl.int32)
        lo = tl.full(a.shape, 0.0, tl.float32)
        hi = tl.full(a.shape, 1.0, tl.float32)
    else:
        # One 16-byte row per bin of BINS equal bins of [0, 1] (a * BINS is an exact power-of-two
        # scaling; no bin holds two level boundaries): m_r, m_{r+1}, m_{r+2}, r of the bin's
        # start (see _params.LevelTables.rows), then one compare moves up to m_{r+1} <= a.
        row = lvl_ptr + (a * BINS).to(tl.uint32) * 4  # one address, four immediate offsets
        lv0 = tl.load(row).to(tl.float32, bitcast=True)
        lv1 = tl.load(row + 1).to(tl.float32, bitcast=True)
        lv2 = tl.load(row + 2).to(tl.float32, bitcast=True)
        r = tl.load(row + 3)
        up = lv1 <= a
        r = r + up.to(tl.int32)
        lo = tl.where(up, lv1, lv0)
        hi = tl.where(up, lv2, lv1)
    return r, lo, hi


@triton.jit
def _store_codes(
    codes, out, row_mask, blk, coord, WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr,
    BS: tl.constexpr,
):
    """The ``[Q, G, 4]`` codes packed LSB-first into the records at ``out`` (``[1, G, 1]``
    pointers): code j goes to byte j*b//8 at bit j*b%8 (fields are disjoint: sum == or)."""
    Q: tl.constexpr = BS // 4
    G: tl.constexpr = ROWS * NB
    if 8 % WIDTH == 0:
        # A thread's 4 consecutive codes make 4 // PER_BYTE whole bytes.
        PER_BYTE: tl.constexpr = 8 // WIDTH
        NBYTES4: tl.constexpr = 4 // PER_BYTE  # bytes per 4 codes: 1, 2 or 4
        if PER_BYTE == 1:
            packed = codes
            byte_index = coord
        else:
            grouped = tl.reshape(codes, [Q, G, NBYTES4, PER_BYTE])
            shifts = tl.arange(0, PER_BYTE) * WIDTH
            packed = tl.reduce(grouped << shifts[None, None, None, :], 3, _ADD)  # [Q, G, NBYTES4]
            byte_index = ((blk * BS + tl.arange(0, Q)[:, None, None] * 4) // PER_BYTE
                          + tl.arange(0, NBYTES4)[None, None, :])
        tl.store(out + byte_index, packed.to(tl.uint8), mask=row_mask)
    else:
        # Bitstream (codec._pack_bitstream): each run of 8 codes makes WIDTH bytes. A thread's 4
        # consecutive codes make a 4w-bit field (< 2**28); byte k of a run is bits 8k.. of
        # ``first | second << 4w``, taken from the two 32-bit fields by constant shifts (the
        # bits shifted past 32 are never part of the byte).
        HALF: tl.constexpr = 4 * WIDTH
        shifts = tl.arange(0, 4).to(tl.uint32) * WIDTH
        quad = tl.reduce(codes.to(tl.uint32) << shifts[None, None, :], 2, _ADD)  # [Q, G]
        first, second = tl.split(tl.permute(tl.reshape(quad, [Q // 2, 2, G]), (0, 2, 1)))
        first = first[:, :, None]  # [Q // 2, G, 1]: codes 0-3 of each run
        second = second[:, :, None]  # codes 4-7
        run = out + blk * (BS * WIDTH // 8) + tl.arange(0, Q // 2)[:, None, None] * WIDTH
        for k in tl.static_range(WIDTH):
            if 8 * k <= HALF:
                byte = second << (HALF - 8 * k)
            else:
                byte = second >> (8 * k - HALF)
            if 8 * k < HALF:
                byte = byte | (first >> (8 * k))
            tl.store(run + k, byte.to(tl.uint8), mask=row_mask)


@triton.jit
def _encode_tile(
    x, base, row_mask, blk, coord, out_ptr, out_row, lvl_ptr,
    jitter_key, perm_key, ptab_ptr, inv_n,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    SCALES: tl.constexpr, CORRELATED: tl.constexpr, BINS: tl.constexpr,
):
    """Encode the fp32 ``[Q, G, 4]`` tile ``x`` (see :func:`_tile_coords`) of rows whose first
    coordinates have global indices ``base`` (``[1, G, 1]``) into records at byte offsets
    ``out_row`` (codec._encode_rows): scales, normalised values, the level bracket of each
    magnitude, the stochastic rounding between its ends, the packed codes."""
    TOP: tl.constexpr = (1 << (WIDTH - 1)) - 1  # R
    CODE_NBYTES: tl.constexpr = 32 * WIDTH
    Q: tl.constexpr = BS // 4
    out = out_ptr + out_row  # [1, G, 1]
    scale = _encode_scales(x, row_mask, blk, out + CODE_NBYTES, ROWS, NB, SCALES)
    y = _normalise(x, scale)
    a = tl.abs(y)
    r, lo, hi = _level_bracket(a, lvl_ptr, WIDTH, BINS)
    if BS == 16:  # a scale block is a permutation run: one permutation per block
        first_coord = blk * 16
    else:  # runs of 16 in blocks of 32: [Q, G, 1]
        first_coord = blk * BS + (tl.arange(0, Q)[:, None, None] // 4) * 16
    u = _rounding_uniforms(base, coord, first_coord, jitter_key, perm_key, ptab_ptr, inv_n,
                           CORRELATED)
    level = r + ((a - lo) > u * (hi - lo)).to(tl.int32)  # P(up) = (a - lo) / (hi - lo)
    codes = tl.where(y < 0.0, TOP - level, TOP + level)  # stored as l + R
    _store_codes(codes, out, row_mask, blk, coord, WIDTH, ROWS, NB, BS)


# -- kernels -------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["valid_ptr", "n_rows"])
def _stats_center_kernel(
    x_ptr, x_row_stride, valid_ptr, centred_ptr, mean_ptr, norm2_ptr, n_rows,
    ROWS: tl.constexpr,
):
    """codec.stats_center_torch: tree-sum mean over the valid coordinates, centring (padding
    stays exactly 0), tree-sum squared norm. ``x`` may be fp32, bf16 or fp16."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    coord = tl.arange(0, 256)
    m2 = row_mask[:, None]
    x = _to_fp32(tl.load(x_ptr + rows[:, None] * x_row_stride + coord[None, :], mask=m2, other=0.0))
    valid = tl.load(valid_ptr + rows, mask=row_mask, other=1)
    mean = tl.math.div_rn(_tree_sum_256(x, ROWS), valid.to(tl.float32))
    centred = x - mean[:, None]
    centred = tl.where(coord[None, :] >= valid[:, None], 0.0, centred)
    norm2 = _tree_sum_256(centred * centred, ROWS)  # products rounded before the adds
    tl.store(centred_ptr + rows[:, None] * 256 + coord[None, :], centred, mask=m2)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(norm2_ptr + rows, norm2, mask=row_mask)


@triton.jit(do_not_specialize=["index_ptr", "jitter_key", "perm_key", "n_rows"])
def _encode_kernel(
    x_ptr, x_row_stride, index_ptr, out_ptr, out_row_stride, lvl_ptr,
    jitter_key, perm_key, ptab_ptr, inv_n, n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    SCALES: tl.constexpr, CORRELATED: tl.constexpr,
    BINS: tl.constexpr,
):
    """codec.encode_torch: a leaf compresses its local rows."""
    rows, row_mask, blk, coord = _tile_coords(tl.program_id(0), n_rows, ROWS, NB, BS)
    x = tl.load(x_ptr + rows * x_row_stride + coord, mask=row_mask, other=0.0)
    base = tl.load(index_ptr + rows, mask=row_mask, other=0)
    _encode_tile(
        _to_fp32(x), base, row_mask, blk, coord, out_ptr, rows * out_row_stride,
        lvl_ptr, jitter_key, perm_key, ptab_ptr, inv_n,
        WIDTH, ROWS, NB, BS, SCALES, CORRELATED, BINS,
    )


@triton.jit(do_not_specialize=["n_rows"])
def _decode_kernel(
    rec_ptr, rec_row_stride, table_ptr, out_ptr, n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    SCALES: tl.constexpr,
):
    """codec.decode_torch: records to fp32 rows (all-gather receive)."""
    rows, row_mask, blk, coord = _tile_coords(tl.program_id(0), n_rows, ROWS, NB, BS)
    value = _decode_tile(rec_ptr, rows * rec_row_stride, row_mask, blk, coord, table_ptr,
                         WIDTH, NB, BS, SCALES)
    tl.store(out_ptr + rows * 256 + coord, value, mask=row_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _decode_accumulate_kernel(
    rec_ptr, rec_row_stride, table_ptr, acc_ptr, acc_row_stride, n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    SCALES: tl.constexpr,
):
    """codec.decode_accumulate_torch: ``acc += decode(records)`` in fp32 (non-last child)."""
    rows, row_mask, blk, coord = _tile_coords(tl.program_id(0), n_rows, ROWS, NB, BS)
    acc_at = acc_ptr + rows * acc_row_stride + coord
    acc = tl.load(acc_at, mask=row_mask, other=0.0)
    value = _decode_tile(rec_ptr, rows * rec_row_stride, row_mask, blk, coord, table_ptr,
                         WIDTH, NB, BS, SCALES)
    tl.store(acc_at, acc + value, mask=row_mask)


@triton.jit(do_not_specialize=["index_ptr", "jitter_key", "perm_key", "n_rows"])
def _decode_accumulate_encode_kernel(
    rec_ptr, rec_row_stride, table_ptr, acc_ptr, acc_row_stride, index_ptr,
    out_ptr, out_row_stride, lvl_ptr,
    jitter_key, perm_key, ptab_ptr, inv_n, n_rows,
    WIDTH: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
    SCALES: tl.constexpr, CORRELATED: tl.constexpr,
    BINS: tl.constexpr, WRITE_ACC: tl.constexpr,
):
    """codec.decode_accumulate_encode_torch, fused: the partial sum is encoded from registers;
    it is written back to ``acc`` only with ``WRITE_ACC`` (the executor never reads it again)."""
    rows, row_mask, blk, coord = _tile_coords(tl.program_id(0), n_rows, ROWS, NB, BS)
    acc_at = acc_ptr + rows * acc_row_stride + coord
    acc = tl.load(acc_at, mask=row_mask, other=0.0)
    value = _decode_tile(rec_ptr, rows * rec_row_stride, row_mask, blk, coord, table_ptr,
                         WIDTH, NB, BS, SCALES)
    acc = acc + value
    if WRITE_ACC:
        tl.store(acc_at, acc, mask=row_mask)
    base = tl.load(index_ptr + rows, mask=row_mask, other=0)
    _encode_tile(
        acc, base, row_mask, blk, coord, out_ptr, rows * out_row_stride,
        lvl_ptr, jitter_key, perm_key, ptab_ptr, inv_n,
        WIDTH, ROWS, NB, BS, SCALES, CORRELATED, BINS,
    )


@triton.jit(do_not_specialize=["mean_ptr", "index_ptr", "valid_ptr", "out_ptr", "n_rows"])
def _restore_kernel(
    work_ptr, work_row_stride, mean_ptr, index_ptr, valid_ptr, out_ptr, n_rows,
    ROWS: tl.constexpr,
):
    """Add back each row's summed mean and scatter the row's valid coordinates to their original
    place ``index[i] + j`` of the flat output (any float dtype; the cast rounds to nearest even),
    undoing the reorder and dropping the padding in one pass."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_mask = rows < n_rows
    coord = tl.arange(0, 256)
    m2 = row_mask[:, None]
    work = tl.load(work_ptr + rows[:, None] * work_row_stride + coord[None, :], mask=m2, other=0.0)
    mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
    base = tl.load(index_ptr + rows, mask=row_mask, other=0)
    valid = tl.load(valid_ptr + rows, mask=row_mask, other=0)
    value = work + mean[:, None]
    keep = m2 & (coord[None, :] < valid[:, None])
    tl.store(out_ptr + base[:, None] + coord[None, :], _from_fp32(value, out_ptr.dtype.element_ty),
             mask=keep)
