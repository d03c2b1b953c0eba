"""Reliability under faults and bad input (docs/design.md §3, invariants 5 and 6).

* A rank that dies or stalls mid-collective makes the others raise, within the timeout, an error
  that names the peer and the collective step -- over the local transport (threads) and over gloo
  (separate processes, one of which exits or sleeps inside the collective).
* Mismatched lengths, dtypes, schemes, bits, algorithms, ops and seeds are detected before any
  payload moves and reported on every rank; an invalid input on one rank is reported by that rank
  and as a PeerError naming it on the others.
* NaN/Inf on any rank reaches every rank's output; finite inputs from 1e-30 to 1e30 and all-zero
  super-groups never produce non-finite outputs (and lose nothing: the error stays in budget).
* Empty tensors, length 1, lengths just around multiples of 256 and of the world size.
* An exception leaves the caller's buffer as it was.

Most tests run ranks as threads (``dqcoll.testing.run_local``); the gloo tests start real
processes with a free port and a short ``DQCOLL_TIMEOUT_S``.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from conftest import run_gloo_script

import dqcoll
from dqcoll import metrics
from dqcoll.errors import (
    CollectiveTimeoutError,
    CommAbortedError,
    DqcollError,
    InvalidArgumentError,
    MismatchError,
    PeerError,
)
from dqcoll.kernels.codec import SUPER
from dqcoll.testing import run_local

ALGORITHMS = ("ring", "butterfly", "direct")
SCHEMES = ("dynamiq", "none")


def _input(rank: int, numel: int, *, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + rank)
    return (torch.randn(numel, generator=gen, dtype=torch.float64) * scale).to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor (NaN-safe equality)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class _Died(Exception):
    """Raised inside a rank to make it stop participating, as if its process had exited."""


def _fail_at(comm, label: str, action) -> None:  # type: ignore[no-untyped-def]
    """Run ``action()`` on this rank when it reaches the exchange whose label contains ``label``."""
    original = comm.transport.exchange

    def exchange(sends, recvs, *, what):  # type: ignore[no-untyped-def]
        if label in what:
            action()
        return original(sends, recvs, what=what)

    comm.transport.exchange = exchange


# -- dead and stalled ranks (threads) ----------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_dead_rank_makes_peers_time_out_naming_peer_and_step(algorithm):
    """A rank that stops mid-collective (no abort) makes every peer raise
    CollectiveTimeoutError within the timeout, naming a peer rank and the step; buffers are
    untouched."""
    timeout_s = 0.5

    def fn(comm):
        x = _input(comm.rank, 2000)
        buf = x.clone()
        if comm.rank == 1:
            _fail_at(comm, "gather step 0", lambda: (_ for _ in ()).throw(_Died("rank 1 died")))
        start = time.monotonic()
        try:
            dqcoll.allreduce(buf, algorithm=algorithm)
        except DqcollError as exc:
            return exc, time.monotonic() - start, torch.equal(buf, x)
        return None, time.monotonic() - start, torch.equal(buf, x)

    results = run_local(4, fn, timeout_s=timeout_s, return_exceptions=True)
    assert isinstance(results[1], _Died)
    for rank in (0, 2, 3):
        exc, elapsed, untouched = results[rank]
        assert isinstance(exc, CollectiveTimeoutError), (rank, exc)
        assert "rank " in str(exc) and "allreduce#0" in str(exc) and "step" in str(exc)
        assert elapsed < 4 * timeout_s + 2.0  # a few chained waits at most, never a hang
        assert untouched
    # The ranks that wait on rank 1 directly name it.
    assert any("rank 1" in str(results[r][0]) for r in (0, 2, 3))


def test_rank_raising_aborts_peers_at_once():
    """A rank that raises inside run_local aborts the group: peers get CommAbortedError long
    before the timeout, and run_local re-raises the root cause."""
    waits: dict[int, float] = {}

    def fn(comm):
        if comm.rank == 2:
            _fail_at(comm, "reduce step 0", lambda: (_ for _ in ()).throw(_Died("boom")))
        start = time.monotonic()
        try:
            dqcoll.allreduce(_input(comm.rank, 1000))
        finally:
            waits[comm.rank] = time.monotonic() - start

    with pytest.raises(_Died):
        run_local(3, fn, timeout_s=30.0)
    assert max(waits.values()) < 5.0


@pytest.mark.parametrize("phase", ["reduce step 0", "gather step 1", "statistics"])
def test_stalled_rank_makes_peers_time_out(phase):
    """A rank that stalls (sleeps past the timeout) in any phase makes the others raise
    CollectiveTimeoutError naming the step within about the timeout; nothing hangs."""
    timeout_s = 0.4

    def fn(comm):
        x = _input(comm.rank, 1500)
        buf = x.clone()
        if comm.rank == 0:
            if phase == "statistics":
                original = comm.transport.allreduce

                def allreduce(tensor, op="sum", *, what):
                    if "statistics" in what:
                        time.sleep(3 * timeout_s)
                    return original(tensor, op, what=what)

                comm.transport.allreduce = allreduce
            else:
                _fail_at(comm, phase, lambda: time.sleep(3 * timeout_s))
        start = time.monotonic()
        try:
            dqcoll.allreduce(buf, algorithm="ring")
        except DqcollError as exc:
            return exc, time.monotonic() - start, torch.equal(buf, x)
        return None, time.monotonic() - start, torch.equal(buf, x)

    results = run_local(3, fn, timeout_s=timeout_s, return_exceptions=True)
    raised = []
    for rank in (1, 2):
        exc, elapsed, untouched = results[rank]
        assert elapsed < 3 * timeout_s + 2.0
        if exc is None:  # a rank that never waits on the stalled one may finish: sends are posted
            continue
        raised.append(str(exc))
        assert isinstance(exc, CollectiveTimeoutError), (rank, exc)
        assert "allreduce#0" in str(exc) and f"{timeout_s:g} s" in str(exc)
        assert untouched
    assert any("rank 0" in text for text in raised) or phase == "statistics"
    assert raised


# -- dead and stalled ranks (gloo processes) ---------------------------------------------------

_WORKER = r"""
import json, os, sys, time, torch
import dqcoll
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local
scenario, fault_timeout_s = sys.argv[1], float(sys.argv[2])
comm = dqcoll.init(backend="gloo")  # DQCOLL_TIMEOUT_S is long: a loaded machine is slow
rank, n = comm.rank, comm.world_size
report = {"rank": rank}

