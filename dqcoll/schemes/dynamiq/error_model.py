"""Predicting a DynamiQ all-reduce's vNMSE from the statistics every rank already has.

``target_vnmse`` replaces the bit budget with an error budget. The widths are still the closed
form of :mod:`.allocation` with one free parameter ``u``; instead of the cheapest ``u`` that fits
a byte budget we pick the cheapest ``u`` whose *predicted* vNMSE meets the target. The prediction
uses only the all-reduced per-super-group statistics (summed squared norm ``F_s`` after centring,
summed mean), so it costs no communication and every rank picks the same widths.

Model, for super-group ``s`` at width ``b``:

* One quantization of a vector ``v`` at width ``b`` adds error ``eps_b * ||v||^2`` (relative error
  of one compress/decompress, table :data:`EPSILON`).
* In a schedule every rank quantizes every chunk once: rank ``v`` quantizes the partial sum of the
  ``T = |subtree(v, c)|`` contributions below it (1 at a leaf, ``n`` at the sink). With the ranks'
  centred inputs of equal expected energy ``F_s / n`` and average pairwise correlation ``rho``,
  ``E||S_v||^2 = T (1 + (T - 1) rho) F_s / n``. Summing over the nodes of each chunk's tree and
  averaging over chunks gives the schedule's growth factor ``H`` (:func:`path_growth`): ring
  ``(n + 1) / 2`` at ``rho = 0``, butterfly about ``1 + log2(n) / 2``, direct about 2.
* Correlated rounding cancels part of the hops' errors: a factor ``gamma`` (0.85; the measured
  ratio was 0.71-0.90 over our sources at n = 8, see tests/test_dynamiq.py).
* The exact aggregate's energy is ``F (1 + (n - 1) rho)`` plus the (exactly known) summed means.

``predicted vNMSE = kappa * gamma * H * sum_s eps_{b_s} F_s / (F (1 + (n-1) rho) + sum_s
count_s mean_s^2)``, with ``kappa`` a multiplicative calibration (1 by default; the DDP hook's
error monitor updates it from measured vNMSE).

Assumptions and their limits: errors of different hops are uncorrelated (true for independent
rounding, approximately for correlated), every super-group's coordinates have the same
within-group shape as the calibration data, and ``rho`` is known. ``EPSILON`` is the geometric mean
of the single-shot error measured on Gaussian and Student-t(3) coordinates (`python
tools/calibrate_error_model.py` reprints the table), so both shapes are predicted within ~1.3x;
``rho = 0`` fits independent data and over-predicts the error of strongly correlated ranks (at
most by 1 / 0.57 for butterfly at n = 8, rho = 1), which ``kappa`` absorbs once measured.
"""

from __future__ import annotations

import dataclasses

import torch

from ...topology.schedule import Schedule
from .codec import CodecConfig, Levels, RoundingMode, Scales

__all__ = ["CORRELATED_FACTOR", "EPSILON", "ErrorModel", "path_growth", "predicted_vnmse"]

# Relative error of one compress/decompress per (levels, scales) and width: geometric mean of
# i.i.d. N(0,1) and Student-t(3) coordinates, 2048 super-groups each, independent rounding
# (tools/calibrate_error_model.py on the dev VM, commit of this table).
EPSILON: dict[tuple[Levels, Scales], dict[int, float]] = {
    (Levels.NONUNIFORM, Scales.HIERARCHICAL): {2: 7.539e-01, 4: 1.664e-02, 8: 7.692e-05, 16: 3.92e-08},
    (Levels.NONUNIFORM, Scales.FLAT): {2: 1.040e00, 4: 2.374e-02, 8: 8.510e-05, 16: 3.92e-08},
    (Levels.UNIFORM, Scales.HIERARCHICAL): {2: 7.539e-01, 4: 1.989e-02, 8: 6.564e-05, 16: 3.92e-08},
    (Levels.UNIFORM, Scales.FLAT): {2: 1.040e00, 4: 2.904e-02, 8: 9.413e-05, 16: 3.92e-08},
}
CORRELATED_FACTOR = 0.85


@dataclasses.dataclass(frozen=True)
class ErrorModel:
    """The model's free parameters (see the module docstring)."""

    rho: float = 0.0  # average pairwise correlation of the ranks' centred inputs
    kappa: float = 1.0  # multiplicative calibration from measured errors
    correlated_factor: float = CORRELATED_FACTOR

    def epsilon(self, config: CodecConfig) -> torch.Tensor:
        """Per-width relative error as a lookup table indexed by width (0..8)."""
        table = torch.zeros(17, dtype=torch.float64)
        for width, eps in EPSILON[(config.levels, config.scales)].items():
            table[width] = eps
        return table

    def factor(self, config: CodecConfig) -> float:
        gamma = self.correlated_factor if config.rounding is RoundingMode.CORRELATED else 1.0
        return self.kappa * gamma


def path_growth(schedule: Schedule, rho: float = 0.0) -> float:
    """``H``: expected sum over a chunk's quantizations of ``||partial sum||^2``, in units of the
    summed energy ``F``, averaged over chunks."""
    n = schedule.world_size
    sizes = schedule.subtree_sizes()
    total = 0.0
    for chunk in range(n):
        for rank in range(n):
            t = sizes[rank][chunk]
            total += t * (1.0 + (t - 1) * rho)
    return total / (n * n)


def predicted_vnmse(
    widths: torch.Tensor,
    norm2: torch.Tensor,
    energy: float,
    growth: float,
    model: ErrorModel,
    config: CodecConfig,
) -> float:
    """Predicted vNMSE of an allocation (``energy``: the estimated squared norm of the exact sum)."""
    if energy <= 0.0:
        return 0.0
    eps = model.epsilon(config)[widths]
    return float(model.factor(config) * growth * (eps * norm2).sum() / energy)
