"""The cost model: predicted time of an all-reduce along a schedule on a topology.

:func:`price_allreduce` (a flat algorithm placed on the topology), :func:`price_hierarchical` and
:func:`price_schedule` return a :class:`CostBreakdown`: per step the wire time of the busiest
resource (a message loads every link on its route, so a shared NIC carries all its ranks' bytes),
a latency term and the busiest compute device's kernel time, pipelined over ``tiles``, plus the
statistics prologue, epilogue and argument check. The formula, the kernel rates and their
validation: docs/topology.md §3. Rejected: LogGP-style per-message gaps; one latency per step plus
a per-message cost fits the measured runs as well with fewer parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

from .. import schemes
from ..errors import InvalidArgumentError
from .graph import Topology
from .hierarchical import HierarchicalPlan, Level
from .placement import build_placed_schedule
from .schedule import Role, Schedule

__all__ = [
    "DEFAULT_KERNEL_RATES",
    "DTYPE_NBYTES",
    "CostBreakdown",
    "CostParams",
    "KernelRates",
    "SchemeCost",
    "StepCost",
    "load_kernel_rates",
    "price_allreduce",
    "price_hierarchical",
    "price_schedule",
    "scheme_cost",
]

DTYPE_NBYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
STATS_BYTES_PER_SUPER = 2  # DynamiQ (format 3): the bf16 squared norm per 256 coordinates
SUPER = 256


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """Nanoseconds per coordinate of one device, for one scheme."""

    compress_ns: float  # encode a chunk (leaf) or re-encode a partial sum
    decompress_ns: float  # decode (and accumulate) a payload
    stats_ns: float = 0.0  # prologue + epilogue per coordinate (statistics, restore)


def _gpu(bytes_compress: float, bytes_decompress: float, bytes_stats: float,
         gbps: float) -> KernelRates:
    per_ns = gbps  # GB/s == bytes per ns
    return KernelRates(bytes_compress / per_ns, bytes_decompress / per_ns, bytes_stats / per_ns)


# Bytes per coordinate a kernel moves (compress, decompress-accumulate, statistics + restore):
# dynamiq reads fp32 and writes ~0.6 B of codes; none copies and adds fp32.
_GPU_BYTES = {"dynamiq": (4.6, 8.6, 16.0), "none": (8.0, 12.0, 0.0)}
_GPU_GBPS = {"h100": 1700.0, "h200": 2400.0}

DEFAULT_KERNEL_RATES: dict[tuple[str, str], KernelRates] = {
    **{(dev, scheme): _gpu(*b, gbps) for dev, gbps in _GPU_GBPS.items()
       for scheme, b in _GPU_BYTES.items()},
    # per host of two cores (one thread's rates halved); tools/topology_validate.py calibrate
    ("cpu", "dynamiq"): KernelRates(compress_ns=1.2, decompress_ns=0.26, stats_ns=1.54),
    ("cpu", "none"): KernelRates(compress_ns=0.040, decompress_ns=0.041, stats_ns=0.0),
}
# A scheme without its own figures is priced like dynamiq on that device (same kind of work).
_FALLBACK_SCHEME = "dynamiq"


@dataclasses.dataclass(frozen=True)
class CostParams:
    message_us: float = 2.0  # per extra message a rank posts in one step
    kernel_rates: tuple[tuple[tuple[str, str], KernelRates], ...] = ()  # overrides
    handshake: bool = True  # the API's argument check (one tiny all-reduce) per call

    def rates(self, device_kind: str, scheme: str) -> KernelRates:
        table = dict(DEFAULT_KERNEL_RATES)
        table.update(dict(self.kernel_rates))
        for key in ((device_kind, scheme), (device_kind, _FALLBACK_SCHEME)):
            if key in table:
                return table[key]
        raise InvalidArgumentError(
            f"no kernel rates for device {device_kind!r}; known devices: "
            f"{sorted({d for d, _ in table})} (add some with load_kernel_rates)")


@dataclasses.dataclass(frozen=True)
class SchemeCost:
    """What the cost model needs to know of a configured scheme."""

    name: str
    wire_bytes_per_coord: float  # payload on the wire (statistics excluded)
    has_stats: bool  # a statistics all-reduce before the collective
    rates: KernelRates


def scheme_cost(name: str, bits: float | None, dtype: str, device_kind: str,
                params: CostParams | None = None) -> SchemeCost:
    """Wire bytes and kernel rates of scheme ``name`` at ``bits`` for input ``dtype``."""
    params = params or CostParams()
    if dtype not in DTYPE_NBYTES:
        raise InvalidArgumentError(f"dtype must be one of {sorted(DTYPE_NBYTES)}, got {dtype!r}")
    spec = schemes.spec(name)
    rates = params.rates(device_kind, name)
    if name == "none":
        return SchemeCost(name, float(DTYPE_NBYTES[dtype]), False, rates)
    if name == "dynamiq":
        b = 5.0 if bits is None else float(bits)
        return SchemeCost(name, (b - STATS_BYTES_PER_SUPER * 8.0 / SUPER) / 8.0, True, rates)
    per_coord = spec.bits_per_coord if spec.bits_per_coord is not None else bits
    if per_coord is None:
        raise InvalidArgumentError(f"scheme {name!r} needs bits to be priced")
    return SchemeCost(name, float(per_coord) / 8.0, spec.needs_global_stats, rates)


@dataclasses.dataclass(frozen=True)
class StepCost:
    latency_us: float
    wire_us: float
    kernel_us: float
    max_link_bytes: float
    bottleneck: str  # the busiest resource, e.g. "nic0 tx"


@dataclasses.dataclass(frozen=True)
class CostBreakdown:
    total_us: float
    steps: tuple[StepCost, ...]
    prologue_us: float
    epilogue_us: float
    tiles: int

    @property
    def wire_us(self) -> float:
        return sum(s.wire_us for s in self.steps)

    @property
    def kernel_us(self) -> float:
        return sum(s.kernel_us for s in self.steps)

    @property
    def latency_us(self) -> float:
        return sum(s.latency_us for s in self.steps)

    def as_dict(self) -> dict[str, Any]:
        return {"total_us": self.total_us, "wire_us": self.wire_us, "kernel_us": self.kernel_us,
                "latency_us": self.latency_us, "prologue_us": self.prologue_us,
                "epilogue_us": self.epilogue_us, "tiles": self.tiles, "steps": len(self.steps)}


def _step_cost(
    transfers: Iterable[tuple[int, int, int, Role]],
    topology: Topology,
    chunk_numel: float,
    cost: SchemeCost,
    params: CostParams,
    is_leaf_send: dict[tuple[int, int], bool],
) -> StepCost:
    messages: dict[tuple[int, int], int] = {}
    device_ns: dict[int, float] = {}
    rates = cost.rates
    for src, dst, chunk, role in transfers:
        messages[(src, dst)] = messages.get((src, dst), 0) + 1
        work = 0.0
        if is_leaf_send.pop((src, chunk), False):
            device_ns[topology.devices[src]] = (device_ns.get(topology.devices[src], 0.0)
                                                + rates.compress_ns * chunk_numel)
        if role is Role.FORWARD:
            work = rates.decompress_ns + rates.compress_ns
        elif role is Role.FINAL:
            work = 2 * rates.decompress_ns + rates.compress_ns
        else:  # ACCUMULATE or GATHER
            work = rates.decompress_ns
        dev = topology.devices[dst]
        device_ns[dev] = device_ns.get(dev, 0.0) + work * chunk_numel
    load: dict[tuple[int, str], float] = {}
    latency = 0.0
    per_rank: dict[int, int] = {}
    for (src, dst), chunks in messages.items():
        nbytes = chunks * chunk_numel * cost.wire_bytes_per_coord
        for resource in topology.route(src, dst):
            load[resource] = load.get(resource, 0.0) + nbytes
        latency = max(latency, topology.latency_us(src, dst))
        per_rank[src] = per_rank.get(src, 0) + 1
    wire_us = 0.0
    bottleneck = ""
    max_bytes = 0.0
    for (link_index, side), nbytes in load.items():
        link = topology.links[link_index]
        t = nbytes / link.bytes_per_us
        if t > wire_us:
            wire_us, bottleneck, max_bytes = t, f"{link.name} {side}", nbytes
    extra_messages = max(per_rank.values(), default=1) - 1
    kernel_us = max(device_ns.values(), default=0.0) / 1e3
    return StepCost(latency + extra_messages * params.message_us, wire_us, kernel_us, max_bytes,
                    bottleneck)


def _pipeline(steps: Sequence[StepCost], tiles: int) -> float:
    t = max(1, int(tiles))
    first = sum(s.latency_us + (s.wire_us + s.kernel_us) / t for s in steps)
    network = sum(s.latency_us + s.wire_us / t for s in steps)
    compute = sum(s.kernel_us / t for s in steps)
    return first + (t - 1) * max(network, compute)


@functools.lru_cache(maxsize=256)
def _unit_steps(schedule: Schedule, topology: Topology, costs: tuple[SchemeCost, ...],
                params: CostParams) -> tuple[StepCost, ...]:
    """Per-step costs for chunks of one coordinate (wire and kernel terms scale linearly with
    the chunk size, latency does not), so one cached pass prices every size."""
    # A rank's first send of a chunk with nothing received for it is a leaf: it compresses.
    received = {(t.dst, t.chunk) for s in schedule.reduce for t in s.transfers}
    leaf = {(t.src, t.chunk): (t.src, t.chunk) not in received
            for s in schedule.reduce for t in s.transfers}
    result = []
    for step, cost in zip(schedule.steps, costs, strict=True):
        transfers = [(t.src, t.dst, t.chunk, t.role) for t in step.transfers]
        result.append(_step_cost(transfers, topology, 1.0, cost, params, leaf))
    return tuple(result)


def _steps(schedule: Schedule, topology: Topology, numel: int,
           costs: Sequence[SchemeCost], params: CostParams) -> list[StepCost]:
    """Per-step costs; ``costs[i]`` is the scheme cost of step ``i`` (reduce steps, then gather)."""
    if schedule.world_size != topology.world_size:
        raise InvalidArgumentError(
            f"schedule is for {schedule.world_size} ranks, topology {topology.name!r} has "
            f"{topology.world_size}")
    chunk_numel = numel / schedule.num_chunks
    return [dataclasses.replace(s, wire_us=s.wire_us * chunk_numel,
                                kernel_us=s.kernel_us * chunk_numel,
                                max_link_bytes=s.max_link_bytes * chunk_numel)
            for s in _unit_steps(schedule, topology, tuple(costs), params)]


def _stats_us(topology: Topology, numel: int, params: CostParams, *, stats: bool,
              stats_ns: float) -> tuple[float, float]:
    """(prologue, epilogue) of one call: handshake, statistics pass and all-reduce, restore."""
    n = topology.world_size
    if n == 1:
        return 0.0, 0.0
    tiny = dataclasses.replace(params, handshake=False)
    none = scheme_cost("none", None, "float32", topology.device_kind, tiny)
    butterfly = build_placed_schedule("butterfly", topology)
    prologue = 0.0
    if params.handshake:  # ~30 int64 values: latency only
        prologue += _pipeline(_steps(butterfly, topology, 64, [none] * len(butterfly.steps),
                                     tiny), 1)
    epilogue = 0.0
    if stats:
        ranks_per_device = max(topology.devices.count(d) for d in set(topology.devices))
        pass_us = stats_ns * numel * ranks_per_device / 1e3
        stats_numel = max(1, -(-math.ceil(numel / SUPER) * STATS_BYTES_PER_SUPER // 4))
        prologue += pass_us / 2 + _pipeline(
            _steps(butterfly, topology, stats_numel, [none] * len(butterfly.steps), tiny), 1)
        epilogue += pass_us / 2
    return prologue, epilogue


def price_schedule(schedule: Schedule, topology: Topology, numel: int, cost: SchemeCost, *,
                   tiles: int = 1, params: CostParams | None = None) -> CostBreakdown:
    """Time of one all-reduce of ``numel`` coordinates along ``schedule`` with one scheme."""
    params = params or CostParams()
    steps = _steps(schedule, topology, numel, [cost] * len(schedule.steps), params)
    prologue, epilogue = _stats_us(topology, numel, params, stats=cost.has_stats,
                                   stats_ns=cost.rates.stats_ns)
    total = prologue + _pipeline(steps, tiles) + epilogue
    return CostBreakdown(total, tuple(steps), prologue, epilogue, max(1, int(tiles)))


def price_allreduce(algorithm: str, topology: Topology, nbytes: int, *, scheme: str,
                    bits: float | None = None, dtype: str = "float32", tiles: int = 1,
                    params: CostParams | None = None) -> CostBreakdown:
    """Time of ``allreduce`` of ``nbytes`` (uncompressed), a flat algorithm placed on the graph."""
    params = params or CostParams()
    numel = max(1, nbytes // DTYPE_NBYTES[dtype])
    cost = scheme_cost(scheme, bits, dtype, topology.device_kind, params)
    schedule = build_placed_schedule(algorithm, topology)
    return price_schedule(schedule, topology, numel, cost, tiles=tiles, params=params)


def price_hierarchical(plan: HierarchicalPlan, topology: Topology, nbytes: int, *,
                       dtype: str = "float32", tiles: int = 1,
                       params: CostParams | None = None) -> CostBreakdown:
    """Time of a two-level all-reduce: the plan's flat schedule, each step at its level's scheme."""
    params = params or CostParams()
    numel = max(1, nbytes // DTYPE_NBYTES[dtype])
    by_level = {
        Level.INTRA: scheme_cost(plan.intra.scheme, plan.intra.bits, dtype,
                                 topology.device_kind, params),
        Level.INTER: scheme_cost(plan.inter.scheme, plan.inter.bits, dtype,
                                 topology.device_kind, params),
    }
    schedule = plan.flat_schedule()
    steps = _steps(schedule, topology, numel, [by_level[lv] for lv in plan.step_levels()],
                   params)
    prologue = epilogue = 0.0
    # each level's statistics priced on the whole topology: a slight overestimate for intra
    for level, shard in ((Level.INTRA, numel), (Level.INTER, numel // plan.gpus_per_node)):
        c = by_level[level]
        p, e = _stats_us(topology, max(shard, 1), params, stats=c.has_stats,
                         stats_ns=c.rates.stats_ns)
        prologue, epilogue = prologue + p, epilogue + e
    total = prologue + _pipeline(steps, tiles) + epilogue
    return CostBreakdown(total, tuple(steps), prologue, epilogue, max(1, int(tiles)))


# -- measured kernel rates -------------------------------------------------------------------

# Kernel names of benchmarks/results/kernels-*.json and the rate each one measures.
_KERNEL_FIELDS = {"encode": "compress_ns", "compress": "compress_ns",
                  "decode_accumulate": "decompress_ns", "decompress_accumulate": "decompress_ns",
                  "decode": "decompress_ns", "stats_center": "stats_ns", "stats": "stats_ns"}
_KERNEL_BYTES = {"compress_ns": 4.6, "decompress_ns": 8.6, "stats_ns": 16.0}


def _device_kind(text: str) -> str:
    low = text.lower()
    for kind in ("h200", "h100"):
        if kind in low:
            return kind
    return "cpu" if "cpu" in low else low.split()[-1] if low else "cpu"


def load_kernel_rates(paths: Iterable[str] | str | None = None
                      ) -> dict[tuple[str, str], KernelRates]:
    """Kernel rates from benchmark JSON files (default ``benchmarks/results/*.json``): records
    with ``compress_ns`` and ``decompress_ns``, or the kernel benchmark's ``kernel``, ``gbps``."""
    if paths is None:
        paths = sorted(glob.glob(os.path.join("benchmarks", "results", "*.json")))
    elif isinstance(paths, str):
        paths = [paths]
    found: dict[tuple[str, str], dict[str, float]] = {}
    best_numel: dict[tuple[str, str, str], int] = {}
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        records = data
        if isinstance(data, dict):
            records = data.get("records", data.get("results", []))
            default_device = str(data.get("device", ""))
        else:
            default_device = ""
        if not isinstance(records, list):
            continue
        for rec in records:
            if not isinstance(rec, dict):
                continue
            device = _device_kind(str(rec.get("device", default_device)))
            if "compress_ns" in rec and "decompress_ns" in rec:
                key = (device, str(rec.get("scheme", "dynamiq")))
                found[key] = {k: float(rec[k]) for k in ("compress_ns", "decompress_ns",
                                                         "stats_ns") if k in rec}
                continue
            field = _KERNEL_FIELDS.get(str(rec.get("kernel", "")))
            if field is None or "gbps" not in rec:
                continue
            numel = int(rec.get("numel", 0))
            mark = (device, "dynamiq", field)
            if numel < best_numel.get(mark, -1):
                continue
            best_numel[mark] = numel
            found.setdefault((device, "dynamiq"), {})[field] = (
                _KERNEL_BYTES[field] / max(float(rec["gbps"]), 1e-9))
    result = {}
    for key, fields in found.items():
        base = DEFAULT_KERNEL_RATES.get(key, DEFAULT_KERNEL_RATES[("h100", "dynamiq")])
        result[key] = dataclasses.replace(base, **fields)
    return result
