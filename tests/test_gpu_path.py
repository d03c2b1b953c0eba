"""The GPU path's logic, tested on a CPU machine: device routing, what kernels ran, the
reduce-scatter's shard-only decode, the Triton launch device, the torch backend over NCCL,
close() while async calls run, a stream-ordered transport's late failure, subgroups over NCCL and
the GPU check's time limits.

Where a GPU would be needed, the piece that needs it is replaced by a recorder checked against
the real library's signature (``torch.cuda.device``, ``torch.distributed.get_backend``); the rest
is the real code. The cases only a GPU can show are in ``tools/gpu_check.sh``.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dqcoll
from dqcoll import executor
from dqcoll.errors import CollectiveTimeoutError, InvalidArgumentError
from dqcoll.schemes.dynamiq.scheme import DynamiqCall
from dqcoll.testing import run_local
from dqcoll.transports.subgroup import SubgroupTransport

CODEC_STEPS = {"encode", "decode", "decode_accumulate", "decode_accumulate_encode", "restore",
               "decode_restore"}


def _data(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * torch.exp(torch.randn(1, generator=g))


class _CudaLooking(torch.Tensor):
    """A CPU tensor that reports itself on ``cuda:1``: stands in for device memory where only the
    device is read (no GPU here)."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", 1)


# -- what ran -----------------------------------------------------------------------------------


def test_default_call_reports_numba_for_every_step() -> None:
    """A default dynamiq all-reduce of CPU tensors (3 ranks, so there are fused hops) reports, in
    ``last_info["kernels"]``, numba for every step that ran: statistics, reorder, encode, the
    fused hops and the final decode; the bit allocation (host code, ``allocation_impl``) says
    numba: the default (hop widths) runs its compiled search."""
    pytest.importorskip("numba")

    def body(comm: Any) -> tuple[dict[str, str], str]:
        dqcoll.allreduce(_data(comm.rank, 3 * 4096 + 5), algorithm="ring", seed=1)
        return dict(comm.last_info["kernels"]), comm.last_info["allocation_impl"]

    for ran, allocation in run_local(3, body):
        assert {"stats", "center_gather", "encode", "decode_accumulate_encode"} <= set(ran), ran
        assert {"decode_restore", "restore"} & set(ran), ran
        assert set(ran.values()) == {"numba"}, ran
        # the default allocation (hop widths) runs compiled on the host, and says so
        assert allocation == "numba"


