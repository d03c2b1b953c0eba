"""The planner: how a collective runs, decided from the job's own topology and measured rates
(docs/design.md §8; use: docs/planner.md). Fitted constants (link speeds from ``/sys``, overlap
shares) are not inputs: they hold only on the machine they were fitted on.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import pathlib
import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .agreement import hash62
from .errors import InvalidArgumentError
from .executor import DEFAULT_CUDA_TILE_NBYTES, DEFAULT_TILE_NBYTES
from .topology.cost import (
    DTYPE_NBYTES,
    CostBreakdown,
    CostParams,
    KernelRates,
    price_allreduce,
    price_hierarchical,
)
from .topology.graph import Link, LinkKind, Topology
from .topology.hierarchical import HierarchicalPlan, LevelSpec

__all__ = [
    "AUTO_SCHEMES",
    "JobTopology",
    "MeasuredRates",
    "Plan",
    "Planner",
    "build_planner",
    "discover_job",
    "flat_algorithms",
    "measure_rates",
]

AUTO_SCHEMES = ("none", "bf16", "dynamiq")
FLAT_ALGORITHMS = ("ring", "butterfly")
# A plan that runs the process group's own all-reduce (what DDP runs without a hook).
NATIVE = "native"
# Bits ``auto`` prices dynamiq at under an error target.
TARGET_BITS = 8.0
# A candidate never run, predicted within this factor of the chosen one, runs once instead.
EXPLORE_WITHIN = 2.0
# A candidate measured only once, predicted within this factor of the chosen one, runs once more:
# one call measured while other work held the cores (a DDP lane's call beside backward and the
# other lane) must not rule out a plan for the rest of the job.
SECOND_LOOK_WITHIN = 1.25
# A measured plan in use is kept unless another is predicted faster by more than this share:
# measurements beside other work scatter, and flipping between close plans costs more.
SWITCH_MARGIN = 0.05
# A candidate's factor: the smallest measured / predicted ratio of its last this many measured
# calls. Calls beside other work (another process on the cores, a DDP lane beside backward) are
# only ever slower than the plan's own time, so the smallest is its best estimate; the window
# lets a plan that became slower for good (a link that degraded) be seen so within as many calls.
CALIBRATION_WINDOW = 4
# Link probes: bytes per flow, best of two after one of an eighth.
PROBE_NBYTES = 4 << 20
# Kernel probe: coordinates per measurement, best of three after one.
KERNEL_PROBE_NUMEL = 1 << 20
# Latency of every link of the job's graph: not probed; measured calls calibrate it.
LINK_LATENCY_US = 20.0
# Size classes: plans are made per power of two of the uncompressed bytes.
_SIZE_CLASS_BASE = 2.0


# -- the job ---------------------------------------------------------------------------------


def host_identity() -> tuple[int, int]:
    """(host key, machine key): host name + network namespace, host name + boot id."""
    name = socket.gethostname()
    netns = boot = ""
    with contextlib.suppress(OSError):
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    with contextlib.suppress(OSError):
        boot = pathlib.Path("/proc/sys/kernel/random/boot_id").read_text("ascii").strip()
    return hash62(f"{name}/{netns}"), hash62(f"{name}/{boot}")


@dataclasses.dataclass(frozen=True)
class JobTopology:
    """Which ranks share a host and which share a machine (see the module docstring)."""

    hosts: tuple[tuple[int, ...], ...]  # ranks of each host, hosts ordered by their first rank
    machines: tuple[int, ...]  # machines[rank]: index of the machine the rank runs on
    device_kind: str = "cpu"  # "cpu", or the GPU kind of the cost model ("h100", "h200")

    @property
    def world_size(self) -> int:
        return len(self.machines)

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def ranks_per_host(self) -> int | None:
        sizes = {len(h) for h in self.hosts}
        return sizes.pop() if len(sizes) == 1 else None

    def host_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.hosts) if rank in ranks)

    @property
    def two_level(self) -> bool:
        """Whether two-level plans apply: several hosts of the same number (> 1) of ranks."""
        return self.num_hosts > 1 and (self.ranks_per_host or 0) > 1

    def describe(self) -> str:
        shape = (f"{self.num_hosts} hosts x {self.ranks_per_host} ranks" if self.ranks_per_host
                 else f"{self.num_hosts} hosts of {[len(h) for h in self.hosts]} ranks")
        return (f"{self.world_size} ranks: {shape}, {len(set(self.machines))} machine(s), "
                f"{self.device_kind}")


def discover_job(transport: Any, device: torch.device | None = None, *,
                 identity: tuple[int, int] | None = None) -> JobTopology:
    """The job's hosts and machines from every rank's :func:`host_identity` (or ``identity``),
    in one all-reduce. Collective: every rank calls it at the same point."""
    n, rank = transport.world_size, transport.rank
    host, machine = identity if identity is not None else host_identity()
    slots = torch.zeros(2 * n, dtype=torch.int64, device=getattr(transport, "device", None)
                        or torch.device("cpu"))
    slots[2 * rank], slots[2 * rank + 1] = host, machine
    if n > 1:
        transport.allreduce(slots, "sum", what="planner: hosts")
    keys = slots.cpu().tolist()
    order: dict[int, list[int]] = {}
    for r, key in enumerate(keys[0::2]):
        order.setdefault(key, []).append(r)
    machine_index = {k: i for i, k in enumerate(dict.fromkeys(keys[1::2]))}
    machines = tuple(machine_index[k] for k in keys[1::2])
    kind = "cpu"
    if device is not None and device.type == "cuda":
        kind = "h200" if "h200" in torch.cuda.get_device_name(device).lower() else "h100"
    return JobTopology(tuple(tuple(r) for r in order.values()), machines, kind)


# -- measured rates ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeasuredRates:
    """What the job measured on its own links and kernels, agreed over ranks (the slowest)."""

    intra_gbps: float | None  # one flow between two ranks of a host (None: no host has two)
    inter_gbps: float | None  # a host's port, all its flows together (None: one host)
    kernels: tuple[tuple[str, KernelRates], ...]  # per scheme, per rank (one core / one GPU)
    cores_per_machine: int = 1

    def kernel(self, scheme: str) -> KernelRates:
        """``scheme``'s kernel rates (``native-<s>`` falls back to ``<s>``, others to dynamiq)."""
        table = dict(self.kernels)
        return (table.get(scheme) or table.get(scheme.removeprefix(NATIVE + "-"))
                or table["dynamiq"])


