"""Bit allocations compiled (numba): the paper's closed form
(the lab's ``dqcoll_lab.dynamiq.allocation_paper.allocate_widths_paper``, :func:`allocate`), and
the search of format 3's hull rule with hop widths
(:func:`dqcoll.schemes.dynamiq.allocation.allocate_widths_by_count`, :func:`hull_by_count`:
the same counting by binary searches in the sorted keys as the reference's ``_HullCost``, with
the search on the predicate itself, and the per-class widths in one pass). The paper's, in
detail:

The reference bisects ``u`` with torch ops over the active super-groups (those whose width still
differs between the ends of the bracket). Even compiled, that evaluates ~5 S rows over the
64 halvings, and the torch passes around it (``isposinf``, ``isfinite``, min/max, three width
tables and their costs) cost as much again. Here:

* one pass adjusts ``log2 F`` as the reference does (+inf -> 128, times the energy exponent),
  counts zero and NaN rows and copies the other values out; NumPy sorts them (its vectorised
  sort, many times faster than numba's ``np.sort``);
* every bisection step counts the rows at or above each width threshold with a binary search
  in the sorted values: for a fixed ``u`` the width rule ``fl(fl(c * log_f) + u)`` compared
  with 4, 8 and 16 is monotone in ``log_f`` (``c > 0``; rounding is monotone), so the rows at
  or above a threshold are a suffix of the sorted values. The cost of the widths at ``u`` is
  then exact in integers, with no row evaluated;
* one last pass writes the widths at the ``u`` found.

The midpoints ``0.5 * (u_lo + u_hi)``, the per-row width rule (``v = c * log2 F + u``, two
roundings, no FMA) and the feasibility test are the reference's, so ``u`` and the widths are bit
for bit the reference's (tested). ``log2`` itself stays torch's: a libm ``log2`` may differ from
it in the last bit.
"""

from __future__ import annotations

import numba
import numpy as np

from .cpu_runtime import JIT_OPTIONS

__all__ = ["SEARCHED", "allocate", "bisect", "hull_by_count"]

# What allocate's ``u`` is (the scheme turns it into an Allocation):
NO_FINITE = 0  # no super-group with a finite, non-zero norm: widths do not depend on u (u = nan)
OVER_BUDGET = 1  # even every finite super-group at 2 bits does not fit: u is the cheapest end
RICHEST = 2  # every finite super-group at max_width fits: u is the richest end
SEARCHED = 3  # u is the bisection's answer


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _at_or_above(values, u, slope, threshold):
    """How many of the ascending ``values`` have ``slope * value + u >= threshold`` (a suffix,
    see the module docstring): a binary search for the first one."""
    lo = 0
    hi = values.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if slope * values[mid] + u >= threshold:
            hi = mid
        else:
            lo = mid + 1
    return values.shape[0] - lo


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _cost(values, fixed, costs, u, slope, max_width):
    """Payload bytes of the widths at ``u``: ``fixed`` (zero and NaN rows) plus the sorted
    finite rows, each at 2 bits plus the steps up to 4, 8 (and 16) of those above the
    thresholds."""
    total = fixed + values.shape[0] * costs[2]
    total += _at_or_above(values, u, slope, 4.0) * (costs[4] - costs[2])
    total += _at_or_above(values, u, slope, 8.0) * (costs[8] - costs[4])
    if max_width == 16:
        total += _at_or_above(values, u, slope, 16.0) * (costs[16] - costs[8])
    return total


@numba.njit(**JIT_OPTIONS)
def _split_rows(log_f, zero, exponent, values):
    """In place, as the reference: ``log_f`` +inf -> 128 (a finite input whose squared norm
    overflowed fp32), then times ``exponent`` (when not 1). Copies the rows that are neither zero
    nor NaN into ``values``; returns (how many, zero rows, NaN rows)."""
    m = 0
    zeros = 0
    nans = 0
    scale = exponent != 1.0
    for i in range(log_f.shape[0]):
        lf = log_f[i]
        if lf == np.inf:
            lf = 128.0
        if scale:
            lf = lf * exponent
        log_f[i] = lf
        if zero[i]:
            zeros += 1
        elif lf != lf:
            nans += 1
        else:
            values[m] = lf
            m += 1
    return m, zeros, nans


