"""Runs a :class:`~dqcoll.topology.hierarchical.HierarchicalPlan`: one all-reduce as three
ordinary collectives, each level with its own scheme.

The plan is data (:mod:`dqcoll.topology.hierarchical`, which only plans); this module runs it,
beside the executor: a reduce-scatter inside each host, an all-reduce across hosts among the
ranks of the same local index, an all-gather inside each host, each over a
:class:`~dqcoll.transports.subgroup.SubgroupTransport` view of the caller's transport.

Each level is one ordinary collective handed to :func:`dqcoll.execute.launch`, as the public
functions do (only the package's front, the integrations, the command line and the evaluation
import :mod:`dqcoll.api`).

Rejected: running the plan from :mod:`dqcoll.topology` (it was there): planning then imported the
public API, and ``api -> topology.tuning -> topology.hierarchical -> api`` was a circle.
"""

from __future__ import annotations

from typing import Any

import torch

from .comm import Communicator, get_default_comm
from .errors import InvalidArgumentError
from .execute import launch
from .interop import as_torch_view
from .prepare import Request
from .topology.hierarchical import HierarchicalPlan
from .transports.subgroup import SubgroupTransport
from .types import Collective

__all__ = ["hierarchical_allreduce"]


def _phase_seed(seed: int, phase: int) -> int:
    # Separate random streams for the three phases; 62 bits like the API's fingerprint.
    return (seed ^ (0x9E3779B97F4A7C15 * phase)) & ((1 << 62) - 1)


def hierarchical_allreduce(
    buf: Any,
    plan: HierarchicalPlan,
    *,
    op: str = "sum",
    comm: Any = None,
    seed: int | None = None,
    step: int | None = None,
) -> Any:
    """All-reduce ``buf`` in place along ``plan``, each level with its own scheme; returns ``buf``.

    ``comm`` is the caller's :class:`~dqcoll.comm.Communicator` (default: the current one); every
    rank of it must call this with the same plan. ``op="avg"`` averages at each level, which
    gives the global average since every host holds the same number of ranks.
    """
    comm = comm or get_default_comm()
    with comm.in_flight("hierarchical allreduce"):
        return _run_levels(buf, plan, comm, op=op, seed=seed, step=step)


def _run_levels(buf: Any, plan: HierarchicalPlan, comm: Communicator, *, op: str,
                seed: int | None, step: int | None) -> Any:
    if comm.world_size != plan.world_size:
        raise InvalidArgumentError(
            f"plan is for {plan.world_size} ranks, communicator has {comm.world_size}")
    call_step = comm.next_step()
    step = call_step if step is None else int(step)
    seed = comm.seed if seed is None else int(seed)
    tensor = as_torch_view(buf)
    flat = tensor.view(-1)
    g = plan.gpus_per_node
    numel = flat.numel()
    if numel == 0 or comm.world_size == 1:
        return buf
    shard_numel = -(-numel // g)
    padded = torch.zeros(g * shard_numel, dtype=flat.dtype, device=flat.device)
    padded[:numel] = flat
    intra = Communicator(SubgroupTransport(comm.transport, plan.intra_group(comm.rank)),
                         device=comm.device)
    inter = Communicator(SubgroupTransport(comm.transport, plan.inter_group(comm.rank)),
                         device=comm.device)
    shard = torch.empty(shard_numel, dtype=flat.dtype, device=flat.device)
    try:
        _levels(padded, shard, plan, intra, inter, op=op, seed=seed, step=step)
    except BaseException as exc:  # a level failed after data moved: see Communicator
        comm.mark_dead(f"hierarchical allreduce#{call_step} failed: {type(exc).__name__}: {exc}")
        raise
    flat.copy_(padded[:numel])
    comm.last_info = {"algorithm": plan.name, "intra": dict(intra.last_info),
                      "inter": dict(inter.last_info)}
    return buf


def _levels(padded: torch.Tensor, shard: torch.Tensor, plan: HierarchicalPlan,
            intra: Communicator, inter: Communicator, *, op: str, seed: int, step: int) -> None:
    lo, hi = plan.intra, plan.inter
    launch(Request(Collective.REDUCE_SCATTER, padded, shard, op=op, scheme=lo.scheme,
                   bits=lo.bits, algorithm=lo.algorithm, comm=intra, seed=_phase_seed(seed, 0),
                   step=step, scheme_options=dict(lo.options)))
    launch(Request(Collective.ALLREDUCE, shard, None, op=op, scheme=hi.scheme, bits=hi.bits,
                   algorithm=hi.algorithm, comm=inter, seed=_phase_seed(seed, 1), step=step,
                   scheme_options=dict(hi.options)))
    launch(Request(Collective.ALL_GATHER, shard, padded, scheme=lo.scheme, bits=lo.bits,
                   algorithm=lo.algorithm, comm=intra, seed=_phase_seed(seed, 2), step=step,
                   scheme_options=dict(lo.options)))
