"""The default ``dynamiq`` all-reduce's result bytes, pinned: a change of the call's planning
(statistics, allocation, reorder, geometry, restore) or of its kernels that was meant to be
faster but not to change the format must leave these digests as they are. A deliberate format
change updates them in the same commit (docs/design.md §3.4)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
import torch

import dqcoll
from dqcoll.testing import run_local

# sha256 of rank 0's result bytes (every rank holds the same), the same with the numba kernels
# and with DQCOLL_KERNELS=torch.
PINNED = {
    ("ring", 4, 300_007):
        "c76e1ba64fa536abdd3259dc6db372783ea03c4177be32dccb07f99562b7eec0",
    ("butterfly", 4, 300_007):
        "eec07c3682361cda14046e9b91b719bd58cc97ed91a217c20b2bf04226db450a",
    ("butterfly", 3, 262_144):
        "a095b1a95d4e88735dacf901189f1db77a898a69783062331b23011f090948ea",
    ("direct", 5, 100_003):
        "b35a6c7a5b7a456399ccd6348a2f54640ed801815a1fc8ce2d62ccc29305522e",
}


def _inputs(rank: int, numel: int) -> torch.Tensor:
    """Heavy-tailed per-row scales (so many widths are used) from NumPy's PCG64, the same on
    every platform."""
    rng = np.random.default_rng(1000 + rank)
    scale = np.exp(rng.standard_normal(-(-numel // 256)) * 2.0).repeat(256)[:numel]
    return torch.from_numpy((rng.standard_normal(numel) * scale).astype(np.float32))


def _call(comm: Any, algorithm: str, numel: int) -> bytes:
    x = _inputs(comm.rank, numel)
    dqcoll.allreduce(x, op="avg", bits=5, algorithm=algorithm, seed=7, step=3)
    return x.numpy().tobytes()


@pytest.mark.parametrize(("algorithm", "world_size", "numel"), list(PINNED))
def test_default_allreduce_bytes_are_pinned(algorithm: str, world_size: int,
                                            numel: int) -> None:
    """Every rank ends with the same bytes, and they hash to the pinned digest."""
    results = run_local(world_size, _call, algorithm, numel)
    assert all(r == results[0] for r in results[1:])
    digest = hashlib.sha256(results[0]).hexdigest()
    assert digest == PINNED[(algorithm, world_size, numel)], digest


def _counting_ops(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The CPU kernels with their statistics passes counted (every rank's thread together)."""
    import dataclasses
    import threading

    from dqcoll.kernels import dynamiq_numba
    from dqcoll.schemes.dynamiq import call

    counts = {"stats": 0, "stats_range": 0, "restore_mean": 0}
    lock = threading.Lock()

    def counted(name: str) -> Any:
        fn = getattr(dynamiq_numba.OPS, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            with lock:  # calls; restore_mean: rows
                counts[name] += args[0].numel() if name == "restore_mean" else 1
            return fn(*args, **kwargs)
        return run

    ops = dataclasses.replace(dynamiq_numba.OPS, stats=counted("stats"),
                              stats_range=counted("stats_range"),
                              restore_mean=counted("restore_mean"))
    monkeypatch.setattr(call, "dynamiq_ops", lambda device: ops)
    return counts


@pytest.mark.parametrize("scale", [1.0, 1e38, 0.0])
def test_statistics_taken_with_the_range_check_change_no_bit(
        monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    """An all-reduce of whole fp32 rows takes its statistics in the range check's pass, before
    the argument check (DynamiqScheme.survey), instead of a pass of its own after it: the same
    bytes as the calls that take them apart (no range check: DQCOLL_VALIDATE=0, which skips the
    survey). Inputs near fp32's largest value are scaled after the argument check, and the call
    then takes its statistics of the scaled rows itself. ``scale`` 0: rows of zeros, as a ReLU
    MLP's gradient has, which the last decode leaves as they are where they were +0 on this
    rank and are +0 in the result (here: every other row; row 1 is -0 on every rank, and row 3
    +0 on rank 0 only, both written)."""
    if dqcoll.kernels.numba_available() is not None:
        pytest.skip("numba is not importable")
    counts = _counting_ops(monkeypatch)

    def call(comm: Any) -> bytes:
        x = _inputs(comm.rank, 4 * 1024)
        if scale == 0.0:
            rows = x.view(-1, 256)
            rows[::2] = 0.0
            rows[1] = -0.0
            if comm.rank == 0:
                rows[3] = 0.0
        elif scale != 1.0:  # up to 3e38 (fp32's largest is 3.4e38): sums of 4 overflow
            x = x.clamp(-3.0, 3.0) * scale
        dqcoll.allreduce(x, op="avg", bits=5, algorithm="butterfly", seed=7, step=3)
        assert torch.isfinite(x).all()
        return x.numpy().tobytes()

    surveyed = run_local(4, call)
    # width-0 rows written: row 1 (-0) of each rank's 9 (rows 0, 1, 2, 4, ..., 14)
    zeros = 4 if scale == 0.0 else 0
    assert counts == ({"stats": 4, "stats_range": 4, "restore_mean": zeros} if scale > 1.0
                      else {"stats": 0, "stats_range": 4, "restore_mean": zeros})
    monkeypatch.setenv("DQCOLL_VALIDATE", "0")
    counts.update(stats=0, stats_range=0, restore_mean=0)
    apart = run_local(4, call)
    assert counts == {"stats": 4, "stats_range": 0, "restore_mean": 9 * zeros}
    assert all(r == surveyed[0] for r in surveyed[1:])
    if scale <= 1.0:  # without the range check nothing is scaled: the same bytes
        assert apart == surveyed
    if scale == 0.0:
        rows = torch.frombuffer(bytearray(surveyed[0]), dtype=torch.float32).view(-1, 256)
        assert (rows[::2].view(torch.int32) == 0).all()  # +0, left as they were
        assert (rows[1].view(torch.int32) == 0).all()  # -0 everywhere: restored as +0
