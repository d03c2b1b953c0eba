"""The communicator's pool of CPU byte buffers (dqcoll.scratch): no two live buffers of a call
share memory, the next call reuses the blocks, results do not depend on it, and a failed call
discards the pool."""

from __future__ import annotations

import itertools

import pytest
import torch

import dqcoll
from dqcoll import scratch
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel()


def test_buffers_of_a_call_are_disjoint_and_reused_by_the_next():
    pool = scratch.ScratchPool()
    sizes = [100, 70_000, 300_000, 65_536, 1, 0, 5_000_000]
    first = [pool.take(n) for n in sizes]
    assert [t.numel() for t in first] == sizes
    assert all(t.dtype == torch.uint8 and t.device.type == "cpu" for t in first)
    spans = sorted(_span(t) for t in first if t.numel())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    held = pool.nbytes
    pool.release()
    second = [pool.take(n) for n in sizes]  # the same requests: the same blocks, no new ones
    assert pool.nbytes == held
    assert {t.data_ptr() for t in second} == {t.data_ptr() for t in first}
    pool.release()
    for _ in range(scratch.KEEP_IDLE_CALLS - 1):  # smaller calls: the other blocks are kept ...
        pool.take(10)
        pool.release()
        assert pool.nbytes == held
    pool.take(10)  # ... until KEEP_IDLE_CALLS calls in a row did not take them
    pool.release()
    assert pool.nbytes == scratch.MIN_BLOCK_NBYTES


def test_calls_that_alternate_keep_their_blocks():
    """A communicator whose calls alternate between one block and two (a two-level plan's
    reduce-scatter and all-gather) allocates nothing after the first of each."""
    pool = scratch.ScratchPool()
    for _ in range(2):
        pool.take(1 << 20)
        pool.release()
        pool.take(1 << 20)
        pool.take(1 << 20)
        pool.release()
    held = pool.nbytes
    for _ in range(3):
        addresses = {pool.take(1 << 20).data_ptr()}
        pool.release()
        addresses |= {pool.take(1 << 20).data_ptr(), pool.take(1 << 20).data_ptr()}
        pool.release()
        assert pool.nbytes == held and len(addresses) == 2


def test_pool_only_for_cpu_calls_of_a_communicator():
    state: dict = {}
    assert scratch.pool_for(None, torch.device("cpu")) is None
    assert scratch.pool_for(state, torch.device("cuda", 0)) is None
    pool = scratch.pool_for(state, torch.device("cpu"))
    assert pool is not None and scratch.pool_for(state, torch.device("cpu")) is pool
    scratch.discard(state)
    assert scratch.pool_for(state, torch.device("cpu")) is not pool


def test_allreduce_results_do_not_depend_on_the_pool():
    """Calls that reuse the pool's blocks (dirty from the previous call) give the bits of a
    first call on a fresh communicator; the pool keeps blocks between calls."""
    sizes = [300_001, 65_536 * 4, 1_000_000]

    def fn(comm: dqcoll.Communicator) -> tuple[list[torch.Tensor], int]:
        out = []
        for numel in sizes:
            g = torch.Generator().manual_seed(1000 * comm.rank + numel)
            x = torch.randn(numel, generator=g)
            dqcoll.allreduce(x, op="avg", scheme="dynamiq", bits=5, comm=comm, seed=7, step=0,
                             algorithm="butterfly")
            out.append(x)
        pool = scratch.pool_for(comm.scheme_state, torch.device("cpu"))
        assert pool is not None
        return out, pool.nbytes

    reused = run_local(4, fn)
    for i, numel in enumerate(sizes):
        def fresh(comm: dqcoll.Communicator, numel: int = numel) -> torch.Tensor:
            g = torch.Generator().manual_seed(1000 * comm.rank + numel)
            x = torch.randn(numel, generator=g)
            dqcoll.allreduce(x, op="avg", scheme="dynamiq", bits=5, comm=comm, seed=7, step=0,
                             algorithm="butterfly")
            return x
        for rank, x in enumerate(run_local(4, fresh)):
            assert torch.equal(x, reused[rank][0][i]), (rank, numel)
    assert all(nbytes > 0 for _, nbytes in reused)


def test_a_failed_call_discards_the_pool(monkeypatch):
    """A call that fails in its transfers leaves no pool behind (a failed receive may still
    land in its buffer later)."""

    def fn(comm: dqcoll.Communicator) -> bool:
        x = torch.randn(200_000)
        dqcoll.allreduce(x, scheme="dynamiq", bits=5, comm=comm)
        assert scratch.pool_for(comm.scheme_state, torch.device("cpu")) is not None
        original = comm.transport.exchange

        def failing(sends, recvs, *, what):  # type: ignore[no-untyped-def]
            if "gather" in what:
                raise DqcollError(f"rank {comm.rank}: injected failure at {what}")
            return original(sends, recvs, what=what)

        monkeypatch.setattr(comm.transport, "exchange", failing)
        with pytest.raises(DqcollError, match="injected"):
            dqcoll.allreduce(x, scheme="dynamiq", bits=5, comm=comm)
        return scratch._KEY not in comm.scheme_state

    assert run_local(2, fn) == [True, True]
