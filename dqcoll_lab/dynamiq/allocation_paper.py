"""The DynamiQ paper's bit allocation (``format="paper"``: ``width_set="paper"`` with
``thresholds="paper"``), a closed form over widths {2, 4, 8} (and raw 16 with ``max_width=16``).

Thresholds on a super-group's summed squared norm ``F`` in the fixed ratio ``T(2->4) = 17/512 *
T(4->8)`` give, with one scalar ``u``, ``v = C_SLOPE * log2 F + u``: 2 bits below 4, 4 in [4, 8),
8 from 8 on (16 from 16 with ``max_width=16``); zero super-groups get width 0, non-finite ``F``
8. ``u`` is found by bisection as in the runtime's hull rule (budget or target mode); a plain
bisection's decisions, evaluated only on the rows still undecided (:class:`_Bracket`).
docs/allocation.md and docs/dense_gap.md compare it with dqcoll's hull rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dqcoll.kernels.codec import RAW_WIDTH, Scales
from dqcoll.schemes.dynamiq.allocation import (
    BISECTION_STEPS,
    STATS_BYTES,
    Allocation,
    cost_lookup,
    smallest_u_meeting,
    target_energy,
)
from dqcoll.schemes.dynamiq.error_model import predicted_vnmse

__all__ = ["C_SLOPE", "allocate_for_target_paper", "allocate_widths_paper"]

C_SLOPE = 4.0 / math.log2(512.0 / 17.0)


def _widths_for(
    log_f: torch.Tensor, zero: torch.Tensor, u: float, max_width: int = 8
) -> torch.Tensor:
    v = C_SLOPE * log_f + u
    widths = torch.where(v >= 8.0, 8, torch.where(v >= 4.0, 4, 2))  # NaN v -> 2, fixed below
    if max_width == RAW_WIDTH:
        widths = torch.where(v >= 16.0, RAW_WIDTH, widths)
    widths = torch.where(torch.isnan(log_f), 8, widths)
    return torch.where(zero, 0, widths)


def _width_of(log_f: float, u: float, max_width: int = 8) -> int:
    """:func:`_widths_for` of one finite, non-zero row, in Python floats (bit-identical)."""
    v = C_SLOPE * log_f + u
    if max_width == RAW_WIDTH and v >= 16.0:
        return RAW_WIDTH
    return 8 if v >= 8.0 else 4 if v >= 4.0 else 2


def _log2_norms(norm2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2 F, F == 0)`` in float64 on the host, before :func:`_ranked`."""
    f = norm2.detach().to("cpu").double()
    zero = f == 0
    return torch.log2(torch.where(zero, 1.0, f)), zero


def _ranked(log_f: torch.Tensor, energy_exponent: float = 1.0) -> torch.Tensor:
    """``a * log2 F`` with an overflowed (+inf) norm ranked as the largest finite one."""
    log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)
    return log_f * energy_exponent if energy_exponent != 1.0 else log_f


def allocate_widths_paper(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    *,
    scales: Scales = Scales.HIERARCHICAL,
    max_width: int = 8,
    energy_exponent: float = 1.0,
    stats_bytes: int = STATS_BYTES["fp32"],
) -> Allocation:
    """The paper's widths for summed squared norms ``norm2`` (fp32 [S]) under a budget of ``bits``
    per coordinate over ``numel`` coordinates (as the hull rule's ``allocate_widths``)."""
    stats = stats_bytes * norm2.numel()
    budget = math.floor(bits * numel / 8.0)
    lookup = cost_lookup(scales)

    def cost(widths: torch.Tensor) -> int:
        return int(lookup[widths].sum().item())

    log_f, zero = _log2_norms(norm2)
    compiled = _compiled_allocation()
    if compiled is not None:  # the same allocation, compiled (kernels/allocation_numba)
        from dqcoll.kernels import allocation_numba

        widths = torch.empty(norm2.numel(), dtype=torch.int64)
        status, u, payload = compiled(log_f.numpy(), zero.numpy(), lookup.numpy(), budget - stats,
                                      BISECTION_STEPS, C_SLOPE, max_width, energy_exponent,
                                      widths.numpy())
        if status == allocation_numba.NO_FINITE:
            u = float("nan")
        over = (payload + stats > budget if status == allocation_numba.NO_FINITE
                else status == allocation_numba.OVER_BUDGET)
        return Allocation(widths, u, payload, stats, budget, over, kernel="numba")
    log_f = _ranked(log_f, energy_exponent)
    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()):
        widths = _widths_for(log_f, zero, 0.0, max_width)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)
    u_lo = 4.0 - C_SLOPE * float(log_f[finite].max()) - 1.0  # every finite super-group at 2 bits
    u_hi = float(max_width) - C_SLOPE * float(log_f[finite].min())  # every one at max_width
    cheapest = _widths_for(log_f, zero, u_lo, max_width)
    if cost(cheapest) + stats > budget:
        return Allocation(cheapest, u_lo, cost(cheapest), stats, budget, True)
    richest = _widths_for(log_f, zero, u_hi, max_width)
    if cost(richest) + stats <= budget:
        return Allocation(richest, u_hi, cost(richest), stats, budget, False)
    search = _Bracket(log_f, zero, lookup, budget - stats, (u_lo, cheapest), (u_hi, richest),
                      max_width)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if search.feasible(mid):
            u_lo = mid
        else:
            u_hi = mid
    widths = _widths_for(log_f, zero, u_lo, max_width)
    return Allocation(widths, u_lo, cost(widths), stats, budget, False)


