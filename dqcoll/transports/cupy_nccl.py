"""The ``nccl-cupy`` transport: CuPy's NCCL bindings (``cupy.cuda.nccl.NcclCommunicator``).

For jobs that want dqcoll's quantized collectives on GPUs without a ``torch.distributed`` NCCL
process group (or beside one: the communicators are independent). One process per GPU, as
torchrun starts them. ``backend="nccl"`` takes nccl4py (:mod:`.nccl4py`) where it is importable
and this one otherwise; ``backend="nccl-cupy"`` asks for this one. Rendezvous, streams, the small
all-reduce, the watchdog, the abort and the communicator's states are those of
:mod:`.nccl_common`.

**CuPy versions.** CuPy 14 (``get_unique_id()`` returns 128 ``bytes``; the constructor is
``NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)``) and CuPy 13 (a
tuple of 128 signed ints both ways) both work: the id travels as bytes and
:func:`unique_id_argument` converts it to the form the installed CuPy's constructor takes, read
off its signature. Contract-tested against the real CuPy 14 on CPU (tests/test_nccl_contract.py);
CuPy 13.6 checked by hand on CPU (docs/gpu_transport.md). Older CuPy documenting the same tuple
signature takes the CuPy 13 path untested; one whose signature says neither is refused.

The module imports without CuPy; :func:`nccl_unavailable_reason` says why NCCL cannot run here and
:func:`init_transport` raises :class:`~dqcoll.errors.UnsupportedError` with that reason.

Rejected: ``cupyx.distributed.NCCLBackend``. It wraps the same communicator but owns the store
and its own stream choice, and does its point-to-point calls one by one rather than in a group.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import torch

from .. import envs
from ..errors import CommAbortedError, UnsupportedError
from .nccl_common import (
    UNIQUE_ID_NBYTES,
    StreamOrderedNcclTransport,
    exchange_unique_id,
    plan_rendezvous,
)

__all__ = [
    "CupyBinding",
    "NcclTransport",
    "init_transport",
    "nccl_unavailable_reason",
    "supports_nccl",
    "unique_id_argument",
]


def _import_nccl() -> Any:
    """CuPy's NCCL module; raises UnsupportedError saying what is missing."""
    reason = nccl_unavailable_reason()
    if reason is not None:
        raise UnsupportedError(f"backend='nccl' cannot run here: {reason}")
    from cupy.cuda import nccl

    return nccl


