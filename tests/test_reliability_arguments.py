"""Arguments, values and settings at their edges: every error on every rank, no silent
divergence.

* ``handle.wait()`` after an ``async_op`` collective timed out raises that collective's
  ``CollectiveTimeoutError`` (with or without a host timeout);
* the argument check covers every bit it uses: seeds that differ anywhere (above bit 62 too)
  raise ``MismatchError`` on every rank before data moves;
* out-of-range integers (``step`` >= 2**63, ``bits=2**1100``, ...) on one rank raise a
  ``DqcollError`` on every rank at once; extreme values given on every rank are accepted;
* fp16 sums beyond the dtype's range saturate;
* ``none`` stays exact next to a huge super-group (the range scaling is a power of two);
* every ``DQCOLL_*`` value is validated when read (``DQCOLL_TIMEOUT_S=nan`` included);
* an ``async_op`` call on a closed communicator starts no thread; a sync and an async call paired
  across ranks raise ``MismatchError``; sparse tensors and ``bits=inf`` get their own messages;
  ``dqcoll.init`` without rank 0 names it without a C++ stack trace.

Every test that could hang runs under a short timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import dqcoll
from dqcoll import envs
from dqcoll.cli.ports import rendezvous_port
from dqcoll.errors import (
    CollectiveTimeoutError,
    DqcollError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
)
from dqcoll.testing import run_local

# "Within 1 s" is the promise; measured 0.00-0.03 s per rank (docs/reliability.md). The bound
# here leaves room for a loaded CI machine (one run at load 8 on 2 cores took 1.15 s) while
# staying far below the timeouts a missed error would run into (5 s and more).
_FAST_S = 2.0


def _input(rank: int, numel: int, *, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2500 + rank)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _timed(fn):  # type: ignore[no-untyped-def]
    """(the DqcollError fn raised or None, seconds it took)."""
    start = time.monotonic()
    try:
        fn()
    except DqcollError as exc:
        return exc, time.monotonic() - start
    return None, time.monotonic() - start


# -- handle.wait() after an async_op timeout ------------------------------------------------------


@pytest.mark.parametrize("wait_timeout_s", [None, 60.0])
def test_wait_after_async_timeout_raises_the_collective_timeout(wait_timeout_s):
    """When an ``async_op`` collective times out (rank 1 never joins), ``wait()`` - with or
    without a host timeout - raises that CollectiveTimeoutError, naming the rank and the step,
    as soon as the collective gave up (not a TypeError, not a host TimeoutError)."""
    timeout_s = 0.5

    def fn(comm):
        if comm.rank == 1:
            time.sleep(3 * timeout_s)  # never calls
            return None
        handle = dqcoll.allreduce(_input(0, 512), async_op=True)
        start = time.monotonic()
        try:
            handle.wait(timeout_s=wait_timeout_s)
        except BaseException as exc:
            return exc, time.monotonic() - start
        return None, time.monotonic() - start

    (exc, elapsed), _ = run_local(2, fn, timeout_s=timeout_s)
    assert isinstance(exc, CollectiveTimeoutError), repr(exc)
    assert "rank 0" in str(exc) and "allreduce#0" in str(exc), str(exc)
    assert elapsed < 5.0


# -- the argument check covers every bit it uses, and every integer fits --------------------------

_SEED_PAIRS = {"0 vs 2**62": (0, 2**62), "-1 vs 2**62-1": (-1, 2**62 - 1),
               "5 vs 5+2**64": (5, 5 + 2**64)}


@pytest.mark.parametrize("scheme", ["thc", "dynamiq"])
@pytest.mark.parametrize("pair", list(_SEED_PAIRS))
def test_seeds_differing_above_bit_62_raise_mismatch_everywhere(pair, scheme):
    """Seeds that differ anywhere (above bit 62 too, or only in sign) make every rank raise
    MismatchError naming the seed within 1 s, before data moves (thc hashes the whole seed, so
    such ranks would end with different results)."""
    low, high = _SEED_PAIRS[pair]

    def fn(comm):
        buf = _input(comm.rank, 1024)
        keep = buf.clone()
        exc, elapsed = _timed(lambda: dqcoll.allreduce(
            buf, scheme=scheme, seed=low if comm.rank == 0 else high))
        return exc, elapsed, torch.equal(buf, keep)

    for exc, elapsed, untouched in run_local(3, fn, timeout_s=10.0, return_exceptions=True):
        assert isinstance(exc, MismatchError), repr(exc)
        assert "seed" in str(exc)
        assert elapsed < _FAST_S and untouched


_OUT_OF_RANGE = {
    "step=2**63": {"step": 2**63},
    "step=2**64 (same 64-bit key as 0)": {"step": 2**64},
    "tile_nbytes=2**63": {"tile_nbytes": 2**63},
    "tiles_in_flight=2**63": {"tiles_in_flight": 2**63},
    "bits=2**1100": {"bits": 2**1100},
}


@pytest.mark.parametrize("kind", list(_OUT_OF_RANGE))
def test_out_of_range_integers_on_one_rank_raise_on_every_rank(kind):
    """An integer option too large for the argument check on rank 1 raises a DqcollError on
    every rank within 1 s (rank 1 a clear InvalidArgumentError or MismatchError, the others a
    PeerError or MismatchError), not a raw OverflowError on rank 1 and a timeout on the others;
    the communicator stays usable."""
    kwargs = _OUT_OF_RANGE[kind]

    def fn(comm):
        exc, elapsed = _timed(lambda: dqcoll.allreduce(
            _input(comm.rank, 512), **(kwargs if comm.rank == 1 else {})))
        after, _ = _timed(lambda: dqcoll.allreduce(_input(comm.rank, 512)))
        return exc, elapsed, after

    results = run_local(3, fn, timeout_s=5.0, return_exceptions=True)
    for rank, result in enumerate(results):
        assert isinstance(result, tuple), repr(result)  # not a raw error escaping rank 1
        exc, elapsed, after = result
        assert isinstance(exc, (InvalidArgumentError, PeerError, MismatchError)), (rank, exc)
        assert elapsed < _FAST_S, (rank, elapsed)
        assert after is None, after
    assert "Overflow" not in str(results[1][0])


def test_extreme_step_on_every_rank_is_accepted():
    """``step=-2**63`` (or ``2**70``) on every rank is one value everywhere: no false
    MismatchError (the check's min and max overflowed), and the sum is right."""

    def fn(comm):
        out = []
        for step in (-(2**63), 2**70):
            buf = torch.full((512,), float(comm.rank + 1))
            dqcoll.allreduce(buf, scheme="none", step=step)
            out.append(buf)
        return out

    for outs in run_local(3, fn, timeout_s=10.0):
        for buf in outs:
            assert torch.equal(buf, torch.full((512,), 6.0))


# -- fp16 saturates -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["none", "dynamiq", "thc"])
def test_fp16_sums_beyond_the_range_saturate(scheme):
    """fp16 inputs of 30000 on 3 ranks (exact sum 90000 > 65504) come back as 65504, the
    dtype's largest value, on every rank, bit-identical, instead of inf; the other coordinates
    keep the error the scheme makes on the same inputs divided by 4 (where nothing overflows;
    ``none``: bit-identical to the same call without the huge coordinates)."""
    n, numel = 3, 2048
    top = torch.finfo(torch.float16).max

    def data(rank: int, huge: bool, scale: float = 1.0) -> torch.Tensor:
        x = _input(rank, numel, dtype=torch.float16)
        if huge:
            x[:256] = 30000.0
        return x * scale  # exact: a power of two

    def fn(comm, huge, scale):
        x = data(comm.rank, huge, scale)
        dqcoll.allreduce(x, scheme=scheme, algorithm="ring")
        return x

    outs = run_local(n, fn, True, 1.0, timeout_s=30.0)
    for out in outs:
        assert torch.isfinite(out).all(), int((~torch.isfinite(out)).sum())
        assert _bits(out) == _bits(outs[0])
    assert torch.equal(outs[0][:256], torch.full((256,), top, dtype=torch.float16))
    errors = []
    for scale, out in ((1.0, outs[0]), (0.25, run_local(n, fn, True, 0.25, timeout_s=30.0)[0])):
        exact = sum(data(r, True, scale).double() for r in range(n))[256:]
        errors.append(float((out[256:].double() - exact).norm() / exact.norm()))
    assert errors[0] <= 1.5 * errors[1] + 1e-3, errors
    if scheme == "none":
        plain = run_local(n, fn, False, 1.0, timeout_s=30.0)[0]
        assert _bits(outs[0][256:]) == _bits(plain[256:])


# -- none stays exact next to a huge value --------------------------------------------------------


@pytest.mark.parametrize("small", [1e-8, 1e-3])
def test_none_stays_exact_next_to_a_huge_super_group(small):
    """Scheme ``none``, one super-group of 1e38 on rank 0 and every other coordinate
    ``small * (rank + 1)``: the other 3840 coordinates are exactly what the same call gives
    without the huge super-group (bit for bit: the range scaling is only the power of two that
    keeps the sums finite), not 0 or 16 % off."""
    n, numel = 3, 4096

    def data(rank: int, huge: bool) -> torch.Tensor:
        x = torch.full((numel,), small * (rank + 1), dtype=torch.float32)
        if huge and rank == 0:
            x[:256] = 1e38
        return x

    def fn(comm, huge):
        x = data(comm.rank, huge)
        dqcoll.allreduce(x, scheme="none", algorithm="ring")
        return x

    outs = run_local(n, fn, True, timeout_s=30.0)
    plain = run_local(n, fn, False, timeout_s=30.0)
    exact = torch.tensor(6 * small, dtype=torch.float64)
    for out in outs:
        assert _bits(out) == _bits(outs[0])
        assert _bits(out[256:]) == _bits(plain[0][256:])
        rel = float(((out[256:].double() - exact).abs() / exact).max())
        assert rel < 1e-6, rel
        assert torch.equal(out[:256], torch.full((256,), 1e38))


# -- every DQCOLL_* value is validated ------------------------------------------------------------

_BAD_ENV = {
    "DQCOLL_TIMEOUT_S": ["nan", "inf", "-1", "0", "soon"],
    "DQCOLL_VALIDATE": ["maybe"],
    "DQCOLL_LOG_LEVEL": ["LOUD"],
    "DQCOLL_TUNING_DIR": ["/nonexistent/dqcoll-tuning"],
    "DQCOLL_KERNELS": ["cuda"],
    "DQCOLL_CPU_THREADS": ["two"],
}
_READERS = {"DQCOLL_TIMEOUT_S": envs.timeout_s, "DQCOLL_VALIDATE": envs.validate,
            "DQCOLL_LOG_LEVEL": envs.log_level, "DQCOLL_TUNING_DIR": envs.tuning_dir,
            "DQCOLL_KERNELS": envs.kernels, "DQCOLL_CPU_THREADS": envs.cpu_threads}


@pytest.mark.parametrize("name,value", [(k, v) for k, vs in _BAD_ENV.items() for v in vs])
def test_malformed_env_values_raise_naming_them(monkeypatch, name, value):
    """Every ``DQCOLL_*`` variable is validated when read: a malformed value raises
    InvalidArgumentError naming the variable and the value (a ``nan`` timeout would let a
    missing rank hang forever)."""
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgumentError, match=name) as info:
        _READERS[name]()
    assert repr(value) in str(info.value)


