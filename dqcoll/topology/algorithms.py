"""Schedule builders and their registry (:func:`build_schedule`, :func:`register_algorithm`).

Every builder's schedule reduces chunk ``c`` onto rank ``c`` (each one's shape: its registration's
description); builders know rank numbers only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from ..errors import InvalidArgumentError
from .schedule import Schedule, assign_roles

__all__ = [
    "AlgorithmSpec",
    "build_butterfly_schedule",
    "build_direct_schedule",
    "build_ring_schedule",
    "build_schedule",
    "get",
    "list_algorithms",
    "register_algorithm",
]


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """A schedule builder (any world size >= 1)."""

    name: str
    build: Callable[[int], Schedule]
    description: str

    def supports(self, world_size: int) -> bool:
        return world_size >= 1


_REGISTRY: dict[str, AlgorithmSpec] = {}


def register_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    if spec.name in _REGISTRY:
        raise InvalidArgumentError(f"algorithm {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def get(name: str) -> AlgorithmSpec:
    if name not in _REGISTRY:
        raise InvalidArgumentError(
            f"unknown algorithm {name!r}; registered algorithms: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_algorithms() -> list[str]:
    return sorted(_REGISTRY)


def build_schedule(name: str, world_size: int) -> Schedule:
    """The schedule of algorithm ``name`` for ``world_size`` ranks (cached)."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"algorithm must be a name, got {name!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(f"world_size must be a positive int, got {world_size!r}")
    return _build(get(name), world_size)


@functools.lru_cache(maxsize=32)  # bounded: a schedule grows as n**2
def _build(spec: AlgorithmSpec, world_size: int) -> Schedule:
    return spec.build(world_size)


def build_ring_schedule(world_size: int) -> Schedule:
    n = world_size
    # Reduce step t: rank r sends chunk (r - 1 - t) mod n to r + 1.
    reduce = [[(r, (r + 1) % n, (r - 1 - t) % n) for r in range(n)] for t in range(n - 1)]
    # Gather step t: rank r forwards chunk (r - t) mod n to r + 1.
    gather = [[(r, (r + 1) % n, (r - t) % n) for r in range(n)] for t in range(n - 1)]
    return assign_roles("ring", n, reduce, gather)


def build_butterfly_schedule(world_size: int) -> Schedule:
    n = world_size
    levels = (n - 1).bit_length()  # ceil(log2 n) for n >= 1
    reduce: list[list[tuple[int, int, int]]] = [[] for _ in range(levels)]
    gather: list[list[tuple[int, int, int]]] = [[] for _ in range(levels)]
    for chunk in range(n):
        for v in range(1, n):
            k = (v & -v).bit_length() - 1  # v's lowest set bit
            src = (chunk + v) % n
            dst = (chunk + v - (1 << k)) % n
            reduce[k].append((src, dst, chunk))
            # The out-tree mirrors the in-tree: the highest levels fan out first.
            gather[levels - 1 - k].append((dst, src, chunk))
    return assign_roles("butterfly", n, reduce, gather)


def build_direct_schedule(world_size: int) -> Schedule:
    n = world_size
    reduce = [[(r, c, c) for c in range(n) for r in range(n) if r != c]]
    gather = [[(c, r, c) for c in range(n) for r in range(n) if r != c]]
    return assign_roles("direct", n, reduce, gather)


for _spec in (
    AlgorithmSpec("ring", build_ring_schedule,
                  "path c+1 -> ... -> c; bandwidth-optimal, depth n-1"),
    AlgorithmSpec("butterfly", build_butterfly_schedule,
                  "binomial in-trees shifted per chunk; ring's bytes, depth ceil(log2 n)"),
    AlgorithmSpec("direct", build_direct_schedule,
                  "two-shot: every chunk straight to its sink and back; depth 1"),
):
    register_algorithm(_spec)
