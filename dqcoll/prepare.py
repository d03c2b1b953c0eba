"""A collective's call made ready to check and run (docs/design.md §2, step 2), and the range
scaling (:func:`range_shift`). Nothing here raises for a bad argument: a local failure is recorded
and raised by :mod:`dqcoll.validate` on every rank together.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from . import kernels, schemes
from .comm import Communicator
from .errors import DqcollError, InvalidArgumentError
from .executor import DEFAULT_TILES_IN_FLIGHT, default_tile_nbytes
from .interop import as_torch_view, buffer_device
from .schemes.base import Scheme
from .topology import algorithms
from .topology.hierarchical import HierarchicalPlan
from .topology.schedule import Schedule
from .types import Collective, ReduceOp

__all__ = [
    "DEFAULT_BITS",
    "INT_LIMIT",
    "NO_EXPONENT",
    "PreparedCall",
    "Request",
    "inspect_buffer",
    "max_exponent",
    "prepare_call",
    "range_shift",
    "scaled",
    "shift_for",
    "unscale_into",
]

# ``bits=None``: 5 bits for the schemes that take ``bits``; with ``target_vnmse``, the target alone.
DEFAULT_BITS = 5.0
# Integer options travel as int64 in the argument check, negated too: each lies in [0, 2**62).
INT_LIMIT = 1 << 62
# Inputs whose largest finite |x| lies outside [2**-RANGE_EXP, 2**RANGE_EXP) are scaled by an
# agreed power of two (exact), keeping every scheme's sums, norms and scales in range.
RANGE_EXP = 48
NO_EXPONENT = -(1 << 20)  # an all-zero (or all non-finite) buffer: nothing to scale


@dataclasses.dataclass(frozen=True)
class Request:
    """One collective as its caller asked for it: the public function's arguments, unchecked."""

    collective: Collective
    buf: Any  # the input (allreduce: also the output)
    out: Any  # reduce_scatter / all_gather: the output; allreduce: None
    op: str | ReduceOp = "sum"
    scheme: str | Scheme = "dynamiq"
    bits: float | None = None  # None: DEFAULT_BITS, unless target_vnmse is given
    algorithm: str | HierarchicalPlan = "auto"  # a plan: its two levels as they are given
    comm: Communicator | None = None  # None: the default communicator
    seed: int | None = None  # None: the communicator's seed
    step: int | None = None  # None: the communicator's call counter
    async_op: bool = False
    tile_nbytes: int | None = None  # None: default_tile_nbytes of the buffer's device
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT
    scheme_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # internal (a two-level plan's levels): ``buf`` and ``out`` are the library's own scratch,
    # so the call may reduce in the input and write the output before it completes
    scratch_buffers: bool = False

    @property
    def result(self) -> Any:
        """What the collective returns: ``buf`` for allreduce, ``out`` otherwise."""
        return self.buf if self.collective is Collective.ALLREDUCE else self.out

    @property
    def is_auto(self) -> bool:
        return isinstance(self.scheme, str) and self.scheme == "auto"

    @property
    def is_planned(self) -> bool:
        """Whether :mod:`dqcoll.planner` decides how the call runs (an ``"auto"`` argument)."""
        return self.plan is None and (self.is_auto or self.algorithm == "auto")

    @property
    def plan(self) -> HierarchicalPlan | None:
        """The caller's two-level plan, or None."""
        return self.algorithm if isinstance(self.algorithm, HierarchicalPlan) else None


@dataclasses.dataclass
class PreparedCall:
    """One collective after the local checks. With ``error`` set, the argument check raises it
    here and a :class:`~dqcoll.errors.PeerError` on the other ranks."""

    # the call's identity (every rank must agree on all of it)
    collective: Collective
    async_op: bool
    call: int  # the communicator's call counter (hashed with ``step`` in the argument check)
    what: str  # the call's name in errors and logs, e.g. "allreduce#3"
    seed: Any  # as given (or the communicator's); checked to be an integer
    step: Any  # as given (or the call counter); checked to be an integer
    tile_nbytes: Any
    tiles_in_flight: Any
    auto: bool  # scheme="auto": checked as dynamiq, fingerprinted as "auto"
    options: dict[str, Any]  # the scheme's: ``bits`` (resolved) unless ``target_vnmse`` is given
    bits: Any
    target: Any  # target_vnmse, or None
    # what the checks resolved (None until they pass)
    tensor: torch.Tensor | None = None
    out: torch.Tensor | None = None
    scheme: Scheme | None = None
    schedule: Schedule | None = None
    op: ReduceOp | None = None
    exponent: int = NO_EXPONENT  # binary exponent of the largest finite |value| (frexp)
    survey: Any = None  # what the scheme took of the input in the range check's pass, or None
    error: DqcollError | None = None  # this rank's local failure
    category: str = ""  # "buffer", "dtype", "layout", "scheme", "algorithm", "op" or "other"
    scratch_buffers: bool = False  # Request.scratch_buffers

    def fail(self, category: str, error: DqcollError) -> None:
        self.error, self.category = error, category