def test_log_level_is_applied_when_a_communicator_is_created(monkeypatch):
    """``DQCOLL_LOG_LEVEL`` sets the ``dqcoll`` logger's level when a communicator is created
    (unset, the application's own logging configuration stands); a malformed value raises
    there, naming it."""
    import logging

    logger = logging.getLogger("dqcoll")
    monkeypatch.setattr(logger, "level", logger.level)  # restored after the test
    monkeypatch.setenv("DQCOLL_LOG_LEVEL", "DEBUG")
    run_local(2, lambda comm: None)
    assert logger.level == logging.DEBUG
    monkeypatch.delenv("DQCOLL_LOG_LEVEL")
    logger.setLevel(logging.ERROR)
    run_local(2, lambda comm: None)
    assert logger.level == logging.ERROR
    monkeypatch.setenv("DQCOLL_LOG_LEVEL", "LOUD")
    with pytest.raises(InvalidArgumentError, match="DQCOLL_LOG_LEVEL"):
        run_local(2, lambda comm: None)


def test_nan_timeout_is_refused_before_any_wait(monkeypatch):
    """``DQCOLL_TIMEOUT_S=nan`` makes an in-process group and ``dqcoll.init`` raise at once,
    naming the value (with it, in-process ranks would wait forever for a missing one, and
    gloo's init would raise a raw ValueError); an explicit ``timeout_s=nan`` too."""
    monkeypatch.setenv("DQCOLL_TIMEOUT_S", "nan")
    with pytest.raises(InvalidArgumentError, match="DQCOLL_TIMEOUT_S"):
        run_local(2, lambda comm: None)
    monkeypatch.delenv("DQCOLL_TIMEOUT_S")
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        dqcoll.init(backend="gloo", rank=0, world_size=1, master_port=1,
                    timeout_s=float("nan"))


