"""The torch transport's batches: what NCCL's ``batch_isend_irecv`` returns, and how a mixed group
(``"cpu:gloo,cuda:nccl"``) is fed.

* A backend that coalesces (NCCL) makes torch's ``batch_isend_irecv`` return **one** Work for
  the whole batch (``_coalescing_manager(async_ops=True)``), not one per message. No backend of
  a CPU build of torch coalesces, and a custom ``Backend`` cannot be written in Python, so the
  group here is a real ``ProcessGroup`` registered under a backend name of its own whose CPU
  backend is gloo's, and the ``ProcessGroup`` methods torch's coalescing path calls
  (``_get_backend(...).supports_coalescing``, ``_start_coalescing``, ``_end_coalescing``, and
  the ``send`` / ``recv`` issued inside the batch) are given NCCL's behaviour: the messages move
  over gloo, and torch's own ``batch_isend_irecv`` code returns one Work for them.
* On a mixed group, CUDA payloads must reach NCCL as one batch without CPU headers; CPU ones keep
  gloo's headers. No GPU here: the group is gloo, the backend string is a mixed group's, and the
  transport's device predicate says "CUDA" for the tensors the test marks so.
"""

from __future__ import annotations

import inspect

import torch
from conftest import run_gloo_script

from dqcoll.transports import torch_dist

# the one Work of a coalesced batch, as NCCL's batch_isend_irecv returns it: done when every
# message of the batch is (both workers' stand-ins of a coalescing group)
_BATCH_WORK = r"""
class BatchWork(dist.Work):
    def __init__(self, works):
        super().__init__()
        self.works = works
    def wait(self, timeout=None):
        for work in self.works:
            work.wait() if timeout is None else work.wait(timeout)
        return True
"""

_COALESCING_WORKER = r"""
import json, os, torch, torch.distributed as dist
import dqcoll
from dqcoll.errors import DqcollError
from dqcoll.testing import run_local

# a backend of its own name whose CPU backend is gloo's: torch builds a plain ProcessGroup for it
dist.Backend.register_backend(
    "coalescing_gloo", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size,
                                                                              timeout),
    devices=["cpu"])
dist.init_process_group("coalescing_gloo")
assert type(dist.group.WORLD) is dist.ProcessGroup

PG = dist.ProcessGroup
real_get_backend, real_send, real_recv = PG._get_backend, PG.send, PG.recv
open_batches = {}  # id(group) -> the Works of the batch being coalesced

class Coalescing:
    # the group's CPU backend as batch_isend_irecv sees it: coalescing, like NCCL's
    supports_coalescing = True
    def __init__(self, backend):
        self._backend = backend
    def __getattr__(self, name):
        return getattr(self._backend, name)

""" + _BATCH_WORK + r"""
def start_coalescing(self, device):
    open_batches[id(self)] = []

def end_coalescing(self, device):
    return BatchWork(open_batches.pop(id(self)))

def in_batch(real):
    def post(self, tensors, peer, tag=0):
        work = real(self, tensors, peer, tag)
        if id(self) in open_batches:
            open_batches[id(self)].append(work)
        return work
    return post

PG._get_backend = lambda self, device: Coalescing(real_get_backend(self, device))
PG._start_coalescing = start_coalescing
PG._end_coalescing = end_coalescing
PG.send, PG.recv = in_batch(real_send), in_batch(real_recv)

returned = []  # how many Works each batch_isend_irecv returned, per messages posted
real_batch = dist.batch_isend_irecv
def batch(ops):
    works = real_batch(ops)
    returned.append([len(ops), len(works)])
    return works
dist.batch_isend_irecv = batch

comm = dqcoll.init(backend="torch")
t = comm.transport
rank, n = comm.rank, comm.world_size
peers = [p for p in range(n) if p != rank]
store = dist.distributed_c10d._get_default_store()
report = {"backend": t.backend}

def outcome(key, fn):
    try:
        fn()
        report[key] = "ok"
    except (DqcollError, ValueError) as exc:
        report[key] = type(exc).__name__ + ": " + str(exc)

def payload(src, dst, numel):
    return torch.arange(numel, dtype=torch.float32) * (src + 1) + dst

# 1. an exchange with every peer, a small payload (copied behind its header) and a large one
# (after its own header): one Work back for the batch, and the data arrive
sizes = (100, 100_000)
into = {(p, k): torch.full((k,), float("nan")) for p in peers for k in sizes}
returned.clear()
outcome("exchange", lambda: t.exchange([(p, payload(rank, p, k)) for p in peers for k in sizes],
                                       [(p, into[p, k]) for p in peers for k in sizes],
                                       what="all to all"))
report["exchange_returned"] = returned[:]
report["exchange_values"] = all(torch.equal(into[p, k], payload(p, rank, k))
                                for p in peers for k in sizes)

# 2. a DynamiQ all-reduce through dqcoll.init(backend="torch"): the local transport's bits
def data(r):
    return torch.randn(200_000, generator=torch.Generator().manual_seed(40 + r))
x = data(rank)
outcome("allreduce", lambda: dqcoll.allreduce(x, scheme="dynamiq", bits=5, algorithm="ring",
                                              seed=3, step=4))
local = run_local(n, lambda c: dqcoll.allreduce(data(c.rank), scheme="dynamiq", bits=5,
                                                algorithm="ring", seed=3, step=4))
report["same_as_local"] = bool(torch.equal(x, local[rank]))
report["allreduce_returned"] = sorted({tuple(r) for r in returned})

# 3. a batch that times out names the rank, every peer of the batch and the step
if rank == 0:
    t.timeout_s = 1.0
    outcome("lonely", lambda: t.exchange([(p, torch.ones(10)) for p in peers],
                                         [(p, torch.empty(10)) for p in peers],
                                         what="lonely step"))
    store.set("lonely done", "1")
    # rank 0 hosts the store: it leaves only after every other rank has read the key
    store.wait([f"lonely seen {p}" for p in peers])
else:
    store.wait(["lonely done"])
    store.set(f"lonely seen {rank}", "1")
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)  # rank 0's timed-out receives closed its connections: no teardown
"""


