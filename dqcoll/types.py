"""Closed sets used across layers: reduction ops and collective kinds; the frame headroom."""

from __future__ import annotations

import enum

from .errors import InvalidArgumentError

__all__ = ["FRAME_HEADROOM", "Collective", "ReduceOp"]

# Bytes in front of each payload of a framed exchange (transports.base.exchange_framed), where
# the gloo transport writes its header; the scratch pool leaves this room before every buffer.
FRAME_HEADROOM = 16


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"

    @classmethod
    def parse(cls, value: str | ReduceOp) -> ReduceOp:
        if isinstance(value, ReduceOp):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise InvalidArgumentError(
                f"unknown op {value!r}; expected one of {[op.value for op in cls]}"
            ) from None


class Collective(enum.Enum):
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
