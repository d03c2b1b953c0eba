"""DynamiQ's departures from the paper (docs/dense_gap.md): finer widths, 4-bit group codes,
hull thresholds, hop widths, and the prototype encodings measured beside them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import dqcoll
from dqcoll.kernels import codec
from dqcoll.metrics import vnmse
from dqcoll.schemes.dynamiq.allocation import count_classes, hull_offsets
from dqcoll.testing import run_local
from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.simulator import simulate
from dqcoll_lab.dynamiq import research_format, research_scheme, scheme_options


@pytest.mark.parametrize("width", codec.FINE_WIDTHS)
def test_bitstream_packing_lsb_first(width: int) -> None:
    codes = torch.randint(0, 2**width, (3, codec.SUPER), generator=torch.Generator().manual_seed(1))
    packed = codec.pack_codes(codes, width)
    assert packed.shape == (3, 32 * width)
    assert torch.equal(codec.unpack_codes(packed, width), codes)
    bits = [(int(packed[0, i // 8]) >> (i % 8)) & 1 for i in range(codec.SUPER * width)]
    for j in (0, 1, 37, 255):  # code j at bit j * width
        assert sum(bits[j * width + t] << t for t in range(width)) == int(codes[0, j])


@pytest.mark.parametrize("scales", list(codec.ProtoScales))
def test_proto_scales_round_trip_never_clip(scales: codec.ProtoScales) -> None:
    x = torch.randn(16, codec.SUPER, generator=torch.Generator().manual_seed(2))
    x[3] *= 1e-6
    x[4, :16] = 0.0
    config = codec.CodecConfig(levels=codec.Levels.TUNED, scales=scales)
    for width in codec.FINE_WIDTHS:
        records = codec.encode_torch(x, width, torch.arange(16) * codec.SUPER, 0, 1, 3, config)
        assert records.shape[1] == codec.record_nbytes(width, scales)
        decoded = codec.decode_torch(records, width, config)
        # unbiased rounding between levels of a scale >= |x|: error below one scale per value
        assert float(((decoded - x) ** 2).sum() / (x**2).sum()) < 1.0


def test_hull_offsets_reproduce_the_paper_rule() -> None:
    hull, offsets = hull_offsets((2, 4, 8), {w: 4.0**-w for w in (2, 4, 8)},
                                 codec.Scales.HIERARCHICAL)
    assert hull == [2, 4, 8]
    assert offsets[2] - offsets[1] == pytest.approx(math.log2(512 / 17))


def test_count_classes_ring() -> None:
    classes = count_classes(build_schedule("ring", 8).subtree_sizes())
    assert sorted(classes) == list(range(1, 9))
    assert sum(t for _, t in classes.values()) == pytest.approx(1.0)
    assert classes[8] == (8.0, 0.5)


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
def test_hop_widths_simulator_equals_local(algorithm: str) -> None:
    n, numel = 4, 1 << 14
    options = {"format": research_format(stats="bf16", width_set="fine", thresholds="measured",
                                         levels="tuned", scales="hierarchical4", max_width=16,
                                         hop_widths=True)}

    class Data:
        world_size = n

        def __init__(self) -> None:
            self.numel = numel

        def rank_tensor(self, rank: int) -> torch.Tensor:
            return torch.randn(numel, generator=torch.Generator().manual_seed(10 + rank))

    data = Data()

    def body(comm):  # type: ignore[no-untyped-def]
        x = data.rank_tensor(comm.rank)
        dqcoll.allreduce(x, algorithm=algorithm, bits=5.0, seed=4, **options)
        return x

    results = run_local(n, body)
    exact = sum(data.rank_tensor(r).double() for r in range(n))
    assert all(torch.equal(results[0], r) for r in results)
    sim = simulate(build_schedule(algorithm, n), data, scheme="dynamiq", bits=5.0, seed=4,
                   **options)
    assert sim.vnmse == pytest.approx(vnmse(results[0], exact), rel=1e-12)


def _call_ops(monkeypatch: pytest.MonkeyPatch, **options: object) -> str:
    from dqcoll.kernels import numba_available

    if numba_available() is not None:
        pytest.skip("numba is not importable")
    monkeypatch.setenv("DQCOLL_KERNELS", "numba")
    options = {"bits": 5.0, **options}
    scheme = research_scheme(**options)  # type: ignore[arg-type]
    x = torch.randn(4 * codec.SUPER, generator=torch.Generator().manual_seed(5))
    payload = scheme.encode(x)
    assert torch.isfinite(scheme.decode(payload)).all()
    return str(payload["call"].ops.name)


def _numba_implements(scales: str, width: int) -> bool:
    from dqcoll.kernels import dynamiq_numba

    return dynamiq_numba.OPS.implements(codec.Scales(scales), [width])


_PAPER = {"scales": "hierarchical", "width_set": "paper"}  # what every fast path implements


@pytest.mark.parametrize("options, expect", [
    ({"scales": "hierarchical4"}, "torch"),  # a prototype encoding: never in the kernels
    ({}, "formats"),  # the default format: whatever numba's FORMATS says
    ({"width_set": "fine", "bits": 7.0, "scales": "hierarchical"}, "formats"),  # 6-bit rows
    (_PAPER, "numba"),
    ({**_PAPER, "thresholds": "paper"}, "numba"),  # changes the allocation only
    ({**_PAPER, "max_width": 8}, "numba"),
    ({**_PAPER, "levels": "nonuniform"}, "numba"),  # level tables are data
    ({**_PAPER, "stats": "bf16"}, "numba"),  # statistics by torch ops, the codec on the kernels
    ({**_PAPER, "stats": "fp32"}, "numba"),
    ({**_PAPER, "hop_widths": False}, "numba"),
], ids=lambda o: ",".join(map(str, o.items())) if isinstance(o, dict) else o)
def test_calls_route_by_what_the_kernels_implement(
        monkeypatch: pytest.MonkeyPatch, options: dict[str, object], expect: str) -> None:
    """A call runs on the kernels exactly when they implement its scales and every width it
    uses (``DynamiqOps.formats``); otherwise on the torch reference, which gives the same bytes."""
    if expect == "formats":
        scales = str(options.get("scales", "hierarchical4x32"))
        width = 4 if "bits" not in options else 6
        expect = "numba" if _numba_implements(scales, width) else "torch"
    assert _call_ops(monkeypatch, **options) == expect


def test_prototype_option_checks() -> None:
    from dqcoll.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="error model"):
        research_scheme(target_vnmse=1e-3, scales="hierarchical4")
    with pytest.raises(InvalidArgumentError):
        research_scheme(thresholds="measured", levels="uniform")
    with pytest.raises(InvalidArgumentError):
        research_scheme(stats="fp16")
    assert "hop_widths=True" in repr(research_scheme(hop_widths=True))


class _HalfZero:
    """4 ranks, i.i.d. N(0, 1) with every other super-group zero on every rank."""

    world_size = 4
    numel = 64 * codec.SUPER

    def rank_tensor(self, rank: int) -> torch.Tensor:
        x = torch.randn(self.numel, generator=torch.Generator().manual_seed(40 + rank))
        x.view(-1, codec.SUPER)[1::2] = 0.0
        return x


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
def test_every_bit_of_the_budget_buys_accuracy(algorithm: str) -> None:
    """With many all-zero super-groups, budgets 5 < 6 < 7 < 8.5 give strictly decreasing vNMSE
    and spend what they are given (raw 16 under a budget); the paper's configuration, capped at 8
    bits, stops improving."""
    data, schedule = _HalfZero(), build_schedule(algorithm, 4)
    errors, bits = [], []
    for budget in (5.0, 6.0, 7.0, 8.5):
        result = simulate(schedule, data, bits=budget, seed=1)
        errors.append(result.vnmse)
        bits.append(result.bits_used)
        assert result.bits_used <= budget and result.bits_used > budget - 0.6, (budget, bits)
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    paper = [simulate(schedule, data, bits=b, seed=1,
                      **scheme_options(max_width=8, width_set="paper")).vnmse
             for b in (7.0, 8.5)]
    assert paper[0] == paper[1] > errors[-1]
