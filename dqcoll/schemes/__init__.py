"""Compression schemes and their registry: ``get("dynamiq", bits=5)`` returns a configured
scheme, ``list_schemes()`` names them, ``spec(name)`` describes one without building it. A scheme
registers itself with :func:`register_scheme` (docs/design.md §5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgumentError
from .base import CallContext, Scheme, SchemeCall, SchemeSpec

__all__ = [
    "CallContext",
    "Scheme",
    "SchemeCall",
    "SchemeEntry",
    "SchemeSpec",
    "get",
    "list_schemes",
    "register_scheme",
    "spec",
]


@dataclasses.dataclass(frozen=True)
class SchemeEntry:
    spec: SchemeSpec
    factory: Callable[..., Scheme]


_REGISTRY: dict[str, SchemeEntry] = {}


def register_scheme(spec: SchemeSpec, factory: Callable[..., Scheme]) -> None:
    if spec.name in _REGISTRY:
        raise InvalidArgumentError(f"scheme {spec.name!r} is already registered")
    _REGISTRY[spec.name] = SchemeEntry(spec, factory)


def _entry(name: str) -> SchemeEntry:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown scheme {name!r}; registered schemes: {sorted(_REGISTRY)}"
        )
    return _REGISTRY[name]


def spec(name: str) -> SchemeSpec:
    return _entry(name).spec


def get(name: str, **options: Any) -> Scheme:
    """A configured scheme. Unknown options raise and list the accepted ones."""
    entry = _entry(name)
    unknown = sorted(set(options) - set(entry.spec.options))
    if unknown:
        raise InvalidArgumentError(
            f"scheme {name!r} does not take {unknown}; its options are {list(entry.spec.options)}"
        )
    return entry.factory(**options)


def list_schemes() -> list[str]:
    return sorted(_REGISTRY)


def _register_builtin() -> None:
    from .bf16 import BF16Scheme
    from .dynamiq import DynamiqScheme
    from .global_qsgd import GlobalQSGDScheme
    from .int_block import Int4BlockScheme, Int8BlockScheme
    from .mx import MXFP4Scheme, MXFP6Scheme, MXFP8Scheme
    from .none import NoneScheme
    from .thc import THCScheme
    from .topk_block import TopKBlockScheme

    for scheme in (NoneScheme, DynamiqScheme, BF16Scheme, MXFP8Scheme, MXFP6Scheme, MXFP4Scheme,
                   Int8BlockScheme, Int4BlockScheme, THCScheme, GlobalQSGDScheme, TopKBlockScheme):
        register_scheme(scheme.spec, scheme)  # type: ignore[arg-type]


_register_builtin()
