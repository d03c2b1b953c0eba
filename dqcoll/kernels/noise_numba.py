"""Counter-based normal noise: N(0, 1) values addressed by (key, super-group, coordinate).

The ``lognormal-mixture`` gradient source (:mod:`dqcoll.topology.sources`) draws every coordinate
of every rank from here, so that any slice of any rank's gradient can be produced on its own,
in any order, with the same bytes: the simulator generates each worker's rows when a step needs
them (:mod:`dqcoll.topology.simulator`) instead of holding ``n x numel`` values, and pass 1
(statistics, exact sum) and pass 2 (the collective) see identical values.

Definition (all arithmetic mod 2**64):

* ``fmix(z)``: the splitmix64 finaliser ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
  z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31``; ``GAMMA = 0x9E3779B97F4A7C15``;
* a *stream key* ``K`` per rank (the source derives it from (seed, rank) by
  :func:`dqcoll.schemes.seeds.derived_seed`); super-group ``s`` (256 coordinates) has the row key
  ``R = fmix(K ^ fmix((s + 1) * GAMMA))``;
* draw ``a`` of coordinate ``j`` (0..255) of that super-group is the 64-bit word
  ``fmix(R + (256 a + j + 1) * GAMMA)`` (splitmix64's output ``256 a + j + 1`` of the seed
  ``R``);
* the normal value is the 256-layer ziggurat of Marsaglia and Tsang (2000) on those words, as
  NumPy's ``standard_normal`` runs it on its bit generator's: word 0 gives the layer (low 8
  bits), the sign (bit 8) and a 52-bit magnitude; a rejection (about 1.2 % of draws) takes the
  next words ``a = 1, 2, ...`` of the same coordinate, so each coordinate's value depends on its
  own words only. The tables are computed at import from the layer count, ``r`` and the layer
  area (:func:`ziggurat_tables`).

Cost: the fast path is one hash, one table lookup and one compare per coordinate, an order of
magnitude less than Box-Muller (a log, a square root and a sine/cosine per pair) and a few times
less than a rational inverse CDF.

Rejected: ``torch.Generator`` streams per rank (the source's first version: a Mersenne Twister
cannot jump to a super-group, so a slice of a rank's gradient cost the whole gradient) and
Philox with NumPy's ``advance`` (a generator object per slice: ~10 us each, 7e7 slices at
n = 8192).

Without numba (:func:`~dqcoll.kernels.cpu_runtime.numba_available`), :func:`fill_numpy` computes
the same words and the same fast path in NumPy; its slow path (exp, log1p of NumPy rather than
the C library's) may differ in the last bit of a rare tail value.
"""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["GAMMA", "fill", "fill_numpy", "ziggurat_tables"]

GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1
LAYERS = 256
ZIGGURAT_R = 3.6541528853610088  # where the base layer's tail starts (NumPy's ziggurat_nor_r)
ZIGGURAT_V = 0.00492867323399  # the area of each layer
SUPER = 256  # coordinates per super-group (one row key)


@functools.lru_cache(maxsize=1)
def ziggurat_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ki, wi, fi)``: per layer the uint64 bound of the fast path on the 52-bit magnitude, the
    scale from magnitude to value, and the density at the layer's edge (Marsaglia and Tsang's
    ``zigset`` for 256 layers and 52-bit magnitudes, as NumPy's tables)."""
    m1 = 2.0**52
    ki = np.zeros(LAYERS, np.uint64)
    wi = np.zeros(LAYERS, np.float64)
    fi = np.zeros(LAYERS, np.float64)
    dn = tn = ZIGGURAT_R
    q = ZIGGURAT_V / math.exp(-0.5 * dn * dn)
    ki[0] = int(dn / q * m1)
    ki[1] = 0
    wi[0] = q / m1
    wi[LAYERS - 1] = dn / m1
    fi[0] = 1.0
    fi[LAYERS - 1] = math.exp(-0.5 * dn * dn)
    for i in range(LAYERS - 2, 0, -1):
        dn = math.sqrt(-2.0 * math.log(ZIGGURAT_V / dn + math.exp(-0.5 * dn * dn)))
        ki[i + 1] = int(dn / tn * m1)
        tn = dn
        fi[i] = math.exp(-0.5 * dn * dn)
        wi[i] = dn / m1
    for table in (ki, wi, fi):
        table.setflags(write=False)
    return ki, wi, fi


# -- NumPy (the fallback, and the definition written out) ----------------------------------------


