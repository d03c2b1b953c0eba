"""The ``nccl4py`` transport: NVIDIA's official NCCL bindings (``nccl.core``, pip ``nccl4py``).

``backend="nccl"`` prefers this transport where nccl4py imports and falls back to CuPy's
(:mod:`.cupy_nccl`); ``backend="nccl4py"`` asks for it. Rendezvous, streams, the deterministic
small all-reduce, the watchdog with its timeouts and abort, and the states that keep every call
into the communicator off its abort and destroy are those of :mod:`.nccl_common`; this module is
the binding:

* the id is ``nccl.core.get_unique_id()``; its 128 bytes (``UniqueId.as_bytes``, a *property*)
  travel over the store and ``UniqueId.from_bytes`` rebuilds it on the other ranks;
* ``Communicator.init(nranks=, rank=, unique_id=)`` under the rank's device;
* ``send(buf, peer, stream=)`` / ``recv`` take the torch tensor itself (DLPack), viewed as bytes,
  between ``group_start()`` and ``group_end()``; ``stream`` is the raw ``cudaStream_t``;
* ``get_async_error()`` returns the communicator's state as ``nccl.bindings.nccl.Result``, an
  ``IntEnum`` (its annotation; the low-level ``comm_get_async_error`` it wraps documents a plain
  ``int``): :meth:`Nccl4pyBinding.check_async_error` reads either through ``int()``, with
  ``Result.Success`` (0) and ``Result.InProgress`` (7, a non-blocking call still running) no
  error; ``abort()`` and ``destroy()`` as in C.

Install with ``pip install "nccl4py[cu12]"`` (or ``[cu13]``): plain ``nccl4py`` does not pull
``cuda-bindings`` and then fails to import. Contract-tested on CPU against the real package
(tests/test_nccl_contract.py): signatures, the id round trip, enum values, the no-GPU error, and
``send``/``recv`` through the real ``Communicator`` and ``NcclBuffer`` down to the C call.

Rejected: ``Communicator.allreduce`` for the statistics (NCCL's reduction order differs from
the other transports', see :mod:`.nccl_common`), and ``shrink``/``grow`` for fault tolerance
(dqcoll's rule after an error is a new communicator, as NCCL's is without them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from .. import envs
from ..errors import CommAbortedError, UnsupportedError
from .nccl_common import StreamOrderedNcclTransport, exchange_unique_id, plan_rendezvous

__all__ = ["Nccl4pyBinding", "Nccl4pyTransport", "init_transport", "nccl4py_unavailable_reason"]

# ncclResult_t values get_async_error may return without an error (nccl.h; Result.Success and
# Result.InProgress in nccl.bindings.nccl).
_NCCL_SUCCESS = 0
_NCCL_IN_PROGRESS = 7


def result_name(code: int) -> str:
    """The name nccl4py gives the ncclResult_t ``code`` (``RemoteError``), or ``ncclResult <code>``
    for a code its ``Result`` enum does not list."""
    try:
        from nccl.bindings import nccl as bindings

        return str(bindings.Result(code).name)
    except Exception:  # an unknown code, or no bindings: the number says it
        return f"ncclResult {code}"


def _import_core() -> Any:
    """``nccl.core``; raises UnsupportedError saying what is missing."""
    reason = nccl4py_unavailable_reason()
    if reason is not None:
        raise UnsupportedError(f"backend='nccl4py' cannot run here: {reason}")
    import nccl.core

    return nccl.core


def nccl4py_importable() -> str | None:
    """None when ``nccl.core`` imports, else why not (no GPU needed for this)."""
    try:
        import nccl.core  # noqa: F401
    except Exception as exc:  # ImportError, or cuda.bindings missing (plain `pip install nccl4py`)
        return (f"nccl4py is not importable ({exc.__class__.__name__}: {exc}); install "
                f"'nccl4py[cu12]' or 'nccl4py[cu13]' (with cuda-bindings and the NCCL wheel)")
    return None


def nccl4py_unavailable_reason() -> str | None:
    """None when the nccl4py transport can run in this process, else why it cannot."""
    reason = nccl4py_importable()
    if reason is not None:
        return reason
    if not torch.cuda.is_available():
        return ("torch sees no CUDA device (no GPU, no driver, or a CPU build of torch); "
                "dqcoll moves torch tensors")
    return None


class Nccl4pyBinding:
    """:class:`~.nccl_common.NcclBinding` over ``nccl.core.Communicator``."""

    name = "nccl4py"

    def __init__(self, comm: Any, core: Any) -> None:
        self.comm = comm
        self.core = core

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.core.group_start()
        try:
            yield
        finally:
            self.core.group_end()

    def send(self, tensor: torch.Tensor, peer: int, stream: int) -> None:
        self.comm.send(tensor, peer, stream=stream)

    def recv(self, tensor: torch.Tensor, peer: int, stream: int) -> None:
        self.comm.recv(tensor, peer, stream=stream)

    def check_async_error(self) -> None:
        """Raise RuntimeError naming the code when the communicator's state is an error; the
        state is a ``Result`` or a plain ``int`` (see the module docstring)."""
        code = int(self.comm.get_async_error())
        if code not in (_NCCL_SUCCESS, _NCCL_IN_PROGRESS):
            try:
                text = self.core.get_error_string(code)
            except Exception:  # the description is a courtesy
                text = ""
            raise RuntimeError(
                f"ncclCommGetAsyncError: {result_name(code)} ({code}) {text}".rstrip())

    def abort(self) -> None:
        self.comm.abort()

    def destroy(self) -> None:
        self.comm.destroy()


class Nccl4pyTransport(StreamOrderedNcclTransport):
    """The stream-ordered NCCL transport over nccl4py."""

    def __init__(self, comm: Any, *, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, store: Any = None, core: Any = None,
                 streams: Any = None) -> None:
        core = core if core is not None else _import_core()
        super().__init__(Nccl4pyBinding(comm, core), rank=rank, world_size=world_size,
                         device=device, timeout_s=timeout_s, store=store, streams=streams,
                         name="nccl4py")
        self.comm = comm


def unique_id_bytes(core: Any) -> bytes:
    """A fresh unique id as its 128 bytes (``as_bytes`` is a property)."""
    return bytes(core.get_unique_id().as_bytes)


def create_communicator(core: Any, world_size: int, unique_id: bytes, rank: int,
                        device: torch.device) -> Any:
    """``Communicator.init`` (ncclCommInitRank) on ``device`` from the id's bytes."""
    with torch.cuda.device(device):
        return core.Communicator.init(nranks=world_size, rank=rank,
                                      unique_id=core.UniqueId.from_bytes(unique_id))


def init_transport(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    store: Any = None,
) -> Nccl4pyTransport:
    """Create this process's nccl4py communicator (collective: every rank must call it);
    arguments as :func:`dqcoll.transports.cupy_nccl.init_transport`."""
    core = _import_core()
    timeout = envs.timeout_s() if timeout_s is None else float(timeout_s)
    plan = plan_rendezvous(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout, device=device,
                           store=store)
    unique_id = exchange_unique_id(lambda: unique_id_bytes(core), plan.store, plan.rank,
                                   plan.key, timeout)
    try:
        comm = create_communicator(core, plan.world_size, unique_id, plan.rank, plan.device)
    except Exception as exc:  # NCCL could not start (library, driver, network)
        raise CommAbortedError(
            f"rank {plan.rank} of {plan.world_size}: ncclCommInitRank through nccl4py on "
            f"{plan.device} failed: {type(exc).__name__}: {exc}") from exc
    return Nccl4pyTransport(comm, rank=plan.rank, world_size=plan.world_size,
                            device=plan.device, timeout_s=timeout, store=plan.store, core=core)