# -- closed communicators, mixed sync and async calls, messages, a missing rank 0 -----------------


def _async_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dqcoll-async")]


def test_async_call_after_close_raises_without_a_thread():
    """``async_op=True`` on a closed communicator starts no worker thread; its ``wait()``
    raises InvalidArgumentError saying the communicator is closed."""

    def fn(comm):
        comm.close()
        before = {t.ident for t in _async_threads()}
        handle = dqcoll.allreduce(_input(comm.rank, 256), async_op=True, comm=comm)
        started = [t.name for t in _async_threads() if t.ident not in before
                   and t.name == f"dqcoll-async rank {comm.rank}"]
        with pytest.raises(InvalidArgumentError, match="closed communicator"):
            handle.wait(timeout_s=5)
        return started

    for started in run_local(2, fn, timeout_s=10.0):
        assert started == []


def test_sync_and_async_calls_paired_across_ranks_raise_mismatch():
    """Two threads per rank, one calling ``allreduce`` synchronously (values 1, 2) and one with
    ``async_op=True`` (100, 200), started in opposite orders on the two ranks: rank 0's sync
    call meets rank 1's async call. Both raise MismatchError naming the mode within 1 s
    instead of returning 201 "ok"; no call returns a wrong sum."""
    timeout_s = 1.0

    def fn(comm):
        rank = comm.rank
        results: dict[str, object] = {}

        def sync_call():
            buf = torch.full((256,), float(rank + 1))
            results["sync"] = _timed(lambda: dqcoll.allreduce(buf, scheme="none", comm=comm))
            results["sync_buf"] = buf

        def async_call():
            buf = torch.full((256,), 100.0 * (rank + 1))

            def go():
                dqcoll.allreduce(buf, scheme="none", comm=comm, async_op=True).wait(5)

            results["async"] = _timed(go)
            results["async_buf"] = buf

        first, second = (sync_call, async_call) if rank == 0 else (async_call, sync_call)
        t1 = threading.Thread(target=first)
        t1.start()
        time.sleep(0.2)
        t2 = threading.Thread(target=second)
        t2.start()
        t1.join(10)
        t2.join(10)
        return results

    r0, r1 = run_local(2, fn, timeout_s=timeout_s)
    paired = [r0["sync"], r1["async"]]
    for exc, elapsed in paired:
        assert isinstance(exc, MismatchError), repr(exc)
        assert "mode" in str(exc) and "sync" in str(exc)
        assert elapsed < _FAST_S
    for result in (r0, r1):
        for mode, right in (("sync", 3.0), ("async", 300.0)):
            exc, _ = result[mode]
            if exc is None:  # a call that completed has the right sum
                assert torch.equal(result[f"{mode}_buf"], torch.full((256,), right))
            else:
                assert isinstance(exc, DqcollError)


