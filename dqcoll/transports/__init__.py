"""Transports and their registry: ``local`` (threads), ``torch`` (a torch.distributed group),
``nccl`` (NCCL itself: nccl4py where it imports, else CuPy's bindings), ``nccl4py`` and
``nccl-cupy`` (either binding by name)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .base import Counters, Transport, ring_allreduce_nbytes
from .local import LocalHub

__all__ = ["Counters", "Transport", "TransportSpec", "get", "init_nccl", "list_transports",
           "nccl_binding", "register_transport", "ring_allreduce_nbytes"]


@dataclasses.dataclass(frozen=True)
class TransportSpec:
    name: str
    factory: Callable[..., Transport]
    description: str
    devices: tuple[str, ...]  # device types the transport moves tensors of


_REGISTRY: dict[str, TransportSpec] = {}


def register_transport(spec: TransportSpec) -> TransportSpec:
    if spec.name in _REGISTRY:
        raise InvalidArgumentError(f"transport {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> TransportSpec:
    if name not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown transport {name!r}; registered transports: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_transports() -> list[str]:
    return sorted(_REGISTRY)


def _torch_factory(group: Any = None, **kwargs: Any) -> Transport:
    from .torch_dist import TorchTransport

    return TorchTransport(group, **kwargs)


def nccl_binding(requested: str = "nccl") -> str:
    """The NCCL binding ``requested`` names: ``nccl4py`` or ``nccl-cupy``, or for ``nccl``
    nccl4py where it imports, else CuPy's (an explicit name is never swapped)."""
    if requested in ("nccl4py", "nccl-cupy"):
        return requested
    if requested != "nccl":
        raise InvalidArgumentError(
            f"unknown NCCL binding {requested!r}; expected 'nccl', 'nccl4py' or 'nccl-cupy'")
    from .nccl4py import nccl4py_importable

    return "nccl4py" if nccl4py_importable() is None else "nccl-cupy"


def init_nccl(requested: str = "nccl", **kwargs: Any) -> Transport:
    """The NCCL transport of ``requested`` (see :func:`nccl_binding`); every rank calls it."""
    if nccl_binding(requested) == "nccl4py":
        from . import nccl4py

        return nccl4py.init_transport(**kwargs)
    from . import cupy_nccl

    return cupy_nccl.init_transport(**kwargs)


register_transport(TransportSpec("local", LocalHub.transport, "ranks as threads in one process",
                                 ("cpu", "cuda")))
register_transport(TransportSpec("torch", _torch_factory,
                                 "an existing torch.distributed group (gloo, nccl)",
                                 ("cpu", "cuda")))
for _name, _text in (("nccl", "NCCL: nccl4py where importable, else CuPy's bindings"),
                     ("nccl4py", "NCCL through nccl4py"),
                     ("nccl-cupy", "NCCL through CuPy's bindings")):
    register_transport(TransportSpec(_name, functools.partial(init_nccl, _name),
                                     f"{_text} (one GPU per process)", ("cuda",)))
