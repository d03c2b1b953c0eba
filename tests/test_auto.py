"""``scheme="auto"`` (dqcoll.auto): every rank runs the same candidate, picked by the documented
rule from agreed predictions; the result is that candidate's; forcing and mismatches work."""

from __future__ import annotations

import math

import pytest
import torch

import dqcoll
from dqcoll.auto import CANDIDATES, MARGIN, AutoPolicy, StepChooser
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local


def _inputs(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank))


def test_rule_compresses_only_with_the_margin() -> None:
    """choose() keeps the uncompressed path unless a compressed candidate is predicted at
    least MARGIN faster, and says why."""
    policy = AutoPolicy()
    policy.force = None
    policy.tried = set(CANDIDATES)  # every factor measured: no exploration (rule 5)
    slow = {"none": 100e-3, "bf16": 60e-3, "dynamiq": 30e-3}
    assert policy.choose(slow).scheme == "dynamiq"
    close = {"none": 100e-3, "bf16": 99e-3, "dynamiq": (1 - MARGIN / 2) * 100e-3}
    choice = policy.choose(close)
    assert choice.scheme == "none" and "no compression" in choice.reason
    assert policy.choose({"none": 100e-3, "bf16": 50e-3, "dynamiq": 80e-3}).scheme == "bf16"


def test_a_close_untried_candidate_runs_once() -> None:
    """Rule 5: bf16 predicted 3 % slower than none has never run, so it runs once (and says
    why); after that the model's choice stands. A far candidate is never tried."""
    policy = AutoPolicy()
    policy.force = None
    close = {"none": 100e-3, "bf16": 103e-3, "dynamiq": 400e-3}
    first = policy.choose(close)
    assert first.scheme == "none"  # none itself has never run: the model's choice runs first
    policy.calibrate(100e-3)
    second = policy.choose(close)
    assert second.scheme == "bf16" and "trying bf16 once" in second.reason
    policy.calibrate(90e-3)  # measured faster than predicted: its factor drops
    assert policy.calibration["bf16"] < 1.0
    third = policy.choose(policy_predictions(policy, close))
    assert third.scheme in ("none", "bf16") and "trying" not in third.reason
    assert "dynamiq" not in policy.tried


def policy_predictions(policy: AutoPolicy, raw: dict[str, float]) -> dict[str, float]:
    return {name: t * policy.calibration[name] for name, t in raw.items()}


def test_prediction_follows_link_and_codec_rates() -> None:
    """With a slow link compression wins, with a fast one the uncompressed path: the model
    prices wire bytes over the measured link against the measured per-coordinate CPU."""
    policy = AutoPolicy()
    policy.force = None
    policy.codec_ns = {"none": 0.5, "bf16": 1.0, "dynamiq": 6.0}
    policy.link_bytes_per_s = 125e6  # 1 Gb/s
    slow = policy.predict_s(16 << 20, 4, 4, 5.0, 1.0)
    assert policy.choose(slow).scheme == "dynamiq"
    policy.link_bytes_per_s = 25e9  # 200 Gb/s
    fast = policy.predict_s(16 << 20, 4, 4, 5.0, 1.0)
    assert policy.choose(fast).scheme == "none"
    assert fast["none"] < fast["dynamiq"]