def _probe_s(transport: Any, ring: Sequence[int], at: int, what: str,
             device: torch.device) -> float:
    """Best time of sending :data:`PROBE_NBYTES` to the next rank of ``ring`` while receiving
    from the one before (``at``: this rank's place; posted by every rank at once). A ring of
    fewer than two ranks only takes part: 0."""
    send = torch.zeros(PROBE_NBYTES, dtype=torch.uint8, device=device)
    recv = torch.empty_like(send)
    paired = len(ring) > 1
    best = math.inf
    for size in (PROBE_NBYTES // 8, PROBE_NBYTES, PROBE_NBYTES):
        sends = [(ring[(at + 1) % len(ring)], send[:size])] if paired else []
        recvs = [(ring[(at - 1) % len(ring)], recv[:size])] if paired else []
        start = time.perf_counter()
        transport.exchange(sends, recvs, what=f"{what} ({size} B)")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if size == PROBE_NBYTES and paired:
            best = min(best, time.perf_counter() - start)
    return best if math.isfinite(best) else 0.0


_KERNELS_LOCK = threading.Lock()  # kernel rates are measured once per process and device


@functools.cache
def _kernel_ns(where: str, bits: float) -> dict[str, KernelRates]:
    """Each scheme's kernel ns per coordinate on device ``where``."""
    from . import schemes

    device = torch.device(where)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(KERNEL_PROBE_NUMEL, generator=g).to(device)
    y = torch.randn(KERNEL_PROBE_NUMEL, generator=g).to(device)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter

    def best(fn: Any) -> float:
        fn()
        elapsed = math.inf
        for _ in range(3):
            start = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = min(elapsed, clock() - start)
        return elapsed * 1e9 / KERNEL_PROBE_NUMEL

    add_ns = best(lambda: x.add(y))
    cast_ns = best(lambda: x.to(torch.bfloat16).add_(y.to(torch.bfloat16)).float())
    rates = {
        # the process group's own all-reduce: gloo's / NCCL's sum, and bf16's casts around it
        NATIVE + "-none": KernelRates(compress_ns=add_ns / 2, decompress_ns=add_ns),
        NATIVE + "-bf16": KernelRates(compress_ns=cast_ns / 2, decompress_ns=cast_ns),
    }
    for name in AUTO_SCHEMES:  # dqcoll's codecs, as its schedules run them
        codec = schemes.get(name, **({"bits": bits} if name == "dynamiq" else {}))
        encoded = codec.encode(x)
        encode_ns = best(lambda codec=codec: codec.encode(x))
        decode_ns = best(lambda codec=codec, encoded=encoded: codec.decode(encoded))
        # a hop decodes and accumulates (none: in float64, as its encode converts)
        hop_ns = max(decode_ns, encode_ns if name == "none" else 0.0) + add_ns
        # dynamiq's statistics and restore: priced as two decodes, which measured calls calibrate
        stats_ns = 2 * decode_ns if name == "dynamiq" else 0.0
        rates[name] = KernelRates(compress_ns=encode_ns, decompress_ns=hop_ns,
                                  stats_ns=stats_ns)
    return rates


def measure_rates(transport: Any, job: JobTopology, *, device: torch.device | None = None,
                  bits: float = 5.0, what: str = "planner probe") -> MeasuredRates:
    """Measure the job's links and this rank's kernels, and agree the slowest rank's figures.
    Collective: every rank calls it at the same point."""
    device = device or getattr(transport, "device", None) or torch.device("cpu")
    hosts, h = job.hosts, job.host_of(transport.rank)
    local = hosts[h].index(transport.rank)
    intra_s = inter_s = 0.0
    if max(len(x) for x in hosts) > 1:  # a ring inside each host
        intra_s = _probe_s(transport, hosts[h], local, f"{what} (intra-host)", device)
    flows = min(len(x) for x in hosts) if job.num_hosts > 1 else 0
    if flows:  # a ring across hosts per local index that every host has
        column = [x[local] for x in hosts] if local < flows else []
        inter_s = _probe_s(transport, column, h, f"{what} (inter-host)", device)
    with _KERNELS_LOCK:
        kernels = _kernel_ns(str(device), float(bits))
    names = sorted(kernels)
    fields = [intra_s, inter_s] + [v for s in names for v in dataclasses.astuple(kernels[s])]
    agreed = torch.tensor(fields, dtype=torch.float64, device=device)
    if transport.world_size > 1:
        transport.allreduce(agreed, "max", what=f"{what} (agree)")
    values = agreed.cpu().tolist()
    intra = PROBE_NBYTES * 8 / values[0] / 1e9 if values[0] > 0 else None
    inter = flows * PROBE_NBYTES * 8 / values[1] / 1e9 if values[1] > 0 else None
    table = tuple((name, KernelRates(*values[2 + 3 * i: 5 + 3 * i]))
                  for i, name in enumerate(names))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return MeasuredRates(intra, inter, table, int(cores or 1))


# -- plans -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one collective runs (plain data, the same on every rank)."""

    collective: str  # "allreduce", "reduce_scatter", "all_gather"
    scheme: str  # the flat scheme, or the scheme across hosts of a two-level plan
    algorithm: str  # the flat algorithm, or "two-level"
    bits: float | None
    levels: HierarchicalPlan | None = None  # set for two-level plans
    predicted_us: float = 0.0
    reason: str = ""
    alternatives: tuple[tuple[str, float], ...] = ()  # (label, predicted us), best first
    dtype: str = "float32"

    @property
    def label(self) -> str:
        return _label(self.scheme, self.algorithm, self.bits, self.levels)

    @property
    def is_two_level(self) -> bool:
        return self.levels is not None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"collective": self.collective, "label": self.label,
                               "scheme": self.scheme, "algorithm": self.algorithm,
                               "bits": self.bits, "predicted_us": round(self.predicted_us, 1),
                               "reason": self.reason}
        if self.levels is not None:
            out["levels"] = {"hosts": [list(h) for h in self.levels.host_ranks], **{
                name: {"scheme": level.scheme, "bits": level.bits, "algorithm": level.algorithm}
                for name, level in (("intra", self.levels.intra), ("inter", self.levels.inter))}}
        out["alternatives"] = [[label, round(us, 1)] for label, us in self.alternatives]
        return out


