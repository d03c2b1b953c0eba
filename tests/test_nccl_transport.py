"""The NCCL transports (nccl4py and CuPy's bindings) and the torchrun launch path.

CPU tier: the modules import without CuPy or nccl4py, every reason NCCL cannot run is named in an
UnsupportedError, the transports are registered, the id travels over a store, and the torchrun
example runs over gloo. The contract with the real packages is tests/test_nccl_contract.py.

GPU tiers (skipped cleanly without a GPU, CuPy or NCCL), over each binding: several NCCL ranks
share the one GPU -
each process gets its own ``NCCL_HOSTID``, so NCCL treats them as separate hosts and connects them
with sockets over loopback - and run every algorithm x scheme x collective, tiled and untiled, on
torch tensors, on CuPy arrays on a CuPy stream, and with ``async_op``; every rank must end
bit-identical and equal to the ``local`` transport's result on CUDA tensors. A stalled rank must
be reported by a timeout that names the step.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import collect_reports

import dqcoll
from dqcoll import transports
from dqcoll.cli.ports import rendezvous_port
from dqcoll.errors import UnsupportedError
from dqcoll.transports import cupy_nccl

ROOT = Path(__file__).resolve().parents[1]


# -- CPU tier ------------------------------------------------------------------------------------


def test_module_imports_without_cupy_and_names_the_reason() -> None:
    """With CuPy and nccl4py unimportable, the modules still import; nccl_unavailable_reason
    says CuPy is missing and how to install it, and init_transport, dqcoll.init(backend='nccl')
    (which then takes CuPy's bindings) and backend='nccl-cupy' raise UnsupportedError with that
    reason; backend='nccl4py' names nccl4py and its extra (checked in a fresh interpreter that
    blocks both)."""
    code = r"""
import sys
sys.modules["cupy"] = None  # import cupy -> ImportError, whether or not CuPy is installed
sys.modules["nccl"] = None  # the same for nccl4py
import dqcoll
from dqcoll.errors import UnsupportedError
from dqcoll.transports import cupy_nccl
reason = cupy_nccl.nccl_unavailable_reason()
assert reason is not None and "CuPy is not importable" in reason and "dqcoll[cuda12]" in reason
assert not cupy_nccl.supports_nccl()
try:
    dqcoll.init(backend="nccl4py", rank=0, world_size=1)
except UnsupportedError as exc:
    assert "nccl4py is not importable" in str(exc) and "nccl4py[cu12]" in str(exc), exc
else:
    raise AssertionError("no error")
for attempt in (lambda: cupy_nccl.init_transport(rank=0, world_size=1),
                lambda: dqcoll.init(backend="nccl", rank=0, world_size=1),
                lambda: dqcoll.init(backend="nccl-cupy", rank=0, world_size=1)):
    try:
        attempt()
    except UnsupportedError as exc:
        assert "cannot run here" in str(exc) and "CuPy is not importable" in str(exc), exc
    else:
        raise AssertionError("no error")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def _fake_cupy_modules(*, device_count: Any,
                       nccl_available: bool) -> tuple[Any, Any, Any]:
    """``cupy``, ``cupy.cuda`` and ``cupy.cuda.nccl`` with what nccl_unavailable_reason reads:
    ``runtime.getDeviceCount()`` (a count, or raising ``device_count``) and ``nccl.available``
    (checked against the real CuPy in test_fake_cupy_has_the_real_surface)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    runtime = types.SimpleNamespace()
    if isinstance(device_count, Exception):
        def getDeviceCount() -> int:
            raise device_count
    else:
        def getDeviceCount() -> int:
            return int(device_count)
    runtime.getDeviceCount = getDeviceCount
    cuda.runtime = runtime  # type: ignore[attr-defined]
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available  # type: ignore[attr-defined]
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    return cupy, cuda, nccl


def _fake_cupy(monkeypatch: pytest.MonkeyPatch, *, device_count: Any, nccl_available: bool) -> None:
    cupy, cuda, nccl = _fake_cupy_modules(device_count=device_count,
                                          nccl_available=nccl_available)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)


@pytest.mark.parametrize(
    ("device_count", "nccl_available", "expected"),
    [
        (RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"), True,
         "no CUDA GPU is usable (RuntimeError: cudaErrorNoDevice"),
        (0, True, "no CUDA GPU is visible"),
        (1, False, "CuPy cannot load NCCL"),
    ],
    ids=["driver-error", "no-device", "no-nccl"],
)
def test_each_missing_piece_is_named(monkeypatch: pytest.MonkeyPatch, device_count: Any,
                                     nccl_available: bool, expected: str) -> None:
    """CuPy importable but no usable GPU, no visible GPU, or no NCCL library: the reason names
    the missing piece, and init_transport raises UnsupportedError carrying it."""
    _fake_cupy(monkeypatch, device_count=device_count, nccl_available=nccl_available)
    reason = cupy_nccl.nccl_unavailable_reason()
    assert reason is not None and expected in reason, reason
    with pytest.raises(UnsupportedError, match="cannot run here"):
        cupy_nccl.init_transport(rank=0, world_size=1)


def test_fake_cupy_has_the_real_surface() -> None:
    """The fake CuPy above has the real one's surface: ``cupy.cuda.runtime.getDeviceCount()``
    (no parameter, an ``int``; without a driver the real one raises a RuntimeError subclass
    whose message starts with the CUDA error name, as the fake's does) and
    ``cupy.cuda.nccl.available`` (a bool)."""
    real_cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    real_nccl = pytest.importorskip("cupy.cuda.nccl", reason="CuPy has no NCCL bindings")
    _, cuda, nccl = _fake_cupy_modules(device_count=1, nccl_available=True)
    real_count = real_cupy.cuda.runtime.getDeviceCount
    assert real_count.__doc__.strip().splitlines()[0] == "getDeviceCount() -> int"
    assert inspect.signature(cuda.runtime.getDeviceCount).parameters == {}
    assert cuda.runtime.getDeviceCount.__annotations__["return"] == "int"
    assert type(nccl.available) is type(real_nccl.available) is bool
    try:
        count = real_count()
    except Exception as exc:  # no driver or no GPU here: the error the fake mimics
        assert isinstance(exc, RuntimeError), type(exc).__mro__
        assert str(exc).startswith("cudaError"), exc
    else:
        assert isinstance(count, int)


@pytest.mark.parametrize(("blocked", "reason", "needs", "expected"), [
    ("nccl", "nccl4py does not import", "cupy.cuda.nccl",
     ["test_cupy_14_unique_id_is_bytes_and_the_constructor_takes_bytes",
      "test_cupy_fakes_match_cupy",
      "test_both_bindings_give_the_local_transports_bits[nccl-cupy]"]),
    ("cupy", "CuPy's NCCL bindings do not import", "nccl.core",
     ["test_nccl4py_fakes_match_nccl4py",
      "test_nccl4py_exchange_resolves_buffers_through_the_real_communicator",
      "test_both_bindings_give_the_local_transports_bits[nccl4py]"]),
], ids=["without-nccl4py", "without-cupy"])
def test_contract_tier_skips_per_package(blocked: str, reason: str, needs: str,
                                         expected: list[str]) -> None:
    """tests/test_nccl_contract.py with one package unimportable (a fresh interpreter that blocks
    it) still runs the other package's tests, and skips only tests that need the blocked one,
    each saying so (or the CuPy 13 fake's check, which needs CuPy 13)."""
    pytest.importorskip(needs, reason=f"the other package's tests need {needs}")
    code = (f"import sys; sys.modules[{blocked!r}] = None; import pytest; "
            "sys.exit(pytest.main(sys.argv[1:]))")
    out = subprocess.run(
        [sys.executable, "-c", code, "-q", "-rA", "-p", "no:cacheprovider",
         "tests/test_nccl_contract.py"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, DQCOLL_TEST_NUMBA_WARMUP="0"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    passed = {ln.split("::", 1)[1].split()[0] for ln in lines if ln.startswith("PASSED")}
    assert set(expected) <= passed, (expected, sorted(passed))
    skipped = [ln for ln in lines if ln.startswith("SKIPPED")]
    assert skipped, out.stdout[-3000:]
    assert all(reason in ln or "fake is of CuPy 13" in ln for ln in skipped), skipped


def test_nccl_is_registered_for_cuda() -> None:
    """The transport registry lists ``nccl`` for CUDA tensors; building it where NCCL cannot run
    raises UnsupportedError instead of failing on an import."""
    assert "nccl" in transports.list_transports()
    spec = transports.get("nccl")
    assert spec.devices == ("cuda",)
    if cupy_nccl.supports_nccl():
        pytest.skip("NCCL can run here: the error path is not reachable")
    with pytest.raises(UnsupportedError):
        spec.factory(rank=0, world_size=1)



def test_torchrun_example_over_gloo() -> None:
    """``torchrun --nproc-per-node 4 examples/torchrun_allreduce.py --backend gloo`` (4 CPU
    processes, tiled: 16 KiB tiles) ends with every rank identical, vNMSE within budget, the
    async_op result equal to the synchronous one, and exit status 0 under --check."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(rendezvous_port()),
           str(ROOT / "examples" / "torchrun_allreduce.py"),
           "--backend", "gloo", "--numel", "64K", "--iters", "1", "--tile-nbytes", "16K",
           "--check"]
    env = dict(os.environ, OMP_NUM_THREADS="1", DQCOLL_TIMEOUT_S="120")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all checks passed" in out.stdout
    rows = [ln.split() for ln in out.stdout.splitlines() if ln.startswith(("none", "dynamiq"))]
    assert len(rows) == 3 and all(row[-1] == "yes" for row in rows), out.stdout


# -- GPU tiers: NCCL ranks sharing one GPU ---------------------------------------------------------

_NCCL_WORKER = r"""
import json, os, sys, time, torch, dqcoll
from dqcoll import schemes
from dqcoll.errors import DqcollError
from dqcoll.types import Collective
scenario, out_dir, backend = sys.argv[1], sys.argv[2], sys.argv[3]
comm = dqcoll.init(backend=backend)
assert comm.transport.name == backend, (comm.transport.name, backend)
rank, n = comm.rank, comm.world_size
assert comm.device.type == "cuda", comm.device

def data(r, numel):
    g = torch.Generator().manual_seed(900 + r)
    return torch.randn(numel, generator=g) * torch.exp(torch.randn(1, generator=g))

def collective(kind, x, **kw):
    if kind == "allreduce":
        dqcoll.allreduce(x, **kw)
        return x
    if kind == "reduce_scatter":
        out = torch.empty(x.numel() // n, device=x.device)
        dqcoll.reduce_scatter(x, out, **kw)
        return out
    out = torch.empty(n * x.numel(), device=x.device)
    dqcoll.all_gather(x, out, **kw)
    return out

if scenario == "matrix":
    results = {}
    numel = 6 * 4096
    for scheme in schemes.list_schemes():
        for algorithm in ("ring", "butterfly", "direct"):
            for kind in ("allreduce", "reduce_scatter", "all_gather"):
                if kind != "allreduce" and not schemes.spec(scheme).supports_reduce_scatter:
                    continue
                for tile in (0, 2048):
                    x = data(rank, numel).cuda()
                    y = collective(kind, x, scheme=scheme, algorithm=algorithm, seed=3, step=1,
                                   tile_nbytes=tile)
                    results[f"{scheme}/{algorithm}/{kind}/{tile}"] = y.cpu()
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        arr = cupy.asarray(data(rank, numel).numpy())
        dqcoll.allreduce(arr, scheme="dynamiq", algorithm="butterfly", seed=3, step=1,
                         tile_nbytes=2048)
        host = cupy.asnumpy(arr, stream=stream)
    stream.synchronize()
    results["cupy/dynamiq/butterfly/allreduce"] = torch.from_numpy(host)
    x = data(rank, numel).cuda()
    handle = dqcoll.allreduce(x, scheme="dynamiq", algorithm="butterfly", seed=3, step=1,
                              tile_nbytes=2048, async_op=True)
    handle.wait()
    results["async/dynamiq/butterfly/allreduce"] = x.cpu()
    comm.transport.synchronize()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    print("REPORT " + json.dumps({"rank": rank, "keys": len(results)}), flush=True)
    comm.close()

if scenario == "stall":
    original = comm.transport.exchange
    def exchange(sends, recvs, *, what):
        if rank == 1 and "allreduce#1 reduce step 0" in what:
            time.sleep(float(os.environ["DQCOLL_TIMEOUT_S"]) * 4)
        return original(sends, recvs, what=what)
    # connect the ranks first (the argument check's all-to-all): NCCL connects a pair inside
    # groupEnd at first contact, with no timeout of its own
    dqcoll.allreduce(data(rank, 4096).cuda(), algorithm="ring", scheme="none")
    comm.transport.synchronize()
    comm.transport.exchange = exchange
    start = time.monotonic()
    report = {"rank": rank}
    x = data(rank, 4096).cuda()
    before = x.clone()
    stage = "call"
    try:
        dqcoll.allreduce(x, algorithm="ring", tile_nbytes=0)
        stage = "synchronize"
        comm.transport.synchronize()
        report["error"] = None
    except DqcollError as exc:
        report["error"] = type(exc).__name__
        report["message"] = str(exc)
        report["raised_at"] = stage
    report["untouched"] = bool(torch.equal(x, before))
    report["elapsed_s"] = time.monotonic() - start
    print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
"""


def _nccl_env(rank: int, world_size: int, port: int, timeout_s: float) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), DQCOLL_TIMEOUT_S=str(timeout_s),
        # each rank a "host" of its own: NCCL then allows several ranks on one GPU and connects
        # them with sockets over loopback; NCCL 2.30 and later also want the multi-rank switch
        NCCL_HOSTID=f"dqcoll-test-host-{rank}", NCCL_MULTI_RANK_GPU_ENABLE="1",
        NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
        NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_DEBUG=env.get("NCCL_DEBUG", "WARN"),
    )
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def _run_nccl(scenario: str, world_size: int, out_dir: Path, timeout_s: float, backend: str,
              wait_for: int | None = None) -> dict[int, dict[str, Any]]:
    """Start ``world_size`` NCCL ranks on GPU 0; collect the reports of all (or of the first
    ``wait_for``) ranks and kill the rest."""
    port = rendezvous_port()
    procs = [
        subprocess.Popen([sys.executable, "-c", _NCCL_WORKER, scenario, str(out_dir), backend],
                         env=_nccl_env(r, world_size, port, timeout_s), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for r in range(world_size)
    ]
    return collect_reports(procs, timeout_s=540, wait_for=wait_for)


def _skip_without_nccl(backend: str) -> None:
    from dqcoll.transports import nccl4py

    reason = (nccl4py.nccl4py_unavailable_reason() if backend == "nccl4py"
              else cupy_nccl.nccl_unavailable_reason())
    if reason is not None:
        pytest.skip(f"{backend} cannot run here: {reason}")


BINDINGS = ["nccl4py", "nccl-cupy"]


@pytest.mark.multi_rank_gpu
@pytest.mark.parametrize("backend", BINDINGS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_nccl_ranks_on_one_gpu_match_local(world_size: int, backend: str,
                                           tmp_path: Path) -> None:
    """NCCL ranks sharing one GPU run every scheme x algorithm x collective, untiled and tiled,
    plus a CuPy array on a CuPy stream and an async_op call: every rank ends bit-identical to rank
    0 and to the local transport's result for the same inputs and seed on CUDA tensors."""
    _skip_without_nccl(backend)
    reports = _run_nccl("matrix", world_size, tmp_path, timeout_s=120, backend=backend)
    for rep in reports.values():
        assert rep["exit"] == 0, rep
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]

    from dqcoll.testing import run_local

    def local(comm: Any) -> dict[str, torch.Tensor]:
        n, rank = comm.world_size, comm.rank
        out: dict[str, torch.Tensor] = {}
        numel = 6 * 4096
        for key in results[0]:
            parts = key.split("/")  # scheme/algorithm/kind/tile or cupy|async/scheme/algorithm/kind
            scheme, algorithm, kind = parts[1:] if parts[0] in ("cupy", "async") else parts[:3]
            g = torch.Generator().manual_seed(900 + rank)
            x = (torch.randn(numel, generator=g) * torch.exp(torch.randn(1, generator=g))).cuda()
            kw = dict(scheme=scheme, algorithm=algorithm, seed=3, step=1, tile_nbytes=0)
            if kind == "allreduce":
                dqcoll.allreduce(x, **kw)
                y = x
            elif kind == "reduce_scatter":
                y = torch.empty(numel // n, device="cuda")
                dqcoll.reduce_scatter(x, y, **kw)
            else:
                y = torch.empty(n * numel, device="cuda")
                dqcoll.all_gather(x, y, **kw)
            out[key] = y.cpu()
        return out

    expected = run_local(world_size, local, device="cuda")
    wrong = []
    for rank in range(world_size):
        for key, value in results[rank].items():
            if not torch.equal(value, results[0][key]):
                wrong.append(f"rank {rank} differs from rank 0 at {key}")
            if not torch.equal(value, expected[rank][key]):
                wrong.append(f"rank {rank} differs from the local transport at {key}")
    assert not wrong, wrong[:20]


@pytest.mark.multi_rank_gpu
@pytest.mark.parametrize("backend", BINDINGS)
def test_nccl_stalled_rank_is_reported_with_the_step(backend: str, tmp_path: Path) -> None:
    """When rank 1 of 2 NCCL ranks stalls before a reduce step, rank 0 raises a
    CollectiveTimeoutError (or PeerError) naming the collective step within the timeout plus
    slack, from the watchdog's abort, instead of waiting forever: at the call, or, where the
    call had queued its last transfers and final decode and returned (a CUDA buffer), at the
    ``synchronize()`` that follows. Where the call itself raised, its buffer keeps the input;
    where it returned, the buffer holds what the aborted transfers left (undefined,
    docs/gpu_transport.md's failure table)."""
    _skip_without_nccl(backend)
    timeout_s = 5.0
    reports = _run_nccl("stall", 2, tmp_path, timeout_s=timeout_s, backend=backend, wait_for=1)
    rep = reports[0]
    assert rep["exit"] == 0, rep
    assert rep["error"] in ("CollectiveTimeoutError", "PeerError"), rep
    assert "allreduce#1" in rep["message"] and "step" in rep["message"], rep
    assert rep["elapsed_s"] < 3 * timeout_s + 10, rep
    assert rep["raised_at"] in ("call", "synchronize"), rep
    if rep["raised_at"] == "call":
        assert rep["untouched"], rep


@pytest.mark.gpu
def test_cupy_array_runs_on_cupy_stream() -> None:
    """A CuPy array is all-reduced on CuPy's current stream: the collective's kernels are queued
    there (torch's current stream is that stream inside), and the result equals the torch
    tensor's, over the local transport on one GPU."""
    cupy = pytest.importorskip("cupy")
    from dqcoll.interop import caller_stream
    from dqcoll.testing import run_local

    def body(comm: Any) -> tuple[bool, bool]:
        g = torch.Generator().manual_seed(comm.rank)
        base = torch.randn(50_000, generator=g)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            arr = cupy.asarray(base.numpy())
            same_stream = caller_stream(arr).cuda_stream == stream.ptr
            dqcoll.allreduce(arr, seed=2, step=0, tile_nbytes=16384)
            host = cupy.asnumpy(arr, stream=stream)
        stream.synchronize()
        x = base.cuda()
        dqcoll.allreduce(x, seed=2, step=0, tile_nbytes=16384)
        return same_stream, bool(torch.equal(torch.from_numpy(host), x.cpu()))

    assert run_local(3, body, device="cuda") == [(True, True)] * 3


def test_unique_id_travels_over_a_tcp_store() -> None:
    """Rank 0 publishes the 128 id bytes (values 0..255, as CuPy 14 and nccl4py make them) in a
    TCPStore it hosts and every other rank reads back exactly the same bytes, under a key of its
    own per communicator; a rank that never gets the id times out naming the key, and an id of
    the wrong length is refused."""
    import threading

    from dqcoll.errors import CollectiveTimeoutError, PeerError
    from dqcoll.transports import nccl_common

    fake_id = bytes((i * 37) % 256 for i in range(128))
    port = rendezvous_port()
    ids: dict[int, bytes] = {}
    stores: list[Any] = []  # rank 0's store serves the others: keep it alive, as the transport does

    def rank_body(rank: int) -> None:
        store = nccl_common.make_store(rank, 3, "127.0.0.1", port, 30.0)
        stores.append(store)
        ids[rank] = nccl_common.exchange_unique_id(lambda: fake_id, store, rank,
                                                   "dqcoll/nccl/t/0", 30.0)

    threads = [threading.Thread(target=rank_body, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert ids == {0: fake_id, 1: fake_id, 2: fake_id}
    store = torch.distributed.TCPStore("127.0.0.1", rendezvous_port(), 1, is_master=True,
                                       wait_for_workers=False)
    with pytest.raises(CollectiveTimeoutError, match="dqcoll/nccl/t/missing"):
        nccl_common.exchange_unique_id(lambda: fake_id, store, 1, "dqcoll/nccl/t/missing", 0.5)
    with pytest.raises(PeerError, match="expected 128 bytes"):
        nccl_common.exchange_unique_id(lambda: fake_id[:100], store, 0, "dqcoll/nccl/t/s", 0.5)
