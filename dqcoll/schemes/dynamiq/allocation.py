"""Bit allocation of dqcoll's format (format 3): one width per super-group from the all-reduced
statistics (so every rank computes the same), and per partial-sum size with hop widths. The hull
rule and its one parameter ``u``, bisected under a budget or against a target vNMSE, are
docs/dense_gap.md's ("The format"); the paper's rule is the lab's (``dqcoll_lab.dynamiq``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ...kernels import dynamiq_ops
from ...kernels.codec import (
    ALL_WIDTHS,
    FINE_WIDTHS,
    RAW_WIDTH,
    Levels,
    ProtoScales,
    Scales,
    record_nbytes,
)
from .error_model import EPSILON, predicted_vnmse

__all__ = [
    "MEASURED_ERRORS",
    "STATS_BYTES",
    "STATS_BYTES_PER_SUPER",
    "Allocation",
    "allocate_for_target",
    "allocate_for_target_by_count",
    "allocate_widths",
    "allocate_widths_by_count",
    "count_classes",
    "hull_offsets",
    "min_bits",
]

# statistics bytes per super-group, by the scheme's ``stats`` option
STATS_BYTES = {"fp32": 8, "bf16": 4, "norm16": 2}
STATS_BYTES_PER_SUPER = STATS_BYTES["norm16"]  # the default: the bf16 squared norm
BISECTION_STEPS = 64

# Single-quantization vNMSE of N(0, 1) per width, keyed by (levels, scales) (docs/dense_gap.md).
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
# dqcoll's format (format 3) without hop widths: the defaults of allocate_widths
_FORMAT3_ERRORS = MEASURED_ERRORS[(Levels.TUNED, Scales.HIERARCHICAL4X32)]
Classes = dict[int, tuple[float, float]]  # count class -> (alpha_c, tau_c): :func:`count_classes`
# by-count rules break ties (bf16 norms repeat) by row index, far below distinct norms' spacing
_TIE_BREAK = 2.0**-30


@dataclasses.dataclass(frozen=True)
class Allocation:
    widths: torch.Tensor  # int64 [S]: 0 (no record), 2..8 or 16
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
    return (record_nbytes(2, scales) + stats_bytes) * 8.0 / 256


def hull_offsets(widths: tuple[int, ...], errors: dict[int, float],
                 scales: Scales) -> tuple[list[int], list[float]]:
    """Widths on the lower convex hull of (record bytes, error) and their thresholds
    ``o_i = log2((B_i - B_{i-1}) / (e_{i-1} - e_i))`` (``o_0 = -inf``)."""
    pts = sorted((record_nbytes(w, scales), errors[w], w) for w in widths)
    hull: list[tuple[int, float, int]] = []
    for p in pts:
        if hull and p[1] >= hull[-1][1]:
            continue  # costs more, no better
        while len(hull) >= 2:
            (b1, e1, _), (b2, e2, _) = hull[-2], hull[-1]
            if (e2 - e1) * (p[0] - b1) >= (p[1] - e1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(p)
    offsets = [-math.inf, *(math.log2((b2 - b1) / (e1 - e2))
                            for (b1, e1, _), (b2, e2, _) in itertools.pairwise(hull))]
    return [w for _, _, w in hull], offsets


def _hull_rule(log_f: torch.Tensor, zero: torch.Tensor, nan: torch.Tensor, hull: list[int],
               offsets: list[float], top: int, u: float, shift: float = 0.0) -> torch.Tensor:
    """Each row's width by the hull rule (NaN rows: the widest coded width; zero rows: 0)."""
    key = log_f + shift if shift else log_f
    w = torch.full_like(log_f, hull[0], dtype=torch.int64)
    for width, off in zip(hull[1:], offsets[1:], strict=False):
        w = torch.where(key + u >= off, width, w)
    w = torch.where(nan, top, w)
    return torch.where(zero, 0, w)


def cost_lookup(scales: Scales) -> torch.Tensor:
    """Record bytes by width (int64 [17]; 0 for width 0), a copy of a cached table."""
    return _cost_table(scales).clone()


