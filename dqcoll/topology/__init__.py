"""Planning: schedules as data, their builders and checker, the topology graph, placed and
hierarchical schedules. The cost model (:mod:`.cost`), the simulator (:mod:`.simulator`) and the
tuner (:mod:`.tuning`) are imported on use, so ``import dqcoll`` stays light."""

from __future__ import annotations

from . import algorithms
from .algorithms import build_schedule
from .checker import ScheduleError, check_schedule
from .detect import parse_topology
from .graph import Link, LinkKind, Topology
from .hierarchical import HierarchicalPlan, LevelSpec, build_hierarchical_plan
from .placement import build_placed_schedule
from .schedule import Phase, Role, Schedule, Step, Transfer

__all__ = [
    "HierarchicalPlan",
    "LevelSpec",
    "Link",
    "LinkKind",
    "Phase",
    "Role",
    "Schedule",
    "ScheduleError",
    "Step",
    "Topology",
    "Transfer",
    "algorithms",
    "build_hierarchical_plan",
    "build_placed_schedule",
    "build_schedule",
    "check_schedule",
    "parse_topology",
]
