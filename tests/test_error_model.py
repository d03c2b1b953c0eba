"""Error-targeted DynamiQ: the error model's parts and target_vnmse end to end."""

from __future__ import annotations

import pytest
import torch

import dqcoll
from dqcoll.errors import InvalidArgumentError
from dqcoll.kernels import codec as C
from dqcoll.metrics import vnmse
from dqcoll.schemes.dynamiq import DynamiqFormat
from dqcoll.schemes.dynamiq.error_model import (
    CREST_GAUSSIAN,
    EPSILON,
    ErrorModel,
    estimate_row_rho,
    measure_crests,
    path_growth,
    shape_factor,
)
from dqcoll.testing import run_local
from dqcoll.topology import build_schedule
from dqcoll.topology.sources import make_source


@pytest.mark.parametrize("levels, scales, width", [
    *[(C.Levels.NONUNIFORM, C.Scales.HIERARCHICAL, w) for w in (2, 4, 8, 16)],
    *[(C.Levels.TUNED, C.Scales.HIERARCHICAL4X32, w) for w in C.ALL_WIDTHS],
])
def test_epsilon_table_matches_the_codec(levels: C.Levels, scales: C.Scales, width: int) -> None:
    """EPSILON is the single-shot error of the reference codec on Gaussian data: re-measured
    here, it agrees within 10 % (so a codec change cannot silently stale the model)."""
    rows = 1024
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(11))
    centred, _, _ = C.stats_center_torch(x, torch.full((rows,), 256))
    cfg = C.CodecConfig(levels=levels, scales=scales, rounding=C.RoundingMode.INDEPENDENT)
    records = C.encode_torch(centred, width, torch.arange(rows) * 256, 0, 1, 5, cfg)
    measured = vnmse(C.decode_torch(records, width, cfg), centred)
    expected = EPSILON[(levels, scales)][width]
    assert measured == pytest.approx(expected, rel=0.1)


@pytest.mark.parametrize("n", [2, 5, 8, 16])
def test_growth_factors(n: int) -> None:
    """Ring: every chunk is quantized with 1, 2, ..., n contributions, so H = (n + 1) / 2;
    direct: n - 1 leaves and the sink, H = ((n - 1) + n) / n; with identical ranks (rho = 1) a
    node's energy grows with the square of its subtree."""
    assert path_growth(build_schedule("ring", n)) == pytest.approx((n + 1) / 2)
    assert path_growth(build_schedule("direct", n)) == pytest.approx((2 * n - 1) / n)
    ring_rho1 = sum(k * k for k in range(1, n + 1)) / n
    assert path_growth(build_schedule("ring", n), rho=1.0) == pytest.approx(ring_rho1)
    butterfly, ring = (path_growth(build_schedule(a, n)) for a in ("butterfly", "ring"))
    assert butterfly < ring or n == 2


def test_bits_and_target_are_exclusive() -> None:
    """Giving both bits and target_vnmse is an error on every rank; so is a target for a scheme
    without an error model."""

    def body(comm):  # type: ignore[no-untyped-def]
        out = []
        for kwargs in ({"bits": 5.0, "target_vnmse": 1e-3},
                       {"scheme": "none", "target_vnmse": 1e-3}):
            try:
                dqcoll.allreduce(torch.ones(300), **kwargs)
                out.append(None)
            except InvalidArgumentError as exc:
                out.append(str(exc))
        return out

    for both, none in run_local(2, body):
        assert both is not None and "not both" in both
        assert none is not None and "target_vnmse" in none


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
def test_target_is_met_and_rho_is_learned(algorithm: str) -> None:
    """On correlated Gaussian ranks (shared = 0.5), the second call (rho measured after the first)
    achieves vNMSE within 0.5..1.5 of a 1e-3 target, and the measured rho is close to 0.5."""
    source = make_source("gaussian:shared=0.5", world_size=8, numel=1 << 15, seed=3)
    tensors = source.tensors()
    exact = source.exact_sum()

    def body(comm):  # type: ignore[no-untyped-def]
        out = []
        for call in range(2):
            x = tensors[comm.rank].clone()
            dqcoll.allreduce(x, algorithm=algorithm, target_vnmse=1e-3, seed=call)
            out.append((x, dict(comm.last_info)))
        return out

    results = run_local(8, body)
    (_, first), (x, second) = results[0]
    assert first["rho"] == 0.0
    assert second["rho"] == pytest.approx(0.5, abs=0.05)
    assert 0.5 <= vnmse(x, exact) / 1e-3 <= 1.5
    assert second["predicted_vnmse"] <= 1e-3
    for other in results[1:]:
        assert torch.equal(other[1][0], x)


# -- the data's shape and per-row correlation ------------------------------------------------------


