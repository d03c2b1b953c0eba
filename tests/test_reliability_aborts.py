"""No process aborts from message mix-ups: dqcoll's traffic over a torch gloo group never
shares message matching with the caller's own calls on that group.

* ``scheme="auto"``'s native choice (the group's own all-reduce) runs on dqcoll's worker
  thread; the caller (or DDP's reducer, which all-reduces its unused-parameter map with
  ``find_unused_parameters=True``) all-reduces on the same group meanwhile, from another
  thread, in an order that differs between ranks;
* dqcoll's point-to-point messages travel while the caller sends and receives its own, with
  the same tag, on the same group.

Shared matching would abort a rank inside gloo (``op.preamble.length <= op.nbytes``, SIGABRT): no
error, no cleanup. Every rank must complete with the right results. Multi-process tests run gloo
ranks on 127.0.0.1 (:func:`conftest.run_gloo_script`); each worker prints one ``REPORT {json}``
line and leaves with ``os._exit``.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from conftest import run_gloo_script

from dqcoll.errors import CollectiveTimeoutError

_HEADER = r"""
import json, os, sys, time, torch
import torch.distributed as dist
import dqcoll
from dqcoll.errors import DqcollError
def data(r, numel, salt=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + 70 + r))
def finish(report):
    print("REPORT " + json.dumps(report), flush=True)
    os._exit(0)
"""


def _assert_clean(reports: dict[int, dict], world_size: int) -> None:
    """Every rank exited 0 with a report and no error."""
    assert sorted(reports) == list(range(world_size)), reports
    for rank, rep in reports.items():
        assert rep["exit"] == 0, (rank, rep)
        assert "error" not in rep, (rank, rep)


def _assert_native_beside_allreduce(reports: dict[int, dict]) -> None:
    """3 clean ranks, 12 iterations of the native path, dqcoll's sums within fp32 rounding of
    the fp64 sums, the caller's all-reduces exact."""
    _assert_clean(reports, 3)
    for rank, rep in reports.items():
        assert rep["iterations"] == 12, (rank, rep)
        assert rep["scheme"] == "none", (rank, rep)
        assert rep["max_rel_err"] < 1e-5, (rank, rep)
        assert "wrong_user_allreduce" not in rep, (rank, rep)


# -- auto's native all-reduce beside the caller's all-reduce -------------------------------------

_AUTO_BESIDE_ALLREDUCE = _HEADER + r"""
comm = dqcoll.init(backend="gloo")
rank, n = comm.rank, comm.world_size
report = {"rank": rank, "iterations": 0}
start = time.monotonic()
try:
    for it in range(12):
        x = data(rank, 20000 + 37 * it, it)
        handle = dqcoll.allreduce(x, scheme="auto", async_op=True)
        # the caller's own all-reduces on the same group before wait(), sizes unlike dqcoll's
        ys = [torch.full((2 + (it + k) % 3,), float(rank + 1)) for k in range(3)]
        for y in ys:
            dist.all_reduce(y)
        handle.wait()
        exact = sum(data(r, 20000 + 37 * it, it).double() for r in range(n))
        report.setdefault("max_rel_err", 0.0)
        err = float((x.double() - exact).abs().max() / exact.abs().max())
        report["max_rel_err"] = max(report["max_rel_err"], err)
        if not all(bool((y == n * (n + 1) / 2).all()) for y in ys):
            report["wrong_user_allreduce"] = it
        report["scheme"] = comm.last_info.get("scheme")
        report["iterations"] = it + 1
except DqcollError as exc:
    report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
report["s"] = time.monotonic() - start
finish(report)
"""


def test_async_auto_beside_a_user_allreduce_completes():
    """3 gloo ranks, ``DQCOLL_AUTO_FORCE=none``: 12 times an ``async_op`` ``scheme="auto"``
    all-reduce (the native path: the group's own all-reduce, on dqcoll's worker thread), then
    three plain ``dist.all_reduce`` of other sizes on the same group before ``wait()``. Every
    rank completes all 12 iterations; dqcoll's sums match the fp64 sums to fp32 rounding and the
    caller's all-reduces are exact (they used to interleave with dqcoll's on one group in
    rank-dependent orders, and gloo aborted a rank with SIGABRT)."""
    reports = run_gloo_script(_AUTO_BESIDE_ALLREDUCE, 3, timeout_s=60,
                              env={"DQCOLL_AUTO_FORCE": "none", "DQCOLL_TIMEOUT_S": "20"})
    _assert_native_beside_allreduce(reports)


# -- the same over an NCCL group: CUDA messages on a private group of dqcoll's own ------------

