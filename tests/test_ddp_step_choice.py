"""``scheme="auto"``'s step-time check in the DDP hook (dqcoll.integrations.step_choice).

The schedule and the decision with a clock the test drives; then on a real 2-rank gloo DDP job
whose ranks' clocks disagree: one agreed mode on both ranks, 16 bits taking over when it is the
faster, and bit-identical replicas throughout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_ddp_hook import _MLP, _batch, _spawn
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dqcoll.integrations import step_choice as step_choice_module
from dqcoll.integrations.step_choice import COMPRESSED, MIN_WARMUP, SIXTEEN_BIT, StepChoice
from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

WARMUP = 5
SAMPLES = 3


class _Clock:
    """A clock the test advances: each call returns the time of the current iteration's start."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(periods: dict[str, float], iterations: int, *, enabled: bool = True,
         warmup: int = WARMUP, slow: frozenset[int] = frozenset(),
         recheck_every: int = 250, exposed: float | None = None,
         cost: float = 0.0) -> tuple[StepChoice, list[str], list[list[float]]]:
    """Begin ``iterations`` iterations; each takes ``periods[its mode]`` seconds, those in
    ``slow`` 100 s; each 16-bit one reports ``exposed`` seconds of exposed communication and a
    cost of compressing of ``cost`` s. Returns the object, each iteration's mode and what ``agree``
    was given."""
    clock, agreed = _Clock(), []

    def agree(values: list[float]) -> list[float]:
        agreed.append(list(values))
        return values

    choice = StepChoice(warmup, enabled, agree, samples=SAMPLES, recheck_every=recheck_every,
                        clock=clock)
    modes: list[str] = []
    for iteration in range(iterations):
        after_sixteen = bool(modes) and modes[-1] == SIXTEEN_BIT
        mode = choice.begin(iteration, exposed=exposed if after_sixteen else None, cost=cost)
        modes.append(mode)
        clock.now += 100.0 if iteration in slow else periods[mode]
    return choice, modes, agreed


INF = float("inf")
UNMEASURED = [INF, INF, 0.0, INF]  # the exposure check's agree where none was reported


def test_schedule_and_choice_of_the_faster_mode() -> None:
    """The warm-up runs 16 bits, the next SAMPLES + 1 steps compressed; then the faster mode by
    median step time; the first step and a mode's first step are not samples."""
    choice, modes, agreed = _run({SIXTEEN_BIT: 1.0, COMPRESSED: 2.0}, 20, slow=frozenset({0, 5}))
    decide = WARMUP + SAMPLES + 1
    assert modes[:WARMUP] == [SIXTEEN_BIT] * WARMUP
    assert modes[WARMUP:decide] == [COMPRESSED] * (SAMPLES + 1)
    assert modes[decide:] == [SIXTEEN_BIT] * (20 - decide)
    assert agreed == [UNMEASURED, [1.0, 2.0, 0.0]]  # iterations 0 and 5 took 100 s: no samples
    assert [(c.iteration, c.mode, c.sixteen_bit_ms, c.compressed_ms) for c in choice.choices] == [
        (decide, SIXTEEN_BIT, 1000.0, 2000.0)]
    assert choice.sixteen_bit_steps == 20 - SAMPLES - 1

    choice, modes, _ = _run({SIXTEEN_BIT: 2.0, COMPRESSED: 1.5}, 20)
    assert modes[decide:] == [COMPRESSED] * (20 - decide)
    assert choice.sixteen_bit_steps == WARMUP


def test_hidden_communication_skips_the_trial() -> None:
    """16-bit steps whose averaging leaves no more than their spread exposed after backward: the
    compressed mode could not win by more than the noise, so it is not tried, after the warm-up
    nor at a recheck; more exposure than the spread, and it is tried as before."""
    choice, modes, agreed = _run({SIXTEEN_BIT: 1.0, COMPRESSED: 0.5}, 30, exposed=0.0,
                                 recheck_every=10)
    assert modes == [SIXTEEN_BIT] * 30
    assert agreed == [[1.0, 0.0, 0.0, 0.0]] * 3  # after the warm-up, at iterations 15 and 25
    assert [(c.iteration, c.mode, c.exposed_ms) for c in choice.choices] == [
        (WARMUP, SIXTEEN_BIT, 0.0), (WARMUP + 10, SIXTEEN_BIT, 0.0),
        (WARMUP + 20, SIXTEEN_BIT, 0.0)]
    assert math.isnan(choice.choices[0].compressed_ms)

    decide = WARMUP + SAMPLES + 1
    choice, modes, agreed = _run({SIXTEEN_BIT: 1.0, COMPRESSED: 0.5}, 20, exposed=0.4)
    assert agreed[0] == [1.0, 0.4, 0.0, 0.4]
    assert modes[WARMUP:] == [COMPRESSED] * (20 - WARMUP)
    assert [(c.iteration, c.mode) for c in choice.choices] == [(decide, COMPRESSED)]


