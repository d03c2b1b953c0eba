"""The auto-tuner and its tables: the fastest configuration per message size under an error budget.

:func:`tune` prices every candidate - flat algorithm (ring, butterfly, direct, placed on the
topology) or hierarchical plan (uncompressed inside hosts, an algorithm and scheme across them)
x scheme x bits x tiles - with the cost model (:mod:`.cost`) at every message size, checks each
configuration's error once with the simulator (:mod:`.simulator`; error does not depend on the
message size or the tiling), and keeps, per size bucket, the fastest configuration whose vNMSE
is within the budget. The result is a :class:`TunedTable`, stored as JSON named by its key
(``<topology>-w<world size>-<dtype>.json``, vLLM's convention for tuned configs) in
``dqcoll/topology/tuned/`` or in ``DQCOLL_TUNING_DIR``.

A table is the planner's stored result for a topology (:mod:`dqcoll.planner`): where a table
exists for the job's world size, dtype and detected topology (:func:`detected_key`), a call
with a named scheme and ``algorithm="auto"`` runs the flat algorithm of the table's entry for the
nearest smaller size bucket (two-level plans are still priced against it); without one the
planner prices the flat algorithms on the job's measured links.

A table is computed offline by the simulator and the cost model for a preset topology; the
planner, which measures the job it runs in, is what decides where no table matches.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import envs
from ..errors import InvalidArgumentError
from .cost import (
    DTYPE_NBYTES,
    CostParams,
    price_allreduce,
    price_hierarchical,
)
from .graph import Topology
from .hierarchical import LevelSpec, build_hierarchical_plan

if TYPE_CHECKING:
    from .simulator import RankData

__all__ = [
    "TUNED_DIR",
    "Candidate",
    "TunedEntry",
    "TunedTable",
    "default_candidates",
    "detected_key",
    "find_table",
    "size_buckets",
    "tune",
]

log = logging.getLogger("dqcoll")

TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")
FLAT_ALGORITHMS = ("ring", "butterfly", "direct")
HIER_PREFIX = "hier"


@dataclasses.dataclass(frozen=True, order=True)
class Candidate:
    """One configuration. ``algorithm`` is a flat algorithm or ``"hier:<intra>/<inter>"``
    (uncompressed ``intra`` algorithm inside hosts, ``inter`` across them with ``scheme``)."""

    algorithm: str
    scheme: str
    bits: float | None = None
    tiles: int = 1

    @property
    def is_hierarchical(self) -> bool:
        return self.algorithm.startswith(HIER_PREFIX + ":")

    @property
    def config_label(self) -> str:
        """The label without tiles (what error depends on)."""
        bits = f"@{self.bits:g}" if self.bits is not None else ""
        return f"{self.algorithm}/{self.scheme}{bits}"

    @property
    def label(self) -> str:
        return self.config_label + (f" x{self.tiles}" if self.tiles > 1 else "")

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "scheme": self.scheme, "bits": self.bits,
                "tiles": self.tiles}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        bits = data.get("bits")
        return cls(str(data["algorithm"]), str(data["scheme"]),
                   None if bits is None else float(bits), int(data.get("tiles", 1)))


def _hier_plan(candidate: Candidate, topology: Topology):  # type: ignore[no-untyped-def]
    intra, inter = candidate.algorithm.split(":", 1)[1].split("/")
    return build_hierarchical_plan(
        topology, intra=LevelSpec("none", algorithm=intra),
        inter=LevelSpec(candidate.scheme, candidate.bits if candidate.bits is not None else 5.0,
                        inter))


def predict_us(candidate: Candidate, topology: Topology, nbytes: int, *, dtype: str = "float32",
               params: CostParams | None = None) -> float:
    """The cost model's time for one candidate."""
    if candidate.is_hierarchical:
        return price_hierarchical(_hier_plan(candidate, topology), topology, nbytes,
                                  dtype=dtype, tiles=candidate.tiles, params=params).total_us
    return price_allreduce(candidate.algorithm, topology, nbytes, scheme=candidate.scheme,
                           bits=candidate.bits, dtype=dtype, tiles=candidate.tiles,
                           params=params).total_us


def default_candidates(
    topology: Topology,
    *,
    schemes: Sequence[str] = ("none", "dynamiq"),
    bits: Sequence[float] = (4.0, 5.0, 6.0, 8.0),
    tiles: Sequence[int] = (1, 2, 4, 8),
    hierarchical: bool = True,
) -> list[Candidate]:
    configs: list[tuple[str, str, float | None]] = []
    for scheme in schemes:
        scheme_bits: Sequence[float | None] = [None] if scheme == "none" else list(bits)
        for b in scheme_bits:
            configs.extend((alg, scheme, b) for alg in FLAT_ALGORITHMS)
            if hierarchical and topology.num_hosts > 1 and (topology.gpus_per_host or 0) > 1:
                configs.extend((f"{HIER_PREFIX}:ring/{inter}", scheme, b)
                               for inter in FLAT_ALGORITHMS)
    return [Candidate(a, s, b, t) for a, s, b in configs for t in tiles]


