"""Error metrics for compressed collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["vnmse"]


def _as_float64(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64).reshape(-1)
    if hasattr(value, "get") and type(value).__module__.startswith("cupy"):
        value = value.get()
    return torch.from_numpy(np.asarray(value, dtype=np.float64).reshape(-1))


def vnmse(estimate: Any, exact: Any) -> float:
    """Vector normalised MSE ``||estimate - exact||^2 / ||exact||^2`` in float64.

    Tensors or NumPy/CuPy arrays, or equal-length sequences of them (summed before dividing).
    An all-zero ``exact`` gives 0.0 if the estimate is exact too, else ``inf``.
    """
    if isinstance(estimate, Sequence) and not isinstance(estimate, (torch.Tensor, np.ndarray)):
        if not isinstance(exact, Sequence) or len(exact) != len(estimate):
            raise ValueError("estimate and exact must be sequences of the same length")
        pairs = [(_as_float64(e), _as_float64(x)) for e, x in zip(estimate, exact, strict=True)]
    else:
        pairs = [(_as_float64(estimate), _as_float64(exact))]
    err = norm = 0.0
    for e, x in pairs:
        if e.shape != x.shape:
            raise ValueError(f"shape mismatch: estimate {tuple(e.shape)} vs exact {tuple(x.shape)}")
        err += float(((e - x) ** 2).sum())
        norm += float((x**2).sum())
    if norm == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / norm
