"""Shared test helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from dqcoll.cli.ports import rendezvous_port

# The suite runs under pytest-xdist on 2 cores: one intra-op thread per worker, no oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("DQCOLL_TIMEOUT_S", "60")


def has_cuda() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):  # type: ignore[no-untyped-def]
    """Compile the numba CPU kernels once, in the controlling process, before the xdist workers
    start: they (and the ranks that tests spawn) then load them from numba's disk cache (~1 s)
    instead of compiling them at once in every process (~80 s of CPU each on a fresh clone,
    docs/kernels.md "Cold compile"; enough to push multi-process tests past their timeouts).

    ``DQCOLL_TEST_NUMBA_WARMUP=0`` skips it: a run of GPU tests alone (``tools/gpu_check.sh``)
    compiles only the CPU kernels its tests call, when they call them."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller did it
        return
    if os.environ.get("DQCOLL_TEST_NUMBA_WARMUP", "1") == "0":
        return
    try:
        import numba  # noqa: F401
    except ImportError:  # the suite then runs the torch references
        return
    import dqcoll
    from dqcoll.kernels import dynamiq_numba
    from dqcoll.testing import run_local

    dynamiq_numba.warm_up(tuple(dynamiq_numba.FORMATS))  # every format the suite tests
    names = [name for name in dqcoll.schemes.list_schemes() if name != "dynamiq"]

    def every_scheme(comm):  # type: ignore[no-untyped-def]
        for name in names:
            dqcoll.allreduce(torch.randn(2 * 4096 + 3), scheme=name, comm=comm)

    run_local(2, every_scheme)


def pytest_collection_modifyitems(config, items):  # type: ignore[no-untyped-def]
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords or "multi_rank_gpu" in item.keywords:
            item.add_marker(skip)


def integer_input(
    rank: int, numel: int, dtype: torch.dtype = torch.float32, high: int = 64
) -> torch.Tensor:
    """Exactly representable inputs: integers in [-high, high], distinct per rank."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-high, high + 1, (numel,), generator=g).to(dtype)


def heavy_tailed(rank: int, numel: int, *, seed: int = 0, sigma: float = 2.0) -> torch.Tensor:
    """Gradient-like data: super-group magnitudes log-normal (shared by ranks), noise per rank."""
    rows = -(-numel // 256)
    shared = torch.Generator().manual_seed(seed)
    magnitude = torch.exp(torch.randn(rows, generator=shared) * sigma)
    g = torch.Generator().manual_seed(seed * 7919 + rank + 1)
    values = torch.randn(rows, 256, generator=g) * magnitude[:, None]
    return values.reshape(-1)[:numel].contiguous()



def run_gloo_script(script: str, world_size: int, *, timeout_s: float,
                    env: dict[str, str] | None = None,
                    argv: Sequence[str] = ()) -> dict[int, dict[str, Any]]:
    """Run ``python -c script *argv`` as ``world_size`` gloo ranks (torchrun's variables on
    127.0.0.1, one intra-op thread each, ``env`` on top); the reports of
    :func:`collect_reports`."""
    port = rendezvous_port()
    procs = []
    for rank in range(world_size):
        rank_env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                        **(env or {}))
        procs.append(subprocess.Popen([sys.executable, "-c", script, *argv], env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return collect_reports(procs, timeout_s=timeout_s)


def collect_reports(procs: Sequence[subprocess.Popen[str]], *, timeout_s: float,
                    wait_for: int | None = None) -> dict[int, dict[str, Any]]:
    """Each of the first ``wait_for`` (default: all) processes' report: the JSON of its first
    stdout line starting with ``REPORT `` (else its stderr's tail), plus its ``exit`` code.
    Processes left running at the end are killed."""
    reports: dict[int, dict[str, Any]] = {}
    try:
        for rank, p in enumerate(procs[:wait_for]):
            out, err = p.communicate(timeout=timeout_s)
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            reports[rank] = json.loads(lines[0][7:]) if lines else {"stderr": err[-4000:]}
            reports[rank]["exit"] = p.returncode
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return reports
