"""Transports and their registry: ``local`` (threads), ``torch`` (a torch.distributed group),
``nccl`` (CuPy's NCCL bindings)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .base import Counters, Transport, ring_allreduce_nbytes

__all__ = [
    "Counters",
    "Transport",
    "TransportSpec",
    "get",
    "list_transports",
    "register_transport",
    "ring_allreduce_nbytes",
]


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
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown transport {name!r}; registered transports: {sorted(_REGISTRY)}"
        ) from None


def list_transports() -> list[str]:
    return sorted(_REGISTRY)


def _local_factory(hub: Any, rank: int) -> Transport:
    return hub.transport(rank)  # type: ignore[no-any-return]


def _torch_factory(group: Any = None, **kwargs: Any) -> Transport:
    from .torch_dist import TorchTransport

    return TorchTransport(group, **kwargs)


def _nccl_factory(**kwargs: Any) -> Transport:
    from .cupy_nccl import init_transport

    return init_transport(**kwargs)


register_transport(TransportSpec("local", _local_factory, "ranks as threads in one process",
                                 ("cpu", "cuda")))
register_transport(TransportSpec("torch", _torch_factory,
                                 "an existing torch.distributed group (gloo, nccl)",
                                 ("cpu", "cuda")))
register_transport(TransportSpec("nccl", _nccl_factory,
                                 "CuPy's NCCL bindings (one GPU per process)", ("cuda",)))
