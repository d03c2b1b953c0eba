"""The simulator: identical to the executor for dynamiq (none: up to fp32 rounding) at small n,
bounded memory by batches that do not change the result, hierarchical plans statistically
equivalent, Ctrl-C keeps what was computed."""

from __future__ import annotations

import pytest
import torch

import dqcoll
from dqcoll.testing import run_local
from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.graph import Topology
from dqcoll.topology.hierarchical import LevelSpec, build_hierarchical_plan
from dqcoll.topology.placement import build_placed_schedule
from dqcoll.topology.simulator import simulate, simulate_hierarchical
from dqcoll.topology.sources import make_source
from dqcoll.topology.steps import placed_plan
from dqcoll_lab.dynamiq import PAPER

CASES = [
    ("ring", "dynamiq", 4, "gaussian", 3000, {}),
    ("butterfly", "dynamiq", 5, "lognormal-mixture:supergroups=24", None, {}),
    ("direct", "dynamiq", 3, "gaussian", 2000, {}),
    ("butterfly", "none", 5, "gaussian", 1001, {}),
    ("ring", "dynamiq", 5, "lognormal-mixture:supergroups=40", None, {"format": PAPER}),
    ("butterfly", "dynamiq", 6, "lognormal-mixture:supergroups=70", None,
     {"format": PAPER, "bits": 8.5}),
    ("ring", "dynamiq", 6, "lognormal-mixture:supergroups=70;noise=torch", None, {"bits": 8.5}),
    ("ring", "mxfp8", 5, "lognormal-mixture:supergroups=20", None, {}),
    ("butterfly", "mxfp8", 6, "lognormal-mixture:supergroups=20", 5000, {"scale": "global"}),
    ("direct", "mxfp8", 3, "gaussian", 4000, {"scale": "global"}),
]


def _executor(source, algorithm, scheme, n, seed, step, op="sum", **options):
    def body(comm):
        x = source.rank_tensor(comm.rank).clone()
        dqcoll.allreduce(x, comm=comm, algorithm=algorithm, scheme=scheme, seed=seed, step=step,
                         op=op, **options)
        return x

    return run_local(n, body)[0]


def _executor_vnmse(source, algorithm, scheme, n, seed, step, op="sum", **options):
    out = _executor(source, algorithm, scheme, n, seed, step, op, **options)
    exact = source.exact_sum() / (n if op == "avg" else 1)
    return dqcoll.metrics.vnmse(out, exact)