def data(r, numel=3000):
    return torch.randn(numel, generator=torch.Generator().manual_seed(50 + r))

def attempt(key, fn):
    try:
        fn()
        report[key] = {"ok": True}
    except DqcollError as exc:
        report[key] = {"error": type(exc).__name__, "message": str(exc)}

if scenario == "checks":
    # 1. The torch transport gives the same bytes as the local transport (same seed and step).
    for scheme, algorithm in (("dynamiq", "butterfly"), ("dynamiq", "ring"), ("none", "direct")):
        buf = data(rank)
        dqcoll.allreduce(buf, scheme=scheme, algorithm=algorithm, seed=7, step=3)
        local = run_local(n, lambda c: dqcoll.allreduce(data(c.rank), scheme=scheme,
                          algorithm=algorithm, seed=7, step=3))
        again = data(rank)
        dqcoll.allreduce(again, scheme=scheme, algorithm=algorithm, seed=7, step=3)
        report[f"repeatable_{scheme}_{algorithm}"] = bool(torch.equal(buf, again))
        report[f"same_as_local_{scheme}_{algorithm}"] = bool(torch.equal(buf, local[rank]))
        report[f"vs_local_{scheme}_{algorithm}"] = dqcoll.metrics.vnmse(buf, local[rank])
        digest = torch.tensor([float(buf.double().sum())], dtype=torch.float64)
        low, high = digest.clone(), digest.clone()
        torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
        torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
        report[f"ranks_agree_{scheme}_{algorithm}"] = bool(low.item() == high.item())
    # 1b. The small all-reduce as one exchange combined in rank order gives the bits of
    # the scatter-and-gather over point-to-point messages; a rank at another step is refused.
    from dqcoll.transports.base import reduce_in_rank_order
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in ("sum", "max", "min"):
            t = (data(rank, 100) * 1000).to(dtype)  # n copies within GATHERED_ALLREDUCE_NBYTES
            gathered = t.clone()
            before = comm.counters["allreduce_bytes_sent"]
            comm.transport.allreduce(gathered, op, what="gathered check")
            # the one-exchange path: n - 1 copies out (the two-step one counts 2 (n-1)/n)
            report[f"gathered_one_exchange_{dtype}_{op}"] = (
                comm.counters["allreduce_bytes_sent"] - before
                == (n - 1) * t.numel() * t.element_size())
            pairwise = reduce_in_rank_order(comm.transport._post, rank, n, t.clone(), op, "pairs")
            report[f"same_as_local_gathered_{dtype}_{op}"] = bool(torch.equal(gathered, pairwise))
    label = "gathered check B" if rank == 1 else "gathered check A"
    attempt("gathered_mismatch", lambda: comm.transport.allreduce(torch.ones(4), "sum", what=label))
    # 2. A mismatched length and an invalid input on one rank: every rank raises, nothing moves.
    sent = comm.counters["payload_bytes_sent"]
    buf = data(rank, 3000 + (rank == 1))
    keep = buf.clone()
    attempt("mismatch", lambda: dqcoll.allreduce(buf))
    report["mismatch_untouched"] = bool(torch.equal(buf, keep))
    bad = data(rank, 6000)[::2] if rank == 2 else data(rank)
    attempt("invalid", lambda: dqcoll.allreduce(bad))
    report["payload_moved"] = comm.counters["payload_bytes_sent"] - sent

