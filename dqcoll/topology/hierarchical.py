"""Hierarchical plans as data: a scheme, bits and algorithm per level of the topology, read as one
schedule over all ranks (:meth:`~HierarchicalPlan.flat_schedule`, checked and priced) or as
:mod:`dqcoll.levels`' run of each level; layout and phases: docs/topology.md §2. Rejected: a scheme
per transfer in the Schedule IR (a partial sum cannot change format mid-tree).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any

from ..errors import InvalidArgumentError
from .algorithms import build_schedule
from .graph import Topology
from .schedule import Schedule, Step, assign_roles

__all__ = ["HierarchicalPlan", "Level", "LevelSpec", "build_hierarchical_plan"]


class Level(enum.Enum):
    INTRA = "intra"
    INTER = "inter"


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """How one level runs: the scheme (and its bit budget) and the algorithm among its ranks."""

    scheme: str = "none"
    bits: float = 5.0  # ignored by schemes without a ``bits`` option (none)
    algorithm: str = "ring"  # or "auto": chosen by the level's call
    # further scheme options, e.g. (("levels", "uniform"),)
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        from .. import schemes

        takes_bits = "bits" in schemes.spec(self.scheme).options
        return f"{self.algorithm}/{self.scheme}" + (f"{self.bits:g}" if takes_bits else "")


@dataclasses.dataclass(frozen=True)
class HierarchicalPlan:
    host_ranks: tuple[tuple[int, ...], ...]  # host_ranks[h][j]: global rank of local rank j on h
    intra: LevelSpec
    inter: LevelSpec

    def __post_init__(self) -> None:
        sizes = {len(r) for r in self.host_ranks}
        if len(sizes) != 1:
            raise InvalidArgumentError(
                f"hierarchical plans need the same number of ranks on every host, got "
                f"{[len(r) for r in self.host_ranks]}")
        flat = sorted(r for ranks in self.host_ranks for r in ranks)
        if flat != list(range(len(flat))):
            raise InvalidArgumentError(f"host ranks must cover 0..{len(flat) - 1} once each")

    @property
    def nodes(self) -> int:
        return len(self.host_ranks)

    @property
    def gpus_per_node(self) -> int:
        return len(self.host_ranks[0])

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def name(self) -> str:
        return f"hier[{self.intra.label}|{self.inter.label}]"

    def position(self, rank: int) -> tuple[int, int]:
        """(host, local rank) of a global rank."""
        for h, ranks in enumerate(self.host_ranks):
            if rank in ranks:
                return h, ranks.index(rank)
        raise InvalidArgumentError(f"rank {rank} is not in the plan")

    @functools.cached_property
    def local_major_ranks(self) -> tuple[int, ...]:
        """The global ranks local-major: position ``j * H + h`` holds ``host_ranks[h][j]`` (part
        ``j`` of a two-level buffer, in the order of :meth:`inter_group`)."""
        return tuple(ranks[j] for j in range(self.gpus_per_node) for ranks in self.host_ranks)

    def intra_group(self, rank: int) -> tuple[int, ...]:
        return self.host_ranks[self.position(rank)[0]]

    def inter_group(self, rank: int) -> tuple[int, ...]:
        j = self.position(rank)[1]
        return tuple(ranks[j] for ranks in self.host_ranks)

    @functools.cached_property
    def inter_schedule(self) -> Schedule:
        return build_schedule(self.inter.algorithm, self.nodes)

    @functools.cached_property
    def _flat(self) -> tuple[Schedule, tuple[Level, ...]]:
        hr, hosts = self.host_ranks, range(self.nodes)
        intra = build_schedule(self.intra.algorithm, self.gpus_per_node)
        inter = self.inter_schedule

        def local(steps: tuple[Step, ...]) -> list[list[tuple[int, int, int]]]:
            # Local transfer (a -> b, shard j) on every host h, for every chunk (h', j) of shard j.
            return [[(hr[h][t.src], hr[h][t.dst], hr[k][t.chunk]) for t in s.transfers
                     for h in hosts for k in hosts] for s in steps]

        def across(steps: tuple[Step, ...]) -> list[list[tuple[int, int, int]]]:
            # Host transfer (x -> y, chunk k) for every local rank j: chunk (k, j).
            return [[(hr[t.src][j], hr[t.dst][j], hr[t.chunk][j]) for t in s.transfers
                     for j in range(self.gpus_per_node)] for s in steps]

        reduce = local(intra.reduce) + across(inter.reduce)
        gather = across(inter.gather) + local(intra.gather)
        schedule = assign_roles(self.name, self.world_size, reduce, gather)
        levels = ((Level.INTRA,) * len(intra.reduce) + (Level.INTER,) * len(inter.reduce)
                  + (Level.INTER,) * len(inter.gather) + (Level.INTRA,) * len(intra.gather))
        return schedule, levels

    def flat_schedule(self) -> Schedule:
        """The whole plan as one schedule over all ranks (see the module docstring)."""
        return self._flat[0]

    def step_levels(self) -> tuple[Level, ...]:
        """The level of each step of :meth:`flat_schedule` (reduce steps, then gather steps)."""
        return self._flat[1]


def build_hierarchical_plan(topology: Topology, *, intra: LevelSpec | None = None,
                            inter: LevelSpec | None = None) -> HierarchicalPlan:
    """The plan for ``topology`` (every host must hold the same number of ranks). Defaults:
    uncompressed ring inside hosts, dynamiq (5 bits) butterfly across them."""
    host_ranks = tuple(topology.host_ranks(h) for h in range(topology.num_hosts))
    return HierarchicalPlan(host_ranks, intra or LevelSpec("none", algorithm="ring"),
                            inter or LevelSpec("dynamiq", 5.0, "butterfly"))
