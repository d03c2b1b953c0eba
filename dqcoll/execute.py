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

A call with ``scheme="auto"`` or ``algorithm="auto"`` (:func:`_run_planned`) takes the same steps
and then runs what :mod:`dqcoll.planner` decides for it: a flat schedule, two levels
(:mod:`dqcoll.hierarchical`), or, for ``none`` / ``bf16`` under ``auto`` over a torch process
group, the group's own all-reduce (:func:`_native_allreduce`). Its time is agreed at the
communicator's next planned call (it rides in the argument check) and calibrates the planner.

A failure after the argument check (data moved, or may have) leaves the communicator dead: peers
may be anywhere in the call and its messages may still be in flight (NCCL's rule after an error).

:func:`run` records every call it runs, whatever its outcome, in ``comm.metrics``
(:func:`dqcoll.call_metrics.recording`: the plan from ``comm.last_info``, the wall time, the bytes
sent).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from . import handles, schemes, scratch, validate
from . import planner as planner_mod
from .call_metrics import recording
from .comm import Communicator, get_default_comm
from .context import call_context
from .executor import run_schedule
from .interop import stream_scope
from .levels import run_levels
from .prepare import (
    PreparedCall,
    Request,
    prepare_call,
    scaled,
    shift_for,
    unscale_into,
)
from .schemes.base import SchemeCall
from .topology import algorithms
from .types import Collective, ReduceOp

__all__ = ["launch", "run"]

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
        if request.is_planned:
            _run_planned(request, comm)
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


def _run_planned(request: Request, comm: Communicator) -> None:
    """A call the planner decides (``scheme="auto"`` or ``algorithm="auto"``): prepare, argument
    check (with this rank's time of the communicator's previous planned call riding along, its
    maximum over ranks calibrating the planner), plan, run the plan."""
    call = prepare_call(request, comm)
    extra = [comm.last_plan_us] if comm.validate else None  # DQCOLL_VALIDATE=0: uncalibrated
    exponent = validate.handshake(call, comm, extra)
    try:
        made = comm.planner is None
        probe_start = time.perf_counter()
        plan = _plan(call, comm, request, extra[0] if extra else 0)
        start = time.perf_counter()
        _run_plan(call, comm, plan, exponent)
    except BaseException as exc:
        comm.mark_dead(f"{call.what} failed: {type(exc).__name__}: {exc}")
        raise
    if made and comm.planner is not None:  # made in this call: its probes are not the call's
        comm.last_info["planner_probe"] = {"bytes": comm.planner.probe_nbytes,
                                           "s": start - probe_start}
    if plan is not None:
        comm.last_plan, comm.last_plan_us = plan, int((time.perf_counter() - start) * 1e6)
        comm.last_info["planned"] = plan.as_dict()
        comm.last_info["predicted_us"] = plan.predicted_us


def _plan(call: PreparedCall, comm: Communicator, request: Request, previous_us: int
          ) -> planner_mod.Plan | None:
    """The planner's plan of ``call``, or None where there is nothing to decide (nothing
    moves, or a named scheme over two ranks: one algorithm, no two levels). The planner is made
    at the communicator's first planned call (collective: every rank is here, the argument
    check passed), and first calibrated with the previous planned call's agreed time."""
    tensor, scheme = call.tensor, call.scheme
    assert tensor is not None and scheme is not None
    n = comm.world_size
    if tensor.numel() == 0 or n == 1 or (not call.auto and n <= 2):
        return None
    planner = comm.planner
    if planner is None:
        planner = comm.planner = planner_mod.build_planner(
            comm.transport, comm.device, what=f"{call.what} planner")
    elif comm.last_plan is not None and previous_us > 0:
        planner.observe(comm.last_plan, float(previous_us), comm.last_plan_nbytes)
    nbytes = tensor.numel() * tensor.element_size()
    if call.collective is Collective.ALL_GATHER:
        nbytes *= n  # priced on the gathered buffer
    comm.last_plan_nbytes = nbytes
    return planner.plan(
        call.collective.value, nbytes, str(tensor.dtype).replace("torch.", ""),
        scheme="auto" if call.auto else scheme.spec.name,
        bits=planner_mod.TARGET_BITS if call.target is not None else float(call.bits),
        algorithm=request.algorithm,
        native=(call.collective is Collective.ALLREDUCE
                and hasattr(comm.transport, "native_allreduce")),
        force=comm.auto_force if call.auto else None)


def _run_plan(call: PreparedCall, comm: Communicator, plan: planner_mod.Plan | None,
              exponent: int) -> None:
    """Run ``plan`` (None: the one flat algorithm): the process group's own all-reduce, two
    levels (:mod:`dqcoll.hierarchical`), or a flat schedule of the planned scheme."""
    n = comm.world_size
    if plan is None:
        call.schedule = algorithms.build_schedule(planner_mod.flat_algorithms(n)[0], n)
    elif plan.algorithm == planner_mod.NATIVE:
        _native_allreduce(call, comm, plan.scheme)
        return
    elif plan.levels is not None:
        _run_two_level(call, comm, plan.levels)
        return
    else:
        if call.auto and plan.scheme != "dynamiq":
            call.scheme = schemes.get(plan.scheme)
        call.schedule = algorithms.build_schedule(plan.algorithm, n)
    _execute(call, comm, shift_for(call, n, exponent))


def _run_two_level(call: PreparedCall, comm: Communicator, levels: Any) -> None:
    """A two-level plan over the caller's checked buffers; the level across hosts takes the
    call's scheme options (bits or target) where it runs the call's scheme."""
    assert call.tensor is not None and call.op is not None and call.scheme is not None
    inter = levels.inter
    if inter.scheme == call.scheme.spec.name:
        options = tuple(sorted((k, v) for k, v in call.options.items() if k != "bits"))
        inter = dataclasses.replace(inter, options=options,
                                    bits=float(call.bits) if call.target is None else inter.bits)
        levels = dataclasses.replace(levels, inter=inter)
    comm.last_info = run_levels(
        call.collective, call.tensor, call.out, levels, comm, seed=int(call.seed),
        step=int(call.step), op=call.op.value, launch=launch)


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
