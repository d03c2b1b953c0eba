"""The bisection of :func:`dqcoll.schemes.dynamiq.allocation.allocate_widths`, compiled (numba).

The reference runs ~64 halvings of torch ops on shrinking tensors of active super-groups: ~11 ms
per call at 2^16 super-groups (2^24 coordinates) on the 2-core dev VM, ~10 % of a rank's CPU time
in a 4-rank 64 MiB all-reduce once the codec is compiled. This is the same bisection in one
compiled loop: the same float64 midpoints ``0.5 * (u_lo + u_hi)``, the same per-row width rule
(``v = C * log2 F + u`` compared with 4, 8 and 16, two roundings, no FMA) and the same
feasibility test, so ``u`` and the widths are bit for bit the reference's (tested).
"""

from __future__ import annotations

import numba
import numpy as np

from .cpu_runtime import JIT_OPTIONS

__all__ = ["bisect"]


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _width(log_f, zero, u, slope, max_width):
    """allocation._width_of: 0 for a zero row, 8 for NaN, else 2/4/8/16 by ``slope*log_f + u``."""
    if zero:
        return 0
    if log_f != log_f:
        return 8
    v = slope * log_f + u
    if max_width == 16 and v >= 16.0:
        return 16
    if v >= 8.0:
        return 8
    if v >= 4.0:
        return 4
    return 2


@numba.njit(**JIT_OPTIONS)
def bisect(log_f, zero, costs, limit, u_lo, u_hi, steps, slope, max_width):
    """The largest ``u`` the reference's bisection finds: ``steps`` halvings of ``[u_lo, u_hi]``
    (feasible, infeasible), each keeping the half whose low end fits ``limit`` payload bytes.
    Rows whose width is equal at both ends of the bracket are settled and leave the loop."""
    rows = log_f.shape[0]
    active = np.empty(rows, np.int64)
    w_lo = np.empty(rows, np.int64)
    w_hi = np.empty(rows, np.int64)
    widths = np.empty(rows, np.int64)
    m = 0
    base = 0
    for i in range(rows):
        a = _width(log_f[i], zero[i], u_lo, slope, max_width)
        b = _width(log_f[i], zero[i], u_hi, slope, max_width)
        if a == b:
            base += costs[a]
        else:
            active[m] = i
            w_lo[m] = a
            w_hi[m] = b
            m += 1
    for _ in range(steps):
        mid = 0.5 * (u_lo + u_hi)
        if not (u_lo < mid < u_hi):  # the bracket no longer splits: every later step agrees
            if mid <= u_lo:
                u_lo = mid  # a feasible answer, as the reference's
            else:
                u_hi = mid
            continue
        total = base
        for k in range(m):
            i = active[k]
            widths[k] = _width(log_f[i], zero[i], mid, slope, max_width)
            total += costs[widths[k]]
        ok = total <= limit
        kept = 0
        for k in range(m):
            w = widths[k]
            if w == (w_hi[k] if ok else w_lo[k]):
                base += costs[w]  # equal at both ends of the new bracket: settled
            else:
                active[kept] = active[k]
                w_lo[kept] = w if ok else w_lo[k]
                w_hi[kept] = w_hi[k] if ok else w
                kept += 1
        m = kept
        if ok:
            u_lo = mid
        else:
            u_hi = mid
    return u_lo