@functools.lru_cache(maxsize=16)  # a few scales
def _cost_table(scales: Scales) -> torch.Tensor:
    return torch.tensor([0 if w not in ALL_WIDTHS else record_nbytes(w, scales)
                         for w in range(RAW_WIDTH + 1)], dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The all-reduced norms as the hull rule reads them (float64 on the host: the same widths
    on every rank and device type)."""

    log_f: torch.Tensor  # a * log2 F (+ the tie break in the by-count rules)
    zero: torch.Tensor  # F == 0: width 0
    nan: torch.Tensor  # F is NaN: the widest coded width
    finite: torch.Tensor  # finite and non-zero: the rows the rule ranks
    hull: list[int]  # the widths on the hull, narrowest first
    offsets: list[float]  # their thresholds (offsets[0] = -inf)
    top: int  # the widest coded width (NaN rows)

    @classmethod
    def of(cls, norm2: torch.Tensor, *, width_set: Sequence[int], errors: dict[int, float] | None,
           scales: Scales, max_width: int, energy_exponent: float = 1.0,
           tie_break: bool = False) -> _Rows:
        raw = (RAW_WIDTH,) if max_width == RAW_WIDTH else ()
        widths = (*(w for w in width_set if w != RAW_WIDTH), *raw)
        if errors is None:
            errors = {w: 4.0**-w for w in widths}
        hull, offsets = hull_offsets(widths, errors, scales)
        f = norm2.detach().to("cpu").double()
        zero = f == 0
        log_f = torch.log2(torch.where(zero, 1.0, f))
        log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)  # an overflowed norm
        if energy_exponent != 1.0:
            log_f = log_f * energy_exponent
        nan = torch.isnan(log_f)
        if tie_break:
            rows = log_f.numel()
            log_f = log_f + torch.arange(rows, dtype=torch.float64) * _TIE_BREAK / max(rows, 1)
        finite = torch.isfinite(log_f) & ~zero
        return cls(log_f, zero, nan, finite, hull, offsets, max(w for w in hull if w != RAW_WIDTH))

    @property
    def searchable(self) -> bool:
        """Whether ``u`` changes anything: some finite row, more than one width."""
        return bool(self.finite.any()) and len(self.hull) > 1

    def widths(self, u: float, shift: float = 0.0) -> torch.Tensor:
        return _hull_rule(self.log_f, self.zero, self.nan, self.hull, self.offsets, self.top, u,
                          shift)

    def class_widths(self, u: float, shifts: dict[int, float], classes: Classes,
                     lookup: torch.Tensor) -> tuple[dict[int, torch.Tensor], int]:
        """Each class's widths at ``u`` and their traffic-weighted payload bytes (``tau_c``
        times class c's bytes, rounded up)."""
        ws = {c: self.widths(u, shift) for c, shift in shifts.items()}
        return ws, math.ceil(sum(classes[c][1] * float(lookup[w].sum()) for c, w in ws.items()))

    def bracket(self, shifts: Sequence[float] = (0.0,)) -> tuple[float, float]:
        """``u`` with every finite row at the narrowest width, and at the widest."""
        top = float(torch.where(self.finite, self.log_f, -math.inf).max())
        low = float(torch.where(self.finite, self.log_f, math.inf).min())
        return (self.offsets[1] - top - max(shifts) - 1.0,
                self.offsets[-1] - low - min(shifts) + 1.0)


def target_energy(f: torch.Tensor, mean_sum: torch.Tensor, valid: torch.Tensor,
                   world_size: int, rho: float) -> tuple[torch.Tensor, float]:
    """Target mode's ``(F with non-finite rows zeroed, the energy the vNMSE is relative to)``:
    the summed centred energy grown by the ranks' correlation ``rho``, plus the means'."""
    finite_f = torch.where(torch.isfinite(f), f, 0.0)
    energy = float(finite_f.sum()) * (1.0 + (world_size - 1) * rho)
    means = mean_sum.detach().to("cpu", torch.float64)
    counts = valid.detach().to("cpu", torch.float64)
    energy += float((counts * means * means).nan_to_num(0.0, 0.0, 0.0).sum())
    return finite_f, energy


def _bisect(low: Callable[[float], bool], u_lo: float, u_hi: float) -> tuple[float, float]:
    """Halve ``[u_lo, u_hi]`` BISECTION_STEPS times, keeping ``low(u_lo)``, not ``low(u_hi)``."""
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if low(mid):
            u_lo = mid
        else:
            u_hi = mid
    return u_lo, u_hi


def _largest_u_fitting(fits: Callable[[float], bool], u_lo: float, u_hi: float
                       ) -> tuple[float, bool]:
    """Budget mode's bisection: ``(the largest u that fits, whether even u_lo does not)``."""
    if not fits(u_lo):
        return u_lo, True
    if fits(u_hi):
        return u_hi, False
    return _bisect(fits, u_lo, u_hi)[0], False


def smallest_u_meeting(error: Callable[[float], float], target: float, u_lo: float,
                        u_hi: float) -> float:
    """Target mode's bisection: the smallest ``u`` (fewest bytes) whose predicted error is at
    most ``target`` (``u_lo`` when even it meets it, ``u_hi`` when even it does not)."""
    if error(u_lo) <= target:
        return u_lo
    if error(u_hi) > target:
        return u_hi
    return _bisect(lambda u: error(u) > target, u_lo, u_hi)[1]


class _HullCost:
    """Cost of the hull rule at a given ``u`` by binary searches in each class's sorted keys,
    corrected to the predicate's own boundary: every count equals the row-by-row evaluation's."""

    def __init__(self, rows: _Rows, shifts: dict[int, float], lookup: torch.Tensor,
                 energies: torch.Tensor | None = None,
                 correlated: torch.Tensor | None = None) -> None:
        keys = rows.log_f.numpy()
        nan = np.isnan(keys)
        zero_np = rows.zero.numpy()
        live = ~zero_np & ~nan
        order = np.argsort(keys[live], kind="stable")
        base = keys[live][order]
        self.keys = {c: base + shift if shift else base for c, shift in shifts.items()}
        self.hull = hull = rows.hull

        def prefix(values: torch.Tensor | None) -> np.ndarray | None:  # in key order
            return None if values is None else np.concatenate(
                [[0.0], np.cumsum(values.numpy()[live][order])])

        self.prefix, self.prefix_rho = prefix(energies), prefix(correlated)  # F_s, F_s rho_s
        costs = lookup.tolist()
        self.bytes = [int(costs[w]) for w in hull]
        self.offsets = np.asarray(rows.offsets[1:], dtype=np.float64)
        self.fixed = int(nan[~zero_np].sum()) * int(costs[rows.top])  # NaN rows: the widest width

    @staticmethod
    def _fix(g: np.ndarray, u: float, off: float, i: int) -> int:
        """Move ``i`` (a binary search's guess) to the first index with ``g[i] + u >= off``."""
        n = g.shape[0]
        while i > 0 and float(g[i - 1]) + u >= off:  # step back over whole runs of equal keys
            i = int(np.searchsorted(g, g[i - 1], side="left"))
        while i < n and float(g[i]) + u < off:
            i = int(np.searchsorted(g, g[i], side="right"))
        return i

    def class_bytes(self, c: int, u: float) -> int:
        """Payload bytes of class ``c`` at ``u``."""
        spans = self._spans(c, u)
        return sum(b * (hi - lo) for b, (lo, hi) in zip(self.bytes, spans, strict=True)) \
            + self.fixed

    def class_error(self, c: int, u: float, unit_error: list[float],
                    correlated: bool = False) -> float:
        """``sum_s unit_error[width_s] F_s`` over the finite rows of class ``c`` at ``u`` (of
        ``F_s rho_s`` with ``correlated``)."""
        prefix = self.prefix_rho if correlated else self.prefix
        assert prefix is not None
        return sum(unit_error[w] * float(prefix[hi] - prefix[lo])
                   for w, (lo, hi) in zip(self.hull, self._spans(c, u), strict=True))

    def _spans(self, c: int, u: float) -> list[tuple[int, int]]:
        """The sorted rows ``[first, end)`` of class ``c`` at width ``hull[k]``, for every k."""
        g = self.keys[c]
        n = g.shape[0]
        offsets = self.offsets
        guess = np.searchsorted(g, offsets - u, side="left")  # one call for every threshold
        # where fl(g + u) >= off disagrees with g >= off - u (rounding), correct the guess
        before = g[np.maximum(guess - 1, 0)] + u >= offsets
        at = g[np.minimum(guess, n - 1)] + u < offsets
        wrong = ((guess > 0) & before) | ((guess < n) & at)
        starts = [0, *guess.tolist()]
        for k in np.flatnonzero(wrong).tolist():
            starts[k + 1] = self._fix(g, u, float(offsets[k]), starts[k + 1])
        return list(itertools.pairwise([*starts, n]))


def allocate_widths(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    *,
    scales: Scales = Scales.HIERARCHICAL4X32,
    width_set: Sequence[int] = FINE_WIDTHS,
    errors: dict[int, float] | None = _FORMAT3_ERRORS,
    stats_bytes: int = STATS_BYTES_PER_SUPER,
    max_width: int = RAW_WIDTH,
    energy_exponent: float = 1.0,
) -> Allocation:
    """Widths for super-groups with summed squared norms ``norm2`` (fp32 [S]) under a budget of
    ``bits`` per coordinate over ``numel`` coordinates (records plus statistics), at the largest
    ``u`` that fits; the defaults are format 3's. ``energy_exponent`` ``a`` ranks super-groups
    by ``F ** a`` (docs/allocation.md)."""
    rows = _Rows.of(norm2, width_set=width_set, errors=errors, scales=scales,
                    max_width=max_width, energy_exponent=energy_exponent)
    lookup = cost_lookup(scales)
    stats = stats_bytes * norm2.numel()
    budget = math.floor(bits * numel / 8.0)
    searched = rows.searchable
    u, over = float("nan"), False
    if searched:
        fast = _HullCost(rows, {0: 0.0}, lookup)
        u, over = _largest_u_fitting(lambda u: fast.class_bytes(0, u) + stats <= budget,
                                     *rows.bracket())
    widths = rows.widths(u if searched else 0.0)
    payload = int(lookup[widths].sum().item())
    return Allocation(widths, u, payload, stats, budget,
                      over if searched else payload + stats > budget)


def count_classes(subtree: Any) -> Classes:
    """Per partial-sum size ``c`` (the executor's ``count``): ``(alpha_c, tau_c)``, the error
    weight (quantizations of a ``c``-rank partial sum per chunk, times ``c``) and the share of
    the all-reduce's transfers that carry it, from ``subtree[rank][chunk]``, as a plain loop."""
    sizes = np.asarray(subtree, dtype=np.int64)
    n = len(subtree)
    chunks = sizes.shape[1] if sizes.ndim == 2 else 0
    sends: dict[int, float] = {}
    if chunks:
        column_major = sizes.T.reshape(-1)  # chunk by chunk, rank by rank
        sent = column_major[column_major < n]
        values, first, counts = np.unique(sent, return_index=True, return_counts=True)
        for i in np.argsort(first, kind="stable"):
            sends[int(values[i])] = _repeated_sum(1.0 / chunks, int(counts[i]))
    total = 2.0 * (n - 1)
    classes = {size: (m * size, m / total) for size, m in sends.items()}
    classes[n] = (float(n), (n - 1) / total)
    return classes


def _repeated_sum(value: float, times: int) -> float:
    """``0.0 + value + value + ...`` (``times`` additions rounded one by one, as a loop would)."""
    total = 0.0
    block = 1 << 20
    while times > 0:
        k = min(times, block)
        total = float(np.cumsum(np.r_[total, np.full(k, value)])[-1])
        times -= k
    return total


def allocate_widths_by_count(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    classes: Classes,
    *,
    scales: Scales,
    width_set: Sequence[int],
    errors: dict[int, float] | None,
    stats_bytes: int,
    max_width: int = 8,
    energy_exponent: float = 1.0,
) -> tuple[dict[int, torch.Tensor], Allocation]:
    """Widths per super-group and partial-sum size (``hop_widths``): ``log2 F`` shifted by
    ``log2(alpha_c / tau_c)`` for class ``c``, one ``u`` under the budget of the transfers'
    average record bytes."""
    rows = _Rows.of(norm2, width_set=width_set, errors=errors, scales=scales,
                    max_width=max_width, energy_exponent=energy_exponent, tie_break=True)
    stats = stats_bytes * norm2.numel()
    budget = math.floor(bits * numel / 8.0)
    lookup = cost_lookup(scales).double()
    shifts = {c: math.log2(a / t) for c, (a, t) in classes.items()}  # log2(alpha_c / tau_c)

    def result(u: float, over: bool, searched: bool = True
               ) -> tuple[dict[int, torch.Tensor], Allocation]:
        ws, payload = rows.class_widths(u, shifts, classes, lookup)
        return ws, Allocation(ws[max(ws)], u if searched else float("nan"), payload, stats,
                              budget, over)

    if not rows.searchable:
        return result(0.0, False, searched=False)
    bracket = rows.bracket(list(shifts.values()))
    if dynamiq_ops(torch.device("cpu")).name == "numba":  # the compiled search, bit for bit
        from ...kernels.allocation_numba import hull_by_count

        widths = torch.empty((len(shifts), rows.log_f.numel()), dtype=torch.int64)
        u, over, traffic = hull_by_count(
            rows.log_f.numpy(), rows.zero.numpy(), rows.nan.numpy(),
            np.array(list(shifts.values()), dtype=np.float64),
            np.array([t for _, t in classes.values()], dtype=np.float64),
            np.array(rows.hull, dtype=np.int64), np.array(rows.offsets, dtype=np.float64),
            lookup.long().numpy(), rows.top, stats, budget, *bracket, BISECTION_STEPS,
            widths.numpy())
        ws = dict(zip(shifts, widths, strict=True))
        return ws, Allocation(ws[max(ws)], u, math.ceil(traffic), stats, budget, over,
                              kernel="numba")
    fast = _HullCost(rows, shifts, lookup.long())

    def fits(u: float) -> bool:  # cost(class_widths(u)) + stats <= budget, bit for bit
        return sum(classes[c][1] * float(fast.class_bytes(c, u)) for c in shifts) + stats \
            <= budget

    return result(*_largest_u_fitting(fits, *bracket))


def allocate_for_target_by_count(
    norm2: torch.Tensor,
    mean_sum: torch.Tensor,
    valid: torch.Tensor,
    target: float,
    classes: Classes,
    *,
    world_size: int,
    rho: float,
    unit_error: torch.Tensor,
    scales: Scales,
    width_set: Sequence[int],
    errors: dict[int, float] | None,
    stats_bytes: int,
    max_width: int = RAW_WIDTH,
    row_rho: torch.Tensor | None = None,
) -> tuple[dict[int, torch.Tensor], Allocation]:
    """:func:`allocate_for_target` with hop widths: the widths of :func:`allocate_widths_by_count`
    at the smallest ``u`` whose predicted vNMSE meets ``target``, class ``c`` weighted by
    ``alpha_c (1 + (c - 1) rho) / n`` (docs/target_vnmse.md, "The model"). ``row_rho`` (float64
    ``[S]``, optional): each super-group's own correlation in place of ``rho``."""
    rows = _Rows.of(norm2, width_set=width_set, errors=errors, scales=scales,
                    max_width=max_width, tie_break=True)
    stats = stats_bytes * norm2.numel()
    finite_f, energy = target_energy(norm2.detach().to("cpu").double(), mean_sum, valid,
                                      world_size, rho)
    correlated = None
    if row_rho is not None:
        correlated = finite_f * row_rho.detach().to("cpu", torch.float64)
        energy += (world_size - 1) * (float(correlated.sum()) - rho * float(finite_f.sum()))
    lookup = cost_lookup(scales).double()
    shifts = {c: math.log2(a / t) for c, (a, t) in classes.items()}  # log2(alpha_c / tau_c)
    weights = {c: a * (1.0 + (c - 1) * rho) / world_size for c, (a, _) in classes.items()}
    unit = unit_error.tolist()

    def result(u: float, predicted: float) -> tuple[dict[int, torch.Tensor], Allocation]:
        ws, payload = rows.class_widths(u, shifts, classes, lookup)
        return ws, Allocation(ws[max(ws)], u, payload, stats, payload + stats, False, predicted,
                              predicted <= target)

    if not rows.searchable or energy <= 0.0:
        return result(0.0, 0.0)
    fast = _HullCost(rows, shifts, lookup.long(), finite_f, correlated)

    def error(u: float) -> float:
        if correlated is not None:
            return sum(classes[c][0] / world_size * (
                fast.class_error(c, u, unit) + (c - 1) * fast.class_error(c, u, unit, True))
                for c in shifts) / energy
        return sum(weights[c] * fast.class_error(c, u, unit) for c in shifts) / energy

    u = smallest_u_meeting(error, target, *rows.bracket(list(shifts.values())))
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
    scales: Scales,
    width_set: Sequence[int],
    errors: dict[int, float] | None,
    stats_bytes: int,
    max_width: int = RAW_WIDTH,
) -> Allocation:
    """The cheapest widths of the hull rule whose predicted vNMSE (:mod:`.error_model`) is at most
    ``target``."""
    rows = _Rows.of(norm2, width_set=width_set, errors=errors, scales=scales,
                    max_width=max_width)
    stats = stats_bytes * norm2.numel()
    finite_f, energy = target_energy(norm2.detach().to("cpu", torch.float64), mean_sum, valid,
                                      world_size, rho)

    def error(widths: torch.Tensor) -> float:
        return predicted_vnmse(widths, finite_f, energy, error_per_energy)

    if bool(rows.finite.any()):
        u = smallest_u_meeting(lambda u: error(rows.widths(u)), target, *rows.bracket())
        widths = rows.widths(u)
    else:  # zero rows get no record, NaN rows 8 bits
        u, widths = float("nan"), torch.where(rows.zero, 0, 8)
    payload = int(cost_lookup(scales)[widths].sum().item())
    predicted = error(widths)
    return Allocation(widths, u, payload, stats, payload + stats, False, predicted,
                      predicted <= target)
