"""Fast paths, chosen per device; the torch references in :mod:`dqcoll.schemes` define the bytes.

:func:`dynamiq_ops` returns the set of DynamiQ operations to use for tensors on ``device``:
Triton kernels for CUDA tensors when Triton is importable, the torch reference otherwise.
``DQCOLL_KERNELS=torch|triton`` forces one; forcing Triton where it cannot run raises.
Triton is imported lazily, so ``import dqcoll`` works without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import envs
from ..errors import UnsupportedError
from .cpu_runtime import numba_available

__all__ = ["DynamiqOps", "check_format", "dynamiq_ops", "numba_available", "triton_available",
           "warm_up"]

log = logging.getLogger("dqcoll")


@dataclasses.dataclass(frozen=True)
class DynamiqOps:
    """One implementation of every DynamiQ step (signatures of the torch reference)."""

    name: str
    stats_center: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    encode: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    decode_accumulate: Callable[..., None]
    decode_accumulate_encode: Callable[..., torch.Tensor]
    # restore(work, mean, index_base, valid, out_flat): add back the means and undo the reorder in
    # one pass; None: the scheme does it with torch ops (reference: codec.restore_torch).
    restore: Callable[..., None] | None = None
    # stats(x, valid, divisor=) -> (mean, norm2) and center_gather(x, mean, valid, order,
    # divisor=, out=) -> the centred rows of x / divisor in ``order``: stats_center split in two
    # so that the centred rows are written once, already reordered (and divided, for avg).
    # None: the scheme divides, uses stats_center and a torch gather.
    stats: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    center_gather: Callable[..., torch.Tensor] | None = None
    # decode_restore(records, width, config, mean, index_base, valid, out): restore(decode(...))
    # in one pass, into a flat fp32 out (an all-reduce's last decode of each row). None: the
    # scheme decodes into its work rows and restores them.
    decode_restore: Callable[..., None] | None = None
    # The widths each scale encoding is implemented for (raw width 16 always is); None: every
    # format (the reference). The scheme runs a call whose widths are not all here on the
    # reference ops.
    formats: Mapping[Any, tuple[int, ...]] | None = None

    def implements(self, scales: Any, widths: Iterable[int]) -> bool:
        """Whether these kernels encode and decode every one of ``widths`` with ``scales``."""
        if self.formats is None:
            return True
        have = self.formats.get(scales, ())
        return all(w in have or w in (0, 16) for w in widths)


def check_format(formats: Mapping[Any, tuple[int, ...]], width: int, config: Any) -> None:
    """Raise unless a fast path with ``formats`` (``DynamiqOps.formats``) implements ``width``
    with ``config.scales`` (raw width 16, the reference's torch ops, always)."""
    widths = formats.get(config.scales, ())
    if width not in widths and width != 16:
        raise ValueError(f"width must be one of {(*widths, 16)} with {config.scales.value} "
                         f"scales, got {width}")


@functools.lru_cache(maxsize=1)
def triton_available() -> str | None:
    """None when Triton can be used, else the reason it cannot."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=1)
def _torch_ops() -> DynamiqOps:
    from ..schemes.dynamiq import codec

    return DynamiqOps(
        name="torch",
        stats_center=codec.stats_center_torch,
        encode=codec.encode_torch,
        decode=codec.decode_torch,
        decode_accumulate=codec.decode_accumulate_torch,
        decode_accumulate_encode=codec.decode_accumulate_encode_torch,
    )


def _triton_ops() -> DynamiqOps:
    from . import dynamiq_triton  # type: ignore[attr-defined]

    return dynamiq_triton.OPS  # type: ignore[no-any-return]


def _numba_ops() -> DynamiqOps:
    from . import dynamiq_numba

    return dynamiq_numba.OPS


_logged: set[str] = set()


def _fallback(why: str, device: torch.device) -> DynamiqOps:
    if why not in _logged:
        _logged.add(why)
        log.warning("dqcoll: using the torch reference for %s tensors: %s", device.type, why)
    return _torch_ops()


def dynamiq_ops(device: torch.device) -> DynamiqOps:
    choice = envs.kernels()
    if choice == "torch":
        return _torch_ops()
    if choice == "numba" or (choice == "auto" and device.type == "cpu"):
        reason = numba_available()
        if choice == "numba":
            if reason is not None:
                raise UnsupportedError(f"DQCOLL_KERNELS=numba was requested but {reason}")
            if device.type != "cpu":
                raise UnsupportedError(
                    f"DQCOLL_KERNELS=numba was requested but the numba kernels take CPU tensors, "
                    f"got {device.type} tensors")
            return _numba_ops()
        if reason is not None:
            return _fallback(reason, device)
        return _numba_ops()
    if choice == "auto" and device.type != "cuda":
        return _torch_ops()
    reason = triton_available()
    if choice == "triton":
        if reason is not None:
            raise UnsupportedError(f"DQCOLL_KERNELS=triton was requested but {reason}")
        return _triton_ops()
    if reason is not None:
        return _fallback(reason, device)
    try:
        return _triton_ops()
    except ImportError as exc:
        return _fallback(f"Triton kernels are not available ({exc})", device)


# A warm-up that takes longer than this is compiling (loading the cached kernels takes ~0.5 s
# on the dev VM): it says so once, and how long it took when done.
COMPILE_NOTICE_S = 3.0


@contextlib.contextmanager
def _compile_notice(what: str, where: str) -> Iterator[None]:
    """Log a line if the block runs longer than :data:`COMPILE_NOTICE_S` (a first compilation,
    once per machine: the kernels are cached) and another when it ends, instead of a silent
    pause of minutes at a communicator's creation."""
    start = time.perf_counter()
    fired = threading.Event()

    def notice() -> None:
        fired.set()
        log.warning("dqcoll: compiling the %s (first use on this machine, a few minutes on 2 "
                    "cores; cached afterwards in %s) ...", what, where)

    timer = threading.Timer(COMPILE_NOTICE_S, notice)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if fired.is_set():
            log.warning("dqcoll: %s compiled in %.0f s", what, time.perf_counter() - start)


def warm_up(device: torch.device) -> None:
    """Compile (or load from the disk cache) the kernels :func:`dynamiq_ops` picks for
    ``device`` now, so that ranks started together do not compile at different steps; a first
    compilation logs what it compiles and how long it took (:func:`_compile_notice`)."""
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
