"""Contract tier: the NCCL transports against the real CuPy 14 and nccl4py, on a CPU machine.

Both packages import and run their host-side parts without a GPU: unique ids, argument checks of
the Cython / Python bindings, buffer resolution, enum values, the error of a communicator made
without a device. These tests ask the libraries themselves (signatures introspected from the
installed package, real calls that must fail only for want of a GPU); a fake stands in only for
what needs a device (a communicator that joined, a CUDA stream, the C call itself), and every fake
is compared with what it replaces (names, parameters, return types; test_*_fakes_match_*). A test
that needs one package skips, naming it, only where that package does not import: the CuPy tests
run without nccl4py and the other way round. ``make test`` installs both (the ``gpu-contract``
extra).

The transport's abort runs against stubs whose calls block (a one-sided ``ncclCommAbort``, a post
stuck inside NCCL): no other thread may wait on it.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
import threading
import time
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch

import dqcoll
from dqcoll.cli.ports import rendezvous_port
from dqcoll.errors import CollectiveTimeoutError, CommAbortedError, PeerError, UnsupportedError
from dqcoll.transports import cupy_nccl, nccl4py, nccl_binding, nccl_common


def _import(name: str) -> tuple[Any, str]:
    """The module ``name``, or None and why it does not import."""
    try:
        return importlib.import_module(name), ""
    except Exception as exc:  # ImportError, or a CuPy / cuda-bindings that fails on import
        return None, f"{type(exc).__name__}: {exc}"


cupy, _cupy_reason = _import("cupy")
cupy_nccl_module, _cupy_nccl_reason = (_import("cupy.cuda.nccl") if cupy is not None
                                       else (None, _cupy_reason))
nccl_core, _nccl4py_reason = _import("nccl.core")
nccl_bindings = importlib.import_module("nccl.bindings.nccl") if nccl_core is not None else None

needs_cupy = pytest.mark.skipif(
    cupy_nccl_module is None,
    reason=f"CuPy's NCCL bindings do not import ({_cupy_nccl_reason}); install cupy-cuda12x "
           "(the gpu-contract extra of pyproject.toml)")
needs_nccl4py = pytest.mark.skipif(
    nccl_core is None,
    reason=f"nccl4py does not import ({_nccl4py_reason}); install nccl4py[cu12] (the "
           "gpu-contract extra of pyproject.toml)")
BINDINGS = [pytest.param("nccl-cupy", marks=needs_cupy),
            pytest.param("nccl4py", marks=needs_nccl4py)]


def _doc_signature(obj: Any) -> str:
    """The signature line Cython's embedsignature puts first in the docstring."""
    return (obj.__doc__ or "").strip().splitlines()[0]


def _doc_typed_params(obj: Any) -> tuple[list[tuple[str | None, str]], str | None]:
    """A Cython signature line ("f(int ndev, bytes commId, comm) -> int"): its parameters as
    (C type or None, name) and its return type (None where the line states none)."""
    line = _doc_signature(obj)
    match = re.search(r"\((.*)\)\s*(?:->\s*(\S+))?\s*$", line)
    assert match is not None, line
    params: list[tuple[str | None, str]] = []
    for part in match.group(1).split(","):
        words = part.split("=")[0].split()
        if words:
            params.append((" ".join(words[:-1]) or None, words[-1]))
    return params, match.group(2)


def _doc_params(obj: Any) -> list[str]:
    """Parameter names of a Cython signature line ("int ndev, bytes commId, ...")."""
    return [name for _, name in _doc_typed_params(obj)[0]]


# C types of Cython signatures and the Python type a caller passes or gets
_C_TYPES: dict[str, type] = {"int": int, "intptr_t": int, "size_t": int, "bytes": bytes,
                             "tuple": tuple}


