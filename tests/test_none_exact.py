"""``none`` is exact: the fp64 sum of the ranks' inputs rounded once to the input dtype.

Beside a huge value, scaling every input by the overflow shift would lose small fp16 values'
bits or flush them to zero, and rounding every partial sum to the input dtype at each hop would
lose more. The inputs here put huge and tiny values together (fp16 30000 beside 1e-4 and 1e-6,
bf16 1e38 beside 1e-37, fp32 1e38 beside 1e-8) beside per-coordinate scaled N(0,1) values whose
sums fp64 holds exactly, and cancellations that a narrower accumulator would lose.
"""

from __future__ import annotations

import pytest
import torch

import dqcoll
from dqcoll.testing import run_local

ALGORITHMS = ["ring", "butterfly", "direct"]
WORLD_SIZES = [2, 3, 5]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUMEL = 3840  # a multiple of 2, 3 and 5: every world size shards it
# (huge value, tiny value) per dtype: the pairs
_EXTREMES = {
    torch.float16: (30000.0, 1e-4),
    torch.bfloat16: (1e38, 1e-37),
    torch.float32: (1e38, 1e-8),
}
_TINY2 = {torch.float16: 1e-6, torch.bfloat16: 3e-38, torch.float32: 1e-30}
# a value far below 1 that survives 1 + v - 1 only when nothing rounds before the end
_CANCEL = {torch.float16: 2.0**-24, torch.bfloat16: 2.0**-30, torch.float32: 2.0**-40}
# per-coordinate binary exponents of the N(0,1) background (inside the dtype's normal range)
_SCALES = {torch.float16: (-10, 10), torch.bfloat16: (-60, 60), torch.float32: (-60, 60)}


def _inputs(n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Each rank's input: N(0,1) times a per-coordinate power of two (the same on every rank,
    so that fp64 holds the sums exactly), with the issue's huge and tiny values and
    cancellations in the first coordinates."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = _SCALES[dtype]
    scale = torch.pow(2.0, torch.randint(lo, hi, (NUMEL,), generator=gen).double())
    huge, tiny = _EXTREMES[dtype]
    out = []
    for r in range(n):
        x = torch.randn(NUMEL, generator=gen, dtype=torch.float64) * scale
        x[0] = huge if r == 0 else tiny  # one huge value: the overflow shift used to apply
        x[1] = huge  # on every rank: sums beyond the dtype's range saturate
        x[2:130] = tiny * (r + 1) * (1 + torch.arange(128, dtype=torch.float64) / 128)
        x[130:200] = _TINY2[dtype] * (r + 1)
        # 1, v, -1, 0, ...: exact only if 1 + v is not rounded before -1 arrives
        x[200:260] = {0: 1.0, 1: _CANCEL[dtype], 2: -1.0}.get(r, 0.0)
        out.append(x.to(dtype))
    return out


