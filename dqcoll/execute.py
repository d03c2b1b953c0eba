"""Running one collective: from a :class:`~dqcoll.prepare.Request` to the caller's buffer.

The steps (prepare, argument check, the scheme's call or the planner's plan, the buffer written
last) are docs/design.md §2 and §8. A failure after the argument check leaves the communicator dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
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
    """Run one collective now or, with ``async_op``, on the worker; returns its result or handle."""
    comm = request.comm or get_default_comm()
    if request.async_op:
        return handles.submit(comm, lambda: run(request, comm), buf=request.buf,
                              result=request.result, what=f"{request.collective.value} (async_op)")
    handles.drain(comm)
    with stream_scope(request.buf):
        run(request, comm)
    return request.result


def run(request: Request, comm: Communicator) -> None:
    """Prepare, check and run one collective on ``comm``, in the calling thread."""
    plan = request.plan
    with comm.in_flight(request.collective.value), recording(
            comm, request.collective, request.buf,
            scheme=request.scheme if plan is None else "hierarchical",
            algorithm=str(request.algorithm if plan is None else plan.name), bits=request.bits,
            target=request.scheme_options.get("target_vnmse") is not None):
        call = prepare_call(request, comm)
        if plan is not None:  # the caller's two levels, as given; local errors raise here
            if call.error is not None:
                raise call.error
            with dead_on_failure(comm, call.what):
                _run_levels(call, comm, plan)
            return
        if request.is_planned:
            _run_planned(call, comm, request)
            return
        exponent = validate.handshake(call, comm)
        with dead_on_failure(comm, call.what):
            _execute(call, comm, shift_for(call, comm.world_size, exponent))


@contextlib.contextmanager
def dead_on_failure(comm: Communicator, what: str) -> Iterator[None]:
    """A failure inside marks ``comm`` dead: messages of the call may still be in flight, and
    the next call could read them as its own."""
    try:
        yield
    except BaseException as exc:
        comm.mark_dead(f"{what} failed: {type(exc).__name__}: {exc}")
        raise


def _run_planned(call: PreparedCall, comm: Communicator, request: Request) -> None:
    """A planned call: argument check (carrying this rank's time of the previous planned call,
    whose maximum calibrates the planner), plan, run the plan."""
    extra = [comm.last_plan_us] if comm.validate else None  # DQCOLL_VALIDATE=0: uncalibrated
    exponent = validate.handshake(call, comm, extra)
    with dead_on_failure(comm, call.what):
        made = comm.planner is None
        probe_start = time.perf_counter()
        plan = _plan(call, comm, request, extra[0] if extra else 0)
        start = time.perf_counter()
        _run_plan(call, comm, plan, exponent)
    if made and comm.planner is not None:  # made in this call: its probes are not the call's
        comm.last_info["planner_probe"] = {"bytes": comm.planner.probe_nbytes,
                                           "s": start - probe_start}
    if plan is not None:
        comm.last_plan, comm.last_plan_us = plan, int((time.perf_counter() - start) * 1e6)
        comm.last_info["planned"] = plan.as_dict()
        comm.last_info["predicted_us"] = plan.predicted_us


def _plan(call: PreparedCall, comm: Communicator, request: Request, previous_us: int
          ) -> planner_mod.Plan | None:
    """The planner's plan of ``call``, or None where there is nothing to decide (nothing moves,
    or a named scheme over two ranks). Makes the planner at the first planned call (collective)."""
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
    gathered = n if call.collective is Collective.ALL_GATHER else 1  # priced on the gathered buffer
    nbytes = comm.last_plan_nbytes = tensor.numel() * tensor.element_size() * gathered
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
    """Run ``plan`` (None: the one flat algorithm): native, two levels or a flat schedule."""
    n = comm.world_size
    if plan is not None and plan.algorithm == planner_mod.NATIVE:
        _native_allreduce(call, comm, plan.scheme)
    elif plan is not None and plan.levels is not None:
        _run_two_level(call, comm, plan.levels)
    else:
        if plan is not None and call.auto and plan.scheme != "dynamiq":
            call.scheme = schemes.get(plan.scheme)
        algorithm = planner_mod.flat_algorithms(n)[0] if plan is None else plan.algorithm
        call.schedule = algorithms.build_schedule(algorithm, n)
        _execute(call, comm, shift_for(call, n, exponent))


def _run_two_level(call: PreparedCall, comm: Communicator, levels: Any) -> None:
    """A two-level plan; an inter level that runs the call's scheme takes the call's options."""
    assert call.tensor is not None and call.op is not None and call.scheme is not None
    inter = levels.inter
    if inter.scheme == call.scheme.spec.name:
        options = tuple(sorted((k, v) for k, v in call.options.items() if k != "bits"))
        inter = dataclasses.replace(inter, options=options,
                                    bits=float(call.bits) if call.target is None else inter.bits)
        levels = dataclasses.replace(levels, inter=inter)
    _run_levels(call, comm, levels)


def _run_levels(call: PreparedCall, comm: Communicator, levels: Any) -> None:
    assert call.tensor is not None and call.op is not None
    comm.last_info = run_levels(
        call.collective, call.tensor, call.out, levels, comm, seed=int(call.seed),
        step=int(call.step), op=call.op.value, launch=launch)


def _native_allreduce(call: PreparedCall, comm: Communicator, scheme: str) -> None:
    """``auto``'s ``none`` / ``bf16``: the group's own all-reduce, as torch's DDP hooks run it."""
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
    """Run one checked collective (``shift``: the agreed range scaling); write the buffers last."""
    scheme, schedule, op = call.scheme, call.schedule, call.op
    assert scheme is not None and schedule is not None and op is not None
    comm.last_info = {"scheme": scheme.spec.name, "algorithm": schedule.algorithm}
    x = _codec_input(call, comm)
    if x is None:
        return
    if shift:
        x = scaled(x, shift)
    # the codec may reduce in its input where that is no caller's buffer (an all-gather's is
    # made here; a two-level plan's levels run on its scratch)
    own = call.scratch_buffers or call.collective is Collective.ALL_GATHER
    ctx = call_context(comm.transport, op, call.seed, call.step, call.collective, call.what,
                       schedule, comm.scheme_state, None if shift else call.survey, own)
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
    scratch.release(comm.scheme_state)  # the call's pooled buffers back, whoever took them
    comm.last_info.update(coded.info)
    if shift:
        comm.last_info["range_shift"] = shift


