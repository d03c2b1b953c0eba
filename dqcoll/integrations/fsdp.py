"""FSDP2 with dqcoll's collectives: quantized weights' all-gather and gradients' reduce-scatter.

```python
from torch.distributed.fsdp import fully_shard
from dqcoll.integrations import fsdp as dqfsdp

for block in model.blocks:
    fully_shard(block)
fully_shard(model)
state = dqfsdp.compress(model)  # or compress(model, CompressionPolicy(...)); DQCOLL_POLICY
...
print(state.summary())           # bytes per role, against the exact collectives'
```

:func:`compress` sets a :class:`ReduceScatter` and an :class:`AllGather` (the classes of
``torch.distributed.fsdp._fully_shard._fsdp_api``) on every ``fully_shard`` module of a model.
FSDP2 calls them as it calls its own (``_fsdp_collectives.foreach_all_gather`` and
``foreach_reduce``):

* **All-gather** (``__call__(output_tensor, input_tensor, group, async_op)``): the flat
  concatenation of the module's parameter shards (padded by FSDP2 to equal sizes) into one
  output of ``world_size x`` that size. Compressed with the policy's ``weights`` rule (default
  ``int8_block``, ZeRO++'s qwZ): every rank decodes every shard from the same bytes, its own
  too, so all ranks compute with identical unsharded weights while the optimizer keeps updating
  the exact sharded ones. The call always returns a Work, also when FSDP2 passes
  ``async_op=False``: FSDP2 waits on any Work it gets back before its copy-out
  (``foreach_all_gather_copy_out``), so prefetched all-gathers (implicit backward prefetch,
  ``set_modules_to_forward_prefetch``) run on the lane's thread while the ranks compute.
* **Reduce-scatter** (``__call__(output_tensor, input_tensor, group, op, async_op)``): FSDP2
  calls it synchronously (no ``async_op``) on its reduce-scatter stream and reads the output
  at once (post-divide, gradient views, accumulation), so the call returns after the result is
  in ``output_tensor`` (CUDA: after the lane queued its work and FSDP2's current stream was
  made to wait for it, as with NCCL). ``op`` is SUM, AVG (FSDP2's default for fp32 and bf16), or
  PREMUL_SUM(f) (after ``set_gradient_divide_factor``; the input is multiplied by ``f`` and
  summed). Compressed with the ``gradients`` rule (default ``dynamiq`` at 5 bits); every rank
  holds its own shard, and each shard is decoded from the same bytes wherever it is used.
* **Exact path**: a role set to ``none``, calls below ``policy.min_nbytes``, other dtypes or ops,
  and the first ``policy.warmup_steps`` steps run FSDP2's own collectives on FSDP2's group
  (``dist.all_gather_single`` / ``dist.reduce_scatter_single`` where torch has them, from
  2.12; ``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` before, as FSDP2 of
  that torch calls): bit for bit FSDP2 without dqcoll. The step counter advances at each
  forward of the model passed to :func:`compress` (a forward pre-hook), on every rank alike.
* **Agreed inputs**: which path a call takes depends on the policy (``min_nbytes``,
  ``warmup_steps``, the roles' schemes), the node layout and, for CUDA tensors, whether a CUDA
  lane can run here; the ranks of a group agree on them through the job's store at the group's
  first call (:meth:`FsdpCompression.agree`), or all raise
  :class:`~dqcoll.errors.MismatchError` naming each rank's value, instead of taking different
  paths and waiting for each other until the timeout. The step counts forwards, each of which
  runs FSDP2's all-gathers on every rank of the group.

The compressed calls of one FSDP2 group run on one :class:`~dqcoll.integrations.lane.Lane` per
device type (its own connection and worker thread; see there), created at the group's first
compressed call on that device type, when every rank of the group makes the same call. CPU
tensors go over a gloo connection; CUDA tensors over an NCCL communicator of dqcoll's own NCCL
transport, with the codecs' GPU kernels, under the same policy. Where no NCCL transport can run
(neither nccl4py nor CuPy's NCCL importable, or torch sees no GPU), CUDA calls take the exact
path and one WARNING says why; every rank of a job is expected to have the same packages, so
all decide alike.

Rejected: returning from the reduce-scatter on CPU before its result is there (to overlap it
with the rest of backward). FSDP2 reads the output right after the call, and on CPU no stream
orders anything; a deferred result would be read half-written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_api

from .. import agreement, envs
from ..errors import InvalidArgumentError
from .lane import (
    Lane,
    RoleCounters,
    exact_nbytes,
    nccl_lane_unavailable_reason,
    policy_settings,
)
from .policy import CompressionPolicy, Decision, Role

__all__ = ["AllGather", "FsdpCompression", "ReduceScatter", "compress", "exact_all_gather",
           "exact_reduce_scatter"]

log = logging.getLogger("dqcoll.fsdp")


# The exact collectives FSDP2 itself calls: torch >= 2.12 names them *_single (its older names
# warn there); older torch has only all_gather_into_tensor / reduce_scatter_tensor. The
# arguments are the same: (output, input, [op,] group, async_op).
exact_all_gather: Callable[..., dist.Work | None] = getattr(
    dist, "all_gather_single", None) or dist.all_gather_into_tensor
exact_reduce_scatter: Callable[..., dist.Work | None] = getattr(
    dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _allocate(size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device=device)


def _op_kind(op: Any) -> tuple[str, float]:
    """("sum" | "avg" | "premul" | "other", pre-multiplication factor) of a torch reduce op."""
    kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType in .op
    if kind == dist.ReduceOp.SUM:
        return "sum", 1.0
    if kind == dist.ReduceOp.AVG:
        return "avg", 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if factor is None:  # torch < 2.12 has no .factor; its pickled state is (op, factor)
            try:
                state = op.__getstate__()
            except Exception:  # a factor torch does not expose: the exact path
                state = None
            factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
        if isinstance(factor, (int, float)):
            return "premul", float(factor)
    return "other", 1.0


class FsdpCompression:
    """What :func:`compress` set up: the policy, the step counter, one lane per group and
    device type.

    ``summary()`` gives the counters of every lane (compressed calls) and of the exact calls.
    """

    instances = 0  # made so far in this process

    def __init__(self, policy: CompressionPolicy, *, timeout_s: float | None = None) -> None:
        # -- what to compress --
        policy.refuse_hook_only("FSDP2 compression")
        self.policy = policy
        # -- when: the current step (forwards of the model passed to compress, from 0) --
        self.forwards = 0
        self.step = 0
        # -- where: one lane per FSDP2 process group and device type, made at its first
        # compressed call; why CUDA calls cannot have one here (None: they can), asked once --
        self.timeout_s = envs.timeout_s() if timeout_s is None else float(timeout_s)
        self.lanes: dict[tuple[str, str], Lane] = {}
        self._cuda_checked = False
        self._no_cuda_lane: str | None = None
        # the lanes' store prefix: compress() runs in the same order on every rank
        FsdpCompression.instances += 1
        self.instance = FsdpCompression.instances
        # -- what went the exact way: role -> calls, and the bytes a bandwidth-optimal exact
        # collective sends per rank for them (lane.exact_nbytes) --
        self.exact_calls = {role: 0 for role in Role}
        self.exact_bytes = {role: 0 for role in Role}
        self._logged: set[str] = set()
        self._agreed: set[tuple[str, str]] = set()  # (group, device type) whose ranks agreed

    def decide(self, role: Role, tensor: torch.Tensor, group: dist.ProcessGroup,
               op_ok: bool = True) -> Decision:
        """``tensor``: the full buffer (all-gather output, reduce-scatter input). The first
        call of a group on a device type first agrees the decision's inputs (:meth:`agree`)."""
        if (group.group_name, tensor.device.type) not in self._agreed:
            self.agree(group, tensor.device)
        decision = self.policy.decide(role, tensor, reducing_op_ok=op_ok, step=self.step)
        if decision.compress and tensor.device.type == "cuda":
            reason = self.cuda_lane_unavailable()
            if reason is not None:
                decision = Decision(False, f"{role.value}: CUDA tensors: {reason}")
        if not decision.compress:
            self.exact_calls[role] += 1
            self.exact_bytes[role] += exact_nbytes(role, tensor.numel() * tensor.element_size(),
                                                   group.size())
            if decision.reason not in self._logged and "warm-up" not in decision.reason:
                self._logged.add(decision.reason)
                log.info("dqcoll fsdp: exact %s (%s)", role.value, decision.reason)
        return decision

    def agree(self, group: dist.ProcessGroup, device: torch.device) -> None:
        """Every rank of ``group`` holds the same policy (its text: schemes, ``min_nbytes``,
        ``warmup_steps``, seed, ...; the node layout) and, for CUDA tensors, the same answer to
        whether a CUDA lane can run, or all raise :class:`~dqcoll.errors.MismatchError` naming
        each differing setting and each rank's value: these decide, call by call, between
        FSDP2's own collective and a lane, and ranks that decide differently would wait for
        each other until the timeout. Through the job's store (a lane may never be made), once
        per group and device type, at the group's first call, which every rank makes at the
        same point."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except (RuntimeError, ValueError):  # no default group: no job to agree with
            log.info("dqcoll fsdp: no default process group: settings not agreed")
            self._agreed.add((group.group_name, device.type))
            return
        settings = policy_settings(self.policy, group.size())
        if device.type == "cuda":
            settings["CUDA lane"] = ("available" if self.cuda_lane_unavailable() is None
                                     else "unavailable")
        agreement.agree_through_store(
            store, f"dqcoll-fsdp/{self.instance}/{group.group_name}/{device.type}/settings/",
            group.rank(), group.size(), settings, timeout_s=self.timeout_s,
            what=f"dqcoll fsdp: the compression settings of group {group.group_name}")
        self._agreed.add((group.group_name, device.type))

    def cuda_lane_unavailable(self) -> str | None:
        """None when CUDA calls can have a lane here, else why not (asked once; the first
        answer other than None is logged as a WARNING)."""
        if not self._cuda_checked:
            self._cuda_checked = True
            self._no_cuda_lane = nccl_lane_unavailable_reason()
            if self._no_cuda_lane is not None:
                log.warning("dqcoll fsdp: CUDA tensors take FSDP2's exact collectives, "
                            "uncompressed: %s", self._no_cuda_lane)
        return self._no_cuda_lane

    def lane(self, group: dist.ProcessGroup, device: torch.device | None = None) -> Lane:
        """The lane of ``group`` for tensors on ``device`` (default: the CPU)."""
        device = torch.device("cpu") if device is None else device
        name = group.group_name
        lane = self.lanes.get((name, device.type))
        if lane is None:
            store = dist.distributed_c10d._get_default_store()
            suffix = "" if device.type == "cpu" else f"{device.type}/"
            lane = Lane(store, group.rank(), group.size(), policy=self.policy,
                        timeout_s=self.timeout_s, name=f"fsdp {name}",
                        prefix=f"dqcoll-fsdp/{self.instance}/{name}/{suffix}", device=device)
            self.lanes[(name, device.type)] = lane
        return lane

    def summary(self) -> dict[str, Any]:
        """Counters per role, summed over the lanes, with the exact calls beside them."""
        roles = {role.value: dict(RoleCounters()) for role in Role}
        for lane in self.lanes.values():
            for role, counters in lane.summary().items():
                for key, value in counters.items():
                    roles[role][key] += value
        return {"policy": str(self.policy), "step": self.step, "compressed": roles,
                "exact_calls": {role.value: n for role, n in self.exact_calls.items()},
                "exact_bytes": {role.value: n for role, n in self.exact_bytes.items()}}

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()


class AllGather(_fsdp_api.AllGather):
    """FSDP2's parameter all-gather with the policy's ``weights`` rule (module docstring)."""

    def __init__(self, state: FsdpCompression) -> None:
        self.state = state

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if not self.state.decide(Role.WEIGHTS, output_tensor, group).compress:
            return exact_all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        lane = self.state.lane(group, output_tensor.device)
        return lane.all_gather(input_tensor, output_tensor, rule=self.state.policy.weights)


class ReduceScatter(_fsdp_api.ReduceScatter):
    """FSDP2's gradient reduce-scatter with the policy's ``gradients`` rule (module docstring)."""

    def __init__(self, state: FsdpCompression) -> None:
        self.state = state

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return _allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> dist.Work | None:
        kind, factor = _op_kind(op)
        if not self.state.decide(Role.GRADIENTS, input_tensor, group, kind != "other").compress:
            return exact_reduce_scatter(output_tensor, input_tensor, op=op, group=group,
                                        async_op=async_op)
        if kind == "premul":
            input_tensor.mul_(factor)  # FSDP2's scratch buffer, as NCCL's PreMulSum would
        lane = self.state.lane(group, input_tensor.device)
        work = lane.reduce_scatter(input_tensor, output_tensor, avg=kind == "avg",
                                   rule=self.state.policy.gradients)
        if async_op:
            return work
        work.wait()
        return None


def compress(model: torch.nn.Module, policy: CompressionPolicy | None = None, *,
             timeout_s: float | None = None) -> FsdpCompression:
    """Set dqcoll's :class:`AllGather` and :class:`ReduceScatter` on every ``fully_shard``
    module of ``model`` (``model`` itself included); returns the shared state.

    ``policy``: per-role schemes (default: ``DQCOLL_POLICY``, else
    :class:`~dqcoll.integrations.policy.CompressionPolicy`'s defaults). Call it after
    ``fully_shard`` and before the first forward, on every rank.
    """
    state = FsdpCompression(policy if policy is not None else CompressionPolicy.from_env(),
                            timeout_s=timeout_s)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise InvalidArgumentError(
            f"compress: no fully_shard module in {type(model).__name__}; call "
            f"torch.distributed.fsdp.fully_shard on its blocks and on the model first")
    all_gather, reduce_scatter = AllGather(state), ReduceScatter(state)
    for module in modules:
        module.set_custom_all_gather(all_gather)
        module.set_custom_reduce_scatter(reduce_scatter)

    def count_step(module: torch.nn.Module, args: Any) -> None:
        state.forwards += 1
        state.step = state.forwards - 1

    # prepended: runs before FSDP2's own pre-forward hook (the root's all-gather), so a step's
    # forward and backward collectives see the same step number
    model.register_forward_pre_hook(count_step, prepend=True)
    return state
