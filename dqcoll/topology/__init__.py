"""Planning: schedules as data, their builders, the topology graph, placed and hierarchical
schedules. The tools no call runs are imported on use, so ``import dqcoll`` stays light: the
schedule checker (:mod:`.checker`), the simulator (:mod:`.simulator`) and the tuner
(:mod:`.tuning`)."""

from __future__ import annotations

from . import algorithms
from .algorithms import build_schedule
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
    "Step",
    "Topology",
    "Transfer",
    "algorithms",
    "build_hierarchical_plan",
    "build_placed_schedule",
    "build_schedule",
    "parse_topology",
]
