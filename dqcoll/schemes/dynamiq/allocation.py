"""Budgeted bit allocation: one width per super-group from the all-reduced statistics.

Equal marginal gain per bit gives thresholds on the summed squared norm ``F`` of a super-group with
fixed ratios, ``T(2->4) = 17/512 * T(4->8)``, so the width has a closed form with one free scalar
``u``:

    width = 2 ** clamp(floor(log2(c * log2 F + u)), 1, 3),   c = 4 / log2(512 / 17)

i.e. ``v = c * log2 F + u`` gives 2 bits below 4, 4 bits in [4, 8) and 8 bits from 8 on; we compare
``v`` with 4 and 8 directly, which is the same thing without a second logarithm. ``u`` is found by
bisection (float64, a fixed number of halvings) as the largest value whose total wire cost
(records + statistics) fits ``bits * numel / 8`` bytes. Super-groups whose summed norm is exactly
zero are zero on every rank after centring and get width 0 (no record). The allocation depends only
on all-reduced values, so every rank computes the same widths without communication.

The bisection evaluates the cost only where it can change: widths grow monotonically with ``u``,
so between a known-feasible and a known-infeasible ``u`` only the super-groups whose widths differ
at the two ends (the *active* ones) need evaluating, and their number shrinks with every halving
(about ``2 S`` row evaluations in all instead of ``64 S``). A hint ``u_hint`` (e.g. the previous
step's ``u``) brackets the answer first; the halvings from the initial bracket are then replayed
with decisions outside the known bracket taken for free. The sequence of midpoints and decisions
is the one of a plain bisection either way, so ``u`` and the widths are bit for bit the same with
or without a hint. Where the CPU kernels are numba's, :mod:`dqcoll.kernels.allocation_numba` runs
the same halvings on costs counted in the sorted norms (~0.5 ms per call at 2^16 super-groups,
where these torch ops took ~5 ms), bit for bit the same.

Non-finite ``F`` (an Inf/NaN input, or a norm that overflowed fp32) gets 8 bits; NaN values then
flow through the records to every rank's output.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from .codec import (
    RAW_WIDTH,
    SUPER,
    WIDTHS,
    Levels,
    ProtoScales,
    Scales,
    Widths,
    record_nbytes,
)
from .error_model import EPSILON, predicted_vnmse

__all__ = [
    "C_SLOPE",
    "STATS_BYTES_PER_SUPER",
    "Allocation",
    "allocate_for_target",
    "allocate_widths",
    "min_bits",
]

C_SLOPE = 4.0 / math.log2(512.0 / 17.0)
# statistics bytes per super-group, by the scheme's ``stats`` option
STATS_BYTES = {"fp32": 8, "bf16": 4, "norm16": 2}
STATS_BYTES_PER_SUPER = STATS_BYTES["norm16"]  # the default: the bf16 squared norm
_BISECTION_STEPS = 64

# Single-quantization vNMSE of i.i.d. N(0, 1) per width (groups of 16; 8192 super-groups,
# measured with the reference codec; docs/dense_gap.md). ``thresholds="measured"`` puts the
# width thresholds where these give equal marginal gain per byte.
# Keyed by (levels, scales), either of which may be a prototype enum (ProtoLevels, ProtoScales).
MEASURED_ERRORS: dict[tuple[enum.Enum, enum.Enum], dict[int, float]] = {
    (Levels.NONUNIFORM, Scales.HIERARCHICAL): {
        2: 0.7032, 3: 0.07086, 4: 0.01324, 5: 0.00286, 6: 6.856e-4, 7: 1.723e-4, 8: 7.895e-5,
        16: 4.141e-8},
    (Levels.TUNED, Scales.HIERARCHICAL): EPSILON[(Levels.TUNED, Scales.HIERARCHICAL)],
    (Levels.TUNED, ProtoScales.HIERARCHICAL4): {
        2: 0.7693, 3: 0.0795, 4: 0.01517, 5: 0.003345, 6: 7.794e-4, 7: 1.891e-4, 8: 4.719e-5,
        16: 4.141e-8},
    (Levels.TUNED, Scales.HIERARCHICAL4X32): EPSILON[(Levels.TUNED, Scales.HIERARCHICAL4X32)],
    (Levels.NONUNIFORM, ProtoScales.HIERARCHICAL4): {
        2: 0.7693, 3: 0.0795, 4: 0.01532, 5: 0.003345, 6: 7.794e-4, 7: 1.891e-4, 8: 8.705e-5,
        16: 4.141e-8},
}


def hull_offsets(
    widths: tuple[int, ...], errors: dict[int, float], scales: Scales
) -> tuple[list[int], list[float]]:
    """Widths on the lower convex hull of (record bytes, error) and their thresholds.

    A super-group of summed norm ``F`` costs ``F * e_w`` error at ``B_w`` bytes; minimising the
    total error under a byte budget (Lagrange multiplier ``2**-u``) gives width ``w_i`` of the
    hull from ``log2 F + u >= o_i`` on, ``o_i = log2((B_i - B_{i-1}) / (e_{i-1} - e_i))``
    (increasing along the hull). The paper's rule is this with ``e_w = 4**-w`` and W = {2, 4, 8}:
    ``o_8 - o_4 = log2(512 / 17)``."""
    pts = sorted((record_nbytes(w, scales), errors[w], w) for w in widths)
    hull: list[tuple[int, float, int]] = []
    for p in pts:
        if hull and p[1] >= hull[-1][1]:
            continue  # costs more, no better
        while len(hull) >= 2:
            (b1, e1, _), (b2, e2, _) = hull[-2], hull[-1]
            # drop the middle point when it lies on or above the chord from hull[-2] to p
            if (e2 - e1) * (p[0] - b1) >= (p[1] - e1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(p)
    offsets = [-math.inf]
    for (b1, e1, _), (b2, e2, _) in itertools.pairwise(hull):
        offsets.append(math.log2((b2 - b1) / (e1 - e2)))
    return [w for _, _, w in hull], offsets


@dataclasses.dataclass(frozen=True)
class Allocation:
    widths: torch.Tensor  # int64 [S] in {0, 2, 4, 8}
    u: float  # the allocation parameter found (nan when not searched)
    payload_nbytes: int  # sum of record sizes
    stats_nbytes: int
    budget_nbytes: int
    over_budget: bool  # even the cheapest allocation did not fit (tiny buffers)
    predicted_vnmse: float = float("nan")  # target mode: the error model's prediction
    target_met: bool | None = None  # target mode: False when even 8 bits everywhere falls short
    kernel: str = "torch"  # the implementation that computed it: "numba" (compiled) or "torch"

    @property
    def total_nbytes(self) -> int:
        return self.payload_nbytes + self.stats_nbytes


def min_bits(scales: Scales = Scales.HIERARCHICAL4X32,
             stats_bytes: int = STATS_BYTES_PER_SUPER) -> float:
    """The smallest budget that can hold every super-group at 2 bits, per coordinate."""
    return (record_nbytes(2, scales) + stats_bytes) * 8.0 / SUPER


def _widths_for(
    log_f: torch.Tensor, zero: torch.Tensor, u: float, max_width: int = 8
) -> torch.Tensor:
    v = C_SLOPE * log_f + u
    widths = torch.where(v >= 8.0, 8, torch.where(v >= 4.0, 4, 2))  # NaN v -> 2, fixed below
    if max_width == RAW_WIDTH:
        widths = torch.where(v >= 16.0, RAW_WIDTH, widths)
    widths = torch.where(torch.isnan(log_f), 8, widths)
    return torch.where(zero, 0, widths)


def _width_of(log_f: float, zero: bool, u: float, max_width: int = 8) -> int:
    """:func:`_widths_for` of one row, in Python floats (bit-identical decisions)."""
    if zero:
        return 0
    if math.isnan(log_f):
        return 8
    v = C_SLOPE * log_f + u
    if max_width == RAW_WIDTH and v >= 16.0:
        return RAW_WIDTH
    return 8 if v >= 8.0 else 4 if v >= 4.0 else 2


def allocate_widths(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    *,
    widths_mode: Widths = Widths.VARIABLE,
    scales: Scales = Scales.HIERARCHICAL,
    u_hint: float | None = None,
    max_width: int = 8,
    energy_exponent: float = 1.0,
    width_set: tuple[int, ...] | None = None,
    errors: dict[int, float] | None = None,
    stats_bytes: int = STATS_BYTES["fp32"],
) -> Allocation:
    """Widths for super-groups with summed squared norms ``norm2`` (fp32 [S]) under a budget of
    ``bits`` per coordinate over ``numel`` coordinates (records plus statistics). ``u_hint``, a
    guess of the answer's ``u``, saves work and never changes the result. ``max_width=16``
    lets the largest super-groups go raw (see :mod:`.codec`).

    ``energy_exponent`` (``a``) ranks super-groups by ``F ** a`` instead of ``F``: 1 is the
    paper's allocation (equal marginal vNMSE gain per bit if one quantization's error were
    proportional to ``4 ** -b``; docs/allocation.md); below 1 the widths follow the
    energies less steeply, so low-energy super-groups keep more bits (0: every super-group the
    same width). See :class:`~dqcoll.schemes.dynamiq.scheme.DynamiqScheme`."""
    rows = norm2.numel()
    # On the host, in float64: every rank (and every device type) computes the same widths, and
    # the executor needs the payload sizes on the host anyway.
    norm2 = norm2.detach().to("cpu")
    stats = stats_bytes * rows
    budget = math.floor(bits * numel / 8.0)
    lookup = _cost_lookup(scales)

    def cost(widths: torch.Tensor) -> int:
        return int(lookup[widths].sum().item())

    if widths_mode is Widths.VARIABLE and (width_set is not None or errors is not None):
        return _allocate_hull(norm2, numel, bits, scales, max_width, energy_exponent,
                              width_set or WIDTHS, errors, stats, budget, cost)

    if widths_mode is Widths.FIXED:
        widths = torch.full((rows,), 4, dtype=torch.int64)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)

    f = norm2.double()
    zero = f == 0
    log_f = torch.log2(torch.where(zero, 1.0, f))  # +inf for inf, nan for nan
    compiled = _compiled_allocation()
    if compiled is not None:  # the same allocation, compiled (kernels/allocation_numba)
        from ...kernels import allocation_numba

        widths = torch.empty(rows, dtype=torch.int64)
        status, u, payload = compiled(log_f.numpy(), zero.numpy(), lookup.numpy(), budget - stats,
                                      _BISECTION_STEPS, C_SLOPE, max_width, energy_exponent,
                                      widths.numpy())
        if status == allocation_numba.NO_FINITE:
            return Allocation(widths, float("nan"), payload, stats, budget,
                              payload + stats > budget, kernel="numba")
        return Allocation(widths, u, payload, stats, budget,
                          status == allocation_numba.OVER_BUDGET, kernel="numba")
    # +inf is a finite input whose squared norm overflowed fp32 (Inf/NaN inputs give NaN after
    # centring): rank it as the largest finite norm rather than spending 8 bits on it.
    log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)
    if energy_exponent != 1.0:
        log_f = log_f * energy_exponent
    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()):
        widths = _widths_for(log_f, zero, 0.0, max_width)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)
    lo_log = float(log_f[finite].min())
    hi_log = float(log_f[finite].max())
    u_lo = 4.0 - C_SLOPE * hi_log - 1.0  # every finite super-group at 2 bits
    u_hi = float(max_width) - C_SLOPE * lo_log  # every finite super-group at max_width
    cheapest = _widths_for(log_f, zero, u_lo, max_width)
    if cost(cheapest) + stats > budget:
        return Allocation(cheapest, u_lo, cost(cheapest), stats, budget, True)
    richest = _widths_for(log_f, zero, u_hi, max_width)
    if cost(richest) + stats <= budget:
        return Allocation(richest, u_hi, cost(richest), stats, budget, False)
    search = _Bracket(log_f, zero, lookup, budget - stats, (u_lo, cheapest), (u_hi, richest),
                      max_width)
    if u_hint is not None and math.isfinite(u_hint):
        search.bracket_around(float(u_hint))
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if search.feasible(mid):
            u_lo = mid
        else:
            u_hi = mid
    widths = _widths_for(log_f, zero, u_lo, max_width)
    return Allocation(widths, u_lo, cost(widths), stats, budget, False)


class _Bracket:
    """A known-feasible and a known-infeasible ``u`` and the rows whose widths differ between them.

    ``feasible(u)`` answers from the bracket when ``u`` lies outside it and otherwise evaluates
    only the active rows, then narrows the bracket to ``u``: exact, because every row's width is
    monotone in ``u`` (``fl(a + u)`` is monotone in ``u``), so a row with equal widths at both ends
    has that width everywhere between them.
    """

    _HINT_STEP = 2.0**-10  # first half-width around a hint (u is O(1..100)); x8 per retry
    # At most this many active rows: evaluate them in Python floats (the same IEEE double
    # multiply and add as the tensor ops, without their per-call overhead; a bisection ends with
    # dozens of evaluations of a handful of rows).
    _PYTHON_ROWS = 16

    def __init__(
        self,
        log_f: torch.Tensor,
        zero: torch.Tensor,
        lookup: torch.Tensor,
        limit: int,
        low: tuple[float, torch.Tensor],
        high: tuple[float, torch.Tensor],
        max_width: int = 8,
    ) -> None:
        self.max_width = max_width
        self.lookup = lookup
        self.limit = limit  # payload bytes allowed
        self.u_lo, widths_lo = low  # feasible
        self.u_hi, widths_hi = high  # infeasible
        active = torch.nonzero(widths_lo != widths_hi).squeeze(1)
        self.log_f, self.zero = log_f[active], zero[active]
        self.w_lo, self.w_hi = widths_lo[active], widths_hi[active]
        # cost of the rows whose width is settled
        self.base = int(lookup[widths_lo].sum()) - int(lookup[self.w_lo].sum())
        self.evaluations = 0
        self._rows: list[tuple[float, bool, int, int]] | None = None  # the Python-float mode

    def feasible(self, u: float) -> bool:
        if u <= self.u_lo:
            return True
        if u >= self.u_hi:
            return False
        self.evaluations += 1
        if self._rows is not None or self.log_f.numel() <= self._PYTHON_ROWS:
            return self._feasible_few(u)
        widths = _widths_for(self.log_f, self.zero, u, self.max_width)
        ok = self.base + int(self.lookup[widths].sum()) <= self.limit
        settled = widths == (self.w_hi if ok else self.w_lo)
        self.base += int(self.lookup[widths[settled]].sum())
        keep = ~settled
        self.log_f, self.zero, widths = self.log_f[keep], self.zero[keep], widths[keep]
        if ok:
            self.u_lo, self.w_lo, self.w_hi = u, widths, self.w_hi[keep]
        else:
            self.u_hi, self.w_lo, self.w_hi = u, self.w_lo[keep], widths
        return ok

    def _feasible_few(self, u: float) -> bool:
        """:meth:`feasible` on the few remaining active rows, one Python float at a time."""
        if self._rows is None:
            self._costs = self.lookup.tolist()
            self._rows = list(zip(self.log_f.tolist(), self.zero.tolist(), self.w_lo.tolist(),
                                  self.w_hi.tolist(), strict=True))
        widths = [_width_of(lf, zero, u, self.max_width) for lf, zero, _, _ in self._rows]
        ok = self.base + sum(self._costs[w] for w in widths) <= self.limit
        rows = []
        for (lf, zero, w_lo, w_hi), w in zip(self._rows, widths, strict=True):
            if w == (w_hi if ok else w_lo):
                self.base += self._costs[w]  # settled
            else:
                rows.append((lf, zero, w, w_hi) if ok else (lf, zero, w_lo, w))
        self._rows = rows
        if ok:
            self.u_lo = u
        else:
            self.u_hi = u
        return ok

    def bracket_around(self, hint: float) -> None:
        """Narrow the bracket to a small interval around ``hint`` (when it is inside)."""
        if not self.u_lo < hint < self.u_hi:
            return
        step = self._HINT_STEP
        if self.feasible(hint):  # look above for an infeasible u (u_hi answers without work)
            while self.feasible(min(hint + step, self.u_hi)):
                step *= 8.0
        else:  # look below for a feasible one
            while not self.feasible(max(hint - step, self.u_lo)):
                step *= 8.0


def _log_energies(norm2: torch.Tensor, energy_exponent: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a * log2 F, F == 0)`` per row in float64; ``log2 F`` of a zero row is 0 (it is masked)
    and of an overflowed (+inf) norm 128, ranking it as the largest finite one."""
    f = norm2.double()
    zero = f == 0
    log_f = torch.log2(torch.where(zero, 1.0, f))
    log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)
    if energy_exponent != 1.0:
        log_f = log_f * energy_exponent
    return log_f, zero


