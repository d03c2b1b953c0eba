"""Contract tier: the NCCL transports against the real CuPy 14 and nccl4py, on a CPU machine.

Both packages import and run their host-side parts without a GPU: unique ids, argument checks of
the Cython / Python bindings, enum values, the error of a communicator made without a device.
These tests ask the libraries themselves (signatures introspected from the installed package,
real calls that must fail only for want of a GPU); a fake stands in only for what needs a device
(a communicator that joined, a CUDA stream), and every fake is checked against the real
signature first. ``make test`` installs the packages (the ``gpu-contract`` extra); where one
cannot be installed the tests skip, naming it.
"""

from __future__ import annotations

import inspect
import itertools
import re
import threading
import time
from typing import Any, ClassVar

import pytest
import torch

import dqcoll
from dqcoll.cli.ports import rendezvous_port
from dqcoll.errors import UnsupportedError
from dqcoll.transports import cupy_nccl, nccl4py, nccl_binding, nccl_common

cupy = pytest.importorskip("cupy", reason="cupy-cuda12x is not installed (the gpu-contract "
                                          "extra of pyproject.toml)")
cupy_nccl_module = pytest.importorskip("cupy.cuda.nccl", reason="CuPy has no NCCL bindings")
nccl_core = pytest.importorskip("nccl.core", reason="nccl4py[cu12] is not installed (the "
                                                    "gpu-contract extra of pyproject.toml)")



def _doc_signature(obj: Any) -> str:
    """The signature line Cython's embedsignature puts first in the docstring."""
    return (obj.__doc__ or "").strip().splitlines()[0]


def _doc_params(obj: Any) -> list[str]:
    """Parameter names of a Cython signature line ("int ndev, bytes commId, ...")."""
    inner = re.search(r"\((.*)\)", _doc_signature(obj))
    assert inner is not None, _doc_signature(obj)
    names = []
    for part in inner.group(1).split(","):
        part = part.split("=")[0].strip()
        if part:
            names.append(part.split()[-1])
    return names


def _no_gpu() -> bool:
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) == 0
    except Exception:
        return True


requires_no_gpu = pytest.mark.skipif(not _no_gpu(), reason="a GPU is present: the no-GPU "
                                                           "error paths are not reachable")


# -- CuPy 14 -----------------------------------------------------------------------------------


def test_cupy_14_unique_id_is_bytes_and_the_constructor_takes_bytes() -> None:
    """CuPy >= 14 makes a 128-byte ``bytes`` id (values 0..255, so it cannot be packed as signed
    bytes) and its constructor's signature names ``bytes commId``; the form dqcoll hands over
    (``unique_id_argument``) is those bytes, and the real constructor accepts it up to the point
    where it needs a GPU (NcclError), while the old tuple form is refused by type (TypeError)."""
    major = int(cupy.__version__.split(".")[0])
    if major < 14:
        pytest.skip(f"CuPy {cupy.__version__}: this test pins CuPy 14's API")
    nccl = cupy_nccl_module
    made = nccl.get_unique_id()
    assert isinstance(made, bytes) and len(made) == nccl_common.UNIQUE_ID_NBYTES
    assert _doc_signature(nccl.NcclCommunicator).startswith(
        "NcclCommunicator(int ndev, bytes commId, int rank")
    fresh = cupy_nccl.unique_id_bytes(nccl)
    assert isinstance(fresh, bytes) and len(fresh) == 128
    argument = cupy_nccl.unique_id_argument(nccl, made)
    assert isinstance(argument, bytes) and argument == made
    with pytest.raises(TypeError, match="commId"):
        nccl.NcclCommunicator(1, tuple(made), 0)
    if _no_gpu():
        with pytest.raises(nccl.NcclError):
            nccl.NcclCommunicator(1, argument, 0)


