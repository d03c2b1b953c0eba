"""A compression lane: dqcoll's collectives on a connection of their own, as ``torch`` Work (which
FSDP2 and DDP can wait on), for the three integrations (docs/fsdp.md; docs/design.md §1).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import api, schemes
from ..comm import Communicator
from ..errors import CommAbortedError, InvalidArgumentError, UnsupportedError
from ..prepare import DEFAULT_BITS
from ..schemes.elementwise import BlockCodec
from ..topology.hierarchical import HierarchicalPlan, LevelSpec
from ..transports.torch_dist import TorchTransport, open_private_group, release_private_group
from .lane_blocks import BlockCollectives
from .policy import CompressionPolicy, Role, RoleRule

__all__ = ["CudaOrder", "Lane", "LaneWork", "RoleCounters", "exact_nbytes", "nccl_lane_binding",
           "nccl_lane_unavailable_reason", "policy_settings", "summed_counters"]

# small all-reduces up to n x this many bytes go to every rank in one exchange (docs/fsdp.md)
LANE_GATHER_NBYTES = 256 * 1024
# the path check (Lane(check_paths=True)): what every rank's call must agree on
_PATH_FIELDS = ("collective", "path (1: compressed on the lane, 0: exact below min_nbytes)",
                "numel", "output numel", "dtype")
_ROLE_CODES = {Role.ALLREDUCE: 1, Role.GRADIENTS: 2, Role.WEIGHTS: 3}


def policy_settings(policy: CompressionPolicy, world_size: int) -> dict[str, str]:
    """What of ``policy`` the ranks of a group must share, with its node layout."""
    settings = {f"policy {key}": value for key, _, value in
                (item.partition("=") for item in str(policy).split(","))}
    settings["policy's ranks per node (0: one level)"] = str(policy.nodes(world_size))
    return settings


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
            with contextlib.suppress(Exception):  # a factor torch does not expose: the exact path
                state = op.__getstate__()
                factor = state[1] if isinstance(state, tuple) and len(state) == 2 else None
        if isinstance(factor, (int, float)):
            return "premul", float(factor)
    return "other", 1.0


def _plain_block_codec(rule: RoleRule) -> BlockCodec | None:
    """The rule's scheme if it is a block codec whose payload depends on its chunk alone."""
    if rule.is_exact or rule.scheme == "auto" or rule.target is not None:
        return None
    scheme = schemes.get(rule.scheme, **({"bits": rule.bits} if rule.bits is not None else {}))
    if isinstance(scheme, BlockCodec) and type(scheme).prepare is BlockCodec.prepare:
        return scheme
    return None


def nccl_lane_binding() -> tuple[str | None, str]:
    """The NCCL binding a CUDA lane uses here: ``("nccl4py", "")``, else ``("nccl-cupy", "")``,
    else ``(None, why neither can run)``."""
    from ..transports import cupy_nccl, nccl4py

    first = nccl4py.nccl4py_unavailable_reason()
    if first is None:
        return "nccl4py", ""
    second = cupy_nccl.nccl_unavailable_reason()
    if second is None:
        return "nccl-cupy", ""
    return None, f"no NCCL transport can run here (nccl4py: {first}; CuPy: {second})"


def nccl_lane_unavailable_reason() -> str | None:
    """None when a lane for CUDA tensors can run in this process, else why it cannot."""
    return nccl_lane_binding()[1] or None  # the reason is empty where a binding can run