@pytest.mark.parametrize("algorithm,scheme,n,spec,numel,options", CASES,
                         ids=[f"{a}-{s}-W{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for a, s, n, _, _, o in CASES])
def test_simulator_matches_executor(algorithm, scheme, n, spec, numel, options):
    """Same seed and step: the simulated all-reduce is the local transport's, bit for bit (the
    simulator reproduces the executor's bytes; ``none``: up to fp32 rounding), whether the rows
    come from the source's row access or from the scratch file (noise=torch, gaussian); so is
    the vNMSE."""
    source = make_source(spec, world_size=n, numel=numel, seed=1)
    options = dict(options)
    bits = options.pop("bits", 5.0) if scheme == "dynamiq" else None
    out = torch.empty(source.numel)
    result = simulate(build_schedule(algorithm, n), source, scheme=scheme, bits=bits, seed=9,
                      step=4, output=out, **options)
    extra = dict(options, **({"bits": bits} if bits is not None else {}))
    expected = _executor(source, algorithm, scheme, n, 9, 4, **extra)
    if scheme == "none":
        # the simulator replays ``none`` in the input dtype on every hop (its cost model's
        # bytes); the executor sums exactly (fp64 partial sums): the same up to fp32 rounding
        assert dqcoll.metrics.vnmse(out, expected) < 1e-12
    else:
        assert torch.equal(out, expected)
    vnmse = dqcoll.metrics.vnmse(expected, source.exact_sum())
    assert result.complete and result.chunks_done == result.chunks_total == n
    if scheme == "none":
        assert result.vnmse < 1e-12 and vnmse < 1e-12
    else:
        assert result.vnmse == pytest.approx(vnmse, rel=1e-9)
    if scheme == "dynamiq":
        # below 64 super-groups the tail's padding is budgeted too (scheme.py)
        slack = (result.numel + 255) / result.numel if result.numel < 64 * 256 else 1.0
        assert result.bits_used is not None and result.bits_used <= bits * slack + 1e-12


def test_simulator_avg_and_independent_rounding():
    """op=avg and rounding='independent' are simulated as the executor runs them."""
    for scheme, options in (("dynamiq", {"rounding": "independent", "bits": 6.0}),
                            ("dynamiq", {"format": PAPER, "bits": 6.0}),
                            ("mxfp8", {"scale": "global"})):
        source = make_source("gaussian", world_size=4, numel=2048, seed=2)
        out = torch.empty(2048)
        options = dict(options)
        bits = options.pop("bits", None)
        simulate(build_schedule("ring", 4), source, scheme=scheme, bits=bits, seed=1, step=0,
                 op="avg", output=out, **options)
        extra = dict(options, **({"bits": bits} if bits is not None else {}))
        assert torch.equal(out, _executor(source, "ring", scheme, 4, 1, 0, op="avg", **extra))


def test_placed_plan_matches_the_placed_schedule():
    """A closed-form plan on a topology (no Schedule object) gives the bytes of the placed
    schedule's simulation, which are the executor's."""
    topology = Topology.cluster(2, 4)
    source = make_source("lognormal-mixture:supergroups=50", world_size=8, seed=3)
    for algorithm in ("ring", "butterfly"):
        a, b = torch.empty(source.numel), torch.empty(source.numel)
        simulate(placed_plan(algorithm, topology), source, bits=6.0, output=a)
        simulate(build_placed_schedule(algorithm, topology), source, bits=6.0, output=b,
                 memory_mb=0.001)
        assert torch.equal(a, b)


def test_batches_do_not_change_the_result():
    """A memory bound small enough to force one chunk per batch gives the same vNMSE."""
    source = make_source("lognormal-mixture:supergroups=32", world_size=6, seed=0)
    schedule = build_schedule("butterfly", 6)
    big = simulate(schedule, source, scheme="dynamiq", bits=5.0, memory_mb=512)
    small = simulate(schedule, source, scheme="dynamiq", bits=5.0, memory_mb=0.001)
    assert small.vnmse == pytest.approx(big.vnmse, rel=1e-12)  # same bytes; fp64 sums


def test_interrupt_keeps_partial_result():
    """Ctrl-C during the simulation pass returns the chunks done so far."""
    source = make_source("gaussian", world_size=4, numel=4096, seed=0)
    calls = []

    def progress(done, total):
        calls.append(done)
        if done > 4 and len(calls) > 6:
            raise KeyboardInterrupt

    result = simulate(build_schedule("ring", 4), source, scheme="dynamiq", bits=5.0,
                      memory_mb=0.001, progress=progress)
    assert not result.complete
    assert 0 < result.chunks_done < result.chunks_total
    assert 0 < result.vnmse < 1


def test_hierarchical_simulation_equivalent_to_execution():
    """none inside hosts + dynamiq across: the simulated vNMSE is statistically the measured
    one (different random streams, same distribution), and far below a flat dynamiq ring over
    all ranks at the same bits."""
    topology = Topology.cluster(2, 2)
    plan = build_hierarchical_plan(topology, intra=LevelSpec("none", algorithm="ring"),
                                   inter=LevelSpec("dynamiq", 5.0, "ring"))
    source = make_source("lognormal-mixture:supergroups=128", world_size=4, seed=5)
    simulated = simulate_hierarchical(plan, source, seed=0)

    def body(comm):
        x = source.rank_tensor(comm.rank).clone()
        dqcoll.allreduce(x, comm=comm, seed=0, algorithm=plan)
        return x

    measured = dqcoll.metrics.vnmse(run_local(4, body)[0], source.exact_sum())
    assert simulated.complete and simulated.chunks_done == 2
    assert 0.7 < simulated.vnmse / measured < 1.4
    flat = simulate(build_schedule("ring", 4), source, scheme="dynamiq", bits=5.0)
    assert simulated.vnmse < flat.vnmse


def test_unsupported_scheme_is_explicit():
    """A scheme without a batched adapter raises and names the ones that exist."""
    source = make_source("gaussian", world_size=2, numel=256, seed=0)
    with pytest.raises(dqcoll.DqcollError, match="'dynamiq' and 'none'"):
        simulate(build_schedule("ring", 2), source, scheme="thc")
    assert torch.is_tensor(source.rank_tensor(0))


def test_simulator_matches_executor_at_moderate_n():
    """33 ranks (a butterfly that is not a power of two, hop widths over 6 count classes, raw
    16-bit rows at 8.5 bits): still the local transport's output, bit for bit."""
    source = make_source("lognormal-mixture:supergroups=66", world_size=33, seed=5)
    out = torch.empty(source.numel)
    simulate(placed_plan("butterfly", Topology.cluster(1, 33)), source, bits=8.5, seed=2,
             step=1, output=out, memory_mb=2)
    assert torch.equal(out, _executor(source, "butterfly", "dynamiq", 33, 2, 1, bits=8.5))