def test_cupy_point_to_point_signatures_and_dtype() -> None:
    """The calls CupyBinding makes match CuPy's own signatures: ``send/recv(ptr, count,
    datatype, peer, stream)``, ``check_async_error()``, ``abort()``, ``destroy()``, module-level
    ``groupStart/groupEnd`` (which run without a GPU), and ``NCCL_UINT8`` is 1 as in nccl.h."""
    comm = cupy_nccl_module.NcclCommunicator
    assert _doc_params(comm.send) == ["self", "sendbuf", "count", "datatype", "peer", "stream"]
    assert _doc_params(comm.recv) == ["self", "recvbuf", "count", "datatype", "peer", "stream"]
    for name in ("check_async_error", "abort", "destroy"):
        assert _doc_params(getattr(comm, name)) == ["self"], name
    assert cupy_nccl_module.NCCL_UINT8 == 1
    cupy_nccl_module.groupStart()
    cupy_nccl_module.groupEnd()
    for name in ("send", "recv"):
        ours = list(inspect.signature(getattr(_RecordingCupyComm, name)).parameters)
        assert ours == _doc_params(getattr(comm, name)), name


class _RecordingCupyComm:
    """Stands in for a joined ``NcclCommunicator`` (needs a GPU); its methods carry the real
    parameter names (checked above)."""

    def __init__(self, ndev: int = 0, commId: Any = None, rank: int = 0) -> None:
        self.args = (ndev, commId, rank)
        self.calls: list[tuple[Any, ...]] = []

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.calls.append(("send", sendbuf, count, datatype, peer, stream))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.calls.append(("recv", recvbuf, count, datatype, peer, stream))

    def check_async_error(self) -> None:
        self.calls.append(("check_async_error",))

    def abort(self) -> None:
        self.calls.append(("abort",))

    def destroy(self) -> None:
        self.calls.append(("destroy",))


def test_recording_comm_matches_cupys_constructor() -> None:
    """The stand-in's constructor has CuPy's parameter names and order."""
    real = _doc_params(cupy_nccl_module.NcclCommunicator)
    ours = list(inspect.signature(_RecordingCupyComm.__init__).parameters)[1:]
    assert real[: len(ours)] == ours, (real, ours)


def _stub_device_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU part of the rendezvous: selecting and entering cuda:0, and the watchdog's
    set_device. Everything else (store, id, constructor arguments) is real."""
    monkeypatch.setattr(nccl_common, "select_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(nccl_common.CudaStreams, "bind_thread", lambda self: None)
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: _NullContext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NullContext())
    # the ranks are threads of this one process: each would count its communicators from 0
    monkeypatch.setattr(nccl_common, "_generation", itertools.repeat(0))


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _run_ranks(world_size: int, body: Any) -> dict[int, Any]:
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return results


def test_two_cupy_ranks_hand_the_constructor_the_same_bytes_id(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' ``cupy_nccl.init_transport`` (real CuPy 14 module, real TCPStore hosted by rank
    0) give ``NcclCommunicator`` the same 128-byte ``bytes`` id, made by CuPy's own
    ``get_unique_id``, with (world size, id, rank) in CuPy's order; only the communicator object
    and the device selection are stubbed."""
    nccl = cupy_nccl_module
    made: list[bytes] = []
    real_get = nccl.get_unique_id

    def get_unique_id() -> bytes:
        made.append(real_get())
        return made[-1]

    monkeypatch.setattr(nccl, "get_unique_id", get_unique_id)
    monkeypatch.setattr(nccl, "NcclCommunicator", _RecordingCupyComm)
    monkeypatch.setattr(cupy_nccl, "_import_nccl", lambda: nccl)
    _stub_device_selection(monkeypatch)
    port = rendezvous_port()

    def rank_body(rank: int) -> Any:
        return cupy_nccl.init_transport(rank=rank, world_size=2, master_addr="127.0.0.1",
                                        master_port=port, timeout_s=30)

    transports = _run_ranks(2, rank_body)
    try:
        ids = [transports[r].comm.args[1] for r in range(2)]
        assert len(made) == 1  # rank 0 only
        assert all(isinstance(i, bytes) and len(i) == 128 for i in ids), ids
        assert ids[0] == ids[1] == made[0]
        assert [transports[r].comm.args[::2] for r in range(2)] == [(2, 0), (2, 1)]
    finally:
        for t in transports.values():
            t.close()
    assert all(("destroy",) in t.comm.calls for t in transports.values())


