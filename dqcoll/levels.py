"""The levels of a two-level plan, run on checked buffers: :func:`run_levels`, the package's one
two-level implementation, for the planner's plans and the callers' (``algorithm=plan``), both
run by :mod:`dqcoll.execute`; layout and phases: docs/topology.md §2. Each level is an ordinary
:class:`~dqcoll.prepare.Request` (the call's step, a seed per phase) over a subgroup view of the
caller's transport, handed to the caller's ``launch``, so this module imports neither the executor
nor the public API.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from . import scratch
from .comm import Communicator
from .prepare import Request
from .topology.hierarchical import HierarchicalPlan
from .transports.subgroup import SubgroupTransport
from .types import Collective

__all__ = ["ACROSS", "INTRA_GATHER", "INTRA_REDUCE", "run_levels"]

# Phases (their seeds): the intra reduce-scatter, the level across hosts, the intra all-gather.
INTRA_REDUCE, ACROSS, INTRA_GATHER = 0, 1, 2


def _phase_seed(seed: int, phase: int) -> int:
    # Separate random streams for the three phases; 62 bits like the API's fingerprint.
    return (seed ^ (0x9E3779B97F4A7C15 * phase)) & ((1 << 62) - 1)


def run_levels(kind: Collective, tensor: torch.Tensor, target: torch.Tensor | None,
               plan: HierarchicalPlan, comm: Communicator, *, seed: int, step: int,
               op: str, launch: Callable[[Request], Any]) -> dict[str, Any]:
    """Run ``plan``'s levels on checked buffers, each request through ``launch``; returns the
    call's ``last_info`` (``target``: a reduce-scatter's or all-gather's output)."""
    run = _Run(plan, comm, tensor.device, seed=seed, step=step, op=op, launch=launch)
    try:
        if kind is Collective.ALLREDUCE:
            run.allreduce(tensor.view(-1))
        else:
            assert target is not None
            levels = run.reduce_scatter if kind is Collective.REDUCE_SCATTER else run.all_gather
            levels(tensor.view(-1), target.view(-1))
    except BaseException:
        scratch.discard(comm.scheme_state)  # a level's receive may still land in a buffer
        raise
    scratch.release(comm.scheme_state)
    return run.info(kind)


# -- the subgroup communicators, kept per communicator -------------------------------------------

_groups: weakref.WeakKeyDictionary[Communicator, dict[tuple[int, ...], Communicator]] = (
    weakref.WeakKeyDictionary())
_groups_lock = threading.Lock()


def _subgroup(comm: Communicator, ranks: tuple[int, ...]) -> Communicator:
    """The communicator of ``ranks`` over ``comm``'s transport, kept; its members issue the same
    calls on it in the same order, so its call counters agree."""
    with _groups_lock:
        kept = _groups.setdefault(comm, {})
        sub = kept.get(ranks)
        if sub is None or sub.dead is not None or sub.closed:
            sub = kept[ranks] = Communicator(SubgroupTransport(comm.transport, ranks),
                                             seed=comm.seed, device=comm.device)
        return sub


