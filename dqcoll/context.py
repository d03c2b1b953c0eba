"""The :class:`~dqcoll.schemes.base.CallContext` of one call: ``ctx.reduce`` and ``ctx.schedule``
bound to its transport and schedule, so the schemes import neither (docs/design.md §1)."""

from __future__ import annotations

from typing import Any

import torch

from .schemes.base import CallContext, ScheduleShape
from .topology.schedule import Schedule
from .transports.base import Transport
from .types import Collective, ReduceOp

__all__ = ["call_context"]


def call_context(
    transport: Transport,
    op: ReduceOp,
    seed: int,
    step: int,
    collective: Collective,
    what: str,
    schedule: Schedule | None = None,
    state: dict[Any, Any] | None = None,
    survey: Any = None,
    own_input: bool = False,
) -> CallContext:
    """A call's context whose ``reduce`` is ``transport``'s small all-reduce."""

    def reduce(tensor: torch.Tensor, op: str, what: str) -> None:
        transport.allreduce(tensor, op, what=what)

    shape = None if schedule is None else ScheduleShape(  # the numbers an error model needs
        schedule.algorithm, schedule.world_size, schedule.subtree_sizes())
    return CallContext(transport.rank, transport.world_size, op, seed, step, collective, what,
                       reduce, shape, state, survey, own_input)