def size_buckets(smallest: int, largest: int, factor: int = 4) -> list[int]:
    if smallest < 1 or largest < smallest or factor < 2:
        raise InvalidArgumentError(
            f"sizes need 1 <= smallest <= largest and factor >= 2, got {smallest}, {largest}, "
            f"{factor}")
    sizes = []
    size = smallest
    while size <= largest:
        sizes.append(size)
        size *= factor
    return sizes


@dataclasses.dataclass(frozen=True)
class TunedEntry:
    """One size bucket: the choice, the best flat algorithm per scheme, every candidate's time."""

    nbytes: int
    choice: Candidate
    predicted_us: float
    vnmse: float
    flat_by_scheme: tuple[tuple[str, str], ...]  # scheme -> best flat algorithm (for "auto")
    times_us: tuple[tuple[str, float], ...]  # candidate label -> predicted time

    def to_dict(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "choice": self.choice.to_dict(),
                "predicted_us": self.predicted_us, "vnmse": self.vnmse,
                "flat_by_scheme": dict(self.flat_by_scheme), "times_us": dict(self.times_us)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TunedEntry:
        return cls(int(data["nbytes"]), Candidate.from_dict(data["choice"]),
                   float(data["predicted_us"]), float(data["vnmse"]),
                   tuple(sorted(data.get("flat_by_scheme", {}).items())),
                   tuple(data.get("times_us", {}).items()))


@dataclasses.dataclass(frozen=True)
class TunedTable:
    topology: str  # Topology.key
    world_size: int
    dtype: str
    error_budget: float
    entries: tuple[TunedEntry, ...]  # ascending nbytes
    errors: tuple[tuple[str, float], ...]  # config label -> simulated vNMSE
    complete: bool = True
    provenance: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return table_key(self.topology, self.world_size, self.dtype)

    def lookup(self, nbytes: int) -> TunedEntry | None:
        """The entry of the nearest smaller size bucket (the smallest bucket below all)."""
        if not self.entries:
            return None
        chosen = self.entries[0]
        for entry in self.entries:
            if entry.nbytes <= nbytes:
                chosen = entry
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return {"topology": self.topology, "world_size": self.world_size, "dtype": self.dtype,
                "error_budget": self.error_budget, "complete": self.complete,
                "provenance": dict(self.provenance), "errors": dict(self.errors),
                "entries": [e.to_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TunedTable:
        return cls(str(data["topology"]), int(data["world_size"]), str(data["dtype"]),
                   float(data["error_budget"]),
                   tuple(TunedEntry.from_dict(e) for e in data["entries"]),
                   tuple(data.get("errors", {}).items()), bool(data.get("complete", True)),
                   tuple(data.get("provenance", {}).items()))

    def save(self, directory: str = TUNED_DIR) -> str:
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, self.key + ".json")
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")
        return path

    @classmethod
    def load(cls, path: str) -> TunedTable:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def render(self) -> str:
        """A readable table: one line per size bucket."""
        lines = [f"tuned {self.key}: error budget vNMSE <= {self.error_budget:g}"
                 + ("" if self.complete else " (INTERRUPTED: partial)"),
                 f"{'size(B)':>12}  {'choice':<34} {'time(us)':>11} {'vnmse':>9}  "
                 f"{'vs none ring':>12}  flat per scheme"]
        for e in self.entries:
            times = dict(e.times_us)
            base = times.get(Candidate("ring", "none").label)
            speedup = f"{base / e.predicted_us:11.2f}x" if base else f"{'-':>12}"
            flat = ", ".join(f"{s}:{a}" for s, a in e.flat_by_scheme)
            lines.append(f"{e.nbytes:>12}  {e.choice.label:<34} {e.predicted_us:>11.1f} "
                         f"{e.vnmse:>9.2e}  {speedup}  {flat}")
        return "\n".join(lines)


def table_key(topology_key: str, world_size: int, dtype: str) -> str:
    return f"{topology_key}-w{world_size}-{dtype}"


Progress = Callable[[int, int, str], None]


def tune(
    topology: Topology,
    sizes: Sequence[int],
    *,
    error_budget: float,
    data: RankData,
    candidates: Sequence[Candidate] | None = None,
    dtype: str = "float32",
    seed: int = 0,
    params: CostParams | None = None,
    progress: Progress | None = None,
    provenance: dict[str, str] | None = None,
    known_errors: dict[str, float] | None = None,
) -> TunedTable:
    """Tune ``topology`` for messages of ``sizes`` bytes; see the module docstring.

    Errors are simulated on ``data``, one tensor per rank of the topology (a
    :class:`.simulator.RankData`, e.g. a :mod:`.sources` source as ``dqcoll tune``
    builds it), with ``seed`` for the schemes' random numbers; ``known_errors`` (configuration
    label -> vNMSE, e.g. another table's ``errors`` for the same ranks and hosts at another link
    speed) skips those simulations. Ctrl-C stops early and returns the sizes done
    (``complete=False``).
    """
    from .placement import build_placed_schedule
    from .simulator import simulate, simulate_hierarchical

    if dtype not in DTYPE_NBYTES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPE_NBYTES)}, got {dtype!r}")
    if data.world_size != topology.world_size:
        raise InvalidArgumentError(f"data has {data.world_size} ranks, topology "
                                   f"{topology.name!r} has {topology.world_size}")
    cands = list(candidates) if candidates is not None else default_candidates(topology)
    n = topology.world_size
    configs = sorted({dataclasses.replace(c, tiles=1) for c in cands})
    total = len(configs) + len(sizes)
    done = 0
    errors: dict[str, float] = {}
    known = dict(known_errors or {})
    entries: list[TunedEntry] = []
    complete = True
    try:
        for config in configs:  # error: once per configuration
            if progress:
                progress(done, total, f"simulate {config.config_label}")
            if config.config_label in known:
                errors[config.config_label] = known[config.config_label]
                done += 1
                continue
            if config.is_hierarchical:
                result = simulate_hierarchical(_hier_plan(config, topology), data, seed=seed)
            else:
                schedule = build_placed_schedule(config.algorithm, topology)
                result = simulate(schedule, data, scheme=config.scheme, bits=config.bits,
                                  seed=seed)
            errors[config.config_label] = result.vnmse
            done += 1
        for nbytes in sizes:  # time: per size and tiling
            if progress:
                progress(done, total, f"price {nbytes} B")
            times = {c: predict_us(c, topology, nbytes, dtype=dtype, params=params)
                     for c in cands}
            entries.append(_entry(nbytes, times, errors, error_budget))
            done += 1
    except KeyboardInterrupt:
        complete = False
    if progress:
        progress(done, total, "done" if complete else "interrupted")
    return TunedTable(topology.key, n, dtype, error_budget, tuple(entries),
                      tuple(sorted(errors.items())), complete,
                      tuple(sorted((provenance or {}).items())))


