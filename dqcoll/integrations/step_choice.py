"""``scheme="auto"`` in the DDP hook, checked where it matters: the step time.

The planner prices each call alone. A DDP bucket's all-reduce, though, runs beside the backward
pass that is still computing the next buckets: a 16-bit all-reduce's transfer hides behind that
compute and costs almost no CPU, while a codec's CPU takes cores from backward wherever the cores
are the limit (CPU ranks sharing cores, a compute-heavy model). What compressing saves or costs
a job shows only in its step time, so the hook measures it there, as follows.

* The warm-up's steps run in 16 bits (torch's ``bf16_compress_hook``): they time the 16-bit
  mode at no extra cost, every one of them but the first (DDP rebuilds its buckets in it).
* The ``samples + 1`` steps after the warm-up run the planner's compressed plans; the first of
  them is not timed either (the planner's first calls measure and explore).
* At the next step's first bucket the ranks agree on the slowest rank's median step time of
  each mode (one all-reduce of two numbers on DDP's group), and the faster mode runs from then
  on: the same on every rank, since the agreed numbers are. Where the two modes are within
  the steps' own spread, either choice costs about the same; medians of several steps keep a
  single slow step (an evaluation, a checkpoint) from deciding.
* Every ``recheck_every`` steps the other mode runs ``samples + 1`` steps again and the choice is
  made again against the current mode's latest steps, so a change in the job (a
  loaded link, a new phase of training) moves it.

A step's time is the time from its first bucket to the next step's first bucket (the rest of its
backward, its exposed communication, the optimizer step and the next forward). Monitored steps
(``monitor_every``: an extra exact all-reduce) are not timed. The check needs at least
:data:`MIN_WARMUP` warm-up steps; with fewer, the planner's per-call choice stands alone.

Rejected: a step-level rule from a cost model (it would have to know the backward's compute and
its overlap with each bucket: a fitted overlap share holds on one machine) and timing the calls
(a bf16 call's transfer is as long as it is, but hidden behind compute).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

__all__ = ["COMPRESSED", "MIN_WARMUP", "SIXTEEN_BIT", "StepChoice"]

SIXTEEN_BIT = "bf16"
COMPRESSED = "compressed"
MIN_WARMUP = 4  # the fewest warm-up steps that time 16 bits: 3 steps after DDP's first


@dataclasses.dataclass
class Choice:
    """One agreed choice: at ``iteration``, the slowest rank's median step time of each mode."""

    iteration: int
    mode: str
    bf16_ms: float
    compressed_ms: float


class StepChoice:
    """Which mode each iteration of a DDP hook with ``scheme="auto"`` runs (module docstring).

    Args:
        warmup_steps: the policy's warm-up (its steps are the 16-bit samples).
        enabled: whether the hook chooses (``scheme="auto"``); otherwise every step after the
            warm-up is compressed and the object only counts the 16-bit steps.
        agree: called with ``[bf16 median s, compressed median s]`` at a decision, on every
            rank at the same iteration; returns the values agreed over the ranks (the maximum).
        samples: timed steps per mode per decision.
        recheck_every: steps between a decision and the next run of the other mode.
        clock: seconds (tests pass their own).
    """

    def __init__(self, warmup_steps: int, enabled: bool,
                 agree: Callable[[list[float]], Sequence[float]], *, samples: int = 5,
                 recheck_every: int = 250,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.warmup_steps = warmup_steps
        self.samples = samples
        self.recheck_every = recheck_every
        self.agree = agree
        self.clock = clock
        self.enabled = enabled and warmup_steps >= MIN_WARMUP
        self.iteration = -1  # the iteration begun last
        self.mode = SIXTEEN_BIT if warmup_steps > 0 else COMPRESSED
        self.choices: list[Choice] = []  # every decision, in order
        self.sixteen_bit_steps = 0  # iterations that ran the 16-bit mode, warm-up included
        # the latest step times of each mode (16 bits: the whole warm-up's)
        self._periods: dict[str, collections.deque[float]] = {
            SIXTEEN_BIT: collections.deque(maxlen=max(samples, warmup_steps)),
            COMPRESSED: collections.deque(maxlen=samples)}
        self._started: tuple[int, float, str, bool] | None = None  # iteration, t, mode, timed
        self._decide_at = warmup_steps + samples + 1
        self._probe_at = -1

    def begin(self, iteration: int, *, timed: bool = True) -> str:
        """Called at the first bucket of ``iteration``: the mode it runs. ``timed=False``: the
        iteration's time is not a sample (a monitored step)."""
        now = self.clock()
        started = self._started
        if started is not None and started[0] == iteration - 1 and started[3]:
            self._periods[started[2]].append(now - started[1])
        previous = self.mode
        if not self.enabled:
            self.mode = SIXTEEN_BIT if iteration < self.warmup_steps else COMPRESSED
        elif iteration < self.warmup_steps:
            self.mode = SIXTEEN_BIT
        elif iteration == self.warmup_steps:
            self.mode = COMPRESSED
        elif iteration == self._decide_at:
            self._decide(iteration)
            self._probe_at = iteration + self.recheck_every
        elif iteration == self._probe_at:
            self.mode = COMPRESSED if self.mode == SIXTEEN_BIT else SIXTEEN_BIT
            self._periods[self.mode].clear()
            self._decide_at = iteration + self.samples + 1
        # the first step of a mode, and the very first step, are not samples
        timed = timed and iteration > 0 and self.mode == previous
        self._started = (iteration, now, self.mode, timed)
        self.iteration = iteration
        if self.mode == SIXTEEN_BIT:
            self.sixteen_bit_steps += 1
        return self.mode

    def _decide(self, iteration: int) -> None:
        def median(mode: str) -> float:
            periods = self._periods[mode]
            return statistics.median(periods) if periods else math.inf

        bf16_s, compressed_s = (float(v) for v in self.agree([median(SIXTEEN_BIT),
                                                              median(COMPRESSED)]))
        if math.isfinite(bf16_s) and math.isfinite(compressed_s):
            self.mode = COMPRESSED if compressed_s < bf16_s else SIXTEEN_BIT
        self.choices.append(Choice(iteration, self.mode, bf16_s * 1e3, compressed_s * 1e3))

    def compressing(self) -> bool:
        """Whether the iteration begun last runs the compressed mode."""
        return self.mode == COMPRESSED
