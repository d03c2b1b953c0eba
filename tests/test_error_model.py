"""Error-targeted DynamiQ: the error model's parts and target_vnmse end to end."""

from __future__ import annotations

import pytest
import torch

import dqcoll
from dqcoll.errors import InvalidArgumentError
from dqcoll.eval.sources import make_source
from dqcoll.metrics import vnmse
from dqcoll.schemes.dynamiq import codec as C
from dqcoll.schemes.dynamiq.error_model import EPSILON, estimate_rho, path_growth
from dqcoll.testing import run_local
from dqcoll.topology import build_schedule


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


def test_rho_estimate_formula_and_range() -> None:
    """rho_hat = (||S||^2 / F - 1) / (n - 1), clamped to [-1/(n-1), 1]; undefined cases give
    None."""
    assert estimate_rho(8.0, 4.0, 5) == pytest.approx(0.25)
    assert estimate_rho(100.0, 1.0, 3) == 1.0
    assert estimate_rho(0.0, 1.0, 3) == pytest.approx(-0.5)
    assert estimate_rho(1.0, 0.0, 3) is None
    assert estimate_rho(1.0, 1.0, 1) is None


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
