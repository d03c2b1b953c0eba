"""``scheme="auto"``: per call, the fastest of ``none``, ``bf16`` and ``dynamiq``, chosen the same
way on every rank.

The rule (:meth:`AutoPolicy.choose`), in one place:

1. **Predict** each candidate's call time from two measured rates::

       t(s) = max(wire_s, cpu_s) + OVERLAP_REST * min(wire_s, cpu_s)
       wire_s = 2 (n - 1) / n * numel * bits_s / 8 / link_bytes_per_s
       cpu_s  = numel * codec_ns_s * 1e-9 * share

   ``bits_s`` is 32 or 16 for ``none`` on fp32 / 16-bit buffers, 16 for ``bf16``, the budget for
   ``dynamiq`` (``bits``, or ~8 bits for ``target_vnmse``); ``link_bytes_per_s`` is what the
   communicator measured on its own traffic (:meth:`AutoPolicy.measure_link`: a ring exchange
   of :data:`PROBE_NBYTES` at its first ``auto`` call, or at ``DynamiqState.prepare``);
   ``codec_ns_s`` is the CPU time per coordinate of each scheme's whole call, measured at the
   same moment on this rank's own kernels (:func:`measure_codec_ns`); ``share`` is how many
   ranks of this machine share a core. Pipelining overlaps a tile's transfer with another
   tile's codec, so the smaller of the two costs only partly (:data:`OVERLAP_REST`).

   Where ``none`` and ``bf16`` run the process group's own all-reduce (an all-reduce over a
   torch group), their ``cpu_s`` is that all-reduce's own CPU: the process CPU time (every
   thread: gloo's copies, its reduction loop, the socket calls; for ``bf16`` the casts too) of
   an all-reduce of :data:`NATIVE_PROBE_NUMEL` coordinates timed beside the link probe
   (:meth:`AutoPolicy.measure_native`), per coordinate, times the ranks per core of this
   machine (CPU seconds become wall seconds where ranks share cores). A 16-bit all-reduce moves
   and adds half the bytes: 25 MB of fp32 took 20 ms of CPU per rank against 13 ms as bf16
   (casts included) with 4 gloo ranks on loopback, 2-core VM, where the wall times were equal;
   priced as ``x + y`` per coordinate (0.5 ns), the CPU of the uncompressed path was missed
   and ``auto`` kept it at 10 Gb/s where torch's fp16 hook ran a DDP step 12 % faster.
2. **Calibrate** with what calls measured: after each call its time (the slowest rank's,
   agreed in the next call's argument check) over its prediction moves that candidate's factor
   (geometric mean, weight :data:`CALIBRATION_RATE`), so the model's errors (Python glue, core
   sharing, the link under load) are corrected by measurement. Calls that share the machine
   with other work of the job are left out (``AutoPolicy.unmeasured_steps``: the DDP hook's
   buckets that run during backward): their time counts that work too, and only the candidate
   that ran would be charged for it (at 10 Gb/s bf16's factor crept up on every step until
   ``auto`` switched to ``none``, whose DDP step was 12 % slower than torch's fp16 hook).
3. **Agree**: every rank puts its predictions into the argument check, which takes the maximum
   over ranks (the slowest rank decides a collective's time); every rank then picks from the
   same numbers, so all run the same scheme (no extra message).
4. **Choose** the candidate with the least agreed time, but compress (``bf16`` or ``dynamiq``)
   only where it beats the uncompressed prediction by :data:`MARGIN` (5 %): a wrong prediction
   then costs at most that margin against not compressing, which is the promise of ``auto``.
5. **Try once what is close**: a candidate that has never run on this communicator and whose
   prediction is within :data:`EXPLORE_WITHIN` of the chosen one's runs once instead (after
   the chosen one has run and been measured itself), so that
   its factor is measured rather than assumed. Only calibrated predictions are trusted to be
   within 5 %: the model does not price everything (gloo's reduction loop, the cast kernels
   under core sharing), and at 10 Gb/s ``none`` and ``bf16`` differ by less than that error.
   One such call costs at most ``EXPLORE_WITHIN`` over the chosen candidate's prediction, once
   per candidate; the choice is a function of agreed numbers, so every rank explores together.

6. **The training step decides between close candidates** (the DDP hook only,
   :class:`StepChooser`): where two or more candidates are predicted within
   :data:`STEP_CLOSE` of the best for an iteration's buckets, the hook runs each of them for
   every bucket of :data:`STEP_ROUNDS` iterations, interleaved, measures the training step
   (the time between the ends of two iterations, the slowest rank's, agreed in the next
   iteration's first argument check) and runs the fastest for :data:`STEP_HOLD` iterations
   before comparing again. A call's time cannot see what the step sees: the buckets before the
   last share the cores with backward, and on loopback (4 ranks on 2 cores) the fp16 hook's
   step was 10 % faster than DDP's fp32 one while the two all-reduces alone measured within a
   few percent; ``auto`` had chosen the fp32 one and was 8.7 % slower than the fp16 hook.

``last_info["auto"]`` says what was chosen, the agreed predictions in ms and why. Override:
pass a scheme name instead of ``"auto"``, or ``AutoPolicy.force`` / ``DQCOLL_AUTO_FORCE``
(which also turns rule 6 off).

``none`` and ``bf16`` chosen by ``auto`` over a torch process group run that group's own
all-reduce (gloo's or NCCL's, what DDP runs without a hook; ``bf16``: cast, sum in bf16, cast
back, as torch's ``bf16_compress_hook``), so ``auto`` is never slower than them because of
dqcoll's executor; over other transports they run dqcoll's ``none`` / ``bf16`` schemes.

Rejected: a tuned table per (size, link) (needs a tuning run per cluster and goes stale when the
network is shared), and trying every candidate in turn and keeping the fastest (a slow candidate
costs a whole call each time it is retried): rule 5 tries only a close candidate, once.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from . import envs
from .kernels import cpu_runtime

__all__ = ["CANDIDATES", "AutoChoice", "AutoPolicy", "StepChooser", "measure_codec_ns"]

CANDIDATES = envs.AUTO_CHOICES  # ("none", "bf16", "dynamiq"), also DQCOLL_AUTO_FORCE's values
# Compress only where the prediction beats not compressing by this fraction: the bound on how
# much slower than the uncompressed path a wrong prediction can make a call.
MARGIN = 0.05
# The share of the smaller of (wire, codec) that pipelining does not hide (tiles overlap one
# tile's transfer with another's codec; the first and last tiles do not overlap).
OVERLAP_REST = 0.35
# A never-run candidate predicted within this factor of the chosen one is run once (rule 5).
EXPLORE_WITHIN = 1.25
# Weight of each measured call in the calibration factor (geometric).
CALIBRATION_RATE = 0.5
# The link probe: each rank sends this many bytes to the next rank and receives as many from
# the previous (a ring, every link busy at once, as in a ring all-reduce), best of two, after
# one smaller exchange. ~35 ms on a 1 Gb/s link, ~170 ms on 200 Mb/s.
PROBE_NBYTES = 4 << 20
# The native all-reduce's CPU probe (fp32 and bf16 of this many coordinates, best of two after a
# smaller one): 4 MiB of fp32, ~10 ms of each rank's CPU with 4 ranks on 2 cores.
NATIVE_PROBE_NUMEL = 1 << 20
# Per-coordinate CPU of a call of each candidate relative to the single-shot codec measured at
# warm-up (dynamiq: encode + decode of one buffer; a ring all-reduce also runs the statistics,
# the hops' fused decode-encode and the restore: about 1.5 of that per coordinate per rank).
CALL_OVER_CODEC = 1.5
# Bits per coordinate dynamiq is assumed to send under target_vnmse (its widths vary per call).
TARGET_BITS = 8.0
_CODEC_NUMEL = 1 << 20
# Rule 6 (StepChooser): candidates whose predictions for an iteration's buckets (summed) are
# within this factor of the best are compared by the training step itself; each runs this
# many iterations of the comparison (interleaved); the fastest then runs this many iterations
# before the next comparison. At 4 iterations per comparison and 200 between, a slow candidate
# costs at most ~1 % of the iterations.
STEP_CLOSE = 1.3
STEP_ROUNDS = 2
STEP_HOLD = 200
# The handshake's extra slots: the previous call's time, one prediction per candidate, then a
# step report: (iteration + 1) * 2**32 + the iteration's time in microseconds (0: none; the
# iteration is the same on every rank, so the maximum is the slowest rank's time).
STEP_SLOTS = 1
_STEP_US_BITS = 32


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` chose for one call, and why (``last_info["auto"]``)."""

    scheme: str
    predicted_ms: dict[str, float]  # agreed over ranks (the slowest rank's prediction)
    reason: str

    def as_info(self) -> dict[str, Any]:
        return {"chosen": self.scheme, "predicted_ms": dict(self.predicted_ms),
                "reason": self.reason}