def _hints(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(obj)


def _check_against_cython(fake: Any, real: Any) -> None:
    """``fake`` (a Python callable) has the parameters of the Cython callable ``real``, in its
    order, each annotated with the Python type of the C type (or Any), and returns the type the
    signature line states, where it states one."""
    params, returns = _doc_typed_params(real)
    ours = inspect.signature(fake).parameters
    assert list(ours) == [name for _, name in params], (fake, list(ours), params)
    hints = _hints(fake.__init__ if isinstance(fake, type) else fake)
    for ctype, name in params:
        if ctype in _C_TYPES and name in hints and hints[name] is not Any:
            assert hints[name] is _C_TYPES[ctype], (fake, name, hints[name], ctype)
    if returns is not None:
        assert hints.get("return") is _C_TYPES[returns], (fake, hints.get("return"), returns)


def _check_against_python(fake: Any, real: Any, stand_ins: dict[Any, Any] | None = None) -> None:
    """``fake`` has ``real``'s parameters (names, kinds, defaults, in order); each type ``real``
    annotates is the fake's too (or the fake says Any), and so is the return type, with a
    stand-in class in place of the class it stands in for."""
    ours, theirs = inspect.signature(fake).parameters, inspect.signature(real).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()], (fake, ours, theirs)
    fake_hints, real_hints = _hints(fake), _hints(real)
    for name, expected in real_hints.items():
        expected = (stand_ins or {}).get(expected, expected)
        got = fake_hints.get(name, Any)
        assert got is Any or got == expected, (fake, name, got, expected)
    if "return" in real_hints:
        expected = (stand_ins or {}).get(real_hints["return"], real_hints["return"])
        assert fake_hints.get("return") == expected, (fake, fake_hints.get("return"), expected)


def _no_gpu() -> bool:
    if torch.cuda.is_available():
        return False
    if cupy is None:
        return True
    try:
        return int(cupy.cuda.runtime.getDeviceCount()) == 0
    except Exception:
        return True


requires_no_gpu = pytest.mark.skipif(not _no_gpu(), reason="a GPU is present: the no-GPU "
                                                           "error paths are not reachable")


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- CuPy 14 -----------------------------------------------------------------------------------


@needs_cupy
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


@needs_cupy
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


class _RecordingCupyComm:
    """Stands in for a joined ``NcclCommunicator`` (needs a GPU); its methods carry the real
    parameter names and types (test_cupy_fakes_match_cupy)."""

    def __init__(self, ndev: int = 0, commId: bytes = b"", rank: int = 0,
                 config: Any = None) -> None:
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