def test_cupy_13_form_is_signed_ints() -> None:
    """A CuPy 13 constructor (``tuple commId``, documented so) gets the same id as 128 signed
    ints, and CuPy 13's own id (signed ints) turns into the same bytes: the two forms round-trip
    (checked manually against the real cupy-cuda12x 13.6.0, see docs/gpu_transport.md)."""

    class Cupy13:
        class NcclCommunicator:
            """NcclCommunicator(int ndev, tuple commId, int rank)"""

        @staticmethod
        def get_unique_id() -> tuple[int, ...]:
            return tuple((i * 37) % 256 - 128 for i in range(128))

    raw = cupy_nccl.unique_id_bytes(Cupy13)
    assert isinstance(raw, bytes) and len(raw) == 128
    assert cupy_nccl.unique_id_argument(Cupy13, raw) == Cupy13.get_unique_id()


# -- nccl4py -----------------------------------------------------------------------------------


def test_nccl4py_unique_id_round_trip_and_signatures() -> None:
    """nccl4py's id: ``as_bytes`` is a *property* giving 128 bytes and ``UniqueId.from_bytes``
    rebuilds the same id; ``Communicator.init(nranks, rank, unique_id, config)``,
    ``send/recv(buf, peer, *, stream)``, ``get_async_error()`` whose codes are ncclSuccess 0 and
    ncclInProgress 7, ``group_start/group_end`` (host-side, run here)."""
    core = nccl_core
    uid = core.get_unique_id()
    assert isinstance(inspect.getattr_static(core.UniqueId, "as_bytes"), property)
    raw = nccl4py.unique_id_bytes(core)
    assert isinstance(raw, bytes) and len(raw) == 128
    assert core.UniqueId.from_bytes(uid.as_bytes).as_bytes == uid.as_bytes
    init = inspect.signature(core.Communicator.init)
    assert list(init.parameters)[:3] == ["nranks", "rank", "unique_id"]
    for name in ("send", "recv"):
        params = inspect.signature(getattr(core.Communicator, name)).parameters
        assert list(params)[:3] == ["self", f"{name}buf", "peer"], name
        assert params["stream"].kind is inspect.Parameter.KEYWORD_ONLY
    from nccl.bindings import nccl as bindings

    assert int(bindings.Result.Success) == nccl4py._NCCL_SUCCESS
    assert int(bindings.Result.InProgress) == nccl4py._NCCL_IN_PROGRESS
    core.group_start()
    core.group_end()


def test_nccl4py_binding_calls_pass_the_real_argument_checks() -> None:
    """Nccl4pyBinding's send/recv reach a real (empty) ``Communicator`` with arguments it
    accepts: the only complaint is that the communicator was never initialised; abort and
    destroy of an empty communicator are no-ops; the byte view resolves to count = bytes."""
    from nccl.core.buffer import NcclBuffer

    comm = nccl_core.Communicator()
    binding = nccl4py.Nccl4pyBinding(comm, nccl_core)
    payload = torch.arange(12, dtype=torch.float32).view(torch.uint8)
    resolved = NcclBuffer(payload)
    assert resolved.count == 48 and int(resolved.dtype) == int(nccl_core.UINT8)
    assert resolved.ptr == payload.data_ptr()
    for call in (binding.send, binding.recv):
        with pytest.raises(nccl_core.NcclInvalid, match="not initialized"):
            call(payload, 1, 0)
    binding.abort()
    binding.destroy()


