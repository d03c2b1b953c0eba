"""Which implementation of the baseline codecs runs: compiled CPU kernels or the torch reference.

:func:`cpu_kernels` returns :mod:`.baselines_numba` for CPU tensors when ``DQCOLL_KERNELS`` is
``auto`` (numba importable; otherwise one log line per reason) or ``numba`` (raises
:class:`~dqcoll.errors.UnsupportedError` without numba), else None: the caller runs its ``*_torch``
reference, which defines the bytes. CUDA tensors always take the reference (docs/kernels.md).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from .. import envs
from ..errors import UnsupportedError
from .cpu_runtime import numba_available

__all__ = ["cpu_kernels"]

log = logging.getLogger("dqcoll")
_logged: set[str] = set()  # fallback reasons already logged: one per distinct reason, for good


def cpu_kernels(device: torch.device) -> ModuleType | None:
    """The compiled baseline kernels for tensors on ``device``, or None for the reference."""
    choice = envs.kernels()
    if device.type != "cpu" or choice in ("torch", "triton"):
        return None
    reason = numba_available()
    if reason is not None:
        if choice == "numba":
            raise UnsupportedError(f"DQCOLL_KERNELS=numba was requested but {reason}")
        if reason not in _logged:
            _logged.add(reason)
            log.warning("dqcoll: baseline codecs use the torch reference on CPU: %s", reason)
        return None
    from . import baselines_numba

    return baselines_numba