def test_native_paths_are_priced_at_their_measured_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where none and bf16 run the group's own all-reduce, their CPU is the measured CPU of that
    all-reduce times the ranks per core, not one add per coordinate: gloo's fp32 all-reduce at
    3.2 ns of CPU per coordinate against 2.0 ns for bf16 (casts included; the ratio measured on
    loopback) makes bf16 the choice, where the single-shot rates alone keep the uncompressed
    path; a 16-bit buffer's own all-reduce costs half the fp32 one's CPU; without a native
    measurement, or off the native path, the predictions do not change."""
    from dqcoll.kernels import cpu_runtime

    monkeypatch.setattr(cpu_runtime, "ranks_per_core", lambda: 2.0)
    policy = AutoPolicy()
    policy.force = None
    policy.tried = set(CANDIDATES)
    # the single-shot rates: an add per coordinate for none, bf16's casts and add measured slow
    # (9 ns) beside the other ranks' probes
    policy.codec_ns = {"none": 0.5, "bf16": 9.0, "dynamiq": 15.0}
    policy.link_bytes_per_s = 0.55e9  # what the probe measured on 10 Gb/s links (4 ranks)
    numel = 6 << 20
    assert policy.choose(policy.predict_s(numel, 4, 4, 5.0, 1.0, native=True)).scheme == "none"
    policy.native_cpu_ns = {"none": 3.2, "bf16": 2.0}
    plain = policy.predict_s(numel, 4, 4, 5.0, 1.0)
    native = policy.predict_s(numel, 4, 4, 5.0, 1.0, native=True)
    assert plain == policy.predict_s(numel, 4, 4, 5.0, 1.0, native=False)
    assert policy.choose(plain).scheme == "none"
    assert native["none"] > plain["none"] and native["dynamiq"] == plain["dynamiq"]
    choice = policy.choose(native)
    assert choice.scheme == "bf16", choice.reason
    wire_none = 1.5 * numel * 4 / 0.55e9
    cpu_none = numel * 3.2e-9 * 2.0
    assert native["none"] == pytest.approx(max(wire_none, cpu_none)
                                           + 0.35 * min(wire_none, cpu_none))
    half = policy.predict_s(numel, 2, 4, 5.0, 1.0, native=True)["none"]
    assert half == pytest.approx(max(wire_none, cpu_none) / 2 + 0.35 * min(wire_none, cpu_none) / 2)


def test_calibration_moves_towards_measurements() -> None:
    """A call measured at 4x its prediction moves that candidate's factor up (geometric, rate
    1/2: x2), the others stay."""
    policy = AutoPolicy()
    policy.force = None
    policy.choose({"none": 1.0, "bf16": 1.0, "dynamiq": 0.5})
    policy.calibrate(2.0)
    assert policy.calibration["dynamiq"] == pytest.approx(2.0)
    assert policy.calibration["none"] == policy.calibration["bf16"] == 1.0
    policy.calibrate(5.0)  # nothing pending: no change
    assert policy.calibration["dynamiq"] == pytest.approx(2.0)
    policy.frozen = True  # the DDP hook's overlapping lanes: a call's time is not its own
    policy.choose({"none": 1.0, "bf16": 1.0, "dynamiq": 0.5})
    policy.calibrate(8.0)
    assert policy.calibration["dynamiq"] == pytest.approx(2.0) and policy.pending is None


def test_an_unmeasured_call_neither_calibrates_nor_explores() -> None:
    """A call chosen with ``measured=False`` leaves nothing to calibrate and does not try an
    untried close candidate (it would count as tried without ever being measured); the next
    measured call does."""
    policy = AutoPolicy()
    policy.force = None
    close = {"none": 1.0, "bf16": 0.6, "dynamiq": 0.55}
    assert policy.choose(close).scheme == "dynamiq"  # the model's choice runs first
    unmeasured = policy.choose(close, measured=False)
    assert unmeasured.scheme == "dynamiq" and policy.pending is None
    assert policy.tried == {"dynamiq"}
    policy.calibrate(5.0)
    assert policy.calibration["dynamiq"] == 1.0
    explored = policy.choose(close)
    assert explored.scheme == "bf16" and "trying bf16 once" in explored.reason
    assert policy.pending == ("bf16", 0.6)


def test_unmeasured_steps_leave_the_factors_alone() -> None:
    """A call whose ``step`` is in ``unmeasured_steps`` (the DDP hook's buckets that run during
    backward) moves no factor when the next call reports its time; a measured one does, and
    every rank keeps the same factors."""

    def fn(comm: dqcoll.Communicator) -> tuple[dict, dict, dict]:
        policy = comm.auto
        x = _inputs(comm.rank, 50_000)
        dqcoll.allreduce(x.clone(), scheme="auto", comm=comm, step=1)  # measures, runs
        policy.unmeasured_steps = frozenset({0})
        dqcoll.allreduce(x.clone(), scheme="auto", comm=comm, step=0)  # calibrates step 1's
        before = dict(policy.calibration)
        dqcoll.allreduce(x.clone(), scheme="auto", comm=comm, step=1)  # step 0's: not measured
        after_unmeasured = dict(policy.calibration)
        dqcoll.allreduce(x.clone(), scheme="auto", comm=comm, step=0)  # step 1's: measured
        return before, after_unmeasured, dict(policy.calibration)

    results = run_local(2, fn)
    assert results[0] == results[1]
    before, after_unmeasured, after = results[0]
    assert after_unmeasured == before
    assert after != before


def _auto_calls(comm: dqcoll.Communicator, numel: int) -> list[dict]:
    results = []
    for step in range(3):
        x = _inputs(comm.rank, numel)
        dqcoll.allreduce(x, scheme="auto", op="avg", comm=comm, step=step)
        info = dict(comm.last_info)
        # the same call with the chosen scheme named explicitly, at the same step (a stochastic
        # scheme's rounding is seeded by the step, which otherwise counts calls)
        y = _inputs(comm.rank, numel)
        dqcoll.allreduce(y, scheme=info["scheme"], op="avg", comm=comm, step=step)
        results.append({"x": x, "y": y, "info": info,
                        "calibration": dict(comm.auto.calibration)})
    return results


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_makes_the_same_choice(world_size: int) -> None:
    """Over in-process ranks (no native all-reduce: candidates run on dqcoll's executor) every
    rank reports the same choice, agreed predictions and calibration, ends bit-identical, and
    the result equals an explicit call of the chosen scheme."""
    numel = 3 * 4096 + 5
    results = run_local(world_size, _auto_calls, numel)
    for call in range(3):
        infos = [r[call]["info"] for r in results]
        assert len({i["scheme"] for i in infos}) == 1
        assert all(i["auto"] == infos[0]["auto"] for i in infos)
        assert infos[0]["scheme"] in CANDIDATES
        assert set(infos[0]["auto"]["predicted_ms"]) == set(CANDIDATES)
        assert all(r[call]["calibration"] == results[0][call]["calibration"] for r in results)
        for r in results:
            assert torch.equal(r[call]["x"], results[0][call]["x"])
            assert torch.equal(r[call]["x"], r[call]["y"])


def test_forced_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_AUTO_FORCE overrides the model (the predictions are still reported)."""
    monkeypatch.setenv("DQCOLL_AUTO_FORCE", "bf16")

    def body(comm: dqcoll.Communicator) -> dict:
        x = _inputs(comm.rank, 2048)
        dqcoll.allreduce(x, scheme="auto", comm=comm)
        return dict(comm.last_info)

    for info in run_local(2, body):
        assert info["scheme"] == "bf16"
        assert "forced" in info["auto"]["reason"]
        assert all(math.isfinite(v) for v in info["auto"]["predicted_ms"].values())


# -- rule 6: the DDP hook's step-level choice (StepChooser) ---------------------------------------


def _drive(chooser: StepChooser, step_s: dict[str, float], predicted: dict[str, float],
           iterations: int) -> list[str | None]:
    """Run ``iterations`` iterations as the DDP hook does: each ends, its time (that of the
    candidate it ran, the per-call rule's "dynamiq" when unplanned) arrives with the next."""
    ran: list[str | None] = []
    for k in range(iterations):
        ran.append(chooser.choice(k))
        measured = (k - 1, step_s[ran[k - 1] or "dynamiq"]) if k else None
        chooser.end_of_iteration(k, measured, predicted)
    return ran


def test_step_chooser_compares_close_candidates_by_their_steps() -> None:
    """Two candidates predicted within STEP_CLOSE: each runs ``rounds`` iterations, interleaved;
    the faster step wins and runs ``hold`` iterations; then they are compared again."""
    chooser = StepChooser(rounds=2, hold=10)
    predicted = {"none": 0.100, "bf16": 0.105, "dynamiq": 0.300}
    ran = _drive(chooser, {"none": 0.195, "bf16": 0.180, "dynamiq": 0.3}, predicted, 30)
    # iteration 0 ends -> the comparison is planned for 1..4; decided at the end of 5
    assert ran[:7] == [None, "none", "bf16", "none", "bf16", None, "bf16"]
    assert chooser.history[0][0] == 5 and chooser.history[0][2] == "bf16"
    assert chooser.history[0][1] == pytest.approx({"none": 0.195, "bf16": 0.180})
    assert ran[6:15] == ["bf16"] * 9
    assert ran[15:20] == ["none", "bf16", "none", "bf16", "bf16"]  # compared again
    assert "fastest training step" in chooser.reason(22) and "bf16 180.0" in chooser.reason(22)


def test_step_chooser_leaves_a_clear_choice_to_the_per_call_rule() -> None:
    """One candidate predicted far ahead (1 Gb/s: dynamiq): no comparison, nothing forced;
    infinite or unknown predictions never count as close."""
    chooser = StepChooser()
    ran = _drive(chooser, {"dynamiq": 0.3}, {"none": 0.9, "bf16": 0.5, "dynamiq": 0.2}, 8)
    assert ran == [None] * 8 and not chooser.history
    chooser = StepChooser()
    assert _drive(chooser, {"dynamiq": 0.3}, {"none": 0.2, "bf16": math.inf}, 6) == [None] * 6
    assert _drive(StepChooser(), {"dynamiq": 0.3}, {}, 6) == [None] * 6


def test_step_chooser_decides_when_a_report_is_lost() -> None:
    """A planned iteration whose time never arrives (a monitored or failed one): the comparison
    still ends, from what was measured."""
    chooser = StepChooser(rounds=1, hold=100)
    predicted = {"none": 0.1, "bf16": 0.1}
    chooser.end_of_iteration(0, None, predicted)  # plans 1: none, 2: bf16
    assert chooser.choice(1) == "none" and chooser.choice(2) == "bf16"
    assert "comparing training steps of bf16, none" in chooser.reason(1)
    chooser.end_of_iteration(1, None, predicted)
    chooser.end_of_iteration(2, (1, 0.2), predicted)  # 2's time is lost
    for k in range(3, 6):
        chooser.end_of_iteration(k, None, predicted)
    assert chooser.choice(6) == "none" and chooser.history[-1][1] == {"none": 0.2}
    with pytest.raises(ValueError):
        StepChooser(close=0.9)


def _step_reports(comm: dqcoll.Communicator) -> list:
    """Each rank reports another iteration time; the next auto call agrees the slowest."""
    agreed = []
    for k in range(3):
        comm.auto.step_report = (k, 0.010 * (comm.rank + 1) + k)
        dqcoll.allreduce(_inputs(comm.rank, 1024), scheme="auto", comm=comm, step=k)
        agreed.append(comm.auto.agreed_step)
        comm.auto.agreed_step = None
        assert comm.auto.step_report is None  # sent once
    dqcoll.allreduce(_inputs(comm.rank, 1024), scheme="auto", comm=comm, step=9)
    agreed.append(comm.auto.agreed_step)  # no report rode along
    comm.auto.step_choice = ("bf16", "rule 6 test")
    dqcoll.allreduce(_inputs(comm.rank, 1024), scheme="auto", comm=comm, step=10)
    return [agreed, dict(comm.last_info)]


def test_step_reports_are_agreed_and_a_step_choice_runs() -> None:
    """The step report rides along with one auto call's argument check, which agrees the
    slowest rank's time (microseconds); a step choice set on the policy runs on every rank."""
    results = run_local(3, _step_reports)
    for agreed, info in results:
        assert agreed[:3] == [(k, pytest.approx(0.030 + k, abs=1e-6)) for k in range(3)]
        assert agreed[3] is None
        assert info["scheme"] == "bf16" and info["auto"]["reason"] == "rule 6 test"


def test_auto_against_an_explicit_scheme_raises_on_every_rank() -> None:
    """One rank auto, another dynamiq: a MismatchError on both before data moves."""

    def body(comm: dqcoll.Communicator) -> str:
        x = _inputs(comm.rank, 4096)
        try:
            dqcoll.allreduce(x, scheme="auto" if comm.rank == 0 else "dynamiq", comm=comm)
        except DqcollError as exc:
            return type(exc).__name__
        return "no error"

    assert run_local(2, body) == ["MismatchError", "MismatchError"]


def test_auto_refuses_all_gather() -> None:
    def body(comm: dqcoll.Communicator) -> str:
        try:
            dqcoll.all_gather(torch.zeros(8), torch.zeros(16), scheme="auto", comm=comm)
        except DqcollError as exc:
            return str(exc)
        return ""

    assert all("allreduce and reduce_scatter" in text for text in run_local(2, body))


def test_ranks_agree_without_the_argument_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """DQCOLL_VALIDATE=0 skips the argument check, but not auto's agreement: ranks whose own
    predictions would differ (different codec rates here) still run the same candidate."""
    monkeypatch.setenv("DQCOLL_VALIDATE", "0")

    def body(comm: dqcoll.Communicator) -> list[str]:
        policy = comm.auto
        policy.force = None
        policy.link_bytes_per_s = 125e6
        # rank 0 thinks dynamiq is cheap, rank 1 that it is very expensive
        dyn = 0.1 if comm.rank == 0 else 1e4
        policy.codec_ns = {"none": 0.5, "bf16": 1e4, "dynamiq": dyn}
        chosen = []
        for _ in range(2):
            x = _inputs(comm.rank, 1 << 16)
            dqcoll.allreduce(x, scheme="auto", comm=comm)
            chosen.append(comm.last_info["scheme"])
        return chosen

    first, second = run_local(2, body)
    assert first == second == ["none", "none"]  # the slowest rank's prediction decides
