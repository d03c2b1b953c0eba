"""What each collective did (docs/metrics.md): one :class:`CallRecord` per call, kept in a ring
in ``comm.metrics`` with totals of every call, written as NCCL Inspector JSON and Prometheus text.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import IO, Any, TextIO

import torch

from . import envs
from .types import Collective

__all__ = [
    "DEFAULT_RECORDS",
    "CallMetrics",
    "CallRecord",
    "Totals",
    "exact_wire_nbytes",
    "plan_of",
    "recording",
    "size_class",
]

log = logging.getLogger("dqcoll")

DEFAULT_RECORDS = 10000
# the ``bits`` a call of these schemes runs at when the caller gives none (dqcoll.prepare)
_BITS_SCHEMES = ("dynamiq", "auto")
_DEFAULT_BITS = 5.0
# NCCL's names of the collectives (NCCL Inspector's ``coll``)
_NCCL_NAMES = {"allreduce": "AllReduce", "reduce_scatter": "ReduceScatter",
               "all_gather": "AllGather"}
_FORMAT_VERSION = "dqcoll-1"
# the record's fields that its Inspector object holds as they are, in this order
_AS_RECORDED = ("collective", "status", "numel", "dtype", "device", "nbytes", "scheme", "algorithm",
                "bits_requested")


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One collective call on one rank, as it ran (fields: docs/metrics.md, "A record")."""

    collective: str
    seq: int
    rank: int
    world_size: int
    numel: int
    dtype: str
    device: str
    nbytes: int
    scheme: str
    algorithm: str
    bits_requested: float | None
    bits_wire: float | None
    plan: dict[str, Any]
    predicted_us: float | None
    measured_us: float
    wire_bytes: int
    exact_wire_bytes: int
    status: str
    start_us: int = 0  # the wall clock (Unix time, microseconds) when the call started

    def to_inspector(self, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The record as one NCCL Inspector object: ``header``, ``metadata``, ``coll_perf``."""
        n = max(self.world_size, 1)
        allreduce = self.collective == Collective.ALLREDUCE.value
        algo_bw = self.nbytes / (self.measured_us * 1e3) if self.measured_us > 0 else 0.0
        perf: dict[str, Any] = {
            "coll": _NCCL_NAMES.get(self.collective, self.collective),
            "coll_sn": self.seq,
            "coll_msg_size_bytes": self.nbytes if allreduce else self.nbytes // n,  # one shard
            "coll_exec_time_us": round(self.measured_us, 3),
            "coll_timing_source": "collective_cpu",
            # nccl-tests' algorithm and bus bandwidths, GB/s
            "coll_algobw_gbs": round(algo_bw, 6),
            "coll_busbw_gbs": round(algo_bw * ((2 * (n - 1) if allreduce else n - 1) / n), 6),
            **{name: getattr(self, name) for name in _AS_RECORDED},
            "bits_wire": None if self.bits_wire is None else round(self.bits_wire, 4),
            "wire_bytes": self.wire_bytes,
            "exact_wire_bytes": self.exact_wire_bytes,
            "predicted_us": None if self.predicted_us is None else round(self.predicted_us, 3),
            "plan": _plain(self.plan),
            "start_us": self.start_us,
        }
        return {"header": {"rank": self.rank, "n_ranks": self.world_size},
                "metadata": dict(metadata or {}), "coll_perf": perf}


@dataclasses.dataclass
class Totals:
    """Running sums of one (collective, scheme, algorithm, size class) over every call."""

    calls: int = 0
    errors: int = 0
    nbytes: int = 0
    wire_bytes: int = 0
    exact_wire_bytes: int = 0
    seconds: float = 0.0
    predicted_calls: int = 0  # calls that came with a predicted time
    predicted_seconds: float = 0.0  # their predicted times
    predicted_measured_seconds: float = 0.0  # their measured times

    def add(self, record: CallRecord) -> None:
        self.calls += 1
        self.errors += record.status != "ok"
        self.nbytes += record.nbytes
        self.wire_bytes += record.wire_bytes
        self.exact_wire_bytes += record.exact_wire_bytes
        self.seconds += record.measured_us * 1e-6
        if record.predicted_us is not None:
            self.predicted_calls += 1
            self.predicted_seconds += record.predicted_us * 1e-6
            self.predicted_measured_seconds += record.measured_us * 1e-6


TotalsKey = tuple[str, str, str, str]  # (collective, scheme, algorithm, size class)

# Prometheus counters: name -> (Totals field, help text)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("dqcoll_calls_total", "calls", "Collective calls run on this rank (any status)."),
    ("dqcoll_call_errors_total", "errors", "Collective calls that raised on this rank."),
    ("dqcoll_bytes_total", "nbytes",
     "Uncompressed bytes of the buffers the calls reduced or gathered."),
    ("dqcoll_wire_bytes_total", "wire_bytes",
     "Bytes this rank sent during the calls (payload, statistics, checks, headers)."),
    ("dqcoll_exact_wire_bytes_total", "exact_wire_bytes",
     "Bytes this rank would send in an uncompressed ring for the same calls."),
    ("dqcoll_call_seconds_total", "seconds", "Wall time of the calls on this rank."),
    ("dqcoll_predicted_calls_total", "predicted_calls", "Calls that came with a predicted time."),
    ("dqcoll_predicted_seconds_total", "predicted_seconds",
     "Predicted time of the calls that came with one."),
    ("dqcoll_predicted_call_seconds_total", "predicted_measured_seconds",
     "Measured wall time of the calls that came with a predicted time."),
)


def size_class(nbytes: int) -> str:
    """The power of two at or above ``nbytes``, as a label (``"0B"``, ``"512B"``, ``"4KiB"``)."""
    if nbytes <= 0:
        return "0B"
    exponent = (int(nbytes) - 1).bit_length()
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if exponent >= shift:
            return f"{1 << (exponent - shift)}{unit}"
    return f"{1 << exponent}B"


def exact_wire_nbytes(collective: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends in an uncompressed ring: ``2 (n-1)/n * nbytes`` for all-reduce,
    ``(n-1)/n * nbytes`` otherwise (rounded down)."""
    n = world_size
    if n <= 1 or nbytes <= 0:
        return 0
    hops = 2 * (n - 1) if collective == Collective.ALLREDUCE.value else n - 1
    return hops * nbytes // n


def _level(info: Mapping[str, Any]) -> dict[str, Any]:
    return {key: info.get(key) for key in ("scheme", "algorithm", "bits")}


def plan_of(info: Mapping[str, Any]) -> dict[str, Any]:
    """The plan a call ran, as plain data, from its ``comm.last_info``: ``info["plan"]``, else
    ``{"kind": "two_level", ...}`` or ``{"kind": "flat", ...}``, with ``"planner"`` where the
    planner decided (shape: docs/metrics.md, "A record")."""
    given = info.get("plan")
    if isinstance(given, Mapping):
        return dict(given)
    intra, inter = info.get("intra"), info.get("inter")
    if isinstance(intra, Mapping) and isinstance(inter, Mapping):
        levels: dict[str, Any] = {
            "kind": "two_level", "algorithm": info.get("algorithm"),
            "levels": [{"level": "intra", **_level(intra)}, {"level": "inter", **_level(inter)}]}
        phases = info.get("phases")
        if isinstance(phases, (list, tuple)):
            levels["phases"] = [{"level": p.get("level"), "collective": p.get("collective"),
                                 **_level(p)} for p in phases if isinstance(p, Mapping)]
    else:
        levels = {"kind": "flat", **_level(info)}
    planned = info.get("planned")
    if isinstance(planned, Mapping):
        levels["planner"] = {key: planned.get(key)
                             for key in ("label", "reason", "predicted_us", "alternatives")}
    return levels


def _plain(value: Any) -> Any:
    """``value`` as JSON can write it: non-finite floats become None, unknown types text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    try:
        number = float(value)  # floats, numpy scalars
    except (TypeError, ValueError):
        return str(value)
    return number if math.isfinite(number) else None


def _buffer_facts(buf: Any) -> tuple[int, int, str, str]:
    """(elements, bytes per element, dtype name, device type) of a buffer, from attributes only."""
    if isinstance(buf, torch.Tensor):
        return (buf.numel(), buf.element_size(), str(buf.dtype).removeprefix("torch."),
                buf.device.type)
    dtype = getattr(buf, "dtype", None)
    device = "cuda" if type(buf).__module__.startswith("cupy") else "cpu"
    return int(getattr(buf, "size", 0)), int(getattr(dtype, "itemsize", 0)), str(dtype), device


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class CallMetrics:
    """One communicator's call records (the most recent ``capacity``) and running totals.

    Thread-safe (``async_op`` calls record from the worker thread). ``capacity=None`` reads
    ``DQCOLL_METRICS_RECORDS``; ``jsonl``: the path every record is appended to (None: no file).
    """

    def __init__(self, rank: int, world_size: int, *, capacity: int | None = None,
                 jsonl: str | None = None) -> None:
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.capacity = envs.metrics_records() if capacity is None else int(capacity)
        self._records: collections.deque[CallRecord] = collections.deque(maxlen=self.capacity)
        self._totals: dict[TotalsKey, Totals] = {}
        self._lock = threading.Lock()
        self.jsonl_path = jsonl
        self._jsonl: TextIO | None = None
        self._warned = False
        self._metadata = {"inspector_output_format_version": _FORMAT_VERSION,
                          "hostname": socket.gethostname(), "pid": os.getpid()}

    @classmethod
    def for_transport(cls, transport: Any) -> CallMetrics:
        """The metrics of a communicator over ``transport``; a subgroup view writes no file."""
        path, rank = envs.metrics_jsonl(), str(transport.rank)
        if not path or getattr(transport, "parent", None) is not None:
            return cls(transport.rank, transport.world_size)
        path = path.replace("{rank}", rank) if "{rank}" in path else f"{path}.rank{rank}"
        return cls(transport.rank, transport.world_size, jsonl=path)

    def record_call(self, collective: str | Collective, buf: Any, *, seq: int,
                    measured_s: float, wire_bytes: int, info: Mapping[str, Any] | None = None,
                    scheme: str = "", algorithm: str = "", bits: float | None = None,
                    target: bool = False, error: BaseException | None = None,
                    start_s: float | None = None) -> CallRecord | None:
        """Build and keep the record of one call (the ring drops the oldest past ``capacity``, the
        totals keep all); returns it, or None where it could not be built (logged once). ``buf``:
        the caller's input (all-gather: this rank's shard); ``info``: the call's new
        ``comm.last_info`` or None; ``scheme`` / ``algorithm``: what the caller asked for, used
        where ``info`` does not say; ``target``: a target error replaced ``bits``."""
        try:
            name = collective if isinstance(collective, str) else collective.value
            n = self.world_size
            numel, itemsize, dtype, device = _buffer_facts(buf)
            if name == Collective.ALL_GATHER.value:
                numel *= n
            nbytes = numel * itemsize
            exact = exact_wire_nbytes(name, nbytes, n)
            requested = None if bits is None else float(bits)
            if requested is None and scheme in _BITS_SCHEMES and not target:
                requested = _DEFAULT_BITS
            info = info or {}
            predicted = info.get("predicted_us")  # the planner's, where it planned the call
            predicted = None if predicted is None else float(predicted)
            record = CallRecord(
                collective=name, seq=int(seq), rank=self.rank, world_size=n, numel=numel,
                dtype=dtype, device=device, nbytes=nbytes,
                scheme=str(info.get("scheme") or scheme),
                algorithm=str(info.get("algorithm") or algorithm), bits_requested=requested,
                bits_wire=8.0 * itemsize * wire_bytes / exact if exact else None,
                plan=plan_of(info) if info else {},
                predicted_us=predicted if predicted is None or math.isfinite(predicted) else None,
                measured_us=measured_s * 1e6, wire_bytes=int(wire_bytes), exact_wire_bytes=exact,
                status="ok" if error is None else type(error).__name__,
                start_us=int((time.time() if start_s is None else start_s) * 1e6))
            key = (name, record.scheme, record.algorithm, size_class(nbytes))
            with self._lock:
                self._records.append(record)
                self._totals.setdefault(key, Totals()).add(record)
                if self.jsonl_path is not None:
                    self._append_jsonl(record)
            return record
        except Exception as exc:  # never into the call
            self._warn_once(f"a call's metrics record was dropped: {type(exc).__name__}: {exc}")
            return None

    @property
    def records(self) -> list[CallRecord]:
        """The records still in the ring, oldest first."""
        with self._lock:
            return list(self._records)

    @property
    def calls(self) -> int:
        """Calls recorded since the communicator was made (the ring may hold fewer)."""
        with self._lock:
            return sum(t.calls for t in self._totals.values())

    def totals(self) -> dict[TotalsKey, Totals]:
        """A copy of the running totals per (collective, scheme, algorithm, size class)."""
        with self._lock:
            return {key: dataclasses.replace(t) for key, t in self._totals.items()}

    @property
    def last(self) -> CallRecord | None:
        """The most recent record, or None."""
        with self._lock:
            return self._records[-1] if self._records else None

    def inspector_line(self, record: CallRecord) -> str:
        """``record`` as one NCCL Inspector JSON line (no newline)."""
        metadata = {**self._metadata, "dump_timestamp_us": int(time.time() * 1e6)}
        return json.dumps(record.to_inspector(metadata), allow_nan=False)

    def to_jsonl(self, target: str | os.PathLike[str] | IO[str]) -> int:
        """Append the ring's records as NCCL Inspector JSON lines to a path or open text file;
        returns the number of lines."""
        lines = [self.inspector_line(r) for r in self.records]
        text = "".join(line + "\n" for line in lines)
        if isinstance(target, (str, os.PathLike)):
            with open(target, "a", encoding="utf-8") as f:
                f.write(text)
        else:
            target.write(text)
        return len(lines)

    def prometheus_text(self) -> str:
        """The running totals, the ring's size and its dropped records as Prometheus text."""
        totals = self.totals()
        keys = sorted(totals)
        out: list[str] = []
        for name, field, text in _COUNTERS:
            out += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
            out += [f"{name}{{{self._labels(key)}}} {getattr(totals[key], field)}" for key in keys]
        with self._lock:
            held, calls = len(self._records), sum(t.calls for t in self._totals.values())
        rank = f'rank="{self.rank}"'
        out += ["# HELP dqcoll_metrics_records Call records held in the ring (comm.metrics).",
                "# TYPE dqcoll_metrics_records gauge",
                f"dqcoll_metrics_records{{{rank}}} {held}",
                "# HELP dqcoll_metrics_records_dropped_total Call records the ring dropped "
                "(their calls stay in the totals).",
                "# TYPE dqcoll_metrics_records_dropped_total counter",
                f"dqcoll_metrics_records_dropped_total{{{rank}}} {calls - held}"]
        return "\n".join(out) + "\n"

    def _labels(self, key: TotalsKey) -> str:
        pairs = (*zip(("collective", "scheme", "algorithm", "size_class"), key, strict=True),
                 ("rank", str(self.rank)))
        return ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)

    def _append_jsonl(self, record: CallRecord) -> None:
        try:
            if self._jsonl is None:
                assert self.jsonl_path is not None
                self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
            self._jsonl.write(self.inspector_line(record) + "\n")
            self._jsonl.flush()
        except Exception as exc:
            path, self.jsonl_path = self.jsonl_path, None
            self._warn_once(f"DQCOLL_METRICS_JSONL: cannot append to {path!r}, no more records "
                            f"are written there: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Close the JSONL file, if one is open (later records open it again)."""
        with self._lock:
            if self._jsonl is not None:
                try:
                    self._jsonl.close()
                except Exception as exc:
                    self._warn_once(f"DQCOLL_METRICS_JSONL: closing failed: {exc}")
                self._jsonl = None

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("rank %d: metrics: %s", self.rank, message)


@contextlib.contextmanager
def recording(comm: Any, collective: str | Collective, buf: Any, *, scheme: Any = "",
              algorithm: str = "", bits: float | None = None,
              target: bool = False) -> Iterator[None]:
    """Record one collective on ``comm`` around the code it wraps, inside its ``in_flight``: wall
    time, ``bytes_sent`` delta and the new ``comm.last_info``; an exception passes on unchanged."""
    if not isinstance(scheme, str):
        spec = getattr(scheme, "spec", None)
        scheme = str(getattr(spec, "name", None) or type(scheme).__name__)
    seq = comm._calls  # what prepare_call's next_step() returns
    before, sent = comm.last_info, comm.counters["bytes_sent"]
    wall, start = time.time(), time.perf_counter()
    error: BaseException | None = None
    try:
        yield
    except BaseException as exc:
        error = exc
        raise
    finally:
        elapsed = time.perf_counter() - start
        try:
            info = comm.last_info
            wire = comm.counters["bytes_sent"] - sent
            probe = info.get("planner_probe") if info is not before else None
            if probe:  # the planner was made in this call: its probes' time is not the call's
                elapsed -= float(probe["s"])
        except Exception:
            info, wire = None, 0
        comm.metrics.record_call(
            collective, buf, seq=int(seq), measured_s=elapsed, wire_bytes=wire,
            info=None if info is before else info, scheme=scheme, algorithm=algorithm,
            bits=bits, target=target, error=error, start_s=wall)
