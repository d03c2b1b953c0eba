"""The cost model: predicted time of an all-reduce along a schedule on a topology.

A :class:`CostBreakdown` per call; the formula, the kernel rates and their validation:
docs/topology.md §3. Rejected: LogGP-style per-message gaps; one latency per step plus a
per-message cost fits the measured runs as well with fewer parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import math
import os
import pathlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from .. import schemes
from ..errors import InvalidArgumentError
from .graph import Topology
from .hierarchical import HierarchicalPlan, Level
from .placement import build_placed_schedule
from .schedule import Role, Schedule, Transfer

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


# Bytes per coordinate a kernel moves (compress, decompress-accumulate, statistics + restore):
# dynamiq reads fp32 and writes ~0.6 B of codes; none copies and adds fp32.
_GPU_BYTES = {"dynamiq": (4.6, 8.6, 16.0), "none": (8.0, 12.0, 0.0)}
_GPU_GBPS = {"h100": 1700.0, "h200": 2400.0}

DEFAULT_KERNEL_RATES: dict[tuple[str, str], KernelRates] = {
    **{(dev, scheme): KernelRates(*(x / gbps for x in b))  # GB/s == bytes per ns
       for dev, gbps in _GPU_GBPS.items() for scheme, b in _GPU_BYTES.items()},
    # per host of two cores (one thread's rates halved); tools/topology_validate.py calibrate
    ("cpu", "dynamiq"): KernelRates(compress_ns=1.2, decompress_ns=0.26, stats_ns=1.54),
    ("cpu", "none"): KernelRates(compress_ns=0.040, decompress_ns=0.041, stats_ns=0.0),
}


@dataclasses.dataclass(frozen=True)
class CostParams:
    message_us: float = 2.0  # per extra message a rank posts in one step
    kernel_rates: tuple[tuple[tuple[str, str], KernelRates], ...] = ()  # overrides
    handshake: bool = True  # the API's argument check (one tiny all-reduce) per call

    def rates(self, device_kind: str, scheme: str) -> KernelRates:
        """``scheme``'s rates, else dynamiq's on that device (the same kind of work)."""
        table = {**DEFAULT_KERNEL_RATES, **dict(self.kernel_rates)}
        for key in ((device_kind, scheme), (device_kind, "dynamiq")):
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


def _step_cost(transfers: Iterable[Transfer], topology: Topology, cost: SchemeCost,
               params: CostParams, is_leaf_send: dict[tuple[int, int], bool]) -> StepCost:
    """One step's cost for chunks of one coordinate."""
    messages: Counter[tuple[int, int]] = Counter()
    device_ns: defaultdict[int, float] = defaultdict(float)
    rates = cost.rates
    work = {Role.FORWARD: rates.decompress_ns + rates.compress_ns,  # others: decode (and add)
            Role.FINAL: 2 * rates.decompress_ns + rates.compress_ns}
    for t in transfers:
        messages[(t.src, t.dst)] += 1
        if is_leaf_send.pop((t.src, t.chunk), False):
            device_ns[topology.devices[t.src]] += rates.compress_ns
        device_ns[topology.devices[t.dst]] += work.get(t.role, rates.decompress_ns)
    load: defaultdict[tuple[int, str], float] = defaultdict(float)
    latency = 0.0
    per_rank: Counter[int] = Counter()
    for (src, dst), chunks in messages.items():
        nbytes = chunks * cost.wire_bytes_per_coord
        for resource in topology.route(src, dst):
            load[resource] += nbytes
        latency = max(latency, topology.latency_us(src, dst))
        per_rank[src] += 1
    wire_us, bottleneck, max_bytes = 0.0, "", 0.0
    for (link_index, side), nbytes in load.items():
        link = topology.links[link_index]
        us = nbytes / link.bytes_per_us
        if us > wire_us:
            wire_us, bottleneck, max_bytes = us, f"{link.name} {side}", nbytes
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
    return tuple(_step_cost(step.transfers, topology, cost, params, leaf)
                 for step, cost in zip(schedule.steps, costs, strict=True))


def _steps(schedule: Schedule, topology: Topology, numel: int,
           costs: Sequence[SchemeCost], params: CostParams) -> list[StepCost]:
    """Per-step costs; ``costs[i]`` is the scheme cost of step ``i`` (reduce steps, then gather)."""
    if schedule.world_size != topology.world_size:
        raise InvalidArgumentError(
            f"schedule is for {schedule.world_size} ranks, topology {topology.name!r} has "
            f"{topology.world_size}")
    chunk_numel = numel / schedule.world_size
    return [dataclasses.replace(s, wire_us=s.wire_us * chunk_numel,
                                kernel_us=s.kernel_us * chunk_numel,
                                max_link_bytes=s.max_link_bytes * chunk_numel)
            for s in _unit_steps(schedule, topology, tuple(costs), params)]


