"""The codecs' arithmetic, chosen per device: the torch reference defines the bytes, the compiled
kernels match it (docs/kernels.md). :func:`dynamiq_ops` picks Triton for CUDA tensors, numba for
CPU tensors, where importable, else the torch reference; ``DQCOLL_KERNELS=torch|numba|triton``
forces one (raising where it cannot run). :func:`warm_up` compiles ahead of the first call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator

import torch

from .. import envs
from ..errors import UnsupportedError
from . import codec
from .cpu_runtime import import_problem, numba_available
from .ops import DynamiqOps, check_format

__all__ = ["DynamiqOps", "check_format", "dynamiq_ops", "numba_available", "torch_ops",
           "triton_available", "warm_up"]

log = logging.getLogger("dqcoll")


@functools.lru_cache(maxsize=1)
def triton_available() -> str | None:
    """None when Triton can be used, else the reason it cannot (checked once per process)."""
    return import_problem("triton")


@functools.lru_cache(maxsize=1)
def torch_ops() -> DynamiqOps:
    """The torch reference's DynamiQ operations (any device; the definition of the bytes)."""
    return DynamiqOps("torch", codec.stats_center_torch, codec.encode_torch, codec.decode_torch,
                      codec.decode_accumulate_torch, codec.decode_accumulate_encode_torch)


_logged: set[str] = set()  # fallback reasons already logged: one per distinct reason, for good


def _fallback(why: str, device: torch.device) -> DynamiqOps:
    if why not in _logged:
        _logged.add(why)
        log.warning("dqcoll: using the torch reference for %s tensors: %s", device.type, why)
    return torch_ops()


def dynamiq_ops(device: torch.device) -> DynamiqOps:
    choice = envs.kernels()
    forced = choice != "auto"
    if not forced:
        choice = {"cpu": "numba", "cuda": "triton"}.get(device.type, "torch")
    if choice == "torch":
        return torch_ops()
    reason = numba_available() if choice == "numba" else triton_available()
    if reason is not None:
        if forced:
            raise UnsupportedError(f"DQCOLL_KERNELS={choice} was requested but {reason}")
        return _fallback(reason, device)
    if choice == "numba":
        if device.type != "cpu":
            raise UnsupportedError(
                f"DQCOLL_KERNELS=numba was requested but the numba kernels take CPU tensors, "
                f"got {device.type} tensors")
        from . import dynamiq_numba

        return dynamiq_numba.OPS
    try:
        from . import dynamiq_triton  # type: ignore[attr-defined]
    except ImportError as exc:
        if forced:
            raise
        return _fallback(f"Triton kernels are not available ({exc})", device)
    return dynamiq_triton.OPS  # type: ignore[no-any-return]


# a warm-up longer than this is compiling (loading cached kernels takes well under a second)
COMPILE_NOTICE_S = 3.0


@contextlib.contextmanager
def _compile_notice(what: str, where: str) -> Iterator[None]:
    """Log a line if the block runs longer than :data:`COMPILE_NOTICE_S`, and another when done."""
    start = time.perf_counter()
    notice = ("dqcoll: compiling the %s (first use on this machine, can take minutes; cached "
              "afterwards in %s) ...", what, where)
    timer = threading.Timer(COMPILE_NOTICE_S, log.warning, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if time.perf_counter() - start >= COMPILE_NOTICE_S:
            log.warning("dqcoll: %s compiled in %.0f s", what, time.perf_counter() - start)


def warm_up(device: torch.device) -> None:
    """Compile (or load from the disk cache) the kernels :func:`dynamiq_ops` picks for
    ``device`` now, so that ranks started together do not compile at different steps."""
    ops = dynamiq_ops(device)
    if ops.name == "numba":
        import numba

        from . import dynamiq_numba

        where = getattr(numba.config, "CACHE_DIR", "") or "__pycache__ beside dqcoll/kernels"
        with _compile_notice("CPU kernels (numba)", where):
            dynamiq_numba.warm_up()
    elif ops.name == "triton" and device.type == "cuda":
        from . import dynamiq_triton

        with _compile_notice("GPU kernels (Triton)", "Triton's cache, ~/.triton"):
            dynamiq_triton.warm_up(device)
