"""The planner (:mod:`dqcoll.planner`): the job's hosts from every rank's identity, measured
rates agreed over ranks, plans the same on every rank, calibration from measured calls."""

from __future__ import annotations

import collections
import math

import pytest

from dqcoll import planner
from dqcoll.errors import InvalidArgumentError
from dqcoll.testing import run_local
from dqcoll.topology.cost import KernelRates


def _rates(intra: float | None = 10.0, inter: float | None = 1.0) -> planner.MeasuredRates:
    kernels = (("none", KernelRates(0.1, 0.2)), ("bf16", KernelRates(0.3, 0.6)),
               ("dynamiq", KernelRates(4.0, 0.8, 1.6)))
    return planner.MeasuredRates(intra, inter, kernels, cores_per_machine=2)


def _job(hosts: tuple[tuple[int, ...], ...]) -> planner.JobTopology:
    n = sum(len(h) for h in hosts)
    return planner.JobTopology(hosts, (0,) * n)


def test_discovery_groups_ranks_by_host_and_agrees_everywhere():
    """Ranks that report the same host identity form one host (in rank order of first
    appearance); every rank builds the same job and, from the agreed rates, the same plans."""

    def fn(comm):
        identity = (100 + comm.rank % 2, 7)  # hosts {0, 2} and {1, 3}
        job = planner.discover_job(comm.transport, identity=identity)
        rates = planner.measure_rates(comm.transport, job)
        plans = planner.Planner(job, rates)
        made = [plans.plan("allreduce", n, "float32") for n in (1 << 16, 1 << 24)]
        return job, rates, [p.as_dict() for p in made]

    out = run_local(4, fn)
    job, rates, plans = out[0]
    assert job.hosts == ((0, 2), (1, 3)) and job.machines == (0, 0, 0, 0)
    assert job.two_level and job.ranks_per_host == 2
    assert rates.intra_gbps is not None and rates.inter_gbps is not None
    assert all(o[0] == job and o[1] == rates and o[2] == plans for o in out)


def test_one_host_has_no_two_level_candidates():
    """A job on one host (or with one rank per host) is planned flat only; with hosts of equal
    size > 1, two-level candidates appear with an exact or 16-bit intra level."""
    flat = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    assert all(c[3] is None for c in flat.candidates("allreduce", "auto", 5.0))
    two = planner.Planner(_job(((0, 1), (2, 3))), _rates())
    levels = [c[3] for c in two.candidates("allreduce", "auto", 5.0) if c[3] is not None]
    assert levels and {lv.intra.scheme for lv in levels} == {"none", "bf16"}
    assert {lv.inter.scheme for lv in levels} == {"dynamiq"}
    named = two.candidates("allreduce", "int8_block", None)
    assert {c[0] for c in named} == {"int8_block"}


def test_slow_ports_make_two_levels_win_and_fast_ones_do_not():
    """On 2 x 2 with a slow inter-host port and fast local links, the planner picks a two-level
    plan for large buffers; where the local links are the slow ones (the exact intra level
    would cross them with 32 bits per coordinate), a flat one."""
    slow = planner.Planner(_job(((0, 1), (2, 3))), _rates(intra=40.0, inter=0.5))
    assert slow.plan("allreduce", 64 << 20, "float32").is_two_level
    fast = planner.Planner(_job(((0, 1), (2, 3))), _rates(intra=0.5, inter=80.0))
    assert not fast.plan("allreduce", 64 << 20, "float32", scheme="dynamiq").is_two_level


def test_plan_lists_every_alternative_best_first_and_honours_a_named_algorithm():
    """The plan's alternatives are every candidate with its predicted time, best first, the
    chosen one first; algorithm='butterfly' keeps the flat butterfly; all-gather refuses auto."""
    p = planner.Planner(_job(((0, 1), (2, 3))), _rates())
    plan = p.plan("allreduce", 8 << 20, "float32")
    times = [us for _, us in plan.alternatives]
    assert times == sorted(times) and plan.alternatives[0][0] == plan.label
    assert len(plan.alternatives) == len(p.candidates("allreduce", "auto", None))
    named = p.plan("allreduce", 8 << 20, "float32", scheme="dynamiq", algorithm="butterfly")
    assert named.algorithm == "butterfly" and not named.is_two_level
    with pytest.raises(InvalidArgumentError, match="auto"):
        p.plan("all_gather", 1 << 20, "float32")