def test_the_cost_of_compressing_comes_off_the_exposure() -> None:
    """What compressing adds (``cost``: e.g. its own last bucket after backward) comes off what it
    could save: 0.4 s exposed, 0.35 s of cost: 0.05 s to gain, within a 0.1 s spread, so no
    trial; 0.2 s of cost leaves 0.2 s, more than the spread: tried."""
    clock = _Clock()
    agreed: list[list[float]] = []
    choice = StepChoice(WARMUP, True, functools.partial(_keep, agreed), samples=SAMPLES,
                        clock=clock)
    for iteration in range(WARMUP + 1):  # 16-bit steps of 1.0 and 1.2 s: spread 0.1 s
        choice.begin(iteration, exposed=0.4 if iteration > 1 else None, cost=0.35)
        clock.now += 1.0 + 0.2 * (iteration % 2)
    assert choice.mode == SIXTEEN_BIT
    [made] = choice.choices
    assert (made.mode, made.exposed_ms) == (SIXTEEN_BIT, 400.0)
    assert made.gain_ms == pytest.approx(50.0) and made.spread_ms == pytest.approx(100.0)
    assert agreed[0][1] == pytest.approx(0.05) and agreed[0][3] == 0.4

    choice, modes, agreed = _run({SIXTEEN_BIT: 1.0, COMPRESSED: 0.5}, 20, exposed=0.4, cost=0.2)
    assert agreed[0][1] == pytest.approx(0.2)
    assert modes[WARMUP:] == [COMPRESSED] * (20 - WARMUP)
    assert choice.choices[0].gain_ms == pytest.approx(200.0)


def test_recheck_runs_the_other_mode_and_follows_a_change() -> None:
    """recheck_every steps after a decision the other mode runs SAMPLES + 1 steps and the choice
    is made again: here 16 bits wins first, then the compressed mode (its steps got faster)."""
    clock, agreed = _Clock(), []
    choice = StepChoice(WARMUP, True, lambda v: agreed.append(v) or v, samples=SAMPLES,
                        recheck_every=10, clock=clock)
    decide = WARMUP + SAMPLES + 1
    modes = []
    for iteration in range(30):  # the next probe would be at iteration 33
        mode = choice.begin(iteration)
        modes.append(mode)
        compressed_s = 2.0 if iteration < decide + 5 else 0.5
        clock.now += 1.0 if mode == SIXTEEN_BIT else compressed_s
    probe = decide + 10
    assert modes[decide:probe] == [SIXTEEN_BIT] * 10
    assert modes[probe:probe + SAMPLES + 1] == [COMPRESSED] * (SAMPLES + 1)
    assert agreed == [UNMEASURED, [1.0, 2.0, 0.0], UNMEASURED, [1.0, 0.5, 0.0]]
    assert modes[probe + SAMPLES + 1:] == [COMPRESSED] * (30 - probe - SAMPLES - 1)
    assert [c.mode for c in choice.choices] == [SIXTEEN_BIT, COMPRESSED]


def _keep(agreed: list[list[float]], values: list[float]) -> list[float]:
    agreed.append(list(values))
    return values


def test_compressing_must_beat_the_samples_noise() -> None:
    """Compressed steps faster by less than the samples' spread (the larger mode's median
    absolute deviation, agreed as the maximum over ranks) keep 16 bits; faster by more, they win.
    16-bit samples 0.8, 1.2, 0.8, 1.2 s (median 1.0, spread 0.2); compressed 0.9 s, then 0.7 s."""
    sixteen = (1.0, 0.8, 1.2, 0.8, 1.2)  # iteration 0: not a sample
    for compressed_s, expected in ((0.9, SIXTEEN_BIT), (0.7, COMPRESSED)):
        clock, agreed = _Clock(), []
        choice = StepChoice(WARMUP, True, functools.partial(_keep, agreed), samples=SAMPLES,
                            clock=clock)
        for iteration in range(WARMUP + SAMPLES + 2):
            mode = choice.begin(iteration)
            clock.now += (sixteen[iteration] if iteration < WARMUP
                          else 1.0 if mode == SIXTEEN_BIT else compressed_s)
        assert agreed[0] == UNMEASURED and agreed[-1] == pytest.approx([1.0, compressed_s, 0.2])
        assert choice.choices[0].mode == expected and choice.mode == expected
        assert choice.choices[0].spread_ms == pytest.approx(200.0)


