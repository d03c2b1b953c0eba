"""The scheme protocol: how a compression scheme plugs into the executor (docs/design.md §1, §5).

:meth:`Scheme.begin` makes a :class:`SchemeCall` per collective call (statistics only through
``ctx.reduce``, never a transport). Its fp32 ``work`` is cut into chunks by ``chunk_bounds``; the
executor calls ``compress(chunk, count=1)`` at a leaf, ``decompress_accumulate`` per non-last
child, ``decompress_accumulate_recompress`` for the last (at the sink then ``decompress`` of its
own output), ``decompress`` on an all-gather receive and ``finish(out)`` at the end. ``count``:
the ranks a payload sums; payloads are flat ``uint8`` of ``payload_nbytes`` bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..types import Collective, ReduceOp

__all__ = ["FLOAT_DTYPES", "CallContext", "Reducer", "ScheduleShape", "Scheme", "SchemeCall",
           "SchemeSpec", "no_reduce"]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
    """What a scheme can do, declared once next to its implementation."""

    name: str
    description: str
    # Wire bits per coordinate (codes + scales + statistics); None when set by the ``bits`` option.
    bits_per_coord: float | None
    unbiased: bool  # E[decode(encode(x))] == x
    exact_sums: bool  # partial sums are exact in the compressed domain (no re-rounding per hop)
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    supports_reduce_scatter: bool = True
    needs_global_stats: bool = False  # needs an extra small all-reduce per call
    options: tuple[str, ...] = ()  # keyword options accepted by the factory


# ``reduce(tensor, op, what)``: ``tensor`` reduced in place across the call's ranks (``op``: "sum",
# "max" or "min"), the same bits on every rank; ``what`` labels the step in error messages.
Reducer = Callable[[torch.Tensor, str, str], None]


def no_reduce(tensor: torch.Tensor, op: str, what: str) -> None:
    """The reduction over one rank: the tensor as it is (single-tensor codec use)."""


@dataclasses.dataclass(frozen=True)
class ScheduleShape:
    """The numbers of a schedule that error models use, without the schedule itself."""

    algorithm: str
    world_size: int
    subtree: tuple[tuple[int, ...], ...]  # subtree[rank][chunk], see Schedule.subtree_sizes

    def subtree_sizes(self) -> tuple[tuple[int, ...], ...]:
        return self.subtree


@dataclasses.dataclass
class CallContext:
    """Everything a scheme may know about the collective call it serves."""

    rank: int
    world_size: int
    op: ReduceOp
    seed: int
    step: int
    collective: Collective
    what: str  # prefix for error messages, e.g. "allreduce#3"
    reduce: Reducer = no_reduce  # small uncompressed all-reduces of statistics
    schedule: ScheduleShape | None = None  # the schedule the call runs on (error models use it)
    # per-communicator memory a scheme may keep across calls; the same on all ranks
    state: dict[Any, Any] | None = None
    # the scheme's ``survey`` of this rank's input (None: none, or the input was scaled since)
    survey: Any = None
    # the input is the library's own scratch: the call may reduce in it (a two-level plan's level)
    own_input: bool = False


@runtime_checkable
class SchemeCall(Protocol):
    work: torch.Tensor  # fp32; chunk c is work[chunk_bounds[c]:chunk_bounds[c + 1]]
    chunk_bounds: Sequence[int]
    info: dict[str, Any]  # what the call chose (bits used, allocation parameter, ...)

    def payload_nbytes(self, chunk: int, count: int) -> int: ...

    def compress(self, chunk: int, count: int) -> torch.Tensor: ...

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None: ...

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None: ...

    def decompress_accumulate_recompress(
        self, chunk: int, payload: torch.Tensor, count: int, out_count: int
    ) -> torch.Tensor:
        self.decompress_accumulate(chunk, payload, count)
        return self.compress(chunk, out_count)

    def finish(self, out: torch.Tensor) -> None: ...


@runtime_checkable
class Scheme(Protocol):
    spec: SchemeSpec

    def begin(self, x: torch.Tensor, ctx: CallContext) -> SchemeCall: ...

    def encode(self, x: torch.Tensor) -> Any: ...

    def decode(self, payload: Any) -> torch.Tensor: ...

    def wire_nbytes(self, numel: int) -> int: ...