def test_measured_calls_recalibrate_and_close_candidates_are_explored_once():
    """A measured call slower than predicted raises that candidate's factor; a never-run
    candidate, predicted with the measured candidates' mean factor, runs once when within the
    exploration margin, and then the faster measured one is kept."""
    p = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    first = p.plan("allreduce", 16 << 20, "float32", scheme="dynamiq")
    p.observe(first, first.predicted_us * 10)  # ten times slower than predicted
    second = p.plan("allreduce", 16 << 20, "float32", scheme="dynamiq")
    assert second.label != first.label
    assert p.factors[first.label] == pytest.approx(10.0)
    # never run, the second was predicted with the measured one's factor (the mean of those
    # that ran)
    assert p.factor(second.label) == pytest.approx(10.0) and "explored" in second.reason
    p.observe(second, second.predicted_us / 10)  # as the uncorrected model predicted
    assert p.factors[second.label] == pytest.approx(1.0)
    third = p.plan("allreduce", 16 << 20, "float32", scheme="dynamiq")
    assert third.label == second.label and "least predicted" in third.reason


def test_least_us_prices_the_call_alone_and_chooses_nothing():
    """least_us: the cost model's least time among plan()'s candidates at the exact size,
    uncalibrated by measured calls, and it leaves no trace (the next plan() is what it would
    have been)."""
    p = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    size = (16 << 20) + 4096
    least = p.least_us("allreduce", size, "float32", scheme="auto", force="dynamiq")
    candidates = p.candidates("allreduce", "auto", None, force="dynamiq")
    assert {c[0] for c in candidates} == {"dynamiq"}
    assert least == min(p.predict_us("allreduce", *c, size, "float32") for c in candidates)
    assert not p._cache and not p._incumbent
    first = p.plan("allreduce", size, "float32", scheme="dynamiq")
    p.observe(first, first.predicted_us * 10)  # measured beside other work: 10x its price
    assert p.least_us("allreduce", size, "float32", scheme="auto", force="dynamiq") == least
    # its codec part: the kernel time of the least-priced plan's steps, a part of its total
    codec = p.least_codec_us(size, "float32", scheme="auto", force="dynamiq")
    best = min(candidates, key=lambda c: p.predict_us("allreduce", *c, size, "float32"))
    steps = p._price(best[0], best[1], best[3], best[2], size, "float32").steps
    assert codec == sum(step.kernel_us for step in steps) and 0 < codec < least


def test_size_classes_share_plans():
    """Sizes in one power-of-two class get the same (cached) plan object."""
    p = planner.Planner(_job(((0, 1), (2, 3))), _rates())
    a = p.plan("allreduce", (1 << 20) + 1, "float32")
    assert p.plan("allreduce", (1 << 20) + 1000, "float32") is a


def test_plan_command_prints_the_topology_and_agreed_plans(tmp_path):
    """``dqcoll plan -g 2`` starts two ranks on loopback, prints the topology it found (one
    host), the plan per size with every alternative's predicted time, and says the ranks agree."""
    import json
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, "-m", "dqcoll.cli.plan", "-g", "2", "-b", "64K",
                           "-e", "256K", "-f", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "topology: 2 ranks: 1 hosts x 2 ranks" in done.stdout
    assert "plans identical on every rank: yes" in done.stdout
    report = json.loads(out.read_text())
    assert [p["nbytes"] for p in report["plans"]] == [64 << 10, 256 << 10]
    assert all(p["alternatives"][0][0] == p["label"] for p in report["plans"])


