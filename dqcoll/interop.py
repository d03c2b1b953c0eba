"""torch / NumPy / CuPy buffers in and out, zero-copy.

Collectives work on a torch view of the caller's memory: ``torch.from_numpy`` for NumPy arrays
(including ``ml_dtypes.bfloat16``, viewed through int16), DLPack (``torch.from_dlpack``) for CuPy
and anything else that speaks it. Results are written through that view, so the caller's object is
updated in place and returned as is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .errors import InvalidArgumentError

__all__ = ["as_torch_view", "buffer_kind", "current_stream"]


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
            raise InvalidArgumentError(f"{name}: the NumPy array is read-only; it is updated in place")
        if buf.dtype.name == "bfloat16":  # ml_dtypes: torch cannot wrap it directly
            return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        try:
            return torch.from_numpy(buf)
        except TypeError as exc:
            raise InvalidArgumentError(f"{name}: unsupported NumPy dtype {buf.dtype}: {exc}") from None
    if kind in ("cupy", "dlpack"):
        try:
            return torch.from_dlpack(buf)
        except Exception as exc:
            raise InvalidArgumentError(f"{name}: cannot wrap {type(buf).__name__} via DLPack: {exc}") from exc
    raise InvalidArgumentError(
        f"{name}: expected a torch tensor, a NumPy array or a CuPy array, got {type(buf).__name__}"
    )


def current_stream(tensor: torch.Tensor) -> Any:
    """The caller's current stream for ``tensor``'s device (None on CPU)."""
    if tensor.device.type == "cuda":
        return torch.cuda.current_stream(tensor.device)
    return None
