"""The public collectives: each hands its arguments as one :class:`~dqcoll.prepare.Request` to
:func:`dqcoll.execute.launch`. The path of one call (on CUDA, all on the caller's current
stream): docs/design.md §2. Who may import this module: tests/test_layers.py.
"""

from __future__ import annotations

from typing import Any

from . import execute
from .comm import Communicator
from .executor import DEFAULT_TILES_IN_FLIGHT
from .prepare import Request
from .schemes.base import Scheme
from .topology.hierarchical import HierarchicalPlan
from .types import Collective, ReduceOp

__all__ = ["all_gather", "allreduce", "reduce_scatter"]


def allreduce(
    buf: Any,
    *,
    op: str | ReduceOp = "sum",
    scheme: str | Scheme = "dynamiq",
    bits: float | None = None,
    algorithm: str | HierarchicalPlan = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized all-reduce of ``buf`` in place; returns ``buf``.

    ``buf``: torch tensor, NumPy or CuPy array, contiguous, fp32/bf16/fp16, any length.
    ``op``: "sum" or "avg". ``scheme``: a registered name, a scheme object, or "auto" (the
    planner picks ``none``, ``bf16`` or ``dynamiq``; docs/design.md §8); ``scheme_options``
    configure it. ``bits``: wire bits per coordinate where the scheme takes them (None: 5).
    ``target_vnmse=`` (dynamiq, instead of ``bits``) picks the fewest bits predicted to meet it.
    ``algorithm``: "ring", "butterfly", "direct" or "auto" (``comm.last_info["planned"]`` says
    why), or a :class:`~dqcoll.topology.HierarchicalPlan`, run as given: each level with its own
    scheme, bits and algorithm (the call's scheme options do not apply; docs/topology.md §2).
    ``seed``/``step`` key the random rounding (default: the communicator's seed and call
    counter). ``async_op=True`` returns a :class:`~dqcoll.handles.CollectiveHandle` instead.
    ``tile_nbytes`` (0: untiled) and ``tiles_in_flight`` set the pipelining; the result does
    not depend on them.
    """
    return execute.launch(Request(
        Collective.ALLREDUCE, buf, None, op=op, scheme=scheme, bits=bits, algorithm=algorithm,
        comm=comm, seed=seed, step=step, async_op=async_op, tile_nbytes=tile_nbytes,
        tiles_in_flight=tiles_in_flight, scheme_options=scheme_options))


def reduce_scatter(
    buf: Any,
    out: Any,
    *,
    op: str | ReduceOp = "sum",
    scheme: str | Scheme = "dynamiq",
    bits: float | None = None,
    algorithm: str | HierarchicalPlan = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized reduce-scatter: ``out`` (``buf.numel() / world_size`` elements) receives shard
    ``rank`` of the reduction of ``buf`` (equal to that part of :func:`allreduce`'s result with
    the same arguments); returns ``out``. Arguments as :func:`allreduce`'s."""
    return execute.launch(Request(
        Collective.REDUCE_SCATTER, buf, out, op=op, scheme=scheme, bits=bits,
        algorithm=algorithm, comm=comm, seed=seed, step=step, async_op=async_op,
        tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight, scheme_options=scheme_options))


def all_gather(
    shard: Any,
    out: Any,
    *,
    scheme: str | Scheme = "dynamiq",
    bits: float | None = None,
    algorithm: str | HierarchicalPlan = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized all-gather: ``out`` (``world_size * shard.numel()`` elements) receives every
    rank's shard in rank order, identical on every rank (the owner's own shard decoded too);
    returns ``out``. Arguments as :func:`allreduce`'s; ``scheme="auto"`` is refused."""
    return execute.launch(Request(
        Collective.ALL_GATHER, shard, out, op="sum", scheme=scheme, bits=bits,
        algorithm=algorithm, comm=comm, seed=seed, step=step, async_op=async_op,
        tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight, scheme_options=scheme_options))