def test_a_plan_in_use_is_kept_unless_another_is_clearly_faster():
    """Once two plans were measured, the one in use stays while the other is predicted faster
    by less than SWITCH_MARGIN (scattered measurements do not flip the choice), and is left once
    the other is clearly faster."""
    p = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    size = 16 << 20
    first = p.plan("allreduce", size, "float32", scheme="dynamiq")
    p.observe(first, first.predicted_us)
    second = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert second.label != first.label and "explored" in second.reason
    p.observe(second, second.predicted_us * 3)  # much slower: the first stays in use
    assert p.plan("allreduce", size, "float32", scheme="dynamiq").label == first.label
    typical = int(2 ** (int(math.log2(size)) + 0.5))

    def set_predicted(plan, us):  # the factor that makes the plan's prediction ``us``
        raw = p.predict_us("allreduce", plan.scheme, plan.algorithm, plan.bits, None, typical,
                           "float32")
        p.factors[plan.label] = us / raw
        p._ratios[plan.label] = collections.deque([us / raw] * 2)  # measured twice: no second look
        p._cache.clear()

    set_predicted(second, 100.0)
    set_predicted(first, 102.0)  # 2 % slower than the other: kept
    again = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert again.label == first.label and "kept" in again.reason
    set_predicted(first, 120.0)  # 20 % slower: left for the other
    assert p.plan("allreduce", size, "float32", scheme="dynamiq").label == second.label


def test_a_close_candidate_measured_once_gets_a_second_look():
    """A candidate whose only measured call was slow, but predicted within SECOND_LOOK_WITHIN
    of the plan in use, runs once more; measured at its usual speed then, it becomes the plan.
    One measured far off gets no second look."""
    p = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    size = 16 << 20
    first = p.plan("allreduce", size, "float32", scheme="dynamiq")
    p.observe(first, first.predicted_us)
    second = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert "explored once" in second.reason
    p.observe(second, second.predicted_us * 1.15)  # one unlucky call: 15 % slow
    third = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert third.label == second.label and "explored again" in third.reason
    p.observe(third, third.predicted_us / 1.15 * 0.5)  # its usual speed: well below the first
    assert p.samples[second.label] == 2
    fourth = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert fourth.label == second.label and "explored" not in fourth.reason
    fifth = p.plan("allreduce", size, "float32", scheme="dynamiq")
    assert fifth is fourth  # settled: cached until the next measured call

    far = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    first = far.plan("allreduce", size, "float32", scheme="dynamiq")
    far.observe(first, first.predicted_us)
    second = far.plan("allreduce", size, "float32", scheme="dynamiq")
    far.observe(second, second.predicted_us * 2)
    assert far.plan("allreduce", size, "float32", scheme="dynamiq").label == first.label
    assert far.fork().samples == far.samples


def test_a_kind_of_plan_measured_slow_does_not_price_out_the_other_kinds():
    """Two levels measured 5x their prediction: a flat plan never run is still priced by the
    model alone (its kind has no measurement), so it runs next instead of being priced 5x too;
    a flat plan never run beside a measured flat one takes that one's factor."""
    p = planner.Planner(_job(((0, 1), (2, 3))), _rates(intra=40.0, inter=0.5))
    size = 64 << 20
    first = p.plan("allreduce", size, "float32")
    assert first.is_two_level
    p.observe(first, first.predicted_us * 5)
    flat = next(label for label, _ in first.alternatives if not label.startswith("two-level")
                and not label.startswith("native"))
    assert p.factor(flat) == 1.0
    assert p.factor(next(label for label, _ in first.alternatives
                         if label.startswith("two-level") and label != first.label)
                    ) == pytest.approx(5.0)
    second = p.plan("allreduce", size, "float32")
    assert not second.is_two_level
    p.observe(second, second.predicted_us * 1.2)
    other_flat = next(label for label, _ in second.alternatives if label != second.label
                      and not label.startswith(("two-level", "native")))
    assert p.factor(other_flat) == pytest.approx(1.2)


def test_a_factor_is_the_best_of_the_last_measured_calls():
    """One call slowed by other work does not move the plan's factor up (the smallest ratio of
    the last CALIBRATION_WINDOW calls is kept); a plan slower for good is seen so once its
    faster calls have left the window."""
    p = planner.Planner(_job(((0, 1, 2, 3),)), _rates(inter=None))
    size = 16 << 20
    plan = p.plan("allreduce", size, "float32", scheme="dynamiq", algorithm="ring")
    raw = plan.predicted_us  # nothing measured yet: the model's own prediction
    for ratio in (1.0, 3.0, 1.1):
        p.observe(plan, raw * ratio)
    assert p.factors[plan.label] == pytest.approx(1.0)
    for _ in range(planner.CALIBRATION_WINDOW):
        p.observe(plan, raw * 2.0)
    assert p.factors[plan.label] == pytest.approx(2.0)
