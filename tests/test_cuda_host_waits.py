"""A CUDA call queues its work on the caller's stream and returns: no host wait and no copy from
pageable host memory on the stream-ordered (NCCL) path, in the Triton launchers and at the end of
a collective (``execute``). Checked without a GPU: tensors that report ``cuda:0`` hold their data
on the CPU, a torch function mode stands in for the device side (factories given ``device=cuda``
allocate there, ``pin_memory=True`` is noted, every host-to-device ``Tensor.to`` is recorded with
its source's pinning and ``non_blocking``), and the host waits (``torch.cuda.synchronize``,
``Stream.synchronize``, ``Event.synchronize``, reads of device values) are counted; the launchers
and ``execute`` are the real code, the kernel launch itself is recorded (as in
``test_kernels_warmup.py``). A whole DynamiQ collective runs the same way over a stream-ordered
``local`` transport (two rank threads), its launches running the very kernel source in Triton's
interpreter on the tensors' host data."""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily

import dqcoll
from dqcoll import execute
from dqcoll.comm import Communicator
from dqcoll.kernels.codec import SUPER, CodecConfig, Scales, record_nbytes
from dqcoll.transports.local import LocalHub, LocalTransport
from dqcoll.types import Collective

CUDA = torch.device("cuda", 0)


class _OnCuda(torch.Tensor):
    """A CPU tensor that reports itself on ``cuda:0`` (device memory where no GPU is)."""

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return CUDA


def _on_cuda(value: Any) -> Any:
    return value.as_subclass(_OnCuda) if isinstance(value, torch.Tensor) else value


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


# What makes the host wait for a device value (a copy to the host, a conversion to a Python
# number, a count the host needs: nonzero, a boolean mask).
_READS = (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
          torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.nonzero, torch.Tensor.nonzero, torch.masked_select,
          torch.Tensor.masked_select)


