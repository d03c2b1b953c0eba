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

Non-finite ``F`` (an Inf/NaN input, or a norm that overflowed fp32) gets 8 bits; NaN values then
flow through the records to every rank's output.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .codec import SUPER, WIDTHS, Scales, Widths, record_nbytes

__all__ = ["Allocation", "allocate_widths", "STATS_BYTES_PER_SUPER", "min_bits", "C_SLOPE"]

C_SLOPE = 4.0 / math.log2(512.0 / 17.0)
STATS_BYTES_PER_SUPER = 8  # fp32 mean and fp32 squared norm, all-reduced uncompressed
_BISECTION_STEPS = 64


@dataclasses.dataclass(frozen=True)
class Allocation:
    widths: torch.Tensor  # int64 [S] in {0, 2, 4, 8}
    u: float  # the allocation parameter found (nan when not searched)
    payload_nbytes: int  # sum of record sizes
    stats_nbytes: int
    budget_nbytes: int
    over_budget: bool  # even the cheapest allocation did not fit (tiny buffers)

    @property
    def total_nbytes(self) -> int:
        return self.payload_nbytes + self.stats_nbytes


def min_bits(scales: Scales = Scales.HIERARCHICAL) -> float:
    """The smallest budget that can hold every super-group at 2 bits, per coordinate."""
    return (record_nbytes(2, scales) + STATS_BYTES_PER_SUPER) * 8.0 / SUPER


def _widths_for(log_f: torch.Tensor, zero: torch.Tensor, u: float) -> torch.Tensor:
    v = C_SLOPE * log_f + u
    widths = torch.where(v >= 8.0, 8, torch.where(v >= 4.0, 4, 2))  # NaN v -> 2, fixed below
    widths = torch.where(torch.isnan(log_f), 8, widths)
    return torch.where(zero, 0, widths)


def allocate_widths(
    norm2: torch.Tensor,
    numel: int,
    bits: float,
    *,
    widths_mode: Widths = Widths.VARIABLE,
    scales: Scales = Scales.HIERARCHICAL,
) -> Allocation:
    """Widths for super-groups with summed squared norms ``norm2`` (fp32 [S]) under a budget of
    ``bits`` per coordinate over ``numel`` coordinates (records plus statistics)."""
    rows = norm2.numel()
    # On the host, in float64: every rank (and every device type) computes the same widths, and
    # the executor needs the payload sizes on the host anyway.
    norm2 = norm2.detach().to("cpu")
    stats = STATS_BYTES_PER_SUPER * rows
    budget = int(math.floor(bits * numel / 8.0))
    costs = torch.tensor([record_nbytes(w, scales) for w in (0, *WIDTHS)], dtype=torch.int64)
    lookup = torch.zeros(9, dtype=torch.int64)
    lookup[[0, *WIDTHS]] = costs

    def cost(widths: torch.Tensor) -> int:
        return int(lookup[widths].sum().item())

    if widths_mode is Widths.FIXED:
        widths = torch.full((rows,), 4, dtype=torch.int64)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)

    f = norm2.double()
    zero = f == 0
    log_f = torch.log2(torch.where(zero, 1.0, f))  # +inf for inf, nan for nan
    # +inf is a finite input whose squared norm overflowed fp32 (Inf/NaN inputs give NaN after
    # centring): rank it as the largest finite norm rather than spending 8 bits on it.
    log_f = torch.where(torch.isposinf(log_f), 128.0, log_f)
    finite = torch.isfinite(log_f) & ~zero
    if not bool(finite.any()):
        widths = _widths_for(log_f, zero, 0.0)
        payload = cost(widths)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)
    lo_log = float(log_f[finite].min())
    hi_log = float(log_f[finite].max())
    u_lo = 4.0 - C_SLOPE * hi_log - 1.0  # every finite super-group at 2 bits
    u_hi = 8.0 - C_SLOPE * lo_log  # every finite super-group at 8 bits
    cheapest = _widths_for(log_f, zero, u_lo)
    if cost(cheapest) + stats > budget:
        return Allocation(cheapest, u_lo, cost(cheapest), stats, budget, True)
    richest = _widths_for(log_f, zero, u_hi)
    if cost(richest) + stats <= budget:
        return Allocation(richest, u_hi, cost(richest), stats, budget, False)
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (u_lo + u_hi)
        if cost(_widths_for(log_f, zero, mid)) + stats <= budget:
            u_lo = mid
        else:
            u_hi = mid
    widths = _widths_for(log_f, zero, u_lo)
    return Allocation(widths, u_lo, cost(widths), stats, budget, False)
