"""The ``dqcoll`` backend and the FSDP2 classes against the names the installed torch calls.

``torch.distributed`` reaches a Python process group through method names that changed in torch
2.12 (``_allgather_base`` became ``all_gather_single``, ``allgather_into_tensor_coalesced``
became ``all_gather_single_coalesced``, ...), and FSDP2's own exact collectives are
``dist.all_gather_into_tensor`` / ``dist.reduce_scatter_tensor`` before 2.12 and
``dist.all_gather_single`` / ``dist.reduce_scatter_single`` from it. These tests read the names
from the installed torch itself (its ``distributed_c10d`` source, the ``PyProcessGroup`` header
of its Python bindings, FSDP2's ``_fsdp_collectives``) and run the backend through torch's own
functions, so they check whichever torch runs them (the CI runs them under 2.11 and 2.13).
"""

from __future__ import annotations

import datetime
import inspect
import os
import pathlib
import re
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dqcoll.integrations import fsdp as dqfsdp
from dqcoll.integrations.policy import CompressionPolicy

WORLD = 2

# Methods distributed_c10d calls on a process group that are not collectives: identity and
# set-up (a Python process group answers them itself or through torch's base class), and the
# coalescing calls made only for ``_coalescing_manager(device=...)``, which FSDP2 and DDP do not
# use on a group (they coalesce with the fast path, i.e. the ``*_coalesced`` collectives).
NOT_COLLECTIVES = {
    "_end_coalescing", "_get_backend", "_has_hooks", "_register_backend", "_set_default_backend",
    "_set_group_desc", "_set_group_name", "_start_coalescing", "_wait_for_pending_works", "abort",
    "new_group", "rank", "shutdown", "size",
}


def _c10d_calls() -> set[str]:
    """The methods the installed ``distributed_c10d`` calls on a process group object."""
    source = inspect.getsource(dist.distributed_c10d)
    found = set(re.findall(r"\b(?:group|pg|default_pg|process_group)\.([A-Za-z_]+)\(", source))
    return found - NOT_COLLECTIVES


def _binding_overrides() -> set[str]:
    """The collectives that the installed torch's ``PyProcessGroup`` (the C++ side of a Python
    process group) forwards to Python by name; empty where the wheel has no headers."""
    header = next(pathlib.Path(torch.__file__).parent.glob(
        "include/torch/csrc/distributed/c10d/PyProcessGroup.hpp"), None)
    if header is None:
        return set()
    return set(re.findall(r"WORK_OVERRIDE\(\s*(?://[^\n]*\n\s*)*ProcessGroup,\s*/\*[^*]*\*/\s*"
                          r"([A-Za-z_]+),", header.read_text()))


def test_backend_defines_every_collective_this_torch_calls() -> None:
    """Every collective the installed torch calls on a Python process group (from Python, and
    from C++ through its bindings: DDP's reducer) is a method of ``DqcollProcessGroup`` itself,
    not the C++ base class's (which has no backend to run it on)."""
    import dqcoll.integrations.torch_backend as backend

    calls = _c10d_calls()
    overrides = _binding_overrides()
    assert {"allreduce", "broadcast", "barrier"} <= calls  # the parsing found the calls
    assert not overrides or "allreduce" in overrides
    own = set(vars(backend.DqcollProcessGroup))
    missing = sorted((calls | overrides) - own)
    assert not missing, f"torch {torch.__version__} calls {missing} on a process group"