if scenario in ("checks", "stall"):  # "checks" ends with rank 1 exiting mid-collective
    def fault(original):  # both entry points: dynamiq's payloads travel in frames
        def exchange(sends, recvs, *, what):
            if rank == 1 and "reduce step 1" in what:
                if scenario == "checks":
                    os._exit(17)
                time.sleep(fault_timeout_s * 1.5 + 1)
            return original(sends, recvs, what=what)
        return exchange
    comm.transport.exchange = fault(comm.transport.exchange)
    comm.transport.exchange_framed = fault(comm.transport.exchange_framed)
    x = data(rank)
    buf = x.clone()
    torch.distributed.barrier()  # start the faulty collective together, with the short timeout
    comm.transport.timeout_s = fault_timeout_s
    start = time.monotonic()
    attempt("collective", lambda: dqcoll.allreduce(buf, algorithm="butterfly"))
    report["elapsed_s"] = time.monotonic() - start
    report["untouched"] = bool(torch.equal(buf, x))

print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


def _run_gloo(scenario: str, world_size: int, timeout_s: float) -> dict[int, dict]:
    """Run the worker on ``world_size`` gloo processes; ``timeout_s`` bounds the faulty call."""
    return run_gloo_script(_WORKER, world_size, timeout_s=120, env={"DQCOLL_TIMEOUT_S": "60"},
                           argv=[scenario, str(timeout_s)])


@pytest.fixture(scope="module")
def gloo_checks() -> dict[int, dict]:
    """One 3-process gloo job: transport checks, bad input, then rank 1 exits mid-collective."""
    return _run_gloo("checks", 3, timeout_s=3.0)


def test_gloo_transport_matches_local_and_reports_bad_input_everywhere(gloo_checks):
    """Over gloo processes: results are bit-identical across ranks, repeat bit for bit with the
    same seed and step, and equal the local transport's bit for bit (the small all-reduce of
    statistics sums in rank order on every transport); a length mismatch
    raises MismatchError on every rank and an invalid input raises on its rank and PeerError
    (naming it) elsewhere, with no payload moved and buffers untouched."""
    assert gloo_checks[1]["exit"] == 17  # it reported nothing: it exits in the last collective
    for rank in (0, 2):
        rep = gloo_checks[rank]
        assert rep["exit"] == 0, rep
        for key, value in rep.items():
            if key.startswith(("repeatable", "ranks_agree", "same_as_local")):
                assert value is True, (rank, key)
        assert rep["mismatch"]["error"] == "MismatchError", rep
        assert rep["gathered_mismatch"]["error"] == "MismatchError", rep
        assert "another step" in rep["gathered_mismatch"]["message"]
        assert sum(k.startswith("same_as_local_gathered") for k in rep) == 9
        assert sum(k.startswith("gathered_one_exchange") for k in rep) == 9
        assert all(v for k, v in rep.items() if k.startswith("gathered_one_exchange")), rep
        assert "numel" in rep["mismatch"]["message"]
        assert rep["mismatch_untouched"]
        expected = "InvalidArgumentError" if rank == 2 else "PeerError"
        assert rep["invalid"]["error"] == expected, rep
        if rank != 2:
            assert "rank 2" in rep["invalid"]["message"]
        assert rep["payload_moved"] == 0


