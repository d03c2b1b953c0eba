"""Two-level collectives for a plan the caller gives: all-reduce, reduce-scatter and all-gather in
two levels, each level with its own scheme. They run through :func:`dqcoll.levels.run_levels`,
the package's one two-level implementation, which the executor runs for the planner's two-level
plans too.

The plan is data (:mod:`dqcoll.topology.hierarchical`, which only plans); this module runs it,
beside the executor. Each level is one ordinary collective (a
:class:`~dqcoll.prepare.Request` handed to :func:`dqcoll.execute.launch`, as the public functions
do; only the package's front, the integrations, the command line and the evaluation import
:mod:`dqcoll.api`) over a :class:`~dqcoll.transports.subgroup.SubgroupTransport` view of the
caller's transport: the ranks of one host (``intra``), or the ranks with the same local index on
every host, in host order (``inter``).

**Layout.** Over ``H`` hosts of ``G`` ranks (``n = H x G``), the buffer of ``n`` equal shards
(the reduce-scatter's input, the all-gather's output, the all-reduce's buffer padded with zeros
to ``n`` equal shards) is arranged local-major: part ``j`` of ``G`` holds, in host order, the
shards of the ranks with local index ``j`` (:attr:`HierarchicalPlan.local_major_ranks`). Then

* **reduce-scatter**: a reduce-scatter inside each host leaves local rank ``j`` with the host's
  sum of part ``j``; a reduce-scatter of that part among the ranks of local index ``j`` leaves
  the rank on host ``h`` with piece ``h``, the sum of its own shard;
* **all-reduce**: the same reduce-scatter inside each host, an all-reduce of the part across
  hosts, an all-gather inside each host;
* **all-gather**: an all-gather across hosts (part ``j`` on every rank of local index ``j``),
  then one inside each host. Across first, so each shard crosses the network once, coded by its
  owner; inside first would send every host's ``G`` shards from each of its ranks.

The copy into local-major order (and back) is one row gather of the buffer; it is skipped when
the ranks are numbered local-major already (``host_ranks[h][j] == j x H + h``) and the buffer
needs no padding: the levels then read and write the caller's buffers.

**What follows.** With an exact intra level (``none``), a rank's reduce-scatter output is, bit
for bit, its shard of the all-reduce of the same buffer with the same plan, seed and step, when
the inter scheme's all-reduce uses its reduce-scatter layout (``dynamiq``: ``balance="shards"``;
exact schemes always): both run the same intra reduce-scatter, and a flat reduce-scatter is its
shard of the flat all-reduce on that layout (tests/test_rs_ag.py). With a compressed intra level
the all-reduce's result is that shard coded once more by the intra all-gather.

**Calls.** Every rank of ``comm`` calls with the same plan, sizes and dtype. The call takes one
step of ``comm``'s call counter (``step`` defaults to it) and every level runs with that step
and a seed of its phase derived from the call's seed (0: intra reduce-scatter, 1: across hosts,
2: intra all-gather), the same on every rank. ``op="avg"`` averages at each level, the global
average since every host holds the same number of ranks. Local argument errors (a plan for
another world size, buffer sizes, dtypes) raise on the rank that has them before anything moves;
the levels check the ranks against each other. A level that fails leaves ``comm`` dead
(:class:`~dqcoll.comm.Communicator`): another host may be in another level of the call.
``comm.last_info`` names the plan, the collective and each level's call.

The subgroup communicators are made once per communicator and group and kept while the
communicator lives (their schemes' state and scratch buffers with them).

Rejected: running the plan from :mod:`dqcoll.topology` (it was there): planning then imported the
public API, and ``api -> topology.tuning -> topology.hierarchical -> api`` was a circle.
"""

from __future__ import annotations

from typing import Any

import torch

from .call_metrics import recording
from .comm import Communicator, get_default_comm
from .errors import InvalidArgumentError
from .execute import launch
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
    """All-reduce ``buf`` in place along ``plan``, each level with its own scheme; returns
    ``buf``. Any length; see the module docstring."""
    return run_hierarchical(Collective.ALLREDUCE, buf, None, plan, op=op, comm=comm, seed=seed,
                            step=step)


def hierarchical_reduce_scatter(buf: Any, out: Any, plan: HierarchicalPlan, *, op: str = "sum",
                                comm: Communicator | None = None, seed: int | None = None,
                                step: int | None = None) -> Any:
    """``out`` = this rank's shard (global rank order) of the sum or average of every rank's
    ``buf`` (``n x out.numel()`` elements); returns ``out``."""
    return run_hierarchical(Collective.REDUCE_SCATTER, buf, out, plan, op=op, comm=comm,
                            seed=seed, step=step)


def hierarchical_all_gather(shard: Any, out: Any, plan: HierarchicalPlan, *,
                            comm: Communicator | None = None, seed: int | None = None,
                            step: int | None = None) -> Any:
    """``out`` = every rank's ``shard`` in global rank order, the same on every rank; returns
    ``out``."""
    return run_hierarchical(Collective.ALL_GATHER, shard, out, plan, comm=comm, seed=seed,
                            step=step)


def run_hierarchical(collective: Collective | str, buf: Any, out: Any, plan: HierarchicalPlan,
                     *, op: str = "sum", comm: Communicator | None = None,
                     seed: int | None = None, step: int | None = None) -> Any:
    """Run ``collective`` (``allreduce``: ``out`` is None, ``buf`` is reduced in place;
    ``reduce_scatter``; ``all_gather``) along ``plan``; returns ``buf`` or ``out``.

    ``comm`` is the caller's :class:`~dqcoll.comm.Communicator` (default: the current one); every
    rank of it must call this with the same collective, plan and sizes (module docstring)."""
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
        try:
            comm.last_info = run_levels(kind, tensor, target, plan, comm,
                                        seed=comm.seed if seed is None else int(seed),
                                        step=call_step if step is None else int(step), op=op,
                                        launch=launch)
        except BaseException as exc:  # a level failed, another host may be in another level
            comm.mark_dead(f"{what} failed: {type(exc).__name__}: {exc}")
            raise
    return buf if kind is Collective.ALLREDUCE else out


def _check(kind: Collective, buf: Any, out: Any, plan: HierarchicalPlan, comm: Communicator,
           what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's arguments as torch views; raises :class:`InvalidArgumentError` naming the
    rank and the call."""
    n = comm.world_size
    if n != plan.world_size:
        raise InvalidArgumentError(
            f"rank {comm.rank}: {what}: the plan is for {plan.world_size} ranks "
            f"({plan.nodes} hosts x {plan.gpus_per_node}), the communicator has {n}")
    tensor = inspect_buffer(buf, "buf", comm)
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"rank {comm.rank}: {what}: buf is not contiguous (strides "
                                   f"{tensor.stride()})")
    if kind is Collective.ALLREDUCE:
        if out is not None:
            raise InvalidArgumentError(f"rank {comm.rank}: {what}: an all-reduce is in place; "
                                       f"out must be None")
        return tensor, None
    target = inspect_buffer(out, "out", comm)
    if kind is Collective.REDUCE_SCATTER:
        expected, rule = n * target.numel(), "buf.numel() == world_size x out.numel()"
        got = tensor.numel()
    else:
        expected, rule = n * tensor.numel(), "out.numel() == world_size x shard.numel()"
        got = target.numel()
    problem = None
    if got != expected:
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


