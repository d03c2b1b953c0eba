"""The public collectives.

Every collective follows the same path:

1. Local checks (buffer type, dtype, contiguity, scheme and algorithm names, op) are turned into an
   error *code* rather than raised at once, and every rank joins one tiny all-reduce (a handshake)
   carrying that code and a fingerprint of its arguments (length, dtype, scheme and options,
   algorithm, op, seed, step). If any rank is invalid or the ranks disagree, *every* rank raises
   before any data moves: the faulty rank its own error, the others a PeerError or MismatchError
   naming the ranks and values. ``DQCOLL_VALIDATE=0`` skips the handshake (local errors still
   raise, but a peer may then wait until its timeout).
2. The scheme plans the call (statistics, allocation) and the executor runs the schedule, cut
   into tiles of ``tile_nbytes`` (default :func:`~dqcoll.executor.default_tile_nbytes`: 4 MiB
   on CPUs, 64 MiB on CUDA devices) with
   ``tiles_in_flight`` overlapping (see :mod:`dqcoll.executor`; the result does not depend on
   either, but all ranks must agree on them, so they are part of the handshake).
3. The result is written into the caller's buffer last, so an error leaves the input untouched.

CUDA buffers: all work is queued on the caller's current stream - torch's for torch tensors,
CuPy's for CuPy arrays (:func:`dqcoll.interop.stream_scope`). ``async_op=True`` returns a
:class:`~dqcoll.handles.CollectiveHandle` at once and runs the collective on the communicator's
worker (see :mod:`dqcoll.handles`); a synchronous call first waits for the communicator's pending
asynchronous ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import numbers
import time
import zlib
from typing import Any

import torch

from . import auto as auto_mod
from . import envs, handles, kernels, schemes
from .comm import Communicator, get_default_comm
from .context import call_context
from .errors import DqcollError, InvalidArgumentError, MismatchError, PeerError
from .executor import DEFAULT_TILES_IN_FLIGHT, default_tile_nbytes, run_schedule
from .interop import as_torch_view, stream_scope
from .schemes.base import Scheme
from .topology import algorithms
from .topology.schedule import Schedule
from .types import Collective, ReduceOp

__all__ = ["all_gather", "allreduce", "reduce_scatter"]

log = logging.getLogger("dqcoll")

_ERROR_CODES = {
    "buffer": 1,
    "dtype": 2,
    "layout": 3,
    "scheme": 4,
    "algorithm": 5,
    "op": 6,
    "other": 7,
}
_ERROR_NAMES = {v: k for k, v in _ERROR_CODES.items()}
_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# Everything that changes the number or the sizes of the messages, or their contents' meaning,
# must be here: ranks that disagree on any of it raise before data moves (a size disagreement
# over gloo is not an error but a SIGABRT, or a short message silently accepted).
# ``seed`` and ``step`` travel as 62-bit hashes of their whole value (the random numbers use all
# of it: dynamiq 64 bits of each, thc their decimal text), so any difference is caught; the
# message then shows each rank's own value. The call's identity rides along without new
# fields (every int64 of the check is wire bytes of every call): the communicator's call
# counter is hashed with ``step``, and the mode (sync or async_op) is coded with the collective
# kind, so two threads that issue their calls in different orders on different ranks, pairing a
# sync call with an async one, raise here instead of summing unrelated buffers.
_FIELDS = ("numel", "dtype", "scheme", "algorithm", "op", "seed", "step", "tile_nbytes",
           "tiles_in_flight", "collective", "out_numel")
_NUMERIC_FIELDS = ("numel", "tile_nbytes", "tiles_in_flight", "out_numel")
_HASHED_FIELDS = ("seed", "step")
_STEP_FIELD = _FIELDS.index("step")
_MODES = {0: "sync", 1: "async_op"}
_MODE_STRIDE = 8  # collective field = kind id + _MODE_STRIDE * mode
# Integer options travel as int64 in the argument check, negated for the minimum: each must lie
# in [0, 2**62) so that neither overflows.
_INT_LIMIT = 1 << 62
_COLLECTIVE_IDS = {Collective.ALLREDUCE: 1, Collective.REDUCE_SCATTER: 2,
                   Collective.ALL_GATHER: 3}
# Inputs whose largest finite magnitude on any rank lies outside [2**-_RANGE_EXP, 2**_RANGE_EXP)
# are scaled by a power of two (the same on every rank, agreed in the argument check) before the
# codec and back after: exact, and it keeps every scheme's sums, norms and scales in range
# (DynamiQ's squared norms overflow fp32 from |x| ~ 1e18 and its super-group means from ~1e36;
# THC's rotation from ~1e37). Inputs inside the range take the unscaled path, bit for bit.
# Cost: one torch.aminmax pass per call, 4.9 ms for 64 MiB of fp32 on one core of the dev VM
# (~14 GB/s), against >= 80 ms per hop for the codec at ~200 M coordinates/s.
_RANGE_EXP = 48
_NO_EXPONENT = -(1 << 20)  # an all-zero (or all non-finite) buffer: nothing to scale


class _DefaultBits(float):
    """The default ``bits`` (5.0), recognisable by identity: ``bits`` and ``target_vnmse``
    conflict only when the caller gave both."""


DEFAULT_BITS = _DefaultBits(5.0)


@dataclasses.dataclass
class _Request:
    tensor: torch.Tensor | None = None
    scheme: Scheme | None = None
    schedule: Schedule | None = None
    op: ReduceOp | None = None
    out: torch.Tensor | None = None
    error: DqcollError | None = None
    category: str = ""
    fingerprint: tuple[int, ...] = ()
    exponent: int = _NO_EXPONENT  # binary exponent of the largest finite |value| (frexp)
    seed: int = 0  # this rank's own values of the hashed fields, for the mismatch message
    step: int = 0
    call: int = 0  # the communicator's call counter (hashed with step)


def _schemes_with(option: str) -> list[str]:
    return [name for name in schemes.list_schemes() if option in schemes.spec(name).options]


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _hash62(value: object) -> int:
    """A 62-bit hash of a value of any size (its text, e.g. an int's digits): equal only for
    equal values, up to collisions of probability 2**-62."""
    digest = hashlib.blake2b(str(value).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (_INT_LIMIT - 1)


def _short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters (``bits=2**1100`` has 332 digits)."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:28]}...{text[-28:]} ({len(text)} characters)"


def _choose_algorithm(name: str, world_size: int, buf: Any = None, scheme: Any = None) -> str:
    if name != "auto":
        return name
    # The tuned table of this topology (nearest smaller size bucket), else the documented
    # fallback rule; see dqcoll.topology.tuning.
    from .topology import tuning

    scheme_name = scheme if isinstance(scheme, str) else getattr(
        getattr(scheme, "spec", None), "name", "dynamiq")
    return tuning.choose(world_size=world_size, nbytes=int(getattr(buf, "nbytes", 0) or 0),
                         scheme=scheme_name,
                         dtype=str(getattr(buf, "dtype", "float32")).replace("torch.", ""))


def _prepare(
    buf: Any,
    *,
    op: str | ReduceOp,
    scheme: str | Scheme,
    scheme_options: dict[str, Any],
    algorithm: str,
    comm: Communicator,
    seed: int,
    step: int,
    bits: Any = None,
    tile_nbytes: int = 0,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
) -> _Request:
    request = _Request()

    def fail(category: str, exc: DqcollError) -> _Request:
        request.error, request.category = exc, category
        return request

    if scheme_options.get("target_vnmse") is not None and bits is not DEFAULT_BITS:
        return fail("other", InvalidArgumentError(
            f"rank {comm.rank}: give bits or target_vnmse, not both (bits={bits!r}, "
            f"target_vnmse={scheme_options['target_vnmse']!r})"))

    for name, value, kind in (("bits", bits, numbers.Real), ("seed", seed, numbers.Integral),
                              ("step", step, numbers.Integral),
                              ("tile_nbytes", tile_nbytes, numbers.Integral),
                              ("tiles_in_flight", tiles_in_flight, numbers.Integral),
                              ("target_vnmse", scheme_options.get("target_vnmse", 1.0),
                               numbers.Real)):
        if isinstance(value, bool) or not isinstance(value, kind):
            return fail("other", InvalidArgumentError(
                f"rank {comm.rank}: {name} must be "
                f"{'a number' if kind is numbers.Real else 'an integer'}, got {_short(value)} "
                f"({type(value).__name__})"))
        if kind is numbers.Real and not _is_finite(value):
            return fail("other", InvalidArgumentError(
                f"rank {comm.rank}: {name} must be a finite number, got {_short(value)}"))
    seed, step = int(seed), int(step)
    tile_nbytes, tiles_in_flight = int(tile_nbytes), int(tiles_in_flight)
    if not (0 <= tile_nbytes < _INT_LIMIT and 1 <= tiles_in_flight < _INT_LIMIT):
        return fail("other", InvalidArgumentError(
            f"rank {comm.rank}: tile_nbytes must be in [0, 2**62) (0: untiled) and "
            f"tiles_in_flight in [1, 2**62), got tile_nbytes={_short(tile_nbytes)}, "
            f"tiles_in_flight={_short(tiles_in_flight)}"
        ))
    request.seed, request.step = seed, step

    try:
        request.op = ReduceOp.parse(op)
    except DqcollError as exc:
        return fail("op", exc)
    try:
        if isinstance(scheme, str):
            entry_options = schemes.spec(scheme).options
            if "target_vnmse" in scheme_options and "target_vnmse" not in entry_options:
                raise InvalidArgumentError(
                    f"target_vnmse is not supported by scheme {scheme!r} (it sets its error "
                    f"through bits); schemes that take it: {_schemes_with('target_vnmse')}"
                )
            # `bits` is passed to the schemes that take it; the others have a fixed format.
            options = {k: v for k, v in scheme_options.items()
                       if k in entry_options or k != "bits"}
            request.scheme = schemes.get(scheme, **options)
        else:
            request.scheme = scheme
    except DqcollError as exc:
        return fail("scheme", exc)
    try:
        name = _choose_algorithm(algorithm, comm.world_size, buf, request.scheme)
        request.schedule = algorithms.build_schedule(name, comm.world_size)
    except DqcollError as exc:
        return fail("algorithm", exc)
    try:
        tensor = _inspect_buffer(buf, "buf", comm)
    except DqcollError as exc:
        return fail("buffer", exc)
    except Exception as exc:  # anything that goes wrong while looking at a buffer
        return fail("buffer", InvalidArgumentError(
            f"rank {comm.rank}: buf ({type(buf).__name__}) cannot be used: "
            f"{type(exc).__name__}: {exc}"))
    assert request.scheme is not None
    if tensor.dtype not in request.scheme.spec.dtypes:
        return fail("dtype", InvalidArgumentError(
            f"rank {comm.rank}: scheme {request.scheme.spec.name!r} takes "
            f"{[str(d).replace('torch.', '') for d in request.scheme.spec.dtypes]}, got "
            f"{str(tensor.dtype).replace('torch.', '')}"
        ))
    if tensor.layout is not torch.strided:
        return fail("layout", InvalidArgumentError(
            f"rank {comm.rank}: buf is a {str(tensor.layout).replace('torch.', '')} tensor; "
            f"dqcoll reduces dense (strided) tensors: pass buf.to_dense()"))
    if not tensor.is_contiguous():
        return fail("layout", InvalidArgumentError(
            f"rank {comm.rank}: expected a contiguous tensor, got shape {tuple(tensor.shape)} "
            f"with strides {tensor.stride()}"
        ))
    request.tensor = tensor
    options_text = repr(request.scheme)
    request.fingerprint = (
        tensor.numel(),
        _DTYPE_IDS[tensor.dtype],
        _crc(request.scheme.spec.name + options_text),
        _crc(request.schedule.algorithm),
        _crc(request.op.value),
        _hash62(seed),
        _hash62(step),
        tile_nbytes,
        tiles_in_flight,
    )
    if envs.validate() and comm.world_size > 1:
        request.exponent = _max_exponent(tensor)
    return request


def _with_identity(request: _Request, fingerprint: tuple[int, ...], call: int, async_op: bool,
                   collective: Collective, out_numel: int) -> tuple[int, ...]:
    """The fingerprint with the call's identity: ``step`` hashed with the call counter, the
    collective kind coded with the mode, then the output length."""
    request.call = call
    fields = list(fingerprint)
    fields[_STEP_FIELD] = _hash62(f"{request.step}/{call}")
    kind = _COLLECTIVE_IDS[collective] + _MODE_STRIDE * (1 if async_op else 0)
    return (*fields, kind, out_numel)


def _is_finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (OverflowError, ValueError, TypeError):  # 2**1100 does not fit a float
        return False


def _handshake(request: _Request, comm: Communicator, what: str,
               extra: list[int] | None = None) -> int:
    """Raise on every rank if any rank is invalid or the ranks disagree (one tiny all-reduce).

    Returns the largest binary exponent of a finite input value over all ranks (the range
    check of :func:`_range_shift`); :data:`_NO_EXPONENT` without a check. ``extra`` (integers)
    rides along and is replaced in place by its maximum over ranks (``scheme="auto"``'s
    agreement, so an ``auto`` call runs the exchange even with ``DQCOLL_VALIDATE=0``).
    """
    n = comm.world_size
    if (not envs.validate() and extra is None) or n == 1:
        if request.error is not None:
            raise request.error
        return _NO_EXPONENT
    k = len(_FIELDS)
    # every call carries the same slots (zeros outside auto), so that a rank calling auto and
    # one calling a scheme by name exchange vectors of one size and see the mismatch
    m = _EXTRA_SLOTS
    assert extra is None or len(extra) == m
    vector = torch.zeros(2 * k + n + m + 1, dtype=torch.int64)
    if extra:
        vector[2 * k + n : 2 * k + n + m] = torch.tensor(extra, dtype=torch.int64)
    if request.error is None:
        fields = torch.tensor(request.fingerprint, dtype=torch.int64)
        vector[:k] = fields
        vector[k : 2 * k] = -fields
        vector[-1] = request.exponent
    else:
        vector[2 * k + comm.rank] = _ERROR_CODES[request.category]
        vector[-1] = _NO_EXPONENT
    vector = vector.to(comm.device)
    try:
        comm.transport.allreduce(vector, "max", what=f"{what} argument check")
    except MismatchError:
        raise  # messages of another step (the torch transport's headers): nothing in flight
    except BaseException as exc:
        comm.mark_dead(f"{what} argument check failed: {type(exc).__name__}: {exc}")
        raise
    vector = vector.cpu()
    codes = vector[2 * k : 2 * k + n].tolist()
    if extra is not None:
        extra[:] = vector[2 * k + n : 2 * k + n + m].tolist()
    if request.error is not None:
        raise request.error
    bad = [(r, _ERROR_NAMES.get(c, "other")) for r, c in enumerate(codes) if c]
    if bad:
        listed = ", ".join(f"rank {r} ({cat})" for r, cat in bad)
        raise PeerError(f"rank {comm.rank}: {what} not run: invalid input on {listed}")
    high = vector[:k].tolist()
    low = [-v for v in vector[k : 2 * k].tolist()]
    differ = [(f, lo, hi) for f, lo, hi in zip(_FIELDS, low, high, strict=True) if lo != hi]
    if differ:
        kinds = {i: c.value for c, i in _COLLECTIVE_IDS.items()}
        detail = "; ".join(
            f"{f} (min {lo}, max {hi})" if f in _NUMERIC_FIELDS
            else f"seed (this rank: {request.seed})" if f == "seed"
            else (f"step or call counter (this rank: step {request.step}, call {request.call}; "
                  f"ranks must issue the same collectives in the same order)") if f == "step"
            else (f"collective or mode ({kinds.get(lo % _MODE_STRIDE)} "
                  f"{_MODES.get(lo // _MODE_STRIDE)} vs {kinds.get(hi % _MODE_STRIDE)} "
                  f"{_MODES.get(hi // _MODE_STRIDE)})") if f == "collective"
            else f"{f}"
            for f, lo, hi in differ
        )
        raise MismatchError(f"rank {comm.rank}: {what}: ranks disagree on {detail}")
    return int(vector[-1])


def _inspect_buffer(buf: Any, name: str, comm: Communicator) -> torch.Tensor:
    """A torch view of ``buf`` that dqcoll can read and then write in place, or a clear error.

    Everything that would fail only when the result is written (autograd leaves, inference
    tensors) or when the data is read (meta and other storage-less devices) is refused here,
    before the argument check, so every rank raises and no rank keeps a half-written buffer.
    """
    tensor = as_torch_view(buf, name=name)
    where = f"rank {comm.rank}: {name}"
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(
            f"{where} is on device {tensor.device}; dqcoll reads and writes cpu or cuda memory")
    if tensor.device.type not in comm.devices:
        # e.g. a CUDA tensor on a gloo communicator: gloo would be handed device memory
        raise InvalidArgumentError(
            f"{where} is on device {tensor.device}, but this communicator's transport "
            f"({_transport_label(comm)}) moves {' and '.join(comm.devices)} tensors only: "
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


def _transport_label(comm: Communicator) -> str:
    """The transport's name, with its torch.distributed backend where it has one."""
    backend = getattr(comm.transport, "backend", None)
    return f"{comm.transport.name}/{backend}" if backend else str(comm.transport.name)


def _buffer_device(buf: Any, default: torch.device) -> torch.device:
    """The device of ``buf``'s memory, or ``default`` where it cannot be told (the argument
    check then reports the buffer)."""
    try:
        return as_torch_view(buf, name="buf").device
    except Exception:
        return default


def _max_exponent(tensor: torch.Tensor) -> int:
    """``e`` with ``2**(e-1) <= max finite |x| < 2**e`` (math.frexp), or :data:`_NO_EXPONENT`."""
    if tensor.numel() == 0:
        return _NO_EXPONENT
    if (tensor.device.type == "cpu" and tensor.dtype == torch.float32
            and tensor.is_contiguous() and kernels.numba_available() is None):
        from .kernels import dynamiq_numba  # one compiled pass (numba is importable)

        top = dynamiq_numba.max_finite_abs(tensor)
        return _NO_EXPONENT if top == 0.0 else math.frexp(top)[1]
    low, high = torch.aminmax(tensor.view(-1))
    top = max(abs(float(low)), abs(float(high)))
    if not math.isfinite(top):  # rare: look past the NaN / Inf values
        flat = tensor.view(-1)
        finite = torch.where(torch.isfinite(flat), flat, torch.zeros((), dtype=flat.dtype,
                                                                      device=flat.device))
        top = float(finite.abs().max())
    if top == 0.0:
        return _NO_EXPONENT
    return math.frexp(top)[1]


def _shift_for(request: _Request, comm: Communicator, exponent: int) -> int:
    """:func:`_range_shift` for a checked request (its dtype and scheme)."""
    if exponent == _NO_EXPONENT or request.tensor is None or request.scheme is None:
        return 0
    return _range_shift(exponent, dtype=request.tensor.dtype, world_size=comm.world_size,
                        exact_sums=_sums_exact_in_wire_dtype(request.scheme))


def _sums_exact_in_wire_dtype(scheme: Scheme) -> bool:
    """Whether the scheme sends values as they are (``none``): its sums are exact in its wire
    dtype, so it must not be scaled into a range where small values lose bits."""
    return scheme.spec.exact_sums and scheme.spec.name == "none"


def _range_shift(exponent: int, *, dtype: torch.dtype, world_size: int,
                 exact_sums: bool) -> int:
    """The power of two ``s`` the call's inputs are divided by (``x * 2**-s``), 0: unscaled.

    ``exponent`` is the largest over all ranks of ``e`` with ``max |x| < 2**e``, so every partial
    sum is below ``world_size * 2**e <= 2**(e + c)``, ``c = ceil(log2 world_size)``. The
    smallest shift that keeps that bound at most half the dtype's largest power (2**127 for
    fp32 and bf16, 2**15 for fp16) is the *overflow* shift: fp16 inputs of 30000 on 3 ranks
    need 2 (they overflowed to inf before). A scheme whose sums are exact in its wire dtype
    (``none``) takes only that shift, which is exact for every normal number. The others take
    it too, unless the magnitude is outside [2**-48, 2**48), where their norms and scales would
    leave the fp32 range; then the largest value lands in [0.5, 1)."""
    if exponent == _NO_EXPONENT:
        return 0
    spread = (world_size - 1).bit_length()  # ceil(log2 world_size)
    top = math.frexp(torch.finfo(dtype).max)[1]  # 128 for fp32 and bf16, 16 for fp16
    overflow = max(0, exponent + spread - (top - 1))
    if exact_sums or -_RANGE_EXP < exponent <= _RANGE_EXP:
        return overflow
    return exponent


def _scaled(flat: torch.Tensor, shift: int) -> torch.Tensor:
    """A copy of ``flat * 2**-shift`` in ``flat``'s dtype (rounded once, from fp64)."""
    return (flat.double() * 2.0**-shift).to(flat.dtype)


def _unscale_into(result: torch.Tensor, shift: int, out: torch.Tensor) -> None:
    """``out = result * 2**shift``, saturating at ``out``'s largest finite value where the
    scaled result was finite (non-finite inputs stay non-finite)."""
    value = result.double() * 2.0**shift  # exact in fp64 (|shift| < 200)
    top = torch.finfo(out.dtype).max
    overflow = torch.isfinite(result) & (value.abs() > top)
    if bool(overflow.any()):
        value = torch.where(overflow, torch.sign(value) * top, value)
    out.copy_(value.view(out.shape))


def _run(
    collective: Collective,
    buf: Any,
    out: Any,
    *,
    op: str | ReduceOp,
    scheme: str | Scheme,
    bits: float,
    algorithm: str,
    comm: Communicator | None,
    seed: int | None,
    step: int | None,
    scheme_options: dict[str, Any],
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    async_op: bool = False,
) -> None:
    comm = comm or get_default_comm()
    with comm.in_flight(collective.value):
        _run_checked(collective, buf, out, op=op, scheme=scheme, bits=bits, algorithm=algorithm,
                     comm=comm, seed=seed, step=step, scheme_options=scheme_options,
                     tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight,
                     async_op=async_op)


@dataclasses.dataclass
class _Call:
    """What every checked collective settles before its argument check."""

    tile_nbytes: int
    call_step: int  # the communicator's counter: the call's identity
    step: int
    seed: int
    what: str  # the call's name in errors and logs
    options: dict[str, Any]  # the scheme options, with ``bits`` unless ``target_vnmse``
    target: Any  # target_vnmse, or None


def _call(collective: Collective, buf: Any, comm: Communicator, *, seed: int | None,
          step: int | None, bits: float, scheme_options: dict[str, Any],
          tile_nbytes: int | None, label: str = "") -> _Call:
    if tile_nbytes is None:  # the tensor's device decides (4 MiB on CPUs, 64 MiB on GPUs)
        tile_nbytes = default_tile_nbytes(_buffer_device(buf, comm.device))
    call_step = comm.next_step()
    options = dict(scheme_options)
    target = options.get("target_vnmse")
    if target is None:
        options.pop("target_vnmse", None)
        options["bits"] = bits
    return _Call(tile_nbytes=tile_nbytes, call_step=call_step,
                 step=call_step if step is None else step,
                 seed=comm.seed if seed is None else seed,
                 what=f"{collective.value}#{call_step}{label}", options=options, target=target)


def _prepare_or_error(buf: Any, call: _Call, comm: Communicator, **kwargs: Any) -> _Request:
    """:func:`_prepare`, with whatever goes wrong there made this rank's error (told to every
    rank by the argument check)."""
    try:
        return _prepare(buf, scheme_options=call.options, comm=comm, seed=call.seed,
                        step=call.step, tile_nbytes=call.tile_nbytes, **kwargs)
    except Exception as exc:
        return _Request(error=exc if isinstance(exc, DqcollError) else InvalidArgumentError(
            f"rank {comm.rank}: {call.what}: invalid arguments: {type(exc).__name__}: {exc}"),
            category="other")


def _run_checked(
    collective: Collective,
    buf: Any,
    out: Any,
    *,
    op: str | ReduceOp,
    scheme: str | Scheme,
    bits: float,
    algorithm: str,
    comm: Communicator,
    seed: int | None,
    step: int | None,
    scheme_options: dict[str, Any],
    tile_nbytes: int | None,
    tiles_in_flight: int,
    async_op: bool = False,
) -> None:
    if isinstance(scheme, str) and scheme == "auto":
        _run_auto(collective, buf, out, op=op, bits=bits, algorithm=algorithm, comm=comm,
                  seed=seed, step=step, scheme_options=scheme_options, tile_nbytes=tile_nbytes,
                  tiles_in_flight=tiles_in_flight, async_op=async_op)
        return
    call = _call(collective, buf, comm, seed=seed, step=step, bits=bits,
                 scheme_options=scheme_options, tile_nbytes=tile_nbytes)
    tile_nbytes, call_step, step, seed, what = (call.tile_nbytes, call.call_step, call.step,
                                                call.seed, call.what)
    request = _prepare_or_error(buf, call, comm, op=op, scheme=scheme, algorithm=algorithm,
                                bits=bits, tiles_in_flight=tiles_in_flight)
    out_tensor = None
    if request.error is None and collective is not Collective.ALLREDUCE:
        _check_sharded_support(request, collective, comm)
    if request.error is None and collective is not Collective.ALLREDUCE:
        _check_output(request, out, collective, comm)
        out_tensor = request.out
    if request.error is None:
        out_numel = out_tensor.numel() if out_tensor is not None else 0
        request.fingerprint = _with_identity(request, request.fingerprint, call_step,
                                             async_op, collective, out_numel)
    exponent = _handshake(request, comm, what)
    try:
        _execute(collective, request, comm, what, _shift_for(request, comm, exponent), seed=seed,
                 step=step, tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight)
    except BaseException as exc:
        # Data moved (or may have): peers may be anywhere in this call, and messages of it may
        # still be in flight. The next call could read them as its own, so the communicator
        # is done for (NCCL's rule after an error, too).
        comm.mark_dead(f"{what} failed: {type(exc).__name__}: {exc}")
        raise


def _run_auto(
    collective: Collective,
    buf: Any,
    out: Any,
    *,
    op: str | ReduceOp,
    bits: float,
    algorithm: str,
    comm: Communicator,
    seed: int | None,
    step: int | None,
    scheme_options: dict[str, Any],
    tile_nbytes: int | None,
    tiles_in_flight: int,
    async_op: bool = False,
) -> None:
    """``scheme="auto"`` (see :mod:`dqcoll.auto`): the arguments are checked as for
    ``dynamiq`` with its options, the ranks agree on the candidates' predicted times in the same
    check, and every rank runs the candidate the rule picks from those agreed numbers."""
    start = time.perf_counter()
    call = _call(collective, buf, comm, seed=seed, step=step, bits=bits,
                 scheme_options=scheme_options, tile_nbytes=tile_nbytes, label=" (auto)")
    tile_nbytes, call_step, step, seed, what, target = (
        call.tile_nbytes, call.call_step, call.step, call.seed, call.what, call.target)
    # Checked as dynamiq with the caller's options (so bad options raise on every rank now),
    # fingerprinted as "auto": a rank calling auto and another calling dynamiq disagree.
    request = _prepare_or_error(buf, call, comm, op=op, scheme="dynamiq", algorithm=algorithm,
                                bits=bits, tiles_in_flight=tiles_in_flight)
    if request.error is None and collective is Collective.ALL_GATHER:
        request.error, request.category = InvalidArgumentError(
            f"rank {comm.rank}: scheme='auto' is for allreduce and reduce_scatter (an "
            f"all-gather's bytes are set by the scheme its shards were made with)"), "scheme"
    if request.error is None and collective is not Collective.ALLREDUCE:
        _check_output(request, out, collective, comm)
    if request.error is None:
        fingerprint = list(request.fingerprint)
        fingerprint[_FIELDS.index("scheme")] = _crc("auto" + repr(request.scheme))
        out_numel = request.out.numel() if request.out is not None else 0
        request.fingerprint = _with_identity(request, tuple(fingerprint), call_step, async_op,
                                             collective, out_numel)
    policy = comm.auto
    numel = request.tensor.numel() if request.tensor is not None else 0
    element_nbytes = request.tensor.element_size() if request.tensor is not None else 4
    budget = float(bits) if target is None else auto_mod.TARGET_BITS
    traffic = 2 if collective is Collective.ALLREDUCE else 1  # reduce-scatter: half the bytes

    def local_us() -> list[int]:
        # (the codec rates were measured with every rank of the machine measuring at once, so
        # they include the sharing of its cores)
        predicted = policy.predict_s(numel * traffic // 2, element_nbytes, comm.world_size,
                                     budget, 1.0)
        if element_nbytes == 2:  # a 16-bit buffer: bf16 saves nothing
            predicted["bf16"] = math.inf
        return [min(int(predicted[c] * 1e6), _MAX_US) for c in auto_mod.CANDIDATES]

    ready = policy.ready()
    extra = [int(policy.last_elapsed_s * 1e6), *(local_us() if ready else [0, 0, 0])]
    exponent = _handshake(request, comm, what, extra)
    policy.calibrate(extra[0] / 1e6)
    try:
        if not ready:  # the first auto call: measure the link and the codecs, then agree
            policy.measure_link(comm.transport, what=f"{what} link probe")
            policy.measure_codecs(comm.device, budget)
            start = time.perf_counter()  # the call's time, for calibration, without the probe
            agreed = torch.tensor(local_us(), dtype=torch.float64)
            comm.transport.allreduce(agreed, "max", what=f"{what} predictions")
            extra[1:] = [int(v) for v in agreed.tolist()]
        choice = policy.choose({c: extra[1 + i] / 1e6
                                for i, c in enumerate(auto_mod.CANDIDATES)})
        native = (choice.scheme != "dynamiq" and collective is Collective.ALLREDUCE
                  and hasattr(comm.transport, "native_allreduce") and numel > 0)
        if native:
            _native_allreduce(request, comm, choice.scheme, what)
        else:
            if choice.scheme != "dynamiq":
                request.scheme = schemes.get(choice.scheme)
            if algorithm == "auto":
                request.schedule = algorithms.build_schedule(
                    _choose_algorithm("auto", comm.world_size, buf, request.scheme),
                    comm.world_size)
            _execute(collective, request, comm, what, _shift_for(request, comm, exponent),
                     seed=seed,
                     step=step, tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight)
    except BaseException as exc:
        comm.mark_dead(f"{what} failed: {type(exc).__name__}: {exc}")
        raise
    policy.last_elapsed_s = time.perf_counter() - start
    comm.last_info["scheme"] = choice.scheme
    comm.last_info["auto"] = choice.as_info()


_MAX_US = 1 << 50  # an "infinite" prediction in the argument check's int64 fields
# the argument check's slots for auto: the previous call's time, then one prediction per candidate
_EXTRA_SLOTS = 1 + len(auto_mod.CANDIDATES)


def _native_allreduce(request: _Request, comm: Communicator, scheme: str, what: str) -> None:
    """``auto``'s ``none`` / ``bf16`` over a torch process group: the group's own all-reduce,
    what DDP runs without a hook (``avg``: divided by n first, as ``allreduce_hook``), ``bf16``
    cast to bf16 and back around it (torch's ``bf16_compress_hook``)."""
    tensor = request.tensor
    assert tensor is not None and request.op is not None
    n = comm.world_size
    flat = tensor.view(-1)
    work = flat.to(torch.bfloat16) if scheme == "bf16" and flat.element_size() == 4 else flat
    if request.op is ReduceOp.AVG:
        work = work.div_(n) if work is not flat else work.mul_(1.0 / n)
    comm.transport.native_allreduce(work, what=what)  # type: ignore[attr-defined]  # checked
    if work is not flat:
        flat.copy_(work)
    comm.last_info = {"scheme": scheme, "algorithm": f"{comm.transport.name} all_reduce",
                      "bits": 8.0 * work.element_size()}


def _execute(collective: Collective, request: _Request, comm: Communicator, what: str,
             shift: int, *, seed: int, step: int, tile_nbytes: int,
             tiles_in_flight: int) -> None:
    """Run one checked collective; write the caller's buffers last."""
    tensor, scheme_obj, schedule = request.tensor, request.scheme, request.schedule
    out_tensor = request.out
    assert tensor is not None and scheme_obj is not None and schedule is not None
    assert request.op is not None
    n = comm.world_size
    flat = tensor.view(-1)
    comm.last_info = {"scheme": scheme_obj.spec.name, "algorithm": schedule.algorithm}
    if collective is Collective.ALLREDUCE:
        if flat.numel() == 0 or n == 1:
            return
        x = flat
    elif collective is Collective.REDUCE_SCATTER:
        assert out_tensor is not None
        if flat.numel() == 0 or n == 1:
            out_tensor.view(-1).copy_(flat)
            return
        x = flat
    else:
        assert out_tensor is not None
        if flat.numel() == 0 or n == 1:
            out_tensor.view(-1).copy_(flat)
            return
        x = torch.zeros(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        x.view(n, -1)[comm.rank] = flat
    if shift:
        x = _scaled(x, shift)
    ctx = call_context(comm.transport, request.op, seed, step, collective, what, schedule,
                       comm.scheme_state)
    call = scheme_obj.begin(x, ctx)
    run_schedule(schedule, call, comm.transport, what=what, collective=collective,
                 tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight)
    if collective is Collective.ALLREDUCE:
        target = flat
    else:
        assert out_tensor is not None
        target = out_tensor.view(-1)
    # A stream-ordered transport (NCCL) returns before the data moved, and a timed-out or
    # aborted transfer leaves garbage behind: the host waits (with the timeout) until every
    # transfer of the call completed before anything is written to the caller's buffers, so a
    # failure raises here with the buffers untouched (docs/gpu_transport.md). Waiting before
    # the final decode rather than decoding into scratch first saves a buffer-sized copy.
    if getattr(comm.transport, "stream_ordered", False):
        comm.transport.synchronize(what=f"{what} (last transfers)")  # type: ignore[attr-defined]
    result: torch.Tensor | None = None
    if collective is Collective.REDUCE_SCATTER:
        finish_shard = getattr(call, "finish_shard", None)
        if finish_shard is not None:  # decode this rank's shard only
            result = torch.empty_like(target) if shift else target
            finish_shard(comm.rank, result)
        else:
            full = torch.empty_like(flat)
            call.finish(full)
            result = full.view(n, -1)[comm.rank]
    elif shift:
        result = torch.empty_like(target)
        call.finish(result)
    else:
        call.finish(target)
    if shift:
        assert result is not None
        _unscale_into(result, shift, target)
    elif result is not None and result is not target:
        target.copy_(result)
    comm.last_info.update(call.info)
    if shift:
        comm.last_info["range_shift"] = shift


def _check_sharded_support(request: _Request, collective: Collective, comm: Communicator) -> None:
    """A scheme that declares ``supports_reduce_scatter=False`` is refused, saying why."""
    spec = request.scheme.spec if request.scheme is not None else None
    if spec is None or spec.supports_reduce_scatter:
        return
    request.error = InvalidArgumentError(
        f"rank {comm.rank}: scheme {spec.name!r} cannot run {collective.value}: its spec says "
        f"supports_reduce_scatter=False ({spec.description}: its shards cannot be coded apart "
        f"from the whole buffer); use allreduce, or one of "
        f"{[s for s in schemes.list_schemes() if schemes.spec(s).supports_reduce_scatter]}"
    )
    request.category = "scheme"


def _check_output(request: _Request, out: Any, collective: Collective, comm: Communicator) -> None:
    """The shape rules of reduce-scatter (out = one shard) and all-gather (out = n shards)."""
    tensor = request.tensor
    assert tensor is not None
    try:
        out_tensor = _inspect_buffer(out, "out", comm)
    except DqcollError as exc:
        request.error, request.category = exc, "buffer"
        return
    except Exception as exc:  # anything that goes wrong while looking at a buffer
        request.error, request.category = InvalidArgumentError(
            f"rank {comm.rank}: out ({type(out).__name__}) cannot be used: "
            f"{type(exc).__name__}: {exc}"), "buffer"
        return
    n = comm.world_size
    if collective is Collective.REDUCE_SCATTER:
        expected, rule = tensor.numel(), "world_size x out.numel() == buf.numel()"
        got = n * out_tensor.numel()
    else:
        expected, rule = n * tensor.numel(), "out.numel() == world_size x shard.numel()"
        got = out_tensor.numel()
    problem = None
    if got != expected:
        problem = (
            f"rank {comm.rank}: {collective.value} needs {rule}: input has {tensor.numel()} "
            f"elements, out has {out_tensor.numel()}, world size {n}"
        )
        if collective is Collective.REDUCE_SCATTER and tensor.numel() % n:
            padded = -(-tensor.numel() // n) * n
            problem += (f" ({tensor.numel()} does not split into {n} equal shards: unequal "
                        f"shards are not supported; pad the buffer to {padded} elements)")
    elif out_tensor.dtype != tensor.dtype:
        problem = (f"rank {comm.rank}: out dtype {out_tensor.dtype} differs from input "
                   f"{tensor.dtype}")
    elif out_tensor.device != tensor.device:
        problem = f"rank {comm.rank}: out is on {out_tensor.device}, input on {tensor.device}"
    elif not out_tensor.is_contiguous():
        problem = (
            f"rank {comm.rank}: expected a contiguous out tensor, got strides {out_tensor.stride()}"
        )
    if problem is not None:
        request.error, request.category = InvalidArgumentError(problem), "buffer"
        return
    request.out = out_tensor


def _launch(collective: Collective, buf: Any, out: Any, result: Any, *, async_op: bool,
            comm: Communicator | None, **kwargs: Any) -> Any:
    """Run one collective now (in the caller's stream scope) or on the communicator's worker."""
    comm = comm or get_default_comm()
    if async_op:
        return handles.submit(comm, lambda: _run(collective, buf, out, comm=comm, async_op=True,
                                                 **kwargs),
                              buf=buf, result=result, what=f"{collective.value} (async_op)")
    handles.drain(comm)
    with stream_scope(buf):
        _run(collective, buf, out, comm=comm, **kwargs)
    return result


def allreduce(
    buf: Any,
    *,
    op: str | ReduceOp = "sum",
    scheme: str | Scheme = "dynamiq",
    bits: float = DEFAULT_BITS,
    algorithm: str = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized all-reduce of ``buf`` in place; returns ``buf``.

    ``buf``: torch tensor, NumPy or CuPy array, contiguous, fp32/bf16/fp16, any length.
    ``op``: "sum" or "avg". ``scheme``: a registered name (see ``dqcoll.schemes.list_schemes()``)
    or a scheme object; ``bits`` and ``scheme_options`` (e.g. ``levels="uniform"``) configure it.
    ``algorithm``: "ring", "butterfly", "direct" or "auto". ``seed``/``step`` key the random
    rounding (default: the communicator's seed and call counter).
    ``target_vnmse=`` (a scheme option, dynamiq only, instead of ``bits``) chooses per call the
    fewest bits whose predicted vNMSE meets the target (see
    :mod:`dqcoll.schemes.dynamiq.error_model`); ``comm.last_info`` reports the bits used and
    the prediction.
    ``async_op=True`` returns a :class:`~dqcoll.handles.CollectiveHandle` (``wait()`` returns
    ``buf``; ``is_completed()``) instead of ``buf``. ``tile_nbytes`` (None: the default,
    :func:`~dqcoll.executor.default_tile_nbytes`; 0: untiled) and ``tiles_in_flight`` set the
    pipelining (:mod:`dqcoll.executor`); the result does not depend on them.
    """
    return _launch(Collective.ALLREDUCE, buf, None, buf, async_op=async_op, comm=comm, op=op,
                   scheme=scheme, bits=bits, algorithm=algorithm, seed=seed, step=step,
                   scheme_options=scheme_options, tile_nbytes=tile_nbytes,
                   tiles_in_flight=tiles_in_flight)


def reduce_scatter(
    buf: Any,
    out: Any,
    *,
    op: str | ReduceOp = "sum",
    scheme: str | Scheme = "dynamiq",
    bits: float = DEFAULT_BITS,
    algorithm: str = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized reduce-scatter: ``out`` (``buf.numel() / world_size`` elements) receives shard
    ``rank`` of the reduction of ``buf``; returns ``out``. Equal to the matching part of
    :func:`allreduce` with the same arguments on the same layout."""
    return _launch(Collective.REDUCE_SCATTER, buf, out, out, async_op=async_op, comm=comm, op=op,
                   scheme=scheme, bits=bits, algorithm=algorithm, seed=seed, step=step,
                   scheme_options=scheme_options, tile_nbytes=tile_nbytes,
                   tiles_in_flight=tiles_in_flight)


def all_gather(
    shard: Any,
    out: Any,
    *,
    scheme: str | Scheme = "dynamiq",
    bits: float = DEFAULT_BITS,
    algorithm: str = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized all-gather: ``out`` (``world_size * shard.numel()`` elements) receives every
    rank's shard in rank order, each decoded from the same bytes on every rank (the owner's own
    shard too); returns ``out``."""
    return _launch(Collective.ALL_GATHER, shard, out, out, async_op=async_op, comm=comm,
                   op="sum", scheme=scheme, bits=bits, algorithm=algorithm, seed=seed, step=step,
                   scheme_options=scheme_options, tile_nbytes=tile_nbytes,
                   tiles_in_flight=tiles_in_flight)
