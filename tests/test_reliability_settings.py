"""Settings that differ between ranks, and the lane's block codecs at the ends of the range.

* ``DQCOLL_VALIDATE=0`` on one rank only: creating a communicator agrees on the settings that
  change the messages (:mod:`dqcoll.agreement`) and refuses the difference on every rank, instead
  of gloo aborting the others (SIGABRT: a message longer than its receive buffer).
* The lane's one-exchange block codecs (``int8_block``, ``int4_block``, ``bf16``) apply the API
  path's range scaling: fp32 2e38 on 3 ranks and fp16 30000 come back finite; a bf16 output for
  an fp32 input is refused.
* Per-rank policies (``warmup_steps``, ``min_nbytes``) and a ``DQCOLL_AUTO_FORCE`` that differ
  raise dqcoll's errors at once, not raw errors after the timeout.

Multi-process tests run gloo ranks on 127.0.0.1 (:func:`conftest.run_gloo_script`); each
worker prints one ``REPORT {json}`` line and leaves with ``os._exit``. The per-rank setting is
set in the worker, before dqcoll reads it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_gloo_script

from dqcoll.errors import MismatchError
from dqcoll.testing import run_local

# -- DQCOLL_VALIDATE=0 on one rank ------------------------------------------------------------

_ENV_ON_ONE_RANK = r"""
import json, os, sys, time
name, value = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
if rank == 1:
    os.environ[name] = value
import torch
import dqcoll
from dqcoll.errors import DqcollError
report = {"rank": rank}
start = time.monotonic()
try:
    comm = dqcoll.init(backend="gloo", timeout_s=30)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(rank))
    dqcoll.allreduce(x, scheme=sys.argv[3])
    report["error"] = None
except DqcollError as exc:
    report["error"], report["message"] = type(exc).__name__, str(exc)
report["seconds"] = time.monotonic() - start
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize(("name", "value", "scheme", "shown"), [
    ("DQCOLL_VALIDATE", "0", "dynamiq", ("'0'", "'1'")),
    ("DQCOLL_AUTO_FORCE", "bf16", "auto", ("'bf16'", "''")),
])
def test_a_setting_on_one_rank_raises_on_every_rank(name: str, value: str, scheme: str,
                                                    shown: tuple[str, str]) -> None:
    """A setting that changes the messages (``DQCOLL_VALIDATE=0``, ``DQCOLL_AUTO_FORCE=bf16``)
    on one rank of 3: every rank raises MismatchError from ``dqcoll.init()`` naming the setting
    and each rank's value, within a few seconds of starting (no gloo abort, no timeout)."""
    reports = run_gloo_script(_ENV_ON_ONE_RANK, 3, timeout_s=60, argv=(name, value, scheme))
    for report in reports.values():
        assert report["exit"] == 0, report
        assert report["error"] == "MismatchError", report
        message = report["message"]
        assert name in message and "rank 1: " + shown[0] in message, message
        assert "ranks 0, 2: " + shown[1] in message, message
        assert report["seconds"] < 10, report


def test_in_process_ranks_skip_the_agreement() -> None:
    """The ``local`` transport's ranks (threads of one process, one environment) skip the
    agreement and say why; the communicator keeps the DQCOLL_VALIDATE it read."""
    from dqcoll import agreement

    skipped = run_local(2, lambda comm: (comm.agreement_skipped, comm.validate))
    assert skipped == [(agreement.SKIPPED["local"], True)] * 2