@functools.lru_cache(maxsize=64)
def _order_index(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``order`` as an index tensor on ``device``, made once (read only by the row gathers)."""
    return torch.tensor(order, dtype=torch.int64).to(device)


class _Run:
    """One call of a plan on one rank: its levels' communicators, seeds and calls."""

    def __init__(self, plan: HierarchicalPlan, comm: Communicator, device: torch.device, *,
                 seed: int, step: int, op: str, launch: Callable[[Request], Any]) -> None:
        self.plan, self.seed, self.step, self.op, self.launch = plan, seed, step, op, launch
        self.n, self.hosts = plan.world_size, plan.nodes
        self.intra = _subgroup(comm, plan.intra_group(comm.rank))
        self.inter = _subgroup(comm, plan.inter_group(comm.rank))
        order = plan.local_major_ranks
        # the row index of local-major order; None: no reordering
        self.index = None if order == tuple(range(self.n)) else _order_index(order, device)
        self.phases: list[dict[str, Any]] = []
        # the reordered buffer and the level across hosts' part, reused from call to call
        self.pool = scratch.pool_for(comm.scheme_state, device)
        self._own: set[int] = set()  # addresses of the buffers made by this call

    def _empty(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """An uninitialised buffer of ``numel`` elements of ``like``'s dtype, for this call."""
        if self.pool is None:
            made = like.new_empty(numel)
        else:
            made = self.pool.take(numel * like.element_size()).view(like.dtype)
        self._own.add(made.data_ptr())
        return made

    def _level(self, collective: Collective, buf: torch.Tensor, out: torch.Tensor | None,
               phase: int) -> None:
        """One level's collective (phase ACROSS: inter-host), a request over its communicator."""
        level, spec, comm = (("inter", self.plan.inter, self.inter) if phase == ACROSS
                             else ("intra", self.plan.intra, self.intra))
        options = dict(spec.options)
        bits = None if "target_vnmse" in options else spec.bits
        # a level may reduce in its input (gather in its output) where that is this call's own
        written = out if collective is Collective.ALL_GATHER else buf
        assert written is not None
        self.launch(Request(collective, buf, out, op=self.op, scheme=spec.scheme, bits=bits,
                       algorithm=spec.algorithm, comm=comm, seed=_phase_seed(self.seed, phase),
                       step=self.step, scheme_options=options,
                       scratch_buffers=written.data_ptr() in self._own))
        self.phases.append({**comm.last_info, "level": level, "collective": collective.value})

    def _to_local_major(self, flat: torch.Tensor, shard: int) -> torch.Tensor:
        """``flat`` (at most ``n x shard`` elements, global rank order) as a new buffer of
        ``n x shard`` in local-major order, zero-padded; ``flat`` itself where nothing moves."""
        if flat.numel() < self.n * shard:
            padded = self._empty(flat, self.n * shard)
            padded[flat.numel():].zero_()
            padded[: flat.numel()].copy_(flat)
            flat = padded
        if self.index is None:
            return flat
        work = self._empty(flat, self.n * shard)
        torch.index_select(flat.view(self.n, shard), 0, self.index, out=work.view(self.n, shard))
        return work

    def _from_local_major(self, work: torch.Tensor, flat: torch.Tensor, shard: int) -> None:
        """Write ``work`` (local-major) into ``flat`` in global rank order, cut to its length."""
        if work is flat:
            return
        if self.index is not None:
            rows = work.view(self.n, shard)
            if flat.numel() == work.numel():
                flat.view(self.n, shard).index_copy_(0, self.index, rows)
                return
            ordered = self._empty(work, work.numel()).view(self.n, shard)
            work = ordered.index_copy_(0, self.index, rows).view(-1)
        flat.copy_(work[: flat.numel()])

    def allreduce(self, flat: torch.Tensor) -> None:
        shard = -(-flat.numel() // self.n)
        work = self._to_local_major(flat, shard)
        part = self._empty(flat, self.hosts * shard)
        self._level(Collective.REDUCE_SCATTER, work, part, INTRA_REDUCE)
        self._level(Collective.ALLREDUCE, part, None, ACROSS)
        self._level(Collective.ALL_GATHER, part, work, INTRA_GATHER)
        self._from_local_major(work, flat, shard)

    def reduce_scatter(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        shard = out.numel()
        work = self._to_local_major(flat, shard)
        part = self._empty(flat, self.hosts * shard)
        self._level(Collective.REDUCE_SCATTER, work, part, INTRA_REDUCE)
        self._level(Collective.REDUCE_SCATTER, part, out, ACROSS)

    def all_gather(self, flat: torch.Tensor, out: torch.Tensor) -> None:
        shard = flat.numel()
        part = self._empty(flat, self.hosts * shard)
        work = out if self.index is None else self._empty(out, out.numel())
        # across hosts first: each shard crosses the network once
        self._level(Collective.ALL_GATHER, flat, part, ACROSS)
        self._level(Collective.ALL_GATHER, part, work, INTRA_GATHER)
        self._from_local_major(work, out, shard)

    def info(self, kind: Collective) -> dict[str, Any]:
        """``comm.last_info`` of the call: plan, collective, each level's first call, all phases."""
        first = {level: next(p for p in self.phases if p["level"] == level)
                 for level in ("intra", "inter")}
        return {"algorithm": self.plan.name, "collective": kind.value, "hierarchical": True,
                **first, "phases": list(self.phases)}