def prepare_call(request: Request, comm: Communicator) -> PreparedCall:
    """``request`` checked on this rank and resolved; the first failure is recorded, not raised
    (identity, numbers, ``op``, scheme, schedule, input, the collective's rules, output)."""
    call = _identify(request, comm)
    try:
        _resolve(call, request, comm)
    except Exception as exc:  # whatever goes wrong there is this rank's error, told to all
        call.fail("other", exc if isinstance(exc, DqcollError) else InvalidArgumentError(
            f"rank {comm.rank}: {call.what}: invalid arguments: {type(exc).__name__}: {exc}"))
    if call.error is None and call.collective is not Collective.ALLREDUCE:
        _check_sharded(call, request.out, comm)
    return call


def _identify(request: Request, comm: Communicator) -> PreparedCall:
    """The call's identity and options; the call counter advances here, valid call or not."""
    tile_nbytes = request.tile_nbytes
    if tile_nbytes is None:  # the buffer's device decides (the communicator's if unknown)
        tile_nbytes = default_tile_nbytes(buffer_device(request.buf) or comm.device)
    call_step = comm.next_step()
    bits = DEFAULT_BITS if request.bits is None else request.bits
    options = dict(request.scheme_options)
    target = options.get("target_vnmse")
    if target is None:
        options.pop("target_vnmse", None)
        options["bits"] = bits
    label = " (auto)" if request.is_auto else ""
    return PreparedCall(
        collective=request.collective, async_op=request.async_op, call=call_step,
        what=f"{request.collective.value}#{call_step}{label}",
        seed=comm.seed if request.seed is None else request.seed,
        step=call_step if request.step is None else request.step,
        tile_nbytes=tile_nbytes, tiles_in_flight=request.tiles_in_flight, auto=request.is_auto,
        options=options, bits=bits, target=target, scratch_buffers=request.scratch_buffers)


def _resolve(call: PreparedCall, request: Request, comm: Communicator) -> None:
    """The local checks of the arguments and the input buffer; the first failure is recorded."""
    _check_numbers(call, request, comm)
    category = "op"  # what failed, for the argument check's error codes
    try:
        call.op = ReduceOp.parse(request.op)
        if call.collective is Collective.ALL_GATHER:
            call.op = ReduceOp.SUM  # an all-gather reduces nothing: no op (nor avg's 1/n) applies
        category = "scheme"  # scheme="auto" is checked as dynamiq with the caller's options
        call.scheme = _resolve_scheme("dynamiq" if call.auto else request.scheme, call.options)
        category = "algorithm"  # "auto": the planner builds the schedule after the argument check
        plan = request.plan
        if plan is not None and plan.world_size != comm.world_size:
            raise InvalidArgumentError(
                f"rank {comm.rank}: {call.what}: the plan is for {plan.world_size} ranks "
                f"({plan.nodes} hosts x {plan.gpus_per_node}), the communicator has "
                f"{comm.world_size}")
        if plan is None and request.algorithm != "auto":
            call.schedule = algorithms.build_schedule(str(request.algorithm), comm.world_size)
    except DqcollError as exc:
        call.fail(category, exc)
        return
    _inspect_input(call, request.buf, comm)
    if (call.error is not None or not comm.validate or comm.world_size <= 1
            or request.plan is not None):  # a plan's levels check their own arguments
        return
    # the range check's largest exponent: from the scheme's ``survey`` where it takes one (its
    # statistics in the same pass, kept for the call), else its own pass. ``auto`` surveys as
    # dynamiq unless forced to another scheme: a plan that runs something else ignores it (a few
    # percent more than the bare range check), one that runs dynamiq saves its statistics pass
    assert call.tensor is not None
    other = call.auto and comm.auto_force not in (None, "dynamiq")
    survey = None if other else getattr(call.scheme, "survey", None)
    surveyed = (survey(call.tensor, call.op, comm.world_size, call.collective)
                if survey is not None else None)
    if surveyed is None:
        call.exponent = max_exponent(call.tensor)
    else:
        largest, call.survey = surveyed
        call.exponent = exponent_of(largest)