def _fmix_np(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(_M1)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(_M2)
    return z ^ (z >> np.uint64(31))


def _row_keys_np(keys: np.ndarray, groups: np.ndarray) -> np.ndarray:
    return _fmix_np(keys ^ _fmix_np((groups.astype(np.uint64) + np.uint64(1)) * np.uint64(GAMMA)))


def _normals_np(row_key: np.ndarray, j: np.ndarray) -> np.ndarray:
    """Ziggurat normals of coordinates ``j`` (0..255) under row keys ``row_key`` (same shape)."""
    ki, wi, fi = ziggurat_tables()
    out = np.empty(row_key.shape, np.float64)
    todo = np.arange(row_key.size)
    rk, jj = row_key.reshape(-1), j.reshape(-1).astype(np.uint64)
    flat = out.reshape(-1)
    attempt = np.zeros(rk.size, np.uint64)
    with np.errstate(over="ignore"):
        while todo.size:
            word = _fmix_np(rk[todo] + (attempt[todo] * np.uint64(SUPER) + jj[todo]
                                        + np.uint64(1)) * np.uint64(GAMMA))
            attempt[todo] += np.uint64(1)
            idx = (word & np.uint64(0xFF)).astype(np.int64)
            r = word >> np.uint64(8)
            sign = (r & np.uint64(1)).astype(bool)
            rabs = (r >> np.uint64(1)) & np.uint64(0x000FFFFFFFFFFFFF)
            x = rabs.astype(np.float64) * wi[idx]
            x = np.where(sign, -x, x)
            done = rabs < ki[idx]
            rest = ~done
            for pos in np.flatnonzero(rest):  # rare: the scalar slow path, draw by draw
                k = todo[pos]
                value = _slow_path_np(rk[k], jj[k], attempt, k, int(idx[pos]), float(x[pos]),
                                      int(rabs[pos]), fi)
                if value is not None:
                    flat[k] = value
                    done[pos] = True
            flat[todo[done & ~rest]] = x[done & ~rest]
            todo = todo[~done]
    return out


def _next_double_np(rk: np.uint64, j: np.uint64, attempt: np.ndarray, k: int) -> float:
    word = _fmix_np(np.array([rk + (attempt[k] * np.uint64(SUPER) + j + np.uint64(1))
                              * np.uint64(GAMMA)], np.uint64))[0]
    attempt[k] += np.uint64(1)
    return float(word >> np.uint64(11)) * (1.0 / 9007199254740992.0)


def _slow_path_np(rk, j, attempt, k, idx, x, rabs, fi):  # type: ignore[no-untyped-def]
    """The ziggurat's rare branch for one coordinate: the tail of layer 0, or the wedge test;
    None means rejected (the caller draws again)."""
    if idx == 0:
        while True:
            xx = -(1.0 / ZIGGURAT_R) * np.log1p(-_next_double_np(rk, j, attempt, k))
            yy = -np.log1p(-_next_double_np(rk, j, attempt, k))
            if yy + yy > xx * xx:
                return -(ZIGGURAT_R + xx) if (rabs >> 8) & 1 else ZIGGURAT_R + xx
    u = _next_double_np(rk, j, attempt, k)
    if (fi[idx - 1] - fi[idx]) * u + fi[idx] < np.exp(-0.5 * x * x):
        return x
    return None


def fill_numpy(keys: np.ndarray, starts: np.ndarray, numel: int, scale: np.ndarray,
               out: np.ndarray) -> None:
    """:func:`fill` in NumPy (see the module docstring for where it may differ)."""
    length = out.shape[1]
    g = starts.astype(np.int64)[:, None] + np.arange(length, dtype=np.int64)[None, :]
    inside = g < numel
    gi = np.where(inside, g, 0)
    groups = gi >> 8
    row_key = _row_keys_np(np.broadcast_to(keys.astype(np.uint64)[:, None], g.shape), groups)
    z = _normals_np(row_key, gi & 255)
    out[...] = np.where(inside, (z * scale[groups]).astype(np.float32), np.float32(0.0))


@functools.lru_cache(maxsize=1)
def _kernel():  # type: ignore[no-untyped-def]
    from .cpu_runtime import numba_available

    if numba_available() is not None:
        return None
    from . import _noise_numba_kernels as K

    return K.fill_rows


def fill(keys: np.ndarray, starts: np.ndarray, numel: int, scale: np.ndarray,
         out: np.ndarray, *, threads: int | None = None) -> None:
    """``out[i, t]`` = coordinate ``starts[i] + t`` of the stream ``keys[i]``: the normal value of
    the module docstring times ``scale`` of its super-group (fp64 product, rounded once to
    fp32), 0 past ``numel``. ``keys`` uint64 ``[k]``, ``starts`` int64 ``[k]`` (any
    coordinate), ``scale`` fp64 ``[ceil(numel / 256)]``, ``out`` fp32 ``[k, L]`` C-contiguous."""
    keys = np.ascontiguousarray(keys, dtype=np.uint64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    scale = np.ascontiguousarray(scale, dtype=np.float64)
    if out.dtype != np.float32 or out.ndim != 2 or not out.flags.c_contiguous:
        raise ValueError(f"out: expected C-contiguous fp32 [k, L], got {out.dtype} {out.shape}")
    if keys.shape != (out.shape[0],) or starts.shape != (out.shape[0],):
        raise ValueError(f"keys and starts: expected [{out.shape[0]}], got {keys.shape} and "
                         f"{starts.shape}")
    if starts.size and starts.min() < 0:
        raise ValueError("starts must be >= 0")
    kernel = _kernel()
    if kernel is None:
        fill_numpy(keys, starts, numel, scale, out)
        return
    from .cpu_runtime import run_rows

    ki, wi, fi = ziggurat_tables()
    rows = out.shape[0]
    if out.shape[1] >= 4 * SUPER:  # long rows (whole tensors): split the coordinates instead
        _fill_long(kernel, keys, starts, numel, scale, out, ki, wi, fi, threads)
        return
    run_rows(kernel, rows, keys, starts, np.int64(numel), scale, out, ki, wi, fi,
             threads=threads)


def _fill_long(kernel, keys, starts, numel, scale, out, ki, wi, fi, threads):  # type: ignore[no-untyped-def]
    """One or a few long rows: cut each into pieces of whole super-groups (the values do not
    depend on the cut) so that the row split of ``run_rows`` has rows to share out."""
    from .cpu_runtime import run_rows

    length = out.shape[1]
    piece = 64 * SUPER
    for i in range(out.shape[0]):
        pieces = -(-length // piece)
        pad = np.zeros((pieces, piece), np.float32)
        pstarts = starts[i] + np.arange(pieces, dtype=np.int64) * piece
        run_rows(kernel, pieces, np.full(pieces, keys[i], np.uint64), pstarts, np.int64(numel),
                 scale, pad, ki, wi, fi, threads=threads)
        out[i] = pad.reshape(-1)[:length]
