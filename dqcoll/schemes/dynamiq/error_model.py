"""Predicting a DynamiQ all-reduce's vNMSE from the statistics every rank already has
(``target_vnmse``): the model, its terms and its validation are docs/target_vnmse.md's, "The
model". The ranks' correlation and the crests are measured from a call's decoded aggregate (the
same on every rank) for the next call; the first assumes ``rho = 0`` and a Gaussian crest.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...kernels.codec import CodecConfig, Levels, RoundingMode, Scales
from ..base import ScheduleShape

__all__ = [
    "CALIBRATION",
    "CORRELATED_FACTOR",
    "CREST_EXPONENT",
    "EPSILON",
    "UNCERTAINTY",
    "ErrorModel",
    "estimate_row_rho",
    "measure_crests",
    "path_growth",
    "predicted_vnmse",
    "row_error_terms",
    "row_moments",
    "shape_factor",
]

# Relative error of one compress/decompress of N(0, 1) coordinates per (levels, scales) and width
# (tests/test_error_model.py re-measures them).
EPSILON: dict[tuple[Levels, Scales], dict[int, float]] = {
    (Levels.NONUNIFORM, Scales.HIERARCHICAL): {2: 7.031e-01, 4: 1.323e-02, 8: 7.867e-05,
                                               16: 4.14e-08},
    (Levels.NONUNIFORM, Scales.FLAT): {2: 9.002e-01, 4: 1.674e-02, 8: 8.579e-05, 16: 4.14e-08},
    (Levels.UNIFORM, Scales.HIERARCHICAL): {2: 7.031e-01, 4: 1.470e-02, 8: 4.740e-05,
                                            16: 4.14e-08},
    (Levels.UNIFORM, Scales.FLAT): {2: 9.002e-01, 4: 1.898e-02, 8: 5.929e-05, 16: 4.14e-08},
    # the default format (also the allocation's thresholds, allocation.MEASURED_ERRORS)
    (Levels.TUNED, Scales.HIERARCHICAL4X32): {
        2: 0.9603, 3: 0.09573, 4: 0.01772, 5: 0.00391, 6: 9.168e-4, 7: 2.224e-4, 8: 5.649e-5,
        16: 4.141e-8},
    (Levels.TUNED, Scales.HIERARCHICAL): {
        2: 0.7032, 3: 0.07086, 4: 0.01299, 5: 0.00286, 6: 6.856e-4, 7: 1.723e-4, 8: 4.442e-5,
        16: 4.141e-8},
}
# Error with correlated / with independent rounding, per algorithm, at n = 8 (docs/ablation.md).
CORRELATED_FACTOR: dict[str, float] = {"ring": 0.78, "butterfly": 0.94, "direct": 0.95}
_DEFAULT_CORRELATED_FACTOR = 0.9

# Data of crest C (energy-weighted 16 max_g^2 / ||g||^2 over groups of 16) costs
# (C / CREST_GAUSSIAN) ** CREST_EXPONENT[b] times EPSILON at width b (tools/target_eval.py fits it).
CREST_GAUSSIAN = 4.55
CREST_EXPONENT: dict[int, float] = {2: 0.62, 3: 0.97, 4: 0.96, 5: 0.99, 6: 1.03, 7: 1.04,
                                    8: 1.18, 16: 0.0}
CREST_GROUP = 16


# The residual calibration and the factor to its upper bound, which the allocation spends bits
# to meet (tools/target_eval.py; docs/target_vnmse.md).
CALIBRATION = 0.943
UNCERTAINTY = 1.197


@dataclasses.dataclass(frozen=True)
class ErrorModel:
    """The model's free parameters (see the module docstring)."""

    # the ranks' average pairwise correlation; None: measured by the previous call (0 until then)
    rho: float | None = None
    kappa: float = 1.0  # multiplicative calibration from measured errors (the DDP hook's)
    # the crest per width (``measure_crests``); None: measured by the previous call
    crests: dict[int, float] | None = None
    calibration: float | None = None  # None: CALIBRATION
    uncertainty: float | None = None  # None: UNCERTAINTY

    @property
    def central(self) -> float:
        """The residual calibration factor in force (``kappa`` excluded)."""
        return CALIBRATION if self.calibration is None else self.calibration

    @property
    def spread(self) -> float:
        """The factor from the central prediction to its upper bound."""
        return UNCERTAINTY if self.uncertainty is None else self.uncertainty

    def epsilon(self, config: CodecConfig, crests: dict[int, float] | None = None
                ) -> torch.Tensor:
        """Per-width relative error (a table indexed 0..16) on data of the given crests."""
        table = torch.zeros(17, dtype=torch.float64)
        for width, eps in EPSILON[(config.levels, config.scales)].items():
            table[width] = eps * shape_factor(width, crests)
        return table

    def error_per_energy(
        self, schedule: ScheduleShape | None, config: CodecConfig, rho: float,
        crests: dict[int, float] | None = None,
    ) -> torch.Tensor:
        """Predicted final error per unit of summed energy ``F_s``, by width (a lookup table
        indexed 0..16): ``calibration * kappa * gamma * G(eps_b)``."""
        if schedule is None:  # outside a collective: one quantization of local data
            return self.central * self.kappa * self.epsilon(config, crests)
        return self.unit_error(schedule, config, crests) * path_growth(schedule, rho)

    def unit_error(self, schedule: ScheduleShape, config: CodecConfig,
                   crests: dict[int, float] | None = None) -> torch.Tensor:
        """:meth:`error_per_energy` without the path growth ``H``: the error of one quantization
        of a unit of partial-sum energy (hop widths weigh each partial-sum size on its own)."""
        eps = self.epsilon(config, crests)
        gamma = 1.0
        if config.rounding is RoundingMode.CORRELATED:
            gamma = CORRELATED_FACTOR.get(schedule.algorithm, _DEFAULT_CORRELATED_FACTOR)
        eps[2] *= 1.0 + 0.2 * math.log2(max(schedule.world_size, 1))  # 2-bit errors compound
        return self.central * self.kappa * gamma * eps