def _entry(nbytes: int, times: dict[Candidate, float], errors: dict[str, float],
           budget: float) -> TunedEntry:
    def error(c: Candidate) -> float:
        return errors.get(c.config_label, math.inf)

    feasible = [c for c in times if error(c) <= budget]
    pool = feasible or list(times)  # nothing meets the budget: the most accurate is still useful
    key = (lambda c: times[c]) if feasible else (lambda c: (error(c), times[c]))
    best = min(pool, key=key)
    flat: dict[str, str] = {}
    for scheme in sorted({c.scheme for c in times}):
        mine = [c for c in times if c.scheme == scheme and not c.is_hierarchical]
        ok = [c for c in mine if error(c) <= budget] or mine
        if ok:
            flat[scheme] = min(ok, key=lambda c: times[c]).algorithm
    return TunedEntry(nbytes, best, times[best], error(best), tuple(sorted(flat.items())),
                      tuple((c.label, times[c]) for c in sorted(times)))


# -- lookup for algorithm="auto" ------------------------------------------------------------


def _search_dirs() -> list[str]:
    extra = envs.tuning_dir()
    return [d for d in (extra, TUNED_DIR) if d]


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime: float) -> TunedTable:
    """A table file, parsed once per (path, modification time): the 64 most recently read stay
    (``algorithm="auto"`` looks its table up at every call); an edited file is read again."""
    return TunedTable.load(path)


def find_table(world_size: int, dtype: str, topology_key: str | None = None) -> TunedTable | None:
    """The table for ``topology_key`` (``None``: any table of that world size and dtype, first
    in sorted file order); ``DQCOLL_TUNING_DIR`` is searched before the packaged tables."""
    wanted = None if topology_key is None else table_key(topology_key, world_size, dtype) + ".json"
    suffix = f"-w{world_size}-{dtype}.json"
    for directory in _search_dirs():
        if not os.path.isdir(directory):
            continue
        names = sorted(f for f in os.listdir(directory) if f.endswith(suffix))
        if wanted is not None:
            names = [wanted] if wanted in names else []
        for name in names:
            path = os.path.join(directory, name)
            try:
                return _load_cached(path, os.path.getmtime(path))
            except (OSError, ValueError, KeyError) as exc:
                log.warning("dqcoll: ignoring unreadable tuned table %s: %s", path, exc)
    return None


@functools.lru_cache(maxsize=16)
def detected_key(world_size: int) -> str:
    """The detected topology's key, detected once per process and world size (16 kept): the
    machine does not change under a running job."""
    from .detect import detect_topology

    return detect_topology(world_size=world_size).key
