"""DynamiQ's parts on their own: random numbers, codec format, bit allocation."""

from __future__ import annotations

import random

import pytest
import torch

from dqcoll.errors import InvalidArgumentError
from dqcoll.kernels import codec as C
from dqcoll.kernels import rng
from dqcoll.schemes import get
from dqcoll.schemes.dynamiq import min_bits
from dqcoll.schemes.dynamiq.allocation import STATS_BYTES_PER_SUPER
from dqcoll_lab.dynamiq import FixedRule, research_scheme
from dqcoll_lab.dynamiq.allocation_paper import allocate_widths_paper

# -- random numbers ---------------------------------------------------------------------------


def test_mix32_matches_python_uint32() -> None:
    """The torch int64 emulation of uint32 arithmetic equals exact Python integer arithmetic."""
    values = [random.Random(1).getrandbits(32) for _ in range(2000)] + [0, 1, 2**31, 2**32 - 1]
    got = rng.mix32(rng.to_uint32_bits(torch.tensor(values))).tolist()
    assert [g & rng.MASK32 for g in got] == [rng.mix32_int(v) for v in values]


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 64, 100])
def test_feistel_gives_a_permutation_per_coordinate(n: int) -> None:
    """For every coordinate, pi maps the ranks onto [0, n) one to one."""
    ck = rng.coord_hash(12345, torch.arange(2000))
    pis = torch.stack([rng.permute_rank(r, n, ck) for r in range(n)])
    assert torch.equal(pis.sort(0).values, torch.arange(n)[:, None].expand(n, 2000))


def test_permutation_is_uniform() -> None:
    """pi(0) is uniform over the ranks (chi-square within 5 sigma) for several n."""
    ck = rng.coord_hash(rng.stream_key(rng.call_key(3, 4), rng.STREAM_PERM), torch.arange(60_000))
    for n in (3, 7, 13, 40):
        counts = torch.bincount(rng.permute_rank(0, n, ck), minlength=n).double()
        expected = 60_000 / n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert abs(chi2 - (n - 1)) < 5 * (2 * (n - 1)) ** 0.5, (n, chi2)


@pytest.mark.parametrize("n", [2, 5, 8, 17])
def test_permutation_table_holds_permutations_and_runs_spread_over_it(n: int) -> None:
    """Column t of the n ranks' tables is a permutation of [0, n) for every t; the compiled table
    (numba) equals the reference; runs pick table entries uniformly (chi-square), also past
    2**32."""
    from dqcoll.kernels._params import permutation_table

    tables = torch.stack([rng.permutation_table(11, r, n) for r in range(n)])
    assert torch.equal(tables.sort(0).values,
                       torch.arange(n, dtype=torch.int32)[:, None].expand(n, rng.PERMUTATION_TABLE))
    for r in (0, n - 1):
        assert torch.equal(torch.from_numpy(permutation_table(11, r, n)), tables[r])
    for start in (0, 2**32 - 2**19):
        sel = rng.permutation_index(11, torch.arange(start, start + 2**20, 16))
        counts = torch.bincount(sel, minlength=rng.PERMUTATION_TABLE).double()
        assert counts.numel() == rng.PERMUTATION_TABLE
        expected = sel.numel() / rng.PERMUTATION_TABLE
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        dof = rng.PERMUTATION_TABLE - 1
        assert abs(chi2 - dof) < 5 * (2 * dof) ** 0.5, chi2


def test_uniforms_in_range_and_stratified() -> None:
    """Correlated uniforms lie in [0, 1) and the n ranks' uniforms for a coordinate fall in
    distinct 1/n strata; independent ones are keyed by rank."""
    idx = torch.arange(4096).view(16, 256)
    n = 6
    u = torch.stack([rng.rounding_uniforms(9, r, n, idx, True) for r in range(n)]).view(n, -1)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    strata = (u * n).floor().long().sort(0).values
    assert torch.equal(strata, torch.arange(n)[:, None].expand(n, 4096))
    # one permutation per run of 16 coordinates: a rank's stratum is constant within a run
    runs = (u * n).floor().long().view(n, -1, 16)
    assert bool((runs == runs[..., :1]).all())
    assert not bool((runs[:, :, 0] == runs[:, :1, 0]).all())  # ... but differs across runs
    a = rng.rounding_uniforms(9, 0, n, idx.view(-1), False)
    b = rng.rounding_uniforms(9, 1, n, idx.view(-1), False)
    assert not torch.equal(a, b)
    assert abs(float(a.mean()) - 0.5) < 0.02


