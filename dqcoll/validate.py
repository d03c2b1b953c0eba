"""The argument check across ranks: every rank raises together, before any data moves; one
tiny all-reduce (max) of ``[fields, -fields, error code by rank, extra, exponent]`` (int64).
Rationale: docs/reliability.md, "Argument check"; the vector: docs/design.md §2 step 3.
"""

from __future__ import annotations

import zlib

import torch

from .agreement import hash62
from .comm import Communicator
from .errors import InvalidArgumentError, MismatchError, PeerError
from .interop import host_to_device
from .prepare import NO_EXPONENT, PreparedCall
from .types import Collective

__all__ = ["EXTRA_SLOTS", "fingerprint", "handshake"]

# a failure's category (prepare.PreparedCall.category) travels as its position here plus 1
_CATEGORIES = ("buffer", "dtype", "layout", "scheme", "algorithm", "op", "other")
_DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
# Everything that changes the number, sizes or meaning of the messages must be here. ``seed``
# and ``step`` travel as 62-bit hashes of their whole value; the call counter is hashed with
# ``step`` and the mode (sync / async_op) coded with the collective, adding no wire bytes.
_FIELDS = ("numel", "dtype", "scheme", "algorithm", "op", "seed", "step", "tile_nbytes",
           "tiles_in_flight", "collective", "out_numel")
_NUMERIC_FIELDS = ("numel", "tile_nbytes", "tiles_in_flight", "out_numel")
_MODES = {0: "sync", 1: "async_op"}
_MODE_STRIDE = 8  # collective field = kind id + _MODE_STRIDE * mode
_COLLECTIVE_IDS = {Collective.ALLREDUCE: 1, Collective.REDUCE_SCATTER: 2,
                   Collective.ALL_GATHER: 3}
# a planned call's previous time; every call carries it (zero otherwise), so vectors match in size
EXTRA_SLOTS = 1


def fingerprint(call: PreparedCall) -> tuple[int, ...]:
    """The int64 fields of :data:`_FIELDS` for a call that passed its local checks: what every
    rank must agree on (``scheme="auto"`` is fingerprinted as ``auto``)."""
    tensor, scheme, schedule, op = call.tensor, call.scheme, call.schedule, call.op
    assert tensor is not None and scheme is not None and op is not None
    name = "auto" if call.auto else scheme.spec.name
    algorithm = "auto" if schedule is None else schedule.algorithm  # None: the planner's
    kind = _COLLECTIVE_IDS[call.collective] + _MODE_STRIDE * (1 if call.async_op else 0)
    return (
        tensor.numel(),
        _DTYPE_IDS[tensor.dtype],
        zlib.crc32((name + repr(scheme)).encode()),
        zlib.crc32(algorithm.encode()),
        zlib.crc32(op.value.encode()),
        hash62(str(int(call.seed))),
        hash62(f"{int(call.step)}/{call.call}"),
        int(call.tile_nbytes),
        int(call.tiles_in_flight),
        kind,
        call.out.numel() if call.out is not None else 0,
    )


def handshake(call: PreparedCall, comm: Communicator, extra: list[int] | None = None) -> int:
    """Raise on every rank if any rank is invalid or the ranks disagree (one tiny all-reduce).

    Returns the largest binary exponent of a finite input value over all ranks;
    :data:`~dqcoll.prepare.NO_EXPONENT` without a check. ``extra`` (:data:`EXTRA_SLOTS` ints) is
    replaced in place by its maximum over ranks (and runs the exchange even when validation is off).
    """
    fields: tuple[int, ...] = ()
    if call.error is None:
        try:
            fields = fingerprint(call)
        except Exception as exc:  # this rank's error
            call.fail("other", InvalidArgumentError(f"rank {comm.rank}: {call.what}: invalid "
                                                    f"arguments: {type(exc).__name__}: {exc}"))
    n = comm.world_size
    if (not comm.validate and extra is None) or n == 1:
        if call.error is not None:
            raise call.error
        return NO_EXPONENT
    vector = _exchange(call, comm, fields, extra)
    k, m = len(_FIELDS), EXTRA_SLOTS
    codes = vector[2 * k : 2 * k + n].tolist()
    if extra is not None:
        extra[:] = vector[2 * k + n : 2 * k + n + m].tolist()
    if call.error is not None:
        raise call.error
    bad = [(r, _CATEGORIES[min(c, len(_CATEGORIES)) - 1]) for r, c in enumerate(codes) if c]
    if bad:
        listed = ", ".join(f"rank {r} ({cat})" for r, cat in bad)
        raise PeerError(f"rank {comm.rank}: {call.what} not run: invalid input on {listed}")
    high = vector[:k].tolist()
    low = [-v for v in vector[k : 2 * k].tolist()]
    differ = [(f, lo, hi) for f, lo, hi in zip(_FIELDS, low, high, strict=True) if lo != hi]
    if differ:
        raise MismatchError(f"rank {comm.rank}: {call.what}: ranks disagree on "
                            f"{_describe(call, differ)}")
    return int(vector[-1])


def _exchange(call: PreparedCall, comm: Communicator, fields: tuple[int, ...],
              extra: list[int] | None) -> torch.Tensor:
    """The handshake's all-reduce; a failure of the exchange itself leaves the communicator dead."""
    n, k, m = comm.world_size, len(_FIELDS), EXTRA_SLOTS
    vector = torch.zeros(2 * k + n + m + 1, dtype=torch.int64)
    if extra:
        vector[2 * k + n : 2 * k + n + m] = torch.tensor(extra, dtype=torch.int64)
    if call.error is None:
        values = torch.tensor(fields, dtype=torch.int64)
        vector[:k] = values
        vector[k : 2 * k] = -values
        vector[-1] = call.exponent
    else:
        vector[2 * k + comm.rank] = _CATEGORIES.index(call.category) + 1
        vector[-1] = NO_EXPONENT
    vector = host_to_device(vector, comm.device, torch.int64)  # the host waits only at .cpu()
    try:
        comm.transport.allreduce(vector, "max", what=f"{call.what} argument check")
    except MismatchError:
        raise  # messages of another step (the torch transport's headers): nothing in flight
    except BaseException as exc:
        comm.mark_dead(f"{call.what} argument check failed: {type(exc).__name__}: {exc}")
        raise
    return vector.cpu()


def _describe(call: PreparedCall, differ: list[tuple[str, int, int]]) -> str:
    """The fields the ranks disagree on, with the values a reader can act on."""
    kinds = {i: c.value for c, i in _COLLECTIVE_IDS.items()}
    return "; ".join(
        f"{f} (min {lo}, max {hi})" if f in _NUMERIC_FIELDS
        else f"seed (this rank: {int(call.seed)})" if f == "seed"
        else (f"step or call counter (this rank: step {int(call.step)}, call {call.call}; "
              f"ranks must issue the same collectives in the same order)") if f == "step"
        else (f"collective or mode ({kinds.get(lo % _MODE_STRIDE)} "
              f"{_MODES.get(lo // _MODE_STRIDE)} vs {kinds.get(hi % _MODE_STRIDE)} "
              f"{_MODES.get(hi // _MODE_STRIDE)})") if f == "collective"
        else f"{f}"
        for f, lo, hi in differ
    )
