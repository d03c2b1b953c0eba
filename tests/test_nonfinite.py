"""Non-finite inputs stay where they were; finite inputs give finite outputs.

One inf on one rank makes at most its own super-group non-finite, with every scheme (``thc``
and ``global_qsgd`` included, whose global statistic it must not reach) and in ``all_gather``
(the other ranks' finite shards stay finite). With error feedback in the DDP hook, the steps
after one inf gradient are finite on every rank (the residual of a non-finite coordinate is
not carried).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

import dqcoll
from dqcoll import metrics
from dqcoll.testing import run_local

INTEGER_SUM_SCHEMES = ["thc", "global_qsgd"]
ALGORITHMS = ["ring", "butterfly", "direct"]
COLLECTIVES = ["allreduce", "reduce_scatter", "all_gather"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NUMEL = 4096 * 3  # all-gather: 4096 per rank
SUPER = 256
# vNMSE of the finite coordinates against the exact sum (tests/test_properties.py's budgets)
BUDGET = {"thc": 0.06, "global_qsgd": 0.02}


def _collective(comm: dqcoll.Communicator, collective: str, x: torch.Tensor, scheme: str,
                algorithm: str) -> torch.Tensor:
    n = comm.world_size
    if collective == "allreduce":
        dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, seed=3)
        return x
    if collective == "reduce_scatter":
        out = torch.full((x.numel() // n,), float("nan"), dtype=x.dtype)
        dqcoll.reduce_scatter(x, out, scheme=scheme, algorithm=algorithm, seed=3)
        return out
    out = torch.full((n * x.numel(),), float("nan"), dtype=x.dtype)
    dqcoll.all_gather(x, out, scheme=scheme, algorithm=algorithm, seed=3)
    return out


def _inputs(n: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(numel, generator=gen).to(dtype) for _ in range(n)]


def _exact(collective: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    n = len(inputs)
    if collective == "all_gather":
        return torch.cat([x.double() for x in inputs])
    total = sum(x.double() for x in inputs)
    assert isinstance(total, torch.Tensor)
    return total.view(n, -1)[rank] if collective == "reduce_scatter" else total


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _run(comm: dqcoll.Communicator, collective: str, inputs: list[torch.Tensor], scheme: str,
         algorithm: str) -> torch.Tensor:
    return _collective(comm, collective, inputs[comm.rank].clone(), scheme, algorithm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("scheme", INTEGER_SUM_SCHEMES)
def test_one_inf_affects_at_most_its_super_group(scheme: str, collective: str,
                                                 dtype: torch.dtype) -> None:
    """One inf on one rank (rank 1, 10th coordinate of its input) leaves every other
    coordinate finite on every rank, for every algorithm: at most the 256 coordinates of its
    super-group are non-finite, the inf coordinate itself is +inf, all ranks agree bit for bit,
    and the finite coordinates are as close to the exact sum as without the inf."""
    n = 3
    numel = NUMEL // n if collective == "all_gather" else NUMEL
    inputs = _inputs(n, numel, dtype)
    inputs[1][9] = float("inf")
    where = (numel + 9) if collective == "all_gather" else 9  # the inf in the output
    for algorithm in ALGORITHMS:
        results = run_local(n, _run, collective, inputs, scheme, algorithm)
        for rank, out in enumerate(results):
            if collective != "reduce_scatter":  # one result for all: the same bits
                assert torch.equal(_bits(out), _bits(results[0])), (algorithm, rank)
            bad = (~torch.isfinite(out)).nonzero().view(-1)
            if collective == "reduce_scatter" and rank != 0:
                assert bad.numel() == 0, (algorithm, rank, bad.numel())
                mask = torch.ones(out.numel(), dtype=torch.bool)
            else:
                assert 1 <= bad.numel() <= SUPER, (algorithm, rank, bad.numel())
                assert int(bad.max()) - int(bad.min()) < SUPER
                assert out[where].item() == float("inf")
                mask = torch.isfinite(out)
            exact = _exact(collective, inputs, rank)
            error = metrics.vnmse(out[mask].double(), exact[mask])
            assert error < BUDGET[scheme], (algorithm, rank, error)


@pytest.mark.parametrize("scheme", INTEGER_SUM_SCHEMES)
def test_inf_meeting_minus_inf_and_nan_give_nan_in_their_group(scheme: str) -> None:
    """+inf and -inf in the same super-group (on two ranks), or a NaN, make that super-group
    NaN; a -inf alone gives -inf; every other super-group stays finite."""
    n = 3
    inputs = _inputs(n, NUMEL, torch.float32)
    inputs[0][300] = float("inf")
    inputs[2][301] = float("-inf")  # same super-group as 300: NaN
    inputs[1][1000] = float("nan")
    inputs[2][2000] = float("-inf")
    results = run_local(n, _run, "allreduce", inputs, scheme, "ring")
    for out in results:
        bad = ~torch.isfinite(out)
        groups = sorted({int(i) // SUPER for i in bad.nonzero().view(-1)})
        assert groups == [300 // SUPER, 1000 // SUPER, 2000 // SUPER]
        assert out[300].isnan() and out[1000].isnan() and out[2000].item() == float("-inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_finite_extremes_give_finite_outputs_with_every_scheme(collective: str,
                                                               dtype: torch.dtype) -> None:
    """Finite inputs up to the dtype's largest value (one super-group at 0.9 x max on every
    rank, one beside it at 1e-3 x max, the rest N(0,1)) give finite outputs, the same on every
    rank, with every scheme on every algorithm; sums beyond the range saturate at it."""
    n = 3
    numel = 3 * 1024
    top = torch.finfo(dtype).max
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x[:SUPER] = 0.9 * top
    x[SUPER : 2 * SUPER] *= 1e-3 * top
    inputs = [x.to(dtype) for _ in range(n)]
    for scheme in dqcoll.schemes.list_schemes():
        for algorithm in ALGORITHMS:
            results = run_local(n, _run, collective, inputs, scheme, algorithm)
            for rank, out in enumerate(results):
                assert torch.isfinite(out).all(), (scheme, algorithm, rank)


# -- error feedback in the DDP hook ------------------------------------------------------------


def _ef_training(rank: int, world_size: int) -> dict[str, Any]:
    """Six steps with error feedback; at step 2 rank 1's gradient of one weight is inf."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(37, 301), nn.GELU(), nn.Linear(301, 5))
    model = DistributedDataParallel(net, bucket_cap_mb=0.05)
    state = DynamiqState(scheme="dynamiq", bits=5, warmup_steps=0, error_feedback=True)
    model.register_comm_hook(state, dynamiq_hook)
    bad_per_step = []
    grads_per_step = []
    for step in range(6):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 37, generator=g), torch.randn(16, 5, generator=g)
        model.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if step == 2 and rank == 1:
            loss = loss + net[0].weight[0, 0] * float("inf")  # d loss / d w00 = inf
        loss.backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        bad_per_step.append(int((~torch.isfinite(grads)).sum()))
        grads_per_step.append(grads)
    state.drain()
    return {"bad": bad_per_step, "grads": grads_per_step}


def test_error_feedback_recovers_after_one_inf_gradient(tmp_path: pathlib.Path) -> None:
    """DDP over gloo, 2 ranks, dynamiq with ``error_feedback=True``: one inf gradient on one
    rank at one step makes that step's result non-finite in at most one super-group, and every
    later step (finite inputs) is finite on every rank, the replicas' gradients identical (the
    residual of a non-finite coordinate is not carried)."""
    from test_ddp_hook import _spawn

    results = _spawn(tmp_path, 2, _ef_training)
    for rank, result in enumerate(results):
        bad = result["bad"]
        assert bad[:2] == [0, 0], (rank, bad)
        assert 1 <= bad[2] <= SUPER, (rank, bad)
        assert bad[3:] == [0, 0, 0], (rank, bad)
    for a, b in zip(results[0]["grads"], results[1]["grads"], strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