def measure_codec_ns(device: torch.device, bits: float) -> dict[str, float]:
    """CPU (or device) nanoseconds per coordinate of each candidate's call on this rank: the
    single-shot codec of ``_CODEC_NUMEL`` N(0, 1) coordinates on this device's kernels, best of
    three, times :data:`CALL_OVER_CODEC`; ``none`` is one add of the partial sums."""
    from . import schemes

    g = torch.Generator().manual_seed(0)
    x = torch.randn(_CODEC_NUMEL, generator=g).to(device)
    y = torch.randn(_CODEC_NUMEL, generator=g).to(device)

    def best(fn: Any) -> float:
        fn()
        elapsed = math.inf
        for _ in range(3):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = min(elapsed, time.perf_counter() - start)
        return elapsed * 1e9 / _CODEC_NUMEL

    dynamiq = schemes.get("dynamiq", bits=bits)
    return {
        "none": best(lambda: x.add(y)),
        # the native path's cast to bf16, sum and cast back (the executor's bf16 scheme costs
        # more; calibration corrects the factor where it runs)
        "bf16": best(lambda: x.to(torch.bfloat16).add_(y.to(torch.bfloat16)).float()),
        "dynamiq": best(lambda: dynamiq.decode(dynamiq.encode(x))) * CALL_OVER_CODEC,
    }