class _RecordingCommunicator:
    """Stands in for ``nccl.core.Communicator`` where a device is needed; ``init`` carries the
    real signature's parameter names (checked in the test)."""

    inits: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: Any, config: Any = None) -> Any:
        cls.inits.append({"nranks": nranks, "rank": rank, "unique_id": unique_id})
        return cls()

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def test_two_nccl4py_ranks_init_with_the_same_unique_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' ``nccl4py.init_transport`` (real nccl.core, real TCPStore) call
    ``Communicator.init`` by keyword with the same ``UniqueId`` (same 128 bytes, rebuilt with
    ``from_bytes`` on rank 1); only the communicator and the device selection are stubbed."""
    real = inspect.signature(nccl_core.Communicator.init)
    ours = inspect.signature(_RecordingCommunicator.init)
    assert list(ours.parameters) == list(real.parameters)
    _RecordingCommunicator.inits = []
    monkeypatch.setattr(nccl_core, "Communicator", _RecordingCommunicator)
    monkeypatch.setattr(nccl4py, "_import_core", lambda: nccl_core)
    _stub_device_selection(monkeypatch)
    port = rendezvous_port()

    def rank_body(rank: int) -> Any:
        return nccl4py.init_transport(rank=rank, world_size=2, master_addr="127.0.0.1",
                                      master_port=port, timeout_s=30)

    transports = _run_ranks(2, rank_body)
    try:
        inits = sorted(_RecordingCommunicator.inits, key=lambda d: d["rank"])
        assert [(d["nranks"], d["rank"]) for d in inits] == [(2, 0), (2, 1)]
        ids = [d["unique_id"] for d in inits]
        assert all(isinstance(i, nccl_core.UniqueId) for i in ids)
        assert ids[0].as_bytes == ids[1].as_bytes and len(ids[0].as_bytes) == 128
    finally:
        for t in transports.values():
            t.close()


# -- backend choice and the no-GPU errors --------------------------------------------------------


def test_backend_nccl_prefers_nccl4py_and_both_are_selectable() -> None:
    """``nccl`` resolves to nccl4py where it imports; ``nccl4py`` and ``nccl-cupy`` are kept as
    asked; an unknown binding name lists the valid ones."""
    assert nccl_binding("nccl") == "nccl4py"
    assert nccl_binding("nccl4py") == "nccl4py"
    assert nccl_binding("nccl-cupy") == "nccl-cupy"
    with pytest.raises(dqcoll.errors.InvalidArgumentError, match="nccl-cupy"):
        nccl_binding("nccl5")


@requires_no_gpu
@pytest.mark.parametrize(("backend", "expected"), [
    ("nccl", "torch sees no CUDA device"),
    ("nccl4py", "torch sees no CUDA device"),
    ("nccl-cupy", "no CUDA GPU is usable"),
])
def test_each_backend_says_no_gpu(backend: str, expected: str) -> None:
    """Without a GPU, ``dqcoll.init(backend=...)`` raises UnsupportedError naming the backend and
    saying no GPU is usable (from the real packages), before any rendezvous."""
    with pytest.raises(UnsupportedError, match="cannot run here") as info:
        dqcoll.init(backend=backend, rank=0, world_size=1)
    assert expected in str(info.value), info.value
    assert cupy_nccl.nccl_unavailable_reason() is not None
    assert nccl4py.nccl4py_unavailable_reason() is not None


# -- the transport on the host: both bindings over fakes of a joined communicator ------------------
#
# A joined communicator needs a GPU; these fakes carry NCCL's point-to-point semantics on the host
# instead (a receive completes when the matching send arrives, in order per pair; groupEnd waits
# for the group's receives, with a deadline) and the real libraries' method signatures (checked
# first). The transports, their bindings and everything above them are the real code.


class _FakeNet:
    """Byte mailboxes between ranks: a send copies its bytes out at once, a receive is filled
    when the matching send is there (FIFO per pair)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[tuple[int, int], list[bytes]] = {}
        self.waiting: dict[tuple[int, int], list[tuple[int, int, threading.Event]]] = {}
        self.group = threading.local()

    def _match(self, pair: tuple[int, int]) -> None:
        import ctypes

        data, waiting = self.data.setdefault(pair, []), self.waiting.setdefault(pair, [])
        while data and waiting:
            payload = data.pop(0)
            ptr, count, done = waiting.pop(0)
            assert len(payload) == count, f"{pair}: {len(payload)} bytes sent, {count} expected"
            ctypes.memmove(ptr, payload, count)
            done.set()

    def send(self, src: int, dst: int, ptr: int, count: int) -> None:
        import ctypes

        with self.lock:
            self.data.setdefault((src, dst), []).append(ctypes.string_at(ptr, count))
            self._match((src, dst))

    def recv(self, dst: int, src: int, ptr: int, count: int) -> None:
        done = threading.Event()
        with self.lock:
            self.waiting.setdefault((src, dst), []).append((ptr, count, done))
            self._match((src, dst))
        self.group.pending.append(done)

    def group_start(self) -> None:
        self.group.pending = []

    def group_end(self) -> None:
        for done in self.group.pending:
            if not done.wait(20):
                raise RuntimeError("fake NCCL: a receive did not complete within 20 s")


