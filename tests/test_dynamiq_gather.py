"""The CPU all-reduce's rows gathered by the kernels as they encode (``DynamiqOps.gather_source``)
against the same calls with the centred rows written out first (``center_gather``): the same
result bytes on every path that reads the work rows some other way (the butterfly's
accumulates, tiles, hop widths, a bf16 output, width-0 rows, a padded tail, sum and avg), and
the gather actually taken where the kernels can (no ``center_gather`` pass)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import torch

import dqcoll
from dqcoll.testing import run_local

pytestmark = pytest.mark.skipif(dqcoll.kernels.numba_available() is not None,
                                reason="numba is not importable")


def _ops(monkeypatch: pytest.MonkeyPatch, gather: bool) -> dict[str, int]:
    """The CPU kernels with or without the gather source; counts center_gather passes and
    encode/hop launches that gathered."""
    from dqcoll.kernels import dynamiq_numba
    from dqcoll.schemes.dynamiq import call

    counts = {"center_gather": 0, "gathered": 0, "source_writes": 0}
    lock = threading.Lock()
    base = dynamiq_numba.OPS

    def center_gather(*args: Any, **kwargs: Any) -> Any:
        with lock:
            counts["center_gather"] += 1
        return base.center_gather(*args, **kwargs)

    def runs(name: str) -> Any:
        fn = getattr(base, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("source") is not None:
                with lock:
                    counts["gathered"] += 1
            return fn(*args, **kwargs)
        return run

    class Source:  # counts the rows written out (a step that reads them some other way)
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def write(self, *args: Any, **kwargs: Any) -> None:
            with lock:
                counts["source_writes"] += 1
            self.inner.write(*args, **kwargs)

    def gather_source(*args: Any, **kwargs: Any) -> Any:
        return Source(base.gather_source(*args, **kwargs))

    def unwrap(fn: Any) -> Any:  # the kernels take the real source
        def run(*args: Any, **kwargs: Any) -> Any:
            if isinstance(kwargs.get("source"), Source):
                kwargs["source"] = kwargs["source"].inner
            return fn(*args, **kwargs)
        return run

    ops = dataclasses.replace(
        base, center_gather=center_gather,
        encode_runs=unwrap(runs("encode_runs")), hop_runs=unwrap(runs("hop_runs")),
        gather_source=gather_source if gather else None)
    monkeypatch.setattr(call, "dynamiq_ops", lambda device: ops)
    return counts


def _inputs(rank: int, numel: int, zeros: bool) -> torch.Tensor:
    rng = np.random.default_rng(500 + rank)
    scale = np.exp(rng.standard_normal(-(-numel // 256)) * 2.0).repeat(256)[:numel]
    x = torch.from_numpy((rng.standard_normal(numel) * scale).astype(np.float32))
    if zeros:  # a ReLU MLP's dead units: whole rows of +0 (width 0) and one of -0
        rows = x[: numel // 256 * 256].view(-1, 256)
        rows[::3] = 0.0
        rows[1] = -0.0
    return x


CASES = [
    # (algorithm, world size, numel, op, dtype, tile_nbytes, zeros)
    ("ring", 4, 300_007, "avg", torch.float32, None, False),
    ("ring", 4, 262_144, "sum", torch.float32, None, True),
    ("ring", 3, 200_001, "avg", torch.float32, 64 * 1024, True),
    ("ring", 4, 131_072, "avg", torch.bfloat16, None, False),
    ("butterfly", 4, 300_007, "avg", torch.float32, None, True),
    ("butterfly", 3, 262_144, "sum", torch.float32, 32 * 1024, False),
    ("direct", 5, 100_003, "avg", torch.float32, None, False),
]


@pytest.mark.parametrize(("algorithm", "world_size", "numel", "op", "dtype", "tile", "zeros"),
                         CASES)
def test_gathered_rows_give_the_written_rows_bytes(
        monkeypatch: pytest.MonkeyPatch, algorithm: str, world_size: int, numel: int, op: str,
        dtype: torch.dtype, tile: int | None, zeros: bool) -> None:
    def call(comm: Any) -> bytes:
        x = _inputs(comm.rank, numel, zeros).to(dtype)
        dqcoll.allreduce(x, op=op, bits=5, algorithm=algorithm, seed=7, step=3,
                         tile_nbytes=tile)
        return x.view(torch.uint8).numpy().tobytes()

    counts = _ops(monkeypatch, gather=False)
    written = run_local(world_size, call)
    assert counts["center_gather"] == world_size and counts["gathered"] == 0
    counts = _ops(monkeypatch, gather=True)
    gathered = run_local(world_size, call)
    assert all(r == written[0] for r in written[1:])
    assert gathered == written
    # no pass writes every centred row: the encodes and hops gather them (the ring reads each
    # row once, so nothing is written out; the butterfly's and the direct schedule's
    # accumulates and a bf16 output's decode write the rows they read)
    assert counts["center_gather"] == 0 and counts["gathered"] > 0, counts
    if algorithm == "ring" and dtype == torch.float32:
        assert counts["source_writes"] == 0, counts