def _check_numbers(call: PreparedCall, request: Request, comm: Communicator) -> None:
    """``bits`` / ``target_vnmse`` (not both), ``seed``, ``step``, tiling: kind and range."""
    if call.target is not None and request.bits is not None:
        raise InvalidArgumentError(
            f"rank {comm.rank}: give bits or target_vnmse, not both (bits={request.bits!r}, "
            f"target_vnmse={call.target!r})")
    for name, value, kind in (("bits", call.bits, numbers.Real),
                              ("seed", call.seed, numbers.Integral),
                              ("step", call.step, numbers.Integral),
                              ("tile_nbytes", call.tile_nbytes, numbers.Integral),
                              ("tiles_in_flight", call.tiles_in_flight, numbers.Integral),
                              ("target_vnmse", call.options.get("target_vnmse", 1.0),
                               numbers.Real)):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise InvalidArgumentError(
                f"rank {comm.rank}: {name} must be "
                f"{'a number' if kind is numbers.Real else 'an integer'}, got {_short(value)} "
                f"({type(value).__name__})")
        if kind is numbers.Real and not _is_finite(value):
            raise InvalidArgumentError(
                f"rank {comm.rank}: {name} must be a finite number, got {_short(value)}")
    tile_nbytes, tiles_in_flight = int(call.tile_nbytes), int(call.tiles_in_flight)
    if not (0 <= tile_nbytes < INT_LIMIT and 1 <= tiles_in_flight < INT_LIMIT):
        raise InvalidArgumentError(
            f"rank {comm.rank}: tile_nbytes must be in [0, 2**62) (0: untiled) and "
            f"tiles_in_flight in [1, 2**62), got tile_nbytes={_short(tile_nbytes)}, "
            f"tiles_in_flight={_short(tiles_in_flight)}")


def _resolve_scheme(scheme: str | Scheme, options: dict[str, Any]) -> Scheme:
    """The caller's scheme object, or a registered name built with the options it takes."""
    if not isinstance(scheme, str):
        return scheme
    entry_options = schemes.spec(scheme).options
    if "target_vnmse" in options and "target_vnmse" not in entry_options:
        raise InvalidArgumentError(
            f"target_vnmse is not supported by scheme {scheme!r} (it sets its error "
            f"through bits); schemes that take it: "
            f"{[n for n in schemes.list_schemes() if 'target_vnmse' in schemes.spec(n).options]}")
    return schemes.get(scheme, **{k: v for k, v in options.items()
                                  if k in entry_options or k != "bits"})


def _inspect_input(call: PreparedCall, buf: Any, comm: Communicator) -> None:
    """The input buffer as a torch view the scheme takes: dtype, dense, contiguous."""
    tensor = _view(call, buf, "buf", comm)
    if tensor is None:
        return
    assert call.scheme is not None
    if tensor.dtype not in call.scheme.spec.dtypes:
        call.fail("dtype", InvalidArgumentError(
            f"rank {comm.rank}: scheme {call.scheme.spec.name!r} takes "
            f"{[str(d).replace('torch.', '') for d in call.scheme.spec.dtypes]}, got "
            f"{str(tensor.dtype).replace('torch.', '')}"))
    elif tensor.layout is not torch.strided:
        call.fail("layout", InvalidArgumentError(
            f"rank {comm.rank}: buf is a {str(tensor.layout).replace('torch.', '')} tensor; "
            f"dqcoll reduces dense (strided) tensors: pass buf.to_dense()"))
    elif not tensor.is_contiguous():
        call.fail("layout", InvalidArgumentError(
            f"rank {comm.rank}: expected a contiguous tensor, got shape {tuple(tensor.shape)} "
            f"with strides {tensor.stride()}"))
    else:
        call.tensor = tensor