# -- codec format -----------------------------------------------------------------------------


def test_record_sizes() -> None:
    """82 / 146 / 274 bytes per super-group at 2 / 4 / 8 bits; flat scales 80 / 144 / 272."""
    assert [C.record_nbytes(w) for w in (2, 4, 8)] == [82, 146, 274]
    assert [C.record_nbytes(w, C.Scales.FLAT) for w in (2, 4, 8)] == [80, 144, 272]
    assert C.record_nbytes(0) == 0


@pytest.mark.parametrize("width", [2, 4, 8])
def test_pack_unpack_round_trip(width: int) -> None:
    """Packing is LSB-first and lossless."""
    codes = torch.randint(0, 2**width, (5, 256))
    packed = C.pack_codes(codes, width)
    assert packed.shape == (5, 32 * width)
    assert torch.equal(C.unpack_codes(packed, width), codes)
    if width == 2:
        assert int(packed[0, 0]) == int(sum(int(codes[0, j]) << (2 * j) for j in range(4)))


def test_bf16_ceil_rounds_up_minimally() -> None:
    """bf16_ceil(v) >= v, and the next bf16 below it is < v."""
    v = torch.rand(10_000) * torch.exp(torch.randn(10_000) * 10)
    up = C.bf16_ceil(v).float()
    assert bool((up >= v).all())
    below = (C.bf16_ceil(v).view(torch.int16) - 1).view(torch.bfloat16).float()
    exact = up == v
    assert bool((below[~exact] < v[~exact]).all())


def test_levels() -> None:
    """Non-uniform levels are denser near zero and end at 1; code R means 0."""
    for width in (4, 8):
        mags = C.level_magnitudes(width, C.Levels.NONUNIFORM)
        assert float(mags[0]) == 0.0 and float(mags[-1]) == 1.0
        gaps = mags[1:] - mags[:-1]
        assert bool((gaps[1:] > gaps[:-1]).all())
        table = C.code_table(width, C.Levels.NONUNIFORM)
        top = 2 ** (width - 1) - 1
        used = table[: 2 * top + 1]
        assert float(table[top]) == 0.0 and torch.equal(used.flip(0), -used)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_encode_never_clips(width: int) -> None:
    """Decoded group scales are never smaller than the group's absmax, so |x| / D <= 1."""
    x = torch.randn(64, 256) * torch.exp(torch.randn(64, 16) * 3).repeat_interleave(16, 1)
    decoded, _ = C._scales_encode(x, C.Scales.HIERARCHICAL)
    assert bool((x.abs() <= decoded.repeat_interleave(C.GROUP, dim=1)).all())


def test_non_finite_rows_decode_to_nan_and_others_stay_finite() -> None:
    """A NaN or Inf in a super-group makes that super-group NaN after decoding; the others stay
    finite."""
    x = torch.randn(4, 256)
    x[1, 7] = float("nan")
    x[2, 100] = float("inf")
    cfg = C.CodecConfig()
    out = C.decode_torch(C.encode_torch(x, 4, torch.arange(4) * 256, 0, 1, 0, cfg), 4, cfg)
    assert bool(torch.isnan(out[1]).all()) and bool(torch.isnan(out[2]).all())
    assert bool(torch.isfinite(out[0]).all()) and bool(torch.isfinite(out[3]).all())


def test_stats_center_ignores_padding() -> None:
    """Means use the valid coordinates only and padding stays exactly zero."""
    x = torch.zeros(2, 256)
    x[0] = 1.0
    x[1, :10] = 3.0
    centred, mean, norm2 = C.stats_center_torch(x, torch.tensor([256, 10]))
    assert mean.tolist() == [1.0, 3.0]
    assert float(centred.abs().sum()) == 0.0 and norm2.tolist() == [0.0, 0.0]