# The device side stubbed: every tensor counts as CUDA for the transport (``_is_cuda``), and the
# group's CUDA backend maps to a private connection whose backend is gloo (``_cuda_backend``;
# NCCL's needs a GPU). What is tested is where the transport posts CUDA messages and the native
# all-reduce: on its own group, never on the caller's.
_CUDA_ROUTED_BESIDE_ALLREDUCE = r"""
import dqcoll.transports.torch_dist as td
td._is_cuda = lambda tensor: True
td._cuda_backend = lambda backend: "gloo"
""" + _AUTO_BESIDE_ALLREDUCE


def test_cuda_messages_beside_a_user_allreduce_take_a_private_group():
    """3 ranks; the transport treats every tensor as CUDA (the device side stubbed) and its
    group's CUDA backend has a private counterpart: 12 times an ``async_op`` ``scheme="auto"``
    all-reduce forced to the native path (``DQCOLL_AUTO_FORCE=none``) beside three plain
    ``dist.all_reduce`` on the caller's group before ``wait()``. Every rank completes with the
    right sums: the CUDA path's native all-reduce and messages run on the transport's private
    group (on an NCCL group they went to the caller's group, where a caller's collective from
    another thread pairs with them in rank-dependent orders)."""
    reports = run_gloo_script(_CUDA_ROUTED_BESIDE_ALLREDUCE, 3, timeout_s=60,
                              env={"DQCOLL_AUTO_FORCE": "none", "DQCOLL_TIMEOUT_S": "20"})
    _assert_native_beside_allreduce(reports)


# -- the DDP hook with scheme="auto" and find_unused_parameters=True -------------------------------

_DDP_AUTO_UNUSED = _HEADER + r"""
from torch.nn.parallel import DistributedDataParallel as DDP
from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(64, 384), torch.nn.GELU(),
                                          *[torch.nn.Linear(384, 384) for _ in range(6)])
        self.head = torch.nn.Linear(384, 8)
        self.spare = torch.nn.Linear(384, 8)  # used on odd steps only

    def forward(self, x, step):
        h = self.trunk(x)
        return self.head(h) + (self.spare(h) if step % 2 else 0.0)

import threading
off_main = []  # dist.all_reduce calls from threads other than the training loop's
real_all_reduce = dist.all_reduce
def all_reduce(*args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
        off_main.append(threading.current_thread().name)
    return real_all_reduce(*args, **kwargs)
dist.all_reduce = all_reduce
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(Net(), find_unused_parameters=True, bucket_cap_mb=0.5)
state = DynamiqState(dist.group.WORLD, scheme="auto", warmup_steps=1)
model.register_comm_hook(state, dynamiq_hook)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
report = {"rank": rank, "steps": 0}
start = time.monotonic()
try:
    for step in range(8):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank * 100 + step))
        optimizer.zero_grad()
        model(x, step).square().mean().backward()
        optimizer.step()
        report["steps"] = step + 1
except Exception as exc:
    report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
report["s"] = time.monotonic() - start
report["scheme"] = state.last_info.get("scheme")
report["off_main_all_reduces"] = sorted(set(off_main))
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
report["params"] = [float(flat.sum()), float(flat.square().sum())]
finish(report)
"""


def test_ddp_auto_with_unused_parameters_trains_identical_replicas():
    """3 gloo ranks train a DDP model with ``find_unused_parameters=True`` (one layer used on odd
    steps only, so DDP's reducer all-reduces its unused-parameter map on the group every step,
    from the autograd thread) and ``DynamiqState(scheme="auto")`` with
    ``DQCOLL_AUTO_FORCE=none`` (the hook's worker runs the native all-reduce) for 8 steps in
    buckets of ~0.5 MB. Every rank completes all 8 steps, the replicas' parameters are
    identical, and no ``dist.all_reduce`` runs on any thread but the training loop's (the
    worker's native all-reduces used to run on DDP's group and interleave with the reducer's in
    rank-dependent orders: gloo aborted a rank within a few steps)."""
    reports = run_gloo_script(_DDP_AUTO_UNUSED, 3, timeout_s=60,
                              env={"DQCOLL_AUTO_FORCE": "none", "DQCOLL_TIMEOUT_S": "20"})
    _assert_clean(reports, 3)
    for rank, rep in reports.items():
        assert rep["steps"] == 8, (rank, rep)
        assert rep["scheme"] == "none", (rank, rep)
        assert rep["off_main_all_reduces"] == [], (rank, rep)
    assert reports[1]["params"] == reports[0]["params"] == reports[2]["params"], reports


# -- dqcoll's messages beside the caller's send / recv --------------------------------------------

