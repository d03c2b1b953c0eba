"""Compiled kernels of the simulator (:mod:`.simulate_numba`): DynamiQ encodes whose rows
belong to different ranks.

The executor encodes one rank's rows per launch (:mod:`._dynamiq_numba_kernels`), so its kernels
take that rank's jitter key and permutation column as scalars. The simulator encodes the rows of
a whole step of a schedule at once - at n = 8192 on a ring, 8192 rows of 8192 different ranks -
so these entry points take, per row, the index of its rank into a table of every rank's jitter
key and permutation column. The row bodies are the executor kernels' (imported from there:
scales, level search, packing), so the bytes are theirs; the format-3 row loop is
:func:`._dynamiq_numba_kernels._q_rows` with the two per-rank values read per row (kept in step
with it by ``tests/test_topology_simulator.py``, which compares the simulator with the ``local``
transport bit for bit).

(numba's disk cache checks this file only: after an edit of ``_dynamiq_numba_kernels.py`` clear
``__pycache__`` or touch this file.)
"""

from __future__ import annotations

import numba
import numpy as np

from . import _dynamiq_numba_kernels as K
from .cpu_runtime import JIT_OPTIONS

SUPER, GROUP, GROUPS, H4_BLOCKS = K.SUPER, K.GROUP, K.GROUPS, K.H4_BLOCKS
_F0, _F1, _FM1 = K._F0, K._F1, K._FM1
_TWO_M24, _SEL_SHIFT = K._TWO_M24, K._SEL_SHIFT
_inline = dict(JIT_OPTIONS, inline="always")


@numba.njit(**_inline)
def _q_ranked_rows(lo, hi, x, index_base, ranks, out, width, mags, nxt, rtab, bins,
                   jitter_keys, perm_key, ptabs, inv_n, correlated):
    """:func:`._dynamiq_numba_kernels._q_rows` (encode only), row ``i`` with the jitter key
    ``jitter_keys[ranks[i]]`` and the permutation column ``ptabs[ranks[i]]``."""
    K._prefer_wide_vectors()
    (t, f32, u32, bs, sa, sb, d, p, u, pv, codes, av, rv) = K._q_scratch()
    ext = K._window_table(mags)
    window = (ext[1], ext[2], ext[3], ext[4], ext[5], ext[6], ext[7], ext[8],
              ext[9], ext[10], ext[11], ext[12], ext[13], ext[14], ext[15], ext[16],
              ext[17], ext[18], ext[19], ext[20], ext[21], ext[22], ext[23], ext[24],
              ext[25], ext[26], ext[27], ext[28], ext[29], ext[30], ext[31], ext[32])
    top = (1 << (width - 1)) - 1  # R
    xb = x.view(np.uint32)
    tf = t.view(np.float32)
    for i in range(lo, hi):
        rank = ranks[i]
        jitter_key = jitter_keys[rank]
        tiny, unit_bits = K._q_scales(xb, i, t, tf, f32, u32, bs)
        K._dup(bs, sa, 8)
        K._dup(sa, sb, 16)
        K._dup(sb, sa, 32)
        K._dup(sa, sb, 64)
        K._dup(sb, d, 128)
        if tiny:
            for b in range(H4_BLOCKS):
                sb[b] = bs[H4_BLOCKS + b]
            K._dup(sb, sa, 8)
            K._dup(sa, sb, 16)
            K._dup(sb, sa, 32)
            K._dup(sa, sb, 64)
            K._dup(sb, pv, 128)
            for j in range(SUPER):
                p[j] = x[i, j] * pv[j]
        else:
            for j in range(SUPER):
                p[j] = x[i, j]
        base = index_base[i]
        lo32 = K._lo32(base)
        jrow = K._row_key(jitter_key, base)
        jend = K._row_key(jitter_key, base + SUPER - 1)
        if correlated:
            prow = K._row_key(perm_key, base)
            pend = K._row_key(perm_key, base + SUPER - 1)
            for g in range(GROUPS):
                f_lo = np.uint32(lo32 + np.uint32(g * GROUP))
                k = pend if f_lo < lo32 else prow
                sel = np.int32(K._mix32(np.uint32(k ^ f_lo)) >> _SEL_SHIFT)
                sa[g] = np.float32(ptabs[rank, sel])
            K._dup(sa, sb, 16)
            K._dup(sb, sa, 32)
            K._dup(sa, sb, 64)
            K._dup(sb, pv, 128)
            for j in range(SUPER):
                g_lo = np.uint32(lo32 + np.uint32(j))
                k = jend if g_lo < lo32 else jrow
                gamma = np.float32(K._mix32(np.uint32(k ^ g_lo)) >> np.uint32(8)) * _TWO_M24
                u[j] = (pv[j] + gamma) * inv_n
        else:
            for j in range(SUPER):
                g_lo = np.uint32(lo32 + np.uint32(j))
                k = jend if g_lo < lo32 else jrow
                u[j] = np.float32(K._mix32(np.uint32(k ^ g_lo)) >> np.uint32(8)) * _TWO_M24
        if width <= 6:
            for j in range(SUPER):
                inv = d[j]
                q = p[j] * inv
                y = min(max(q if inv > _F0 else _F0, _FM1), _F1)
                a = abs(y)
                r, m_lo, m_hi = K._window_level(a, window, width)
                level = r + (1 if (a - m_lo) > u[j] * (m_hi - m_lo) else 0)
                codes[j] = np.uint8(top - level if y < _F0 else top + level)
        else:
            K._q_levels_table(p, d, u, codes, width, mags, nxt, rtab, bins, av, rv, sa, sb)
        K._q_store_record(out, i, codes, width, bs, unit_bits)


@numba.njit(**_inline)
def _generic_ranked_rows(lo, hi, x, index_base, ranks, out, width, scales, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated):
    """The generic row codec (hierarchical uint8 and flat scales) with per-row ranks."""
    x_bits = x.view(np.uint32)
    scratch = K._encode_scratch()
    for i in range(lo, hi):
        rank = ranks[i]
        K._encode_row(x[i], x_bits[i], index_base[i], out[i], width, scales, mags, nxt, rtab,
                      bins, jitter_keys[rank], perm_key, ptabs[rank], inv_n, correlated,
                      scratch, True)


# -- entry points, one per (width, scales): see _dynamiq_numba_kernels on why literals --------

@numba.njit(**JIT_OPTIONS)
def encode_ranked_w2q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 2, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w3q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 3, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w4q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 4, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w5q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 5, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w6q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 6, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w7q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 7, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w8q(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _q_ranked_rows(lo, hi, x, index_base, ranks, out, 8, mags, nxt, rtab, bins, jitter_keys,
                   perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w2h(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 2, K.SCALES_H, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w4h(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 4, K.SCALES_H, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w8h(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 8, K.SCALES_H, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w2f(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 2, K.SCALES_FLAT, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w4f(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 4, K.SCALES_FLAT, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)


@numba.njit(**JIT_OPTIONS)
def encode_ranked_w8f(lo, hi, x, index_base, ranks, out, mags, nxt, rtab, bins, jitter_keys,
                      perm_key, ptabs, inv_n, correlated):
    _generic_ranked_rows(lo, hi, x, index_base, ranks, out, 8, K.SCALES_FLAT, mags, nxt, rtab,
                         bins, jitter_keys, perm_key, ptabs, inv_n, correlated)
