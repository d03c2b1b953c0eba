"""The compiled CPU path beyond byte identity (which ``test_kernels.py`` checks for every op):
dispatch and its errors, thread-count independence, the level-search tables, ``out=``, the
compiled allocation."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from conftest import heavy_tailed

pytest.importorskip("numba")

from dqcoll.comm import Communicator
from dqcoll.errors import UnsupportedError
from dqcoll.kernels import codec, cpu_runtime, dynamiq_numba, dynamiq_ops
from dqcoll.kernels.codec import (
    FINE_WIDTHS,
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    Scales,
)
from dqcoll.transports.local import LocalHub

KEY = 0xC0FFEE


def test_auto_dispatch_picks_numba_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_KERNELS=auto (the default) and =numba give the numba ops for CPU tensors; =torch the
    reference; =numba for CUDA tensors is an explicit request that cannot be honoured."""
    monkeypatch.delenv("DQCOLL_KERNELS", raising=False)
    assert dynamiq_ops(torch.device("cpu")).name == "numba"
    monkeypatch.setenv("DQCOLL_KERNELS", "numba")
    assert dynamiq_ops(torch.device("cpu")).name == "numba"
    with pytest.raises(UnsupportedError, match="numba kernels take CPU tensors"):
        dynamiq_ops(torch.device("cuda"))
    monkeypatch.setenv("DQCOLL_KERNELS", "torch")
    assert dynamiq_ops(torch.device("cpu")).name == "torch"
    monkeypatch.setenv("DQCOLL_KERNELS", "fast")
    with pytest.raises(ValueError, match="DQCOLL_KERNELS must be one of auto, torch"):
        dynamiq_ops(torch.device("cpu"))


def test_without_numba_auto_falls_back_and_explicit_raises() -> None:
    """Without numba, ``import dqcoll`` and a CPU all-reduce still work (torch reference, with a
    log line saying why), and DQCOLL_KERNELS=numba raises an error naming the reason."""
    script = """
import logging, os, sys
sys.modules["numba"] = None  # as if not installed
import dqcoll, torch
from dqcoll.comm import Communicator
from dqcoll.errors import UnsupportedError
from dqcoll.kernels import dynamiq_ops
from dqcoll.testing import run_local
records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger("dqcoll").addHandler(handler)
assert dynamiq_ops(torch.device("cpu")).name == "torch"
assert any("numba is not importable" in r.getMessage() for r in records), records
out = run_local(2, lambda comm: dqcoll.allreduce(torch.ones(1000), scheme="dynamiq"))
assert torch.equal(out[0], out[1])
os.environ["DQCOLL_KERNELS"] = "numba"
try:
    dynamiq_ops(torch.device("cpu"))
except UnsupportedError as exc:
    assert "DQCOLL_KERNELS=numba" in str(exc) and "numba is not importable" in str(exc), exc
else:
    raise AssertionError("no error")
"""
    env = {k: v for k, v in os.environ.items() if k != "DQCOLL_KERNELS"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)