class _FakeCupyComm(_RecordingCupyComm):
    """A joined CuPy communicator on the host (signatures: _RecordingCupyComm's, checked)."""

    def __init__(self, net: _FakeNet, rank: int) -> None:
        super().__init__()
        self.net, self.rank = net, rank

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        assert datatype == cupy_nccl_module.NCCL_UINT8
        self.net.send(self.rank, peer, sendbuf, count)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        assert datatype == cupy_nccl_module.NCCL_UINT8
        self.net.recv(self.rank, peer, recvbuf, count)


class _FakeNccl4pyComm:
    """A joined nccl4py Communicator on the host (send/recv signatures checked below)."""

    def __init__(self, net: _FakeNet, rank: int) -> None:
        self.net, self.rank = net, rank
        self.destroyed = False

    def send(self, sendbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.send(self.rank, peer, sendbuf.data_ptr(), sendbuf.numel())

    def recv(self, recvbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.recv(self.rank, peer, recvbuf.data_ptr(), recvbuf.numel())

    def get_async_error(self) -> int:
        return 0

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        self.destroyed = True


class _HostEvent:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _HostStreams:
    """CudaStreams on the host: one "stream" whose work is done when posted."""

    def __init__(self, complete: bool = True) -> None:
        self.complete = complete

    def current_handle(self) -> int:
        return 0

    def record(self) -> Any:
        return _HostEvent(self.complete)

    def scope(self) -> Any:
        return _NullContext()

    def bind_thread(self) -> None:
        pass


def test_host_fakes_match_the_real_signatures() -> None:
    """Every fake used below has the parameters of what it replaces: CuPy's send/recv (its
    docstring signature), nccl4py's Communicator.send/recv, the transport's CudaStreams, and
    torch.cuda.Event.query."""
    for name in ("send", "recv"):
        ours = list(inspect.signature(getattr(_FakeCupyComm, name)).parameters)
        assert ours == _doc_params(getattr(cupy_nccl_module.NcclCommunicator, name)), name
        real = inspect.signature(getattr(nccl_core.Communicator, name)).parameters
        fake = inspect.signature(getattr(_FakeNccl4pyComm, name)).parameters
        assert [(p.name, p.kind) for p in fake.values()] == [
            (p.name, p.kind) for p in real.values()], name
    for name in ("current_handle", "record", "scope", "bind_thread"):
        assert inspect.signature(getattr(_HostStreams, name)) == inspect.signature(
            getattr(nccl_common.CudaStreams, name)), name
    assert list(inspect.signature(_HostEvent.query).parameters) == list(
        inspect.signature(torch.cuda.Event.query).parameters)
    # the module-level parts: CuPy's group calls and byte type, nccl4py's group calls
    assert _FakeCupyModule.NCCL_UINT8 == cupy_nccl_module.NCCL_UINT8
    for name in ("groupStart", "groupEnd"):
        assert _doc_params(getattr(cupy_nccl_module, name)) == [], name
    for name in ("group_start", "group_end"):
        real = [p for p in inspect.signature(getattr(nccl_core, name)).parameters.values()
                if p.default is inspect.Parameter.empty]
        assert real == [], name  # called with no argument, as the binding does
    assert list(inspect.signature(_FakeCore.get_error_string).parameters) == list(
        inspect.signature(nccl_core.get_error_string).parameters)


class _FakeCupyModule:
    NCCL_UINT8 = 1

    def __init__(self, net: _FakeNet) -> None:
        self.groupStart, self.groupEnd = net.group_start, net.group_end


class _FakeCore:
    def __init__(self, net: _FakeNet) -> None:
        self.group_start, self.group_end = net.group_start, net.group_end

    @staticmethod
    def get_error_string(nccl_result: Any) -> str:
        return ""


def _host_transport(binding: str, net: _FakeNet, rank: int, world_size: int) -> Any:
    kwargs = dict(rank=rank, world_size=world_size, device=torch.device("cpu"), timeout_s=20.0,
                  streams=_HostStreams())
    transport: Any
    if binding == "nccl-cupy":
        transport = cupy_nccl.NcclTransport(_FakeCupyComm(net, rank),
                                            nccl_module=_FakeCupyModule(net), **kwargs)
    else:
        transport = nccl4py.Nccl4pyTransport(_FakeNccl4pyComm(net, rank), core=_FakeCore(net),
                                             **kwargs)
    transport.devices = ("cpu",)  # host memory stands in for the GPU's
    return transport


def _collectives(comm: Any) -> dict[str, torch.Tensor]:
    n, rank = comm.world_size, comm.rank
    g = torch.Generator().manual_seed(50 + rank)
    base = torch.randn(3 * 2048 + 6, generator=g) * 3
    results = {}
    for algorithm in ("ring", "butterfly"):
        x = base.clone()
        dqcoll.allreduce(x, scheme="dynamiq", algorithm=algorithm, seed=4, step=1,
                         tile_nbytes=4096, comm=comm)
        results[f"allreduce/{algorithm}"] = x
    out = torch.empty(base.numel() // n)
    dqcoll.reduce_scatter(base.clone(), out, algorithm="ring", seed=4, step=1, comm=comm)
    results["reduce_scatter"] = out
    small = torch.arange(7, dtype=torch.float32) * (rank + 1) + 0.1
    comm.transport.allreduce(small, "sum", what="small")
    results["small"] = small
    comm.barrier()
    return results


@pytest.mark.parametrize("binding", ["nccl-cupy", "nccl4py"])
def test_both_bindings_give_the_local_transports_bits(binding: str) -> None:
    """Three ranks over each NCCL transport (real transport and binding code, the joined
    communicator faked on the host) run dynamiq all-reduces (ring, butterfly; tiled),
    a reduce-scatter, the small rank-order all-reduce and a barrier: every result is bit for bit
    what the ``local`` transport gives, then close() destroys each communicator once."""
    from dqcoll.comm import Communicator
    from dqcoll.testing import run_local

    n = 3
    expected = run_local(n, _collectives)
    net = _FakeNet()
    transports = [_host_transport(binding, net, r, n) for r in range(n)]
    actual = _run_ranks(n, lambda r: _collectives(Communicator(transports[r], device="cpu")))
    for rank in range(n):
        for key, value in expected[rank].items():
            assert torch.equal(actual[rank][key], value), (binding, rank, key)
    for transport in transports:
        transport.close()
        transport.close()  # idempotent
    if binding == "nccl-cupy":
        assert all(t.comm.calls.count(("destroy",)) == 1 for t in transports)
    else:
        assert all(t.comm.destroyed for t in transports)


class _SlowComm(_RecordingCupyComm):
    """A CuPy communicator whose calls take time and record when they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[str, float, float]] = []
        self.watchdog_alive_at_destroy: bool | None = None
        self.transport: Any = None

    def _span(self, name: str, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        self.spans.append((name, start, time.monotonic()))

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._span("send", 0.03)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._span("recv", 0.03)

    def abort(self) -> None:
        self._span("abort", 0.0)

    def destroy(self) -> None:
        self.watchdog_alive_at_destroy = self.transport._watchdog.is_alive()
        self._span("destroy", 0.0)


def test_watchdog_abort_never_overlaps_a_post_and_close_joins_it() -> None:
    """A group that never completes times out while another thread keeps posting: the
    watchdog's abort runs between posts, never inside one (one lock around every call into the
    communicator), posts after it raise without touching the communicator, the caller's host
    wait raises the timeout naming the step, and close() joins the watchdog before it would
    destroy (it does not: an aborted communicator is already freed)."""
    import time as clock

    comm = _SlowComm()
    transport = cupy_nccl.NcclTransport(
        comm, rank=0, world_size=2, device=torch.device("cpu"), timeout_s=0.2,
        nccl_module=_FakeCupyModule(_FakeNet()), streams=_HostStreams(complete=False))
    transport.binding.nccl = types_namespace(NCCL_UINT8=1, groupStart=lambda: None,
                                             groupEnd=lambda: None)
    comm.transport = transport
    payload = torch.zeros(64, dtype=torch.uint8)
    errors: list[BaseException] = []

    def poster() -> None:
        deadline = clock.monotonic() + 2.0
        step = 0
        while clock.monotonic() < deadline:
            try:
                transport.exchange([(1, payload)], [(1, torch.empty(64, dtype=torch.uint8))],
                                   what=f"allreduce#0 reduce step {step}")
            except BaseException as exc:
                errors.append(exc)
                return
            step += 1

    thread = threading.Thread(target=poster)
    thread.start()
    thread.join(timeout=10)
    assert errors and isinstance(errors[0], dqcoll.errors.CollectiveTimeoutError), errors
    assert "allreduce#0 reduce step 0" in str(errors[0])
    transport._watchdog.join(timeout=5)  # it returns once it has aborted
    aborts = [s for s in comm.spans if s[0] == "abort"]
    assert len(aborts) == 1
    at = aborts[0][1]
    inside = [s for s in comm.spans if s[0] != "abort" and s[1] < at < s[2]]
    assert not inside, inside
    assert not [s for s in comm.spans if s[0] != "abort" and s[1] > at]  # nothing posted after
    with pytest.raises(dqcoll.errors.CollectiveTimeoutError):
        transport.synchronize()
    transport.close()
    assert not transport._watchdog.is_alive()
    assert comm.watchdog_alive_at_destroy is None  # aborted: never destroyed as well


def types_namespace(**attrs: Any) -> Any:
    import types

    return types.SimpleNamespace(**attrs)


@requires_no_gpu
@pytest.mark.parametrize("binding", ["nccl-cupy", "nccl4py"])
def test_a_failing_communicator_init_names_the_rank(binding: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real constructor, handed the real id, fails for want of a GPU (NCCL's "unhandled
    cuda error"): init_transport raises CommAbortedError naming the rank, the binding and the
    device, not the library's bare error. Only the device selection is stubbed."""
    _stub_device_selection(monkeypatch)
    monkeypatch.setattr(cupy_nccl, "_import_nccl", lambda: cupy_nccl_module)
    monkeypatch.setattr(nccl4py, "_import_core", lambda: nccl_core)
    module = cupy_nccl if binding == "nccl-cupy" else nccl4py
    with pytest.raises(dqcoll.errors.CommAbortedError,
                       match=r"rank 0 of 1: ncclCommInitRank through (CuPy|nccl4py) on cuda:0"):
        module.init_transport(rank=0, world_size=1, master_addr="127.0.0.1",
                              master_port=rendezvous_port(), timeout_s=10)


def test_nccl4py_async_error_codes() -> None:
    """Nccl4pyBinding.check_async_error reads nccl4py's real result codes: ncclSuccess and
    ncclInProgress are no error; any other code raises with its name and NCCL's own description
    (``get_error_string``, the real one)."""
    from nccl.bindings import nccl as bindings

    class Comm:
        def __init__(self, result: Any) -> None:
            self.result = result

        def get_async_error(self) -> Any:
            return self.result

    assert list(inspect.signature(Comm.get_async_error).parameters) == list(
        inspect.signature(nccl_core.Communicator.get_async_error).parameters)
    for ok in (bindings.Result.Success, bindings.Result.InProgress):
        nccl4py.Nccl4pyBinding(Comm(ok), nccl_core).check_async_error()
    with pytest.raises(RuntimeError, match="RemoteError") as info:
        nccl4py.Nccl4pyBinding(Comm(bindings.Result.RemoteError), nccl_core).check_async_error()
    assert nccl_core.get_error_string(bindings.Result.RemoteError) in str(info.value)