def test_one_work_for_the_batch_as_nccl_returns_it() -> None:
    """Over a group whose ``batch_isend_irecv`` returns one Work for the whole batch (as NCCL's
    coalescing does), the torch transport waits on that Work: an exchange of several messages
    with every peer delivers the right data, ``dqcoll.init(backend="torch")`` runs a DynamiQ
    all-reduce to the local transport's bits, and a batch that times out raises
    CollectiveTimeoutError naming the rank, every peer of the batch and the step."""
    reports = run_gloo_script(_COALESCING_WORKER, 3, timeout_s=240,
                              env={"DQCOLL_TIMEOUT_S": "30"})
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        assert rep["backend"] == "coalescing_gloo", rep
        assert rep["exchange"] == "ok", rep["exchange"]
        # 2 peers x (small frame + header and large payload): 6 sends, 6 receives, one Work
        assert rep["exchange_returned"] == [[12, 1]], rep
        assert rep["exchange_values"], rank
        assert rep["allreduce"] == "ok", rep["allreduce"]
        assert rep["same_as_local"], rank
        assert all(works == 1 for _, works in rep["allreduce_returned"]), rep
    lonely = reports[0]["lonely"]
    assert lonely.startswith("CollectiveTimeoutError: rank 0: timed out after 1 s"), lonely
    assert "to ranks 1, 2; from ranks 1, 2" in lonely and "at lonely step" in lonely, lonely