def _hull_widths(width_set: Sequence[int], max_width: int, errors: dict[int, float] | None,
                 scales: Scales) -> tuple[list[int], list[float], int]:
    """The widths a generic allocation chooses among, their hull offsets and the widest coded
    width (errors default to the paper's ``4**-w`` assumption)."""
    widths_all = tuple(w for w in width_set if w != RAW_WIDTH)
    if max_width == RAW_WIDTH:
        widths_all = (*widths_all, RAW_WIDTH)
    if errors is None:
        errors = {w: 4.0**-w for w in widths_all}
    hull, offsets = hull_offsets(widths_all, errors, scales)
    return hull, offsets, max(w for w in hull if w != RAW_WIDTH)


class _HullCost:
    """Cost of the hull rule at a given ``u`` without touching every row: per class ``c`` the keys
    ``g = fl(log2 F + shift_c)`` of the finite, non-zero rows sorted once, so the rows at width
    ``hull[k]`` or wider (``g + u >= o_k``, a suffix: ``fl(g + u)`` is monotone in ``g``) are
    counted by a binary search. Exact: the search is corrected to the predicate's own boundary,
    so every count, and hence every bisection decision, equals the row-by-row evaluation's
    (64 halvings x 8 classes x 7 thresholds: ~3 ms at 2^16 rows instead of ~0.5 s)."""

    def __init__(self, log_f: torch.Tensor, zero: torch.Tensor, shifts: dict[int, float],
                 hull: list[int], offsets: list[float], top: int, lookup: torch.Tensor,
                 energies: torch.Tensor | None = None) -> None:
        import numpy as np

        keys = log_f.numpy()
        nan = np.isnan(keys)
        zero_np = zero.numpy()
        live = ~zero_np & ~nan
        order = np.argsort(keys[live], kind="stable")
        base = keys[live][order]
        self.keys = {c: base + shift if shift else base for c, shift in shifts.items()}
        self.hull = hull
        # target mode: prefix sums of the rows' energies in key order (band sums by subtraction)
        self.prefix = None if energies is None else np.concatenate(
            [[0.0], np.cumsum(energies.numpy()[live][order])])
        costs = lookup.tolist()
        self.bytes = [int(costs[w]) for w in hull]
        self.offsets = offsets[1:]
        self.offsets_np = np.asarray(self.offsets, dtype=np.float64)
        self.fixed = int(nan[~zero_np].sum()) * int(costs[top])  # NaN rows: the widest width

    @staticmethod
    def _fix(g, u: float, off: float, i: int) -> int:  # type: ignore[no-untyped-def]
        """Move ``i`` (a binary search's guess) to the first index with ``g[i] + u >= off``."""
        import numpy as np

        n = g.shape[0]
        while i > 0 and float(g[i - 1]) + u >= off:  # step back over whole runs of equal keys
            i = int(np.searchsorted(g, g[i - 1], side="left"))
        while i < n and float(g[i]) + u < off:
            i = int(np.searchsorted(g, g[i], side="right"))
        return i

    def class_bytes(self, c: int, u: float) -> int:
        """Payload bytes of class ``c`` at ``u`` (width ``hull[k]`` from ``starts[k]`` on)."""
        g = self.keys[c]
        starts = self._starts(c, u)
        ends = [*starts[1:], g.shape[0]]
        total = sum(b * (hi - lo) for b, lo, hi in zip(self.bytes, starts, ends, strict=True))
        return total + self.fixed

    def class_error(self, c: int, u: float, unit_error: list[float]) -> float:
        """``sum_s unit_error[width_s] F_s`` over the finite rows of class ``c`` at ``u``."""
        assert self.prefix is not None
        starts = self._starts(c, u)
        ends = [*starts[1:], self.keys[c].shape[0]]
        return sum(unit_error[w] * float(self.prefix[hi] - self.prefix[lo])
                   for w, lo, hi in zip(self.hull, starts, ends, strict=True))

    def _starts(self, c: int, u: float) -> list[int]:
        """Index of the first row at width ``hull[k]`` or wider, for every k."""
        import numpy as np

        g = self.keys[c]
        n = g.shape[0]
        offsets = self.offsets_np
        guess = np.searchsorted(g, offsets - u, side="left")  # one call for every threshold
        # where fl(g + u) >= off disagrees with g >= off - u (rounding), correct the guess
        before = g[np.maximum(guess - 1, 0)] + u >= offsets
        at = g[np.minimum(guess, n - 1)] + u < offsets
        wrong = ((guess > 0) & before) | ((guess < n) & at)
        starts = [0, *guess.tolist()]
        for k in np.flatnonzero(wrong).tolist():
            starts[k + 1] = self._fix(g, u, self.offsets[k], starts[k + 1])
        return starts


