"""Bad messages, mismatched calls and unusable buffers: no garbage accepted, no rank left
behind, no process aborted.

* a peer's short message over gloo is refused on every rank, not summed in as data;
* different collectives on different ranks raise MismatchError everywhere before data moves
  (rather than a gloo abort, or the local transport waiting for the full timeout);
* an unusable buffer on one rank (negative NumPy stride, ``meta`` tensor) is reported through the
  argument check on every rank (the others do not wait for the timeout);
* a buffer that cannot be written in place (autograd leaf, inference tensor) is refused on every
  rank before data moves, so no rank ends with a different buffer;
* finite inputs up to the dtype's largest value give finite outputs for every scheme (DynamiQ
  near 6e37, THC near 1e37 included);
* the ``async_op`` worker thread ends with its communicator (no thread left per group);
* a communicator is refused once dead (after a failed collective), closed, or busy in another
  thread; non-numeric options are refused; ``dqcoll.init`` names the ranks that never joined.

Every test that could hang runs under a short ``DQCOLL_TIMEOUT_S`` / ``timeout_s`` and the gloo
tests under a subprocess timeout.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import dqcoll
from dqcoll import metrics, schemes
from dqcoll.cli.ports import rendezvous_port
from dqcoll.errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    DqcollError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
)
from dqcoll.testing import run_local


def _input(rank: int, numel: int, *, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + rank)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


# -- gloo processes -----------------------------------------------------------------------------

_WORKER = r"""
import json, os, sys, time, torch
import dqcoll
from dqcoll.errors import DqcollError
scenario, fault_timeout_s = sys.argv[1], float(sys.argv[2])
report = {}

def attempt(key, fn):
    start = time.monotonic()
    try:
        fn()
        report[key] = {"ok": True}
    except DqcollError as exc:
        report[key] = {"error": type(exc).__name__, "message": str(exc)}
    except Exception as exc:
        report[key] = {"error": "raw " + type(exc).__name__, "message": str(exc)}
    report[key]["elapsed_s"] = time.monotonic() - start

def data(r, numel=3000):
    return torch.randn(numel, generator=torch.Generator().manual_seed(50 + r))

if scenario == "missing":
    attempt("init", lambda: dqcoll.init(backend="gloo", timeout_s=fault_timeout_s))
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)

comm = dqcoll.init(backend="gloo")  # DQCOLL_TIMEOUT_S is long: a loaded machine is slow
rank, n = comm.rank, comm.world_size
report["rank"] = rank

