"""The compiled kernel of :mod:`.noise_numba` (imported only where numba is usable): the
counter-based ziggurat normals, written as that module's docstring defines them."""

from __future__ import annotations

import numba
import numpy as np

from .cpu_runtime import JIT_OPTIONS

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)
_MASK52 = np.uint64(0x000FFFFFFFFFFFFF)
_R = 3.6541528853610088  # noise_numba.ZIGGURAT_R
_INV_R = 1.0 / _R
_TO_UNIT = 1.0 / 9007199254740992.0  # 2**-53
SUPER = 256


@numba.njit(**JIT_OPTIONS)
def _fmix(z):  # type: ignore[no-untyped-def]
    """The splitmix64 finaliser (uint64 arithmetic wraps)."""
    z = np.uint64(z ^ (z >> np.uint64(30)))
    z = np.uint64(z * _M1)
    z = np.uint64(z ^ (z >> np.uint64(27)))
    z = np.uint64(z * _M2)
    return np.uint64(z ^ (z >> np.uint64(31)))


@numba.njit(**JIT_OPTIONS)
def _word(rk, j, a):  # type: ignore[no-untyped-def]
    """Draw ``a`` of coordinate ``j`` under the row key ``rk``."""
    return _fmix(np.uint64(rk + np.uint64(np.uint64(a * SUPER + j) + _ONE) * _GAMMA))


@numba.njit(**JIT_OPTIONS)
def _unit(w):  # type: ignore[no-untyped-def]
    return np.float64(w >> np.uint64(11)) * _TO_UNIT


@numba.njit(**JIT_OPTIONS)
def _normal(rk, j, ki, wi, fi):  # type: ignore[no-untyped-def]
    """The ziggurat (NumPy's ``random_standard_normal``) on the words of one coordinate."""
    a = 0
    while True:
        w = _word(rk, j, a)
        a += 1
        idx = np.int64(w & np.uint64(0xFF))
        r = np.uint64(w >> np.uint64(8))
        rabs = np.uint64((r >> _ONE) & _MASK52)
        x = np.float64(rabs) * wi[idx]
        if r & _ONE:
            x = -x
        if rabs < ki[idx]:
            return x
        if idx == 0:  # the tail beyond r (Marsaglia's method)
            while True:
                u1 = _unit(_word(rk, j, a))
                u2 = _unit(_word(rk, j, a + 1))
                a += 2
                xx = -_INV_R * np.log1p(-u1)
                yy = -np.log1p(-u2)
                if yy + yy > xx * xx:
                    return -(_R + xx) if (rabs >> np.uint64(8)) & _ONE else _R + xx
        else:  # the wedge between the layer's rectangle and the density
            u = _unit(_word(rk, j, a))
            a += 1
            if (fi[idx - 1] - fi[idx]) * u + fi[idx] < np.exp(-0.5 * x * x):
                return x


@numba.njit(**JIT_OPTIONS)
def _slow(rk, j, ki, wi, fi):  # type: ignore[no-untyped-def]
    """:func:`_normal` for a coordinate whose first draw missed the fast path."""
    return _normal(rk, j, ki, wi, fi)


@numba.njit(**JIT_OPTIONS)
def fill_rows(lo, hi, keys, starts, numel, scale, out, ki, wi, fi):  # type: ignore[no-untyped-def]
    """Rows ``[lo, hi)`` of :func:`.noise_numba.fill`."""
    length = out.shape[1]
    for i in range(lo, hi):
        key = np.uint64(keys[i])
        t = 0
        while t < length:
            g = starts[i] + t
            if g >= numel:
                for k in range(t, length):
                    out[i, k] = np.float32(0.0)
                break
            group = g >> 8
            j0 = g & 255
            seg = min(length - t, SUPER - j0, numel - g)
            rk = _fmix(np.uint64(key ^ _fmix(np.uint64(np.uint64(group) + _ONE) * _GAMMA)))
            s = scale[group]
            # the first draw of every coordinate in one branch-free loop (it vectorises); the
            # ~1.2 % that miss the fast path redo it in full
            miss = False
            for k in range(seg):
                w = _word(rk, j0 + k, 0)
                idx = np.int64(w & np.uint64(0xFF))
                r = np.uint64(w >> np.uint64(8))
                rabs = np.uint64((r >> _ONE) & _MASK52)
                x = np.float64(rabs) * wi[idx]
                x = -x if r & _ONE else x
                hit = rabs < ki[idx]
                miss |= not hit
                out[i, t + k] = np.float32(x * s) if hit else np.float32(np.nan)
            if miss:
                for k in range(seg):
                    if out[i, t + k] != out[i, t + k]:
                        out[i, t + k] = np.float32(_slow(rk, j0 + k, ki, wi, fi) * s)
            t += seg
