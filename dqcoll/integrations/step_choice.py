"""The DDP hook's 16-bit mode: its format (:class:`SixteenBitFormat`) and, with ``scheme="auto"``,
whether a step runs it or compresses (:class:`StepChoice`); docs/ddp.md ("Warm-up", "Does
compressing pay for this job?").
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["COMPRESSED", "MIN_WARMUP", "SIXTEEN_BIT", "SixteenBitFormat", "StepChoice",
           "sixteen_bit_wire"]

SIXTEEN_BIT = "16-bit"
COMPRESSED = "compressed"
MIN_WARMUP = 4  # the fewest warm-up steps that time 16 bits: 3 steps after DDP's first


@dataclasses.dataclass
class Choice:
    """One agreed choice: at ``iteration``, the slowest rank's median step time of each mode and
    the largest rank's spread of the samples (the larger mode's median absolute deviation)."""

    iteration: int
    mode: str
    sixteen_bit_ms: float
    compressed_ms: float
    trial_steps: int = 0  # steps of the sampled mode left out: a bucket ran a plan tried once
    spread_ms: float = 0.0
    exposed_ms: float = math.nan  # the slowest rank's median exposed 16-bit communication
    gain_ms: float = math.nan  # the most compressing could save: exposure less what it adds
    next_check: int = -1  # the iteration at which the other mode runs again


def _median(periods: list[float]) -> float:
    return statistics.median(periods) if periods else math.inf


def _spread(periods: list[float]) -> float:
    """The median absolute deviation (0 without samples)."""
    return _median([abs(s - _median(periods)) for s in periods]) if periods else 0.0


class StepChoice:
    """Which mode each iteration of a DDP hook with ``scheme="auto"`` runs (docs/ddp.md).

    ``enabled=False`` (or under :data:`MIN_WARMUP` warm-up steps): every step after the warm-up is
    compressed. ``agree`` is called on every rank at the same iteration with ``[16-bit median s,
    compressed median s, spread s]`` and returns the maximum over the ranks. Compressing is chosen
    only where its median beats the 16-bit one by more than the spread: a difference within the
    samples' own noise keeps the 16-bit mode (torch's hook, exact to 16 bits).

    Before the compressed mode is tried (after the warm-up, and at a recheck from 16 bits), the
    16-bit steps' *exposed* communication bounds what it could gain: ``begin(..., exposed=s,
    cost=s)`` reports, for the 16-bit step just ended, how long its averaging ran on after
    backward produced the last bucket, and what compressing that step would at least have
    added (the DDP hook: the last bucket's compressed all-reduce after backward and, where the
    compute fills the cores, the other buckets' codec, as the planner prices them from the job's
    measured rates; 0 if unknown). Compressing shortens at most the wait and adds its own work,
    so the gain is at most exposure less cost. Where the slowest rank's median of that is within
    the 16-bit samples' spread (``agree`` then gets ``[16-bit median s, gain median s, spread
    s, exposed median s]``) the compressed mode could not win by more than the noise and is not
    tried: no step pays its error to learn that.

    A step that is no sample (untimed, or one in which a bucket ran a plan the planner tries once:
    :meth:`exclude`) makes the sampled mode run one step more, up to ``samples`` more, so that
    the choice rests on ``samples`` steps of the plans the job settles on (which steps are left
    out, and so the decision's iteration, is the same on every rank: the plans are agreed).

    The other mode runs again ``recheck_every`` steps after a decision, or ``retry_every`` steps
    after an *inconclusive* one (16 bits kept although the compressed median was the lower, by
    less than the spread: the samples could not tell the modes apart, as when the machine's
    speed drifts during the trial), doubling after each inconclusive decision in a row up to
    ``recheck_every``.
    """

    def __init__(self, warmup_steps: int, enabled: bool,
                 agree: Callable[[list[float]], Sequence[float]], *, samples: int = 5,
                 recheck_every: int = 250, retry_every: int = 25,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.warmup_steps = warmup_steps
        self.samples = samples
        self.recheck_every = recheck_every
        self.retry_every = retry_every
        self._retry = 0  # the interval after the last inconclusive decision (0: none in a row)
        self.agree = agree
        self.clock = clock
        self.enabled = enabled and warmup_steps >= MIN_WARMUP
        self.iteration = -1  # the iteration begun last
        self.mode = SIXTEEN_BIT if warmup_steps > 0 else COMPRESSED
        self.choices: list[Choice] = []  # every decision, in order
        self.sixteen_bit_steps = 0  # iterations that ran the 16-bit mode, warm-up included
        self._periods: dict[str, collections.deque[tuple[float, bool]]] = {  # (s, clean)
            SIXTEEN_BIT: collections.deque(maxlen=max(samples, warmup_steps)),
            COMPRESSED: collections.deque(maxlen=samples)}
        self._started: tuple[int, float, str, bool] | None = None  # iteration, t, mode, timed
        self._decide_at = warmup_steps + samples + 1
        self._decide_by = self._decide_at + samples  # the latest, after steps left out
        self._trials = 0  # steps of the sampled mode left out since its sampling began
        self._probe_at = -1
        self._excluded: set[int] = set()  # iterations that are no sample (exclude)
        # (exposed s, gain bound s) of the clean timed 16-bit steps
        self._exposed: collections.deque[tuple[float, float]] = collections.deque(
            maxlen=max(samples, warmup_steps))
        self._exposed_ms = self._gain_ms = math.nan  # the agreed medians at the last check

    def begin(self, iteration: int, *, timed: bool = True, exposed: float | None = None,
              cost: float = 0.0) -> str:
        """Called at the first bucket of ``iteration``: the mode it runs. ``timed=False``: the
        iteration's time is not a sample (a monitored step). ``exposed``: seconds the iteration
        before ran on after its last bucket was handed over, if it was averaged in 16 bits;
        ``cost``: seconds compressing that iteration would at least have added."""
        now = self.clock()
        started = self._started
        if started is not None and started[0] == iteration - 1 and started[3]:
            clean = started[0] not in self._excluded
            self._periods[started[2]].append((now - started[1], clean))
            self._trials += not clean
            if clean and started[2] == SIXTEEN_BIT and exposed is not None:
                exposed = max(exposed, 0.0)
                self._exposed.append((exposed, max(exposed - max(cost, 0.0), 0.0)))
        self._excluded.clear()
        previous = self.mode
        if self.enabled and iteration == self.warmup_steps and self._hidden(iteration):
            self.mode = SIXTEEN_BIT  # compressing cannot pay: no trial
        elif not self.enabled or iteration <= self.warmup_steps:
            self.mode = SIXTEEN_BIT if iteration < self.warmup_steps else COMPRESSED
        elif iteration == self._probe_at and self.mode == SIXTEEN_BIT and self._hidden(iteration):
            pass  # still nothing to gain: no trial either
        elif iteration == self._decide_at and iteration < self._decide_by and sum(
                ok for _, ok in self._periods[self.mode]) < self.samples:
            self._decide_at += 1  # a step was left out: one more of this mode
        elif iteration == self._decide_at:
            self._decide(iteration)
        elif iteration == self._probe_at:
            self.mode = COMPRESSED if self.mode == SIXTEEN_BIT else SIXTEEN_BIT
            self._periods[self.mode].clear()
            self._decide_at = iteration + self.samples + 1
            self._decide_by, self._trials = self._decide_at + self.samples, 0
        # the first step of a mode, and the very first step, are not samples
        timed = timed and iteration > 0 and self.mode == previous
        self._started = (iteration, now, self.mode, timed)
        self.iteration = iteration
        if self.mode == SIXTEEN_BIT:
            self.sixteen_bit_steps += 1
        return self.mode

    def _hidden(self, iteration: int) -> bool:
        """Whether the 16-bit steps leave too little communication exposed for compressing to
        win by more than their spread (the same answer on every rank); if so, the choice is
        recorded and the next recheck set."""
        sixteen = [s for s, ok in self._periods[SIXTEEN_BIT] if ok]
        # measured or not (then [inf, inf, 0, inf]), every rank agrees here: no rank waits
        measured = len(sixteen) >= 2 and len(self._exposed) >= 2  # the same on every rank
        sixteen, pairs = (sixteen, list(self._exposed)) if measured else ([], [])
        sixteen_s, gain_s, spread_s, exposed_s = (float(v) for v in self.agree(
            [_median(sixteen), _median([g for _, g in pairs]), _spread(sixteen),
             _median([e for e, _ in pairs])]))
        self._exposed_ms = exposed_s * 1e3 if math.isfinite(exposed_s) else math.nan
        self._gain_ms = gain_s * 1e3 if math.isfinite(gain_s) else math.nan
        if not gain_s <= spread_s:
            return False  # the trial's choice records the exposure too
        self._retry = 0  # nothing to gain, which is no doubt about the trial
        self._probe_at = iteration + self.recheck_every
        self.choices.append(Choice(iteration, SIXTEEN_BIT, sixteen_s * 1e3, math.nan,
                                   spread_ms=spread_s * 1e3, exposed_ms=self._exposed_ms,
                                   gain_ms=self._gain_ms, next_check=self._probe_at))
        self._decide_at = self._decide_by = -1
        return True

    def exclude(self, iteration: int) -> None:
        """``iteration`` is no sample: one of its buckets ran a plan the planner tried once (called
        before the next iteration begins; the decision's iteration does not depend on it)."""
        self._excluded.add(iteration)

    def _decide(self, iteration: int) -> None:
        def samples(mode: str) -> list[float]:
            clean = [s for s, ok in self._periods[mode] if ok]
            return clean if len(clean) >= 2 else [s for s, _ in self._periods[mode]]

        sixteen, compressed = samples(SIXTEEN_BIT), samples(COMPRESSED)
        sixteen_s, compressed_s, spread_s = (float(v) for v in self.agree(
            [_median(sixteen), _median(compressed), max(_spread(sixteen), _spread(compressed))]))
        if math.isfinite(sixteen_s) and math.isfinite(compressed_s):
            self.mode = COMPRESSED if compressed_s + spread_s < sixteen_s else SIXTEEN_BIT
        if self.mode == SIXTEEN_BIT and compressed_s < sixteen_s:  # inconclusive: again soon
            self._retry = min(2 * self._retry if self._retry else self.retry_every,
                              self.recheck_every)
        else:
            self._retry = 0
        self._probe_at = iteration + (self._retry or self.recheck_every)
        self.choices.append(Choice(iteration, self.mode, sixteen_s * 1e3, compressed_s * 1e3,
                                   self._trials, spread_s * 1e3, self._exposed_ms,
                                   self._gain_ms, self._probe_at))

    def compressing(self) -> bool:
        """Whether the iteration begun last runs the compressed mode."""
        return self.mode == COMPRESSED


FP16_MAX = float(torch.finfo(torch.float16).max)


def sixteen_bit_wire(buf: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` rounded to ``dtype`` and divided by ``n``, as torch's fp16 and bf16 hooks send it;
    in fp16, finite values beyond its range saturate so that no partial sum of ``n`` such terms
    overflows (infinite and NaN inputs stay as they are)."""
    wire = buf.to(dtype).div_(n)
    if dtype != torch.float16:
        return wire
    if not buf.is_cuda and wire.numel():  # a CPU bucket in range: torch's hook exactly
        low, high = torch.aminmax(wire)  # one reduction, no mask (NaN: checked below)
        if math.isfinite(float(low)) and math.isfinite(float(high)):
            return wire
    over = torch.isinf(wire)
    limit = torch.tensor(FP16_MAX / n, dtype=torch.float16)
    if float(limit) * n > FP16_MAX:
        limit = torch.nextafter(limit, torch.zeros_like(limit))
    saturated = torch.sign(buf).to(dtype) * limit.to(buf.device)
    return torch.where(over & torch.isfinite(buf), saturated, wire)


OBSERVE_PIECE = 1 << 18  # coordinates of a bucket SixteenBitFormat.observe takes at a time


class SixteenBitFormat:
    """The 16-bit mode's format, fp16 or bf16, whichever rounds the job's gradients closer: fp32
    buckets of iteration 0 and every ``every``-th are :meth:`observe`-d. Until measured, fp16:
    torch's default hook's format, so that where the job keeps it the 16-bit mode is that hook
    bit for bit from the first step."""

    def __init__(self, active: bool, every: int | None = None) -> None:
        self.active, self.every = active, every
        self.dtype = torch.float16
        self.history: list[tuple[int, str, float, float]] = []  # iteration, name, fp16, bf16
        self._sums = [0.0, 0.0]
        self._measured: int | None = None

    @property
    def name(self) -> str:
        return "fp16" if self.dtype == torch.float16 else "bf16"

    def measuring(self, iteration: int) -> bool:
        every = self.every or 0
        return self.active and (iteration == 0 or (every > 0 and iteration % every == 0))

    def observe(self, iteration: int, buf: torch.Tensor, n: int) -> None:
        """Add this rank's squared rounding error of ``buf`` in each format."""
        if self._measured != iteration:
            self._sums, self._measured = [0.0, 0.0], iteration
        # in float64, a cache-sized piece at a time (docs/ddp.md: whole-bucket temporaries, 8
        # bytes a coordinate on fresh pages, are 8x slower)
        for part in buf.reshape(-1).split(OBSERVE_PIECE):
            exact = part.double().div_(n)
            for k, dtype in enumerate((torch.float16, torch.bfloat16)):
                wire = sixteen_bit_wire(part, n, dtype).double()
                error = float(wire.sub_(exact).square_().sum())
                self._sums[k] += error if math.isfinite(error) else math.inf

    def decide(self, iteration: int, agree: Callable[[list[float]], Sequence[float]]) -> None:
        """At ``iteration``'s first bucket: the format from the last iteration's sums, if it
        was measured (the same on every rank)."""
        if self._measured != iteration - 1:
            return
        fp16, bf16 = (float(v) for v in agree(self._sums))
        self._measured = None
        self.dtype = torch.float16 if fp16 < bf16 else torch.bfloat16
        self.history.append((iteration, self.name, fp16, bf16))
