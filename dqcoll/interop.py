"""torch / NumPy / CuPy buffers in and out, zero-copy.

Collectives work on a torch view of the caller's memory (:func:`as_torch_view`: NumPy, DLPack
for CuPy and others), so the caller's object is updated in place and returned as is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError

__all__ = ["as_torch_view", "buffer_device", "buffer_kind", "caller_stream", "host_to_device",
           "stream_scope"]


def buffer_kind(buf: Any) -> str:
    if isinstance(buf, torch.Tensor):
        return "torch"
    if isinstance(buf, np.ndarray):
        return "numpy"
    if type(buf).__module__.split(".")[0] == "cupy":
        return "cupy"
    if hasattr(buf, "__dlpack__"):
        return "dlpack"
    return type(buf).__name__


def as_torch_view(buf: Any, *, name: str = "buf") -> torch.Tensor:
    """A torch tensor sharing memory with ``buf``; raises for anything that cannot be one."""
    kind = buffer_kind(buf)
    if kind == "torch":
        return buf  # type: ignore[no-any-return]
    if kind == "numpy":
        if not buf.flags.writeable:
            raise InvalidArgumentError(
                f"{name}: the NumPy array is read-only; it is updated in place")
        if buf.dtype.name == "bfloat16":  # ml_dtypes: torch cannot wrap it directly
            return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        try:
            return torch.from_numpy(buf)
        except TypeError as exc:
            raise InvalidArgumentError(
                f"{name}: unsupported NumPy dtype {buf.dtype}: {exc}") from None
    if kind in ("cupy", "dlpack"):
        try:
            return torch.from_dlpack(buf)
        except Exception as exc:
            raise InvalidArgumentError(
                f"{name}: cannot wrap {type(buf).__name__} via DLPack: {exc}") from exc
    raise InvalidArgumentError(
        f"{name}: expected a torch tensor, a NumPy array or a CuPy array, got {type(buf).__name__}")


# DLPack device types (dlpack.h DLDeviceType): kDLCUDA = 2, kDLCUDAManaged = 13.
_DLPACK_CUDA_TYPES = (2, 13)


def buffer_device(buf: Any) -> torch.device | None:
    """The device ``buf`` lives on, without wrapping it; None when it cannot tell."""
    kind = buffer_kind(buf)
    if kind == "torch":
        return buf.device  # type: ignore[no-any-return]
    if kind == "numpy":
        return torch.device("cpu")
    if hasattr(buf, "__dlpack_device__"):
        device_type, index = buf.__dlpack_device__()
        if int(device_type) in _DLPACK_CUDA_TYPES:
            return torch.device("cuda", int(index))
        return torch.device("cpu")
    return None


def caller_stream(buf: Any) -> Any:
    """The caller's stream for ``buf``: CuPy's current one for a CuPy array (as a torch
    ``ExternalStream``), torch's for anything else on a GPU; None for host buffers."""
    device = buffer_device(buf)
    if device is None or device.type != "cuda":
        return None
    if buffer_kind(buf) == "cupy":
        import cupy  # the caller passed a CuPy array, so CuPy is there

        with cupy.cuda.Device(device.index):
            pointer = cupy.cuda.get_current_stream().ptr
        if pointer == 0:  # CuPy's null stream is the legacy default stream, as torch's default
            return torch.cuda.default_stream(device)
        return torch.cuda.ExternalStream(pointer, device=device)
    return torch.cuda.current_stream(device)


@contextlib.contextmanager
def stream_scope(buf: Any) -> Iterator[None]:
    """Inside, torch's current stream is CuPy's current one for a CuPy ``buf``; else a no-op."""
    stream = caller_stream(buf) if buffer_kind(buf) == "cupy" else None
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        yield


def host_to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous ``dtype`` tensor on ``device``; a CPU-to-CUDA copy goes through
    pinned memory, queued on the current stream without a host wait."""
    if device.type == "cuda" and t.device.type == "cpu":
        staged = torch.empty(t.shape, dtype=dtype, pin_memory=True)
        staged.copy_(t)
        return staged.to(device, non_blocking=True)
    return t.to(device=device, dtype=dtype).contiguous()