def test_an_inconclusive_trial_is_tried_again_sooner() -> None:
    """Compressed steps faster than 16-bit ones by less than the spread (the machine slowed
    during the trial) keep 16 bits but run the trial again after retry_every steps, not
    recheck_every; another inconclusive one doubles the interval; a trial whose compressed
    steps are clearly faster then compresses; compressed steps slower than 16-bit ones are no
    doubt: the next check is recheck_every away. 16-bit steps take 0.7, 1.3 and 1.0 s in turn
    (any 5 or 6 in a row: median 1.0, spread 0.3)."""
    warmup, retry = 6, 6
    decide = warmup + SAMPLES + 1

    def play(compressed: Callable[[int], float], iterations: int
             ) -> tuple[StepChoice, list[str]]:
        clock = _Clock()
        choice = StepChoice(warmup, True, lambda v: v, samples=SAMPLES, recheck_every=100,
                            retry_every=retry, clock=clock)
        modes = []
        for iteration in range(iterations):
            mode = choice.begin(iteration)
            modes.append(mode)
            clock.now += (compressed(iteration) if mode == COMPRESSED
                          else (0.7, 1.3, 1.0)[iteration % 3])
        return choice, modes

    # two inconclusive trials (0.9 s), then a clear one (0.5 s)
    second = decide + retry + SAMPLES + 1
    third = second + 2 * retry + SAMPLES + 1
    choice, modes = play(lambda i: 0.9 if i < third - SAMPLES - 1 else 0.5, third + 3)
    assert [(c.iteration, c.mode, c.next_check) for c in choice.choices] == [
        (decide, SIXTEEN_BIT, decide + retry), (second, SIXTEEN_BIT, second + 2 * retry),
        (third, COMPRESSED, third + 100)]
    assert modes[decide:decide + retry] == [SIXTEEN_BIT] * retry
    assert modes[decide + retry:second] == [COMPRESSED] * (SAMPLES + 1)
    assert modes[third:] == [COMPRESSED] * 3

    # compressed slower: no doubt, the usual recheck
    choice, _ = play(lambda i: 2.0, decide + 2)
    assert [(c.mode, c.next_check) for c in choice.choices] == [(SIXTEEN_BIT, decide + 100)]


def test_untimed_steps_and_disabled_check() -> None:
    """A step begun with timed=False is no sample (the compressed mode runs one step more for
    it); without auto, or with a warm-up too short to time 16 bits, every step after the warm-up
    is compressed and agree is never called."""
    clock = _Clock()
    choice = StepChoice(WARMUP, True, lambda v: v, samples=SAMPLES, clock=clock)
    for iteration in range(WARMUP + SAMPLES + 3):
        mode = choice.begin(iteration, timed=iteration != WARMUP + 2)
        clock.now += 50.0 if iteration == WARMUP + 2 else (1.0 if mode == SIXTEEN_BIT else 3.0)
    assert (choice.choices[0].sixteen_bit_ms, choice.choices[0].compressed_ms) == (1000.0, 3000.0)
    assert choice.choices[0].iteration == WARMUP + SAMPLES + 2

    for enabled, warmup in ((False, WARMUP), (True, MIN_WARMUP - 1)):
        choice, modes, agreed = _run({SIXTEEN_BIT: 1.0, COMPRESSED: 9.0}, 20, enabled=enabled,
                                     warmup=warmup)
        assert modes == [SIXTEEN_BIT] * warmup + [COMPRESSED] * (20 - warmup)
        assert agreed == [] and choice.choices == [] and not choice.enabled


# -- a real DDP job -------------------------------------------------------------------------------

STEPS = 18  # a trial's decision at iteration 11 to 16 with the default samples (5)


