"""Runtime of the compiled CPU kernels: is numba usable, the JIT options, and the row-split threads.

Every compiled CPU kernel (``*_numba.py`` here) is a top-level ``@njit`` function with
:data:`JIT_OPTIONS` over rows ``[lo, hi)``; :func:`run_rows` cuts a call into row ranges on a
process-wide thread pool, so the bytes do not depend on the threads (docs/kernels.md, "Structure"
and "Byte-exactness rules"; the process-wide state: docs/design.md, "CPU runtime"). Options not
explained there: ``nogil`` (the communication thread and the ``local`` ranks run beside a kernel),
``cache`` (hence top-level functions: numba caches no closures), ``error_model="numpy"`` (inf/NaN
as in torch), ``boundscheck=False`` (kernels guard their indices; none is derived from a value
that can be NaN).

Rejected: numba's ``parallel=True``: its default threading layer is not safe when several Python
threads call parallel kernels at once (the ``local`` transport's ranks do), and the safe layers
need TBB or OpenMP that a fresh machine may lack.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .. import envs

__all__ = ["JIT_OPTIONS", "MIN_ROWS_PER_THREAD", "claim_local_ranks", "cpu_threads",
           "import_problem", "local_ranks", "numba_available", "release_local_ranks", "run_rows"]

JIT_OPTIONS: dict[str, Any] = dict(nogil=True, cache=True, fastmath=False, error_model="numpy",
                                   boundscheck=False)
# Fewer rows than this per thread run on the calling thread alone: a range of 64 super-groups is
# 64 KiB of fp32 work, ~0.1 ms of encode, where handing it to a pool thread (~20 us) starts to
# show.
MIN_ROWS_PER_THREAD = 64

# id(owner) -> (ranks it claims, the finalizer that drops the claim when the owner is collected)
_claims: dict[int, tuple[int, weakref.finalize]] = {}
_local_ranks = 1  # max over _claims (1 with none), recomputed on every change, read per launch
# Reentrant: a claim's finalizer may run from a garbage collection inside a locked section.
_lock = threading.RLock()
# Read once: os.cpu_count() reads /sys on every call (~1 ms per all-reduce of 60 launches when the
# machine is busy).
_CORES = os.cpu_count() or 1
# An executor starts its threads on submit: none before the first split call.
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, _CORES),
                                              thread_name_prefix="dqcoll-cpu")


def import_problem(module: str) -> str | None:
    """None when ``module`` imports, else why not (ImportError, or a broken install)."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{module} is not importable ({exc.__class__.__name__}: {exc})"
    return None


@functools.lru_cache(maxsize=1)
def numba_available() -> str | None:
    """None when numba can be used, else the reason it cannot."""
    return import_problem("numba")


def claim_local_ranks(owner: object, ranks: int) -> None:
    """Record that ``owner`` (a communicator) runs with ``ranks`` ranks sharing this machine's
    cores, until :func:`release_local_ranks` or ``owner`` is garbage-collected; a second claim
    by the same owner replaces its first."""
    if int(ranks) < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    release_local_ranks(owner)
    with _lock:
        key = id(owner)  # unique while owner lives; the finalizer drops it before id reuse
        _claims[key] = (int(ranks), weakref.finalize(owner, _drop_claim, key))
        _recount()


def release_local_ranks(owner: object) -> None:
    """Drop ``owner``'s claim, if any (a communicator that is closed or dies)."""
    with _lock:
        claim = _claims.get(id(owner))
        if claim is not None:
            claim[1]()  # a finalizer runs once: _drop_claim now, nothing at collection


def local_ranks() -> int:
    """The largest claim of a live communicator (1 when none claims any)."""
    return _local_ranks


def _drop_claim(key: int) -> None:
    with _lock:
        if _claims.pop(key, None) is not None:
            _recount()


def _recount() -> None:
    global _local_ranks
    _local_ranks = max((ranks for ranks, _ in _claims.values()), default=1)


def cpu_threads() -> int:
    """Threads one rank's kernels use: ``DQCOLL_CPU_THREADS``, else cores / :func:`local_ranks`."""
    configured = envs.cpu_threads()
    return max(1, _CORES // _local_ranks) if configured is None else configured


def run_rows(kernel: Callable[..., Any], rows: int, *args: Any, threads: int | None = None) -> None:
    """``kernel(lo, hi, *args)`` over row ranges that cover ``[0, rows)``, on up to ``threads``
    threads (default :func:`cpu_threads`); the calling thread runs the first range."""
    threads = cpu_threads() if threads is None else threads
    parts = max(1, min(threads, rows // MIN_ROWS_PER_THREAD))
    cuts = [rows * p // parts for p in range(parts + 1)]
    futures = [_pool.submit(kernel, cuts[p], cuts[p + 1], *args) for p in range(1, parts)]
    if rows:
        kernel(cuts[0], cuts[1], *args)
    for future in futures:
        future.result()