def _nccl_parts(binding: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The transport module, library, transport class and its library argument of ``binding``."""
    if binding == "nccl4py":
        import nccl.core

        from ..transports import nccl4py

        return nccl4py, nccl.core, nccl4py.Nccl4pyTransport, {"core": nccl.core}
    from cupy.cuda import nccl as cupy_library

    from ..transports import cupy_nccl

    return cupy_nccl, cupy_library, cupy_nccl.NcclTransport, {"nccl_module": cupy_library}


class CudaOrder:
    """The stream and event calls of a CUDA lane (tests replace it by a host fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None  # the lane's own stream, made on the lane's thread

    def record_caller(self) -> Any:
        """An event on the caller's current stream, after which the input is ready."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def run_after(self, ready: Any, run: Callable[[], None],
                  tensors: Sequence[torch.Tensor]) -> Any:
        """On the lane's thread: ``run()`` on the lane's stream after ``ready``, ``tensors``
        marked as used there; returns an event after the work."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=self.device)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            run()
        for tensor in tensors:
            tensor.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return done

    def wait(self, done: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(done)


class RoleCounters(dict[str, int]):
    """Per-role totals: ``calls``, ``numel``, ``wire_bytes`` (what this rank sent),
    ``exact_bytes`` (what a bandwidth-optimal exact collective would have sent)."""

    KEYS = ("calls", "numel", "wire_bytes", "exact_bytes")

    def __init__(self) -> None:
        super().__init__({key: 0 for key in self.KEYS})


def exact_nbytes(role: Role, tensor_nbytes: int, world_size: int) -> int:
    """Bytes per rank of a bandwidth-optimal exact collective of a *full* buffer of
    ``tensor_nbytes`` (reduce-scatter input, all-gather output, all-reduce buffer)."""
    share = tensor_nbytes * (world_size - 1) // world_size
    return 2 * share if role is Role.ALLREDUCE else share


def summed_counters(lanes: Iterable[Lane]) -> dict[str, dict[str, int]]:
    """The lanes' counters summed per role (every role, zeros included), as plain dicts."""
    lanes = list(lanes)
    return {role.value: {key: sum(lane.counters[role][key] for lane in lanes)
                         for key in RoleCounters.KEYS} for role in Role}


class LaneWork(dist.Work):
    """The Work of one lane call: ``wait()`` blocks until the lane's thread ran (CUDA: queued) it
    and raises its error (``_create_work_from_future``'s Work drops it); on CUDA the current
    stream then waits for its last kernel. ``get_future()`` serves DDP's reducer."""

    def __init__(self, done: concurrent.futures.Future[Any], result: Any,
                 order: CudaOrder | None = None) -> None:
        super().__init__()
        self._done = done  # its result: the event after the call's work (CUDA), else None
        self._result = result
        self._order = order

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        seconds = timeout.total_seconds() if timeout else 0.0
        # wait, then look: an except TimeoutError around result() would catch the call's own
        if not concurrent.futures.wait([self._done], seconds if seconds > 0 else None).done:
            raise TimeoutError(f"lane call not finished after {seconds:g} s")
        event = self._done.result()  # raises the call's error
        if self._order is not None and event is not None:
            self._order.wait(event)
        return True

    def is_completed(self) -> bool:
        return self._done.done()

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[Any]], None]) -> None:
        """``fn(future)`` on the lane's thread after the call (result: its CUDA event, or None)."""
        self._done.add_done_callback(fn)

    def is_success(self) -> bool:
        return self._done.done() and self._done.exception() is None

    def exception(self) -> BaseException | None:
        return self._done.exception() if self._done.done() else None

    def get_future(self) -> torch.futures.Future[Any]:
        order = self._order
        future: torch.futures.Future[Any] = torch.futures.Future(
            devices=[order.device] if order is not None else None)

        def finish(done: concurrent.futures.Future[Any]) -> None:
            error = done.exception()
            if error is not None:
                future.set_exception(error)
                return
            if order is not None and done.result() is not None:
                # the future records its event on this thread's stream: order it after the call
                order.wait(done.result())
            future.set_result(self._result)

        self._done.add_done_callback(finish)
        return future