def nccl_unavailable_reason() -> str | None:
    """None when the NCCL transport can run in this process, else why it cannot."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CuPy that does not match the CUDA driver
        return (
            f"CuPy is not importable ({exc.__class__.__name__}: {exc}); install "
            "'dqcoll[cuda12]' or 'dqcoll[cuda13]' (CuPy and the NCCL wheel for your CUDA)"
        )
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CuPy imports fine on machines without a driver or a GPU
        return f"no CUDA GPU is usable ({exc.__class__.__name__}: {exc})"
    if count < 1:
        return "no CUDA GPU is visible (cupy.cuda.runtime.getDeviceCount() == 0)"
    try:
        from cupy.cuda import nccl
    except Exception as exc:
        return f"CuPy has no NCCL bindings ({exc.__class__.__name__}: {exc})"
    if not getattr(nccl, "available", False):
        return (
            "CuPy cannot load NCCL (cupy.cuda.nccl.available is False); install the NCCL wheel "
            "matching CuPy's CUDA (nvidia-nccl-cu12 / nvidia-nccl-cu13)"
        )
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (a CPU build of torch?); dqcoll moves torch tensors"
    return None


def supports_nccl() -> bool:
    return nccl_unavailable_reason() is None


# -- the binding ------------------------------------------------------------------------------


def _constructor_takes_bytes(nccl: Any) -> bool:
    """Whether this CuPy's ``NcclCommunicator`` takes the id as ``bytes`` (CuPy >= 14) or as a
    tuple of signed ints (CuPy 13), from the signature its docstring states (Cython
    ``embedsignature``; ``inspect.signature`` cannot read it)."""
    doc = (getattr(nccl.NcclCommunicator, "__doc__", None) or "").strip().splitlines()
    first = doc[0] if doc else ""
    if "bytes commId" in first:
        return True
    if "tuple commId" in first:
        return False
    import cupy  # no signature in the docstring: go by the version that changed it

    major = int(str(getattr(cupy, "__version__", "0")).split(".")[0] or 0)
    if major >= 14:
        return True
    if major == 13:
        return False
    raise UnsupportedError(
        f"CuPy {getattr(cupy, '__version__', '?')}: its NcclCommunicator has an unknown "
        f"signature {first!r}; dqcoll supports CuPy 13 (tuple commId) and 14 (bytes commId)")


def unique_id_argument(nccl: Any, unique_id: bytes) -> bytes | tuple[int, ...]:
    """The 128 id bytes in the form ``nccl.NcclCommunicator`` takes (see the module docstring)."""
    if _constructor_takes_bytes(nccl):
        return bytes(unique_id)
    return tuple(struct.unpack(f"{UNIQUE_ID_NBYTES}b", unique_id))  # CuPy 13: signed chars


def unique_id_bytes(nccl: Any) -> bytes:
    """A fresh unique id as 128 bytes, from CuPy 14's bytes or CuPy 13's signed ints."""
    made = nccl.get_unique_id()
    if isinstance(made, bytes):
        return made
    return struct.pack(f"{len(made)}b", *made)


class CupyBinding:
    """:class:`~.nccl_common.NcclBinding` over ``cupy.cuda.nccl``: raw pointers and byte
    counts (``NCCL_UINT8``), on an explicit ``cudaStream_t``."""

    name = "nccl-cupy"

    def __init__(self, comm: Any, nccl: Any) -> None:
        self.comm = comm
        self.nccl = nccl

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.nccl.groupStart()
        try:
            yield
        finally:
            self.nccl.groupEnd()

    def send(self, tensor: torch.Tensor, peer: int, stream: int) -> None:
        self.comm.send(tensor.data_ptr(), tensor.numel(), self.nccl.NCCL_UINT8, peer, stream)

    def recv(self, tensor: torch.Tensor, peer: int, stream: int) -> None:
        self.comm.recv(tensor.data_ptr(), tensor.numel(), self.nccl.NCCL_UINT8, peer, stream)

    def check_async_error(self) -> None:
        self.comm.check_async_error()  # raises NcclError

    def abort(self) -> None:
        self.comm.abort()

    def destroy(self) -> None:
        self.comm.destroy()


# -- the transport ----------------------------------------------------------------------------


class NcclTransport(StreamOrderedNcclTransport):
    """The stream-ordered NCCL transport over CuPy's bindings."""

    def __init__(self, comm: Any, *, rank: int, world_size: int, device: torch.device,
                 timeout_s: float, store: Any = None, nccl_module: Any = None,
                 streams: Any = None) -> None:
        nccl = nccl_module if nccl_module is not None else _import_nccl()
        super().__init__(CupyBinding(comm, nccl), rank=rank, world_size=world_size,
                         device=device, timeout_s=timeout_s, store=store, streams=streams,
                         name="nccl-cupy")
        self.comm = comm


def create_communicator(nccl: Any, world_size: int, unique_id: bytes, rank: int,
                        device: torch.device) -> Any:
    """``NcclCommunicator(ndev, commId, rank)`` on ``device`` (ncclCommInitRank)."""
    import cupy

    with cupy.cuda.Device(device.index):
        return nccl.NcclCommunicator(world_size, unique_id_argument(nccl, unique_id), rank)


def init_transport(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float | None = None,
    device: torch.device | str | int | None = None,
    store: Any = None,
) -> NcclTransport:
    """Create the NCCL communicator of this process (collective: every rank must call it).

    Arguments default to the torchrun variables; ``device`` to ``cuda:LOCAL_RANK``; ``store`` to
    the store chosen as described in :mod:`.nccl_common`. Raises UnsupportedError where NCCL
    cannot run (no CuPy, no GPU, no NCCL library).
    """
    nccl = _import_nccl()
    timeout = envs.timeout_s() if timeout_s is None else float(timeout_s)
    plan = plan_rendezvous(rank=rank, world_size=world_size, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout, device=device,
                           store=store)
    unique_id = exchange_unique_id(lambda: unique_id_bytes(nccl), plan.store, plan.rank,
                                   plan.key, timeout)
    try:
        comm = create_communicator(nccl, plan.world_size, unique_id, plan.rank, plan.device)
    except Exception as exc:  # NCCL could not start (library, driver, network)
        raise CommAbortedError(
            f"rank {plan.rank} of {plan.world_size}: ncclCommInitRank through CuPy on "
            f"{plan.device} failed: {type(exc).__name__}: {exc}") from exc
    return NcclTransport(comm, rank=plan.rank, world_size=plan.world_size, device=plan.device,
                         timeout_s=timeout, store=plan.store, nccl_module=nccl)