def _hull_rule(log_f: torch.Tensor, zero: torch.Tensor, nan: torch.Tensor, hull: list[int],
               offsets: list[float], top: int, u: float, shift: float = 0.0) -> torch.Tensor:
    """Each row's width by the hull rule: ``hull[k]`` from ``log2 F + shift + u >= o_k`` on (the
    widest width for NaN rows, 0 for zero rows)."""
    key = log_f + shift if shift else log_f
    w = torch.full_like(log_f, hull[0], dtype=torch.int64)
    for width, off in zip(hull[1:], offsets[1:], strict=False):
        w = torch.where(key + u >= off, width, w)
    w = torch.where(nan, top, w)
    return torch.where(zero, 0, w)


def _classes_cost(ws: dict[int, torch.Tensor], classes: dict[int, tuple[float, float]],
                  lookup: torch.Tensor) -> float:
    """Traffic-weighted payload bytes of per-class widths (``tau_c`` times class c's bytes)."""
    return sum(classes[c][1] * float(lookup[w].sum()) for c, w in ws.items())


def _allocate_hull(norm2, numel, bits, scales, max_width, energy_exponent, width_set, errors,
                   stats, budget, cost):  # type: ignore[no-untyped-def]
    """The generic allocation: any width set, thresholds from an error table (default the
    paper's 4**-w assumption); bisection on ``u`` for the largest total that fits."""
    hull, offsets, top = _hull_widths(width_set, max_width, errors, scales)
    log_f, zero = _log_energies(norm2, energy_exponent)
    nan = torch.isnan(log_f)

    def widths_at(u: float) -> torch.Tensor:
        return _hull_rule(log_f, zero, nan, hull, offsets, top, u)

    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()) or len(hull) == 1:
        widths = widths_at(0.0)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)
    u_lo = offsets[1] - float(log_f[finite].max()) - 1.0
    u_hi = offsets[-1] - float(log_f[finite].min()) + 1.0
    cheapest = widths_at(u_lo)
    if cost(cheapest) + stats > budget:
        return Allocation(cheapest, u_lo, cost(cheapest), stats, budget, True)
    richest = widths_at(u_hi)
    if cost(richest) + stats <= budget:
        return Allocation(richest, u_hi, cost(richest), stats, budget, False)
    fast = _HullCost(log_f, zero, {0: 0.0}, hull, offsets, top, _cost_lookup(scales))
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if fast.class_bytes(0, mid) + stats <= budget:
            u_lo = mid
        else:
            u_hi = mid
    widths = widths_at(u_lo)
    return Allocation(widths, u_lo, cost(widths), stats, budget, False)


