"""The uncompressed scheme over every schedule: exact on exactly representable inputs."""

from __future__ import annotations

import pytest
import torch
from conftest import integer_input

import dqcoll
from dqcoll.testing import run_local

ALGORITHMS = ["ring", "butterfly", "direct"]
WORLD_SIZES = [1, 2, 3, 5, 8]
LENGTHS = [1, 7, 1001, 4099]


def _allreduce_ints(comm, numel, algorithm, dtype, op, high=64):  # type: ignore[no-untyped-def]
    x = integer_input(comm.rank, numel, dtype, high)
    poison = x.clone()
    result = dqcoll.allreduce(x, scheme="none", algorithm=algorithm, op=op)
    assert result is x  # in place, same object back
    return x, poison


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("numel", LENGTHS)
def test_none_sum_is_exact(algorithm: str, world_size: int, numel: int) -> None:
    """Sums of small integers are exact on every rank for every algorithm, world size and odd
    length (no element lost, duplicated or misplaced)."""
    results = run_local(world_size, _allreduce_ints, numel, algorithm, torch.float32, "sum")
    exact = sum(integer_input(r, numel).double() for r in range(world_size))
    for out, _ in results:
        assert torch.equal(out.double(), exact)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_none_low_precision_dtypes_exact(dtype: torch.dtype, algorithm: str) -> None:
    """bf16 and fp16 travel in their own dtype; integer sums that fit the significand (|sum| <=
    5 * 32 < 256) stay exact at every hop."""
    results = run_local(5, _allreduce_ints, 777, algorithm, dtype, "sum", 32)
    exact = sum(integer_input(r, 777, dtype, 32).double() for r in range(5))
    for out, _ in results:
        assert out.dtype == dtype
        assert torch.equal(out.double(), exact)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_none_avg_divides_the_exact_sum(algorithm: str) -> None:
    """op=avg gives the exact sum divided by n (one rounding)."""
    n = 4
    results = run_local(n, _allreduce_ints, 999, algorithm, torch.float32, "avg")
    exact = (sum(integer_input(r, 999).double() for r in range(n)) / n).float()
    for out, _ in results:
        assert torch.equal(out, exact)


def test_numpy_buffers_in_place() -> None:
    """A NumPy array is reduced in place and the same object is returned."""
    import numpy as np

    def body(comm):  # type: ignore[no-untyped-def]
        x = np.full(300, comm.rank + 1, dtype=np.float32)
        out = dqcoll.allreduce(x, scheme="none", algorithm="ring")
        return out is x, x.copy()

    for same, values in run_local(3, body):
        assert same
        assert (values == 6).all()


def test_multidimensional_tensor_keeps_shape() -> None:
    """Any contiguous shape works; the result keeps it."""

    def body(comm):  # type: ignore[no-untyped-def]
        x = torch.ones(3, 5, 7) * (comm.rank + 1)
        dqcoll.allreduce(x, scheme="none")
        return x

    for out in run_local(2, body):
        assert out.shape == (3, 5, 7) and torch.equal(out, torch.full((3, 5, 7), 3.0))


def test_empty_tensor_is_a_no_op() -> None:
    """Zero elements: nothing moves, nothing fails."""

    def body(comm):  # type: ignore[no-untyped-def]
        x = torch.empty(0)
        dqcoll.allreduce(x)
        return x.numel()

    assert run_local(3, body) == [0, 0, 0]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_reduce_scatter_and_all_gather_none(algorithm: str, world_size: int) -> None:
    """reduce_scatter gives each rank its shard of the exact sum; all_gather concatenates the
    shards in rank order; together they equal allreduce."""
    shard = 333

    def body(comm):  # type: ignore[no-untyped-def]
        x = integer_input(comm.rank, shard * comm.world_size)
        out = torch.full((shard,), float("nan"))
        dqcoll.reduce_scatter(x, out, scheme="none", algorithm=algorithm)
        gathered = torch.full((shard * comm.world_size,), float("nan"))
        dqcoll.all_gather(out, gathered, scheme="none", algorithm=algorithm)
        y = x.clone()
        dqcoll.allreduce(y, scheme="none", algorithm=algorithm)
        return out, gathered, y

    exact = sum(integer_input(r, shard * world_size).double() for r in range(world_size))
    for rank, (out, gathered, y) in enumerate(run_local(world_size, body)):
        assert torch.equal(out.double(), exact[rank * shard : (rank + 1) * shard])
        assert torch.equal(gathered.double(), exact)
        assert torch.equal(gathered, y)
