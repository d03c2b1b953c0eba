"""A drop-in ``torch.distributed`` backend, registered on import: ``init_process_group("dqcoll")``.

Which calls are compressed, and how the others run exact on wrapped gloo (and NCCL): docs/fsdp.md
("The drop-in backend"). Calls exact only for their size pass the lane's path check, so sizes on
both sides of ``min_nbytes`` raise :class:`~dqcoll.errors.MismatchError` instead of hanging. (Not
a C++ ``Backend``: that is a compiled plugin per torch version, for a host-driven Python codec.)
"""

from __future__ import annotations

import datetime
import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions

from .. import envs
from .lane import Lane, _op_kind, nccl_lane_unavailable_reason, summed_counters
from .policy import CompressionPolicy, Role

__all__ = ["BACKEND_NAME", "DqcollProcessGroup", "set_policy"]

log = logging.getLogger("dqcoll.backend")

BACKEND_NAME = "dqcoll"
_policy: CompressionPolicy | None = None


def set_policy(policy: CompressionPolicy | None) -> None:
    """The policy of process groups created from now on (None: ``DQCOLL_POLICY``)."""
    global _policy
    _policy = policy


def _exact_method(method: str, collective: str | None = None) -> Any:
    """A process-group method that runs ``method`` on the wrapped group, counted under
    ``collective``; trailing None arguments are dropped (torch's defaults), earlier ones kept."""

    def call(self: DqcollProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
        given = {key: value for key, value in kwargs.items() if value is not None}
        positional = list(args)
        while positional and positional[-1] is None:
            positional.pop()
        return getattr(self._exact(collective or method), method)(*positional, **given)

    call.__name__ = call.__qualname__ = method
    return call


class DqcollProcessGroup(dist.ProcessGroup):
    """The ``dqcoll`` backend's process group (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta,
                 policy: CompressionPolicy) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        self.policy = policy
        # the exact collectives: what init_process_group("cpu:gloo,cuda:nccl") would have made
        self.wrapped = dist.ProcessGroup(store, rank, world_size)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
        self.wrapped._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                       gloo)
        self.wrapped._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        if torch.cuda.is_available() and dist.is_nccl_available():
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size,
                                         options)
            self.wrapped._register_backend(torch.device("cuda"),
                                           dist.ProcessGroup.BackendType.NCCL, nccl)
        self._store = store
        self._timeout_s = timeout.total_seconds()
        self.cuda_lane: Lane | None = None
        cuda = ("torch has no CUDA" if not torch.cuda.is_available()
                else "available" if self._cuda_lane_reason is None else "unavailable")
        # the ranks agree on the policy and the CUDA lane here, or all raise MismatchError
        self.lane = Lane(store, rank, world_size, policy=policy, timeout_s=self._timeout_s,
                         name="backend", settings={"CUDA lane": cuda}, check_paths=True)
        self.exact_calls: dict[str, int] = {}
        self._logged: set[str] = set()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:  # type: ignore[override]
        # a Python process group has no C++ backend to hold its name: torch's registry has it
        return dist.distributed_c10d._world.pg_names[self]

    pg_name = group_name

    def __repr__(self) -> str:
        return f"DqcollProcessGroup(rank={self.rank()}, world_size={self.size()})"

    def _exact(self, what: str) -> dist.ProcessGroup:
        """The wrapped process group (CUDA tensors to NCCL, CPU ones to gloo), counting ``what``."""
        self.exact_calls[what] = self.exact_calls.get(what, 0) + 1
        return self.wrapped

    def _route(self, role: Role, tensor: torch.Tensor, op_ok: bool = True) -> str:
        """Where this call goes: ``"lane"``, ``"checked"`` (exact only for its size:
        :meth:`_exact_checked`) or ``"exact"``."""
        if (not tensor.is_floating_point() or not tensor.is_contiguous()
                or (tensor.device.type == "cuda" and self._cuda_lane_reason is not None)):
            return "exact"
        decision = self.policy.decide(role, tensor, reducing_op_ok=op_ok)
        if not decision.compress and decision.reason not in self._logged:
            self._logged.add(decision.reason)
            log.info("dqcoll backend: exact %s (%s)", role.value, decision.reason)
        return "lane" if decision.compress else "checked" if decision.by_size else "exact"

    def _exact_checked(self, route: str, role: Role, tensor: torch.Tensor, numel: int,
                       out_numel: int, post: Any) -> dist.Work:
        """``post()``'s exact call, after the lane's path check if routed ``"checked"``."""
        if route != "checked":
            return post()
        check = self._lane(tensor).probe(role, numel, out_numel, tensor.dtype)
        return CheckedWork(check, post(), tensor.device)

    @functools.cached_property
    def _cuda_lane_reason(self) -> str | None:
        """None when CUDA calls can have a lane here, else why not (asked once, warned once)."""
        reason = nccl_lane_unavailable_reason()
        if reason is not None:
            log.warning("dqcoll backend: CUDA tensors take the wrapped backend's exact "
                        "collectives, uncompressed: %s", reason)
        return reason

    def _lane(self, tensor: torch.Tensor) -> Lane:
        if tensor.device.type != "cuda":
            return self.lane
        if self.cuda_lane is None:
            self.cuda_lane = Lane(self._store, self.rank(), self.size(), policy=self.policy,
                                  timeout_s=self._timeout_s, name="backend cuda",
                                  prefix="dqcoll-lane/cuda/", device=tensor.device,
                                  check_paths=True)
        return self.cuda_lane

    def summary(self) -> dict[str, Any]:
        """Compressed calls' counters per role and the count of exact calls per collective."""
        lanes = [lane for lane in (self.lane, self.cuda_lane) if lane is not None]
        return {"policy": str(self.policy), "compressed": summed_counters(lanes),
                "exact_calls": dict(self.exact_calls)}

    def allreduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: AllreduceOptions | None = None) -> dist.Work:
        opts = opts if opts is not None else AllreduceOptions()
        kind, factor = _op_kind(opts.reduceOp)
        if len(tensors) != 1:
            return self._exact("allreduce").allreduce(tensors, opts)
        buf = tensors[0]
        route = self._route(Role.ALLREDUCE, buf, kind in ("sum", "avg", "premul"))
        if route == "lane":
            if kind == "premul":
                buf.mul_(factor)
            return self._lane(buf).allreduce(buf, avg=kind == "avg", rule=self.policy.allreduce)
        return self._exact_checked(route, Role.ALLREDUCE, buf, buf.numel(), buf.numel(),
                                   lambda: self._exact("allreduce").allreduce(tensors, opts))

    def _reduce_scatter_base(self, output: torch.Tensor,  # type: ignore[override]
                             input: torch.Tensor,
                             opts: ReduceScatterOptions | None = None) -> dist.Work:
        """The single-tensor reduce-scatter (``reduce_scatter_single`` from torch 2.12)."""
        opts = opts if opts is not None else ReduceScatterOptions()
        kind, factor = _op_kind(opts.reduceOp)
        route = self._route(Role.GRADIENTS, input, kind in ("sum", "avg", "premul"))
        if route == "lane" and output.is_contiguous() and output.device == input.device:
            if kind == "premul":
                input = input * factor  # the caller's input stays as it was
            return self._lane(input).reduce_scatter(input, output, avg=kind == "avg",
                                                    rule=self.policy.gradients)
        return self._exact_checked(
            route, Role.GRADIENTS, input, input.numel(), output.numel(),
            lambda: self._exact("reduce_scatter_single")._reduce_scatter_base(output, input, opts))

    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]

    def _allgather_base(self, output: torch.Tensor,  # type: ignore[override]
                        input: torch.Tensor,
                        opts: AllgatherOptions | None = None) -> dist.Work:
        """The single-tensor all-gather (``all_gather_single`` from torch 2.12)."""
        opts = opts if opts is not None else AllgatherOptions()
        route = self._route(Role.WEIGHTS, output)
        if (route == "lane" and input.is_contiguous() and input.dtype == output.dtype
                and input.device == output.device):
            return self._lane(output).all_gather(input, output, rule=self.policy.weights)
        return self._exact_checked(
            route, Role.WEIGHTS, output, output.numel(), input.numel(),
            lambda: self._exact("all_gather_single")._allgather_base(output, input, opts))

    all_gather_single = _allgather_base  # type: ignore[assignment]

    # the other collectives run exact; torch 2.12 renamed some (both names lead to one method)
    allreduce_coalesced = _exact_method("allreduce_coalesced")
    allgather = _exact_method("allgather")
    allgather_coalesced = _exact_method("allgather_coalesced")
    allgather_into_tensor_coalesced = all_gather_single_coalesced = _exact_method(
        "allgather_into_tensor_coalesced", "all_gather_single_coalesced")
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced = _exact_method(
        "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")
    reduce_scatter = _exact_method("reduce_scatter")
    broadcast = _exact_method("broadcast")
    barrier = _exact_method("barrier")
    reduce = _exact_method("reduce")
    gather = _exact_method("gather")
    scatter = _exact_method("scatter")
    alltoall = _exact_method("alltoall")
    alltoall_base = all_to_all_single = _exact_method("alltoall_base", "all_to_all_single")

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        return self._exact("send").send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        return self._exact("recv").recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        return self._exact("recv_anysource").recv_anysource(tensors, tag)