def count_classes(subtree: tuple[tuple[int, ...], ...]) -> dict[int, tuple[float, float]]:
    """Per partial-sum size ``c`` (the executor's ``count``): ``(alpha_c, tau_c)``, the error
    weight (quantizations of a ``c``-rank partial sum per chunk, times ``c``: its energy relative
    to one rank's) and the share of the all-reduce's transfers that carry it. In a tree reduce
    every non-sink rank sends its partial sum of a chunk once (count = its subtree size); the sink
    encodes the full sum once (count n), which the all-gather forwards n - 1 times."""
    n = len(subtree)
    chunks = len(subtree[0]) if n else 0
    sends: dict[int, float] = {}
    for c in range(chunks):
        for r in range(n):
            size = subtree[r][c]
            if size < n:
                sends[size] = sends.get(size, 0.0) + 1.0 / chunks
    total = 2.0 * (n - 1)
    classes = {size: (m * size, m / total) for size, m in sends.items()}
    classes[n] = (float(n), (n - 1) / total)
    return classes


def allocate_widths_by_count(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    classes: dict[int, tuple[float, float]],
    *,
    scales: Scales,
    width_set: tuple[int, ...],
    errors: dict[int, float] | None,
    stats_bytes: int,
    max_width: int = 8,
    energy_exponent: float = 1.0,
) -> tuple[dict[int, torch.Tensor], Allocation]:
    """Widths per super-group *and* partial-sum size (prototype ``hop_widths``): the hull rule
    with ``log2 F`` shifted by ``log2(alpha_c / tau_c)`` for class ``c``, one ``u`` for all
    classes, under the budget of the transfers' average record bytes (``sum_c tau_c B``)."""
    rows = norm2.numel()
    norm2 = norm2.detach().to("cpu")
    stats = stats_bytes * rows
    budget = math.floor(bits * numel / 8.0)
    lookup = _cost_lookup(scales).double()
    hull, offsets, top = _hull_widths(width_set, max_width, errors, scales)
    log_f, zero = _log_energies(norm2, energy_exponent)
    nan = torch.isnan(log_f)
    # Ties (bf16 statistics leave few distinct norms on dense data) are broken by row index so
    # that the bisection can split them and the budget is used up; 2**-30 per row is far below
    # the spacing of distinct norms (>= log2(1 + 2**-8)).
    log_f = log_f + torch.arange(rows, dtype=torch.float64) * 2.0**-30 / max(rows, 1)
    shifts = {c: math.log2(a / t) for c, (a, t) in classes.items()}

    def widths_at(u: float) -> dict[int, torch.Tensor]:
        return {c: _hull_rule(log_f, zero, nan, hull, offsets, top, u, shift)
                for c, shift in shifts.items()}

    def cost(ws: dict[int, torch.Tensor]) -> float:
        return _classes_cost(ws, classes, lookup)

    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()) or len(hull) == 1:
        ws = widths_at(0.0)
        return ws, Allocation(ws[max(ws)], float("nan"), math.ceil(cost(ws)), stats, budget, False)
    u_lo = offsets[1] - float(log_f[finite].max()) - max(shifts.values()) - 1.0
    u_hi = offsets[-1] - float(log_f[finite].min()) - min(shifts.values()) + 1.0
    fast = _HullCost(log_f, zero, shifts, hull, offsets, top, lookup.long())

    def fast_cost(u: float) -> float:  # == cost(widths_at(u)), bit for bit
        return sum(classes[c][1] * float(fast.class_bytes(c, u)) for c in shifts)

    if fast_cost(u_lo) + stats > budget:
        ws = widths_at(u_lo)
        return ws, Allocation(ws[max(ws)], u_lo, math.ceil(cost(ws)), stats, budget, True)
    if fast_cost(u_hi) + stats <= budget:
        u_lo = u_hi
    else:
        for _ in range(_BISECTION_STEPS):
            mid = 0.5 * (u_lo + u_hi)
            if fast_cost(mid) + stats <= budget:
                u_lo = mid
            else:
                u_hi = mid
    ws = widths_at(u_lo)
    return ws, Allocation(ws[max(ws)], u_lo, math.ceil(cost(ws)), stats, budget, False)