def test_store_agreement_names_every_rank_value() -> None:
    """Through a store: equal settings pass; a differing one raises MismatchError on the
    ranks naming the setting with each rank's value."""
    from dqcoll import agreement

    store = torch.distributed.HashStore()
    for rank in range(2):  # ranks 0 and 1 wrote theirs; rank 2 agrees
        store.set(f"same/{rank}", "policy=a\nx=1")
    agreement.agree_through_store(store, "same/", 2, 3, {"policy": "a", "x": "1"}, timeout_s=5,
                                  what="test")
    for rank in range(2):
        store.set(f"differ/{rank}", f"policy=a\nx={rank}")
    with pytest.raises(MismatchError, match=r"x \(rank 0: '0'; rank 1: '1'; rank 2: '2'\)"):
        agreement.agree_through_store(store, "differ/", 2, 3, {"policy": "a", "x": "2"},
                                      timeout_s=5, what="test")


# -- the lane's block codecs at the ends of the range -----------------------------------------

_BLOCK_RANGE = r"""
import json, os, sys
import torch
import torch.distributed as dist
import dqcoll.integrations.torch_backend  # registers "dqcoll"
from dqcoll import api
from dqcoll.errors import DqcollError
from dqcoll.integrations.lane import _plain_block_codec
from dqcoll.integrations.policy import RoleRule
dist.init_process_group("dqcoll")
rank, n = dist.get_rank(), dist.get_world_size()
pg = dist.group.WORLD
report = {"rank": rank, "rs": {}, "ag": {}, "same": {}}
numel = 3 * 16384  # fp16: 96 KiB, above min_nbytes (64 KiB)
for dtype, value in ((torch.float32, 2e38), (torch.float16, 30000.0),
                     (torch.bfloat16, 2e38), (torch.float32, 1e-30)):
    inp = torch.full((numel,), value, dtype=dtype)
    inp[::7] = -value / 3
    out = torch.empty(numel // n, dtype=dtype)
    dist.reduce_scatter_tensor(out, inp)
    top = torch.finfo(dtype).max
    report["rs"][f"{dtype} {value}"] = [bool(torch.isfinite(out).all()),
                                        float(out.float().abs().max()), top]
    gathered = torch.empty(n * numel, dtype=dtype)
    dist.all_gather_into_tensor(gathered, inp)
    report["ag"][f"{dtype} {value}"] = [bool(torch.isfinite(gathered).all()),
                                        float(gathered.float().abs().max())]
# bit for bit the API path's result (dqcoll.reduce_scatter / all_gather, same scheme)
for scheme in ("int8_block", "int4_block", "bf16"):
    codec = _plain_block_codec(RoleRule(scheme))
    for dtype, value in ((torch.float32, 2e38), (torch.float16, 30000.0),
                         (torch.float32, 3.4e38)):
        g = torch.Generator().manual_seed(rank)
        inp = (torch.rand(3 * 1000, generator=g) * value).to(dtype)
        for avg in (False, True):
            fast = torch.empty(1000, dtype=dtype)
            pg.lane._scatter_blocks(inp.clone(), fast, codec, avg)
            slow = torch.empty_like(fast)
            api.reduce_scatter(inp.clone(), slow, comm=pg.lane.comm, algorithm="direct",
                               op="avg" if avg else "sum", scheme=scheme)
            report["same"][f"rs {scheme} {dtype} {value} {avg}"] = [
                bool(torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))),
                bool(torch.isfinite(fast).all())]
        fast = torch.empty(n * inp.numel(), dtype=dtype)
        pg.lane._gather_blocks(inp, fast, codec)
        slow = torch.empty_like(fast)
        api.all_gather(inp, slow, comm=pg.lane.comm, scheme=scheme)
        report["same"][f"ag {scheme} {dtype} {value}"] = [
            bool(torch.equal(fast.view(torch.uint8), slow.view(torch.uint8))),
            bool(torch.isfinite(fast).all())]
# an output dtype other than the input's: refused on every rank, as dynamiq refuses it
try:
    dist.reduce_scatter_tensor(torch.empty(numel // n, dtype=torch.bfloat16),
                               torch.ones(numel))
    report["mixed"] = None
except DqcollError as exc:
    report["mixed"] = [type(exc).__name__, str(exc)]
ok = torch.ones(numel)
out = torch.empty(numel // n)
dist.reduce_scatter_tensor(out, ok)  # the lane still works
report["after"] = float(out.max())
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("gradients", ["int4_block", "dynamiq"])
def test_block_codecs_saturate_and_refuse_a_dtype_mix(gradients: str) -> None:
    """Through the ``dqcoll`` backend on 3 ranks with ``weights=int8_block`` and the gradients'
    scheme: reduce-scatter and all-gather of finite inputs at the ends of the range (fp32 2e38,
    fp16 30000, bf16 2e38, fp32 1e-30) give finite results, saturated at the dtype's largest
    value where the sum leaves the range; the lane's block collectives give the bytes of the API
    path (``dqcoll.reduce_scatter(algorithm="direct")``, ``dqcoll.all_gather``) for those
    inputs; a bf16 output for an fp32 input raises InvalidArgumentError on every rank, as
    under ``dynamiq``, and the lane stays usable."""
    policy = f"weights=int8_block,gradients={gradients}"
    reports = run_gloo_script(_BLOCK_RANGE, 3, timeout_s=120,
                              env={"DQCOLL_POLICY": policy, "DQCOLL_TIMEOUT_S": "30"})
    for report in reports.values():
        assert report["exit"] == 0, report
        for case, (finite, largest, top) in report["rs"].items():
            assert finite, (case, largest)
            if "2e+38" in case or "30000" in case:
                assert largest == top, (case, largest)  # 3 x 2e38 > fp32's max: saturated
        assert all(finite for finite, _ in report["ag"].values()), report["ag"]
        assert all(same and finite for same, finite in report["same"].values()), report["same"]
        name, message = report["mixed"]
        assert name == "InvalidArgumentError" and "dtype" in message, report["mixed"]
        assert report["after"] == 3.0


# -- per-rank policies -------------------------------------------------------------------------

_FSDP_POLICY_ON_ONE_RANK = r"""
import json, os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    os.environ["DQCOLL_POLICY"] = sys.argv[1]
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from dqcoll.errors import DqcollError
from dqcoll.integrations import fsdp as dqfsdp
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
state = dqfsdp.compress(model)
report = {"rank": rank}
start = time.monotonic()
try:
    for step in range(3):
        model(torch.randn(8, 64)).square().mean().backward()
    report["error"] = None