def test_measure_crests_of_gaussian_rows_per_width() -> None:
    """The energy-weighted crest of Gaussian rows is CREST_GAUSSIAN (within 3 %); per width it
    covers only that width's rows (rows with one spike per group have crest ~16); zero rows are
    left out."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(512, 256, generator=g)
    spiky = torch.zeros(256, 256)
    spiky[:, ::16] = 1.0  # one non-zero per group of 16: 16 max^2 / ||g||^2 = 16
    rows = torch.cat([x, spiky, torch.zeros(4, 256)])
    widths = torch.cat([torch.full((512,), 6), torch.full((256,), 8), torch.full((4,), 0)])
    crests = measure_crests(rows, widths)
    assert crests[6] == pytest.approx(CREST_GAUSSIAN, rel=0.03)
    assert crests[8] == pytest.approx(16.0)
    assert set(crests) == {0, 6, 8}
    assert CREST_GAUSSIAN < crests[0] < 16.0


@pytest.mark.parametrize("width", [4, 6, 8])
def test_crest_term_predicts_the_codec_on_heavy_tails(width: int) -> None:
    """On Student-t(3) coordinates the codec's single-shot error is 1.7-2.3x EPSILON (the
    Gaussian's); EPSILON times shape_factor of the measured crest agrees within 12 %."""
    rows = 1024
    g = torch.Generator().manual_seed(12)
    chi2 = (torch.randn(rows, 256, 3, generator=g) ** 2).sum(-1)
    x = torch.randn(rows, 256, generator=g) / torch.sqrt(chi2 / 3)
    centred, _, _ = C.stats_center_torch(x, torch.full((rows,), 256))
    cfg = C.CodecConfig(levels=C.Levels.TUNED, scales=C.Scales.HIERARCHICAL4X32,
                        rounding=C.RoundingMode.INDEPENDENT)
    records = C.encode_torch(centred, width, torch.arange(rows) * 256, 0, 1, 5, cfg)
    measured = vnmse(C.decode_torch(records, width, cfg), centred)
    gaussian = EPSILON[(cfg.levels, cfg.scales)][width]
    crests = measure_crests(centred, torch.full((rows,), width))
    assert measured > 1.5 * gaussian  # the Gaussian table alone under-predicts
    assert measured == pytest.approx(gaussian * shape_factor(width, crests), rel=0.12)


def test_row_rho_estimate() -> None:
    """rho_s = (||S_s||^2 - A_s - F_s) / ((n - 1) F_s + B_s) per row, returned in buffer order,
    clamped, 0 for rows of zero summed energy; the buffer's rho is their F-weighted mean; the
    expected error A_s + B_s rho_s is not read as correlation."""
    n = 4
    rows = torch.tensor([[2.0] * 256, [1.0] * 256, [0.0] * 256, [9.0] * 256])  # layout order
    f = torch.tensor([256.0, 256.0, 0.0, 1.0])  # summed norms, layout order
    order = torch.tensor([2, 0, 3, 1])
    rho, mean = estimate_row_rho(rows, f, order, n)
    assert rho[2] == pytest.approx(1.0)  # ||S||^2 = 1024 = 4 F: fully correlated
    assert rho[0] == pytest.approx(0.0)  # ||S||^2 = F
    assert rho[3] == 0.0  # zero energy
    assert rho[1] == 1.0  # clamped
    assert mean == pytest.approx((256.0 * 1.0 + 256.0 * 0.0 + 1.0 * 1.0) / 513.0)
    # decoded 1024 = F (1 + 3 rho) + A + B rho with F = 256, A = 64, B = 192: rho = 704 / 960
    terms = torch.tensor([[64.0, 0.0, 0.0, 0.0], [192.0, 0.0, 0.0, 0.0]])
    rho, _ = estimate_row_rho(rows, f, order, n, terms)
    assert rho[2] == pytest.approx(704.0 / 960.0)


def test_target_holds_on_heavy_tailed_sparse_ranks() -> None:
    """The issue's failure in small: Student-t(3) coordinates with half super-groups zero per
    rank (8 ranks, ring, target 1e-3). The Gaussian-only model overshot such data by ~1.4x;
    from the second call on (crests and rho measured) the achieved vNMSE is within 0.6..1.1 of
    the target and target_met says True; the first call does not claim it."""
    source = make_source("lognormal-mixture:supergroups=512;dof=3;sparsity=0.5", world_size=8,
                         seed=5)
    tensors = source.tensors()
    exact = source.exact_sum()

    def body(comm):  # type: ignore[no-untyped-def]
        out = []
        for call in range(2):
            x = tensors[comm.rank].clone()
            dqcoll.allreduce(x, algorithm="ring", target_vnmse=1e-3, seed=call)
            out.append((x, dict(comm.last_info)))
        return out

    results = run_local(8, body)
    (_, first), (x, second) = results[0]
    assert first["target_met"] is False and second["target_met"] is True
    assert second["crests"] is not None and second["crests"][0] > 1.5 * CREST_GAUSSIAN
    assert second["predicted_vnmse"] <= second["predicted_vnmse_upper"] <= 1e-3
    assert 0.6 <= vnmse(x, exact) / 1e-3 <= 1.1
    for other in results[1:]:
        assert torch.equal(other[1][0], x)


def test_fixed_crests_and_calibration_are_used() -> None:
    """ErrorModel(crests=...) fixes the shape (a first call then may claim the target met), and
    the calibration scales the prediction: twice the calibration, twice the predicted vNMSE at
    the same widths."""
    model = ErrorModel(calibration=2.0, uncertainty=1.0)
    schedule = build_schedule("ring", 4)
    cfg = C.CodecConfig(levels=C.Levels.TUNED, scales=C.Scales.HIERARCHICAL4X32)
    base = ErrorModel(calibration=1.0, uncertainty=1.0).unit_error(schedule, cfg)
    assert torch.allclose(model.unit_error(schedule, cfg), 2.0 * base)
    heavy = base.clone()
    heavy[8] *= shape_factor(8, {8: 2 * CREST_GAUSSIAN})
    assert torch.allclose(ErrorModel(calibration=1.0, uncertainty=1.0).unit_error(
        schedule, cfg, {8: 2 * CREST_GAUSSIAN})[8], heavy[8])

    def body(comm):  # type: ignore[no-untyped-def]
        x = torch.randn(1 << 13, generator=torch.Generator().manual_seed(comm.rank))
        dqcoll.allreduce(x, algorithm="ring", target_vnmse=1e-2,
                         format=DynamiqFormat(error_model=ErrorModel(crests={0: CREST_GAUSSIAN})))
        return dict(comm.last_info)

    info = run_local(4, body)[0]
    assert info["target_met"] is True and info["crests"] == {0: CREST_GAUSSIAN}