def _stats_us(topology: Topology, numel: int, params: CostParams,
              cost: SchemeCost) -> tuple[float, float]:
    """(prologue, epilogue) of one call: handshake, statistics pass and all-reduce, restore."""
    if topology.world_size == 1:
        return 0.0, 0.0
    tiny = dataclasses.replace(params, handshake=False)
    none = scheme_cost("none", None, "float32", topology.device_kind, tiny)
    butterfly = build_placed_schedule("butterfly", topology)

    def exchange_us(count: int) -> float:  # a tiny butterfly all-reduce: latency only
        steps = _steps(butterfly, topology, count, [none] * len(butterfly.steps), tiny)
        return _pipeline(steps, 1)

    prologue = exchange_us(64) if params.handshake else 0.0  # ~30 int64 values
    if not cost.has_stats:
        return prologue, 0.0
    ranks_per_device = max(topology.devices.count(d) for d in set(topology.devices))
    pass_us = cost.rates.stats_ns * numel * ranks_per_device / 1e3
    stats_numel = max(1, -(-math.ceil(numel / SUPER) * STATS_BYTES_PER_SUPER // 4))
    return prologue + (pass_us / 2 + exchange_us(stats_numel)), pass_us / 2


def _breakdown(steps: list[StepCost], tiles: int, prologue: float,
               epilogue: float) -> CostBreakdown:
    total = prologue + _pipeline(steps, tiles) + epilogue
    return CostBreakdown(total, tuple(steps), prologue, epilogue, max(1, int(tiles)))


def price_schedule(schedule: Schedule, topology: Topology, numel: int, cost: SchemeCost, *,
                   tiles: int = 1, params: CostParams | None = None) -> CostBreakdown:
    """Time of one all-reduce of ``numel`` coordinates along ``schedule`` with one scheme."""
    params = params or CostParams()
    steps = _steps(schedule, topology, numel, [cost] * len(schedule.steps), params)
    return _breakdown(steps, tiles, *_stats_us(topology, numel, params, cost))


def price_allreduce(algorithm: str, topology: Topology, nbytes: int, *, scheme: str,
                    bits: float | None = None, dtype: str = "float32", tiles: int = 1,
                    params: CostParams | None = None) -> CostBreakdown:
    """Time of ``allreduce`` of ``nbytes`` (uncompressed), a flat algorithm placed on the graph."""
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
    by_level = {level: scheme_cost(spec.scheme, spec.bits, dtype, topology.device_kind, params)
                for level, spec in ((Level.INTRA, plan.intra), (Level.INTER, plan.inter))}
    steps = _steps(plan.flat_schedule(), topology, numel,
                   [by_level[lv] for lv in plan.step_levels()], params)
    # each level's statistics priced on the whole topology: a slight overestimate for intra
    stats = [_stats_us(topology, max(shard, 1), params, by_level[level])
             for level, shard in ((Level.INTRA, numel), (Level.INTER, numel // plan.gpus_per_node))]
    return _breakdown(steps, tiles, sum(p for p, _ in stats), sum(e for _, e in stats))


# -- measured kernel rates -------------------------------------------------------------------

# Kernel names of benchmarks/results/kernels-*.json and the rate each one measures.
_KERNEL_FIELDS = {"encode": "compress_ns", "compress": "compress_ns",
                  "decode_accumulate": "decompress_ns", "decompress_accumulate": "decompress_ns",
                  "decode": "decompress_ns", "stats_center": "stats_ns", "stats": "stats_ns"}
_KERNEL_BYTES = dict(zip(("compress_ns", "decompress_ns", "stats_ns"), _GPU_BYTES["dynamiq"],
                         strict=True))


def _device_kind(text: str) -> str:
    low = text.lower()
    return next((k for k in ("h200", "h100", "cpu") if k in low), low.split()[-1] if low else "cpu")


def load_kernel_rates(paths: Iterable[str] | str | None = None
                      ) -> dict[tuple[str, str], KernelRates]:
    """Kernel rates from benchmark JSON files (default ``benchmarks/results/*.json``): records
    with ``compress_ns`` and ``decompress_ns``, or the kernel benchmark's ``kernel``, ``gbps``."""
    if paths is None:
        paths = sorted(glob.glob(os.path.join("benchmarks", "results", "*.json")))
    elif isinstance(paths, str):
        paths = [paths]
    found: dict[tuple[str, str], dict[str, float]] = {}
    best_numel: dict[tuple[str, str], int] = {}
    for path in paths:
        try:
            data = json.loads(pathlib.Path(path).read_text())
        except (OSError, ValueError):
            continue
        data = data if isinstance(data, dict) else {"records": data}
        records = data.get("records", data.get("results", []))
        for rec in records if isinstance(records, list) else []:
            if not isinstance(rec, dict):
                continue
            device = _device_kind(str(rec.get("device", data.get("device", ""))))
            if "compress_ns" in rec and "decompress_ns" in rec:
                key = (device, str(rec.get("scheme", "dynamiq")))
                found[key] = {k: float(rec[k]) for k in ("compress_ns", "decompress_ns",
                                                         "stats_ns") if k in rec}
                continue
            field = _KERNEL_FIELDS.get(str(rec.get("kernel", "")))
            if field is not None and "gbps" in rec:  # the largest size's rate wins
                numel = int(rec.get("numel", 0))
                if numel >= best_numel.get((device, field), -1):
                    best_numel[(device, field)] = numel
                    found.setdefault((device, "dynamiq"), {})[field] = (
                        _KERNEL_BYTES[field] / max(float(rec["gbps"]), 1e-9))
    return {key: dataclasses.replace(
        DEFAULT_KERNEL_RATES.get(key, DEFAULT_KERNEL_RATES[("h100", "dynamiq")]), **fields)
        for key, fields in found.items()}