if scenario.startswith("short-"):
    scheme = scenario.split("-", 1)[1]
    original, original_framed = comm.transport.exchange, comm.transport.exchange_framed
    def exchange(sends, recvs, *, what):
        if rank == 1 and "reduce step 0" in what:  # half of each message, as a buggy peer would
            sends = [(peer, t.view(-1)[: t.numel() // 2]) for peer, t in sends]
        return original(sends, recvs, what=what)
    def exchange_framed(sends, recvs, *, what):  # dynamiq's payloads travel in frames
        if rank == 1 and "reduce step 0" in what:  # half of each payload (the room stays)
            room = dqcoll.types.FRAME_HEADROOM
            sends = [(peer, f[: room + (f.numel() - room) // 2]) for peer, f in sends]
        return original_framed(sends, recvs, what=what)
    comm.transport.exchange = exchange
    comm.transport.exchange_framed = exchange_framed
    x = data(rank)
    buf = x.clone()
    torch.distributed.barrier()
    comm.transport.timeout_s = fault_timeout_s
    attempt("collective", lambda: dqcoll.allreduce(buf, scheme=scheme, algorithm="ring"))
    report["untouched"] = bool(torch.equal(buf, x))
    report["finite"] = bool(torch.isfinite(buf).all())
    exact = sum(data(r).double() for r in range(n))
    report["vnmse"] = dqcoll.metrics.vnmse(buf, exact)
    attempt("next_call", lambda: dqcoll.allreduce(data(rank), scheme=scheme))

if scenario == "mixed":
    N = 1024
    for other in ("all_gather", "reduce_scatter"):
        buf = data(rank, N)
        keep = buf.clone()
        if rank == 0:
            attempt(other, lambda: dqcoll.allreduce(buf))
        elif other == "all_gather":
            attempt(other, lambda: dqcoll.all_gather(buf, torch.empty(n * N)))
        else:
            attempt(other, lambda: dqcoll.reduce_scatter(buf, torch.empty(N // n + 1)))
        report[other + "_untouched"] = bool(torch.equal(buf, keep))
    attempt("after", lambda: dqcoll.allreduce(data(rank)))  # still usable: nothing moved

print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""



def _run_gloo(scenario: str, world_size: int, timeout_s: float, *,
              ranks: list[int] | None = None) -> dict[int, dict]:
    """Run the worker as ``world_size`` gloo processes (only ``ranks``, if given); each process
    is killed after 120 s, and its report says how it ended (``exit``: -6 is SIGABRT)."""
    port = rendezvous_port()
    procs = {}
    for rank in ranks if ranks is not None else range(world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   DQCOLL_TIMEOUT_S="60", OMP_NUM_THREADS="1")
        procs[rank] = subprocess.Popen(
            [sys.executable, "-c", _WORKER, scenario, str(timeout_s)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports: dict[int, dict] = {}
    try:
        for rank, p in procs.items():
            try:
                out, err = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            reports[rank] = json.loads(lines[0][7:]) if lines else {"stderr": err[-2000:]}
            reports[rank]["exit"] = p.returncode
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    return reports


@pytest.mark.parametrize("scheme", ["none", "dynamiq"])
def test_gloo_short_message_refused_on_every_rank(scheme):
    """Over gloo, a peer that sends half of a reduce-step message makes every rank raise a
    DqcollError (the receiver a PeerError naming the sender and the byte counts, the others
    within the timeout): no rank accepts the stale tail of its receive buffer as data, every
    buffer is left untouched, and the communicator is then dead (the next call raises
    CommAbortedError at once instead of failing inside gloo)."""
    timeout_s = 2.0
    reports = _run_gloo(f"short-{scheme}", 3, timeout_s)
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        err = rep["collective"]
        assert "error" in err, (rank, rep)  # before the fix: ok, with garbage (NaN for "none")
        assert err["error"] in ("PeerError", "CollectiveTimeoutError"), (rank, err)
        assert err["elapsed_s"] < 3 * timeout_s + 5
        assert rep["untouched"], rank
        assert rep["next_call"]["error"] == "CommAbortedError", rep["next_call"]
        assert "create a new communicator" in rep["next_call"]["message"]
        assert rep["next_call"]["elapsed_s"] < 1.0
    refused = [rep["collective"]["message"] for rep in reports.values()
               if rep["collective"]["error"] == "PeerError"]
    assert any("rank 1 sent" in m and "bytes" in m and "expected" in m for m in refused), refused


def test_gloo_different_collectives_raise_mismatch_without_abort():
    """Over gloo, rank 0 calling allreduce(buf[N]) while the others call all_gather(shard[N],
    out[3N]) (then reduce_scatter) makes every rank raise MismatchError before data moves - no
    process is aborted by gloo's size check - and the communicator stays usable."""
    reports = _run_gloo("mixed", 3, 5.0)
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep  # before the fix: rank 0 died of SIGABRT (exit -6)
        for other in ("all_gather", "reduce_scatter"):
            assert rep[other].get("error") == "MismatchError", (rank, rep[other])
            assert rep[other + "_untouched"]
        assert rep["after"] == {"ok": True, "elapsed_s": rep["after"]["elapsed_s"]}, rep


def test_init_with_a_missing_rank_names_it():
    """``dqcoll.init`` with rank 2 of 3 never started raises a DqcollError (not torch's
    DistStoreError) on the ranks that did start, naming the missing rank and the timeout."""
    reports = _run_gloo("missing", 3, 3.0, ranks=[0, 1])
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        err = rep["init"]
        assert err.get("error") == "CollectiveTimeoutError", (rank, err)
        assert "missing ranks [2]" in err["message"] and "3 s" in err["message"], err
        assert err["elapsed_s"] < 20


# -- mismatched collectives (threads) -----------------------------------------------------------


@pytest.mark.parametrize("other", ["all_gather", "reduce_scatter"])
def test_different_collectives_raise_mismatch_on_every_rank(other):
    """Rank 0 calling allreduce while the others call ``other`` with the same input length makes
    every rank raise MismatchError naming the collective at once (not a timeout on one rank),
    with no payload sent."""
    numel, n = 768, 3

    def fn(comm):
        buf = _input(comm.rank, numel)
        start = time.monotonic()
        try:
            if comm.rank == 0:
                dqcoll.allreduce(buf)
            elif other == "all_gather":
                dqcoll.all_gather(buf, torch.empty(n * numel))
            else:
                dqcoll.reduce_scatter(buf, torch.empty(numel // n))
        except DqcollError as exc:
            return exc, time.monotonic() - start, comm.counters["payload_bytes_sent"]
        return None, time.monotonic() - start, comm.counters["payload_bytes_sent"]

    for exc, elapsed, sent in run_local(n, fn, timeout_s=20.0, return_exceptions=True):
        assert isinstance(exc, MismatchError), exc
        assert "collective" in str(exc)
        assert elapsed < 5.0 and sent == 0


# -- buffers that cannot be used, or cannot be written ----------------------------------------


def _negative_stride(rank, numel):
    return np.ascontiguousarray(_input(rank, numel).numpy())[::-1]


def _meta(rank, numel):
    return torch.empty(numel, device="meta")


def _leaf(rank, numel):
    return _input(rank, numel).requires_grad_()


def _non_leaf(rank, numel):
    return _input(rank, numel).requires_grad_() * 1.0


def _inference(rank, numel):
    with torch.inference_mode():
        return _input(rank, numel) * 1.0


_UNUSABLE = {
    "negative-stride numpy": (_negative_stride, "negative"),
    "meta tensor": (_meta, "meta"),
    "leaf requiring grad": (_leaf, "requires grad"),
    "non-leaf requiring grad": (_non_leaf, "requires grad"),
    "inference tensor": (_inference, "inference"),
}


def _snapshot(buf):
    if isinstance(buf, np.ndarray):
        return buf.copy()
    if buf.device.type == "meta":
        return None
    with torch.inference_mode():
        return buf.detach().clone()


def _same(buf, keep) -> bool:
    if keep is None:
        return True
    if isinstance(buf, np.ndarray):
        return bool(np.array_equal(buf, keep))
    with torch.inference_mode():
        return bool(torch.equal(buf.detach(), keep))


@pytest.mark.parametrize("position", ["buf", "out"])
@pytest.mark.parametrize("kind", list(_UNUSABLE))
def test_unusable_or_unwritable_buffer_on_one_rank_raises_on_every_rank(kind, position):
    """A buffer on rank 1 that cannot be read (negative NumPy stride, meta tensor) or cannot be
    written in place (autograd leaf or non-leaf requiring grad, inference tensor outside
    inference mode), as the input of an all-reduce or the output of an all-gather, raises
    InvalidArgumentError naming the problem there and PeerError naming rank 1 on the others, at
    once (not after the timeout), before any payload moves; every buffer keeps its values (the
    inference tensor was written, then torch raised on its version counter)."""
    make, needle = _UNUSABLE[kind]
    n = 3

    def fn(comm):
        bad = comm.rank == 1
        if position == "buf":
            buf = make(comm.rank, 1000) if bad else _input(comm.rank, 1000)
            out = None
        else:
            buf = _input(comm.rank, 1000)
            out = make(comm.rank, n * 1000) if bad else torch.zeros(n * 1000)
        keep, keep_out = _snapshot(buf), (None if out is None else _snapshot(out))
        start = time.monotonic()
        try:
            if out is None:
                dqcoll.allreduce(buf)
            else:
                dqcoll.all_gather(buf, out)
        except DqcollError as exc:
            untouched = _same(buf, keep) and (out is None or _same(out, keep_out))
            return exc, time.monotonic() - start, untouched, comm.counters["payload_bytes_sent"]
        return None, time.monotonic() - start, True, comm.counters["payload_bytes_sent"]

    results = run_local(n, fn, timeout_s=20.0, return_exceptions=True)
    for rank, (exc, elapsed, untouched, sent) in enumerate(results):
        if rank == 1:
            assert isinstance(exc, InvalidArgumentError), exc
            assert needle in str(exc) and position in str(exc), exc
        else:
            assert isinstance(exc, PeerError), exc
            assert "rank 1" in str(exc)
        assert elapsed < 5.0 and sent == 0
        assert untouched, rank


def test_inference_tensor_inside_inference_mode_is_reduced():
    """An inference tensor passed inside ``torch.inference_mode()`` is a valid buffer: the
    all-reduce runs and writes it (only outside inference mode is it refused)."""

    def fn(comm):
        with torch.inference_mode():
            buf = _input(comm.rank, 1000)
            dqcoll.allreduce(buf, scheme="none")
        return buf

    outs = run_local(2, fn, timeout_s=20.0)
    exact = (_input(0, 1000) + _input(1, 1000))
    assert all(torch.equal(o, exact) for o in outs)


# -- finite inputs up to the dtype's largest value --------------------------------------------

_HUGE_CASES = {
    # one rank holds a super-group of values 3e37..6e37 (the exact sums stay finite)
    "one-rank-6e37": lambda rank, n, dtype: _one_huge(rank, dtype),
    # every rank up to max / (2 n): exact sums up to max / 2
    "all-ranks-max/2n": lambda rank, n, dtype: _uniform(rank, torch.finfo(dtype).max / (2 * n),
                                                        dtype),
    # every rank up to max / n: exact sums reach max; results may saturate, never inf / NaN
    "all-ranks-max/n": lambda rank, n, dtype: _uniform(rank, torch.finfo(dtype).max / n, dtype),
}


def _one_huge(rank: int, dtype: torch.dtype) -> torch.Tensor:
    x = _input(rank, 2048).to(torch.float64)
    if rank == 0:
        x[256:512] = torch.linspace(3e37, 6e37, 256, dtype=torch.float64)
    return x.to(dtype)


def _uniform(rank: int, top: float, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3000 + rank)
    x = (torch.rand(2048, generator=gen, dtype=torch.float64) * 2 - 1) * top
    return x.to(dtype).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)


def _allreduce_all(case, scheme, dtype, *, shift=0, n=4):
    """Every rank's output and the exact sum for inputs ``_HUGE_CASES[case] * 2**-shift``."""
    make = _HUGE_CASES[case]

    def data(rank):
        return (make(rank, n, dtype).double() * 2.0**-shift).to(dtype)

    def fn(comm):
        x = data(comm.rank)
        dqcoll.allreduce(x, scheme=scheme, algorithm="ring")
        return x

    outs = run_local(n, fn, timeout_s=60.0)
    exact = sum(data(r).double() for r in range(n))
    return outs, exact


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(_HUGE_CASES))
@pytest.mark.parametrize("scheme", schemes.list_schemes())
def test_finite_inputs_up_to_dtype_max_give_finite_outputs(scheme, case, dtype):
    """Finite inputs up to the dtype's largest value, whose exact sums are finite, give finite
    outputs with every scheme, identical on every rank, with the error the same scheme makes on
    the same inputs scaled by 2**-120 into an ordinary range (the call is scaled by a power of
    two, exactly, and back); where the exact sum reaches the largest value the result saturates
    there instead of overflowing."""
    if dtype not in schemes.spec(scheme).dtypes:
        pytest.skip(f"{scheme} does not take {dtype}")
    outs, exact = _allreduce_all(case, scheme, dtype)
    for out in outs:
        assert torch.isfinite(out).all(), (int((~torch.isfinite(out)).sum()), out)
        assert _bits(out) == _bits(outs[0])
    if case == "all-ranks-max/n":
        return  # saturation: finite is the promise
    small, small_exact = _allreduce_all(case, scheme, dtype, shift=120)
    reference = metrics.vnmse(small[0], small_exact)
    assert metrics.vnmse(outs[0], exact) < 1.5 * reference + 1e-4, (reference,)


# -- threads ---------------------------------------------------------------------------------


def _async_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dqcoll-async")]


def _settle(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        gc.collect()
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_async_worker_threads_end_with_their_communicator():
    """Communicators that ran ``async_op=True`` collectives leave no worker thread behind once
    they are garbage-collected (30 short-lived 2-rank groups), and ``close()`` ends a live
    communicator's worker at once."""
    before = {t.ident for t in _async_threads()}

    def fn(comm):
        dqcoll.allreduce(_input(comm.rank, 512), async_op=True).wait(timeout_s=30)

    for _ in range(15):
        run_local(2, fn, timeout_s=20.0)
    assert _settle(lambda: len({t.ident for t in _async_threads()} - before) == 0), [
        t.name for t in _async_threads()]

    def closing(comm):
        dqcoll.allreduce(_input(comm.rank, 512), async_op=True).wait(timeout_s=30)
        mine = [t for t in _async_threads() if t.ident not in before
                and t.name == f"dqcoll-async rank {comm.rank}"]
        comm.close()
        for t in mine:
            t.join(timeout=10)
        return [t.is_alive() for t in mine], comm

    results = run_local(2, closing, timeout_s=20.0)
    for alive, _ in results:
        assert alive and not any(alive)


def test_one_communicator_used_from_two_threads_raises():
    """A collective issued from a second thread while the same communicator is in the middle
    of one raises InvalidArgumentError at once, saying so; the first call completes correctly."""

    def fn(comm):
        if comm.rank == 1:
            time.sleep(1.0)  # keeps rank 0's first call waiting in its argument check
            return dqcoll.allreduce(_input(1, 512), scheme="none"), None
        buf = _input(0, 512)
        errors: list[BaseException] = []

        def second():
            try:
                dqcoll.allreduce(_input(0, 512), scheme="none", comm=comm)
            except BaseException as exc:
                errors.append(exc)

        first = threading.Thread(target=lambda: dqcoll.allreduce(buf, scheme="none", comm=comm))
        first.start()
        time.sleep(0.3)
        intruder = threading.Thread(target=second)
        intruder.start()
        intruder.join(timeout=10)
        first.join(timeout=20)
        return buf, errors

    (buf, errors), (other, _) = run_local(2, fn, timeout_s=20.0)
    assert len(errors) == 1 and isinstance(errors[0], InvalidArgumentError), errors
    assert "one collective at a time" in str(errors[0])
    exact = _input(0, 512) + _input(1, 512)
    assert torch.equal(buf, exact) and torch.equal(other, exact)


def test_call_on_closed_communicator_raises():
    """``allreduce(..., comm=c)`` after ``c.close()`` raises instead of running."""

    def fn(comm):
        comm.close()
        with pytest.raises(InvalidArgumentError, match="closed communicator"):
            dqcoll.allreduce(_input(comm.rank, 100), comm=comm)

    run_local(2, fn, timeout_s=20.0)


def test_communicator_after_timeout_is_dead():
    """After a collective timed out (rank 1 never joined it), every later call on that
    communicator raises CommAbortedError at once, saying to create a new communicator."""
    timeout_s = 0.5

    def fn(comm):
        if comm.rank == 1:
            time.sleep(3 * timeout_s)  # misses the first collective
            return None
        with pytest.raises(CollectiveTimeoutError):
            dqcoll.allreduce(_input(0, 512))
        start = time.monotonic()
        with pytest.raises(CommAbortedError, match="create a new communicator") as info:
            dqcoll.allreduce(_input(0, 512))
        assert "timed out" in str(info.value)
        return time.monotonic() - start

    elapsed = run_local(2, fn, timeout_s=timeout_s)[0]
    assert elapsed < 0.5


_BAD_TYPES = {
    "bits as a string": {"bits": "5"},
    "bits as a bool": {"bits": True},
    "seed as a string": {"seed": "1"},
    "step as a float": {"step": 1.5},
    "tile_nbytes as a string": {"tile_nbytes": "4096"},
    "target_vnmse as a string": {"target_vnmse": "0.01"},
}


@pytest.mark.parametrize("kind", list(_BAD_TYPES))
def test_non_numeric_options_rejected_on_every_rank(kind):
    """An option of the wrong type on rank 1 (``bits="5"``, ``seed="1"``, ...) raises
    InvalidArgumentError naming it there and PeerError on the others, before data moves."""
    kwargs = _BAD_TYPES[kind]
    name = next(iter(kwargs))

    def fn(comm):
        try:
            dqcoll.allreduce(_input(comm.rank, 512), **(kwargs if comm.rank == 1 else {}))
        except DqcollError as exc:
            return exc
        return None

    results = run_local(3, fn, timeout_s=20.0, return_exceptions=True)
    assert isinstance(results[1], InvalidArgumentError) and name in str(results[1]), results[1]
    assert all(isinstance(results[r], PeerError) for r in (0, 2)), results