def _check_sharded(call: PreparedCall, out: Any, comm: Communicator) -> None:
    """A reduce-scatter's or all-gather's scheme and output (one shard, or n shards)."""
    tensor, spec = call.tensor, call.scheme.spec if call.scheme is not None else None
    assert tensor is not None and spec is not None
    if call.auto and call.collective is Collective.ALL_GATHER:
        call.fail("scheme", InvalidArgumentError(
            f"rank {comm.rank}: scheme='auto' is for allreduce and reduce_scatter (an "
            f"all-gather's bytes are set by the scheme its shards were made with)"))
        return
    if not call.auto and not spec.supports_reduce_scatter:
        call.fail("scheme", InvalidArgumentError(
            f"rank {comm.rank}: scheme {spec.name!r} cannot run {call.collective.value}: its "
            f"spec says supports_reduce_scatter=False ({spec.description}: its shards cannot be "
            f"coded apart from the whole buffer); use allreduce, or one of "
            f"{[s for s in schemes.list_schemes() if schemes.spec(s).supports_reduce_scatter]}"))
        return
    out_tensor = _view(call, out, "out", comm)
    if out_tensor is None:
        return
    n, scatter = comm.world_size, call.collective is Collective.REDUCE_SCATTER
    shard, whole = (out_tensor, tensor) if scatter else (tensor, out_tensor)
    if n * shard.numel() != whole.numel():
        rule = ("world_size x out.numel() == buf.numel()" if scatter
                else "out.numel() == world_size x shard.numel()")
        problem = (
            f"rank {comm.rank}: {call.collective.value} needs {rule}: input has "
            f"{tensor.numel()} elements, out has {out_tensor.numel()}, world size {n}")
        if scatter and tensor.numel() % n:
            padded = -(-tensor.numel() // n) * n
            problem += (f" ({tensor.numel()} does not split into {n} equal shards: unequal "
                        f"shards are not supported; pad the buffer to {padded} elements)")
    elif out_tensor.dtype != tensor.dtype:
        problem = (f"rank {comm.rank}: out dtype {out_tensor.dtype} differs from input "
                   f"{tensor.dtype}")
    elif out_tensor.device != tensor.device:
        problem = f"rank {comm.rank}: out is on {out_tensor.device}, input on {tensor.device}"
    elif not out_tensor.is_contiguous():
        problem = (f"rank {comm.rank}: expected a contiguous out tensor, got strides "
                   f"{out_tensor.stride()}")
    else:
        call.out = out_tensor
        return
    call.fail("buffer", InvalidArgumentError(problem))


def _view(call: PreparedCall, buf: Any, name: str, comm: Communicator) -> torch.Tensor | None:
    """:func:`inspect_buffer`, or None with the failure recorded."""
    try:
        return inspect_buffer(buf, name, comm)
    except DqcollError as exc:
        call.fail("buffer", exc)
    except Exception as exc:  # anything that goes wrong while looking at a buffer
        call.fail("buffer", InvalidArgumentError(
            f"rank {comm.rank}: {name} ({type(buf).__name__}) cannot be used: "
            f"{type(exc).__name__}: {exc}"))
    return None


def inspect_buffer(buf: Any, name: str, comm: Communicator) -> torch.Tensor:
    """A torch view of ``buf`` that dqcoll can read and write in place, or a clear error: what
    would fail only when read or written is refused before the argument check."""
    tensor = as_torch_view(buf, name=name)
    where = f"rank {comm.rank}: {name}"
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"{where} is on device {tensor.device}; dqcoll reads and writes cpu or cuda memory")
    if tensor.device.type not in comm.devices:
        backend = getattr(comm.transport, "backend", None)
        label = f"{comm.transport.name}/{backend}" if backend else comm.transport.name
        # e.g. a CUDA tensor on a gloo communicator: gloo would be handed device memory
        raise InvalidArgumentError(
            f"{where} is on device {tensor.device}, but this communicator's transport "
            f"({label}) moves {' and '.join(comm.devices)} tensors only: "
            f"pass a tensor on {comm.devices[0]} (e.g. {name}.to({comm.devices[0]!r}), copied "
            f"back after the call), or create a communicator for {tensor.device.type} tensors "
            + ("(dqcoll.init(backend='nccl'), or backend='torch' over an NCCL group)"
               if tensor.device.type == "cuda" else "(dqcoll.init(backend='gloo'))"))
    if tensor.requires_grad:
        raise InvalidArgumentError(
            f"{where} requires grad (a {'leaf' if tensor.is_leaf else 'non-leaf'} of an "
            f"autograd graph); dqcoll writes it in place outside autograd: pass "
            f"{name}.detach() (same memory) or the .grad tensor")
    if tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise InvalidArgumentError(
            f"{where} is an inference tensor (made under torch.inference_mode()) and this "
            f"call runs outside inference mode, where torch forbids writing it in place; call "
            f"under torch.inference_mode() (not with async_op=True) or pass a normal tensor")
    return tensor


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (``bits=2**1100`` has 332 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text)} characters)"