class AutoPolicy:
    """The measured rates and calibration of one communicator's ``auto`` calls (``comm.auto``).
    Everything that decides a choice is agreed over ranks, so every rank holds the same
    ``link_bytes_per_s`` and ``calibration``; ``codec_ns`` is this rank's own (its predictions
    are maximised over ranks in the argument check)."""

    def __init__(self) -> None:
        # -- measured: the link (agreed: the slowest rank's), this rank's codecs --
        self.link_bytes_per_s: float | None = None
        self.codec_ns: dict[str, float] = {}
        # process CPU ns per coordinate of the group's own fp32 ("none") and bf16 all-reduce
        # (empty where the transport has none, or before the first measurement)
        self.native_cpu_ns: dict[str, float] = {}
        # -- corrected by measured calls (agreed): candidate -> measured / predicted --
        self.calibration: dict[str, float] = {name: 1.0 for name in CANDIDATES}
        # -- the previous auto call, calibrated in the next one's argument check --
        self.pending: tuple[str, float] | None = None  # (scheme, agreed prediction in s)
        self.last_elapsed_s = 0.0  # this rank's time of that call
        self.force = envs.auto_force()  # a candidate to run whatever the model says, or None
        self.history: list[AutoChoice] = []  # the last choices (bounded), for inspection
        self.tried: set[str] = set()  # candidates run at least once (their factor is measured)
        # no calibration (and no exploration) while set: the DDP hook sets it for its first
        # compressed iteration and on its lanes while they overlap buckets (a call's time then
        # counts another lane's work; agreed, as the lanes' spread)
        self.frozen = False
        # calls whose ``step`` is in here are not measured: the DDP hook lists its buckets that
        # run during backward (their time counts backward's work on the shared cores as theirs)
        self.unmeasured_steps: frozenset[int] = frozenset()
        # -- rule 6 (the DDP hook's StepChooser) --
        # (candidate, reason) every call runs, set between iterations by the hook
        self.step_choice: tuple[str, str] | None = None
        # this rank's time of a training iteration, (iteration, seconds): sent in the next call's
        # argument check, which agrees the slowest rank's into ``agreed_step``
        self.step_report: tuple[int, float] | None = None
        self.agreed_step: tuple[int, float] | None = None

    # -- measurement ------------------------------------------------------------------------------

    def ready(self) -> bool:
        return self.link_bytes_per_s is not None and bool(self.codec_ns)

    def measure_link(self, transport: Any, *, what: str = "auto link probe") -> float:
        """Time a ring exchange of :data:`PROBE_NBYTES` (every rank sends to the next and
        receives from the previous at once), best of two after a smaller one, and agree on the
        slowest rank's rate (a min over ranks). Collective: every rank calls it at the same
        point. Returns bytes per second."""
        n, rank = transport.world_size, transport.rank
        if n == 1:
            self.link_bytes_per_s = math.inf
            return self.link_bytes_per_s
        device = getattr(transport, "device", None) or torch.device("cpu")
        send = torch.zeros(PROBE_NBYTES, dtype=torch.uint8, device=device)
        recv = torch.empty_like(send)
        best = math.inf
        for size in (PROBE_NBYTES // 8, PROBE_NBYTES, PROBE_NBYTES):
            start = time.perf_counter()
            transport.exchange([((rank + 1) % n, send[:size])], [((rank - 1) % n, recv[:size])],
                               what=f"{what} ({size} B)")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if size == PROBE_NBYTES:
                best = min(best, time.perf_counter() - start)
        rate = torch.tensor([-PROBE_NBYTES / best], dtype=torch.float64, device=device)
        transport.allreduce(rate, "max", what=f"{what} (agree)")  # max of -rate: the min rate
        self.link_bytes_per_s = float(-rate.item())
        self.measure_native(transport, what=what)
        return self.link_bytes_per_s

    def measure_native(self, transport: Any, *, what: str = "auto link probe") -> None:
        """Where ``transport`` has the group's own all-reduce (``native_allreduce``) on the CPU:
        the process CPU time per coordinate of ``none``'s and ``bf16``'s native path (scaled
        fp32 all-reduce; cast, all-reduce in bf16, cast back), best of two after a smaller one,
        into :attr:`native_cpu_ns`. Collective (every rank calls it at the same point). The
        process CPU counts gloo's own threads; nothing else of the process should run meanwhile
        (``DynamiqState`` measures when it is made, before training)."""
        n = transport.world_size
        device = getattr(transport, "device", None) or torch.device("cpu")
        native = getattr(transport, "native_allreduce", None)
        if native is None or n == 1 or device.type != "cpu":
            return
        buf = torch.randn(NATIVE_PROBE_NUMEL, generator=torch.Generator().manual_seed(0))

        def run(name: str, numel: int) -> None:
            flat = buf[:numel]
            if name == "none":
                native(flat.mul_(1.0 / n), what=f"{what} (native fp32)")
                return
            work = flat.to(torch.bfloat16).div_(n)
            native(work, what=f"{what} (native bf16)")
            flat.copy_(work)

        for name in ("none", "bf16"):
            best = math.inf
            for numel in (NATIVE_PROBE_NUMEL // 8, NATIVE_PROBE_NUMEL, NATIVE_PROBE_NUMEL):
                start = time.process_time()
                run(name, numel)
                if numel == NATIVE_PROBE_NUMEL:
                    best = min(best, time.process_time() - start)
            self.native_cpu_ns[name] = best * 1e9 / NATIVE_PROBE_NUMEL

    def measure_codecs(self, device: torch.device, bits: float) -> None:
        self.codec_ns = measure_codec_ns(device, bits)

    # -- the rule ---------------------------------------------------------------------------------

    def predict_s(self, numel: int, element_nbytes: int, world_size: int, bits: float,
                  cores_shared: float, *, native: bool = False) -> dict[str, float]:
        """This rank's calibrated prediction of each candidate's call time (seconds).
        ``native``: ``none`` and ``bf16`` run the group's own all-reduce, priced at its measured
        CPU (:attr:`native_cpu_ns`) where there is one."""
        assert self.link_bytes_per_s is not None
        wire_bits = {"none": 8.0 * element_nbytes, "bf16": 16.0, "dynamiq": bits}
        factor = 2.0 * (world_size - 1) / world_size
        predicted = {}
        for name in CANDIDATES:
            wire = factor * numel * wire_bits[name] / 8.0 / self.link_bytes_per_s
            cpu = numel * self.codec_ns[name] * 1e-9 * cores_shared
            if native and name in self.native_cpu_ns:
                # CPU seconds of every thread, as wall seconds where ranks share the cores; a
                # 16-bit buffer's own all-reduce moves half the bytes of the fp32 one measured
                per_coordinate = self.native_cpu_ns[name] * (
                    element_nbytes / 4.0 if name == "none" else 1.0)
                cpu = numel * per_coordinate * 1e-9 * cpu_runtime.ranks_per_core()
            raw = max(wire, cpu) + OVERLAP_REST * min(wire, cpu)
            predicted[name] = raw * self.calibration[name]
        return predicted

    def choose(self, agreed_s: dict[str, float], *, measured: bool = True) -> AutoChoice:
        """The candidate to run from the agreed predictions (see the module docstring).
        ``measured=False``: the call's time will not be measured (``unmeasured_steps``), so it
        calibrates nothing and explores nothing (an untried candidate would stay unmeasured)."""
        ms = {name: round(t * 1e3, 3) for name, t in agreed_s.items()}
        if self.force is not None:
            choice = AutoChoice(self.force, ms, f"forced by DQCOLL_AUTO_FORCE={self.force}")
        elif self.step_choice is not None:
            choice = AutoChoice(self.step_choice[0], ms, self.step_choice[1])
        else:
            baseline = agreed_s["none"]
            best = min(("bf16", "dynamiq"), key=lambda name: agreed_s[name])
            if agreed_s[best] <= (1.0 - MARGIN) * baseline:
                reason = (f"{best} predicted {ms[best]:g} ms against {ms['none']:g} ms "
                          f"uncompressed (link {self._link_text()})")
                choice = AutoChoice(best, ms, reason)
            else:
                reason = (f"no compression predicted {MARGIN:.0%} faster than {ms['none']:g} ms "
                          f"uncompressed (bf16 {ms['bf16']:g}, dynamiq {ms['dynamiq']:g} ms; "
                          f"link {self._link_text()})")
                choice = AutoChoice("none", ms, reason)
            if measured:
                choice = self._explore(choice, agreed_s, ms)
        if measured:
            self.tried.add(choice.scheme)
        self.pending = (choice.scheme, agreed_s[choice.scheme]) if measured else None
        self.history = [*self.history[-63:], choice]
        return choice

    def _explore(self, choice: AutoChoice, agreed_s: dict[str, float],
                 ms: dict[str, float]) -> AutoChoice:
        """Rule 5: the untried candidate closest to ``choice`` runs instead, if within
        :data:`EXPLORE_WITHIN` of its prediction (in candidate order on ties)."""
        if choice.scheme not in self.tried:  # the model's choice runs (and is measured) first
            return choice
        chosen = agreed_s[choice.scheme]
        close = [name for name in CANDIDATES if name not in self.tried
                 and name != choice.scheme and math.isfinite(agreed_s[name])
                 and agreed_s[name] <= EXPLORE_WITHIN * chosen]
        if not close:
            return choice
        name = min(close, key=lambda c: agreed_s[c])
        reason = (f"trying {name} once ({ms[name]:g} ms predicted, within "
                  f"{EXPLORE_WITHIN - 1:.0%} of {choice.scheme}'s {ms[choice.scheme]:g} ms) to "
                  f"measure it; the model chose {choice.scheme}")
        return AutoChoice(name, ms, reason)

    def calibrate(self, measured_s: float) -> None:
        """The previous call took ``measured_s`` (agreed: the slowest rank's): move its
        candidate's factor towards measured / predicted. Every rank runs it with the same
        numbers, so the factors stay identical."""
        if self.pending is None or not measured_s > 0:
            return
        scheme, predicted = self.pending
        self.pending = None
        if self.frozen:
            return
        if not predicted > 0:
            return
        ratio = min(max(measured_s / predicted, 1.0 / 16), 16.0)
        factor = self.calibration[scheme] * ratio**CALIBRATION_RATE
        self.calibration[scheme] = min(max(factor, 1e-3), 1e3)

    def step_extra(self) -> list[int]:
        """The step report's handshake slots (:data:`STEP_SLOTS`), consumed: a report rides
        along with one call only."""
        report, self.step_report = self.step_report, None
        if report is None:
            return [0]
        micros = min(max(1, int(report[1] * 1e6)), (1 << _STEP_US_BITS) - 1)
        return [((report[0] + 1) << _STEP_US_BITS) + micros]

    def agree_step(self, slots: list[int]) -> None:
        """The agreed step report (the slowest rank's time), if the call carried one."""
        if slots[0] > 0:
            iteration = (slots[0] >> _STEP_US_BITS) - 1
            self.agreed_step = (iteration, (slots[0] & ((1 << _STEP_US_BITS) - 1)) / 1e6)

    def _link_text(self) -> str:
        rate = self.link_bytes_per_s or 0.0
        return "unbounded" if math.isinf(rate) else f"{rate * 8 / 1e9:.3g} Gb/s measured"


class StepChooser:
    """Rule 6 of :mod:`dqcoll.auto`: which candidate every bucket of an iteration runs, from
    measured training steps. The DDP hook calls :meth:`end_of_iteration` between iterations
    (nothing in flight) with the same agreed numbers on every rank, so every rank plans the
    same; :meth:`choice` is the plan of an iteration (``None``: the per-call rule decides).

    A comparison starts where two or more candidates are predicted within ``close`` of the
    best (the predictions of an iteration's buckets, summed); its iterations run the close
    candidates in turn (``rounds`` each, interleaved: a drift of the machine costs each the
    same); each iteration's agreed time arrives one iteration later (in the next iteration's
    first argument check); the fastest mean then runs for ``hold`` iterations."""

    def __init__(self, *, close: float = STEP_CLOSE, rounds: int = STEP_ROUNDS,
                 hold: int = STEP_HOLD) -> None:
        if close < 1.0 or rounds < 1 or hold < 1:
            raise ValueError(f"StepChooser: close >= 1, rounds >= 1, hold >= 1; got {close}, "
                             f"{rounds}, {hold}")
        self.close, self.rounds, self.hold = close, rounds, hold
        self.plan: dict[int, str] = {}  # iteration -> candidate, for the running comparison
        self.samples: dict[str, list[float]] = {}  # candidate -> agreed step times (s)
        self.last_trial = -1  # the comparison's last iteration (-1: none running)
        self.winner: str | None = None  # what runs between comparisons (None: per-call rule)
        self.next_trial = 0  # the first iteration a new comparison may start after
        self.history: list[tuple[int, dict[str, float], str]] = []  # (iteration, means, winner)

    def choice(self, iteration: int) -> str | None:
        """The candidate every bucket of ``iteration`` runs, or None for the per-call rule."""
        return self.plan.get(iteration, self.winner)

    def reason(self, iteration: int) -> str:
        """Why :meth:`choice` is what it is (``last_info["auto"]["reason"]``)."""
        scheme = self.choice(iteration)
        if iteration in self.plan:
            return (f"comparing training steps of {', '.join(sorted(self.samples))} (predicted "
                    f"within {self.close - 1:.0%} of each other): this iteration runs {scheme}")
        means = self.history[-1][1] if self.history else {}
        text = ", ".join(f"{name} {seconds * 1e3:.1f}" for name, seconds in sorted(means.items()))
        return f"{scheme} had the fastest training step (mean ms: {text})"

    def end_of_iteration(self, iteration: int, measured: tuple[int, float] | None,
                         predicted_s: dict[str, float]) -> None:
        """Iteration ``iteration`` has ended. ``measured``: an earlier iteration's agreed time
        (iteration, seconds), as the iteration's first call agreed it; ``predicted_s``: the
        candidates' agreed predictions summed over the iteration's buckets (empty: unknown).
        Plans the next iterations."""
        if measured is not None:
            done, seconds = measured
            scheme = self.plan.pop(done, None)
            if scheme is not None and seconds > 0:
                self.samples[scheme].append(seconds)
        if self.last_trial >= 0 and iteration > self.last_trial:
            # every planned iteration has run; the last one's time arrives with the next
            # iteration's first call, so decide once none is outstanding
            if not any(k <= self.last_trial for k in self.plan):
                self._decide(iteration)
            elif iteration > self.last_trial + 2:  # a report lost (a rank failed a call)
                self.plan = {k: v for k, v in self.plan.items() if k > self.last_trial}
                self._decide(iteration)
            return
        if self.last_trial >= 0 or iteration + 1 < self.next_trial:
            return
        close = self._close(predicted_s)
        if len(close) < 2:
            return
        self.samples = {name: [] for name in close}
        order = [name for _ in range(self.rounds) for name in close]
        self.plan = {iteration + 1 + k: name for k, name in enumerate(order)}
        self.last_trial = iteration + len(order)

    def _close(self, predicted_s: dict[str, float]) -> list[str]:
        finite = {name: t for name, t in predicted_s.items() if math.isfinite(t) and t > 0}
        if not finite:
            return []
        best = min(finite.values())
        return [name for name in CANDIDATES if name in finite
                and finite[name] <= self.close * best]

    def _decide(self, iteration: int) -> None:
        means = {name: sum(times) / len(times) for name, times in self.samples.items() if times}
        if means:
            self.winner = min(means, key=lambda name: (means[name], CANDIDATES.index(name)))
            self.history = [*self.history[-15:], (iteration, means, self.winner)]
        self.last_trial = -1
        self.next_trial = iteration + self.hold
