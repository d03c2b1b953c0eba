"""Running one collective: from a :class:`~dqcoll.prepare.Request` to the caller's buffer.

:func:`launch` is what every public collective calls. It runs the call now, in the caller's
stream scope (:func:`dqcoll.interop.stream_scope`: torch's current stream for torch tensors,
CuPy's for CuPy arrays), or with ``async_op=True`` on the communicator's worker, returning a
:class:`~dqcoll.handles.CollectiveHandle` at once (see :mod:`dqcoll.handles`); a synchronous call
first waits for the communicator's pending asynchronous ones. Either way :func:`run` goes down
the steps of the call path in order:

1. :func:`dqcoll.prepare.prepare_call`: the local checks and the resolved scheme, schedule and
   buffers (a failure is recorded, not raised);
2. :func:`dqcoll.validate.handshake`: every rank raises together if any is invalid or they
   disagree, and they agree on the range scaling;
3. :func:`_execute`: the scheme plans the call (statistics, allocation) and
   :func:`dqcoll.executor.run_schedule` runs the schedule, cut into tiles of ``tile_nbytes``
   (default :func:`~dqcoll.executor.default_tile_nbytes`: 4 MiB on CPUs, 64 MiB on CUDA devices)
   with ``tiles_in_flight`` overlapping (the result depends on neither, but all ranks must agree
   on them, so they are part of the argument check). The result is written into the caller's
   buffer last, so an error leaves the input untouched.

``scheme="auto"`` (:func:`_run_auto`, rule in :mod:`dqcoll.auto`) takes the same steps, with the
ranks' predicted times agreed in the argument check, and may run the process group's own
all-reduce (:func:`_native_allreduce`) instead of a schedule.

A failure after the argument check (data moved, or may have) leaves the communicator dead: peers
may be anywhere in the call and its messages may still be in flight (NCCL's rule after an error).

:func:`run` records every call it runs, whatever its outcome, in ``comm.metrics``
(:func:`dqcoll.call_metrics.recording`: the plan from ``comm.last_info``, the wall time, the bytes
sent).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from . import auto as auto_mod
from . import handles, schemes, scratch, validate
from .auto import AutoChoice
from .call_metrics import recording
from .comm import Communicator, get_default_comm
from .context import call_context
from .executor import run_schedule
from .interop import stream_scope
from .prepare import (
    PreparedCall,
    Request,
    choose_algorithm,
    prepare_call,
    scaled,
    shift_for,
    unscale_into,
)
from .schemes.base import SchemeCall
from .topology import algorithms
from .types import Collective, ReduceOp

__all__ = ["launch", "run"]

_MAX_US = 1 << 50  # an "infinite" prediction in the argument check's int64 fields


def launch(request: Request) -> Any:
    """Run one collective now (in the caller's stream scope) or, with ``async_op``, on the
    communicator's worker; returns its result buffer or a handle."""
    comm = request.comm or get_default_comm()
    if request.async_op:
        return handles.submit(comm, lambda: run(request, comm), buf=request.buf,
                              result=request.result,
                              what=f"{request.collective.value} (async_op)")
    handles.drain(comm)
    with stream_scope(request.buf):
        run(request, comm)
    return request.result


def run(request: Request, comm: Communicator) -> None:
    """Prepare, check and run one collective on ``comm``, in the calling thread."""
    with comm.in_flight(request.collective.value), recording(
            comm, request.collective, request.buf, scheme=request.scheme,
            algorithm=request.algorithm, bits=request.bits,
            target=request.scheme_options.get("target_vnmse") is not None):
        if request.is_auto:
            _run_auto(request, comm)
        else:
            _run_checked(request, comm)


def _run_checked(request: Request, comm: Communicator) -> None:
    """A collective with a named (or given) scheme: prepare, argument check, execute."""
    call = prepare_call(request, comm)
    exponent = validate.handshake(call, comm)
    try:
        _execute(call, comm, shift_for(call, comm.world_size, exponent))
    except BaseException as exc:
        # Data moved (or may have): peers may be anywhere in this call, and messages of it may
        # still be in flight. The next call could read them as its own, so the communicator
        # is done for (NCCL's rule after an error, too).
        comm.mark_dead(f"{call.what} failed: {type(exc).__name__}: {exc}")
        raise


def _run_auto(request: Request, comm: Communicator) -> None:
    """``scheme="auto"`` (see :mod:`dqcoll.auto`): the arguments are checked as for
    ``dynamiq`` with its options, the ranks agree on the candidates' predicted times in the same
    check, and every rank runs the candidate the rule picks from those agreed numbers."""
    start = time.perf_counter()
    call = prepare_call(request, comm)
    policy = comm.auto
    ready = policy.ready()
    predicted = (_predicted_us(call, comm) if ready and call.error is None
                 else [0] * len(auto_mod.CANDIDATES))
    extra = [int(policy.last_elapsed_s * 1e6), *predicted, *policy.step_extra()]
    exponent = validate.handshake(call, comm, extra)
    policy.calibrate(extra[0] / 1e6)
    policy.agree_step(extra[-auto_mod.STEP_SLOTS:])
    try:
        if not ready:  # the first auto call: measure the link and the codecs, then agree
            start = _measure_and_agree(call, comm, extra)
        choice = policy.choose({c: extra[1 + i] / 1e6 for i, c in enumerate(auto_mod.CANDIDATES)},
                               measured=not policy.frozen
                               and call.step not in policy.unmeasured_steps)
        _run_choice(call, comm, request, choice, exponent)
    except BaseException as exc:
        comm.mark_dead(f"{call.what} failed: {type(exc).__name__}: {exc}")
        raise
    policy.last_elapsed_s = time.perf_counter() - start
    comm.last_info["scheme"] = choice.scheme
    comm.last_info["auto"] = choice.as_info()


def _budget_bits(call: PreparedCall) -> float:
    """The bits per coordinate ``auto`` prices dynamiq at: ``bits``, or ~8 under a target."""
    return float(call.bits) if call.target is None else auto_mod.TARGET_BITS


def _predicted_us(call: PreparedCall, comm: Communicator) -> list[int]:
    """This rank's predicted time of each candidate (microseconds, capped), in
    :data:`dqcoll.auto.CANDIDATES` order. The codec rates were measured with every rank of the
    machine measuring at once, so they include the sharing of its cores."""
    tensor = call.tensor
    numel = tensor.numel() if tensor is not None else 0
    element_nbytes = tensor.element_size() if tensor is not None else 4
    traffic = 2 if call.collective is Collective.ALLREDUCE else 1  # reduce-scatter: half
    native = (call.collective is Collective.ALLREDUCE
              and hasattr(comm.transport, "native_allreduce"))  # as _run_choice decides
    predicted = comm.auto.predict_s(numel * traffic // 2, element_nbytes, comm.world_size,
                                    _budget_bits(call), 1.0, native=native)
    if element_nbytes == 2:  # a 16-bit buffer: bf16 saves nothing
        predicted["bf16"] = math.inf
    return [min(int(predicted[c] * 1e6), _MAX_US) for c in auto_mod.CANDIDATES]


def _measure_and_agree(call: PreparedCall, comm: Communicator, extra: list[int]) -> float:
    """The first ``auto`` call of a communicator: measure the link and this rank's codecs, then
    agree on the predictions (the slowest rank's, into ``extra``). Returns the time the call's
    own work starts (the calibration leaves the probe out)."""
    policy = comm.auto
    policy.measure_link(comm.transport, what=f"{call.what} link probe")
    policy.measure_codecs(comm.device, _budget_bits(call))
    start = time.perf_counter()
    agreed = torch.tensor(_predicted_us(call, comm), dtype=torch.float64)
    comm.transport.allreduce(agreed, "max", what=f"{call.what} predictions")
    extra[1 : 1 + len(auto_mod.CANDIDATES)] = [int(v) for v in agreed.tolist()]
    return start


def _run_choice(call: PreparedCall, comm: Communicator, request: Request, choice: AutoChoice,
                exponent: int) -> None:
    """Run ``auto``'s choice: ``none`` / ``bf16`` all-reduces over a torch process group as its
    own all-reduce; otherwise the chosen scheme over a schedule (re-chosen for it when the
    caller left ``algorithm="auto"``)."""
    assert call.tensor is not None
    native = (choice.scheme != "dynamiq" and call.collective is Collective.ALLREDUCE
              and hasattr(comm.transport, "native_allreduce") and call.tensor.numel() > 0)
    if native:
        _native_allreduce(call, comm, choice.scheme)
        return
    if choice.scheme != "dynamiq":
        call.scheme = schemes.get(choice.scheme)
    if request.algorithm == "auto":
        call.schedule = algorithms.build_schedule(
            choose_algorithm("auto", comm.world_size, request.buf, call.scheme), comm.world_size)
    _execute(call, comm, shift_for(call, comm.world_size, exponent))


def _native_allreduce(call: PreparedCall, comm: Communicator, scheme: str) -> None:
    """``auto``'s ``none`` / ``bf16`` over a torch process group: the group's own all-reduce,
    what DDP runs without a hook (``avg``: divided by n first, as ``allreduce_hook``), ``bf16``
    cast to bf16 and back around it (torch's ``bf16_compress_hook``)."""
    tensor = call.tensor
    assert tensor is not None and call.op is not None
    n = comm.world_size
    flat = tensor.view(-1)
    work = flat.to(torch.bfloat16) if scheme == "bf16" and flat.element_size() == 4 else flat
    if call.op is ReduceOp.AVG:
        work = work.div_(n) if work is not flat else work.mul_(1.0 / n)
    comm.transport.native_allreduce(work, what=call.what)  # type: ignore[attr-defined]  # checked
    if work is not flat:
        flat.copy_(work)
    comm.last_info = {"scheme": scheme, "algorithm": f"{comm.transport.name} all_reduce",
                      "bits": 8.0 * work.element_size()}


def _execute(call: PreparedCall, comm: Communicator, shift: int) -> None:
    """Run one checked collective over its schedule; write the caller's buffers last.
    ``shift``: the agreed range scaling (:func:`dqcoll.prepare.range_shift`), 0 for none."""
    scheme, schedule, op = call.scheme, call.schedule, call.op
    assert scheme is not None and schedule is not None and op is not None
    comm.last_info = {"scheme": scheme.spec.name, "algorithm": schedule.algorithm}
    x = _codec_input(call, comm)
    if x is None:
        return
    if shift:
        x = scaled(x, shift)
    ctx = call_context(comm.transport, op, call.seed, call.step, call.collective, call.what,
                       schedule, comm.scheme_state, None if shift else call.survey)
    try:
        coded = scheme.begin(x, ctx)
        run_schedule(schedule, coded, comm.transport, what=call.what,
                     collective=call.collective, tile_nbytes=call.tile_nbytes,
                     tiles_in_flight=call.tiles_in_flight)
        _restore(call, comm, coded, shift)
    except BaseException:
        # a receive that failed may still land in its buffer: no later call reuses it
        scratch.discard(comm.scheme_state)
        raise
    release = getattr(coded, "release", None)  # pooled buffers back (dqcoll.scratch)
    if release is not None:
        release()
    comm.last_info.update(coded.info)
    if shift:
        comm.last_info["range_shift"] = shift


def _codec_input(call: PreparedCall, comm: Communicator) -> torch.Tensor | None:
    """The whole buffer the schedule reduces (all-gather: this rank's shard in place among
    zeros), or None where nothing moves (empty, or one rank: the output is the input, written
    here)."""
    assert call.tensor is not None
    flat = call.tensor.view(-1)
    n = comm.world_size
    if flat.numel() == 0 or n == 1:
        if call.collective is not Collective.ALLREDUCE:
            assert call.out is not None
            call.out.view(-1).copy_(flat)
        return None
    if call.collective is not Collective.ALL_GATHER:
        return flat
    x = torch.zeros(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    x.view(n, -1)[comm.rank] = flat
    return x


def _restore(call: PreparedCall, comm: Communicator, coded: SchemeCall, shift: int) -> None:
    """Decode the result into the caller's buffer (reduce-scatter: this rank's shard only),
    unscaled by ``2**shift``."""
    assert call.tensor is not None
    flat = call.tensor.view(-1)
    if call.collective is Collective.ALLREDUCE:
        target = flat
    else:
        assert call.out is not None
        target = call.out.view(-1)
    # A stream-ordered transport (NCCL) returns before the data moved. On a CUDA buffer the final
    # decode is queued on the caller's stream behind the transfers and the call returns without
    # a host wait, as an NCCL collective does: a transfer that fails later (the watchdog's
    # timeout, NCCL's asynchronous error) aborts the communicator, the next call raises, and the
    # buffers hold what the aborted transfers left. A CPU buffer waits (with the timeout) until
    # every transfer completed before anything is written to it, so a failure raises here with
    # the buffers untouched (docs/gpu_transport.md).
    if getattr(comm.transport, "stream_ordered", False) and target.device.type != "cuda":
        comm.transport.synchronize(what=f"{call.what} (last transfers)")  # type: ignore[attr-defined]
    result: torch.Tensor | None = None
    if call.collective is Collective.REDUCE_SCATTER:
        finish_shard = getattr(coded, "finish_shard", None)
        if finish_shard is not None:  # decode this rank's shard only
            result = torch.empty_like(target) if shift else target
            finish_shard(comm.rank, result)
        else:
            full = torch.empty_like(flat)
            coded.finish(full)
            result = full.view(comm.world_size, -1)[comm.rank]
    elif shift:
        result = torch.empty_like(target)
        coded.finish(result)
    else:
        coded.finish(target)
    if shift:
        assert result is not None
        unscale_into(result, shift, target)
    elif result is not None and result is not target:
        target.copy_(result)