_MIXED_WORKER = r"""
import json, os, torch, torch.distributed as dist
from dqcoll.errors import DqcollError
from dqcoll.transports import torch_dist
from dqcoll.types import FRAME_HEADROOM as H

dist.init_process_group("gloo")
# what dist.get_backend says of a group made with init_process_group("cpu:gloo,cuda:nccl")
real_get_backend = dist.get_backend
def get_backend(group=None):
    return "cpu:gloo,cuda:nccl"
dist.get_backend = get_backend

# the transport's private NCCL group, its device side stubbed: a coalescing group whose
# messages gloo moves; each batch it coalesces is recorded as [is a send, bytes, device]
cuda_private = []
""" + _BATCH_WORK + r"""class Coalescing:
    supports_coalescing = True
class PrivateNccl:
    def __init__(self, group):
        self.group, self.batch, self.works = group, None, []
    def _get_backend(self, device):
        return Coalescing()
    def _start_coalescing(self, device):
        self.batch, self.works = [], []
    def _end_coalescing(self, device):
        cuda_private.append(self.batch)
        self.batch = None
        return BatchWork(self.works)
    def _post(self, is_send, tensors, peer, tag):
        self.batch.append([is_send, tensors[0].numel() * tensors[0].element_size(),
                           "cuda" if on_cuda(tensors[0]) else "cpu"])
        work = (self.group.send if is_send else self.group.recv)(tensors, peer, tag)
        self.works.append(work)
        return work
    def send(self, tensors, peer, tag):
        return self._post(True, tensors, peer, tag)
    def recv(self, tensors, peer, tag):
        return self._post(False, tensors, peer, tag)
    def allreduce(self, tensors):
        return self.group.allreduce(tensors)
    def shutdown(self):
        self.group.shutdown()
torch_dist._nccl_group = lambda store, rank, size, timeout: PrivateNccl(
    dist.ProcessGroupGloo(store, rank, size, timeout))
t = torch_dist.TorchTransport(timeout_s=30)
dist.get_backend = real_get_backend
rank = t.rank
peer = 1 - rank
report = {"devices": list(t.devices)}

# the device side, stubbed: tensors whose storage is marked live "on CUDA"
cuda_storages, kept = set(), []  # kept alive: a freed address may come back for a CPU tensor
def on_cuda(tensor):
    return tensor.untyped_storage().data_ptr() in cuda_storages
torch_dist._is_cuda = on_cuda
def cuda(tensor):
    cuda_storages.add(tensor.untyped_storage().data_ptr())
    kept.append(tensor)
    return tensor

batches = []  # per batch_isend_irecv: [is a send, bytes, "cuda" or "cpu"] per message
real_batch = dist.batch_isend_irecv
def batch(ops):
    batches.append([[op.op is dist.isend, op.tensor.numel() * op.tensor.element_size(),
                     "cuda" if on_cuda(op.tensor) else "cpu"] for op in ops])
    return real_batch(ops)
dist.batch_isend_irecv = batch

private = []  # per message posted on the transport's own gloo connection: as for batches
class Recording:
    def __init__(self, group):
        self.group = group
    def send(self, tensors, peer, tag):
        private.append([True, tensors[0].numel() * tensors[0].element_size(), "cpu"])
        return self.group.send(tensors, peer, tag)
    def recv(self, tensors, peer, tag):
        private.append([False, tensors[0].numel() * tensors[0].element_size(), "cpu"])
        return self.group.recv(tensors, peer, tag)
    def __getattr__(self, name):
        return getattr(self.group, name)
report["private_prefix"] = t.private_prefix
t.cpu_group = Recording(t.cpu_group)

def outcome(key, fn):
    try:
        fn()
        report[key] = "ok"
    except DqcollError as exc:
        report[key] = type(exc).__name__ + ": " + str(exc)

def payload(r, numel, dtype):
    return (torch.arange(numel) * (r + 3) % 251).to(dtype)

def exchange(key, mark, framed=False):
    small, large = payload(rank, 1000, torch.float64), payload(rank, 200_000, torch.float32)
    small_in, large_in = torch.empty(1000, dtype=torch.float64), torch.empty(200_000)
    if framed:  # uint8 frames with FRAME_HEADROOM bytes of room in front
        small, large = (torch.cat([torch.zeros(H, dtype=torch.uint8), x.view(torch.uint8)])
                        for x in (small, large))
        small_in, large_in = (torch.empty(H + x.numel() * x.element_size(), dtype=torch.uint8)
                              for x in (small_in, large_in))
    tensors = [mark(x) for x in (small, large, small_in, large_in)]
    batches.clear()
    private.clear()
    cuda_private.clear()
    post = t.exchange_framed if framed else t.exchange
    outcome(key, lambda: post([(peer, tensors[0]), (peer, tensors[1])],
                              [(peer, tensors[2]), (peer, tensors[3])], what=key))
    got_small, got_large = tensors[2], tensors[3]
    if framed:
        got_small = got_small[H:].view(torch.float64)
        got_large = got_large[H:].view(torch.float32)
    report[key + "_values"] = bool(torch.equal(got_small, payload(peer, 1000, torch.float64))
                                   and torch.equal(got_large, payload(peer, 200_000,
                                                                      torch.float32)))
    report[key + "_batches"] = batches[:]
    report[key + "_private"] = private[:]
    report[key + "_cuda_private"] = cuda_private[:]

exchange("cuda", cuda)
exchange("cuda_framed", cuda, framed=True)
exchange("cpu", lambda x: x)
# an exchange with a CUDA send and a CPU receive: refused before anything is posted
batches.clear()
outcome("mixed", lambda: t.exchange([(peer, cuda(torch.ones(10)))], [(peer, torch.empty(10))],
                                    what="mixed step"))
report["mixed_batches"] = batches[:]
print("REPORT " + json.dumps(report), flush=True)
dist.destroy_process_group()
"""