def allocate_for_target_by_count(
    norm2: torch.Tensor,
    mean_sum: torch.Tensor,
    valid: torch.Tensor,
    target: float,
    classes: dict[int, tuple[float, float]],
    *,
    world_size: int,
    rho: float,
    unit_error: torch.Tensor,
    scales: Scales,
    width_set: tuple[int, ...],
    errors: dict[int, float] | None,
    stats_bytes: int,
    max_width: int = RAW_WIDTH,
) -> tuple[dict[int, torch.Tensor], Allocation]:
    """:func:`allocate_for_target` with hop widths: the widths of :func:`allocate_widths_by_count`
    (one ``u`` for every count class) at the smallest ``u`` whose predicted vNMSE meets
    ``target``. Class ``c`` contributes ``alpha_c (1 + (c - 1) rho) / n`` times
    ``unit_error[width] F`` per super-group (summed over the classes at rho = 0 this weight is the
    schedule's path growth ``H``; :mod:`.error_model`)."""
    rows = norm2.numel()
    norm2 = norm2.detach().to("cpu")
    stats = stats_bytes * rows
    f = norm2.double()
    finite_f = torch.where(torch.isfinite(f), f, 0.0)
    energy = float(finite_f.sum()) * (1.0 + (world_size - 1) * rho)
    means = mean_sum.detach().to("cpu", torch.float64)
    counts = valid.detach().to("cpu", torch.float64)
    energy += float((counts * means * means).nan_to_num(0.0, 0.0, 0.0).sum())
    lookup = _cost_lookup(scales).double()
    hull, offsets, top = _hull_widths(width_set, max_width, errors, scales)
    log_f, zero = _log_energies(norm2)
    nan = torch.isnan(log_f)
    log_f = log_f + torch.arange(rows, dtype=torch.float64) * 2.0**-30 / max(rows, 1)
    shifts = {c: math.log2(a / t) for c, (a, t) in classes.items()}
    weights = {c: a * (1.0 + (c - 1) * rho) / world_size for c, (a, _) in classes.items()}
    unit = unit_error.tolist()

    def widths_at(u: float) -> dict[int, torch.Tensor]:
        return {c: _hull_rule(log_f, zero, nan, hull, offsets, top, u, shift)
                for c, shift in shifts.items()}

    def cost(ws: dict[int, torch.Tensor]) -> float:
        return _classes_cost(ws, classes, lookup)

    def result(u: float, predicted: float) -> tuple[dict[int, torch.Tensor], Allocation]:
        ws = widths_at(u)
        payload = math.ceil(cost(ws))
        return ws, Allocation(ws[max(ws)], u, payload, stats, payload + stats, False, predicted,
                              predicted <= target)

    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()) or energy <= 0.0 or len(hull) == 1:
        return result(0.0, 0.0)
    fast = _HullCost(log_f, zero, shifts, hull, offsets, top, lookup.long(), finite_f)

    def error(u: float) -> float:
        return sum(weights[c] * fast.class_error(c, u, unit) for c in shifts) / energy

    u_lo = offsets[1] - float(log_f[finite].max()) - max(shifts.values()) - 1.0
    u_hi = offsets[-1] - float(log_f[finite].min()) - min(shifts.values()) + 1.0
    u = _smallest_u_meeting(error, target, u_lo, u_hi)
    return result(u, error(u))