def _label(scheme: str, algorithm: str, bits: float | None,
           levels: HierarchicalPlan | None) -> str:
    if levels is not None:
        return f"two-level[{levels.intra.label} + {levels.inter.label}]"
    return f"{algorithm}/{scheme}" if bits is None else LevelSpec(scheme, bits, algorithm).label


def _kind(label: str) -> str:
    """The kind of plan a label names: ``two-level``, ``native`` or ``flat``."""
    if label.startswith("two-level"):
        return "two-level"
    return NATIVE if label.startswith(NATIVE + "/") else "flat"


PREDICTIONS_KEPT = 4096  # Planner.predict_us results kept (a few per size and candidate)


class Planner:
    """Plans for one communicator's calls; ``job`` and ``rates`` must be the same on every rank."""

    def __init__(self, job: JobTopology, rates: MeasuredRates) -> None:
        self.job = job
        self.rates = rates
        self.tile_nbytes = DEFAULT_TILE_NBYTES if job.device_kind == "cpu" else (
            DEFAULT_CUDA_TILE_NBYTES)
        self.graph = self._graph()
        self.params = CostParams(kernel_rates=tuple(
            ((job.device_kind, name), self._device_rates(name)) for name in AUTO_SCHEMES))
        # the group's own all-reduce: none and bf16 at the native kernels' rates
        self.native_params = CostParams(kernel_rates=tuple(
            ((job.device_kind, name), self._device_rates(f"{NATIVE}-{name}"))
            for name in ("none", "bf16")))
        # label -> measured / predicted, for every plan that ran (:meth:`observe`): the smallest
        # of its last measured ratios (``_ratios``)
        self.factors: dict[str, float] = {}
        self._ratios: dict[str, collections.deque[float]] = {}
        self._cache: dict[tuple[Any, ...], Plan] = {}
        self._predicted: dict[tuple[Any, ...], float] = {}  # predict_us's, per argument
        self._incumbent: dict[tuple[Any, ...], str] = {}  # the plan in use per cache key
        self.probe_nbytes = 0  # what this rank sent to measure the links (build_planner)

    # -- the cost model's inputs ------------------------------------------------------------

    def _device_rates(self, scheme: str) -> KernelRates:
        """Rates per compute device: a machine's cores serve its CPU ranks together."""
        cores = max(1, self.rates.cores_per_machine) if self.job.device_kind == "cpu" else 1
        return KernelRates(*(v / cores for v in dataclasses.astuple(self.rates.kernel(scheme))))

    def _graph(self) -> Topology:
        """The job as the cost model's graph (docs/design.md §8, "One cost model")."""
        job = self.job
        intra, inter = self.rates.intra_gbps or 1e4, self.rates.inter_gbps or 1e4
        links: list[Link] = []
        nics: list[int] = []
        hosts = [0] * job.world_size
        ports = [0] * job.world_size
        for h, ranks in enumerate(job.hosts):
            nics.append(len(links))
            links.append(Link(f"port{h}", LinkKind.NETWORK, inter, LINK_LATENCY_US))
            for r in ranks:
                hosts[r] = h
                ports[r] = len(links)
                links.append(Link(f"local{h}.{r}", LinkKind.LOOPBACK, intra, LINK_LATENCY_US))
        devices = (tuple(job.machines) if job.device_kind == "cpu"
                   else tuple(range(job.world_size)))
        return Topology("job", tuple(hosts), tuple(ports), tuple(nics), tuple(links), devices,
                        device_kind=job.device_kind)

    # -- candidates and prices ----------------------------------------------------------------

    def candidates(self, collective: str, scheme: str, bits: float | None, *,
                   native: bool = False, force: str | None = None
                   ) -> list[tuple[str, str, float | None, HierarchicalPlan | None]]:
        """(scheme, algorithm, bits, levels) of every plan considered for ``scheme`` (or
        ``"auto"``). ``native``: ``auto`` may run the group's own all-reduce for ``none`` and
        ``bf16``; ``force``: ``auto`` considers that scheme only (``DQCOLL_AUTO_FORCE``)."""
        if collective == "all_gather" and scheme == "auto":
            raise InvalidArgumentError("scheme='auto' is for allreduce and reduce_scatter")
        names = (AUTO_SCHEMES if force is None else (force,)) if scheme == "auto" else (scheme,)

        def bits_of(name: str) -> float | None:  # dynamiq's bits (default 5), others none
            return (5.0 if bits is None else float(bits)) if name == "dynamiq" else None

        out: list[tuple[str, str, float | None, HierarchicalPlan | None]] = []
        algorithms = flat_algorithms(self.job.world_size)
        for name in names:
            if scheme == "auto" and native and name != "dynamiq" and collective == "allreduce":
                out.append((name, NATIVE, bits_of(name), None))
            else:
                out += [(name, algorithm, bits_of(name), None) for algorithm in algorithms]
        if not self.job.two_level or (scheme == "auto" and force not in (None, "dynamiq")):
            return out
        hi = "dynamiq" if scheme == "auto" else scheme
        hi_bits = bits_of(hi)
        for lo in ("none", "bf16") if scheme == "auto" else ("none",):
            for algorithm in FLAT_ALGORITHMS if self.job.num_hosts > 2 else ("ring",):
                inter = LevelSpec(hi, 5.0 if hi_bits is None else hi_bits, algorithm)
                levels = HierarchicalPlan(self.job.hosts, LevelSpec(lo, algorithm="ring"), inter)
                out.append((hi, "two-level", hi_bits, levels))
        return out

    def predict_us(self, collective: str, scheme: str, algorithm: str, bits: float | None,
                   levels: HierarchicalPlan | None, nbytes: int, dtype: str) -> float:
        """The cost model's time of a candidate, uncalibrated (reduce-scatter, all-gather: half);
        kept per argument (the model's inputs do not change once the planner is made, and a
        call re-prices its candidates after every measured call moves a factor)."""
        key = (collective, scheme, algorithm, bits, levels, nbytes, dtype)
        known = self._predicted.get(key)
        if known is None:
            if len(self._predicted) >= PREDICTIONS_KEPT:  # calls of ever new sizes: start over
                self._predicted.clear()
            known = self._predicted[key] = self._predict_us(*key)
        return known

    def _predict_us(self, collective: str, scheme: str, algorithm: str, bits: float | None,
                    levels: HierarchicalPlan | None, nbytes: int, dtype: str) -> float:
        total = self._price(scheme, algorithm, levels, bits, nbytes, dtype).total_us
        return total if collective == "allreduce" else total / 2

    def _price(self, scheme: str, algorithm: str, levels: HierarchicalPlan | None,
               bits: float | None, nbytes: int, dtype: str) -> CostBreakdown:
        """The cost model's breakdown of an all-reduce candidate."""
        dtype = dtype if dtype in DTYPE_NBYTES else "float32"
        tiles = max(1, -(-nbytes // self.tile_nbytes))
        params = self.params
        if algorithm == NATIVE:  # the group's own all-reduce: a ring, untiled
            algorithm, tiles = "ring" if self.job.world_size > 2 else "direct", 1
            params = self.native_params
        if levels is not None:
            return price_hierarchical(levels, self.graph, nbytes, dtype=dtype, tiles=tiles,
                                      params=params)
        return price_allreduce(algorithm, self.graph, nbytes, scheme=scheme, bits=bits,
                               dtype=dtype, tiles=tiles, params=params)

    def _least(self, collective: str, nbytes: int, dtype: str, scheme: str, bits: float | None,
               force: str | None) -> tuple[float, tuple[Any, ...]]:
        """(us, candidate) of the cost model's least time among :meth:`plan`'s candidates."""
        return min(((self.predict_us(collective, *cand, nbytes, dtype), cand)
                    for cand in self.candidates(collective, scheme, bits, force=force)),
                   key=lambda priced: priced[0])

    def least_us(self, collective: str, nbytes: int, dtype: str, *, scheme: str = "auto",
                 bits: float | None = None, force: str | None = None) -> float:
        """The cost model's least time among the plans :meth:`plan` weighs for a call of
        ``nbytes``, uncalibrated (the call alone, not beside other work: measured calls that
        shared the cores with a backward pass would price it above that), without choosing one
        (nothing explored, cached or held)."""
        return self._least(collective, nbytes, dtype, scheme, bits, force)[0]

    def least_codec_us(self, nbytes: int, dtype: str, *, scheme: str = "auto",
                       bits: float | None = None, force: str | None = None) -> float:
        """The codec part (the steps' kernel time, on the machine's cores as its ranks share
        them) of the all-reduce plan :meth:`least_us` prices least."""
        key = ("codec", scheme, bits, force, nbytes, dtype)
        known = self._predicted.get(key)
        if known is None:
            name, algorithm, b, levels = self._least("allreduce", nbytes, dtype, scheme, bits,
                                                     force)[1]
            breakdown = self._price(name, algorithm, levels, b, nbytes, dtype)
            known = self._predicted[key] = sum(step.kernel_us for step in breakdown.steps)
        return known

    def plan(self, collective: str, nbytes: int, dtype: str, *, scheme: str = "auto",
             bits: float | None = None, algorithm: str = "auto", native: bool = False,
             force: str | None = None) -> Plan:
        """The plan of a call: the least calibrated prediction, or a close candidate never run
        (explored once) or measured once (explored again). The same on every rank where the
        planner's inputs are."""
        size_class = 0 if nbytes <= 0 else int(math.log(nbytes, _SIZE_CLASS_BASE))
        key = (collective, size_class, dtype, scheme, bits, algorithm, native, force)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        options = self.candidates(collective, scheme, bits, native=native, force=force)
        stored = (self.stored_algorithm(nbytes, dtype, scheme)
                  if algorithm == "auto" and scheme != "auto" else None)
        if stored is not None:  # the table's flat algorithm, priced against two levels
            flat = {(c[0], c[2]) for c in options if c[3] is None}
            options = [(name, stored, b, None) for name, b in sorted(flat, key=str)] + [
                c for c in options if c[3] is not None]
        if algorithm != "auto":
            options = [c for c in options if c[1] == algorithm]
            if not options:
                raise InvalidArgumentError(f"no {collective} plan with algorithm {algorithm!r}")
        typical = int(_SIZE_CLASS_BASE ** (size_class + 0.5)) if nbytes > 0 else 0
        labelled = [(_label(*cand), cand) for cand in options]
        priced = sorted(((self.predict_us(collective, *cand, typical, dtype) * self.factor(label),
                          label, cand) for label, cand in labelled), key=lambda p: (p[0], p[1]))
        best_us, best_label, best = priced[0]
        reason = f"least predicted time ({best_us / 1e3:.2f} ms)"
        held = self._incumbent.get(key)
        kept = next((p for p in priced[1:]
                     if p[1] == held and held in self.factors and best_label in self.factors
                     and p[0] * (1 - SWITCH_MARGIN) <= best_us), None)
        if kept is not None:
            best_us, best_label, best = kept
            reason = f"kept: predicted within {SWITCH_MARGIN:.0%} of the best ({priced[0][1]})"
        if stored is not None and best[1] == stored:
            reason += f"; flat algorithm from the stored table {self.table_key}"
        explored = next((p for p in priced if p[1] != best_label and best_label in self.factors
                         and ((p[1] not in self.factors and p[0] <= EXPLORE_WITHIN * best_us)
                              or (len(self._ratios.get(p[1], ())) == 1
                                  and p[0] <= SECOND_LOOK_WITHIN * best_us))), None)
        if explored is not None:
            again = explored[1] in self.factors
            best_us, best_label, best = explored
            reason = (f"explored again: predicted within {SECOND_LOOK_WITHIN:g}x of the best "
                      f"and measured once" if again else
                      f"explored once: predicted within {EXPLORE_WITHIN:g}x of the best and "
                      f"never measured")
        plan = Plan(collective, best[0], best[1], best[2], best[3], best_us, reason,
                    tuple((label, us) for us, label, _ in priced), dtype)
        if explored is None:  # an explored plan is not yet the one in use
            self._incumbent[key] = best_label
        self._cache[key] = plan
        return plan

    def stored_algorithm(self, nbytes: int, dtype: str, scheme: str) -> str | None:
        """The flat algorithm a tuned table for this job gives ``scheme`` at this size, or None."""
        from .topology import tuning

        if self.job.world_size <= 2:
            return None
        table = tuning.find_table(self.job.world_size, dtype, self.table_key)
        entry = table.lookup(nbytes) if table is not None else None
        algorithm = dict(entry.flat_by_scheme).get(scheme) if entry is not None else None
        return algorithm if algorithm in ("ring", "butterfly", "direct") else None

    @functools.cached_property
    def table_key(self) -> str:
        from .topology import tuning

        return tuning.detected_key(self.job.world_size)

    def fork(self) -> Planner:
        """A copy with its own calibration, for a communicator whose calls interleave with this
        one's in an order that differs between ranks (a DDP hook's lane)."""
        twin = Planner(self.job, self.rates)
        twin.factors = dict(self.factors)
        twin._ratios = {k: collections.deque(v, maxlen=CALIBRATION_WINDOW)
                        for k, v in self._ratios.items()}
        return twin

    @property
    def samples(self) -> Counter[str]:
        """Measured calls per plan in its calibration window (at most CALIBRATION_WINDOW)."""
        return Counter({label: len(window) for label, window in self._ratios.items()})

    def factor(self, label: str) -> float:
        """Measured / predicted of a candidate: its own, else the geometric mean of the measured
        candidates of its kind (flat, two-level, the group's own all-reduce), else 1. A kind's
        model error is its own: two levels on CPU ranks measured 3-5x their prediction while the
        flat rings of the same job measured ~1.1x, and with one mean for all a flat ring never
        run was priced out of exploration by the two-level calls measured before it."""
        if label in self.factors:
            return self.factors[label]
        kind = _kind(label)
        logs = [math.log(f) for other, f in self.factors.items() if _kind(other) == kind]
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def observe(self, plan: Plan, measured_us: float, nbytes: int | None = None) -> None:
        """``plan`` ran a call of ``nbytes`` (default: its size class's) in ``measured_us`` (the
        slowest rank's, agreed by the caller): move its factor and drop cached plans."""
        if plan.predicted_us <= 0 or measured_us <= 0:
            return
        label = plan.label
        if nbytes is None:
            raw = plan.predicted_us / self.factor(label)
        else:
            raw = self.predict_us(plan.collective, plan.scheme, plan.algorithm, plan.bits,
                                  plan.levels, int(nbytes), plan.dtype)
        if raw <= 0:
            return
        ratio = measured_us / raw
        window = self._ratios.setdefault(label, collections.deque(maxlen=CALIBRATION_WINDOW))
        window.append(ratio)
        self.factors[label] = min(window)
        self._cache.clear()

    def describe(self) -> str:
        r = self.rates
        links = [f"{name} {gbps:.2f} Gb/s per {unit}" for name, gbps, unit in (
            ("intra-host", r.intra_gbps, "flow"), ("inter-host", r.inter_gbps, "host port"))
            if gbps is not None]
        kernels = ", ".join(f"{name} {k.compress_ns:.2f}/{k.decompress_ns:.2f} ns"
                            for name, k in r.kernels)
        return (f"{self.job.describe()}; measured: {', '.join(links) or 'no links'}; kernels "
                f"(encode/decode per coordinate, one core): {kernels}; "
                f"{r.cores_per_machine} cores per machine")


def flat_algorithms(world_size: int) -> tuple[str, ...]:
    """The flat algorithms plans choose between (two ranks: ``direct`` only)."""
    return FLAT_ALGORITHMS if world_size > 2 else ("direct",)


def build_planner(transport: Any, device: torch.device | None = None, *,
                  bits: float = 5.0, what: str = "planner") -> Planner:
    """The planner of a communicator over ``transport`` (collective); the probes' bytes are
    left out of the transport's counters and kept in :attr:`Planner.probe_nbytes`."""
    counters = transport.counters
    before = dict(counters)
    job = discover_job(transport, device)
    rates = measure_rates(transport, job, device=device, bits=bits, what=f"{what} probe")
    planner = Planner(job, rates)
    planner.probe_nbytes = counters["bytes_sent"] - before["bytes_sent"]
    counters.update(before)
    return planner


def fingerprint(plan: Plan) -> int:
    """A 31-bit digest of a plan's decision (for checks that every rank made the same)."""
    return zlib.crc32(repr((plan.collective, plan.label)).encode()) & 0x7FFFFFFF