def _ddp_job(rank: int, world_size: int, exposed: float | None) -> dict[str, Any]:
    """DynamiqState(scheme="auto", warmup_steps=WARMUP) on 2 gloo ranks whose clocks disagree:
    rank 0 sees compressed steps faster (0.5 s against 1 s in 16 bits), rank 1 far slower (8 s
    against 1 s). The test's clock stands still within a step, so the hook measures no exposed
    communication; ``exposed`` (seconds) replaces what it reports, if given. Per step: did the
    hook average in 16 bits itself (its 16-bit path sets last_info["warmup"])?"""
    ticks = {"now": 0.0}
    model = DistributedDataParallel(_MLP(), bucket_cap_mb=0.05)
    state = DynamiqState(scheme="auto", warmup_steps=WARMUP)
    state.step_choice.clock = lambda: ticks["now"]
    reported: list[float] = []  # what the hook measured
    begin = state.step_choice.begin

    def begin_reporting(iteration: int, **kwargs: Any) -> str:
        if kwargs.get("exposed") is not None:
            reported.append(kwargs["exposed"])
            if exposed is not None:
                kwargs["exposed"] = exposed
        return begin(iteration, **kwargs)

    state.step_choice.begin = begin_reporting  # type: ignore[method-assign]
    model.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    per_step: list[str] = []
    schemes_run: list[Any] = []  # what a compressed step's last bucket ran
    for step in range(STEPS):
        x, y = _batch(rank, step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        state.drain()
        per_step.append("16-bit" if "warmup" in state.last_info else "dqcoll")
        optimizer.step()
        compressed = state.step_choice.mode == "compressed"
        ticks["now"] += (0.5 if rank == 0 else 8.0) if compressed else 1.0
        if compressed:
            schemes_run.append(state.last_info.get("scheme"))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"schemes": per_step, "params": params, "sixteen_bit_steps": state.sixteen_bit_steps,
            "forces": [lane.comm.auto_force for lane in state.lane_list],
            "compressed_schemes": schemes_run, "reported": reported,
            "choices": [(c.iteration, c.mode, c.sixteen_bit_ms, c.compressed_ms)
                        for c in state.step_choice.choices]}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(tmp_path_factory.mktemp("step_choice"), 2,
                  functools.partial(_ddp_job, exposed=0.5))


def test_ddp_ranks_agree_and_16_bits_takes_over(two_ranks: list[dict[str, Any]]) -> None:
    """With communication exposed, the compressed mode is tried; both ranks make the same
    choice from the slowest rank's medians (16 bits: 1000 ms against 8000) at the same
    iteration (later by one for each step the planner explored in), average in 16 bits from
    the decision on, count the same 16-bit steps and end with bit-identical parameters."""
    first, second = two_ranks
    assert first["choices"] == second["choices"] and len(first["choices"]) == 1
    decide, mode, sixteen_ms, compressed_ms = first["choices"][0]
    samples = 5  # DynamiqState's default
    assert WARMUP + samples + 1 <= decide <= WARMUP + 2 * samples + 1 < STEPS
    assert (mode, sixteen_ms, compressed_ms) == (SIXTEEN_BIT, 1000.0, 8000.0)
    for result in two_ranks:
        assert result["schemes"][:WARMUP] == ["16-bit"] * WARMUP
        assert "16-bit" not in result["schemes"][WARMUP:decide]
        assert result["schemes"][decide:] == ["16-bit"] * (STEPS - decide)
        assert result["sixteen_bit_steps"] == STEPS - (decide - WARMUP)
        # the compressed mode compresses: its planner considers dynamiq's plans only
        assert result["compressed_schemes"] and set(result["compressed_schemes"]) == {"dynamiq"}
        assert set(result["forces"]) == {"dynamiq"}
    assert torch.equal(first["params"], second["params"])


def test_ddp_hidden_communication_is_not_tried(tmp_path: Any) -> None:
    """The hook's own measurement: after each 16-bit step it reports the time from the last
    bucket's hand-over to the last average's completion (0 here: the test's clock stands still
    within a step), no more than the 16-bit steps' spread, so the compressed mode is never
    tried and every step is averaged in 16 bits, the same on both ranks."""
    first, second = _spawn(tmp_path, 2, functools.partial(_ddp_job, exposed=None))
    assert repr(first["choices"]) == repr(second["choices"])  # NaN: no compressed median
    [(decide, mode, sixteen_ms, compressed_ms)] = first["choices"]
    assert (decide, mode, sixteen_ms) == (WARMUP, SIXTEEN_BIT, 1000.0)
    assert math.isnan(compressed_ms)
    for result in (first, second):
        assert result["schemes"] == ["16-bit"] * STEPS and result["sixteen_bit_steps"] == STEPS
        assert result["reported"] == [0.0] * (STEPS - 1) and result["compressed_schemes"] == []
    assert torch.equal(first["params"], second["params"])


def test_module_defaults() -> None:
    """What DynamiqState() runs: the check on with auto (the default) and its default warm-up,
    off for a fixed scheme."""
    assert step_choice_module.StepChoice(10, True, lambda v: v).enabled
    state = DynamiqState(scheme="dynamiq")
    assert not state.step_choice.enabled and state.should_compress(10)