def allocate_for_target(
    norm2: torch.Tensor,
    mean_sum: torch.Tensor,
    valid: torch.Tensor,
    target: float,
    *,
    world_size: int,
    rho: float,
    error_per_energy: torch.Tensor,
    scales: Scales = Scales.HIERARCHICAL,
    widths_mode: Widths = Widths.VARIABLE,
    max_width: int = RAW_WIDTH,
    width_set: tuple[int, ...] | None = None,
    errors: dict[int, float] | None = None,
    stats_bytes: int = STATS_BYTES["fp32"],
) -> Allocation:
    """The cheapest widths whose predicted vNMSE (:mod:`.error_model`) is at most ``target``.

    Same rule as :func:`allocate_widths` (the paper's closed form, or the hull of ``errors`` over
    ``width_set``); the bisection on ``u`` now keeps the smallest ``u`` (fewest bits) whose
    prediction meets the target. Everything it reads is all-reduced, so every rank picks the same
    widths.
    """
    rows = norm2.numel()
    stats = stats_bytes * rows
    f = norm2.detach().to("cpu", torch.float64)
    means = mean_sum.detach().to("cpu", torch.float64)
    counts = valid.detach().to("cpu", torch.float64)
    finite_f = torch.where(torch.isfinite(f), f, 0.0)
    energy = float(finite_f.sum()) * (1.0 + (world_size - 1) * rho)
    energy += float((counts * means * means).nan_to_num(0.0, 0.0, 0.0).sum())
    lookup = _cost_lookup(scales)

    def result(widths: torch.Tensor, u: float) -> Allocation:
        payload = int(lookup[widths].sum().item())
        predicted = predicted_vnmse(widths, finite_f, energy, error_per_energy)
        return Allocation(widths, u, payload, stats, payload + stats, False, predicted,
                          predicted <= target)

    if widths_mode is Widths.FIXED:
        return result(torch.full((rows,), 4, dtype=torch.int64), float("nan"))
    zero = f == 0
    log_f = torch.log2(torch.where(zero, 1.0, f))
    log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)
    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()):
        return result(_widths_for(log_f, zero, 0.0, max_width), float("nan"))
    if width_set is not None or errors is not None:  # the hull rule
        hull, offsets, top = _hull_widths(width_set or WIDTHS, max_width, errors, scales)
        nan = torch.isnan(log_f)
        u_lo = offsets[1] - float(log_f[finite].max()) - 1.0  # everything at the narrowest
        u_hi = offsets[-1] - float(log_f[finite].min()) + 1.0  # everything at the widest

        def widths(u: float) -> torch.Tensor:
            return _hull_rule(log_f, zero, nan, hull, offsets, top, u)
    else:
        u_lo = 4.0 - C_SLOPE * float(log_f[finite].max()) - 1.0  # everything at 2 bits
        u_hi = float(max_width) - C_SLOPE * float(log_f[finite].min())  # everything at max_width

        def widths(u: float) -> torch.Tensor:
            return _widths_for(log_f, zero, u, max_width)

    def error(u: float) -> float:
        return predicted_vnmse(widths(u), finite_f, energy, error_per_energy)

    u = _smallest_u_meeting(error, target, u_lo, u_hi)
    return result(widths(u), u)