except DqcollError as exc:
    report["error"], report["message"] = type(exc).__name__, str(exc)
report["seconds"] = time.monotonic() - start
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


def test_fsdp_policy_on_one_rank_raises_on_every_rank() -> None:
    """FSDP2 with ``DQCOLL_POLICY``'s ``warmup_steps`` (and ``min_nbytes``) different on one rank
    of 3: every rank raises MismatchError at the first collective, within a second, naming the
    policy and each rank's value (ranks that decided differently between FSDP2's exact
    collective and the lane used to wait for each other until the timeout)."""
    reports = run_gloo_script(_FSDP_POLICY_ON_ONE_RANK, 3, timeout_s=90,
                              argv=("warmup_steps=2,min_nbytes=1024",),
                              env={"DQCOLL_POLICY": "min_nbytes=1024", "DQCOLL_TIMEOUT_S": "20"})
    for report in reports.values():
        assert report["exit"] == 0, report
        assert report["error"] == "MismatchError", report
        message = report["message"]
        assert "policy warmup_steps (ranks 0, 2: '0'; rank 1: '2')" in message, message
        assert "min_nbytes (" not in message, message  # the same on every rank
        assert report["seconds"] < 2, report


_BACKEND_POLICY_ON_ONE_RANK = r"""
import json, os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    os.environ["DQCOLL_POLICY"] = sys.argv[1]
import torch
import torch.distributed as dist
import dqcoll.integrations.torch_backend  # registers "dqcoll"
from dqcoll.errors import DqcollError
report = {"rank": rank}
start = time.monotonic()
try:
    dist.init_process_group("dqcoll")
    x = torch.ones(50000)  # 200 KB: between the ranks' min_nbytes
    dist.all_reduce(x)
    report["error"] = None
except DqcollError as exc:
    report["error"], report["message"] = type(exc).__name__, str(exc)
report["seconds"] = time.monotonic() - start
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


def test_backend_policy_on_one_rank_raises_on_every_rank() -> None:
    """The ``dqcoll`` backend with ``min_nbytes`` different on one rank of 3 (a 200 KB
    all-reduce above one rank's threshold and below the others'): every rank raises
    MismatchError from ``init_process_group`` naming the policy and each rank's value, within
    a few seconds, instead of waiting on two different connections until the timeout."""
    reports = run_gloo_script(_BACKEND_POLICY_ON_ONE_RANK, 3, timeout_s=90,
                              argv=("min_nbytes=1000000",), env={"DQCOLL_TIMEOUT_S": "20"})
    for report in reports.values():
        assert report["exit"] == 0, report
        assert report["error"] == "MismatchError", report
        message = report["message"]
        assert "policy min_nbytes (ranks 0, 2: '65536'; rank 1: '1000000')" in message, message
        assert report["seconds"] < 10, report


_BACKEND_SIZES_ACROSS_MIN_NBYTES = r"""
import json, os, sys, time
import torch
import torch.distributed as dist
import dqcoll.integrations.torch_backend  # registers "dqcoll"
from dqcoll.errors import DqcollError
rank = int(os.environ["RANK"])
collective = sys.argv[1]
report = {"rank": rank}
dist.init_process_group("dqcoll")
group = dist.group.WORLD
n = dist.get_world_size()
# one matching small call and one matching large call first: they run (exact, compressed)
small, large = 1000, 50000  # 4 KB and 200 KB of fp32: either side of min_nbytes (64 KiB)
def call(numel):
    if collective == "all_reduce":
        x = torch.ones(numel)
        dist.all_reduce(x)
        return float(x[0])
    if collective == "reduce_scatter":
        out = torch.empty(numel)
        dist.reduce_scatter_tensor(out, torch.ones(n * numel))
        return float(out[0])
    out = torch.empty(n * numel)
    dist.all_gather_into_tensor(out, torch.ones(numel))
    return float(out[0])
