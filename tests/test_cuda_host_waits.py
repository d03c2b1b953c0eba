"""A CUDA call queues its work on the caller's stream and returns: no host wait and no copy from
pageable host memory on the stream-ordered (NCCL) path, in the Triton launchers and at the end of
a collective (``execute``). Checked without a GPU: tensors that report ``cuda:0`` hold their data
on the CPU, a torch function mode stands in for the device side (factories given ``device=cuda``
allocate there, ``pin_memory=True`` is noted, every host-to-device ``Tensor.to`` is recorded with
its source's pinning and ``non_blocking``), and the host waits (``torch.cuda.synchronize``,
``Stream.synchronize``, ``Event.synchronize``, reads of device values) are counted; the launchers
and ``execute`` are the real code, the kernel launch itself is recorded (as in
``test_kernels_warmup.py``)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dqcoll import execute
from dqcoll.schemes.dynamiq.codec import SUPER, CodecConfig, Scales, record_nbytes
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


class _FakeCuda(TorchFunctionMode):
    """The device side of torch, on the CPU: records each host-to-device copy as
    ``(pinned source, non_blocking)`` and each read of a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[bool, bool]] = []
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types_: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            return self._to(args[0], list(args[1:]), kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist,
                    torch.Tensor.numpy) and isinstance(args[0], _OnCuda):
            self.reads.append(func.__name__)
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
                self.reads.append("to(cpu)")
            return src.to(*rest, **kwargs)  # stays "on the device"
        if not _is_cuda(device):
            return src.to(*rest, **({"device": device} if device is not None else {}), **kwargs)
        self.copies.append((bool(getattr(src, "fake_pinned", False)), non_blocking))
        return _on_cuda(src.to(*rest, **kwargs).clone())


class _Waits:
    """Counts the host waits torch.cuda offers (each would block the host on the device)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        stream = types.SimpleNamespace(cuda_stream=17, synchronize=self.wait)
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