def shape_factor(width: int, crests: dict[int, float] | None) -> float:
    """``(C_b / CREST_GAUSSIAN) ** CREST_EXPONENT[b]`` (1 without crests); ``crests`` maps a width
    to its measured crest and 0 to the crest of all rows (the fallback)."""
    if not crests:
        return 1.0
    crest = crests.get(width, crests.get(0))
    if crest is None or not crest > 0.0 or not math.isfinite(crest):
        return 1.0
    return (crest / CREST_GAUSSIAN) ** CREST_EXPONENT.get(width, 1.0)


def row_moments(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``rows`` (fp32 ``[S, 256]``): ``(||row||^2, sum 16 max_g^2 over its groups of
    16)``, float64 on the CPU, from one fp32 pass (squares that overflow read as non-finite)."""
    groups = rows.detach().reshape(rows.shape[0], -1, CREST_GROUP)
    energy = groups.square().sum(-1).double().sum(-1)
    peak = groups.abs().amax(-1).square().double().sum(-1) * CREST_GROUP
    return energy.cpu(), peak.cpu()


def measure_crests(rows: torch.Tensor, widths: torch.Tensor,
                   moments: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[int, float]:
    """Energy-weighted crest of ``rows`` (fp32 ``[S, 256]``) per width each row was sent at
    (``widths``, int ``[S]``), and of every row under key 0; zero and non-finite rows left out.
    ``moments``: :func:`row_moments` of ``rows``, when already computed."""
    energy, peak = row_moments(rows) if moments is None else moments
    ok = torch.isfinite(energy) & torch.isfinite(peak) & (energy > 0)
    widths = widths.cpu()
    crests: dict[int, float] = {}
    for width in [0, *sorted(set(widths[ok].tolist()))]:
        pick = ok if width == 0 else ok & (widths == width)
        total = float(energy[pick].sum())
        if total > 0.0:
            crests[int(width)] = float(peak[pick].sum()) / total
    return crests


def path_growth(schedule: ScheduleShape, rho: float = 0.0) -> float:
    """``H``: expected sum over a chunk's quantizations of ``||partial sum||^2``, in units of the
    summed energy ``F``, averaged over chunks."""
    n, sizes = schedule.world_size, schedule.subtree_sizes()
    return sum(sizes[rank][chunk] * (1.0 + (sizes[rank][chunk] - 1) * rho)
               for chunk in range(n) for rank in range(n)) / (n * n)


def predicted_vnmse(
    widths: torch.Tensor, norm2: torch.Tensor, energy: float, error_per_energy: torch.Tensor
) -> float:
    """Predicted vNMSE of an allocation: ``sum_s error_per_energy[width_s] F_s / energy``
    (``energy``: the estimated squared norm of the exact sum)."""
    if energy <= 0.0:
        return 0.0
    return float((error_per_energy[widths] * norm2).sum() / energy)


def row_error_terms(norm2: torch.Tensor, widths: dict[int, torch.Tensor],
                    classes: dict[int, tuple[float, float]] | None, table: torch.Tensor,
                    world_size: int) -> torch.Tensor:
    """The model's expected squared error of each super-group's decoded aggregate as ``A_s +
    B_s rho_s`` (float64 ``[2, S]``, buffer order); without hop widths (``classes`` None)
    ``B_s = 0`` and ``table`` holds the path growth at the call's rho."""
    f = torch.nan_to_num(norm2.detach().to("cpu", torch.float64), 0.0, 0.0, 0.0)
    table = table.to(torch.float64)
    terms = torch.zeros(2, f.shape[0], dtype=torch.float64)
    if not classes:
        terms[0] = table[widths[0].cpu()] * f
        return terms
    for c, (alpha, _) in classes.items():
        part = alpha / world_size * table[widths[c].cpu()] * f
        terms[0] += part
        terms[1] += (c - 1) * part
    return terms


def estimate_row_rho(rows: torch.Tensor, summed_norm2: torch.Tensor, order: torch.Tensor,
                     world_size: int, terms: torch.Tensor | None = None,
                     decoded_energy: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, float | None]:
    """Per super-group ``rho_s`` (float64 ``[S]``, buffer row order, clamped to [-1/(n-1), 1]; 0
    where ``F_s`` is zero or not finite) and their ``F``-weighted mean (None without energy),
    from the decoded aggregate ``rows`` and ``summed_norm2`` (layout order; ``order[i]`` is the
    buffer row of layout row ``i``): ``rho_s = (||S^_s||^2 - A_s - F_s) / ((n - 1) F_s + B_s)``
    with the call's own expected error ``terms`` (:func:`row_error_terms`) taken off."""
    n = max(world_size, 2)
    decoded = (row_moments(rows)[0] if decoded_energy is None
               else decoded_energy.to("cpu", torch.float64))
    f = summed_norm2.double()
    a, b = (torch.zeros_like(f),) * 2 if terms is None else terms.to("cpu", torch.float64)
    ok = torch.isfinite(decoded) & torch.isfinite(f) & (f > 0)
    safe_f = torch.where(ok, f, 1.0)
    rho = torch.where(ok, (decoded - a - safe_f) / ((n - 1) * safe_f + b), 0.0)
    rho = rho.clamp(-1.0 / (n - 1), 1.0)
    out = torch.zeros(rows.shape[0], dtype=torch.float64)
    out[order] = rho
    total = float(f[ok].sum())
    mean = float((f[ok] * rho[ok]).sum()) / total if total > 0 and world_size > 1 else None
    return out, mean