report["small"], report["large"] = call(small), call(large)
start = time.monotonic()
try:
    call(small if rank == 1 else large)  # rank 1's tensor is below min_nbytes, the others' above
    report["error"] = None
except (DqcollError, RuntimeError) as exc:
    report["error"], report["message"] = type(exc).__name__, str(exc)
report["seconds"] = time.monotonic() - start
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_gather"])
def test_backend_sizes_on_both_sides_of_min_nbytes_raise_on_every_rank(collective: str) -> None:
    """The ``dqcoll`` backend, 3 ranks, a call whose tensor is below ``min_nbytes`` on one rank
    and above it on the others (one rank's call exact on the wrapped group, the others'
    compressed on the lane): every rank raises MismatchError naming the path and the sizes
    within a second, instead of each side waiting on its own connection until the timeout;
    matching calls on either side of the threshold run before it."""
    reports = run_gloo_script(_BACKEND_SIZES_ACROSS_MIN_NBYTES, 3, timeout_s=90,
                              argv=(collective,), env={"DQCOLL_TIMEOUT_S": "20"})
    for rank, report in reports.items():
        assert report["exit"] == 0, report
        expected = 3.0 if collective != "all_gather" else 1.0
        assert report["small"] == expected and abs(report["large"] - expected) < 0.05, report
        assert report["error"] == "MismatchError", report
        message = report["message"]
        assert f"rank {rank}:" in message and "path check" in message, message
        assert "path (1: compressed on the lane, 0: exact below min_nbytes)" in message, message
        assert report["seconds"] < 1.0, report
