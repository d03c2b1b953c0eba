"""Two-level collectives for a plan the caller gives (:func:`run_hierarchical` and its three
wrappers), each level with its own scheme, run by :func:`dqcoll.levels.run_levels`; levels, layout
and phases: docs/topology.md §2. Every rank of ``comm`` calls with the same plan, sizes and dtype;
local argument errors raise before anything moves; a failed level leaves ``comm`` dead.
"""

from __future__ import annotations

from typing import Any

import torch

from .call_metrics import recording
from .comm import Communicator, get_default_comm
from .errors import InvalidArgumentError
from .execute import dead_on_failure, launch
from .levels import run_levels
from .prepare import inspect_buffer
from .topology.hierarchical import HierarchicalPlan
from .types import Collective

__all__ = [
    "hierarchical_all_gather",
    "hierarchical_allreduce",
    "hierarchical_reduce_scatter",
    "run_hierarchical",
]

def hierarchical_allreduce(buf: Any, plan: HierarchicalPlan, *, op: str = "sum",
                           comm: Communicator | None = None, seed: int | None = None,
                           step: int | None = None) -> Any:
    """All-reduce ``buf`` in place along ``plan``; returns ``buf``. Any length."""
    return run_hierarchical(Collective.ALLREDUCE, buf, None, plan, op=op, comm=comm, seed=seed,
                            step=step)


def hierarchical_reduce_scatter(buf: Any, out: Any, plan: HierarchicalPlan, *, op: str = "sum",
                                comm: Communicator | None = None, seed: int | None = None,
                                step: int | None = None) -> Any:
    """``out`` = this rank's shard of the reduced ``buf`` (``n x out.numel()``); returns ``out``."""
    return run_hierarchical(Collective.REDUCE_SCATTER, buf, out, plan, op=op, comm=comm,
                            seed=seed, step=step)


def hierarchical_all_gather(shard: Any, out: Any, plan: HierarchicalPlan, *,
                            comm: Communicator | None = None, seed: int | None = None,
                            step: int | None = None) -> Any:
    """``out`` = every rank's ``shard`` in global rank order; returns ``out``."""
    return run_hierarchical(Collective.ALL_GATHER, shard, out, plan, comm=comm, seed=seed,
                            step=step)


def run_hierarchical(collective: Collective | str, buf: Any, out: Any, plan: HierarchicalPlan,
                     *, op: str = "sum", comm: Communicator | None = None,
                     seed: int | None = None, step: int | None = None) -> Any:
    """Run ``collective`` along ``plan`` (``allreduce``: in place, ``out`` None); returns ``buf``
    or ``out``. Every rank of ``comm`` (default: the current one) calls it alike."""
    comm = comm or get_default_comm()
    try:
        kind = Collective(collective)
    except ValueError:
        raise InvalidArgumentError(
            f"rank {comm.rank}: collective must be one of {[c.value for c in Collective]}, got "
            f"{collective!r}") from None
    with comm.in_flight(f"hierarchical {kind.value}"), recording(
            comm, kind, buf, scheme="hierarchical", algorithm=plan.name):
        call_step = comm.next_step()
        what = f"hierarchical {kind.value}#{call_step}"
        tensor, target = _check(kind, buf, out, plan, comm, what)
        with dead_on_failure(comm, what):  # another host may be in another level
            comm.last_info = run_levels(kind, tensor, target, plan, comm,
                                        seed=comm.seed if seed is None else int(seed),
                                        step=call_step if step is None else int(step), op=op,
                                        launch=launch)
    return buf if kind is Collective.ALLREDUCE else out


def _check(kind: Collective, buf: Any, out: Any, plan: HierarchicalPlan, comm: Communicator,
           what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's arguments as torch views, or :class:`InvalidArgumentError`."""
    n = comm.world_size
    if n != plan.world_size:
        raise InvalidArgumentError(
            f"rank {comm.rank}: {what}: the plan is for {plan.world_size} ranks "
            f"({plan.nodes} hosts x {plan.gpus_per_node}), the communicator has {n}")
    tensor = inspect_buffer(buf, "buf", comm)
    target = None if kind is Collective.ALLREDUCE else inspect_buffer(out, "out", comm)
    scatter = kind is Collective.REDUCE_SCATTER
    problem = None
    if not tensor.is_contiguous():
        problem = f"buf is not contiguous (strides {tensor.stride()})"
    elif target is None:
        problem = None if out is None else "an all-reduce is in place; out must be None"
    elif (tensor if scatter else target).numel() != n * (target if scatter else tensor).numel():
        rule = ("buf.numel() == world_size x out.numel()" if scatter
                else "out.numel() == world_size x shard.numel()")
        problem = (f"needs {rule}: buf has {tensor.numel()} elements, out {target.numel()}, "
                   f"world size {n}")
    elif target.dtype != tensor.dtype or target.device != tensor.device:
        problem = (f"out ({target.dtype}, {target.device}) differs from buf ({tensor.dtype}, "
                   f"{tensor.device})")
    elif not target.is_contiguous():
        problem = f"out is not contiguous (strides {target.stride()})"
    if problem is not None:
        raise InvalidArgumentError(f"rank {comm.rank}: {what}: {problem}")
    return tensor, target