class CheckedWork(dist.Work):
    """The Work of an exact call guarded by the lane's path check: ``wait()`` and the future raise
    the check's :class:`~dqcoll.errors.MismatchError` first, else they are the exact call's."""

    def __init__(self, check: dist.Work, work: dist.Work, device: torch.device) -> None:
        super().__init__()
        self._check = check
        self._work = work
        self._device = device  # a CUDA future records the exact call's stream events

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        args = () if timeout is None else (timeout,)  # torch's Work takes no None
        self._check.wait(*args)
        return bool(self._work.wait(*args))

    def is_completed(self) -> bool:
        return self._check.is_completed() and self._work.is_completed()

    def is_success(self) -> bool:
        return self._check.is_success() and self._work.is_success()

    def exception(self) -> BaseException | None:
        return self._check.exception()

    def get_future(self) -> torch.futures.Future[Any]:
        inner = self._work.get_future()
        future: torch.futures.Future[Any] = torch.futures.Future(
            devices=[self._device] if self._device.type == "cuda" else None)

        def settle(done: torch.futures.Future[Any], exact: bool = False) -> None:
            """The check's error, else (once it passed) the exact call's result or error."""
            try:
                value = done.value()
            except Exception as exc:
                future.set_exception(exc)
                return
            if exact:
                future.set_result(value)
            else:
                inner.add_done_callback(functools.partial(settle, exact=True))

        self._check.get_future().add_done_callback(settle)
        return future


def _create(store: Any, rank: int, world_size: int,
            timeout: datetime.timedelta) -> DqcollProcessGroup:
    policy = _policy if _policy is not None else CompressionPolicy.from_env()
    policy.refuse_hook_only("the dqcoll backend")
    # torch's default timeout means none was given: DQCOLL_TIMEOUT_S bounds every wait then
    if timeout is None or timeout == dist.constants.default_pg_timeout:
        timeout = datetime.timedelta(seconds=envs.timeout_s())
    return DqcollProcessGroup(store, rank, world_size, timeout, policy)


if BACKEND_NAME.upper() not in dist.Backend._plugins:  # imported twice: already there
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu", "cuda"])