def _caller() -> str:
    """The innermost dqcoll module on the stack (where a read or a copy comes from)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("dqcoll."):
            return str(name)
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


class _FakeCuda(TorchFunctionMode):
    """The device side of torch, on the CPU: records each host-to-device copy as
    ``(pinned source, non_blocking)`` and each read of a device value on the host (in
    ``reads``, with the dqcoll module that made it in ``read_sites``). Copies to the host
    (``cpu()``, ``to("cpu")``) return host tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[bool, bool]] = []
        self.reads: list[str] = []
        self.read_sites: list[tuple[str, str]] = []
        self.blocking_sites: list[str] = []

    def _read(self, what: str) -> None:
        self.reads.append(what)
        self.read_sites.append((what, _caller()))

    def __torch_function__(self, func: Any, types_: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            return self._to(args[0], list(args[1:]), kwargs)
        if func in _READS and isinstance(args[0], _OnCuda):
            self._read(func.__name__)
            if func is torch.Tensor.cpu:
                return func(*args, **kwargs).as_subclass(torch.Tensor).clone()
        if (func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
                and isinstance(args[1], _OnCuda) and args[1].dtype == torch.bool):
            self._read("boolean mask")  # the host needs the mask's count
        if kwargs.pop("pin_memory", False):
            out = func(*args, **kwargs)
            out.fake_pinned = True
            return out
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
            return _on_cuda(func(*args, **kwargs))
        return func(*args, **kwargs)

    def _to(self, src: torch.Tensor, rest: list[Any], kwargs: dict[str, Any]) -> Any:
        device = kwargs.pop("device", None)
        for i, arg in enumerate(rest):
            if isinstance(arg, (torch.device, str)):
                device = rest.pop(i)
                break
        non_blocking = bool(kwargs.pop("non_blocking", False))
        if isinstance(src, _OnCuda):
            if device is not None and not _is_cuda(device):
                self._read("to(cpu)")
                return src.to(*rest, **kwargs).as_subclass(torch.Tensor).clone()
            return src.to(*rest, **kwargs)  # stays "on the device"
        if not _is_cuda(device):
            return src.to(*rest, **({"device": device} if device is not None else {}), **kwargs)
        pinned = bool(getattr(src, "fake_pinned", False))
        self.copies.append((pinned, non_blocking))
        if not (pinned and non_blocking):
            self.blocking_sites.append(_caller())
        return _on_cuda(src.to(*rest, **kwargs).clone())


class _Waits:
    """Counts the host waits torch.cuda offers (each would block the host on the device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        stream = types.SimpleNamespace(cuda_stream=17, synchronize=self.wait,
                                       wait_event=lambda event: None)
        monkeypatch.setattr(torch.cuda, "synchronize", self.wait)
        monkeypatch.setattr(torch.cuda.Stream, "synchronize", self.wait)
        monkeypatch.setattr(torch.cuda.Event, "synchronize", self.wait)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)

    def wait(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1


@pytest.fixture
def triton_on_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The Triton launchers as on a GPU (compiled kernel module, GPU launch configurations),
    each launch recorded instead of run; the per-device caches emptied before and after."""
    pytest.importorskip("triton")
    from dqcoll.kernels import _dynamiq_kernels, _params, dynamiq_triton

    launches: list[str] = []
    monkeypatch.setattr(dynamiq_triton, "_launch",
                        lambda kernel, *args, **kwargs: launches.append(kernel.__name__))
    monkeypatch.setattr(dynamiq_triton, "_kernels_for", lambda device: (_dynamiq_kernels, False))
    monkeypatch.setattr(dynamiq_triton, "_warmed", set())
    dynamiq_triton._level_params.cache_clear()
    _params.RoundingParams.build.cache_clear()
    try:
        yield dynamiq_triton, launches
    finally:
        dynamiq_triton._level_params.cache_clear()
        _params.RoundingParams.build.cache_clear()


def test_triton_launchers_neither_wait_nor_copy_from_pageable_memory(
        triton_on_fake_cuda: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the warm-up, the Triton launchers of a call on CUDA tensors (statistics with the
    host's ``valid`` counts, encode and fused hops at odd row offsets under two fresh keys,
    decodes, the restore with the host's ``valid``) copy from the host only from pinned memory
    with ``non_blocking=True``, and never wait on the host (no synchronize, no read of a device
    value): they queue their work on the stream and return."""
    triton, launches = triton_on_fake_cuda
    waits = _Waits(monkeypatch)
    config = CodecConfig(scales=Scales.HIERARCHICAL)
    width, rows = 4, 7
    size = record_nbytes(width, config.scales)
    with _FakeCuda() as fake:
        triton.warm_up(CUDA)
        x = torch.randn(rows, SUPER, device=CUDA)
        index_base = torch.arange(rows, dtype=torch.int64, device=CUDA) * SUPER
        out = torch.zeros(rows * SUPER, device=CUDA)
        records = torch.zeros(rows * size + 1, dtype=torch.uint8, device=CUDA)
        fake.copies.clear()
        launches.clear()
        # as DynamiqCall keeps them: valid counts on the host, the rest on the device
        valid = torch.full((rows,), SUPER, dtype=torch.int64)
        valid[-1] = 100
        centred, mean, _ = triton.stats_center(x, valid)
        for key in (101, 102):  # a new key per call: a new permutation table
            a, b = 1, 4
            coded = records[1 : 1 + (b - a) * size].view(b - a, size)
            triton.encode(centred[a:b], width, index_base[a:b], 0, 2, key, config, out=coded)
            hop = records[:(b - a) * size].view(b - a, size)
            triton.decode_accumulate_encode(coded, width, centred[a:b].clone(), index_base[a:b],
                                            0, 2, key, config, out=hop)
            triton.decode_accumulate(hop, width, config, centred[a:b])
            triton.decode(hop, width, config, out=centred[a:b])
        triton.restore(centred[1:6], mean[1:6], index_base[1:6], valid[1:6], out)
    assert len(launches) == 10, launches
    assert fake.copies, "the host's valid counts reach the device"
    assert all(pinned and non_blocking for pinned, non_blocking in fake.copies), fake.copies
    assert waits.count == 0 and not fake.reads, (waits.count, fake.reads)


class _StreamOrdered:
    """A stream-ordered transport's host wait, recorded."""

    stream_ordered = True

    def __init__(self) -> None:
        self.waits: list[str] = []

    def synchronize(self, *, what: str = "synchronize") -> None:
        self.waits.append(what)


@pytest.mark.parametrize("collective", [Collective.ALLREDUCE, Collective.REDUCE_SCATTER])
def test_collective_on_cuda_ends_without_a_host_wait(collective: Collective) -> None:
    """The end of a collective over a stream-ordered transport (the final decode into the
    caller's buffer): on a CUDA buffer it queues the decode behind the transfers and returns
    without waiting for them on the host; on a CPU buffer it waits first (so a late failure
    leaves the buffer untouched, ``test_gpu_path.py``)."""

    def finish(buffer: torch.Tensor) -> tuple[list[str], list[str]]:
        out = torch.zeros(buffer.numel() // 2).as_subclass(type(buffer))
        call = types.SimpleNamespace(tensor=buffer, out=out, collective=collective,
                                     what="allreduce#3")
        comm = types.SimpleNamespace(transport=_StreamOrdered(), rank=1, world_size=2)
        decoded: list[str] = []
        coded = types.SimpleNamespace(finish=lambda t: decoded.append(t.device.type),
                                      finish_shard=lambda r, t: decoded.append(t.device.type))
        execute._restore(call, comm, coded, 0)  # type: ignore[arg-type]
        return comm.transport.waits, decoded

    assert finish(torch.zeros(2 * SUPER).as_subclass(_OnCuda)) == ([], ["cuda"])
    assert finish(torch.zeros(2 * SUPER)) == (["allreduce#3 (last transfers)"], ["cpu"])


# -- a whole collective on CUDA buffers ----------------------------------------------------------


class _Event:
    """``torch.cuda.Event`` on the CPU: recording and stream waits are free; a host wait
    counts."""

    def __init__(self, waits: _Waits) -> None:
        self._waits = waits

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._waits.wait()


class _Stream:
    """``torch.cuda.Stream`` on the CPU (the executor's side stream): waits on events are
    ordering only; a host wait counts."""

    def __init__(self, waits: _Waits) -> None:
        self._waits = waits
        self.cuda_stream = 18

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        self._waits.wait()


class _StreamOrderedLocal(LocalTransport):
    """The ``local`` transport declared stream-ordered, as NCCL is: the executor queues its
    exchanges on a side stream and ``execute`` does not wait for a CUDA buffer's last transfers;
    a host wait (``synchronize``) counts."""

    stream_ordered = True

    def __init__(self, hub: LocalHub, rank: int, waits: _Waits) -> None:
        super().__init__(hub, rank)
        self._waits = waits

    def synchronize(self, *, what: str = "synchronize") -> None:
        self._waits.wait()


@pytest.fixture
def cuda_world(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``run(world_size, body)``: ``body(comm, fake)`` on each rank's thread, with a communicator
    on ``cuda:0`` over a stream-ordered local transport, inside that thread's :class:`_FakeCuda`
    (``fake``); returns the bodies' results and the host waits counted. The Triton launchers are
    the real code on the GPU's launch configurations; each launch runs the kernel source in
    Triton's interpreter on the tensors' host data (the bytes the GPU computes). The level
    tables are on the device before the call, as the communicator's warm-up leaves them."""
    pytest.importorskip("triton")
    from dqcoll.kernels import _dynamiq_kernels, _params, dynamiq_triton

    waits = _Waits(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(waits))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream(waits))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    # the caching allocator's bookkeeping of a side stream's use: nothing to do on the CPU
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    interpreted = dynamiq_triton._interpreted_kernels()
    launch = dynamiq_triton._launch

    def run_interpreted(kernel: Any, cfg: Any, n_rows: int, _: bool, *args: Any,
                        **constexprs: Any) -> None:
        host = [a.as_subclass(torch.Tensor) if isinstance(a, torch.Tensor) else a for a in args]
        with _pop_mode_temporarily():
            launch(getattr(interpreted, kernel.__name__), cfg, n_rows, True, *host, **constexprs)

    monkeypatch.setattr(dynamiq_triton, "_launch", run_interpreted)
    monkeypatch.setattr(dynamiq_triton, "_kernels_for", lambda device: (_dynamiq_kernels, False))
    monkeypatch.setattr(dynamiq_triton, "_warmed", {str(CUDA)})  # its tables are made below
    dynamiq_triton._level_params.cache_clear()
    _params.RoundingParams.build.cache_clear()
    with _FakeCuda():
        for widths in dynamiq_triton.FORMATS.values():
            for width in widths:
                for levels in dynamiq_triton.Levels:
                    dynamiq_triton._level_params(width, levels, CUDA)

    def run(world_size: int, body: Callable[[Communicator, _FakeCuda], Any]) -> tuple[
            list[Any], int]:
        hub = LocalHub(world_size, timeout_s=60)
        results: list[Any] = [None] * world_size
        errors: list[BaseException] = []

        def rank_thread(rank: int) -> None:
            try:
                with _FakeCuda() as fake:
                    comm = Communicator(_StreamOrderedLocal(hub, rank, waits), device=CUDA)
                    results[rank] = body(comm, fake)
            except BaseException as exc:  # re-raised below
                errors.append(exc)
                hub.abort(f"rank {rank} raised {exc!r}")

        threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results, waits.count

    try:
        yield run
    finally:
        dynamiq_triton._level_params.cache_clear()
        _params.RoundingParams.build.cache_clear()


def _heavy_tailed(rank: int, numel: int) -> torch.Tensor:
    """Per-row scales over several orders of magnitude, so that the call uses many widths."""
    rng = np.random.default_rng(300 + rank)
    scale = np.exp(rng.standard_normal(-(-numel // SUPER)) * 2.0).repeat(SUPER)[:numel]
    return torch.from_numpy((rng.standard_normal(numel) * scale).astype(np.float32))


def _collective(comm: Any, x: torch.Tensor, kind: str, options: dict[str, Any]) -> torch.Tensor:
    """One call of ``kind`` on ``x`` (the result: ``x`` itself, or the reduce-scatter's
    ``out``), tiled so that two tiles are in flight."""
    common = dict(comm=comm, seed=7, algorithm="ring", tile_nbytes=2 * SUPER * 4, **options)
    if kind == "allreduce":
        dqcoll.allreduce(x, **common)
        return x
    out = torch.empty(x.numel() // comm.world_size, dtype=x.dtype, device=x.device)
    dqcoll.reduce_scatter(x, out, **common)
    return out


# The host reads device values only where it needs them: the range check and the argument check's
# result (every rank raises together before data moves), and the summed statistics that the bit
# allocation, and with it the chunk geometry, is planned from.
_PLANNING_READS = {"dqcoll.prepare", "dqcoll.validate", "dqcoll.schemes.dynamiq.allocation"}


@pytest.mark.parametrize(("kind", "numel", "options"), [
    ("allreduce", 5 * SUPER + 3, {}),
    ("allreduce", 6 * SUPER + 1, {"balance": "shards"}),  # shard 1 loses a row past the end
    ("reduce_scatter", 2 * (3 * SUPER + 5), {}),
])
def test_dynamiq_collective_on_cuda_queues_without_host_waits(
        cuda_world: Any, monkeypatch: pytest.MonkeyPatch, kind: str, numel: int,
        options: dict[str, Any]) -> None:
    """A whole DynamiQ collective on CUDA buffers over a stream-ordered transport (2 ranks,
    ring, tiled, default options: hop widths, 16-bit statistics; the shard layout, its last row
    dropped; the reduce-scatter) copies from the host only from pinned memory with
    ``non_blocking=True`` (the argument check's vector, the reorder's tables, the launchers'
    arrays), never synchronizes, and reads device values only for its planning (the range and
    argument checks, the summed statistics): it queues its work on the stream and returns. Its
    result is bit for bit the torch reference's on CPU tensors."""

    def on_cpu(comm: Any) -> bytes:
        result = _collective(comm, _heavy_tailed(comm.rank, numel), kind, options)
        return result.numpy().tobytes()

    with monkeypatch.context() as m:
        m.setenv("DQCOLL_KERNELS", "torch")
        expected = dqcoll.testing.run_local(2, on_cpu)

    def on_cuda(comm: Any, fake: _FakeCuda) -> tuple[bytes, list[str], list[tuple[str, str]],
                                                      dict[str, str]]:
        x = _on_cuda(_heavy_tailed(comm.rank, numel))
        fake.copies.clear()
        result = _collective(comm, x, kind, options).as_subclass(torch.Tensor)
        return (result.numpy().tobytes(), fake.blocking_sites, fake.read_sites,
                dict(comm.last_info["kernels"]))

    results, waits = cuda_world(2, on_cuda)
    assert waits == 0
    for rank, (got, blocking, reads, kernels) in enumerate(results):
        assert blocking == [], (rank, blocking)  # every copy pinned and non-blocking
        assert {site for _, site in reads} <= _PLANNING_READS, (rank, reads)
        assert kernels["encode"] == "triton", kernels
        assert got == expected[rank], rank