def test_without_numba_the_call_says_torch_and_warns_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With numba made unavailable, every step of a default call reports the torch reference,
    and the fallback is logged as a warning once (not once per call or per rank)."""
    from dqcoll import kernels

    monkeypatch.setattr(kernels, "numba_available", lambda: "numba is not importable (test)")
    monkeypatch.setattr(kernels, "_logged", set())

    def body(comm: Any) -> list[dict[str, str]]:
        ran = []
        for _ in range(2):
            dqcoll.allreduce(_data(comm.rank, 2 * 4096), seed=1)
            ran.append(dict(comm.last_info["kernels"]))
        return ran

    with caplog.at_level(logging.WARNING, logger="dqcoll"):
        results = run_local(2, body)
    for ran in (r for rank in results for r in rank):
        assert set(ran.values()) == {"torch"}, ran
        assert CODEC_STEPS & set(ran), ran
    warnings = [r for r in caplog.records if "numba is not importable (test)" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert warnings[0].levelno == logging.WARNING


# -- reduce-scatter ---------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_reduce_scatter_decodes_only_its_shard(monkeypatch: pytest.MonkeyPatch,
                                               kernels: str) -> None:
    """A dynamiq reduce-scatter restores only this rank's shard (``finish_shard``, with the
    compiled restore and with the torch one): the whole-buffer ``finish`` is never called, and
    the shard equals the matching part of the all-reduce with the same arguments, on every rank
    (3 ranks, shards of 5 super-groups + 7)."""
    monkeypatch.setenv("DQCOLL_KERNELS", kernels)
    n, numel = 3, 3 * (5 * 256 + 7)

    def allreduce(comm: Any) -> torch.Tensor:
        whole = _data(comm.rank, numel)
        dqcoll.allreduce(whole, algorithm="ring", seed=2, step=0, balance="shards")
        return whole.view(n, -1)[comm.rank]

    def reduce_scatter(comm: Any) -> tuple[torch.Tensor, dict[str, str]]:
        out = torch.full((numel // n,), float("nan"))
        dqcoll.reduce_scatter(_data(comm.rank, numel), out, algorithm="ring", seed=2, step=0)
        return out, dict(comm.last_info["kernels"])

    parts = run_local(n, allreduce)

    def refuse(self: Any, out: torch.Tensor) -> None:
        raise AssertionError("reduce-scatter decoded the whole buffer")

    monkeypatch.setattr(DynamiqCall, "finish", refuse)
    shards = run_local(n, reduce_scatter)
    for rank, ((out, ran), part) in enumerate(zip(shards, parts, strict=True)):
        assert not torch.isnan(out).any(), rank
        assert torch.equal(out, part), rank
        assert ran["restore"] == ("torch" if kernels == "torch" else "numba"), ran


# -- device routing ------------------------------------------------------------------------------


@pytest.fixture
def gloo_world(tmp_path: Path) -> Any:
    """A one-rank gloo process group in this process (destroyed afterwards)."""
    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_cuda_tensor_on_gloo_communicator_is_refused(gloo_world: Any) -> None:
    """A CUDA tensor handed to a gloo communicator raises before anything moves, naming the
    tensor's device, the transport and what to do, instead of a gloo send of device memory."""
    comm = dqcoll.init(backend="torch")
    try:
        assert comm.devices == ("cpu",)
        tensor = torch.zeros(4096).as_subclass(_CudaLooking)
        with pytest.raises(InvalidArgumentError) as info:
            dqcoll.allreduce(tensor, comm=comm)
        text = str(info.value)
        assert "cuda:1" in text and "torch/gloo" in text and "cpu tensors only" in text, text
    finally:
        comm.close()


def _fake_backend(real: Any) -> Any:
    def get_backend(group: Any = None) -> str:
        return "nccl"

    assert list(inspect.signature(get_backend).parameters) == list(
        inspect.signature(real).parameters)
    return get_backend