# -- allocation -------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2.9, 3.5, 5.0, 6.5, 8.0])
def test_allocation_meets_budget(bits: float) -> None:
    """Records plus statistics fit bits * numel / 8 and use most of it."""
    f = torch.exp(torch.randn(4000) * 4).float()
    numel = 4000 * 256
    alloc = allocate_widths_paper(f, numel, bits)
    assert set(alloc.widths.unique().tolist()) <= {2, 4, 8}
    assert alloc.total_nbytes <= bits * numel / 8
    assert not alloc.over_budget
    if bits < 8.8:
        assert alloc.total_nbytes >= bits * numel / 8 - 274 * 2


def test_allocation_follows_norms_and_skips_zeros() -> None:
    """Larger norms never get fewer bits; exactly-zero super-groups get width 0; NaN gets 8."""
    f = torch.exp(torch.linspace(-20, 20, 1000)).float()
    f[10] = 0.0
    f[20] = float("nan")
    alloc = allocate_widths_paper(f, 1000 * 256, 5.0)
    w = alloc.widths.clone()
    assert int(w[10]) == 0 and int(w[20]) == 8
    rest = torch.cat([w[:10], w[11:20], w[21:]])
    assert bool((rest[1:] >= rest[:-1]).all())


def test_energy_exponent_flattens_the_allocation() -> None:
    """energy_exponent < 1 moves bits from high- to low-energy super-groups under the same
    budget; 1 is the default rule exactly; 0 gives every live super-group the same width."""
    f = torch.exp(torch.randn(4000) * 4).float()
    f[:5] = 0.0
    numel = 4000 * 256
    base = allocate_widths_paper(f, numel, 5.0)
    same = allocate_widths_paper(f, numel, 5.0, energy_exponent=1.0)
    assert torch.equal(same.widths, base.widths)
    half = allocate_widths_paper(f, numel, 5.0, energy_exponent=0.5)
    assert half.total_nbytes <= 5.0 * numel / 8 and not half.over_budget
    assert int((half.widths == 2).sum()) < int((base.widths == 2).sum())
    assert int((half.widths == 8).sum()) < int((base.widths == 8).sum())
    assert half.widths[:5].tolist() == [0] * 5  # zero super-groups still cost nothing
    order = torch.argsort(f[5:])
    assert bool((half.widths[5:][order][1:] >= half.widths[5:][order][:-1]).all())
    flat = allocate_widths_paper(f, numel, 5.0, energy_exponent=0.0)
    assert flat.widths[5:].unique().numel() == 1
    for bad in (-0.1, 1.5, "x"):
        with pytest.raises(InvalidArgumentError, match="energy_exponent"):
            get("dynamiq", energy_exponent=bad)
    with pytest.raises(InvalidArgumentError, match="energy_exponent"):
        get("dynamiq", energy_exponent=0.5, target_vnmse=1e-3)
    assert "energy_exponent=0.5" in repr(get("dynamiq", energy_exponent=0.5))


def test_fixed_widths_and_minimum_bits() -> None:
    """widths='fixed' puts everything at 4 bits; a budget below 2-bit cost raises."""
    alloc = FixedRule().budget(torch.ones(10), 2560, 5.0, scales=C.Scales.HIERARCHICAL,
                               stats_bytes=8, max_width=8, energy_exponent=1.0)
    assert alloc.widths.tolist() == [4] * 10
    # the default format: 2-bit records of 64 + 6 B, 2 B of statistics; the paper's: 64 + 18, 8
    assert min_bits() == pytest.approx((70 + STATS_BYTES_PER_SUPER) * 8 / 256) == 2.25
    assert min_bits(C.Scales.HIERARCHICAL, 8) == pytest.approx((82 + 8) * 8 / 256)
    with pytest.raises(InvalidArgumentError, match="minimum"):
        get("dynamiq", bits=2.0)


