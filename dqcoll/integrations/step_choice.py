"""``scheme="auto"`` in the DDP hook, decided by the step time: :class:`StepChoice`.

The warm-up's steps time the 16-bit mode (torch's ``bf16_compress_hook``), the ``samples + 1``
steps after it the compressed one (the first step of each mode untimed); the ranks then agree on
the slowest rank's median of each and run the faster mode, the same on every rank, and every
``recheck_every`` steps the other mode is timed again. A step runs from its first bucket to the
next step's first bucket; monitored steps are not timed. Needs :data:`MIN_WARMUP` warm-up steps.
Rationale and rejected alternatives: docs/ddp.md ("Does compressing pay for this job?").
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

    ``enabled=False``: every step after the warm-up is compressed; only the 16-bit steps are
    counted. ``agree`` is called on every rank at the same iteration with ``[bf16 median s,
    compressed median s]`` and returns the values agreed over the ranks (the maximum).
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