def test_sparse_tensor_and_non_finite_bits_get_clear_messages():
    """A sparse tensor is refused as sparse (not as "non-contiguous, strides (0,)"), and
    ``bits=inf`` / ``nan`` as not finite (not "below the minimum"), on that rank, with a
    PeerError on the others."""
    cases = {
        "sparse": (lambda r: torch.zeros(512).to_sparse(), {}, "sparse"),
        "bits=inf": (lambda r: _input(r, 512), {"bits": float("inf")}, "finite"),
        "bits=nan": (lambda r: _input(r, 512), {"bits": float("nan")}, "finite"),
    }
    for name, (make, kwargs, word) in cases.items():

        def fn(comm, make=make, kwargs=kwargs):
            buf = make(comm.rank) if comm.rank == 1 else _input(comm.rank, 512)
            return _timed(lambda: dqcoll.allreduce(buf, **(kwargs if comm.rank == 1 else {})))

        results = run_local(3, fn, timeout_s=5.0)
        exc = results[1][0]
        assert isinstance(exc, InvalidArgumentError), (name, exc)
        assert word in str(exc) and "strides" not in str(exc) and "minimum" not in str(exc), (
            name, str(exc))
        assert all(isinstance(results[r][0], PeerError) for r in (0, 2)), (name, results)



_INIT_WORKER = r"""
import json, os, sys, time
import dqcoll
from dqcoll.errors import DqcollError
start = time.monotonic()
try:
    dqcoll.init(backend="gloo", timeout_s=float(sys.argv[1]))
    report = {"ok": True}
except DqcollError as exc:
    report = {"error": type(exc).__name__, "message": str(exc)}
except Exception as exc:
    report = {"error": "raw " + type(exc).__name__, "message": str(exc)}
report["elapsed_s"] = time.monotonic() - start
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


def test_init_without_rank_0_names_it_without_a_cpp_stack_trace():
    """``dqcoll.init`` on rank 1 of 2 with rank 0 (the store) never started raises
    CollectiveTimeoutError naming rank 0, with a one-line reason and no c10d C++ stack trace
    ("Exception raised from ...", "frame #") in the message or on stderr (torch's TCPStore
    client logged one per connection attempt, and the chained exception printed another)."""
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(rendezvous_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _INIT_WORKER, "2"], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, proc.stderr[-2000:]
    report = json.loads(lines[0][7:])
    assert report.get("error") == "CollectiveTimeoutError", report
    message = report["message"]
    assert "missing rank: 0" in message, message
    assert "Exception raised from" not in message and "frame #" not in message, message
    assert "\n" not in message, message
    assert "frame #" not in proc.stderr and "Exception raised from" not in proc.stderr, (
        proc.stderr[-3000:])