_BESIDE_SEND_RECV = _HEADER + r"""
comm = dqcoll.init(backend=sys.argv[1])
rank, n = comm.rank, comm.world_size
report = {"rank": rank, "iterations": 0}
start = time.monotonic()
results = []
try:
    for it in range(10):
        x = data(rank, 30000 + 101 * it, it)
        handle = dqcoll.allreduce(x, async_op=True)  # dynamiq: point-to-point messages
        # the caller's own ring of messages on the same group (tag 0), sizes unlike dqcoll's
        out = torch.full((33 + it,), float(100 * it + rank))
        got = torch.empty(33 + it)
        if rank % 2 == 0:
            dist.send(out, (rank + 1) % n)
            dist.recv(got, (rank - 1) % n)
        else:
            dist.recv(got, (rank - 1) % n)
            dist.send(out, (rank + 1) % n)
        handle.wait()
        if not bool((got == float(100 * it + (rank - 1) % n)).all()):
            report["wrong_user_message"] = it
        exact = sum(data(r, 30000 + 101 * it, it).double() for r in range(n))
        report.setdefault("max_vnmse", 0.0)
        vnmse = float((x.double() - exact).square().sum() / exact.square().sum())
        report["max_vnmse"] = max(report["max_vnmse"], vnmse)
        results.append(x.double().sum().item())
        report["iterations"] = it + 1
except DqcollError as exc:
    report["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
report["s"] = time.monotonic() - start
report["sums"] = results
finish(report)
"""


def _check_send_recv(reports: dict[int, dict]) -> None:
    _assert_clean(reports, 4)
    for rank, rep in reports.items():
        assert rep["iterations"] == 10, (rank, rep)
        assert "wrong_user_message" not in rep, (rank, rep)
        assert rep["max_vnmse"] < 0.05, (rank, rep)
    # dqcoll's invariant: every rank holds the same bits
    assert all(rep["sums"] == reports[0]["sums"] for rep in reports.values()), reports


def test_async_dqcoll_beside_user_send_recv_on_the_default_group():
    """4 gloo ranks (``dqcoll.init(backend="gloo")``): 10 times an ``async_op`` dynamiq
    all-reduce while the caller sends and receives its own messages around a ring on the same
    default group, before ``wait()``. Every rank completes: each user message arrives intact at
    its receiver, and dqcoll's results are the same on every rank and close to the exact sum
    (dqcoll's messages used tag 0 on the caller's group, so a user message could land in
    dqcoll's receive: gloo aborted the process, 16384 vs 264 bytes)."""
    _check_send_recv(run_gloo_script(_BESIDE_SEND_RECV, 4, timeout_s=60, argv=["gloo"],
                                     env={"DQCOLL_TIMEOUT_S": "20"}))


def test_async_dqcoll_beside_user_send_recv_over_backend_torch():
    """As the default-group test, over ``dqcoll.init(backend="torch")`` on a group the caller
    initialised itself: dqcoll's messages still never match the caller's."""
    script = _BESIDE_SEND_RECV.replace(
        "comm = dqcoll.init(backend=sys.argv[1])",
        "dist.init_process_group('gloo')\ncomm = dqcoll.init(backend=sys.argv[1])")
    _check_send_recv(run_gloo_script(script, 4, timeout_s=60, argv=["torch"],
                                     env={"DQCOLL_TIMEOUT_S": "20"}))


# -- the private connection itself ---------------------------------------------------------------


def test_private_prefixes_count_per_group_name():
    """Each group name has its own count of private connections, so the k-th connection opened
    over a group has the same prefix on every rank that opens its connections over that group
    in the same order, whatever it opened over other groups meanwhile."""
    from dqcoll.transports.torch_dist import private_prefix

    first = private_prefix("test-group-a")
    assert first.startswith("dqcoll-private/test-group-a/"), first
    other = private_prefix("test-group-b")
    second = private_prefix("test-group-a")
    k = int(first.rstrip("/").rsplit("/", 1)[1])
    assert second == f"dqcoll-private/test-group-a/{k + 1}/", (first, second)
    assert other.startswith("dqcoll-private/test-group-b/"), other


def test_private_connection_a_rank_never_opens_times_out_naming_it():
    """Opening a private connection that the other rank never opens raises
    CollectiveTimeoutError within its timeout (0.5 s + slack), naming this rank, the group's
    size and the prefix, instead of blocking in gloo's rendezvous."""
    from dqcoll.transports.torch_dist import open_private_group

    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError) as info:
        open_private_group(dist.HashStore(), "never/", 0, 2, 0.5)
    assert time.monotonic() - start < 3.0
    text = str(info.value)
    assert text.startswith("rank 0 of 2:") and "'never/'" in text, text