def test_sixteen_bit_format_schedule_and_decision() -> None:
    """SixteenBitFormat measures iteration 0 and every ``every``-th, decides at the next
    iteration from the agreed sums (the smaller error wins, an infinite or NaN one loses, a tie
    goes to bf16's range), and keeps its format where the last iteration was not measured."""
    form = step_choice_module.SixteenBitFormat(True, every=4)
    assert [i for i in range(10) if form.measuring(i)] == [0, 4, 8]
    assert not step_choice_module.SixteenBitFormat(False, 4).measuring(0)
    assert [i for i in range(10) if step_choice_module.SixteenBitFormat(True).measuring(i)] == [0]
    ordinary = torch.linspace(-0.5, 0.5, 1000)
    form.observe(0, ordinary, 4)
    form.observe(0, ordinary, 4)  # a second bucket of the same iteration adds to the sums
    seen: list[list[float]] = []
    form.decide(1, lambda v: seen.append(list(v)) or [2 * x for x in v])
    assert form.name == "fp16" and seen[0][0] < seen[0][1] and form.history[0][:2] == (1, "fp16")
    form.decide(2, lambda v: pytest.fail("iteration 1 was not measured"))
    assert form.name == "fp16" and len(form.history) == 1
    form.observe(4, torch.full((10,), 1e-9), 4)  # fp16's subnormals: bf16 rounds closer
    form.decide(5, lambda v: v)
    assert form.name == "bf16"
    form.observe(8, ordinary, 4)
    form.decide(9, lambda v: [float("nan"), 1.0])
    assert form.name == "bf16"
    form.observe(8, ordinary, 4)
    form.decide(9, lambda v: [1.0, 1.0])
    assert form.name == "bf16"


def test_steps_with_a_trial_plan_are_no_samples() -> None:
    """A compressed step in which a bucket ran a plan the planner tries once (exclude) is no
    sample: the compressed mode runs one step more for each, so that the decision rests on
    SAMPLES clean steps, and two slow trial steps do not make compressed (2 s) lose to 16 bits
    (3 s). At most SAMPLES steps more: with every compressed step a trial the decision comes
    SAMPLES steps late and every sample counts."""
    decide = WARMUP + SAMPLES + 1
    for trials, expected, at in (
            (frozenset({WARMUP + 1}), COMPRESSED, decide + 1),
            (frozenset({WARMUP + 1, WARMUP + 2}), COMPRESSED, decide + 2),
            (frozenset(range(WARMUP, decide + SAMPLES)), SIXTEEN_BIT, decide + SAMPLES)):
        clock = _Clock()
        choice = StepChoice(WARMUP, True, lambda v: v, samples=SAMPLES, clock=clock)
        modes = []
        for iteration in range(decide + SAMPLES + 3):
            mode = choice.begin(iteration)
            modes.append(mode)
            if iteration in trials:
                choice.exclude(iteration)
            clock.now += 30.0 if iteration in trials else (3.0 if mode == SIXTEEN_BIT else 2.0)
        assert [c.iteration for c in choice.choices] == [at], (trials, choice.choices)
        assert modes[WARMUP:at] == [COMPRESSED] * (at - WARMUP)
        assert choice.choices[0].mode == expected, (trials, choice.choices)
        assert choice.choices[0].trial_steps == len(trials - {WARMUP})  # WARMUP: untimed


def test_cores_are_busy_where_the_ranks_compute_threads_fill_them(monkeypatch: Any) -> None:
    """The other buckets' codec counts against compressing only where the compute threads of
    the ranks on one machine (the most on any machine) fill its cores."""
    from types import SimpleNamespace

    from dqcoll.integrations.torch_ddp import _cores_busy

    def planner(machines: tuple[int, ...], cores: int) -> Any:
        return SimpleNamespace(job=SimpleNamespace(machines=machines),
                               rates=SimpleNamespace(cores_per_machine=cores))

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _cores_busy(planner((0, 0, 0, 0), 2))  # this VM: 4 ranks on 2 cores
    assert _cores_busy(planner((0, 0, 1, 1), 2))
    assert not _cores_busy(planner((0, 0, 1, 1), 8))  # 2 single-threaded ranks on 8 cores
    assert not _cores_busy(planner((0, 1, 2, 3), 2))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert _cores_busy(planner((0, 0, 1, 1), 8))  # 2 ranks x 4 threads