@pytest.mark.parametrize("scenario", ["die", "stall"])
def test_gloo_dead_or_stalled_rank_reported_within_timeout(scenario, gloo_checks):
    """Over gloo processes: when rank 1 exits (os._exit) or sleeps mid-collective, every other
    rank raises a DqcollError naming a peer rank and the step within the timeout (plus slack),
    and its buffer is untouched."""
    timeout_s = 3.0
    reports = gloo_checks if scenario == "die" else _run_gloo(scenario, 3, timeout_s=timeout_s)
    if scenario == "die":
        assert reports[1]["exit"] == 17
    for rank in (0, 2):
        rep = reports[rank]
        assert rep["exit"] == 0, rep
        err = rep["collective"]
        assert err.get("error") in ("PeerError", "CollectiveTimeoutError"), rep
        assert re.search(r"allreduce#\d+ (reduce|gather) step \d", err["message"]), err
        assert "rank 1" in err["message"] or "rank 0" in err["message"] or "rank 2" in err[
            "message"]
        assert rep["elapsed_s"] < 2 * timeout_s + 5
        assert rep["untouched"]
    # The rank that waits on rank 1 first names it.
    assert any("rank 1" in reports[r]["collective"]["message"] for r in (0, 2))


# -- argument mismatches and invalid input ----------------------------------------------------

_MISMATCHES = {
    "numel": ({"numel": 1001}, "numel"),
    "dtype": ({"dtype": torch.bfloat16}, "dtype"),
    "scheme": ({"scheme": "none"}, "scheme"),
    "bits": ({"bits": 6.0}, "scheme"),
    "energy_exponent": ({"energy_exponent": 0.5}, "scheme"),
    "algorithm": ({"algorithm": "ring"}, "algorithm"),
    "op": ({"op": "avg"}, "op"),
    "seed": ({"seed": 99}, "seed"),
}


@pytest.mark.parametrize("field", list(_MISMATCHES))
@pytest.mark.parametrize("odd_rank", [0, 2])
def test_mismatch_detected_on_every_rank_before_data_moves(field, odd_rank):
    """Ranks that disagree on one argument all raise MismatchError naming it, no payload byte is
    sent, and every buffer is unchanged."""
    change, name = _MISMATCHES[field]

    def fn(comm):
        args = {"numel": 1000, "dtype": torch.float32, "scheme": "dynamiq", "bits": 5.0,
                "algorithm": "butterfly", "op": "sum", "seed": 1}
        if comm.rank == odd_rank:
            args.update(change)
        x = _input(comm.rank, args.pop("numel"), dtype=args.pop("dtype"))
        buf = x.clone()
        try:
            dqcoll.allreduce(buf, **args)
        except DqcollError as exc:
            return exc, torch.equal(buf, x), comm.counters["payload_bytes_sent"]
        return None, torch.equal(buf, x), comm.counters["payload_bytes_sent"]

    for exc, untouched, sent in run_local(3, fn, return_exceptions=True):
        assert isinstance(exc, MismatchError), exc
        assert name in str(exc)
        assert untouched and sent == 0


def _noncontiguous(rank):
    return _input(rank, 2000)[::2]