@numba.njit(**JIT_OPTIONS)
def _search(values, log_f, zero, zeros, nans, costs, limit, u_lo, u_hi, bracket, steps, slope,
            max_width, widths):
    """The reference's allocation over the ascending finite ``values``: with ``bracket``, its
    ends from the values and the cheapest / richest shortcuts first, else ``[u_lo, u_hi]`` as
    given (feasible, infeasible); then ``steps`` halvings. Writes the widths at the answer into
    ``widths``; returns (what u is, u, payload bytes)."""
    fixed = zeros * costs[0] + nans * costs[8]
    status = SEARCHED
    u = 0.0
    m = values.shape[0]
    if bracket:
        # values hold no NaN; -inf cannot arise (a zero norm is zero), but stays out of lo/hi
        first = 0
        while first < m and values[first] == -np.inf:
            first += 1
        if first == m:
            status = NO_FINITE
        else:
            lo_log = values[first]
            hi_log = values[m - 1]
            u_lo = 4.0 - slope * hi_log - 1.0  # every finite super-group at 2 bits
            u_hi = float(max_width) - slope * lo_log  # every finite super-group at max_width
            if _cost(values, fixed, costs, u_lo, slope, max_width) > limit:
                status = OVER_BUDGET
                u = u_lo
            elif _cost(values, fixed, costs, u_hi, slope, max_width) <= limit:
                status = RICHEST
                u = u_hi
    if status == SEARCHED:
        for _ in range(steps):
            mid = 0.5 * (u_lo + u_hi)
            if mid <= u_lo:  # the bracket no longer splits: the reference answers unevaluated
                u_lo = mid
            elif mid >= u_hi:
                u_hi = mid
            elif _cost(values, fixed, costs, mid, slope, max_width) <= limit:
                u_lo = mid
            else:
                u_hi = mid
        u = u_lo
    _write_widths(log_f, zero, u, slope, max_width, widths)
    return status, u, _cost(values, fixed, costs, u, slope, max_width)


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _write_widths(log_f, zero, u, slope, max_width, widths):
    """``widths[i]`` by the paper's rule (allocation_paper._widths_for: 0 for a zero row, 8 for
    NaN, else 2/4/8/16 by ``slope * log_f + u``) without branches: the rows come in
    buffer order, where a branch per threshold mispredicted for ~0.4 ms per 2^16 rows."""
    raw = max_width == 16
    for i in range(log_f.shape[0]):
        lf = log_f[i]
        v = slope * lf + u  # NaN for a NaN row: every comparison below is False
        w = (2 + (2 if v >= 4.0 else 0) + (4 if v >= 8.0 else 0)
             + (8 if raw and v >= 16.0 else 0))
        w = 8 if lf != lf else w
        widths[i] = 0 if zero[i] else w


def allocate(log_f: np.ndarray, zero: np.ndarray, costs: np.ndarray, limit: int,
             steps: int, slope: float, max_width: int, exponent: float,
             widths: np.ndarray) -> tuple[int, float, int]:
    """The allocation for ``log_f = log2 F`` (float64, zero rows any finite value; adjusted in
    place, see :func:`_split_rows`) within ``limit`` payload bytes, row costs ``costs[width]``:
    the widths go into ``widths`` (int64); returns ``(status, u, payload bytes)``, status one of
    :data:`NO_FINITE`, :data:`OVER_BUDGET`, :data:`RICHEST`, :data:`SEARCHED`."""
    values = np.empty(log_f.shape[0], np.float64)
    m, zeros, nans = _split_rows(log_f, zero, float(exponent), values)
    values = np.sort(values[:m])
    status, u, payload = _search(values, log_f, zero, zeros, nans, costs, int(limit), 0.0, 0.0,
                                 True, int(steps), float(slope), int(max_width), widths)
    return int(status), float(u), int(payload)


def bisect(log_f: np.ndarray, zero: np.ndarray, costs: np.ndarray, limit: int, u_lo: float,
           u_hi: float, steps: int, slope: float, max_width: int) -> float:
    """The bisection alone: the largest ``u`` the reference's bisection finds in ``steps``
    halvings of ``[u_lo, u_hi]`` (feasible, infeasible). Compiles (or loads) what
    :func:`allocate` runs, for the argument types it passes (the kernels' warm-up calls this)."""
    log_f = np.array(log_f, np.float64)
    values = np.empty(log_f.shape[0], np.float64)
    m, zeros, nans = _split_rows(log_f, zero, 1.0, values)
    values = np.sort(values[:m])
    widths = np.empty(log_f.shape[0], np.int64)
    _, u, _ = _search(values, log_f, zero, zeros, nans, costs, int(limit), float(u_lo),
                      float(u_hi), False, int(steps), float(slope), int(max_width), widths)
    return float(u)


# -- the hull rule per partial-sum size (allocation.allocate_widths_by_count) ----------------------


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _first_at_or_above(values, shift, u, threshold):
    """The first index of the ascending ``values`` with ``fl(fl(value + shift) + u) >=
    threshold`` (a suffix: both roundings are monotone), by a binary search on that predicate
    itself, so the count is exact where ``value >= threshold - u`` would be off by rounding."""
    lo = 0
    hi = values.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if (values[mid] + shift) + u >= threshold:
            hi = mid
        else:
            lo = mid + 1
    return lo


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _class_bytes(values, shift, u, offsets, hull_bytes, fixed):
    """Payload bytes of one class at ``u``: row ``i`` of the sorted finite ``values`` at width
    ``hull[k]`` for the largest ``k`` with ``fl(fl(values[i] + shift) + u) >= offsets[k]``
    (``offsets[0]`` is -inf: every row), plus ``fixed`` (the NaN rows at the widest width)."""
    m = values.shape[0]
    total = fixed
    start = 0
    for k in range(1, offsets.shape[0]):
        nxt = _first_at_or_above(values, shift, u, offsets[k])
        total += hull_bytes[k - 1] * (nxt - start)
        start = nxt
    total += hull_bytes[offsets.shape[0] - 1] * (m - start)
    return total