@pytest.mark.parametrize("width", WIDTHS)
def test_bytes_do_not_depend_on_threads(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """1, 2 and 3 threads (row ranges cut at different places) give the same records, partial sums
    and statistics."""
    rows = 3 * cpu_runtime.MIN_ROWS_PER_THREAD + 5
    x = heavy_tailed(0, rows * SUPER, seed=width).view(rows, SUPER)
    index = torch.arange(rows, dtype=torch.int64) * SUPER + 2**33
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    results = []
    for threads in ("1", "2", "3"):
        monkeypatch.setenv("DQCOLL_CPU_THREADS", threads)
        assert cpu_runtime.cpu_threads() == int(threads)
        records = dynamiq_numba.encode(x, width, index, 2, 5, KEY, CodecConfig())
        acc = x.clone()
        hop = dynamiq_numba.decode_accumulate_encode(records, width, acc, index, 1, 5, KEY,
                                                     CodecConfig())
        results.append((records, hop, acc, *dynamiq_numba.stats_center(x, valid)))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def test_cpu_threads_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_CPU_THREADS must be a positive integer; unset, the cores are divided among the
    ranks that share the machine."""
    monkeypatch.setenv("DQCOLL_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="positive integer, got '0'"):
        cpu_runtime.cpu_threads()
    monkeypatch.setenv("DQCOLL_CPU_THREADS", "")
    monkeypatch.setattr(cpu_runtime, "_local_ranks", 1)
    assert cpu_runtime.cpu_threads() == max(1, os.cpu_count() or 1)
    monkeypatch.setattr(cpu_runtime, "_local_ranks", 10_000)
    assert cpu_runtime.cpu_threads() == 1


def test_local_rank_claims_end_with_their_communicator(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cores are divided by the largest group of ranks a *live* communicator shares the
    machine with: a claim ends when its owner is released, collected, closed or dies, so a
    finished many-rank run leaves the cores to the jobs after it."""
    monkeypatch.setenv("DQCOLL_CPU_THREADS", "")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # a communicator claims its own size
    gc.collect()  # communicators of earlier tests that are already unreachable release now
    before = cpu_runtime.local_ranks()

    class Owner:
        pass

    big, small = Owner(), Owner()
    cpu_runtime.claim_local_ranks(big, before + 10_000)
    cpu_runtime.claim_local_ranks(small, before + 1)
    assert cpu_runtime.local_ranks() == before + 10_000 and cpu_runtime.cpu_threads() == 1
    cpu_runtime.release_local_ranks(big)
    assert cpu_runtime.local_ranks() == before + 1
    del small
    gc.collect()
    assert cpu_runtime.local_ranks() == before

    hub = LocalHub(before + 2)
    closed, dead = Communicator(hub.transport(0)), Communicator(hub.transport(1))
    assert cpu_runtime.local_ranks() == before + 2
    closed.close()
    assert cpu_runtime.local_ranks() == before + 2  # the other one still runs
    dead.mark_dead("the test kills it")
    assert cpu_runtime.local_ranks() == before


@pytest.mark.parametrize("levels", list(Levels))
@pytest.mark.parametrize("width", FINE_WIDTHS)
def test_level_tables_agree_with_searchsorted(width: int, levels: Levels) -> None:
    """The 8-bit level search (bin table plus one compare) equals ``searchsorted`` over the
    interior magnitudes on a dense grid of [0, 1] and on every magnitude and its neighbours."""
    tables = dynamiq_numba.level_tables(width, levels)
    interior = tables.mags[1:-1]
    grid = torch.linspace(0, 1, 200_001, dtype=torch.float32).numpy()
    probe = torch.cat([torch.from_numpy(grid), torch.from_numpy(tables.mags),
                       torch.nextafter(torch.from_numpy(tables.mags), torch.tensor(2.0))])
    probe = probe[probe <= 1].numpy()
    guess = tables.rtab[(probe * tables.bins).astype("int64")]
    guess = guess + (tables.nxt[guess] <= probe)
    assert (guess == interior.searchsorted(probe, side="right")).all()


@pytest.mark.parametrize("divisor", [1, 3, 4, 8])
def test_uncentred_stats_and_gather_equal_the_divided_rows(divisor: int) -> None:
    """``stats(centre=False)``: zero means and the squared norm of the uncentred rows, bit for bit
    the reference's (``stats_center_rounded_torch(x / n, valid, centre=False)``, the prototype
    "norm16" statistics); ``center_gather`` with those zeros then writes ``x / n`` reordered, bit
    for bit: -0.0 stays -0.0, NaN stays NaN, padding past ``valid`` is +0."""
    g = torch.Generator().manual_seed(divisor)
    rows = 9
    x = torch.randn(rows, SUPER, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 4)
    x[0] = -0.0
    x[1, ::3] = -0.0
    x[2, 17] = float("nan")
    x[3, 200] = float("-inf")
    x[4] = torch.randn(SUPER, generator=g) * 1e-39  # denormals
    x[5, 100:] = 0.0  # a partial row
    x[6] = torch.randn(SUPER, generator=g) * 1e19  # squares overflow fp32
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    valid[5] = 100
    valid[1] = 1
    x[1, 1:] = 0.0
    divided = x / divisor
    _, _, norm_ref = codec.stats_center_rounded_torch(divided, valid, centre=False)
    mean, norm2 = dynamiq_numba.stats(x, valid, divisor=divisor, centre=False)
    assert torch.equal(mean.view(torch.int32), torch.zeros(rows, dtype=torch.int32))  # +0.0
    assert torch.equal(torch.isnan(norm2), torch.isnan(norm_ref))
    assert torch.equal(torch.nan_to_num(norm2).view(torch.int32),
                       torch.nan_to_num(norm_ref).view(torch.int32))
    order = torch.randperm(rows, generator=g)
    gathered = dynamiq_numba.center_gather(x, mean, valid, order, divisor=divisor)
    expected = divided.clone()
    expected[5, 100:] = 0.0
    expected = expected[order]
    assert torch.equal(torch.isnan(gathered), torch.isnan(expected))
    assert torch.equal(torch.where(torch.isnan(gathered), 0.0, gathered).view(torch.int32),
                       torch.where(torch.isnan(expected), 0.0, expected).view(torch.int32))
    assert (gathered[(order == 0).nonzero()[0, 0]].view(torch.int32) == -2**31).all()  # -0.0
    # and centre=True is unchanged: the reference's mean and centred norm
    mean_c, norm_c = dynamiq_numba.stats(x, valid, divisor=divisor)
    _, mean_cr, norm_cr = codec.stats_center_torch(divided, valid)
    for a, b in ((mean_c, mean_cr), (norm_c, norm_cr)):
        assert torch.equal(torch.nan_to_num(a).view(torch.int32),
                           torch.nan_to_num(b).view(torch.int32))
    # the centred gather too (a power-of-two divisor multiplies by its reciprocal: same bits)
    centred_ref = codec.stats_center_torch(divided, valid)[0][order]
    centred = dynamiq_numba.center_gather(x, mean_c, valid, order, divisor=divisor)
    assert torch.equal(torch.isnan(centred), torch.isnan(centred_ref))
    assert torch.equal(torch.nan_to_num(centred).view(torch.int32),
                       torch.nan_to_num(centred_ref).view(torch.int32))


@pytest.mark.parametrize("width", [3, 6])
def test_fine_widths_do_not_depend_on_threads(monkeypatch: pytest.MonkeyPatch,
                                              width: int) -> None:
    """The bitstream widths (HIERARCHICAL4X32) give the same records, sums and decodes on 1 and 3
    threads."""
    rows = 3 * cpu_runtime.MIN_ROWS_PER_THREAD + 5
    x = heavy_tailed(0, rows * SUPER, seed=width).view(rows, SUPER)
    index = torch.arange(rows, dtype=torch.int64) * SUPER + 2**33
    config = CodecConfig(levels=Levels.TUNED, scales=Scales.HIERARCHICAL4X32)
    results = []
    for threads in ("1", "3"):
        monkeypatch.setenv("DQCOLL_CPU_THREADS", threads)
        records = dynamiq_numba.encode(x, width, index, 2, 5, KEY, config)
        acc = x.clone()
        hop = dynamiq_numba.decode_accumulate_encode(records, width, acc, index, 1, 5, KEY,
                                                     config)
        results.append((records, hop, acc, dynamiq_numba.decode(hop, width, config)))
    assert torch.equal(results[0][0], codec.encode_torch(x, width, index, 2, 5, KEY, config))
    for a, b in zip(results[0], results[1], strict=True):
        assert torch.equal(a, b)


def test_formats_reject_what_the_kernels_lack() -> None:
    """A (scales, width) outside ``FORMATS`` raises instead of running another format's kernel."""
    x = torch.zeros(1, SUPER)
    index = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="width must be one of"):
        dynamiq_numba.encode(x, 5, index, 0, 1, KEY, CodecConfig())
    config = CodecConfig(scales=Scales.HIERARCHICAL4X32)
    assert dynamiq_numba.FORMATS[Scales.HIERARCHICAL4X32] == FINE_WIDTHS
    records = dynamiq_numba.encode(x, 5, index, 0, 1, KEY, config)
    assert records.shape == (1, codec.record_nbytes(5, Scales.HIERARCHICAL4X32)) == (1, 166)


