"""FSDP2 with dqcoll's collectives: quantized weights' all-gather and gradients' reduce-scatter.

Compressed calls run on a :class:`~dqcoll.integrations.lane.Lane` per group and device type, the
others on FSDP2's own collectives (docs/fsdp.md, "FSDP2's custom collectives").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_api
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

from .. import agreement, envs
from ..errors import InvalidArgumentError
from .lane import (
    Lane,
    _op_kind,
    exact_nbytes,
    nccl_lane_unavailable_reason,
    policy_settings,
    summed_counters,
)
from .policy import CompressionPolicy, Decision, Role

__all__ = ["AllGather", "FsdpCompression", "ReduceScatter", "compress", "exact_all_gather",
           "exact_reduce_scatter"]

log = logging.getLogger("dqcoll.fsdp")


# The exact collectives FSDP2 itself calls: *_single from torch 2.12 (the older names warn there).
exact_all_gather: Callable[..., dist.Work | None] = getattr(
    dist, "all_gather_single", None) or dist.all_gather_into_tensor
exact_reduce_scatter: Callable[..., dist.Work | None] = getattr(
    dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class FsdpCompression:
    """What :func:`compress` set up: the policy, the step counter, one lane per group and
    device type, and the counters (:meth:`summary`)."""

    instances = 0  # made so far in this process

    def __init__(self, policy: CompressionPolicy, *, timeout_s: float | None = None) -> None:
        policy.refuse_hook_only("FSDP2 compression")
        self.policy = policy
        self.forwards = 0
        self.step = 0
        self.timeout_s = envs.timeout_s() if timeout_s is None else float(timeout_s)
        self.lanes: dict[tuple[str, str], Lane] = {}
        # the lanes' store prefix: compress() runs in the same order on every rank
        FsdpCompression.instances += 1
        self.instance = FsdpCompression.instances
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
        if (decision.compress and tensor.device.type == "cuda"
                and (reason := self.cuda_lane_unavailable()) is not None):
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
        """Check through the job's store that every rank of ``group`` holds the same policy and
        (CUDA) the same answer on a CUDA lane, or all raise :class:`MismatchError`."""
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
        """None when CUDA calls can have a lane here, else why not (asked once, warned once)."""
        return self._no_cuda_lane

    @functools.cached_property
    def _no_cuda_lane(self) -> str | None:
        reason = nccl_lane_unavailable_reason()
        if reason is not None:
            log.warning("dqcoll fsdp: CUDA tensors take FSDP2's exact collectives, "
                        "uncompressed: %s", reason)
        return reason

    def lane(self, group: dist.ProcessGroup, device: torch.device | None = None) -> Lane:
        """The lane of ``group`` for tensors on ``device`` (default: the CPU)."""
        device = torch.device("cpu") if device is None else device
        name = group.group_name
        if (name, device.type) not in self.lanes:
            suffix = "" if device.type == "cpu" else f"{device.type}/"
            self.lanes[(name, device.type)] = Lane(
                dist.distributed_c10d._get_default_store(), group.rank(), group.size(),
                policy=self.policy, timeout_s=self.timeout_s, name=f"fsdp {name}",
                prefix=f"dqcoll-fsdp/{self.instance}/{name}/{suffix}", device=device)
        return self.lanes[(name, device.type)]

    def summary(self) -> dict[str, Any]:
        """Counters per role, summed over the lanes, with the exact calls beside them."""
        return {"policy": str(self.policy), "step": self.step,
                "compressed": summed_counters(self.lanes.values()),
                "exact_calls": {role.value: n for role, n in self.exact_calls.items()},
                "exact_bytes": {role.value: n for role, n in self.exact_bytes.items()}}

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()
        self.lanes.clear()


class _Comm(DefaultAllocMixin):
    """What both classes share: the state, and FSDP2's default buffers (``torch.empty``)."""

    def __init__(self, state: FsdpCompression) -> None:
        self.state = state


class AllGather(_Comm, _fsdp_api.AllGather):
    """FSDP2's parameter all-gather with the policy's ``weights`` rule (module docstring)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None:
        if not self.state.decide(Role.WEIGHTS, output_tensor, group).compress:
            return exact_all_gather(output_tensor, input_tensor, group=group, async_op=async_op)
        lane = self.state.lane(group, output_tensor.device)
        return lane.all_gather(input_tensor, output_tensor, rule=self.state.policy.weights)


class ReduceScatter(_Comm, _fsdp_api.ReduceScatter):
    """FSDP2's gradient reduce-scatter with the policy's ``gradients`` rule (module docstring)."""

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
    module of ``model`` (itself included); returns the shared state. ``policy`` defaults to
    ``DQCOLL_POLICY``. Call it after ``fully_shard``, before the first forward, on every rank."""
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

    # prepended, before FSDP2's all-gather: a step's collectives all see the same step number
    model.register_forward_pre_hook(count_step, prepend=True)
    return state