def test_torch_backend_over_nccl_group_defaults_to_the_gpu(
        gloo_world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dqcoll.init(backend="torch")`` over an NCCL group (faked: ``get_backend`` says nccl)
    gives a communicator on the current CUDA device without ``device=``: its argument check and
    barrier tensors live there, not on the CPU (which NCCL refuses), and a CPU tensor is refused
    up front with a clear error."""
    monkeypatch.setattr(dist, "get_backend", _fake_backend(dist.get_backend))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(dqcoll.kernels, "warm_up", lambda device: None)  # no GPU to compile for
    comm = dqcoll.init(backend="torch")
    try:
        assert comm.device == torch.device("cuda", 0)
        assert comm.transport.device == torch.device("cuda", 0)  # its barrier's tensor
        assert comm.devices == ("cuda",)
        with pytest.raises(InvalidArgumentError, match="cuda tensors only"):
            dqcoll.allreduce(torch.zeros(4096), comm=comm)  # a CPU tensor on an NCCL group
    finally:
        comm.close()


def test_gloo_backend_refuses_an_existing_nccl_group(
        gloo_world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``dqcoll.init(backend="gloo")`` with torch.distributed already initialised with NCCL
    raises, saying which backend is there and to use backend='torch'."""
    monkeypatch.setattr(dist, "get_backend", _fake_backend(dist.get_backend))
    with pytest.raises(InvalidArgumentError, match="backend='torch'") as info:
        dqcoll.init(backend="gloo")
    assert "'nccl'" in str(info.value)


def test_tile_size_follows_the_tensor() -> None:
    """The default tile size comes from the tensor's device (smaller on CPU than on a GPU), and
    the device is read from the buffer itself without wrapping it: a read-only NumPy array is on
    the CPU, a tensor on ``cuda:1`` on cuda:1, an object of unknown kind on no device (the call
    then takes the communicator's)."""
    assert executor.default_tile_nbytes(torch.device("cpu")) < executor.default_tile_nbytes(
        torch.device("cuda", 0))
    from dqcoll.interop import buffer_device

    read_only = np.zeros(4, dtype=np.float32)
    read_only.flags.writeable = False
    assert buffer_device(torch.zeros(4)) == torch.device("cpu")
    assert buffer_device(read_only) == torch.device("cpu")
    assert buffer_device(torch.zeros(4).as_subclass(_CudaLooking)) == torch.device("cuda", 1)
    assert buffer_device(object()) is None


# -- Triton launches under the tensors' device ----------------------------------------------------


def test_triton_launch_runs_under_the_tensors_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled (non-interpreted) launch with tensors on ``cuda:1`` happens while cuda:1 is
    torch's current device (Triton takes the device and stream from there), whatever the
    calling thread's current device; the guard is torch.cuda.device, with its real signature."""
    pytest.importorskip("triton")
    from dqcoll.kernels import dynamiq_triton
    from dqcoll.kernels._launch import LaunchConfig

    current: list[int | None] = [None]
    entered: list[int] = []

    class DeviceGuard:
        def __init__(self, device: Any) -> None:
            self.index = torch.device(device).index

        def __enter__(self) -> None:
            entered.append(self.index)
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc: object) -> None:
            current[0] = self.previous

    assert list(inspect.signature(DeviceGuard).parameters) == list(
        inspect.signature(torch.cuda.device).parameters)
    monkeypatch.setattr(torch.cuda, "device", DeviceGuard)
    launched: list[int | None] = []

    class Kernel:
        def __getitem__(self, grid: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> None:
                launched.append(current[0])
            return run

    x = torch.zeros(2, 256).as_subclass(_CudaLooking)
    dynamiq_triton._launch(Kernel(), LaunchConfig(rows_per_program=8, num_warps=4), 2, False,
                           x, 256, 2, ROWS=8)
    assert launched == [1] and entered == [1]


# -- close() waits for pending async calls ------------------------------------------------------


def test_close_waits_for_pending_async_calls() -> None:
    """``Communicator.close()`` right after ``async_op=True`` calls closes the transport only
    once they have finished (their handles complete, results correct), never under them."""

    def body(comm: Any) -> tuple[bool, bool]:
        original = comm.transport.exchange

        def slow(sends: Any, recvs: Any, *, what: str) -> None:
            time.sleep(0.02)
            original(sends, recvs, what=what)

        comm.transport.exchange = slow
        handles = [dqcoll.allreduce(torch.ones(2 * 4096), scheme="none", async_op=True)
                   for _ in range(3)]
        state: dict[str, bool] = {}
        close = comm.transport.close

        def recording_close() -> None:
            state["done"] = all(h.is_completed() for h in handles)
            close()

        comm.transport.close = recording_close
        comm.close()
        ok = all(torch.equal(h.wait(), torch.full((2 * 4096,), 2.0)) for h in handles)
        return state["done"], ok

    assert run_local(2, body) == [(True, True)] * 2


# -- a late failure of a stream-ordered transport --------------------------------------------------


class _LateFailingTransport:
    """A stream-ordered transport over the local one whose exchanges of one call "time out" the
    way NCCL's do: the exchange returns at once, its receive buffers hold garbage, and the error
    shows only at the host wait (``synchronize``)."""

    stream_ordered = True

    def __init__(self, inner: Any, fail_at: str) -> None:
        self.inner, self.fail_at = inner, fail_at
        self.rank, self.world_size = inner.rank, inner.world_size
        self.counters, self.name, self.devices = inner.counters, "late-failing", ("cpu",)
        self.failure: BaseException | None = None

    def exchange(self, sends: Any, recvs: Any, *, what: str) -> None:
        if self.failure is None and self.fail_at in what:
            self.failure = CollectiveTimeoutError(
                f"rank {self.rank}: timed out after 1 s at {what}")
        if self.failure is not None:
            for _, buffer in recvs:
                buffer.view(torch.uint8).fill_(0x7F)  # garbage, as an aborted receive leaves
            return
        self.inner.exchange(sends, recvs, what=what)

    def synchronize(self, *, what: str = "synchronize") -> None:
        if self.failure is not None:
            raise self.failure

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        self.inner.allreduce(tensor, op, what=what)

    def barrier(self, *, what: str = "barrier") -> None:
        self.inner.barrier(what=what)

    def abort(self, reason: str) -> None:
        self.inner.abort(reason)

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_late_transport_failure_leaves_the_buffer_untouched(collective: str) -> None:
    """When a stream-ordered transport's exchange fails after it returned (a timeout found by the
    watchdog), a collective on CPU buffers raises that error and the caller's buffer (and out)
    keep their values: the result is copied out only after the host saw every transfer complete
    (CUDA buffers do not wait: ``test_cuda_host_waits.py``)."""
    from dqcoll.comm import Communicator, set_default_comm
    from dqcoll.transports.local import LocalHub

    n, numel = 2, 2 * 4096
    hub = LocalHub(n, timeout_s=20)
    results: list[Any] = [None] * n

    def rank_body(rank: int) -> None:
        transport = _LateFailingTransport(hub.transport(rank), "reduce")
        comm = Communicator(transport, device="cpu")  # type: ignore[arg-type]
        set_default_comm(comm, thread_local=True)
        x = _data(rank, numel)
        before = x.clone()
        out = torch.full((numel // n,), -1.0)
        try:
            if collective == "allreduce":
                dqcoll.allreduce(x, algorithm="ring", tile_nbytes=0)
            else:
                dqcoll.reduce_scatter(x, out, algorithm="ring", tile_nbytes=0)
            results[rank] = ("returned", torch.equal(x, before), bool((out == -1).all()))
        except CollectiveTimeoutError as exc:
            results[rank] = ("raised", torch.equal(x, before), bool((out == -1).all()), str(exc))
        finally:
            set_default_comm(None, thread_local=True)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for rank, result in enumerate(results):
        assert result is not None and result[0] == "raised", (rank, result)
        assert result[1] and result[2], (rank, result)
        assert "reduce" in result[3], result


# -- subgroups keep the parent's stream ordering --------------------------------------------------


def test_subgroup_of_a_stream_ordered_transport_is_stream_ordered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A SubgroupTransport over a stream-ordered (NCCL) parent is stream-ordered itself and has
    the parent's device, so the executor picks its stream driver for CUDA tiles (overlap) rather
    than the thread driver; over a thread-driven parent it stays thread-driven."""
    from dqcoll.transports.local import LocalHub

    parent = LocalHub(2).transport(0)
    assert not SubgroupTransport(parent, [0, 1]).stream_ordered
    parent.stream_ordered = True  # type: ignore[attr-defined]
    parent.device = torch.device("cuda", 0)  # type: ignore[attr-defined]
    sub = SubgroupTransport(parent, [0, 1])
    assert sub.stream_ordered and sub.device == torch.device("cuda", 0)
    chosen: list[str] = []

    class StreamDriver:
        def __init__(self, transport: Any, device: torch.device) -> None:
            chosen.append("stream")

    monkeypatch.setattr(executor, "_StreamDriver", StreamDriver)
    executor._make_driver(sub, torch.device("cuda", 0), 2, "allreduce#0")
    assert chosen == ["stream"]


@pytest.mark.gpu
def test_ranks_on_the_second_gpu_launch_there() -> None:
    """(Two GPUs.) Ranks whose communicator and tensors are on cuda:1, while every thread's
    current device is 0, get exactly the CPU run's bits: their warm-up and every kernel launch on
    cuda:1, where the data is."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    torch.cuda.set_device(0)

    def on_gpu(comm: Any) -> torch.Tensor:
        torch.cuda.set_device(0)  # each rank thread: current device 0, data on 1
        x = _data(comm.rank, 3 * 4096 + 5).to("cuda:1")
        dqcoll.allreduce(x, seed=1, step=0)
        return x.cpu()

    def on_cpu(comm: Any) -> torch.Tensor:
        x = _data(comm.rank, 3 * 4096 + 5)
        dqcoll.allreduce(x, seed=1, step=0)
        return x

    for rank, (got, expected) in enumerate(zip(run_local(2, on_gpu, device="cuda:1"),
                                               run_local(2, on_cpu), strict=True)):
        assert torch.equal(got, expected), rank