def test_out_arguments_write_in_place() -> None:
    """``out=`` receives the records / rows (the scheme writes straight into its payload), and a
    wrong ``out`` raises with the expected shape."""
    x = heavy_tailed(2, 4 * SUPER, seed=1).view(4, SUPER)
    index = torch.arange(4, dtype=torch.int64) * SUPER
    config = CodecConfig()
    payload = torch.zeros(4 * 146 + 10, dtype=torch.uint8)
    view = payload[5 : 5 + 4 * 146].view(4, 146)
    assert dynamiq_numba.encode(x, 4, index, 0, 2, KEY, config, out=view) is view
    assert torch.equal(view, codec.encode_torch(x, 4, index, 0, 2, KEY, config))
    assert not payload[:5].any() and not payload[-5:].any()
    rows = torch.full((4, SUPER), float("nan"))
    dynamiq_numba.decode(view, 4, config, out=rows)
    assert torch.equal(rows, codec.decode_torch(view, 4, config))
    with pytest.raises(ValueError, match=r"out: expected contiguous uint8 \[4, 146\]"):
        dynamiq_numba.encode(x, 4, index, 0, 2, KEY, config, out=torch.empty(4, 82,
                                                                               dtype=torch.uint8))


@pytest.mark.parametrize("seed", range(6))
def test_compiled_bisection_equals_reference(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The compiled bisection of ``allocate_widths_paper`` finds the reference's ``u`` and
    widths bit for bit (zero, NaN and Inf norms, raw 16-bit widths, energy exponents, budgets)."""
    from dqcoll_lab.dynamiq.allocation_paper import allocate_widths_paper

    g = torch.Generator().manual_seed(seed)
    rows = 1000 + 3000 * seed
    norm2 = (torch.rand(rows, generator=g)
             * torch.exp(torch.randn(rows, generator=g) * (2 + 3 * seed))).float()
    norm2[:: 5 + seed] = 0.0
    norm2[7] = float("nan")
    norm2[11] = float("inf")
    for bits, max_width, exponent in ((3.0, 8, 1.0), (5.0, 8, 0.5), (9.5, 16, 1.0)):
        kwargs = dict(max_width=max_width, energy_exponent=exponent)
        monkeypatch.setenv("DQCOLL_KERNELS", "torch")
        expected = allocate_widths_paper(norm2, rows * SUPER - seed, bits, **kwargs)
        monkeypatch.setenv("DQCOLL_KERNELS", "numba")
        actual = allocate_widths_paper(norm2, rows * SUPER - seed, bits, **kwargs)
        assert actual.u == expected.u and torch.equal(actual.widths, expected.widths)
        assert actual.payload_nbytes == expected.payload_nbytes


def _edge_norms() -> list[torch.Tensor]:
    """Norms that stress the counting search: ties, a single row, all zero / NaN, Inf only,
    subnormals, spreads from none to hundreds of decades."""
    g = torch.Generator().manual_seed(7)
    cases = [
        torch.tensor([3.0]),
        torch.zeros(5),
        torch.full((4,), float("nan")),
        torch.tensor([0.0, float("nan"), 0.0]),
        torch.tensor([float("inf"), 1.0, 0.0, 2.0]),
        torch.full((300,), 2.5),  # every row ties
        torch.tensor([1e-45, 1e-40, 1e-30, 1.0, 3e38, float("inf")] * 20),
    ]
    ties = torch.exp(torch.randint(-5, 5, (2000,), generator=g).float())  # few distinct values
    ties[::7] = 0.0
    cases.append(ties)
    for spread in (0.0, 0.5, 4.0, 30.0):
        cases.append(torch.exp(torch.randn(3000, generator=g) * spread).float())
    return cases


@pytest.mark.parametrize("case", range(12))
def test_compiled_allocation_edge_cases(monkeypatch: pytest.MonkeyPatch, case: int) -> None:
    """The compiled allocation (sorted values, counted costs, branch-free widths) returns the
    torch reference's ``u``, widths, payload and over-budget flag bit for bit on ties, single
    rows, all-zero / all-NaN / Inf-only norms, subnormals and budgets from below the cheapest
    allocation to above the richest."""
    from dqcoll_lab.dynamiq.allocation_paper import allocate_widths_paper

    norm2 = _edge_norms()[case]
    rows = norm2.numel()
    for bits, max_width, exponent in ((2.9, 8, 1.0), (3.1, 8, 1.0), (5.0, 8, 0.0),
                                      (5.0, 16, 0.73), (9.0, 16, 1.0), (40.0, 8, 1.0)):
        kwargs = dict(max_width=max_width, energy_exponent=exponent)
        monkeypatch.setenv("DQCOLL_KERNELS", "torch")
        expected = allocate_widths_paper(norm2, rows * SUPER, bits, **kwargs)
        monkeypatch.setenv("DQCOLL_KERNELS", "numba")
        actual = allocate_widths_paper(norm2, rows * SUPER, bits, **kwargs)
        assert (actual.u == expected.u or (actual.u != actual.u and expected.u != expected.u)), (
            bits, max_width, exponent, actual.u, expected.u)
        assert torch.equal(actual.widths, expected.widths), (bits, max_width, exponent)
        assert actual.payload_nbytes == expected.payload_nbytes
        assert actual.over_budget == expected.over_budget


@pytest.mark.parametrize("case", range(16))
def test_compiled_by_count_allocation_equals_reference(monkeypatch: pytest.MonkeyPatch,
                                                        case: int) -> None:
    """The compiled search of ``allocate_widths_by_count`` (hop widths, the all-reduce's
    default) returns the reference's ``u``, per-class widths, payload and over-budget flag bit
    for bit: the edge norms above and four dense/heavy-tailed draws, with the count classes of
    ring, butterfly and direct at 2-8 ranks, raw 16-bit widths, energy exponents and budgets
    from below the cheapest allocation to above the richest."""
    from dqcoll.schemes.dynamiq import allocation
    from dqcoll.topology import algorithms

    cases = _edge_norms()
    g = torch.Generator().manual_seed(case)
    cases += [torch.exp(torch.randn(5000, generator=g) * s).float().to(torch.bfloat16).float()
              for s in (0.3, 1.0, 3.0, 8.0)]
    norm2 = cases[case]
    rows = norm2.numel()
    configs = (("ring", 4, 5.0, 8, 1.0), ("butterfly", 4, 5.0, 8, 0.5),
               ("butterfly", 3, 2.9, 8, 1.0), ("direct", 5, 9.0, 16, 1.0),
               ("ring", 2, 40.0, 8, 0.0), ("butterfly", 8, 3.3, 16, 0.73),
               ("ring", 4, 2.2, 8, 1.0))  # 2.2 bits: below even every row at 2 bits
    for algorithm, n, bits, max_width, exponent in configs:
        classes = allocation.count_classes(
            algorithms.build_schedule(algorithm, n).subtree_sizes())
        kwargs = dict(scales=codec.Scales.HIERARCHICAL4X32, width_set=codec.FINE_WIDTHS,
                      errors=allocation.MEASURED_ERRORS[(codec.Levels.TUNED,
                                                         codec.Scales.HIERARCHICAL4X32)],
                      stats_bytes=2, max_width=max_width, energy_exponent=exponent)
        monkeypatch.setenv("DQCOLL_KERNELS", "torch")
        ws_ref, expected = allocation.allocate_widths_by_count(norm2, rows * SUPER - 3, bits,
                                                               classes, **kwargs)
        monkeypatch.setenv("DQCOLL_KERNELS", "numba")
        ws, actual = allocation.allocate_widths_by_count(norm2, rows * SUPER - 3, bits,
                                                         classes, **kwargs)
        what = (algorithm, n, bits, max_width, exponent)
        assert (actual.u == expected.u or (actual.u != actual.u and expected.u != expected.u)), (
            what, actual.u, expected.u)
        assert list(ws) == list(ws_ref), what
        for c in ws:
            assert torch.equal(ws[c], ws_ref[c]), (what, c)
        assert torch.equal(actual.widths, expected.widths), what
        assert actual.payload_nbytes == expected.payload_nbytes, what
        assert actual.over_budget == expected.over_budget, what
        assert actual.kernel == ("numba" if actual.u == actual.u else "torch"), what


def test_compiled_bisect_alone_equals_the_bracketed_search() -> None:
    """``allocation_numba.bisect`` (the bisection of a given bracket, which the kernels'
    warm-up compiles) finds the same ``u`` as the full compiled allocation."""
    import math

    import numpy as np

    from dqcoll.kernels import allocation_numba
    from dqcoll.schemes.dynamiq import allocation
    from dqcoll_lab.dynamiq import allocation_paper

    g = torch.Generator().manual_seed(3)
    norm2 = torch.exp(torch.randn(5000, generator=g) * 6).float()
    norm2[::9] = 0.0
    got = allocation_paper.allocate_widths_paper(norm2, 5000 * SUPER, 5.0)
    f = norm2.double()
    zero = f == 0
    log_f = torch.log2(torch.where(zero, 1.0, f))
    finite = log_f[~zero]
    costs = allocation.cost_lookup(codec.Scales.HIERARCHICAL).numpy()
    limit = math.floor(5.0 * 5000 * SUPER / 8) - 8 * 5000
    u_lo = 4.0 - allocation_paper.C_SLOPE * float(finite.max()) - 1.0
    u_hi = 8.0 - allocation_paper.C_SLOPE * float(finite.min())
    u = allocation_numba.bisect(log_f.numpy(), zero.numpy(), costs, limit, u_lo, u_hi, 64,
                                allocation_paper.C_SLOPE, 8)
    assert u == got.u
    assert isinstance(allocation_numba.bisect(np.zeros(2), np.zeros(2, np.bool_),
                                              np.zeros(17, np.int64), 0, 0.0, 1.0, 1, 1.0, 8),
                      float)


def test_max_finite_abs_matches_torch() -> None:
    """The range check's compiled pass returns torch's largest finite |x|, past NaN and inf,
    0 for all-zero or all-non-finite buffers, and exact for denormals."""
    from dqcoll.kernels import dynamiq_numba

    g = torch.Generator().manual_seed(3)
    cases = [torch.randn(100_003, generator=g) * 1e-3, torch.zeros(17),
             torch.tensor([float("nan"), float("inf"), -float("inf")]),
             torch.tensor([1e-45, -3e-44, 0.0]), torch.tensor([-7.5, 2.0, float("nan"), 3e38])]
    for x in cases:
        finite = x[torch.isfinite(x)]
        expected = float(finite.abs().max()) if finite.numel() else 0.0
        assert dynamiq_numba.max_finite_abs(x) == expected, x[:5]


@pytest.mark.parametrize("divisor, centre", [(1, True), (4, True), (4, False)])
def test_stats_keep_underflowed_equals_the_call_check(divisor: int, centre: bool) -> None:
    """``stats(keep_underflowed=True)``: the norms the call's underflow check makes of the
    reference's (``_keep_underflowed_rows`` on the reference statistics) -- the smallest normal
    norm for rows of non-zero values whose squares underflow, 0 kept for zero rows (+0, -0,
    subnormals that ``x / n`` flushes), the same means."""
    from dqcoll.schemes.dynamiq.call import _keep_underflowed_rows

    g = torch.Generator().manual_seed(divisor)
    rows = 12
    x = torch.randn(rows, SUPER, generator=g)
    x[0] = 0.0
    x[1] = -0.0
    x[2] = torch.randn(SUPER, generator=g) * 1e-25  # squares underflow
    x[3] = 0.0
    x[3, 9] = 1e-45  # x / 4 flushes to 0
    x[4] = 3e-30
    x[5, 50:] = 0.0
    x[5, :50] = torch.randn(50, generator=g) * 1e-24
    x[6] = 1e-20  # centred: zero
    x[7] = torch.randn(SUPER, generator=g) * 1e-40
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    valid[5] = 50
    divided = x / divisor
    if centre:
        centred, mean_ref, norm_ref = codec.stats_center_torch(divided, valid)
    else:
        centred, mean_ref, norm_ref = codec.stats_center_rounded_torch(divided, valid,
                                                                       centre=False)
    expected = _keep_underflowed_rows(norm_ref, centred)
    mean, norm2 = dynamiq_numba.stats(x, valid, divisor=divisor, centre=centre,
                                      keep_underflowed=True)
    assert torch.equal(mean.view(torch.int32), mean_ref.float().view(torch.int32))
    assert torch.equal(norm2.view(torch.int32), expected.float().view(torch.int32))
    tiny = torch.finfo(torch.float32).tiny
    assert (norm2[[2, 5, 7]] == tiny).all() and (norm2[[0, 1]] == 0).all()
    assert bool(norm2[3] == 0) == (divisor != 1)


def test_decode_restore_raw_equals_decode_then_restore() -> None:
    """Raw width 16 through the fused final decode: the reference's decode, then its restore
    (partial rows, a scattered order, arbitrary bytes with NaN / Inf / subnormal fp16 codes)."""
    g = torch.Generator().manual_seed(8)
    rows = 9
    records = torch.randint(0, 256, (rows, codec.record_nbytes(16, Scales.HIERARCHICAL4X32)),
                            dtype=torch.uint8, generator=g)
    config = CodecConfig()
    mean = torch.randn(rows, generator=g)
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    valid[3] = 17
    index = torch.randperm(rows, generator=g) * SUPER
    expected = torch.full((rows * SUPER,), -7.0)
    codec.restore_torch(codec.decode_torch(records, 16, config), mean, index, valid, expected)
    actual = torch.full((rows * SUPER,), -7.0)
    dynamiq_numba.decode_restore(records, 16, config, mean, index, valid, actual)
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    assert torch.equal(torch.nan_to_num(actual).view(torch.int32),
                       torch.nan_to_num(expected).view(torch.int32))


@pytest.mark.parametrize("dtype, algorithm", [(torch.float32, "butterfly"),
                                               (torch.float32, "ring"),
                                               (torch.bfloat16, "butterfly")])
def test_allreduce_with_zero_and_raw_rows_equals_reference(monkeypatch: pytest.MonkeyPatch,
                                                           dtype: torch.dtype, algorithm: str
                                                           ) -> None:
    """A gradient like a ReLU MLP's: half its super-groups exactly zero, so a 5-bit budget puts
    others at raw 16 bits. The compiled path (the statistics' underflow check, raw records in the
    hops and in the fused final decode, the zero rows left out of the centred gather and
    restored as their mean) equals the reference's all-reduce bit for bit on every rank: rows of
    -0 on every rank (mean -0), mixed signed zeros, constant rows (a mean, no centred norm), a
    bf16 output (the unfused final decode)."""
    import dqcoll
    from dqcoll.testing import run_local

    def body(comm):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(64, SUPER, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
        x[::2] = 0.0
        x[1::4] = 0.0 if comm.rank else x[1::4]  # zero on some ranks only
        x[5] = torch.randn(SUPER, generator=g) * 1e-24  # squares underflow
        x[2] = -0.0  # -0 on every rank: the summed mean is -0
        x[4, ::3] = -0.0  # mixed signed zeros
        x[6] = 0.75 * (comm.rank + 1)  # constant: width 0 with a mean
        x[8] = -0.0 if comm.rank % 2 else 0.0
        y = x.reshape(-1)[: 64 * SUPER - 100].to(dtype).clone()
        dqcoll.allreduce(y, op="avg", scheme="dynamiq", bits=5, algorithm=algorithm, seed=3)
        return y, dict(comm.last_info)

    monkeypatch.setenv("DQCOLL_KERNELS", "torch")
    expected = run_local(4, body)
    monkeypatch.setenv("DQCOLL_KERNELS", "numba")
    actual = run_local(4, body)
    info = actual[0][1]
    assert info["widths"][0] > 0 and info["widths"][16] > 0, info["widths"]
    if dtype == torch.float32:  # the fused final decode, the zero rows left out
        assert info["kernels"].get("decode_restore") == "numba", info["kernels"]
        assert info["kernels"].get("restore_mean") == "numba", info["kernels"]
    as_int = torch.int32 if dtype == torch.float32 else torch.int16
    for (a, _), (e, _) in zip(actual, expected, strict=True):
        assert torch.equal(a.view(as_int), e.view(as_int))
    assert all(torch.equal(a.view(as_int), actual[0][0].view(as_int)) for a, _ in actual)
    assert (actual[0][0][2 * SUPER : 3 * SUPER].view(as_int) == 0).all()  # -0 rows: +0


def _runs_layout(widths: list[int], rows_per_run: int, config: CodecConfig
                 ) -> tuple[list[tuple[int, int, int, int]], int]:
    """(width, first row, end row, byte offset) runs of ``rows_per_run`` rows each, one payload."""
    runs, offset = [], 0
    for k, width in enumerate(widths):
        a, b = k * rows_per_run, (k + 1) * rows_per_run
        runs.append((width, a, b, offset))
        offset += (b - a) * codec.record_nbytes(width, config.scales)
    return runs, offset


@pytest.mark.parametrize("divisor", [1, 3, 4])
@pytest.mark.parametrize("scales", [Scales.HIERARCHICAL4X32, Scales.HIERARCHICAL])
def test_runs_from_a_gather_source_equal_runs_from_the_gathered_rows(divisor: int,
                                                                     scales: Scales) -> None:
    """encode_runs and hop_runs with ``source=`` (the rows center_gather would write, made by
    the kernels themselves: format 3's fused encode and hop in a scratch row, the other
    pieces gathered into the rows first) write the bytes they write from the gathered rows:
    every width, raw 16, hop pieces whose width changes, a short last row, a divisor that is
    not a power of two. The fused kernels leave the rows as they were."""
    config = (CodecConfig(levels=Levels.TUNED, scales=scales) if scales is Scales.HIERARCHICAL4X32
              else CodecConfig(scales=scales))
    g = torch.Generator().manual_seed(5)
    per = 6
    widths = [2, 5, 8, 16, 3] if scales is Scales.HIERARCHICAL4X32 else [2, 4, 8, 16, 4]
    rows = per * len(widths)
    x = heavy_tailed(1, rows * SUPER, seed=5).view(rows, SUPER).contiguous()
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    valid[7] = 100
    mean, _ = dynamiq_numba.stats(x, valid, divisor=divisor)
    order = torch.randperm(rows, generator=g)
    work = dynamiq_numba.center_gather(x, mean, valid, order, divisor=divisor)
    source = dynamiq_numba.gather_source(x, mean, valid, order, divisor=divisor)
    index = torch.randperm(rows, generator=g) * SUPER
    runs, nbytes = _runs_layout(widths, per, config)
    written, gathered = (torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2))
    dynamiq_numba.encode_runs(work, runs, index, 1, 4, KEY, config, written)
    rows_seen = torch.full_like(work, float("nan"))
    dynamiq_numba.encode_runs(rows_seen, runs, index, 1, 4, KEY, config, gathered,
                              source=source)
    assert torch.equal(written, gathered)

    out_widths = [2, 6, 8, 16, 16] if scales is Scales.HIERARCHICAL4X32 else [2, 8, 8, 16, 16]
    out_runs, out_nbytes = _runs_layout(out_widths, per, config)
    pieces = [(w_in, w_out, a, b, off_in, off_out) for (w_in, a, b, off_in), (w_out, _, _, off_out)
              in zip(runs, out_runs, strict=True)]
    hop_written, hop_gathered = (torch.zeros(out_nbytes, dtype=torch.uint8) for _ in range(2))
    dynamiq_numba.hop_runs(written, pieces, work.clone(), index, 1, 4, KEY, config, hop_written)
    acc = torch.full_like(work, float("nan"))
    dynamiq_numba.hop_runs(written, pieces, acc, index, 1, 4, KEY, config, hop_gathered,
                           source=source)
    assert torch.equal(hop_written, hop_gathered)
    if scales is Scales.HIERARCHICAL4X32:  # the fused pieces (equal widths 2, 8) left acc alone
        assert torch.isnan(acc[:per]).all() and torch.isnan(acc[2 * per : 3 * per]).all()

    part = torch.full_like(work, float("nan"))
    source.write(part, per, 3 * per)
    assert torch.equal(part[per : 3 * per].view(torch.int32),
                       work[per : 3 * per].view(torch.int32))
    assert torch.isnan(part[:per]).all() and torch.isnan(part[3 * per :]).all()
    with pytest.raises(ValueError, match="rows"):
        dynamiq_numba.encode_runs(work[:-1], runs[:1], index[:-1], 1, 4, KEY, config, written,
                                  source=source)
    with pytest.raises(ValueError, match="outside"):
        source.write(part, 0, rows + 1)


def test_multi_run_launchers_equal_the_single_run_ops() -> None:
    """encode_runs, decode_accumulate_runs, hop_runs (equal and changing widths) and
    decode_restore_runs write the bytes and sums that the single-run launchers write run by
    run (raw width 16 included), and refuse a run outside the rows or the payload."""
    config = CodecConfig(levels=Levels.TUNED, scales=Scales.HIERARCHICAL4X32)
    g = torch.Generator().manual_seed(11)
    per, widths = 5, [2, 5, 8, 16, 3]
    rows = per * len(widths)
    x = heavy_tailed(1, rows * SUPER, seed=11).view(rows, SUPER).contiguous()
    index = torch.randperm(rows, generator=g) * SUPER
    runs, nbytes = _runs_layout(widths, per, config)
    one = torch.zeros(nbytes, dtype=torch.uint8)
    for w, a, b, off in runs:
        size = codec.record_nbytes(w, config.scales)
        dynamiq_numba.encode(x[a:b], w, index[a:b], 1, 4, KEY, config,
                             out=one[off : off + (b - a) * size].view(b - a, size))
    many = torch.zeros(nbytes, dtype=torch.uint8)
    dynamiq_numba.encode_runs(x, runs, index, 1, 4, KEY, config, many)
    assert torch.equal(one, many)

    acc_one, acc_many = x.clone(), x.clone()
    for w, a, b, off in runs:
        size = codec.record_nbytes(w, config.scales)
        dynamiq_numba.decode_accumulate(one[off : off + (b - a) * size].view(b - a, size), w,
                                        config, acc_one[a:b])
    dynamiq_numba.decode_accumulate_runs(one, runs, config, acc_many)
    assert torch.equal(acc_one.view(torch.int32), acc_many.view(torch.int32))

    # a hop: the incoming widths above, outgoing ones that differ for some runs
    out_widths = [2, 6, 8, 16, 16]
    out_runs, out_nbytes = _runs_layout(out_widths, per, config)
    pieces = [(w_in, w_out, a, b, off_in, off_out) for (w_in, a, b, off_in), (w_out, _, _, off_out)
              in zip(runs, out_runs, strict=True)]
    acc_one, acc_many = x.clone(), x.clone()
    hop_one = torch.zeros(out_nbytes, dtype=torch.uint8)
    for w_in, w_out, a, b, off_in, off_out in pieces:
        s_in, s_out = codec.record_nbytes(w_in, config.scales), codec.record_nbytes(w_out,
                                                                                    config.scales)
        rec = one[off_in : off_in + (b - a) * s_in].view(b - a, s_in)
        target = hop_one[off_out : off_out + (b - a) * s_out].view(b - a, s_out)
        if w_in == w_out:
            dynamiq_numba.decode_accumulate_encode(rec, w_in, acc_one[a:b], index[a:b], 1, 4,
                                                   KEY, config, keep_sum=False, out=target)
        else:
            dynamiq_numba.decode_accumulate(rec, w_in, config, acc_one[a:b])
            dynamiq_numba.encode(acc_one[a:b], w_out, index[a:b], 1, 4, KEY, config,
                                 out=target)
    hop_many = torch.zeros(out_nbytes, dtype=torch.uint8)
    dynamiq_numba.hop_runs(one, pieces, acc_many, index, 1, 4, KEY, config, hop_many)
    assert torch.equal(hop_one, hop_many)
    assert torch.equal(acc_one.view(torch.int32), acc_many.view(torch.int32))

    mean = torch.randn(rows, generator=g)
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    valid[-1] = 100
    restored_one = torch.full((rows * SUPER,), -3.0)
    restored_many = torch.full((rows * SUPER,), -3.0)
    records = []
    for w, a, b, off in runs:
        size = codec.record_nbytes(w, config.scales)
        records.append((one[off : off + (b - a) * size].view(b - a, size), w, a, b))
        dynamiq_numba.decode_restore(records[-1][0], w, config, mean[a:b], index[a:b],
                                     valid[a:b], restored_one)
    dynamiq_numba.decode_restore_runs(records, config, mean, index, valid, restored_many)
    assert torch.equal(restored_one.view(torch.int32), restored_many.view(torch.int32))

    with pytest.raises(ValueError, match="outside"):
        dynamiq_numba.encode_runs(x, [(5, 0, rows + 1, 0)], index, 1, 4, KEY, config, many)
    with pytest.raises(ValueError, match="outside"):
        dynamiq_numba.decode_accumulate_runs(one, [(8, 0, per, nbytes)], config, acc_many)
    with pytest.raises(ValueError, match="outside"):
        dynamiq_numba.hop_runs(one, [(2, 2, 0, per, 0, out_nbytes)], acc_many, index, 1, 4, KEY,
                               config, hop_many)
    with pytest.raises(ValueError, match="outside"):
        dynamiq_numba.decode_restore_runs([(records[0][0], 2, rows - 1, rows - 1 + per)], config,
                                          mean, index,
                                          valid, restored_many)