def _smallest_u_meeting(error: Callable[[float], float], target: float, u_lo: float,
                        u_hi: float) -> float:
    """Target mode's bisection: the smallest ``u`` (fewest bytes) whose predicted error is at
    most ``target`` (``u_lo`` when even it meets it, ``u_hi`` when even it does not)."""
    if error(u_lo) <= target:
        return u_lo
    if error(u_hi) > target:
        return u_hi
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if error(mid) <= target:
            u_hi = mid
        else:
            u_lo = mid
    return u_hi


def _compiled_allocation() -> Callable[..., tuple[int, float, int]] | None:
    """The compiled allocation where the CPU kernels are numba's (``DQCOLL_KERNELS`` auto or
    numba, numba importable); None: the torch reference above (``DQCOLL_KERNELS=torch``)."""
    from ...kernels import dynamiq_ops

    if dynamiq_ops(torch.device("cpu")).name != "numba":
        return None
    from ...kernels.allocation_numba import allocate

    return allocate


def _cost_lookup(scales: Scales) -> torch.Tensor:
    lookup = torch.zeros(RAW_WIDTH + 1, dtype=torch.int64)
    from .codec import ALL_WIDTHS

    for w in ALL_WIDTHS:
        lookup[w] = record_nbytes(w, scales)
    return lookup