def test_fsdp_exact_path_is_fsdp2s_own_collectives() -> None:
    """The FSDP classes' exact path calls the very ``torch.distributed`` functions that FSDP2 of
    the installed torch calls for its own all-gather and reduce-scatter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    source = inspect.getsource(_fsdp_collectives)
    names = set(re.findall(r"\bdist\.((?:all_gather|reduce_scatter)_[a-z_]+)\(", source))
    assert len(names) == 2, names
    assert {getattr(dist, name) for name in names} == {dqfsdp.exact_all_gather,
                                                      dqfsdp.exact_reduce_scatter}


def test_premul_sum_factor_is_read_on_this_torch() -> None:
    """The factor of FSDP2's ``PREMUL_SUM`` (``_make_nccl_premul_sum(1 / f)``) is read on the
    installed torch (before 2.12 the op does not expose ``.factor``), so such a reduce-scatter
    is compressed as a pre-multiplied sum; SUM, AVG and MAX are told apart."""
    assert dqfsdp._op_kind(dist._make_nccl_premul_sum(0.25)) == ("premul", 0.25)
    assert dqfsdp._op_kind(dist.ReduceOp.SUM) == ("sum", 1.0)
    assert dqfsdp._op_kind(dist.ReduceOp.AVG) == ("avg", 1.0)
    assert dqfsdp._op_kind(dist.ReduceOp.MAX)[0] == "other"


# -- the backend through torch's own functions, 2 ranks ----------------------------------------

# this torch's single-tensor all-gather and reduce-scatter, by the names it has
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    import dqcoll.integrations.torch_backend as backend

    backend.set_policy(CompressionPolicy(min_nbytes=4096))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("dqcoll", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.save(_backend_calls(rank, world_size), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without gloo's C++ teardown (see tests/test_fsdp.py)


def _backend_calls(rank: int, n: int) -> dict[str, Any]:
    pg = dist.group.WORLD
    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(rank)
    # the single-tensor collectives FSDP2 of this torch calls, large (compressed) and small
    big = torch.randn(3001, generator=g)
    gathered = torch.full((n * 3001,), float("nan"))
    _all_gather(gathered, big)
    out["big_gather"] = (big, gathered)
    grads = torch.randn(n * 2048, generator=g)
    shard = torch.full((2048,), float("nan"))
    _reduce_scatter(shard, grads.clone(), op=dist.ReduceOp.AVG)
    out["big_scatter"] = (grads, shard)
    small = torch.arange(8, dtype=torch.float32) + 100 * rank
    small_out = torch.empty(n * 8)
    _all_gather(small_out, small)
    out["small_gather"] = small_out
    small_rs = torch.empty(4)
    _reduce_scatter(small_rs, torch.arange(n * 4, dtype=torch.float32) * (rank + 1))
    out["small_scatter"] = small_rs
    # coalesced all-gathers (the fast path of _coalescing_manager), and an all-to-all: exact
    outs = [torch.empty(n * 3), torch.empty(n * 5)]
    with dist._coalescing_manager(group=pg):
        for o, numel in zip(outs, (3, 5), strict=True):
            _all_gather(o, torch.full((numel,), float(rank)))
    out["coalesced"] = outs
    a2a = torch.empty(n * 2)
    dist.all_to_all_single(a2a, torch.arange(n * 2, dtype=torch.float32) + 10 * rank)
    out["a2a"] = a2a
    out["summary"] = pg.summary()
    return out


def test_backend_through_this_torchs_functions(tmp_path: pathlib.Path) -> None:
    """``init_process_group("dqcoll")`` on 2 ranks, called through the installed torch's own
    functions: the single-tensor all-gather and reduce-scatter (the names FSDP2 of this torch
    uses) compress large tensors (counted as such; within int8 / 5-bit error) and run small
    ones exact, the coalesced all-gathers and the all-to-all are exact, each result right."""
    mp.spawn(_worker, args=(WORLD, str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD,
             join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    from dqcoll import metrics

    shards = [r["big_gather"][0] for r in results]
    grads = sum(r["big_scatter"][0] for r in results) / WORLD
    for rank, result in enumerate(results):
        gathered = result["big_gather"][1]
        assert torch.equal(gathered, results[0]["big_gather"][1])  # same bytes on every rank
        assert metrics.vnmse(gathered, torch.cat(shards)) < 1e-3
        assert metrics.vnmse(result["big_scatter"][1], grads.view(WORLD, -1)[rank]) < 0.02
        assert torch.equal(result["small_gather"],
                           torch.cat([torch.arange(8.0) + 100 * r for r in range(WORLD)]))
        assert torch.equal(result["small_scatter"], torch.arange(4.0) * 3 + 4 * rank * 3)
        assert torch.equal(result["coalesced"][0], torch.tensor([0.0] * 3 + [1.0] * 3))
        assert torch.equal(result["coalesced"][1], torch.tensor([0.0] * 5 + [1.0] * 5))
        assert torch.equal(result["a2a"], torch.tensor(
            [2.0 * rank + 10 * r + j for r in range(WORLD) for j in range(2)]))
        summary = result["summary"]
        assert summary["compressed"]["weights"]["calls"] == 1
        assert summary["compressed"]["gradients"]["calls"] == 1
        exact = summary["exact_calls"]
        assert exact["all_gather_single"] == 1 and exact["reduce_scatter_single"] == 1, exact
        assert exact["all_gather_single_coalesced"] == 1 and exact["all_to_all_single"] == 1
