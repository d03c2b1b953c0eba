"""The scheme protocol: how a compression scheme plugs into the executor.

A :class:`Scheme` is a configured codec (``schemes.get("dynamiq", bits=5)``). For each collective
call it makes a :class:`SchemeCall` with :meth:`Scheme.begin`, which may ask for small
uncompressed all-reduces of statistics (DynamiQ's per-super-group norms, THC's global max) through
``ctx.reduce(tensor, op, what)``: the scheme says what it needs reduced, the layer that runs the
call (:mod:`dqcoll.context`) does the exchange. Schemes never see a transport or a
:class:`~dqcoll.topology.schedule.Schedule`: the error model takes the schedule's numbers
(:class:`ScheduleShape`), and a single-tensor codec use needs no network at all (one rank: the
reduction of one contribution is that contribution).
The call owns an fp32 accumulation buffer ``work`` whose first dimension is cut into chunks by
``chunk_bounds``; the executor only moves payloads and tells the call what to do with them:

========================================  ===================================================
executor event                            call method
========================================  ===================================================
leaf sends its chunk                      ``compress(chunk, count=1)``
non-last child arrives                    ``decompress_accumulate(chunk, payload, count)``
last child at an internal node            ``decompress_accumulate_recompress(...)`` (fused)
last child at the sink                    the same, then ``decompress`` of its own output
all-gather receive                        ``decompress(chunk, payload, count)``
end of the collective                     ``finish(out)``
========================================  ===================================================

``count`` is the number of ranks whose contributions a payload sums (schemes whose integer sums
widen, like THC, size their payload by it). Payloads are flat ``uint8`` tensors whose size both
sides know in advance from ``payload_nbytes`` (NCCL needs receive sizes up front).

Single-shot codec use (``encode``/``decode``/``wire_nbytes``) is for evaluation and tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from ..types import Collective, ReduceOp

__all__ = [
    "FLOAT_DTYPES",
    "CallContext",
    "Reducer",
    "ScheduleShape",
    "Scheme",
    "SchemeCall",
    "SchemeSpec",
    "no_reduce",
]

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


class Reducer(Protocol):
    """Reduces ``tensor`` in place across the call's ranks (``op``: "sum", "max" or "min"), with
    the same bits on every rank; ``what`` labels the step in error messages."""

    def __call__(self, tensor: torch.Tensor, op: str, what: str) -> None: ...


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
    # per-communicator memory a scheme may keep across calls (e.g. calibration); same on all ranks
    state: dict[Any, Any] | None = None
    # what the scheme's ``survey`` took of this rank's input before the argument check (None:
    # nothing, or the input was scaled since)
    survey: Any = None


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
    ) -> torch.Tensor: ...

    def finish(self, out: torch.Tensor) -> None: ...


@runtime_checkable
class Scheme(Protocol):
    spec: SchemeSpec

    def begin(self, x: torch.Tensor, ctx: CallContext) -> SchemeCall: ...

    def encode(self, x: torch.Tensor) -> Any: ...

    def decode(self, payload: Any) -> torch.Tensor: ...

    def wire_nbytes(self, numel: int) -> int: ...
