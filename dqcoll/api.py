"""The public collectives: ``allreduce``, ``reduce_scatter`` and ``all_gather``.

Each function only states its arguments and hands them down as one
:class:`~dqcoll.prepare.Request` to :func:`dqcoll.execute.launch`. A call then walks down the
layers without coming back here:

1. :mod:`dqcoll.prepare` - the local checks (buffer, dtype, contiguity, scheme and algorithm
   names, op, numbers), the scheme object and its options, the schedule, the input's range;
2. :mod:`dqcoll.validate` - one tiny all-reduce of an error code and a fingerprint of the
   arguments: if any rank is invalid or the ranks disagree, *every* rank raises before any data
   moves (``DQCOLL_VALIDATE=0`` skips it);
3. :mod:`dqcoll.execute` - the schedule run by the executor over the transport, then the result
   written into the caller's buffer last, so an error leaves the input untouched.

CUDA buffers: all work is queued on the caller's current stream - torch's for torch tensors,
CuPy's for CuPy arrays (:func:`dqcoll.interop.stream_scope`). ``async_op=True`` returns a
:class:`~dqcoll.handles.CollectiveHandle` at once and runs the collective on the communicator's
worker (see :mod:`dqcoll.handles`); a synchronous call first waits for the communicator's pending
asynchronous ones.

Only the package's front (``dqcoll/__init__.py``), the integrations, the command line and the
lab beside the runtime (``dqcoll_lab``) import this module; the layers below call
:func:`dqcoll.execute.launch` (tests/test_layers.py pins it).
"""

from __future__ import annotations

from typing import Any

from . import execute
from .comm import Communicator
from .executor import DEFAULT_TILES_IN_FLIGHT
from .prepare import Request
from .schemes.base import Scheme
from .types import Collective, ReduceOp

__all__ = ["all_gather", "allreduce", "reduce_scatter"]


def allreduce(
    buf: Any,
    *,
    op: str | ReduceOp = "sum",
    scheme: str | Scheme = "dynamiq",
    bits: float | None = None,
    algorithm: str = "auto",
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
    ``op``: "sum" or "avg". ``scheme``: a registered name (see ``dqcoll.schemes.list_schemes()``),
    a scheme object, or "auto" (:mod:`dqcoll.planner`: ``none``, ``bf16`` or ``dynamiq``,
    whichever the planner predicts fastest on the job's measured links, calibrated by measured
    calls); ``bits`` and ``scheme_options`` (e.g. ``levels="uniform"``) configure
    it. ``bits``: bits per coordinate on the wire for the schemes that take it (dynamiq); None
    (the default) means 5, the default of :data:`dqcoll.prepare.DEFAULT_BITS`.
    ``algorithm``: "ring", "butterfly", "direct" or "auto" (the planner's: a flat algorithm or
    two levels, inside and across hosts; ``comm.last_info["planned"]`` says which and why).
    ``seed``/``step`` key the random rounding (default: the communicator's seed and call counter).
    ``target_vnmse=`` (a scheme option, dynamiq only, instead of ``bits``: giving both raises)
    chooses per call the fewest bits whose predicted vNMSE meets the target (see
    :mod:`dqcoll.schemes.dynamiq.error_model`); ``comm.last_info`` reports the bits used and
    the prediction.
    ``async_op=True`` returns a :class:`~dqcoll.handles.CollectiveHandle` (``wait()`` returns
    ``buf``; ``is_completed()``) instead of ``buf``. ``tile_nbytes`` (None: the default,
    :func:`~dqcoll.executor.default_tile_nbytes`; 0: untiled) and ``tiles_in_flight`` set the
    pipelining (:mod:`dqcoll.executor`); the result does not depend on them.
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
    algorithm: str = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized reduce-scatter: ``out`` (``buf.numel() / world_size`` elements) receives shard
    ``rank`` of the reduction of ``buf``; returns ``out``. Equal to the matching part of
    :func:`allreduce` with the same arguments on the same layout; the arguments are
    :func:`allreduce`'s (``bits=None``: 5 bits)."""
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
    algorithm: str = "auto",
    comm: Communicator | None = None,
    seed: int | None = None,
    step: int | None = None,
    async_op: bool = False,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
    **scheme_options: Any,
) -> Any:
    """Quantized all-gather: ``out`` (``world_size * shard.numel()`` elements) receives every
    rank's shard in rank order, each decoded from the same bytes on every rank (the owner's own
    shard too); returns ``out``. The arguments are :func:`allreduce`'s (``bits=None``: 5 bits;
    ``scheme="auto"`` is refused: the shards' scheme sets an all-gather's bytes)."""
    return execute.launch(Request(
        Collective.ALL_GATHER, shard, out, op="sum", scheme=scheme, bits=bits,
        algorithm=algorithm, comm=comm, seed=seed, step=step, async_op=async_op,
        tile_nbytes=tile_nbytes, tiles_in_flight=tiles_in_flight, scheme_options=scheme_options))