def _stub_device_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU part of the rendezvous: selecting and entering cuda:0, and the watchdog's
    set_device. Everything else (store, id, constructor arguments) is real."""
    monkeypatch.setattr(nccl_common, "select_device", lambda device: torch.device("cuda", 0))
    monkeypatch.setattr(nccl_common.CudaStreams, "bind_thread", lambda self: None)
    if cupy is not None:
        monkeypatch.setattr(cupy.cuda, "Device", lambda index: _NullContext())
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NullContext())
    # the ranks are threads of this one process: each would count its communicators from 0
    monkeypatch.setattr(nccl_common, "_generation", itertools.repeat(0))


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


@needs_cupy
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


class _Cupy13:
    """CuPy 13's NCCL module as documented: ``tuple commId`` both ways (checked against the real
    CuPy 13 where that is the installed version: test_cupy13_fake_matches_cupy_13)."""

    class NcclCommunicator:
        """NcclCommunicator(int ndev, tuple commId, int rank)"""

    @staticmethod
    def get_unique_id() -> tuple[int, ...]:
        return tuple((i * 37) % 256 - 128 for i in range(128))


def test_cupy_13_form_is_signed_ints() -> None:
    """A CuPy 13 constructor (``tuple commId``, documented so) gets the same id as 128 signed
    ints, and CuPy 13's own id (signed ints) turns into the same bytes: the two forms round-trip
    (the fake is checked against the real cupy-cuda12x 13.6.0 where that is installed, and was
    checked by hand, see docs/gpu_transport.md)."""
    raw = cupy_nccl.unique_id_bytes(_Cupy13)
    assert isinstance(raw, bytes) and len(raw) == 128
    assert cupy_nccl.unique_id_argument(_Cupy13, raw) == _Cupy13.get_unique_id()


# -- nccl4py -----------------------------------------------------------------------------------


@needs_nccl4py
def test_nccl4py_unique_id_round_trip_and_signatures() -> None:
    """nccl4py's id: ``as_bytes`` is a *property* giving 128 bytes and ``UniqueId.from_bytes``
    rebuilds the same id; ``Communicator.init(nranks, rank, unique_id, config)``,
    ``send/recv(buf, peer, *, stream)``, ``get_async_error()`` annotated to return the ``Result``
    enum whose codes are Success 0 and InProgress 7, ``group_start/group_end`` (host-side, run
    here)."""
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
    assert _hints(core.Communicator.get_async_error)["return"] is nccl_bindings.Result
    assert int(nccl_bindings.Result.Success) == nccl4py._NCCL_SUCCESS
    assert int(nccl_bindings.Result.InProgress) == nccl4py._NCCL_IN_PROGRESS
    core.group_start()
    core.group_end()


class _LowLevelNccl:
    """Stands in for ``nccl.bindings.nccl`` inside ``nccl.core.communicator``: the C calls, which
    need a joined communicator, are recorded; the rest of nccl.core runs for real. Signatures
    are the real module's (test_nccl4py_fakes_match_nccl4py); ``comm_get_async_error`` returns
    what the test sets (an ``int``, as the real one documents, or a ``Result``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.async_error: Any = 0
        self.Comm = nccl_bindings.Comm

    def send(self, sendbuff: int, count: int, datatype: int, peer: int, comm: Any,
             stream: int) -> None:
        self.calls.append(("send", sendbuff, count, datatype, peer, comm, stream))

    def recv(self, recvbuff: int, count: int, datatype: int, peer: int, comm: Any,
             stream: int) -> None:
        self.calls.append(("recv", recvbuff, count, datatype, peer, comm, stream))

    def comm_get_async_error(self, comm: Any) -> int:
        self.calls.append(("comm_get_async_error", comm))
        return self.async_error  # type: ignore[no-any-return]

    def comm_abort(self, comm: Any) -> None:
        self.calls.append(("comm_abort", comm))

    def comm_destroy(self, comm: Any) -> None:
        self.calls.append(("comm_destroy", comm))


def _joined_communicator(monkeypatch: pytest.MonkeyPatch, device_id: int | None) -> tuple[Any, Any]:
    """A real ``nccl.core.Communicator`` that passes its validity check (a non-null handle) on a
    device with ``device_id``, its C calls recorded by :class:`_LowLevelNccl`."""
    from nccl.core import communicator as communicator_module

    low = _LowLevelNccl()
    monkeypatch.setattr(communicator_module, "_nccl_bindings", low)
    comm = nccl_core.Communicator()
    comm._comm = nccl_bindings.Comm(0x5EED)  # never reaches NCCL: the C calls are recorded
    comm._device = types.SimpleNamespace(device_id=device_id)  # what ncclCommCuDevice would say
    return comm, low


@needs_nccl4py
def test_nccl4py_exchange_resolves_buffers_through_the_real_communicator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exchange over Nccl4pyTransport runs the real nccl.core down to the C call: the real
    ``group_start/group_end``, ``Communicator.send/recv`` with their validity check, ``NcclBuffer``
    resolving each tensor's byte view (its pointer, count = bytes, ``UINT8``) and the device
    check; ``ncclSend/ncclRecv`` get those, the peer, the communicator handle and the caller's
    stream. A buffer on another device than the communicator's is refused by that check, and
    close() reaches ``ncclCommDestroy`` once. Stubbed: the C calls and the device (need a GPU)."""
    payload = torch.arange(12, dtype=torch.float32)
    incoming = torch.zeros(5, dtype=torch.float64)
    comm, low = _joined_communicator(monkeypatch, payload.device.index)
    handle = comm._comm
    transport = nccl4py.Nccl4pyTransport(comm, rank=0, world_size=2, device=torch.device("cpu"),
                                         timeout_s=20.0, core=nccl_core,
                                         streams=_HostStreams(handle=0x5E))
    transport.exchange([(1, payload)], [(1, incoming)], what="allreduce#0 reduce step 0")
    uint8 = int(nccl_core.UINT8)
    assert low.calls == [("send", payload.data_ptr(), 48, uint8, 1, handle, 0x5E),
                         ("recv", incoming.data_ptr(), 40, uint8, 1, handle, 0x5E)]
    transport.close()
    assert low.calls[2:] == [("comm_destroy", handle)]
    assert not comm._comm  # the binding dropped its handle: nothing can use it again

    other, _ = _joined_communicator(monkeypatch, 0)  # the communicator is on cuda:0
    with pytest.raises(nccl_core.NcclInvalid, match="sendbuf is on device None, but "
                                                    "communicator is on device 0"):
        nccl4py.Nccl4pyBinding(other, nccl_core).send(payload.view(torch.uint8), 1, 0)


@needs_nccl4py
def test_nccl4py_binding_calls_on_a_null_communicator() -> None:
    """Nccl4pyBinding's send/recv on a real, never initialised ``Communicator`` fail with
    nccl4py's own complaint (not initialised), and abort and destroy of it are no-ops."""
    comm = nccl_core.Communicator()
    binding = nccl4py.Nccl4pyBinding(comm, nccl_core)
    payload = torch.arange(12, dtype=torch.float32).view(torch.uint8)
    for call in (binding.send, binding.recv):
        with pytest.raises(nccl_core.NcclInvalid, match="not initialized"):
            call(payload, 1, 0)
    binding.abort()
    binding.destroy()


@needs_nccl4py
@pytest.mark.parametrize("form", ["int", "Result"])
def test_nccl4py_async_error_codes_through_the_real_communicator(
        form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport's asynchronous-error query goes through the real
    ``Communicator.get_async_error``, whether the C binding gives a plain ``int`` (as
    ``comm_get_async_error`` documents) or the ``Result`` enum (``get_async_error``'s
    annotation): Success and InProgress are no error; RemoteError fails the transport with a
    PeerError naming the step, the code's name and NCCL's own description, and aborts the
    communicator once (``ncclCommAbort``), never destroying it after."""
    comm, low = _joined_communicator(monkeypatch, None)
    handle = comm._comm
    transport = nccl4py.Nccl4pyTransport(comm, rank=0, world_size=2, device=torch.device("cpu"),
                                         timeout_s=20.0, core=nccl_core, streams=_HostStreams())
    codes = {name: getattr(nccl_bindings.Result, name)
             for name in ("Success", "InProgress", "RemoteError")}
    for name in ("Success", "InProgress"):
        low.async_error = int(codes[name]) if form == "int" else codes[name]
        transport._check_async_error("allreduce#3 reduce step 1")
        assert transport._failure is None, name
    low.async_error = int(codes["RemoteError"]) if form == "int" else codes["RemoteError"]
    transport._check_async_error("allreduce#3 reduce step 1")
    failure = transport._failure
    assert isinstance(failure, PeerError), failure
    text = nccl_core.get_error_string(codes["RemoteError"])
    assert "allreduce#3 reduce step 1" in str(failure) and "RemoteError (6)" in str(failure)
    assert text in str(failure)
    assert transport._retirer is not None
    transport._retirer.join(10)
    with pytest.raises(PeerError):
        transport.exchange([(1, torch.ones(2))], [], what="allreduce#4 reduce step 0")
    transport.close()
    assert [c for c in low.calls if c[0] != "comm_get_async_error"] == [("comm_abort", handle)]


class _RecordingCommunicator:
    """Stands in for ``nccl.core.Communicator`` where a device is needed; ``init`` carries the
    real signature (test_nccl4py_fakes_match_nccl4py)."""

    inits: ClassVar[list[dict[str, Any]]] = []

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: Any,
             config: Any = None) -> _RecordingCommunicator:
        cls.inits.append({"nranks": nranks, "rank": rank, "unique_id": unique_id})
        return cls()

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        pass


@needs_nccl4py
def test_two_nccl4py_ranks_init_with_the_same_unique_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' ``nccl4py.init_transport`` (real nccl.core, real TCPStore) call
    ``Communicator.init`` by keyword with the same ``UniqueId`` (same 128 bytes, rebuilt with
    ``from_bytes`` on rank 1); only the communicator and the device selection are stubbed."""
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
    """``nccl`` resolves to nccl4py where it imports (else CuPy's); ``nccl4py`` and
    ``nccl-cupy`` are kept as asked; an unknown binding name lists the valid ones."""
    assert nccl_binding("nccl") == ("nccl4py" if nccl_core is not None else "nccl-cupy")
    assert nccl_binding("nccl4py") == "nccl4py"
    assert nccl_binding("nccl-cupy") == "nccl-cupy"
    with pytest.raises(dqcoll.errors.InvalidArgumentError, match="nccl-cupy"):
        nccl_binding("nccl5")


@requires_no_gpu
@pytest.mark.parametrize("backend", ["nccl", pytest.param("nccl4py", marks=needs_nccl4py),
                                     pytest.param("nccl-cupy", marks=needs_cupy)])
def test_each_backend_says_no_gpu(backend: str) -> None:
    """Without a GPU, ``dqcoll.init(backend=...)`` raises UnsupportedError naming the backend and
    saying no GPU is usable (from the real packages), before any rendezvous."""
    if nccl_binding(backend) == "nccl4py":
        expected = "torch sees no CUDA device"
    else:
        expected = "no CUDA GPU is usable" if cupy is not None else "CuPy is not importable"
    with pytest.raises(UnsupportedError, match="cannot run here") as info:
        dqcoll.init(backend=backend, rank=0, world_size=1)
    assert expected in str(info.value), info.value
    assert cupy_nccl.nccl_unavailable_reason() is not None
    assert nccl4py.nccl4py_unavailable_reason() is not None


# -- the transport on the host: both bindings over fakes of a joined communicator ------------------
#
# A joined communicator needs a GPU; these fakes carry NCCL's point-to-point semantics on the host
# instead (a receive completes when the matching send arrives, in order per pair; groupEnd waits
# for the group's receives, with a deadline) and the real libraries' signatures (compared in
# test_*_fakes_match_*). The transports, their bindings and everything above them are the real
# code.


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


class _FakeCupyModule:
    """``cupy.cuda.nccl``'s module-level parts the binding uses, over a :class:`_FakeNet`."""

    NCCL_UINT8 = 1

    def __init__(self, net: _FakeNet) -> None:
        self.net = net

    def groupStart(self) -> None:
        self.net.group_start()

    def groupEnd(self) -> None:
        self.net.group_end()


class _FakeCupyComm(_RecordingCupyComm):
    """A joined CuPy communicator on the host (signatures: _RecordingCupyComm's, checked)."""

    def __init__(self, net: _FakeNet, rank: int) -> None:
        super().__init__()
        self.net, self.rank = net, rank

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        assert datatype == _FakeCupyModule.NCCL_UINT8
        self.net.send(self.rank, peer, sendbuf, count)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        assert datatype == _FakeCupyModule.NCCL_UINT8
        self.net.recv(self.rank, peer, recvbuf, count)


class _FakeNccl4pyComm:
    """A joined nccl4py Communicator on the host (signatures and return types checked in
    test_nccl4py_fakes_match_nccl4py; ``get_async_error`` returns the real ``Result`` enum)."""

    def __init__(self, net: _FakeNet, rank: int) -> None:
        self.net, self.rank = net, rank
        self.destroyed = 0

    def send(self, sendbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.send(self.rank, peer, sendbuf.data_ptr(), sendbuf.numel())

    def recv(self, recvbuf: Any, peer: int, *, stream: Any = None) -> None:
        self.net.recv(self.rank, peer, recvbuf.data_ptr(), recvbuf.numel())

    def get_async_error(self) -> nccl_bindings.Result:
        return nccl_bindings.Result.Success

    def abort(self) -> None:
        pass

    def destroy(self) -> None:
        self.destroyed += 1


class _FakeCore:
    """``nccl.core``'s module-level functions the binding uses, over a :class:`_FakeNet`."""

    def __init__(self, net: _FakeNet) -> None:
        self.net = net

    def group_start(self) -> None:
        self.net.group_start()

    def group_end(self, *, simulate: bool = False) -> nccl_core.GroupSimInfo | None:
        assert not simulate
        self.net.group_end()
        return None

    @staticmethod
    def get_error_string(nccl_result: nccl_bindings.Result | int) -> str:
        return ""


class _HostEvent:
    def __init__(self, done: bool = True) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


class _HostStreams:
    """CudaStreams on the host: one "stream" (``handle``) whose work is done when posted, or
    never (``complete=False``)."""

    def __init__(self, complete: bool = True, handle: int = 0) -> None:
        self.complete, self.handle = complete, handle

    def current_handle(self) -> int:
        return self.handle

    def record(self) -> Any:
        return _HostEvent(self.complete)

    def scope(self) -> Any:
        return _NullContext()

    def bind_thread(self) -> None:
        pass


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


@pytest.mark.parametrize("binding", BINDINGS)
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
        assert all(t.comm.destroyed == 1 for t in transports)


# -- aborts: never under a call into the communicator, never blocking another thread ------------


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


def _cupy_transport(comm: Any, *, timeout_s: float, complete: bool = True) -> Any:
    return cupy_nccl.NcclTransport(
        comm, rank=0, world_size=2, device=torch.device("cpu"), timeout_s=timeout_s,
        nccl_module=_FakeCupyModule(_FakeNet()), streams=_HostStreams(complete=complete))


def _exchange(transport: Any, step: int) -> None:
    transport.exchange([(1, torch.zeros(64, dtype=torch.uint8))],
                       [(1, torch.empty(64, dtype=torch.uint8))],
                       what=f"allreduce#0 reduce step {step}")


def test_watchdog_abort_never_overlaps_a_post_and_close_joins_it() -> None:
    """A group that never completes times out while another thread keeps posting: the
    watchdog's abort runs between posts, never inside one, posts after it raise without touching
    the communicator, the caller's host wait raises the timeout naming the step, and close()
    joins the watchdog and destroys nothing (the abort freed the communicator)."""
    comm = _SlowComm()
    transport = _cupy_transport(comm, timeout_s=0.2, complete=False)
    comm.transport = transport
    errors: list[BaseException] = []

    def poster() -> None:
        deadline = time.monotonic() + 2.0
        step = 0
        while time.monotonic() < deadline:
            try:
                _exchange(transport, step)
            except BaseException as exc:
                errors.append(exc)
                return
            step += 1

    thread = threading.Thread(target=poster)
    thread.start()
    thread.join(timeout=10)
    assert errors and isinstance(errors[0], CollectiveTimeoutError), errors
    assert "allreduce#0 reduce step 0" in str(errors[0])
    transport._watchdog.join(timeout=5)  # it returns once it has had the communicator aborted
    assert transport._retirer is not None
    transport._retirer.join(timeout=5)
    assert transport.state == nccl_common.FREED
    aborts = [s for s in comm.spans if s[0] == "abort"]
    assert len(aborts) == 1
    at = aborts[0][1]
    inside = [s for s in comm.spans if s[0] != "abort" and s[1] < at < s[2]]
    assert not inside, inside
    assert not [s for s in comm.spans if s[0] != "abort" and s[1] > at]  # nothing posted after
    with pytest.raises(CollectiveTimeoutError):
        transport.synchronize()
    transport.close()
    assert not transport._watchdog.is_alive()
    assert comm.watchdog_alive_at_destroy is None  # aborted: never destroyed as well


class _BlockingAbortComm(_RecordingCupyComm):
    """A joined CuPy communicator whose abort blocks until the test releases it, as a one-sided
    ``ncclCommAbort`` can while the peer is gone; every call is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.in_abort = threading.Event()
        self.release = threading.Event()

    def abort(self) -> None:
        self.calls.append(("abort",))
        self.in_abort.set()
        self.release.wait(60)


class _BlockingSendComm(_RecordingCupyComm):
    """A joined CuPy communicator whose send blocks until the test releases it (a post stuck
    inside NCCL); calls are recorded with the time they ended."""

    def __init__(self) -> None:
        super().__init__()
        self.in_send = threading.Event()
        self.release = threading.Event()
        self.ended: list[tuple[str, float]] = []

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.in_send.set()
        self.release.wait(60)
        self.ended.append(("send", time.monotonic()))

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self.ended.append(("recv", time.monotonic()))

    def abort(self) -> None:
        self.ended.append(("abort", time.monotonic()))

    def destroy(self) -> None:
        self.ended.append(("destroy", time.monotonic()))


# how long a call may take while another thread's abort blocks (it needs microseconds)
PROMPT_S = 2.0


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``fn`` in a daemon thread (one that blocks for good must not hold up the test run);
    its result or exception lands in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("trigger", ["abort", "timeout"])
def test_a_blocking_abort_blocks_no_other_thread(trigger: str) -> None:
    """While the binding's abort blocks (a one-sided ncclCommAbort), every call of another thread
    returns within PROMPT_S without touching the communicator: abort() itself, exchange and
    synchronize raise the failure (CommAbortedError after abort(), the timeout naming the step
    after the watchdog's timeout), the asynchronous-error query returns without calling NCCL,
    and close() returns without destroying; once the abort returns, the communicator has been
    aborted exactly once and never destroyed."""
    comm = _BlockingAbortComm()
    timeout = trigger == "timeout"
    transport = _cupy_transport(comm, timeout_s=0.2 if timeout else 30.0, complete=not timeout)
    expected = CollectiveTimeoutError if timeout else CommAbortedError
    blocked: list[str] = []
    try:
        if timeout:
            _exchange(transport, 0)  # never completes: the watchdog times it out and aborts
        else:
            thread, _ = _in_thread(lambda: transport.abort("the test aborts"))
            thread.join(PROMPT_S)
            if thread.is_alive():
                blocked.append("abort()")
        assert comm.in_abort.wait(10), "the binding's abort was never called"
        before = list(comm.calls)
        probes: dict[str, Callable[[], Any]] = {
            "exchange": lambda: _exchange(transport, 1),
            "synchronize": transport.synchronize,
            "the asynchronous-error query": lambda: transport._check_async_error("probe"),
            "close": transport.close,
        }
        outcomes = {}
        for name, probe in probes.items():
            thread, out = _in_thread(probe)
            thread.join(PROMPT_S)
            if thread.is_alive():
                blocked.append(name)
            outcomes[name] = out
        assert not blocked, f"blocked while ncclCommAbort blocked: {blocked}"
        for name in ("exchange", "synchronize"):
            assert isinstance(outcomes[name].get("error"), expected), (name, outcomes[name])
        if timeout:
            assert "allreduce#0 reduce step 0" in str(outcomes["exchange"]["error"])
        for name in ("the asynchronous-error query", "close"):
            assert "error" not in outcomes[name], (name, outcomes[name])
        assert comm.calls == before  # no call reached the communicator meanwhile
        assert transport.state == nccl_common.ABORTING
    finally:
        comm.release.set()
    assert transport._retirer is not None
    transport._retirer.join(10)
    assert transport.state == nccl_common.FREED
    assert comm.calls.count(("abort",)) == 1 and ("destroy",) not in comm.calls
    assert not transport._watchdog.is_alive()


def test_abort_waits_for_the_post_in_flight_and_releases_the_waiting_ones() -> None:
    """One thread's post is inside NCCL (its send blocks) and a second thread waits to post:
    abort() returns at once, the waiting post raises CommAbortedError at once without reaching
    the communicator, and the binding's abort runs only once the post in flight has left NCCL
    (the bindings free the communicator inside abort), exactly once; close() destroys nothing."""
    comm = _BlockingSendComm()
    transport = _cupy_transport(comm, timeout_s=30.0)
    first, first_out = _in_thread(lambda: _exchange(transport, 0))
    try:
        assert comm.in_send.wait(10)
        second, second_out = _in_thread(lambda: _exchange(transport, 1))
        time.sleep(0.1)  # it waits for the post in flight
        aborter, _ = _in_thread(lambda: transport.abort("the test aborts"))
        aborter.join(PROMPT_S)
        assert not aborter.is_alive(), "abort() waited for the post in flight"
        second.join(PROMPT_S)
        assert not second.is_alive(), "a waiting post still waits after the abort"
        assert isinstance(second_out.get("error"), CommAbortedError), second_out
        assert comm.ended == []  # nothing has left NCCL, and nothing was aborted under the send
    finally:
        comm.release.set()
    first.join(10)
    assert isinstance(first_out.get("error"), CommAbortedError), first_out
    assert transport._retirer is not None
    transport._retirer.join(10)
    names = [name for name, _ in comm.ended]
    assert names == ["send", "recv", "abort"], names  # one group, then the abort, once
    transport.close()
    assert [name for name, _ in comm.ended] == names  # closed after the abort: no destroy


def test_close_then_abort_frees_the_communicator_once() -> None:
    """close() destroys the communicator once; an abort() after it records the reason for later
    calls (CommAbortedError) without aborting what is already freed, and a second close() does
    nothing."""
    comm = _RecordingCupyComm()
    transport = _cupy_transport(comm, timeout_s=30.0)
    _exchange(transport, 0)
    transport.close()
    transport.abort("after close")
    transport.close()
    with pytest.raises(CommAbortedError):
        _exchange(transport, 1)
    assert [c[0] for c in comm.calls] == ["send", "recv", "destroy"]
    assert transport.state == nccl_common.FREED


@pytest.mark.parametrize("binding", BINDINGS)
def test_a_failing_communicator_init_names_the_rank(binding: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real constructor, handed the real id, fails for want of a GPU (NCCL's "unhandled
    cuda error"): init_transport raises CommAbortedError naming the rank, the binding and the
    device, not the library's bare error. Only the device selection is stubbed."""
    if not _no_gpu():
        pytest.skip("a GPU is present: the constructor would succeed")
    _stub_device_selection(monkeypatch)
    if binding == "nccl-cupy":
        monkeypatch.setattr(cupy_nccl, "_import_nccl", lambda: cupy_nccl_module)
        module: Any = cupy_nccl
    else:
        monkeypatch.setattr(nccl4py, "_import_core", lambda: nccl_core)
        module = nccl4py
    with pytest.raises(CommAbortedError,
                       match=r"rank 0 of 1: ncclCommInitRank through (CuPy|nccl4py) on cuda:0"):
        module.init_transport(rank=0, world_size=1, master_addr="127.0.0.1",
                              master_port=rendezvous_port(), timeout_s=10)


# -- every fake against what it replaces -----------------------------------------------------------


def _own_methods(cls: type) -> list[str]:
    """The public methods of ``cls`` (its own and those it inherits from another fake)."""
    return [name for name in dir(cls) if not name.startswith("_")
            and callable(getattr(cls, name)) and not isinstance(getattr(cls, name), type)]


@needs_cupy
def test_cupy_fakes_match_cupy() -> None:
    """Each fake of CuPy has the real CuPy's surface: the communicator stand-ins
    (_RecordingCupyComm, _FakeCupyComm, _SlowComm, _BlockingAbortComm, _BlockingSendComm) have
    NcclCommunicator's constructor and methods, parameter names in order with the Python types
    of their C types (CuPy's embedded Cython signatures); _FakeCupyModule has the module's
    ``groupStart``/``groupEnd`` and ``NCCL_UINT8`` (value and type)."""
    real = cupy_nccl_module.NcclCommunicator
    _check_against_cython(_RecordingCupyComm, real)  # the constructor's signature line
    for fake in (_RecordingCupyComm, _FakeCupyComm, _SlowComm, _BlockingAbortComm,
                 _BlockingSendComm):
        methods = _own_methods(fake)
        assert {"send", "recv", "check_async_error", "abort", "destroy"} <= set(methods), fake
        for name in methods:
            assert hasattr(real, name), f"{fake.__name__}.{name}: CuPy has no such method"
            _check_against_cython(getattr(fake, name), getattr(real, name))
    module = _FakeCupyModule(_FakeNet())
    for name in _own_methods(_FakeCupyModule):
        _check_against_cython(getattr(module, name), getattr(cupy_nccl_module, name))
    assert type(_FakeCupyModule.NCCL_UINT8) is type(cupy_nccl_module.NCCL_UINT8)
    assert _FakeCupyModule.NCCL_UINT8 == cupy_nccl_module.NCCL_UINT8


def test_cupy13_fake_matches_cupy_13() -> None:
    """_Cupy13 has CuPy 13's surface: the constructor's signature line, and ``get_unique_id``
    giving a tuple of 128 ints (checked where CuPy 13 is the installed version)."""
    if cupy_nccl_module is None:
        pytest.skip(f"CuPy's NCCL bindings do not import ({_cupy_nccl_reason})")
    if not cupy.__version__.startswith("13."):
        pytest.skip(f"CuPy {cupy.__version__} is installed; this fake is of CuPy 13")
    real = cupy_nccl_module
    assert _doc_signature(real.NcclCommunicator).startswith(
        _doc_signature(_Cupy13.NcclCommunicator).rstrip(")"))
    made = real.get_unique_id()
    assert isinstance(made, tuple) and len(made) == 128 and all(isinstance(v, int) for v in made)


@needs_nccl4py
def test_nccl4py_fakes_match_nccl4py() -> None:
    """Each fake of nccl4py has the real package's surface: _FakeNccl4pyComm and
    _RecordingCommunicator have ``nccl.core.Communicator``'s methods (names, parameter kinds and
    defaults, the types nccl4py annotates, return types: ``get_async_error`` the ``Result``
    enum, ``init`` the communicator class); _FakeCore has ``nccl.core``'s ``group_start``,
    ``group_end`` and ``get_error_string``; _LowLevelNccl has ``nccl.bindings.nccl``'s C calls
    (Cython signatures, ``comm_get_async_error`` an ``int``) and its ``Comm``."""
    communicator = nccl_core.Communicator
    for fake in (_FakeNccl4pyComm, _RecordingCommunicator):
        for name in _own_methods(fake):
            assert hasattr(communicator, name), f"{fake.__name__}.{name}: no such method"
            stand_ins = {communicator: fake}
            _check_against_python(getattr(fake, name), getattr(communicator, name), stand_ins)
    assert _hints(_FakeNccl4pyComm.get_async_error)["return"] is nccl_bindings.Result
    assert isinstance(_FakeNccl4pyComm(_FakeNet(), 0).get_async_error(), nccl_bindings.Result)
    core = _FakeCore(_FakeNet())
    for name in _own_methods(_FakeCore):
        _check_against_python(getattr(core, name), getattr(nccl_core, name))
    low = _LowLevelNccl()
    for name in _own_methods(_LowLevelNccl):
        _check_against_cython(getattr(low, name), getattr(nccl_bindings, name))
    assert low.Comm is nccl_bindings.Comm


def test_torch_fakes_match_torch() -> None:
    """_HostStreams has the transport's CudaStreams methods (same signatures, annotations
    included) and _HostEvent.query torch.cuda.Event.query's parameters."""
    for name in _own_methods(nccl_common.CudaStreams):
        assert inspect.signature(getattr(_HostStreams, name)) == inspect.signature(
            getattr(nccl_common.CudaStreams, name)), name
    assert set(_own_methods(_HostStreams)) == set(_own_methods(nccl_common.CudaStreams))
    _check_against_python(_HostEvent.query, torch.cuda.Event.query)
