"""A PyTorch DDP communication hook that averages gradient buckets with any dqcoll scheme:
``model.register_comm_hook(DynamiqState(...), dynamiq_hook)``. docs/ddp.md; a lost rank
(``fault_tolerant``, :func:`resync`): docs/reliability.md ("DDP").
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import math
import threading
from typing import Any

import torch
import torch.distributed as dist

from .. import envs, schemes
from ..api import allreduce
from ..comm import Communicator
from ..errors import DqcollError, InvalidArgumentError
from ..planner import build_planner
from ..prepare import DEFAULT_BITS
from ..schemes.dynamiq.error_model import ErrorModel
from ..schemes.dynamiq.options import resolve_format
from ..schemes.seeds import derived_seed
from ..transports.torch_dist import GATHERED_ALLREDUCE_NBYTES
from .lane import Lane
from .policy import CompressionPolicy, Role, RoleRule
from .step_choice import SixteenBitFormat, StepChoice, sixteen_bit_wire

__all__ = ["DDP_DEFAULT_POLICY", "DynamiqState", "HookRuntime", "ddp_policy", "dynamiq_hook",
           "resync"]

log = logging.getLogger("dqcoll.ddp")

_SEED_MASK = (1 << 62) - 1  # dqcoll seeds are compared across ranks as 62-bit integers
# The tile of a bucket's all-reduce with two or more lanes: the other lane already fills the
# transfer waits, so smaller tiles cost more CPU than they save.
LANE_TILE_NBYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class HookRuntime:
    """How :func:`dynamiq_hook` runs, beside what it sends (the policy); docs/ddp.md.

    ``device``: of DDP's buckets (default: ``cuda`` for an NCCL group, else ``cpu``). ``lanes``:
    buckets averaged at once (None: 2 for CPU buckets, 1 for CUDA ones). ``calibration_rate``:
    with an error target, the weight of each monitored measurement.
    """

    algorithm: str = "auto"
    async_op: bool = True
    device: torch.device | str | None = None
    lanes: int | None = None
    calibration_rate: float = 0.5
    scheme_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.calibration_rate <= 1.0:
            raise InvalidArgumentError(
                f"calibration_rate must be in (0, 1], got {self.calibration_rate}")
        lanes = self.lanes
        if lanes is not None and (type(lanes) is bool or not isinstance(lanes, int) or lanes < 1):
            raise InvalidArgumentError(f"lanes must be a positive int or None, got {lanes!r}")


# What DynamiqState sends without a policy or DQCOLL_POLICY.
DDP_DEFAULT_POLICY = CompressionPolicy(allreduce=RoleRule("auto", DEFAULT_BITS), warmup_steps=10)


def ddp_policy(policy: CompressionPolicy | str | None = None, *, scheme: str | None = None,
               bits: float | None = None, target_vnmse: float | None = None,
               **fields: Any) -> CompressionPolicy:
    """The policy a :class:`DynamiqState` runs: ``policy`` (or its text, read over
    :data:`DDP_DEFAULT_POLICY`; None: ``DQCOLL_POLICY`` where set), then the ``allreduce`` role
    and policy ``fields`` given (``None`` leaves a value as it is)."""
    if policy is None:
        policy = envs.policy()
    if isinstance(policy, str):
        policy = CompressionPolicy.parse(policy, DDP_DEFAULT_POLICY)
    rule = policy.allreduce
    if scheme is not None or bits is not None or target_vnmse is not None:
        name = rule.scheme if scheme is None else scheme
        kept = rule.bits if name == rule.scheme and target_vnmse is None else None
        bits = bits if bits is not None and target_vnmse is None else kept
        takes_bits = "bits" in schemes.spec("dynamiq" if name == "auto" else name).options
        rule = RoleRule(name, bits if takes_bits else None, target_vnmse)  # "none" takes none
    given = {key: value for key, value in fields.items() if value is not None}
    return dataclasses.replace(policy, allreduce=rule, **given)


class DynamiqState:
    """State of :func:`dynamiq_hook` for one DDP model, sending the policy of :func:`ddp_policy`.

    ``scheme``: ``"auto"`` (the planner's choice per bucket), a registered scheme, or ``"none"``
    (exactly DDP without a hook). Bad names or options raise here, not in backward. Fields and
    defaults: docs/ddp.md.
    """

    _instances = itertools.count(1)  # numbers the states of this process: their lanes' prefix

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        policy: CompressionPolicy | str | None = None,
        *,
        scheme: str | None = None,
        bits: float | None = None,
        warmup_steps: int | None = None,
        error_feedback: bool | None = None,
        monitor_every: int | None = None,
        target_vnmse: float | None = None,
        fault_tolerant: bool = False,
        runtime: HookRuntime | None = None,
    ) -> None:
        self.policy = ddp_policy(policy, scheme=scheme, bits=bits, target_vnmse=target_vnmse,
                                 warmup_steps=warmup_steps, error_feedback=error_feedback,
                                 monitor_every=monitor_every)
        self.runtime = runtime if runtime is not None else HookRuntime()
        _check_policy(self.policy, self.runtime)
        rule, run = self.policy.allreduce, self.runtime
        self.process_group = process_group
        self.lane_list: list[Lane] = []  # made by prepare(), before the first backward
        self.device = None if run.device is None else torch.device(run.device)
        self._instance = next(DynamiqState._instances)
        self._in_flight: collections.deque[_Bucket] = collections.deque()
        self._order = threading.Condition()  # guards _in_flight; notified as buckets leave

        self.scheme = rule.scheme
        self.bits = DEFAULT_BITS if rule.bits is None else float(rule.bits)
        self.algorithm = run.algorithm
        self.scheme_options = dict(run.scheme_options or {})

        self.warmup_steps = self.policy.warmup_steps
        self.iteration = 0  # backward passes seen (advanced at each iteration's last bucket)
        self.seed = self.policy.seed
        self.step_choice = StepChoice(  # auto: 16 bits or compressed, by measured step time
            self.warmup_steps, self.scheme == "auto", self._agree)
        self.sixteen_bit = SixteenBitFormat(  # fp16 or bf16, by measured rounding error
            self.warmup_steps > 1 or self.step_choice.enabled,
            self.step_choice.recheck_every if self.step_choice.enabled else None)
        self.allocation_u: dict[int, float] = {}  # bucket index -> u of its last call

        self.error_feedback = self.policy.error_feedback
        self.residuals: dict[int, torch.Tensor] = {}  # bucket index -> fp32 residual

        self.monitor_every = self.policy.monitor_every
        self.vnmse_history: list[tuple[int, float]] = []  # (iteration, vNMSE over its buckets)
        self._monitor_sums = [0.0, 0.0, 0.0]  # squared error, squared exact norm, predicted

        self.target_vnmse = rule.target
        self.kappa = 1.0  # ErrorModel.kappa: measured / predicted vNMSE, smoothed in log space
        self.kappa_history: list[tuple[int, float]] = []  # (iteration, kappa after it)
        self.bits_history: list[tuple[int, float]] = []  # (iteration, bits per coordinate sent)
        self._bits_sums = [0.0, 0]  # sum of bits * numel over the iteration's buckets, numel

        self.fault_tolerant = fault_tolerant
        self.failure: BaseException | None = None  # first failed bucket of this iteration
        self.backward_error: BaseException | None = None  # raised at the end of backward
        self.shrunk = False  # True once averaging runs over a communicator of survivors

        self.bucket_numel: dict[int, int] = {}  # bucket index -> elements, as of the last step
        self._handed_over: float | None = None  # clock at the 16-bit step's last bucket
        self._averaged = -math.inf  # clock when that step's last 16-bit average completed
        self._compress_cost = 0.0  # s compressing would at least add to the 16-bit step begun last
        self.last_info: dict[str, Any] = {}  # the last bucket's comm.last_info (or 16-bit call's)

        if dist.is_available() and dist.is_initialized() and self.scheme != "none":
            self.prepare()

    def should_compress(self, iteration: int | None = None) -> bool:
        """Whether iteration ``iteration`` (default: the current one) is compressed: after the
        warm-up, unless ``scheme="auto"``'s step-time check chose 16 bits for it."""
        iteration = self.iteration if iteration is None else iteration
        if self.scheme == "none" or iteration < self.warmup_steps:
            return False
        choice = self.step_choice
        return self.shrunk or iteration != choice.iteration or choice.compressing()

    @property
    def sixteen_bit_steps(self) -> int:
        """Iterations averaged in 16 bits so far, warm-up included."""
        return self.step_choice.sixteen_bit_steps

    def _agree(self, values: list[float], op: Any = dist.ReduceOp.MAX) -> list[float]:
        device = self.device if self.device is not None else torch.device("cpu")
        agreed = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(agreed, op=op, group=self.process_group)
        return [float(v) for v in agreed.tolist()]

    def _begin_iteration(self, iteration: int) -> None:
        """At an iteration's first bucket: the 16-bit format and this step's mode."""
        choice = self.step_choice
        if self.shrunk or choice.iteration == iteration:
            return
        self.sixteen_bit.decide(iteration, lambda sums: self._agree(sums, dist.ReduceOp.SUM))
        decided = len(choice.choices)
        handed_over, self._handed_over = self._handed_over, None
        exposed = None if handed_over is None else self._averaged - handed_over
        choice.begin(iteration, timed=not self._monitor_due(iteration), exposed=exposed,
                     cost=self._compress_cost)
        self._compress_cost = 0.0  # this iteration's buckets add theirs
        if len(choice.choices) > decided and self.group_rank() == 0:
            made = choice.choices[-1]
            if math.isnan(made.compressed_ms):
                log.info("dqcoll ddp: iteration %d: step %.0f ms in 16 bits, %.0f ms of it "
                         "exposed communication, of which compressing could save %.0f ms, "
                         "within the spread %.0f ms (slowest rank's medians): 16 bits from now "
                         "on, compressing not tried", iteration, made.sixteen_bit_ms,
                         made.exposed_ms, made.gain_ms, made.spread_ms)
            else:
                log.info("dqcoll ddp: iteration %d: step %.0f ms in 16 bits, %.0f ms compressed "
                         "(slowest rank's medians; spread %.0f ms): %s, the other mode again at "
                         "iteration %d", iteration, made.sixteen_bit_ms, made.compressed_ms,
                         made.spread_ms, made.mode, made.next_check)

    def compressed_cost_s(self, index: int, buf: torch.Tensor, *, last: bool) -> float:
        """What compressing bucket ``index`` would at least add to the step beyond its 16-bit
        average, as its lane's planner's cost model prices it from the job's measured link and
        codec rates (0 where no planner prices it). The last bucket (handed over when backward
        ends): its whole compressed all-reduce, which runs after backward. Another bucket: its
        codec's CPU, where the ranks' compute already keeps this host's cores busy (it then
        takes cores from backward); else nothing (it runs beside backward on free cores)."""
        if not self.lane_list:
            return 0.0
        lane = self.lane(index)
        planner = lane.comm.planner
        if planner is None or (not last and not _cores_busy(planner)):
            return 0.0
        dtype = str(buf.dtype).removeprefix("torch.")
        nbytes = buf.numel() * buf.element_size()
        force = lane.comm.auto_force
        if last:
            us = planner.least_us("allreduce", nbytes, dtype, scheme=self.scheme,
                                  bits=self.bits, force=force)
        else:
            us = planner.least_codec_us(nbytes, dtype, scheme=self.scheme, bits=self.bits,
                                        force=force)
        return us / 1e6

    def bucket_algorithm(self, buf: torch.Tensor) -> str:
        """The algorithm of a bucket's all-reduce (``"auto"``: the planner's)."""
        return self.algorithm

    def should_monitor(self, iteration: int) -> bool:
        return self.should_compress(iteration) and self._monitor_due(iteration)

    def _monitor_due(self, iteration: int) -> bool:
        return self.monitor_every > 0 and (iteration - self.warmup_steps) % self.monitor_every == 0

    def step_seed(self, iteration: int) -> int:
        """The seed of the random rounding for one iteration."""
        return derived_seed(self.seed, "ddp", iteration) & _SEED_MASK

    @property
    def comm(self) -> Communicator | None:
        """Lane 0's communicator (after a shrink: the survivors'), None until prepared."""
        return self.lane_list[0].comm if self.lane_list else None

    @property
    def lane_comms(self) -> list[Communicator]:
        """The communicators of lanes 1, 2, ..."""
        return [lane.comm for lane in self.lane_list[1:]]

    def prepare(self, device: torch.device | str | None = None) -> Communicator:
        """Create the lanes on ``device`` (default: the state's), compiling or loading the kernels
        now rather than in the first backward. Collective: every rank of the group calls it."""
        if device is not None:
            self.device = torch.device(device)
        if self.device is None:
            backend = str(dist.get_backend(self.process_group)).lower()
            self.device = (torch.device("cuda", torch.cuda.current_device())
                           if "nccl" in backend else torch.device("cpu"))
        comm = self.communicator(self.device)
        planned = self.scheme == "auto" or (self.algorithm == "auto" and comm.world_size > 2)
        if planned and comm.planner is None and comm.world_size > 1:
            # discover the job and measure its links now (collective), not in the first backward
            comm.planner = build_planner(comm.transport, comm.device,
                                         what="DynamiqState.prepare planner")
        self._make_lanes()
        return comm

    def lane_count(self) -> int:
        """The lanes buckets are spread over (1 until the device is known, and after a shrink)."""
        if self.shrunk or not self.runtime.async_op:
            return 1
        if self.runtime.lanes is not None:
            return self.runtime.lanes
        return 2 if self.device is not None and self.device.type == "cpu" else 1

    def _new_lane(self, index: int, device: torch.device) -> Lane:
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        assert group is not None  # torch.distributed is initialised (a lane is being made)
        name = getattr(group, "group_name", "world")
        lane = Lane(dist.distributed_c10d._get_process_group_store(group),
                    dist.get_rank(group), dist.get_world_size(group), policy=self.policy,
                    timeout_s=envs.timeout_s(), name=f"ddp {self._instance}.{index}",
                    prefix=f"dqcoll-ddp/{self._instance}/{name}/lane{index}/", device=device,
                    gather_nbytes=GATHERED_ALLREDUCE_NBYTES, group=group)
        if self.step_choice.enabled and lane.comm.auto_force is None:
            # the step check chooses between 16 bits and compressing; the compressed mode's
            # planner chooses how to compress (a per-call price cannot see the overlap with
            # backward that decides whether a 16-bit bucket pays: docs/ddp.md)
            lane.comm.auto_force = "dynamiq"
        return lane

    def _make_lanes(self) -> None:
        wanted, first = self.lane_count(), self.lane_list[0]
        if len(self.lane_list) >= wanted:
            return
        if first.device.type != "cpu":
            raise InvalidArgumentError(
                f"DynamiqState(lanes={wanted}): more than one lane needs CPU buckets (each lane "
                f"is a gloo connection); buckets on {first.device} take lanes=1")
        for index in range(len(self.lane_list), wanted):
            lane = self._new_lane(index, first.device)
            if first.comm.planner is not None:  # the same job and rates, its own calibration
                lane.comm.planner = first.comm.planner.fork()
            self.lane_list.append(lane)

    def lane(self, index: int) -> Lane:
        """The lane that averages bucket ``index``: lane ``index % lanes``."""
        return self.lane_list[index % min(self.lane_count(), len(self.lane_list))]

    def drain(self) -> None:
        """Wait until no bucket of this state is in flight on any lane."""
        for lane in self.lane_list:
            lane.flush()
        with self._order:
            # the last releases run in the lanes' done callbacks, just after the collectives
            self._order.wait_for(lambda: not self._in_flight)

    def communicator(self, device: torch.device) -> Communicator:
        """Lane 0's communicator, made on ``device`` at the first call."""
        if not self.lane_list:
            if self.device is None:
                self.device = torch.device(device)
            self.lane_list.append(self._new_lane(0, torch.device(device)))
        lane = self.lane_list[0]
        if lane.device.type != torch.device(device).type:
            raise InvalidArgumentError(
                f"DynamiqState: a bucket on {device} but the lanes were prepared for "
                f"{lane.device}; pass HookRuntime(device=) to DynamiqState or prepare()")
        return lane.comm

    def group_size(self) -> int:
        if self.shrunk and self.comm is not None:
            return self.comm.world_size
        return dist.get_world_size(self.process_group)

    def group_rank(self) -> int:
        if self.shrunk and self.comm is not None:
            return self.comm.rank
        return dist.get_rank(self.process_group)

    def record_failure(self, iteration: int, exc: BaseException) -> None:
        """Keep the first failure of an iteration for the training loop (fault_tolerant) and close
        every lane's connections, so peers fail now instead of after their timeout."""
        if self.failure is None:
            self.failure = exc
            log.warning("dqcoll ddp: iteration %d: averaging failed (%s: %s); the bucket is "
                        "returned unreduced: skip this step, then state.shrink()", iteration,
                        type(exc).__name__, exc)
            for lane in self.lane_list:
                lane.abort(f"averaging failed at iteration {iteration}")

    def shrink(self, **kwargs: Any) -> Communicator:
        """After a lost rank: average over a communicator of the survivors from now on
        (``kwargs`` go to :meth:`dqcoll.Communicator.shrink`); clears ``failure``."""
        comm = self.prepare()
        if self.failure is not None:  # evidence of a lost rank, whichever lane saw it
            comm.mark_dead(f"averaging failed: {type(self.failure).__name__}: {self.failure}")
        for extra in self.lane_list[1:]:  # the survivors average over one lane
            extra.abort("the group shrank after a lost rank")
            extra.comm.mark_dead("shrunk after a lost rank: DynamiqState averages over one lane")
        first = self.lane_list[0]
        survivors = comm.shrink(**kwargs)
        for lane in self.lane_list:
            lane.close()
        self.lane_list = [Lane(None, survivors.rank, survivors.world_size, policy=self.policy,
                               timeout_s=envs.timeout_s(), name=f"{first.name} survivors",
                               device=survivors.device, comm=survivors)]
        self.shrunk = True
        self.failure = None
        self.residuals.clear()  # the failed step's residuals were never sent
        return survivors

    def __repr__(self) -> str:
        return (f"DynamiqState(scheme={self.scheme!r}, bits={self.bits:g}, "
                f"algorithm={self.algorithm!r}, warmup_steps={self.warmup_steps}, "
                f"iteration={self.iteration}, error_feedback={self.error_feedback}, "
                f"monitor_every={self.monitor_every}, lanes={self.lane_count()})")


def _check_policy(policy: CompressionPolicy, runtime: HookRuntime) -> None:
    """Raise now, not at the first backward, for what the hook cannot run."""
    rule = policy.allreduce
    options = {**(runtime.scheme_options or {}), **rule.options()}
    options.pop("scheme")
    if "bits" in rule.spec.options and rule.target is None:
        options.setdefault("bits", DEFAULT_BITS)
    schemes.get(rule.spec.name, **options)
    if rule.scheme == "auto" and policy.error_feedback:
        raise InvalidArgumentError(
            "DynamiqState: error_feedback needs a fixed scheme (its residual is the chosen "
            "codec's error, and scheme='auto' chooses per call, after the hook returns); "
            "pass scheme='dynamiq' for error feedback")


def _future_for(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    return (torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda
            else torch.futures.Future())


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future = _future_for(tensor)
    future.set_result(tensor)
    return future


def _cores_busy(planner: Any) -> bool:
    """Whether the compute threads (torch's, per rank) of the ranks on this machine fill its
    cores (the planner's job: which ranks share a machine; its rates: the cores)."""
    [(_, ranks)] = collections.Counter(planner.job.machines).most_common(1)  # the most on one
    return ranks * torch.get_num_threads() >= max(1, planner.rates.cores_per_machine)


def _group_average(state: DynamiqState, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """An uncompressed bucket's average on DDP's group: torch's fp16 or bf16 hook (bit for bit
    where fp16's range holds), else DDP's own (times 1/n: dividing by n differs in the last bit)."""
    if state.shrunk:  # DDP's group still counts the lost rank: average over the survivors
        assert state.comm is not None
        allreduce(buf, op="avg", scheme="none", comm=state.comm)
        return _completed(buf)
    if _warmup_path(state, buf) == "exact":
        buf.mul_(1.0 / state.group_size())
        wire = buf
    else:
        form = state.sixteen_bit
        wire = sixteen_bit_wire(buf, state.group_size(), form.dtype)
        backend = str(dist.get_backend(state.process_group))
        state.last_info = {"scheme": form.name, "algorithm": f"{backend} all_reduce",
                           "bits": 16.0, "warmup": state.iteration < state.warmup_steps}
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)
    assert work is not None
    iteration = state.iteration

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        try:
            summed = fut.value()[0]
            if summed is not buf:
                buf.copy_(summed)
        except Exception as exc:
            if not state.fault_tolerant:
                raise
            state.record_failure(iteration, exc)
        state._averaged = state.step_choice.clock()  # the last to complete: the step's end
        return buf

    return work.get_future().then(done)


def _warmup_path(state: DynamiqState, buf: torch.Tensor) -> str:
    """``"16-bit"`` for an fp32 bucket of a 16-bit step, else ``"exact"``."""
    if state.scheme == "none" or buf.dtype != torch.float32 or state.shrunk:
        return "exact"
    return "16-bit"


def _residual(state: DynamiqState, index: int, buf: torch.Tensor) -> torch.Tensor:
    residual = state.residuals.get(index)
    if residual is None or residual.numel() != buf.numel() or residual.device != buf.device:
        # first use, or DDP rebuilt its buckets after the first iteration
        residual = torch.zeros(buf.numel(), dtype=torch.float32, device=buf.device)
        state.residuals[index] = residual
    return residual


def _local_quantization(state: DynamiqState, values: torch.Tensor) -> torch.Tensor:
    """decode(encode(values)) with the scheme's single-shot codec."""
    spec = schemes.spec(state.scheme)
    options = {**state.scheme_options, **({"bits": state.bits} if "bits" in spec.options else {})}
    codec = schemes.get(state.scheme, **options)
    return codec.decode(codec.encode(values)).reshape(-1).float()


def _call_options(state: DynamiqState) -> dict[str, Any]:
    if state.target_vnmse is None:
        return {**state.scheme_options, "bits": state.bits}
    # the monitor's calibration rides on the format (its error model, kappa replaced)
    fmt = resolve_format(state.scheme_options.get("format", "dqcoll"))
    model = dataclasses.replace(fmt.error_model or ErrorModel(), kappa=state.kappa)
    return {**state.scheme_options, "target_vnmse": state.target_vnmse,
            "format": dataclasses.replace(fmt, error_model=model)}


def _record(state: DynamiqState, info: dict[str, Any], index: int, numel: int) -> None:
    state.last_info = dict(info)
    if info.get("u") is not None:
        state.allocation_u[index] = float(info["u"])
    if info.get("bits") is not None:
        state._bits_sums[0] += float(info["bits"]) * numel
        state._bits_sums[1] += numel


@dataclasses.dataclass(eq=False)
class _Bucket:
    """One bucket in flight on a lane, until it is released in issue order."""

    future: torch.futures.Future[torch.Tensor]
    buf: torch.Tensor
    index: int
    iteration: int
    last: bool
    finished: bool = False
    error: BaseException | None = None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    event: Any = None  # CUDA: the event after which the result is ready


def _release(state: DynamiqState, bucket: _Bucket) -> None:
    error = bucket.error
    if error is None:
        try:
            _record(state, bucket.info, bucket.index, bucket.buf.numel())
            if bucket.last:
                _end_of_iteration(state, bucket.iteration)
        except BaseException as exc:  # bookkeeping must not lose the bucket's future
            error = exc
    if error is None:
        if bucket.event is not None:  # CUDA: the result is ready once this stream passes it
            torch.cuda.current_stream(bucket.buf.device).wait_event(bucket.event)
        bucket.future.set_result(bucket.buf)
    elif state.fault_tolerant and isinstance(error, DqcollError):
        state.record_failure(bucket.iteration, error)  # the bucket goes back unreduced
        if bucket.last:
            _end_of_iteration(state, bucket.iteration)
        bucket.future.set_result(bucket.buf)
    else:
        if isinstance(error, DqcollError) and state.backward_error is None:
            state.backward_error = error  # raised with its type by _raise_after_backward
        bucket.future.set_exception(error)  # type: ignore[arg-type]  # any exception


def _compressed_average(state: DynamiqState, buf: torch.Tensor, index: int, iteration: int,
                        last: bool) -> torch.futures.Future[torch.Tensor]:
    comm = state.communicator(buf.device)
    if state.error_feedback:
        residual = _residual(state, index, buf)
        buf.copy_(buf.float() + residual)  # what this rank contributes, in the bucket's dtype
        message = buf.float()
        residual.copy_(message - _local_quantization(state, message))
        # a coordinate whose message or quantization is not finite (dynamiq: every coordinate
        # of the super-group of a non-finite value) carries nothing into the next step
        torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
    options = _call_options(state)
    seed = state.step_seed(iteration)

    def run(on: Communicator, tile: int | None = None) -> None:  # None: the API's default tile
        allreduce(buf.view(-1), op="avg", scheme=state.scheme,
                  algorithm=state.bucket_algorithm(buf), comm=on, seed=seed, step=index,
                  tile_nbytes=tile, **options)

    if state.runtime.async_op and not state.should_monitor(iteration):
        state._make_lanes()  # no-op once made (prepare() makes them before any backward)
        lane = state.lane(index)
        bucket = _Bucket(_future_for(buf), buf, index, iteration, last)
        with state._order:
            state._in_flight.append(bucket)
        tile = LANE_TILE_NBYTES if state.lane_count() > 1 else None

        def done(finished: concurrent.futures.Future[Any]) -> None:
            bucket.error = finished.exception()
            if bucket.error is None:
                bucket.info = dict(lane.comm.last_info)
                if str(bucket.info.get("planned", {}).get("reason", "")).startswith("explored"):
                    state.step_choice.exclude(iteration)  # a trial plan: not a sample
                bucket.event = finished.result()
            bucket.finished = True
            with state._order:  # release the finished buckets at the head of the issue order
                while state._in_flight and state._in_flight[0].finished:
                    _release(state, state._in_flight.popleft())
                state._order.notify_all()

        work = lane.submit(Role.ALLREDUCE, buf.numel() * buf.element_size(), buf.numel(),
                           functools.partial(run, lane.comm, tile), buf, (buf,))
        work.add_done_callback(done)
        return bucket.future
    state.drain()  # nothing of this state may be in flight beside the exact all-reduce
    exact = None
    if state.should_monitor(iteration):
        exact = buf.double()
        if state.shrunk:
            comm.transport.allreduce(exact, "sum", what=f"ddp monitor #{iteration}")
        else:
            dist.all_reduce(exact, group=state.process_group)
        exact /= state.group_size()
    run(comm)
    _record(state, comm.last_info, index, buf.numel())
    if exact is not None:
        norm2 = float(exact.square().sum())
        error2 = float((buf.double() - exact).square().sum())
        state._monitor_sums[0] += error2
        state._monitor_sums[1] += norm2
        comm.last_info["measured_vnmse"] = (error2 / norm2 if norm2 > 0
                                            else (0.0 if error2 == 0 else math.inf))
        predicted = comm.last_info.get("predicted_vnmse")
        if predicted is not None and math.isfinite(predicted):
            state._monitor_sums[2] += float(predicted) * norm2
    if last:
        _end_of_iteration(state, iteration)
    return _completed(buf)


def _end_of_iteration(state: DynamiqState, iteration: int) -> None:
    leader = state.group_rank() == 0
    if state._bits_sums[1]:
        bits = state._bits_sums[0] / state._bits_sums[1]
        state.bits_history.append((iteration, bits))
        if leader and state.target_vnmse is not None:
            log.info("dqcoll ddp: iteration %d: %.3f bits per coordinate for target vNMSE %.1e",
                     iteration, bits, state.target_vnmse)
    if state.should_monitor(iteration):
        error2, norm2, predicted2 = state._monitor_sums
        vnmse = error2 / norm2 if norm2 > 0 else (0.0 if error2 == 0 else math.inf)
        state.vnmse_history.append((iteration, vnmse))
        if state.target_vnmse is not None and predicted2 > 0 and 0 < vnmse < math.inf:
            _calibrate(state, iteration, vnmse, predicted2 / norm2)
        if leader:
            log.info("dqcoll ddp: iteration %d: %s vNMSE %.3e (exact average computed alongside)",
                     iteration, state.scheme, vnmse)
    state._monitor_sums = [0.0, 0.0, 0.0]
    state._bits_sums = [0.0, 0]
    state.iteration = iteration + 1


def _calibrate(state: DynamiqState, iteration: int, measured: float, predicted: float) -> None:
    """Move kappa a geometric step of ``calibration_rate`` towards measured / predicted."""
    ratio = min(max(measured / predicted, 1.0 / 16), 16.0)  # one noisy step moves kappa <= 16x
    kappa = state.kappa * ratio**state.runtime.calibration_rate
    state.kappa = min(max(kappa, 1e-3), 1e3)
    state.kappa_history.append((iteration, state.kappa))
    if state.group_rank() == 0:
        log.info("dqcoll ddp: iteration %d: measured/predicted vNMSE %.2f -> kappa %.3g",
                 iteration, measured / predicted, state.kappa)


def _raise_after_backward(state: DynamiqState) -> None:
    """Make a failed bucket's DqcollError reach ``backward()`` with its type (DDP's reducer would
    turn it into a ``RuntimeError``): an autograd-engine callback raises it first."""

    def check() -> None:
        state.drain()
        error, state.backward_error = state.backward_error, None
        if error is not None:
            raise error

    with contextlib.suppress(RuntimeError):  # RuntimeError: the hook called outside backward
        torch.autograd.Variable._execution_engine.queue_callback(check)


def dynamiq_hook(state: DynamiqState,
                 bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket averaged over ``state.process_group`` (docs/ddp.md)."""
    buf = bucket.buffer()
    index = bucket.index()
    iteration = state.iteration
    state.bucket_numel[index] = buf.numel()
    last = bucket.is_last()
    if not state.fault_tolerant and last:
        _raise_after_backward(state)
    try:
        state._begin_iteration(iteration)
    except RuntimeError as exc:  # the step times' all-reduce on DDP's group
        if not state.fault_tolerant:
            raise
        state.record_failure(iteration, exc)
    if buf.dtype == torch.float32 and state.sixteen_bit.measuring(iteration):
        state.sixteen_bit.observe(iteration, buf, state.group_size())
    compress = state.should_compress(iteration)
    if not compress and not buf.is_cuda and state.step_choice.enabled:
        # what compressing would add: summed over the step's buckets, the last one's at the
        # end of backward, whose 16-bit average's wait after it is exposed. Not on CUDA: there a
        # collective's future completes when it is enqueued, so its callback times nothing.
        state._compress_cost += state.compressed_cost_s(index, buf, last=last)
        if last:
            state._handed_over = state.step_choice.clock()
    try:  # the compressed path ends its iteration itself, once the last bucket is averaged
        if compress:
            return _compressed_average(state, buf, index, iteration, last)
        return _group_average(state, buf)  # a warm-up or 16-bit step's bucket, or scheme="none"
    except (DqcollError, RuntimeError) as exc:  # RuntimeError: torch.distributed's own
        if not state.fault_tolerant:
            raise
        state.record_failure(iteration, exc)
        if compress and last:
            _end_of_iteration(state, iteration)
        return _completed(buf)
    finally:
        if last and not compress:
            _end_of_iteration(state, iteration)


def resync(state: DynamiqState, module: torch.nn.Module,
           optimizer: torch.optim.Optimizer | None = None, step: int = 0) -> int:
    """After :meth:`DynamiqState.shrink`: every survivor takes the lowest surviving rank's
    parameters, buffers, optimizer state, ``state.iteration`` and ``step`` (returned), bit for
    bit. Each dtype travels as one all-reduce in which the other ranks add zeros."""
    comm = state.comm
    if comm is None or not state.shrunk:
        raise InvalidArgumentError("resync() follows state.shrink() (no communicator of "
                                   "survivors yet)")
    tensors: list[torch.Tensor] = [*module.parameters(), *module.buffers()]
    if optimizer is not None:
        params = (p for group in optimizer.param_groups for p in group["params"])
        entries = (sorted(optimizer.state.get(p, {}).items()) for p in params)
        tensors.extend(v for entry in entries for _, v in entry if isinstance(v, torch.Tensor))
    counters = torch.tensor([state.iteration, step], dtype=torch.int64)
    tensors.append(counters)
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same_dtype = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.detach().reshape(-1).cpu() for t in same_dtype])
        if comm.rank != 0:
            flat.zero_()
        comm.transport.allreduce(flat, "sum", what=f"ddp resync ({dtype})")
        parts = flat.split([t.numel() for t in same_dtype])
        with torch.no_grad():
            for t, part in zip(same_dtype, parts, strict=True):
                t.copy_(part.view(t.shape))
    state.iteration = int(counters[0])
    state.failure = None
    return int(counters[1])


# DDP checks the hook's annotations against the real types; this module's are strings.
dynamiq_hook.__annotations__.update(state=DynamiqState, bucket=dist.GradBucket)
dynamiq_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
