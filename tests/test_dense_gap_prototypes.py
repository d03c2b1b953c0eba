"""Issue 14 prototypes: finer widths, 4-bit group codes, hull thresholds, hop widths."""

from __future__ import annotations

import math

import pytest
import torch

import dqcoll
from dqcoll.metrics import vnmse
from dqcoll.schemes.dynamiq import codec
from dqcoll.schemes.dynamiq.allocation import count_classes, hull_offsets
from dqcoll.testing import run_local
from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.simulator import simulate


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
    options = {"stats": "bf16", "width_set": "fine", "thresholds": "measured",
               "levels": "tuned", "scales": "hierarchical4", "max_width": 16,
               "hop_widths": True}

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


# Every option the kernels cannot honour, alone: each must run on the torch reference.
_REFERENCE_ONLY = [
    {"levels": "tuned"},
    {"scales": "hierarchical4"},
    {"scales": "hierarchical4x32"},
    {"width_set": "fine"},
    {"stats": "bf16"},
    {"stats": "norm16"},
    {"hop_widths": True},
]


def _call_ops(monkeypatch: pytest.MonkeyPatch, **options: object) -> str:
    from dqcoll.kernels import numba_available
    from dqcoll.schemes.dynamiq.scheme import DynamiqScheme

    if numba_available() is not None:
        pytest.skip("numba is not importable")
    monkeypatch.setenv("DQCOLL_KERNELS", "numba")
    scheme = DynamiqScheme(bits=5.0, **options)  # type: ignore[arg-type]
    x = torch.randn(4 * codec.SUPER, generator=torch.Generator().manual_seed(5))
    payload = scheme.encode(x)
    assert torch.isfinite(scheme.decode(payload)).all()
    return str(payload["call"].ops.name)


@pytest.mark.parametrize("options", _REFERENCE_ONLY, ids=lambda o: ",".join(map(str, o.items())))
def test_prototypes_route_to_the_reference(monkeypatch: pytest.MonkeyPatch,
                                           options: dict[str, object]) -> None:
    assert _call_ops(monkeypatch, **options) == "torch"


@pytest.mark.parametrize("options", [{}, {"thresholds": "measured"}, {"max_width": 16}],
                         ids=["default", "thresholds=measured", "max_width=16"])
def test_kernel_honoured_options_keep_the_kernels(monkeypatch: pytest.MonkeyPatch,
                                                  options: dict[str, object]) -> None:
    # measured thresholds change only the allocation and raw 16 is part of the default format
    assert _call_ops(monkeypatch, **options) == "numba"


def test_prototype_option_checks() -> None:
    from dqcoll.errors import InvalidArgumentError
    from dqcoll.schemes.dynamiq.scheme import DynamiqScheme

    with pytest.raises(InvalidArgumentError):
        DynamiqScheme(target_vnmse=1e-3, width_set="fine")
    with pytest.raises(InvalidArgumentError):
        DynamiqScheme(thresholds="measured", levels="uniform")
    with pytest.raises(InvalidArgumentError):
        DynamiqScheme(stats="fp16")
    assert "hop_widths=True" in repr(DynamiqScheme(hop_widths=True))