def allocate_for_target_paper(
    norm2: torch.Tensor,
    mean_sum: torch.Tensor,
    valid: torch.Tensor,
    target: float,
    *,
    world_size: int,
    rho: float,
    error_per_energy: torch.Tensor,
    scales: Scales = Scales.HIERARCHICAL,
    max_width: int = RAW_WIDTH,
    stats_bytes: int = STATS_BYTES["fp32"],
) -> Allocation:
    """The cheapest widths of the paper's rule whose predicted vNMSE is at most ``target`` (as
    the hull rule's ``allocate_for_target``)."""
    stats = stats_bytes * norm2.numel()
    finite_f, energy = target_energy(norm2.detach().to("cpu", torch.float64), mean_sum, valid,
                                     world_size, rho)
    lookup = cost_lookup(scales)
    log_f, zero = _log2_norms(norm2)
    log_f = _ranked(log_f)
    finite = torch.isfinite(log_f) & ~zero

    def widths(u: float) -> torch.Tensor:
        return _widths_for(log_f, zero, u, max_width)

    def error(widths: torch.Tensor) -> float:
        return predicted_vnmse(widths, finite_f, energy, error_per_energy)

    def result(widths: torch.Tensor, u: float) -> Allocation:
        payload = int(lookup[widths].sum().item())
        predicted = error(widths)
        return Allocation(widths, u, payload, stats, payload + stats, False, predicted,
                          predicted <= target)

    if not bool(finite.any()):
        return result(widths(0.0), float("nan"))
    u_lo = 4.0 - C_SLOPE * float(log_f[finite].max()) - 1.0  # everything at 2 bits
    u_hi = float(max_width) - C_SLOPE * float(log_f[finite].min())  # everything at max_width
    u = smallest_u_meeting(lambda u: error(widths(u)), target, u_lo, u_hi)
    return result(widths(u), u)


class _Bracket:
    """A known-feasible and a known-infeasible ``u`` and the rows whose widths differ between them;
    exact, because every row's width is monotone in ``u``."""

    # at most this many active rows are evaluated in Python floats (same IEEE ops, less overhead)
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
        self._rows: list[tuple[float, int, int]] | None = None  # the Python-float mode

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
            self._rows = list(zip(self.log_f.tolist(), self.w_lo.tolist(), self.w_hi.tolist(),
                                  strict=True))
        widths = [_width_of(lf, u, self.max_width) for lf, _, _ in self._rows]
        ok = self.base + sum(self._costs[w] for w in widths) <= self.limit
        rows = []
        for (lf, w_lo, w_hi), w in zip(self._rows, widths, strict=True):
            if w == (w_hi if ok else w_lo):
                self.base += self._costs[w]  # settled
            else:
                rows.append((lf, w, w_hi) if ok else (lf, w_lo, w))
        self._rows = rows
        if ok:
            self.u_lo = u
        else:
            self.u_hi = u
        return ok


def _compiled_allocation() -> Callable[..., tuple[int, float, int]] | None:
    """The compiled allocation where the CPU kernels are numba's; None: the reference above."""
    from dqcoll.kernels import dynamiq_ops

    if dynamiq_ops(torch.device("cpu")).name != "numba":
        return None
    from dqcoll.kernels.allocation_numba import allocate

    return allocate