def _is_finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError, TypeError):  # 2**1100 does not fit a float
        return False


# -- range scaling: measured here, agreed by the argument check, applied by the execution ------


def max_exponent(tensor: torch.Tensor) -> int:
    """``e`` with ``2**(e-1) <= max finite |x| < 2**e`` (math.frexp), or :data:`NO_EXPONENT`."""
    if tensor.numel() == 0:
        return NO_EXPONENT
    if (tensor.device.type == "cpu" and tensor.dtype == torch.float32
            and tensor.is_contiguous() and kernels.numba_available() is None):
        from .kernels import dynamiq_numba  # one compiled pass (numba is importable)

        return exponent_of(dynamiq_numba.max_finite_abs(tensor))
    low, high = torch.aminmax(tensor.view(-1))
    top = max(abs(float(low)), abs(float(high)))
    if not math.isfinite(top):  # rare: look past the NaN / Inf values
        flat = tensor.view(-1)
        top = float(torch.where(torch.isfinite(flat), flat, 0).abs().max())
    return exponent_of(top)


def exponent_of(largest: float) -> int:
    """:func:`max_exponent` of a buffer whose largest finite ``|x|`` is ``largest`` (0.0: none)."""
    return NO_EXPONENT if largest == 0.0 else math.frexp(largest)[1]


def shift_for(call: PreparedCall, world_size: int, exponent: int) -> int:
    """:func:`range_shift` for a checked call; ``exponent``: the argument check's maximum."""
    if call.tensor is None or call.scheme is None or not getattr(call.scheme, "range_scaled", True):
        return 0  # unchecked, or the scheme sums wider and saturates its own results (``none``)
    spec = call.scheme.spec  # ``none`` sends values as they are: scaling would lose small bits
    return range_shift(exponent, dtype=call.tensor.dtype, world_size=world_size,
                       exact_sums=spec.exact_sums and spec.name == "none")


def range_shift(exponent: int, *, dtype: torch.dtype, world_size: int,
                exact_sums: bool) -> int:
    """The power of two ``s`` the call's inputs are divided by (``x * 2**-s``), 0: unscaled.

    ``exponent`` is the ranks' largest ``e`` with ``max |x| < 2**e``. The *overflow* shift keeps
    every partial sum (below ``2**(e + ceil(log2 world_size))``) at most half the dtype's largest
    power; ``exact_sums`` schemes take only it, the others too unless ``e`` is outside
    ``(-RANGE_EXP, RANGE_EXP]``, where the shift puts the largest value in [0.5, 1)."""
    if exponent == NO_EXPONENT:
        return 0
    spread = (world_size - 1).bit_length()  # ceil(log2 world_size)
    top = math.frexp(torch.finfo(dtype).max)[1]  # 128 for fp32 and bf16, 16 for fp16
    overflow = max(0, exponent + spread - (top - 1))
    if exact_sums or -RANGE_EXP < exponent <= RANGE_EXP:
        return overflow
    return exponent


def scaled(flat: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``flat * 2**-shift`` in ``flat``'s dtype (rounded once, from fp64)."""
    return (flat.double() * 2.0**-shift).to(flat.dtype)


def unscale_into(result: torch.Tensor, shift: int, out: torch.Tensor) -> None:
    """``out = result * 2**shift``, saturating at ``out``'s largest finite value where the
    scaled result was finite (non-finite inputs stay non-finite)."""
    value = result.double() * 2.0**shift  # exact in fp64 (|shift| < 200)
    top = torch.finfo(out.dtype).max
    overflow = torch.isfinite(result) & (value.abs() > top)
    if bool(overflow.any()):
        value = torch.where(overflow, torch.sign(value) * top, value)
    out.copy_(value.view(out.shape))
