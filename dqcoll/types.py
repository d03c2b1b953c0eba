"""Closed sets used across layers: reduction ops and collective kinds."""

from __future__ import annotations

import enum

__all__ = ["Collective", "ReduceOp"]


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
            from .errors import InvalidArgumentError

            raise InvalidArgumentError(
                f"unknown op {value!r}; expected one of {[op.value for op in cls]}"
            ) from None


class Collective(enum.Enum):
    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