_INVALID = {
    "noncontiguous": (_noncontiguous, {}, "contiguous"),
    "float64": (lambda r: _input(r, 1000, dtype=torch.float64), {}, "float64"),
    "int32": (lambda r: torch.arange(1000, dtype=torch.int32), {}, "int32"),
    "unknown scheme": (lambda r: _input(r, 1000), {"scheme": "nope"}, "nope"),
    "unknown algorithm": (lambda r: _input(r, 1000), {"algorithm": "nope"}, "nope"),
    "unknown op": (lambda r: _input(r, 1000), {"op": "max"}, "max"),
    "bits too low": (lambda r: _input(r, 1000), {"bits": 0.5}, "bits"),
    "read-only numpy": (lambda r: np.ones(1000, np.float32), {"readonly": True}, "read-only"),
    "not an array": (lambda r: [1.0, 2.0], {}, "list"),
}


@pytest.mark.parametrize("kind", list(_INVALID))
def test_invalid_input_on_one_rank_reported_on_every_rank(kind):
    """An invalid buffer or argument on rank 1 raises InvalidArgumentError there and PeerError
    naming rank 1 on the others, before any payload moves; the valid buffers are unchanged."""
    make, extra, needle = _INVALID[kind]
    extra = dict(extra)
    readonly = extra.pop("readonly", False)

    def fn(comm):
        if comm.rank == 1:
            buf = make(comm.rank)
            if readonly:
                buf.flags.writeable = False
            kwargs = extra
        else:
            buf = _input(comm.rank, 1000)
            kwargs = {}
        keep = buf.clone() if isinstance(buf, torch.Tensor) else None
        try:
            dqcoll.allreduce(buf, **kwargs)
        except DqcollError as exc:
            same = keep is None or torch.equal(buf, keep)
            return exc, same, comm.counters["payload_bytes_sent"]
        return None, True, 0

    results = run_local(3, fn, return_exceptions=True)
    exc, _, _ = results[1]
    assert isinstance(exc, InvalidArgumentError), exc
    assert needle in str(exc)
    for rank in (0, 2):
        exc, untouched, sent = results[rank]
        assert isinstance(exc, PeerError), exc
        assert "rank 1" in str(exc)
        assert untouched and sent == 0


def test_error_mid_collective_leaves_every_buffer_untouched():
    """A failure after data started moving (rank 0 raises at the gather phase) leaves every
    rank's buffer exactly as it was: the result is written into the caller's buffer last."""

    def fn(comm):
        x = _input(comm.rank, 3000)
        buf = x.clone()
        if comm.rank == 0:
            _fail_at(comm, "gather step 0", lambda: (_ for _ in ()).throw(_Died("late")))
        try:
            dqcoll.allreduce(buf, algorithm="ring")
        except (_Died, DqcollError) as exc:
            return type(exc).__name__, torch.equal(buf, x), comm.counters["payload_bytes_sent"]
        return None, torch.equal(buf, x), 0

    results = run_local(3, fn, timeout_s=1.0, return_exceptions=True)
    assert results[0][0] == "_Died"
    for name, untouched, _ in results:
        assert name is not None
        assert untouched
    assert any(sent > 0 for _, _, sent in results)  # data had moved before the failure


# -- non-finite and extreme values ------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nonfinite_input_reaches_every_rank(value, scheme, algorithm):
    """NaN/Inf in one rank's input makes that coordinate non-finite on every rank (so a loss
    scaler sees the overflow); super-groups without one stay finite; ranks agree bit for bit."""
    position = 700

    def fn(comm):
        x = _input(comm.rank, 1500)
        if comm.rank == 2:
            x[position] = value
        dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm)
        return x

    outs = run_local(3, fn)
    row = position // SUPER
    for out in outs:
        assert not torch.isfinite(out[position])
        outside = torch.ones(out.numel(), dtype=torch.bool)
        outside[row * SUPER : (row + 1) * SUPER] = False
        assert torch.isfinite(out[outside]).all()
        assert _bits(out) == _bits(outs[0])