class Lane(BlockCollectives):
    """dqcoll collectives for one group of ranks, run on one thread.

    Every rank creates its lane at the same point, rendezvousing in ``store`` under ``prefix``;
    ranks whose ``settings`` (beside :func:`policy_settings`) differ raise :class:`MismatchError`.
    ``check_paths``: every call first checks that all ranks take the same path with the same sizes.
    ``group``: a CUDA lane without an NCCL binding runs the ``torch`` transport over it instead of
    raising. ``comm``: run on this communicator as it is (the DDP hook's survivors).
    """

    def __init__(self, store: Any, rank: int, world_size: int, *, policy: CompressionPolicy,
                 timeout_s: float, name: str, prefix: str = "dqcoll-lane/",
                 device: torch.device | str = "cpu",
                 settings: Mapping[str, str] | None = None, check_paths: bool = False,
                 gather_nbytes: int = LANE_GATHER_NBYTES, group: Any = None,
                 comm: Communicator | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.policy = policy
        self.name = name
        self.check_paths = check_paths
        self._paths = 0  # path checks so far (their labels)
        self.settings = {**policy_settings(policy, world_size), **(settings or {})}
        self.device = torch.device(device)
        self.gloo: Any = None  # CPU: the lane's gloo process group
        if comm is None:
            transport, comm_device = self._connect(store, prefix, timeout_s, gather_nbytes, group)
            comm = Communicator(transport, seed=policy.seed, settings=self.settings,
                                device=comm_device)
        self.transport: Any = comm.transport
        self.comm = comm
        self.order = CudaOrder(self.device) if self.device.type == "cuda" else None
        # two levels: the nodes' ranks (node-major); None: one level
        self.local_world_size = local = policy.nodes(world_size)
        self.host_ranks = (tuple(tuple(range(node * local, (node + 1) * local))
                                 for node in range(world_size // local)) if local else None)
        self._plans: dict[RoleRule, HierarchicalPlan] = {}
        self.counters = {role: RoleCounters() for role in Role}
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"dqcoll-lane {name} rank {rank}")
        self._last: concurrent.futures.Future[Any] | None = None  # the call queued last
        self._init_blocks()

    def _connect(self, store: Any, prefix: str, timeout_s: float, gather_nbytes: int,
                 group: Any) -> tuple[Any, torch.device | None]:
        """The lane's transport (gloo on CPU, NCCL on CUDA) and its communicator's device."""
        if self.device.type == "cpu":
            self.gloo = open_private_group(store, prefix, self.rank, self.world_size, timeout_s)
            return TorchTransport(self.gloo, timeout_s=timeout_s, gather_nbytes=gather_nbytes), None
        if self.device.type != "cuda":
            raise InvalidArgumentError(f"rank {self.rank}: lane {self.name}: {self.device} tensors "
                                       f"have no lane (cpu and cuda do)")
        binding, reason = nccl_lane_binding()
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if binding is None and group is not None:
            return TorchTransport(group, timeout_s=timeout_s), self.device
        if binding is None:
            raise UnsupportedError(f"rank {self.rank}: lane {self.name} on {self.device}: {reason}")
        from ..transports.nccl_common import exchange_unique_id  # CUDA only: loaded on use

        prefixed = dist.PrefixStore(prefix, store)
        module, library, transport_class, extra = _nccl_parts(binding)
        unique_id = exchange_unique_id(lambda: module.unique_id_bytes(library), prefixed,
                                       self.rank, "nccl/unique_id", timeout_s)
        try:
            nccl_comm = module.create_communicator(library, self.world_size, unique_id,
                                                   self.rank, self.device)
        except Exception as exc:  # NCCL could not start (library, driver, network)
            raise CommAbortedError(
                f"rank {self.rank} of {self.world_size}: lane {self.name}: ncclCommInitRank "
                f"through {binding} on {self.device} failed: {type(exc).__name__}: {exc}"
            ) from exc
        return transport_class(nccl_comm, rank=self.rank, world_size=self.world_size,
                               device=self.device, timeout_s=timeout_s, store=prefixed,
                               **extra), None

    def two_level_plan(self, rule: RoleRule) -> HierarchicalPlan | None:
        """The two-level plan of ``rule`` (exact inside a node), or None on one level."""
        if self.host_ranks is None:
            return None
        if rule not in self._plans:
            bits = DEFAULT_BITS if rule.bits is None else float(rule.bits)
            self._plans[rule] = HierarchicalPlan(
                self.host_ranks, LevelSpec("none", algorithm="auto"),
                LevelSpec(rule.scheme, bits, algorithm="auto"))
        return self._plans[rule]

    def _check_path(self, role: Role, compressed: bool, numel: int, out_numel: int,
                    dtype: torch.dtype) -> None:
        """The path check: ranks whose calls differ in collective, path or sizes all raise."""
        if not self.check_paths or not self.comm.validate:
            return
        self._paths += 1
        fields = (_ROLE_CODES[role], int(compressed), numel, out_numel,
                  zlib.crc32(str(dtype).encode()))
        self._check(f"lane {self.name} path check #{self._paths} ({role.value})", fields,
                    _PATH_FIELDS)

    def probe(self, role: Role, numel: int, out_numel: int, dtype: torch.dtype) -> dist.Work:
        """The path check of a call that runs exact elsewhere, queued in issue order; its Work
        raises :class:`MismatchError` where another rank's call was compressed."""
        self._last = self._pool.submit(self._check_path, role, False, numel, out_numel, dtype)
        return LaneWork(self._last, None)

    def submit(self, role: Role, tensor_nbytes: int, numel: int, run: Callable[[], Any],
               result: Any, tensors: Sequence[torch.Tensor] = (),
               path: tuple[int, torch.dtype] | None = None) -> LaneWork:
        """Queue ``run()`` (one collective on ``tensors``) on the lane's thread; a Work for its end.
        ``path``: the output's elements and the dtype, for the path check."""
        counters = self.counters[role]
        order = self.order
        ready = order.record_caller() if order is not None else None

        def job() -> Any:
            if path is not None:
                self._check_path(role, True, numel, *path)
            before = self.transport.counters["bytes_sent"]
            done = None
            if order is None:
                run()  # an error goes to the Work's wait()
            else:
                done = order.run_after(ready, run, tensors)
            counters["calls"] += 1
            counters["numel"] += numel
            counters["wire_bytes"] += self.transport.counters["bytes_sent"] - before
            counters["exact_bytes"] += exact_nbytes(role, tensor_nbytes, self.world_size)
            return done

        self._last = self._pool.submit(job)
        return LaneWork(self._last, result, order)

    def flush(self) -> None:
        """Return once every call queued so far has run (on CUDA: been queued on the stream):
        the lane's one thread runs them in order, so once the last one has (nothing queued
        since the last flush: no hand-off to the thread at all)."""
        last = self._last
        if last is not None:
            concurrent.futures.wait([last])  # its error, if any, is its Work's

    def abort(self, reason: str) -> None:
        """Close the lane's connection now (a lost peer): calls blocked on it fail at once."""
        self.transport.abort(reason)

    def close(self) -> None:
        """End the thread after the calls queued so far, then close a CUDA lane's communicator."""
        self._pool.shutdown(wait=True)
        if self.device.type == "cuda":
            self.comm.close()
        if self.gloo is not None:
            release_private_group(self.gloo)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, *, avg: bool,
                       rule: RoleRule) -> dist.Work:
        """``out`` = shard ``rank`` of the sum (or average) of every rank's ``inp``."""
        op = "avg" if avg else "sum"
        codec = _plain_block_codec(rule)
        plan = self.two_level_plan(rule)

        def run() -> None:
            if plan is not None:
                api.reduce_scatter(inp.view(-1), out.view(-1), op=op, comm=self.comm,
                                   algorithm=plan)
            elif codec is not None and inp.device.type == "cpu":
                self._scatter_blocks(inp.reshape(-1), out.view(-1), codec, avg)
            else:
                api.reduce_scatter(inp.view(-1), out.view(-1), op=op, comm=self.comm,
                                   **rule.options())

        return self.submit(Role.GRADIENTS, inp.numel() * inp.element_size(), inp.numel(), run,
                           out, (inp, out), (out.numel(), inp.dtype))

    def all_gather(self, shard: torch.Tensor, out: torch.Tensor, *,
                   rule: RoleRule) -> dist.Work:
        """``out`` = every rank's ``shard`` in rank order, decoded alike on every rank."""
        codec = _plain_block_codec(rule)
        plan = self.two_level_plan(rule)

        def run() -> None:
            if plan is not None:
                api.all_gather(shard.view(-1), out.view(-1), comm=self.comm, algorithm=plan)
            elif codec is not None and shard.device.type == "cpu":
                self._gather_blocks(shard.reshape(-1), out.view(-1), codec)
            else:
                api.all_gather(shard.view(-1), out.view(-1), comm=self.comm, **rule.options())

        return self.submit(Role.WEIGHTS, out.numel() * out.element_size(), out.numel(), run, out,
                           (shard, out), (shard.numel(), out.dtype))

    def allreduce(self, buf: torch.Tensor, *, avg: bool, rule: RoleRule) -> dist.Work:
        """``buf`` = the sum (or average) of every rank's ``buf``, in place."""
        op = "avg" if avg else "sum"
        plan = self.two_level_plan(rule)

        def run() -> None:
            if plan is not None:
                api.allreduce(buf.view(-1), op=op, comm=self.comm, algorithm=plan)
            else:
                api.allreduce(buf.view(-1), op=op, comm=self.comm, **rule.options())

        return self.submit(Role.ALLREDUCE, buf.numel() * buf.element_size(), buf.numel(), run,
                           [buf], (buf,), (buf.numel(), buf.dtype))