def test_mixed_group_posts_cuda_payloads_as_one_batch_without_headers() -> None:
    """On a ``"cpu:gloo,cuda:nccl"`` group, an exchange of CUDA tensors is posted as one
    coalesced batch of its payloads only (no CPU header message, no header bytes; framed
    buffers lose their room) on the transport's own NCCL group (its device side stubbed), so
    NCCL gets it as one group launch and nothing of it reaches the caller's group; an exchange
    of CPU tensors keeps gloo's headers and goes to the transport's own gloo connection
    (nothing of it on the caller's group); both deliver the data. An exchange mixing CUDA and
    CPU tensors raises InvalidArgumentError naming the rank and the step, before anything is
    posted."""
    reports = run_gloo_script(_MIXED_WORKER, 2, timeout_s=240, env={"DQCOLL_TIMEOUT_S": "30"})
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        assert rep["devices"] == ["cpu", "cuda"], rep
        for key in ("cuda", "cuda_framed"):
            assert rep[key] == "ok", rep[key]
            assert rep[key + "_values"], (rank, key)
            assert rep[key + "_cuda_private"] == [[[True, 8000, "cuda"],
                                                   [True, 800_000, "cuda"],
                                                   [False, 8000, "cuda"],
                                                   [False, 800_000, "cuda"]]], rep
            assert rep[key + "_batches"] == [], rep
            assert rep[key + "_private"] == [], rep
        assert rep["cpu"] == "ok" and rep["cpu_values"], rep
        assert rep["private_prefix"].startswith("dqcoll-private/"), rep
        h = torch_dist.HEADER_NBYTES
        assert rep["cpu_batches"] == [], rep
        assert rep["cpu_private"] == [[True, h + 8000, "cpu"], [True, h, "cpu"],
                                      [True, 800_000, "cpu"], [False, h + 8000, "cpu"],
                                      [False, h, "cpu"], [False, 800_000, "cpu"]], rep
        mixed = rep["mixed"]
        assert mixed.startswith(f"InvalidArgumentError: rank {rank}:"), mixed
        assert "mixed step" in mixed and "CUDA and CPU" in mixed, mixed
        assert rep["mixed_batches"] == [], rep


def test_device_predicate_takes_a_tensor() -> None:
    """The device predicate the mixed-group test stubs is the one the transport calls: it takes
    one tensor and says whether it lives in CUDA memory (a CPU tensor: no)."""
    assert list(inspect.signature(torch_dist._is_cuda).parameters) == ["tensor"]
    assert torch_dist._is_cuda(torch.zeros(2)) is False


def test_private_nccl_group_uses_calls_torch_has() -> None:
    """The calls the transport makes on its private NCCL group (and the mixed-group test's
    stand-in answers) are methods of torch's own ``ProcessGroup``, and the ``ProcessGroup``
    that :func:`~dqcoll.transports.torch_dist.open_private_group` builds for NCCL registers a
    backend the way ``ProcessGroup`` takes one."""
    import torch.distributed as dist

    for name in ("_get_backend", "_start_coalescing", "_end_coalescing", "send", "recv",
                 "allreduce", "shutdown", "_register_backend", "_set_default_backend"):
        assert callable(getattr(dist.ProcessGroup, name, None)), name
    assert hasattr(dist.ProcessGroup.BackendType, "NCCL")
    from torch._C._distributed_c10d import Backend

    assert "supports_coalescing" in dir(Backend)
    assert torch_dist._cuda_backend("nccl") == "nccl"
    assert torch_dist._cuda_backend("cpu:gloo,cuda:nccl") == "nccl"
    assert torch_dist._cuda_backend("cpu:gloo, cuda:nccl") == "nccl"
    assert torch_dist._cuda_backend("gloo") is None
    assert torch_dist._cuda_backend("cpu:gloo,cuda:gloo") is None


def test_private_nccl_group_without_a_gpu_names_the_rank_and_prefix() -> None:
    """Without a GPU (a CPU build of torch has no ``ProcessGroupNCCL``; a CUDA build refuses to
    make one), opening a private NCCL connection raises CommAbortedError naming the rank, the
    backend and the prefix, not a bare torch error."""
    import pytest
    import torch.distributed as dist

    from dqcoll.errors import CommAbortedError

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the connection could open")
    store = dist.HashStore()
    with pytest.raises(CommAbortedError, match=r"rank 0 of 2: opening dqcoll's nccl "
                                               r"connection under 'p/cuda/'"):
        torch_dist.open_private_group(store, "p/cuda/", 0, 2, 5.0, backend="nccl")