def _rounded_once(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp64 result rounded once to ``dtype``, saturating finite values at its largest."""
    top = torch.finfo(dtype).max
    return torch.where(torch.isfinite(total), total.clamp(-top, top), total).to(dtype)


def _reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    total = torch.zeros(NUMEL, dtype=torch.float64)
    for x in inputs:
        total += x.double()
    if op == "avg":
        total /= len(inputs)
    return _rounded_once(total, inputs[0].dtype)


def _run(comm: dqcoll.Communicator, collective: str, inputs: list[torch.Tensor], algorithm: str,
         op: str) -> torch.Tensor:
    n = comm.world_size
    x = inputs[comm.rank].clone()
    if collective == "allreduce":
        dqcoll.allreduce(x, scheme="none", algorithm=algorithm, op=op)
        return x
    if collective == "reduce_scatter":
        out = torch.full((NUMEL // n,), float("nan"), dtype=x.dtype)
        dqcoll.reduce_scatter(x, out, scheme="none", algorithm=algorithm, op=op)
        return out
    shard = x[comm.rank * (NUMEL // n) : (comm.rank + 1) * (NUMEL // n)].clone()
    out = torch.full((NUMEL,), float("nan"), dtype=x.dtype)
    dqcoll.all_gather(shard, out, scheme="none", algorithm=algorithm)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_none_is_the_fp64_sum_rounded_once(algorithm: str, world_size: int,
                                           dtype: torch.dtype) -> None:
    """For every collective, algorithm, world size 2/3/5 and dtype, ``none`` gives bit for bit
    the fp64 sum of the inputs rounded once to the dtype (saturating where the sum exceeds its
    largest finite value; ``op="avg"``: the fp64 sum divided by n, rounded once), on every rank;
    all-gather gives the shards unchanged."""
    n = world_size
    inputs = _inputs(n, dtype)
    for op in ("sum", "avg"):
        expected = _reference(inputs, op)
        results = run_local(n, _run, "allreduce", inputs, algorithm, op)
        for rank, out in enumerate(results):
            wrong = (_bits(out) != _bits(expected)).sum().item()
            assert wrong == 0, f"allreduce {op}, rank {rank}: {wrong} of {NUMEL} differ"
        results = run_local(n, _run, "reduce_scatter", inputs, algorithm, op)
        for rank, out in enumerate(results):
            mine = expected.view(n, -1)[rank]
            wrong = (_bits(out) != _bits(mine)).sum().item()
            assert wrong == 0, f"reduce_scatter {op}, rank {rank}: {wrong} differ"
    results = run_local(n, _run, "all_gather", inputs, algorithm, "sum")
    gathered = torch.cat([x.view(n, -1)[r] for r, x in enumerate(inputs)])
    for rank, out in enumerate(results):
        assert torch.equal(_bits(out), _bits(gathered)), f"all_gather rank {rank}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_none_keeps_non_finite_values_in_their_coordinate(dtype: torch.dtype) -> None:
    """An inf, a -inf and a NaN on one rank (and inf meeting -inf) make only their own
    coordinates non-finite; every other coordinate is still the exact sum rounded once."""
    n = 3
    inputs = _inputs(n, dtype, seed=1)
    inputs[1][300] = float("inf")
    inputs[2][301] = float("-inf")
    inputs[0][302] = float("nan")
    inputs[0][303], inputs[2][303] = float("inf"), float("-inf")
    expected = _reference(inputs, "sum")
    for algorithm in ALGORITHMS:
        for out in run_local(n, _run, "allreduce", inputs, algorithm, "sum"):
            assert torch.equal(_bits(out[:300]), _bits(expected[:300]))
            assert torch.equal(_bits(out[304:]), _bits(expected[304:]))
            assert out[300].item() == float("inf") and out[301].item() == float("-inf")
            assert out[302].isnan() and out[303].isnan()


def test_none_reports_its_wire_bytes() -> None:
    """``last_info["wire_payload_nbytes"]`` is what the ranks sent: the direct algorithm and
    two ranks move the input dtype's bytes only, a ring of 5 sends fp64 partial sums."""
    def body(comm: dqcoll.Communicator, algorithm: str) -> tuple[int, int]:
        x = torch.randn(1000, dtype=torch.float16)
        comm.counters.reset()
        dqcoll.allreduce(x, scheme="none", algorithm=algorithm)
        return comm.counters["payload_bytes_sent"], comm.last_info["wire_payload_nbytes"]

    for n, algorithm in ((2, "ring"), (5, "direct"), (5, "ring"), (5, "butterfly")):
        results = run_local(n, body, algorithm)
        sent = sum(s for s, _ in results)
        assert all(info == sent for _, info in results), (n, algorithm)
        in_dtype = 2 * (n - 1) * 1000 * 2
        if n == 2 or algorithm == "direct":
            assert sent == in_dtype
        else:
            assert in_dtype < sent <= (n - 1) * 1000 * (2 + 8)


def test_none_widens_only_what_it_sums_and_reuses_its_buffers() -> None:
    """On the CPU, ``none`` widens to fp64 only the chunks a rank sums (an all-gather none, a
    ring reduce-scatter of 4 ranks the 3 chunks passing through the rank), and a second call of
    the same size takes its payloads, sums and work buffer from the communicator's pool
    (dqcoll.scratch) instead of new allocations; the results stay the fp64 sums rounded once."""
    from dqcoll import scratch as scratch_module
    from dqcoll.schemes import none as none_module

    made: list[tuple[int, set[int]]] = []
    real_init = none_module.ExactSumCall.__init__

    def spy(self: object, x: torch.Tensor, ctx: object) -> None:
        real_init(self, x, ctx)  # type: ignore[arg-type]
        made.append((x.numel(), self._widened))  # type: ignore[attr-defined]

    def body(comm: dqcoll.Communicator) -> tuple[torch.Tensor, torch.Tensor, int, int]:
        x = torch.randn(4096, generator=torch.Generator().manual_seed(comm.rank))
        shard = torch.empty(1024)
        dqcoll.reduce_scatter(x, shard, scheme="none", algorithm="ring")
        pool = scratch_module.pool_for(comm.scheme_state, torch.device("cpu"))
        assert pool is not None
        held = pool.nbytes
        dqcoll.reduce_scatter(x, shard, scheme="none", algorithm="ring")
        after = pool.nbytes
        full = torch.empty(4096)
        dqcoll.all_gather(shard, full, scheme="none", algorithm="ring")
        return shard, full, held, after

    original = none_module.ExactSumCall.__init__
    none_module.ExactSumCall.__init__ = spy  # type: ignore[method-assign]
    try:
        results = run_local(4, body)
    finally:
        none_module.ExactSumCall.__init__ = original  # type: ignore[method-assign]
    exact = sum(torch.randn(4096, generator=torch.Generator().manual_seed(r)).double()
                for r in range(4)).float()
    for rank, (shard, full, held, after) in enumerate(results):
        assert torch.equal(shard, exact[rank * 1024:(rank + 1) * 1024]), rank
        assert torch.equal(full, exact), rank
        assert after == held, (rank, held, after)  # the second call took no new block
    # 8 reduce-scatters (3 of 4 chunks summed on each rank), 4 all-gathers (none summed)
    assert sorted(len(chunks) for _, chunks in made) == [0] * 4 + [3] * 8


_NONE_OVER_GLOO = r"""
import json, os, torch, dqcoll
comm = dqcoll.init(backend="gloo")
r, n = comm.rank, comm.world_size
report = {"ok": []}
for numel in (1000, (1 << 20) + 3):
    for algorithm in ("ring", "butterfly", "direct"):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
        exact = sum(torch.randn(numel, generator=torch.Generator().manual_seed(k)).double()
                    for k in range(n)).float()
        dqcoll.allreduce(x, scheme="none", algorithm=algorithm)
        report["ok"].append(bool(torch.equal(x, exact)))
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("world_size", [3, 4])
def test_none_over_gloo_is_exact_and_frames_alike(world_size: int) -> None:
    """``none`` over gloo ranks, with payloads above the size that travels in one message with
    its header: every rank exits cleanly with the fp64 sum rounded once, on every algorithm
    (a rank that framed a payload while its peer expected a header message alone would abort
    inside gloo)."""
    from conftest import run_gloo_script

    reports = run_gloo_script(_NONE_OVER_GLOO, world_size, timeout_s=240,
                              env={"DQCOLL_TIMEOUT_S": "60"})
    for rank, report in reports.items():
        assert report["exit"] == 0, (rank, report)
        assert report["ok"] == [True] * 6, (rank, report)
