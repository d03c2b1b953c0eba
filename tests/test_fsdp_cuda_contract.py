"""Contract tier: FSDP2's ``compress()`` and the ``dqcoll`` backend on CUDA tensors take a
compressed lane over dqcoll's own NCCL transport, checked on a CPU machine against the real
nccl4py.

What runs is the real code from the FSDP2 classes (or the backend's process group) down to the
bytes: the policy's decision, the lane and its worker thread, the rendezvous of the NCCL unique
id through a real store under the lane's prefix (real ``nccl.core.get_unique_id`` and
``UniqueId.from_bytes``), the real ``Nccl4pyTransport`` and ``Nccl4pyBinding``, dqcoll's
collectives and codecs. Stubbed, only where a GPU is needed, each checked against the real
signature first:

* the tensors' device: :class:`_CudaLooking` tensors report ``cuda:0`` to whoever asks (the
  policy, the lane's choice of connection) while their data, and every tensor an operation
  makes from them, stay in host memory (the transport's device is moved to the CPU likewise,
  "host memory stands in for the GPU's", as in tests/test_nccl_contract.py);
* ``torch.cuda.is_available`` and ``torch.cuda.device`` (no driver here);
* a joined ``nccl.core.Communicator`` and ``group_start`` / ``group_end``: host mailboxes with
  NCCL's point-to-point semantics (:class:`_FakeNet`);
* CUDA streams and events: the transport's ``CudaStreams`` and the lane's ``CudaOrder`` by host
  fakes that record the order of their calls.

The ranks are threads of this one process.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

from dqcoll import api, metrics
from dqcoll.integrations import fsdp as dqfsdp
from dqcoll.integrations import lane as lane_module
from dqcoll.integrations.policy import CompressionPolicy, Role
from dqcoll.testing import run_local
from dqcoll.transports import nccl4py, nccl_common

WORLD = 2
SHARD = 3001  # all-gather shard (no multiple of a block)
RS_SHARD = 2 * 2048 + 5  # reduce-scatter shard


class _CudaLooking(torch.Tensor):
    """A host tensor that says it is on ``cuda:0``; what any operation makes of it is a plain
    host tensor (sharing its memory for views)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _cuda(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(_CudaLooking)


# -- host fakes of what needs a GPU ----------------------------------------------------------------


class _FakeNet:
    """Byte mailboxes between ranks: a send copies its bytes out at once, a receive is filled when
    the matching send is there (FIFO per pair); ``group_end`` waits for the group's receives."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[tuple[int, int], list[bytes]] = {}
        self.waiting: dict[tuple[int, int], list[tuple[int, int, threading.Event]]] = {}
        self.group = threading.local()

    def _match(self, pair: tuple[int, int]) -> None:
        data, waiting = self.data.setdefault(pair, []), self.waiting.setdefault(pair, [])
        while data and waiting:
            payload = data.pop(0)
            ptr, count, done = waiting.pop(0)
            assert len(payload) == count, f"{pair}: {len(payload)} bytes sent, {count} expected"
            ctypes.memmove(ptr, payload, count)
            done.set()

    def send(self, src: int, dst: int, ptr: int, count: int) -> None:
        with self.lock:
            self.data.setdefault((src, dst), []).append(ctypes.string_at(ptr, count))
            self._match((src, dst))

    def recv(self, dst: int, src: int, ptr: int, count: int) -> None:
        done = threading.Event()
        with self.lock:
            self.waiting.setdefault((src, dst), []).append((ptr, count, done))
            self._match((src, dst))
        self.group.pending.append(done)

    def group_start(self) -> None:
        self.group.pending = []

    def group_end(self) -> None:
        for done in self.group.pending:
            if not done.wait(30):
                raise RuntimeError("fake NCCL: a receive did not complete within 30 s")


class _FakeCommunicator:
    """A joined ``nccl.core.Communicator`` on the host (signatures checked against the real)."""

    net: ClassVar[_FakeNet]
    inits: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.destroyed = False

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: Any, config: Any = None) -> Any:
        cls.inits.append({"nranks": nranks, "rank": rank, "unique_id": unique_id})
        return cls(rank)

    def send(self, sendbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.send(self.rank, peer, sendbuf.data_ptr(), sendbuf.numel())

    def recv(self, recvbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.recv(self.rank, peer, recvbuf.data_ptr(), recvbuf.numel())

    def get_async_error(self) -> Any:
        from nccl.bindings import nccl as bindings

        return bindings.Result.Success

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        self.destroyed = True


class _HostEvent:
    def query(self) -> bool:
        return True


class _HostStreams:
    """``nccl_common.CudaStreams`` on the host: work is done once posted."""

    def current_handle(self) -> int:
        return 0

    def record(self) -> Any:
        return _HostEvent()

    def scope(self) -> Any:
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        pass


class _HostOrder:
    """``lane.CudaOrder`` on the host: runs the work at once and records every call (which
    thread, which event) in ``log``."""

    log: ClassVar[list[tuple[Any, ...]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: Any = None

    def _note(self, *entry: Any) -> None:
        with self.lock:
            self.log.append((threading.current_thread().name, *entry))

    def record_caller(self) -> Any:
        event = _HostEvent()
        self._note("record_caller", id(event))
        return event

    def run_after(self, ready: Any, run: Callable[[], None],
                  tensors: Sequence[torch.Tensor]) -> Any:
        self._note("run_after", id(ready), tuple(id(t) for t in tensors))
        run()
        done = _HostEvent()
        self._note("done", id(done))
        return done

    def wait(self, done: Any) -> None:
        self._note("wait", id(done))


class _RecordingTransport(nccl4py.Nccl4pyTransport):
    """The real transport class; records its constructor's arguments, then moves its device to
    the CPU (host memory stands in for the GPU's)."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, comm: Any, **kwargs: Any) -> None:
        super().__init__(comm, **kwargs)
        self.made.append(dict(kwargs))
        self.device = torch.device("cpu")
        self.devices = ("cpu",)


class _Group:
    """The parts of FSDP2's process group that the FSDP classes read."""

    def __init__(self, rank: int, size: int = WORLD) -> None:
        self.group_name = "fsdp-group"
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def _no_nccl_reasons() -> list[str]:
    """Why neither NCCL transport can run here (each transport's own reason); empty where one
    can."""
    from dqcoll.transports import cupy_nccl

    reasons = [nccl4py.nccl4py_unavailable_reason(), cupy_nccl.nccl_unavailable_reason()]
    return [] if None in reasons else [r for r in reasons if r is not None]


def _run_ranks(body: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * WORLD
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), name=f"rank {r}") for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


@pytest.fixture
def nccl_core() -> Any:
    return pytest.importorskip("nccl.core", reason="nccl4py[cu12] is not installed (the "
                                                   "gpu-contract extra of pyproject.toml)")


@pytest.fixture
def gpu_stubs(nccl_core: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Everything above stubbed (see the module docstring); returns the records."""
    net = _FakeNet()
    _FakeCommunicator.net = net
    _FakeCommunicator.inits = []
    _RecordingTransport.made = []
    _HostOrder.log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    for name in ("current_handle", "record", "scope", "bind_thread"):
        monkeypatch.setattr(nccl_common.CudaStreams, name, getattr(_HostStreams, name))
    monkeypatch.setattr(nccl_core, "Communicator", _FakeCommunicator)
    monkeypatch.setattr(nccl_core, "group_start", net.group_start)
    monkeypatch.setattr(nccl_core, "group_end", net.group_end)
    monkeypatch.setattr(nccl4py, "Nccl4pyTransport", _RecordingTransport)
    monkeypatch.setattr(lane_module, "CudaOrder", _HostOrder, raising=False)
    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    glooed: list[Any] = []
    real_gloo = dist.ProcessGroupGloo

    def gloo(*args: Any, **kwargs: Any) -> Any:
        glooed.append(args)
        return real_gloo(*args, **kwargs)

    return {"store": store, "gloo": gloo, "glooed": glooed, "real_gloo": real_gloo}


def test_host_fakes_have_the_real_signatures(nccl_core: Any) -> None:
    """Every fake has the parameters of what it replaces: nccl4py's ``Communicator.init``,
    ``send``, ``recv`` and ``get_async_error``, the module's ``group_start`` / ``group_end``
    (no required argument), the transport's ``CudaStreams``, the lane's ``CudaOrder``, and
    ``torch.cuda.Event.query``."""
    assert list(inspect.signature(_FakeCommunicator.init).parameters) == list(
        inspect.signature(nccl_core.Communicator.init).parameters)
    for name in ("send", "recv", "get_async_error", "abort", "destroy"):
        real = inspect.signature(getattr(nccl_core.Communicator, name)).parameters
        fake = inspect.signature(getattr(_FakeCommunicator, name)).parameters
        assert [(p.name, p.kind) for p in fake.values()] == [
            (p.name, p.kind) for p in real.values()], name
    for name in ("group_start", "group_end"):
        assert not [p for p in inspect.signature(getattr(nccl_core, name)).parameters.values()
                    if p.default is inspect.Parameter.empty], name
    for name in ("current_handle", "record", "scope", "bind_thread"):
        assert inspect.signature(getattr(_HostStreams, name)) == inspect.signature(
            getattr(nccl_common.CudaStreams, name)), name
    for name in ("__init__", "record_caller", "run_after", "wait"):
        assert inspect.signature(getattr(_HostOrder, name)) == inspect.signature(
            getattr(lane_module.CudaOrder, name)), name
    assert list(inspect.signature(_HostEvent.query).parameters) == list(
        inspect.signature(torch.cuda.Event.query).parameters)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + rank)
    return torch.randn(SHARD, generator=g) * 3, torch.randn(WORLD * RS_SHARD, generator=g)


def _reference(policy: CompressionPolicy) -> list[dict[str, torch.Tensor]]:
    """The same two collectives through dqcoll's API on the ``local`` transport (host)."""

    def body(comm: Any) -> dict[str, torch.Tensor]:
        shard, grads = _inputs(comm.rank)
        gathered = torch.empty(WORLD * SHARD)
        api.all_gather(shard, gathered, comm=comm, **policy.weights.options())
        reduced = torch.empty(RS_SHARD)
        api.reduce_scatter(grads, reduced, op="avg", comm=comm, **policy.gradients.options())
        return {"ag": gathered, "rs": reduced}

    return run_local(WORLD, body, seed=policy.seed)


def _check_order(log: list[tuple[Any, ...]], rank: int, calls: int) -> None:
    """Per call of ``rank``: an event recorded on the caller's thread, the lane's thread waits
    for that very event before it runs the work, and the caller's ``wait()`` orders its stream
    after the event the lane recorded after the work."""
    # (position in the log, entry): event ids are id()s, which a later event may reuse, so
    # entries are placed by where they stand, not found by value
    mine = [(i, e) for i, e in enumerate(log) if e[0] == f"rank {rank}" or f"rank {rank}" in e[0]]
    caller = [(i, e) for i, e in mine if e[0] == f"rank {rank}"]
    lane = [(i, e) for i, e in mine if e[0] != f"rank {rank}"]
    records = [(i, e) for i, e in caller if e[1] == "record_caller"]
    waits = [(i, e) for i, e in caller if e[1] == "wait"]
    runs = [(i, e) for i, e in lane if e[1] == "run_after"]
    dones = [(i, e) for i, e in lane if e[1] == "done"]
    assert len(records) == len(runs) == len(dones) == len(waits) == calls, mine
    assert all("dqcoll-lane" in e[0] for _, e in lane), lane
    assert [e[2] for _, e in records] == [e[2] for _, e in runs]
    assert [e[2] for _, e in dones] == [e[2] for _, e in waits]
    for record, run, done, wait in zip(records, runs, dones, waits, strict=True):
        assert record[0] < run[0] < done[0] < wait[0]


def test_fsdp2_cuda_calls_take_the_nccl_lane(gpu_stubs: dict[str, Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2's AllGather and ReduceScatter on CUDA tensors under ``compress()``'s policy: both
    calls are decided ``compress`` (no exact call), one lane per group for CUDA is made whose
    transport is dqcoll's nccl4py transport on ``cuda:0`` (its constructor recorded; no gloo
    group made), both ranks' communicators are made with the same unique id (rank 0's, through
    the store under the lane's prefix), the work runs on the lane's thread ordered after the
    caller's stream and before the caller's ``wait()`` returns, and the results are bit for bit
    those of dqcoll's API with the same schemes on the ``local`` transport."""
    monkeypatch.setattr(dist, "ProcessGroupGloo", gpu_stubs["gloo"])
    policy = CompressionPolicy(min_nbytes=0)

    def rank_body(rank: int) -> dict[str, Any]:
        state = dqfsdp.FsdpCompression(policy, timeout_s=60)
        state.instance = 1  # the ranks are threads: each would count its instances from 1
        group = _Group(rank)
        shard, grads = _inputs(rank)
        gathered = torch.full((WORLD * SHARD,), float("nan"))
        work = dqfsdp.AllGather(state)(_cuda(gathered), _cuda(shard), group, async_op=False)
        assert isinstance(work, dist.Work)
        work.wait()
        reduced = torch.full((RS_SHARD,), float("nan"))
        assert dqfsdp.ReduceScatter(state)(_cuda(reduced), _cuda(grads.clone()), group,
                                           dist.ReduceOp.AVG) is None
        lane = state.lanes[("fsdp-group", "cuda")]
        out = {"ag": gathered, "rs": reduced, "lanes": sorted(state.lanes),
               "transport": type(lane.transport), "gloo": lane.gloo,
               "summary": state.summary()}
        state.close()
        out["destroyed"] = lane.transport.comm.destroyed
        return out

    results = _run_ranks(rank_body)
    expected = _reference(policy)
    assert gpu_stubs["glooed"] == []
    made = sorted(_RecordingTransport.made, key=lambda kw: kw["rank"])
    assert [(kw["rank"], kw["world_size"], kw["device"]) for kw in made] == [
        (0, 2, torch.device("cuda", 0)), (1, 2, torch.device("cuda", 0))]
    inits = sorted(_FakeCommunicator.inits, key=lambda d: d["rank"])
    assert [(d["nranks"], d["rank"]) for d in inits] == [(2, 0), (2, 1)]
    assert inits[0]["unique_id"].as_bytes == inits[1]["unique_id"].as_bytes
    lane_store = dist.PrefixStore("dqcoll-fsdp/1/fsdp-group/cuda/", gpu_stubs["store"])
    assert lane_store.check(["nccl/unique_id"])
    for rank, result in enumerate(results):
        assert result["lanes"] == [("fsdp-group", "cuda")]
        assert result["transport"] is _RecordingTransport and result["gloo"] is None
        summary = result["summary"]
        assert summary["exact_calls"] == {role.value: 0 for role in Role}
        for role in ("weights", "gradients"):
            counters = summary["compressed"][role]
            assert counters["calls"] == 1 and 0 < 3 * counters["wire_bytes"] < \
                counters["exact_bytes"], (role, counters)
        assert torch.equal(result["ag"], expected[rank]["ag"])
        assert torch.equal(result["rs"], expected[rank]["rs"])
        assert metrics.vnmse(result["ag"].view(WORLD, -1)[rank], _inputs(rank)[0]) < 1e-3
        assert result["destroyed"]
        _check_order(_HostOrder.log, rank, calls=2)


def test_backend_cuda_calls_take_the_nccl_lane(gpu_stubs: dict[str, Any],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``dqcoll`` backend's single-tensor all-gather and reduce-scatter on CUDA tensors,
    under every name torch calls them by (``_allgather_base`` / ``all_gather_single``,
    ``_reduce_scatter_base`` / ``reduce_scatter_single``): compressed on a CUDA lane over
    dqcoll's nccl4py transport, made at the first CUDA call beside the CPU lane, with the bits
    of dqcoll's API; the summary counts them, none exact."""
    from torch._C._distributed_c10d import AllgatherOptions, ReduceScatterOptions

    import dqcoll.integrations.torch_backend as backend

    # torch's own NCCL group (the wrapped exact path for CUDA) needs a GPU
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    policy = CompressionPolicy(min_nbytes=0)

    def rank_body(rank: int) -> dict[str, Any]:
        pg = backend.DqcollProcessGroup(gpu_stubs["store"], rank, WORLD,
                                        datetime.timedelta(seconds=60), policy)
        shard, grads = _inputs(rank)
        out: dict[str, Any] = {}
        for name in ("_allgather_base", "all_gather_single"):
            gathered = torch.full((WORLD * SHARD,), float("nan"))
            getattr(pg, name)(_cuda(gathered), _cuda(shard), AllgatherOptions()).wait()
            out[name] = gathered
        for name in ("_reduce_scatter_base", "reduce_scatter_single"):
            reduced = torch.full((RS_SHARD,), float("nan"))
            opts = ReduceScatterOptions()
            opts.reduceOp = dist.ReduceOp.AVG
            getattr(pg, name)(_cuda(reduced), _cuda(grads.clone()), opts).wait()
            out[name] = reduced
        assert pg.cuda_lane is not None
        out["transport"] = type(pg.cuda_lane.transport)
        out["summary"] = pg.summary()
        pg.cuda_lane.close()
        return out

    results = _run_ranks(rank_body)
    assert dist.PrefixStore("dqcoll-lane/cuda/", gpu_stubs["store"]).check(["nccl/unique_id"])
    assert len(_RecordingTransport.made) == WORLD
    for rank, result in enumerate(results):
        assert result["transport"] is _RecordingTransport
        summary = result["summary"]
        assert summary["exact_calls"] == {}
        assert summary["compressed"]["weights"]["calls"] == 2
        assert summary["compressed"]["gradients"]["calls"] == 2
        # the first all-gather is dqcoll's first collective: the API's bits; the others are
        # close to exact
        assert torch.equal(result["_allgather_base"], _reference(policy)[rank]["ag"])
        assert metrics.vnmse(result["all_gather_single"].view(WORLD, -1)[rank],
                             _inputs(rank)[0]) < 1e-3
        exact = sum(_inputs(r)[1] for r in range(WORLD)).view(WORLD, -1)[rank] / WORLD
        for name in ("_reduce_scatter_base", "reduce_scatter_single"):
            assert metrics.vnmse(result[name], exact) < 0.02, name
        _check_order(_HostOrder.log, rank, calls=4)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append((args, kwargs))


def test_fsdp2_cuda_fallback_warns_once_naming_the_reason(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no NCCL transport can run (here: no GPU; nothing stubbed but the tensors' device
    and FSDP2's exact collectives, which would need a GPU), CUDA calls that the policy would
    compress take FSDP2's exact collectives, no lane is made, and one WARNING, at the first
    call only, names why (the transports' own reasons)."""
    reasons = _no_nccl_reasons()
    if not reasons:
        pytest.skip("an NCCL transport can run here: the fallback is not reachable")
    gather, scatter = _Recorder(), _Recorder()
    monkeypatch.setattr(dqfsdp, "exact_all_gather", gather)
    monkeypatch.setattr(dqfsdp, "exact_reduce_scatter", scatter)
    state = dqfsdp.FsdpCompression(CompressionPolicy(min_nbytes=0), timeout_s=10)
    group = _Group(0)
    shard, grads = _inputs(0)
    with caplog.at_level(logging.INFO, logger="dqcoll"):
        for _ in range(2):
            dqfsdp.AllGather(state)(_cuda(torch.empty(WORLD * SHARD)), _cuda(shard), group)
            dqfsdp.ReduceScatter(state)(_cuda(torch.empty(RS_SHARD)), _cuda(grads), group,
                                        dist.ReduceOp.AVG)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert "CUDA tensors take FSDP2's exact collectives" in message
    assert all(reason in message for reason in reasons), (message, reasons)
    assert len(gather.calls) == len(scatter.calls) == 2 and state.lanes == {}
    assert state.exact_calls[Role.WEIGHTS] == state.exact_calls[Role.GRADIENTS] == 2


def test_backend_cuda_fallback_warns_once_and_runs_exact(
        caplog: pytest.LogCaptureFixture) -> None:
    """The backend where no NCCL transport can run: a CUDA all-gather the policy would compress
    runs on the wrapped backend (here gloo, world size 1: the output is the input), no CUDA
    lane is made, and one WARNING names why."""
    from torch._C._distributed_c10d import AllgatherOptions

    import dqcoll.integrations.torch_backend as backend

    reasons = _no_nccl_reasons()
    if not reasons:
        pytest.skip("an NCCL transport can run here: the fallback is not reachable")
    pg = backend.DqcollProcessGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=30),
                                    CompressionPolicy(min_nbytes=0))
    shard = _inputs(0)[0]
    with caplog.at_level(logging.INFO, logger="dqcoll"):
        for name in ("_allgather_base", "all_gather_single"):
            out = torch.full_like(shard, float("nan"))
            getattr(pg, name)(_cuda(out), _cuda(shard), AllgatherOptions()).wait()
            assert torch.equal(out, shard)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert all(reason in warnings[0].getMessage() for reason in reasons)
    assert pg.cuda_lane is None
    assert pg.summary()["exact_calls"] == {"all_gather_single": 2}
    assert pg.summary()["compressed"]["weights"]["calls"] == 0


class _Bucket:
    """The parts of DDP's ``GradBucket`` the hook reads."""

    def __init__(self, buf: torch.Tensor, index: int = 0, last: bool = True) -> None:
        self._buf, self._index, self._last = buf, index, last

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last


def test_ddp_hook_cuda_buckets_take_the_nccl_lane(gpu_stubs: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The DDP hook's CUDA buckets run on the same lane class as FSDP2's and the backend's: a
    :class:`~dqcoll.integrations.lane.Lane` over dqcoll's nccl4py transport, made by
    ``DynamiqState.prepare()`` on the bucket's device (unique id through the group's store
    under the state's prefix). The bucket's average is bit for bit dqcoll's API call with the
    hook's seed and step; the caller's stream waits for the event the lane recorded after the
    work (stubbed: a future and a stream without a device)."""
    from dqcoll.integrations import torch_ddp

    waited: list[Any] = []

    class _Stream:
        def wait_event(self, event: Any) -> None:
            waited.append((threading.current_thread().name, id(event)))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(torch_ddp, "_future_for", lambda tensor: torch.futures.Future())
    monkeypatch.setattr(dist, "get_rank", lambda group=None: group.rank())
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: group.size())
    monkeypatch.setattr(dist.distributed_c10d, "_get_process_group_store",
                        lambda group: gpu_stubs["store"])
    numel = 3 * 4096 + 17

    def grads(rank: int) -> torch.Tensor:
        return torch.randn(numel, generator=torch.Generator().manual_seed(70 + rank))

    states = [torch_ddp.DynamiqState(_Group(rank), scheme="dynamiq", bits=5, warmup_steps=0,
                                     runtime=torch_ddp.HookRuntime(algorithm="ring"))
              for rank in range(WORLD)]
    for state in states:  # one process holds both ranks: the same instance number on each
        state._instance = 0

    def rank_body(rank: int) -> dict[str, Any]:
        state = states[rank]
        state.prepare("cuda:0")
        buf = grads(rank)
        averaged = torch_ddp.dynamiq_hook(state, _Bucket(_cuda(buf))).wait()
        out = {"result": averaged.clone(), "lanes": len(state.lane_list),
               "transport": type(state.lane(0).transport), "lane": type(state.lane(0)),
               "info": dict(state.last_info), "seed": state.step_seed(0)}
        state.lane(0).close()
        return out

    results = _run_ranks(rank_body)
    assert dist.PrefixStore("dqcoll-ddp/0/fsdp-group/lane0/", gpu_stubs["store"]).check(
        ["nccl/unique_id"])
    reference = run_local(WORLD, lambda comm: api.allreduce(
        grads(comm.rank), op="avg", scheme="dynamiq", bits=5, algorithm="ring",
        seed=results[0]["seed"], step=0))
    for rank, result in enumerate(results):
        assert result["lane"] is lane_module.Lane and result["lanes"] == 1
        assert result["transport"] is _RecordingTransport
        assert result["info"]["scheme"] == "dynamiq", result["info"]
        assert torch.equal(result["result"], reference[rank]), rank
        mine = [e for e in _HostOrder.log if f"rank {rank}" in e[0]]
        runs = [e for e in mine if e[1] == "run_after"]
        dones = [e for e in mine if e[1] == "done"]
        assert len(runs) == len(dones) == 1 and "dqcoll-lane" in runs[0][0], mine
        assert (dones[0][2]) in [event for _, event in waited], (dones, waited)