@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-10, 1.0, 1e10, 1e20, 1e30])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_finite_inputs_at_any_magnitude_stay_finite_and_accurate(scale, dtype, scheme):
    """Finite inputs at magnitudes 1e-30..1e30 give finite outputs, identical on every rank, with
    the same relative error as at magnitude 1, within the byte budget (from 64 super-groups on
    the budget is exact; smaller buffers budget their tail's padding, scheme.py)."""
    n = 4
    numel = 64 * 256 + 80

    def fn(comm):
        x = _input(comm.rank, numel, scale=scale, dtype=dtype)
        dqcoll.allreduce(x, scheme=scheme, algorithm="ring", bits=5.0)
        return x, dict(comm.last_info)

    results = run_local(n, fn)
    exact = sum(_input(r, numel, scale=scale, dtype=dtype).double() for r in range(n))
    out, info = results[0]
    assert torch.isfinite(out).all()
    assert all(_bits(o) == _bits(out) for o, _ in results)
    bound = 0.06 if scheme == "dynamiq" else 1e-4
    assert metrics.vnmse(out, exact) < bound
    if scheme == "dynamiq":
        assert info["bits"] <= 5.0 and not info["over_budget"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_all_zero_super_groups_stay_exact_zero(scheme):
    """Super-groups that are zero on every rank come out exactly zero (no NaN from a zero scale),
    and super-groups zero on only some ranks are still reduced correctly."""
    n = 3

    def fn(comm):
        x = _input(comm.rank, 5 * SUPER + 17)
        x[: 2 * SUPER] = 0.0  # zero everywhere
        if comm.rank != 1:
            x[3 * SUPER : 4 * SUPER] = 0.0  # nonzero on rank 1 only
        keep = x.clone()
        dqcoll.allreduce(x, scheme=scheme)
        return x, keep

    results = run_local(n, fn)
    exact = sum(keep.double() for _, keep in results)
    for out, _ in results:
        assert torch.isfinite(out).all()
        assert (out[: 2 * SUPER] == 0).all()
        part = slice(3 * SUPER, 4 * SUPER)
        assert metrics.vnmse(out[part], exact[part]) < 0.06


def test_all_zero_input_gives_exact_zero():
    """An all-zero buffer on every rank comes back exactly zero, without NaN."""
    outs = run_local(3, lambda comm: dqcoll.allreduce(torch.zeros(1000)))
    for out in outs:
        assert (out == 0).all()


# -- awkward lengths -------------------------------------------------------------------------


def _lengths(n: int) -> list[int]:
    around = {0, 1, 2, n - 1, n, n + 1, 255, 256, 257, 511, 512, 513,
              SUPER * n - 1, SUPER * n, SUPER * n + 1, 16 * n + 1}
    return sorted(v for v in around if v >= 0)


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_awkward_lengths(world_size, scheme, algorithm):
    """Empty, length 1, and lengths just below/at/above multiples of 256 and of the world size:
    shape and dtype kept, ranks identical, result equal to the exact sum (none) or within the
    error budget (dynamiq)."""

    def fn(comm, numel):
        x = torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(comm.rank),
                          dtype=torch.int64).float()
        dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm)
        return x

    for numel in _lengths(world_size):
        outs = run_local(world_size, fn, numel)
        exact = sum(torch.randint(-8, 9, (numel,), generator=torch.Generator().manual_seed(r),
                                  dtype=torch.int64).double() for r in range(world_size))
        for out in outs:
            assert out.shape == (numel,) and out.dtype == torch.float32
            assert _bits(out) == _bits(outs[0])
        if scheme == "none":
            assert torch.equal(outs[0].double(), exact), numel
        elif numel >= SUPER:
            # Below one super-group (and at 257 = 256 + 1, where the second super-group's
            # statistics use the budget) the cheapest allocation is 2 bits: noisy but unbiased.
            assert metrics.vnmse(outs[0], exact) < (0.1 if numel % SUPER != 1 else 3.0), numel


def test_world_size_one_is_identity():
    """With one rank the all-reduce returns the input unchanged (no codec applied)."""
    x = _input(0, 777)
    out = run_local(1, lambda comm: dqcoll.allreduce(x.clone()))[0]
    assert torch.equal(out, x)


def test_aborted_communicator_raises_instead_of_waiting():
    """After abort(), a collective raises CommAbortedError at once rather than waiting."""

    def fn(comm):
        start = time.monotonic()
        if comm.rank == 0:
            comm.abort("test")
        try:
            dqcoll.allreduce(_input(comm.rank, 100))
        except CommAbortedError:
            return time.monotonic() - start
        return None

    for elapsed in run_local(2, fn, timeout_s=20.0, return_exceptions=True):
        assert isinstance(elapsed, float) and elapsed < 5.0