def _codec_input(call: PreparedCall, comm: Communicator) -> torch.Tensor | None:
    """The buffer the schedule reduces (all-gather: this rank's shard among zeros), or None where
    nothing moves (empty, or one rank: the output, written here, is the input)."""
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
    out = call.out
    assert out is not None
    if call.scratch_buffers and out.is_contiguous() and out.dtype == flat.dtype:
        x = out.view(-1)  # the library's own output buffer: gathered in place
        rows = x.view(n, -1)
        rows[: comm.rank].zero_()
        rows[comm.rank + 1 :].zero_()
    else:
        pool = scratch.pool_for(comm.scheme_state, flat.device)
        if pool is None:
            x = torch.zeros(n * flat.numel(), dtype=flat.dtype, device=flat.device)
        else:  # reused from call to call: no page faults (released at the call's end)
            x = pool.take(n * flat.numel() * flat.element_size()).view(flat.dtype).zero_()
    x.view(n, -1)[comm.rank] = flat
    return x


def _restore(call: PreparedCall, comm: Communicator, coded: SchemeCall, shift: int) -> None:
    """Decode the result into the caller's buffer (reduce-scatter: its shard), unscaled."""
    assert call.tensor is not None
    flat = call.tensor.view(-1)
    out = flat if call.collective is Collective.ALLREDUCE else call.out
    assert out is not None
    target = out.view(-1)
    # Stream-ordered (NCCL): a CUDA buffer's decode queues behind the transfers without a host
    # wait; a CPU buffer waits first, so a failure leaves it untouched (docs/gpu_transport.md).
    if getattr(comm.transport, "stream_ordered", False) and target.device.type != "cuda":
        comm.transport.synchronize(what=f"{call.what} (last transfers)")  # type: ignore[attr-defined]
    finish_shard = getattr(coded, "finish_shard", None)
    if call.collective is Collective.REDUCE_SCATTER and finish_shard is None:
        full = torch.empty_like(flat)
        coded.finish(full)
        result = full.view(comm.world_size, -1)[comm.rank]
    else:
        result = torch.empty_like(target) if shift else target
        if finish_shard is not None and call.collective is Collective.REDUCE_SCATTER:
            finish_shard(comm.rank, result)  # decode this rank's shard only
        else:
            coded.finish(result)
    if shift:
        unscale_into(result, shift, target)
    elif result is not target:
        target.copy_(result)