def test_unknown_option_values_are_rejected() -> None:
    """Ablation switches take only their documented values."""
    with pytest.raises(InvalidArgumentError, match="levels"):
        research_scheme(levels="log")
    with pytest.raises(InvalidArgumentError, match="does not take"):
        get("dynamiq", colour="blue")


@pytest.mark.parametrize("ties", [False, True])
def test_hull_cost_counts_equal_the_row_by_row_rule(ties: bool) -> None:
    """The bisection's sorted-key cost (allocation._HullCost) equals the payload of the widths the
    hull rule gives row by row, at any u (exactly on thresholds too), for shifted classes, with
    ties (bf16 norms), zero, NaN and overflowed rows."""
    from dqcoll.schemes.dynamiq import allocation as A

    g = torch.Generator().manual_seed(4)
    rows = 3000
    f = torch.exp(torch.randn(rows, generator=g) * 3).float()
    if ties:
        f = f.to(torch.bfloat16).float()
    f[::97] = 0
    f[5] = float("nan")
    f[7] = float("inf")
    scales = C.Scales.HIERARCHICAL4X32
    errors = A.MEASURED_ERRORS[(C.Levels.TUNED, scales)]
    rows = A._Rows.of(f, width_set=C.FINE_WIDTHS, errors=errors, scales=scales, max_width=16)
    log_f, zero, hull, offsets, top = rows.log_f, rows.zero, rows.hull, rows.offsets, rows.top
    shifts = {1: 0.0, 3: 1.7, 8: -0.3}
    lookup = A.cost_lookup(scales)
    fast = A._HullCost(rows, shifts, lookup)
    nan = torch.isnan(log_f)
    probes = torch.linspace(-60, 60, 241).tolist()
    probes += [offsets[2] - float(log_f[10]), offsets[3] - float(log_f[11]) - 1.7]
    for u in probes:
        for c, shift in shifts.items():
            w = torch.full_like(log_f, hull[0], dtype=torch.int64)
            for width, off in zip(hull[1:], offsets[1:], strict=False):
                w = torch.where(log_f + shift + u >= off, width, w)
            w = torch.where(zero, 0, torch.where(nan, top, w))
            assert int(lookup[w].sum()) == fast.class_bytes(c, u), (u, c)


def test_target_allocation_with_hop_widths_meets_its_prediction() -> None:
    """allocate_for_target_by_count: the predicted vNMSE (recomputed here row by row from the
    widths it returns) meets the target, a tighter target costs more bytes, and the per-class
    widths are those of the hull rule at the returned u."""
    from dqcoll.schemes.dynamiq import allocation as A
    from dqcoll.schemes.dynamiq.error_model import ErrorModel
    from dqcoll.topology import build_schedule

    g = torch.Generator().manual_seed(7)
    rows = 2000
    norm2 = torch.exp(torch.randn(rows, generator=g) * 2).float()
    norm2[::50] = 0
    valid = torch.full((rows,), 256)
    schedule = build_schedule("ring", 4)
    classes = A.count_classes(schedule.subtree_sizes())
    config = C.FORMAT3
    unit = ErrorModel().unit_error(schedule, config)
    errors = A.MEASURED_ERRORS[(config.levels, config.scales)]
    costs = []
    for target in (1e-2, 1e-3, 1e-4):
        hop, alloc = A.allocate_for_target_by_count(
            norm2, torch.zeros(rows), valid, target, classes, world_size=4, rho=0.0,
            unit_error=unit, scales=config.scales, width_set=C.FINE_WIDTHS, errors=errors,
            stats_bytes=2)
        f = norm2.double()
        predicted = sum(a / 4 * float((unit[hop[c]] * f).sum())
                        for c, (a, _) in classes.items()) / float(f.sum())
        assert predicted == pytest.approx(alloc.predicted_vnmse, rel=1e-9)
        assert alloc.target_met and predicted <= target * (1 + 1e-9)
        costs.append(alloc.payload_nbytes)
    assert costs[0] < costs[1] < costs[2]
