"""Planning: schedules as data, their builders and checker (topology graph, cost model, simulator
and tuner live here too)."""

from __future__ import annotations

from . import algorithms
from .algorithms import build_schedule
from .checker import ScheduleError, check_schedule
from .schedule import Phase, Role, Schedule, Step, Transfer

__all__ = [
    "algorithms",
    "build_schedule",
    "check_schedule",
    "ScheduleError",
    "Phase",
    "Role",
    "Schedule",
    "Step",
    "Transfer",
]