@numba.njit(**dict(JIT_OPTIONS, inline="always"))
def _traffic_bytes(values, shifts, taus, u, offsets, hull_bytes, fixed):
    """``sum_c tau_c * float(bytes of class c at u)``, the classes in order, from 0.0 (the
    reference's Python ``sum`` over the classes, the same roundings)."""
    acc = 0.0
    for c in range(shifts.shape[0]):
        acc += taus[c] * float(_class_bytes(values, shifts[c], u, offsets, hull_bytes, fixed))
    return acc


@numba.njit(**JIT_OPTIONS)
def _hull_by_count(values, shifts, taus, offsets, hull_bytes, fixed, stats, budget, u_lo, u_hi,
                   steps):
    """The reference's ``_largest_u_fitting`` over ``fits(u) = traffic(u) + stats <= budget``;
    returns ``(u, over budget, traffic bytes at u)``."""
    over = False
    if not _traffic_bytes(values, shifts, taus, u_lo, offsets, hull_bytes, fixed) + stats \
            <= budget:
        u = u_lo
        over = True
    elif _traffic_bytes(values, shifts, taus, u_hi, offsets, hull_bytes, fixed) + stats \
            <= budget:
        u = u_hi
    else:
        for _ in range(steps):
            mid = 0.5 * (u_lo + u_hi)
            if _traffic_bytes(values, shifts, taus, mid, offsets, hull_bytes, fixed) + stats \
                    <= budget:
                u_lo = mid
            else:
                u_hi = mid
        u = u_lo
    return u, over, _traffic_bytes(values, shifts, taus, u, offsets, hull_bytes, fixed)


@numba.njit(**JIT_OPTIONS)
def _hull_widths(log_f, zero, nan, shifts, u, offsets, hull, top, widths):
    """``widths[c, i]``: the reference's ``_hull_rule`` per class (key ``fl(log_f + shift_c)``,
    unshifted where the shift is 0; ``hull[k]`` for the largest ``k`` with ``fl(key + u) >=
    offsets[k]``; the widest coded width for NaN rows, 0 for zero rows). One pass per threshold
    over a row of keys (a select each, vectorised), not a loop over the thresholds per row
    (~4x faster: 1.15 -> 0.3 ms for 4 classes of 28 k rows)."""
    rows = log_f.shape[0]
    v = np.empty(rows, np.float64)
    for c in range(shifts.shape[0]):
        shift = shifts[c]
        if shift != 0.0:
            for i in range(rows):
                v[i] = (log_f[i] + shift) + u
        else:
            for i in range(rows):
                v[i] = log_f[i] + u
        out = widths[c]
        first = hull[0]
        for i in range(rows):
            out[i] = first
        for k in range(1, offsets.shape[0]):  # increasing k: the largest k that holds wins
            threshold = offsets[k]
            width = hull[k]
            for i in range(rows):
                out[i] = width if v[i] >= threshold else out[i]
        for i in range(rows):
            if nan[i]:
                out[i] = top
            if zero[i]:
                out[i] = 0


def hull_by_count(log_f: np.ndarray, zero: np.ndarray, nan: np.ndarray, shifts: np.ndarray,
                  taus: np.ndarray, hull: np.ndarray, offsets: np.ndarray, costs: np.ndarray,
                  top: int, stats: int, budget: int, u_lo: float, u_hi: float, steps: int,
                  widths: np.ndarray) -> tuple[float, bool, float]:
    """:func:`dqcoll.schemes.dynamiq.allocation.allocate_widths_by_count`'s search, compiled:
    the largest ``u`` in ``steps`` halvings of ``[u_lo, u_hi]`` whose traffic-weighted payload
    (``sum_c taus[c] * bytes_c``) plus ``stats`` fits ``budget``, each class's bytes counted by
    binary searches in the sorted finite keys (no row evaluated); the per-class widths at that
    ``u`` go into ``widths`` (int64 ``[classes, rows]``). ``log_f`` (float64, tie-broken),
    ``zero`` and ``nan`` are the reference's ``_Rows``; ``offsets[0]`` is -inf. Returns ``(u,
    over budget, traffic-weighted payload bytes at u)``, bit for bit the reference's."""
    live = ~zero & ~nan
    values = np.sort(log_f[live])  # the values only: ties sort alike whatever the algorithm
    fixed = int(np.count_nonzero(nan & ~zero)) * int(costs[top])
    hull_bytes = costs[hull].astype(np.int64)
    u, over, traffic = _hull_by_count(values, shifts, taus, offsets, hull_bytes, fixed,
                                      int(stats), int(budget), float(u_lo), float(u_hi),
                                      int(steps))
    _hull_widths(log_f, zero, nan, shifts, float(u), offsets, hull.astype(np.int64), int(top),
                 widths)
    return float(u), bool(over), float(traffic)
