"""Which implementation of the baseline codecs runs: compiled CPU kernels or the torch reference.

The baseline schemes (MX formats, int blocks, THC, global QSGD, bit packing) ask
:func:`cpu_kernels` for each CPU tensor they code; it returns :mod:`.baselines_numba` when the
compiled path should run, else None (the caller runs its ``*_torch`` reference, which defines the
bytes). ``DQCOLL_KERNELS`` (:mod:`dqcoll.envs`):

* ``auto``: numba on CPU tensors when it is importable; otherwise the reference, with one log line
  saying why;
* ``torch``: the reference always;
* ``numba``: the compiled kernels on CPU tensors, and :class:`~dqcoll.errors.UnsupportedError`
  where numba cannot be imported;
* ``triton``: the reference (the baselines have no Triton kernels; the choice is DynamiQ's).

CUDA tensors always take the reference here (numba kernels read host memory).
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
