"""The numerical simulator: the real codecs over a schedule for ``n`` virtual workers at once.

What a cluster of ``n`` ranks would compute is reproduced without ``n`` processes: every rank's
part of the computation is done here, batched across ranks and chunks, and the vNMSE of the
result against the exact (fp64) sum is reported. For ``dynamiq`` the bytes are the executor's:
the same layout (one :class:`~dqcoll.schemes.dynamiq.DynamiqCall` built with the all-reduced
statistics), the same random numbers (:func:`~dqcoll.schemes.dynamiq.rng.rounding_uniforms` of
each row's own rank, passed to :func:`~dqcoll.schemes.dynamiq.codec.encode_torch`), the same
order of accumulation (children in step order, then by source rank) - so with the same seed the
simulated output equals the ``local`` transport's bit for bit (tested).

Streaming keeps memory bounded:

1. **pass 1**, one worker at a time: draw its gradient from the source, add it to the fp64 exact
   sum, compute its statistics (DynamiQ: centring, per-super-group mean and norm) and write its
   working rows to a scratch file (``numpy.memmap``, so the page cache holds what fits);
2. **layout**: the all-reduced statistics give the bit allocation, the reorder and the chunks;
3. **pass 2**, a batch of chunks at a time (as many rows as ``memory_mb`` allows for all
   ``n`` workers): load the batch's rows of every worker, walk the reduce steps of the schedule
   restricted to those chunks - leaves encode, receivers decode-accumulate in arrival order,
   forwarding nodes re-encode, the sink encodes and decodes its own output - and score the sink's
   decoded rows against the exact sum. The all-gather forwards the sink's bytes unchanged, so it
   adds no error and is not simulated.

Each step's work is one codec call per width over the rows of every transfer of the step in the
batch, whatever rank sends them: a ring at n = 1024 is ~1000 steps x a few calls per batch, not a
million per-rank calls. Ctrl-C between batches returns the vNMSE of the chunks done so far
(``complete=False``).

Hierarchical plans (uncompressed inside hosts) are simulated as what they compute: the inter-host
all-reduce of each host's fp32 sum, one shard per local rank (:func:`simulate_hierarchical`).

Rejected: running ``n`` threads over the ``local`` transport (memory ``n x buffer`` and one codec
call per rank per step), and sampling a subset of chunks (the bit allocation couples all of them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from .. import schemes
from ..errors import InvalidArgumentError, UnsupportedError
from ..schemes.base import CallContext
from ..schemes.dynamiq import rng
from ..schemes.dynamiq.codec import (
    ALL_WIDTHS,
    SUPER,
    RoundingMode,
    decode_torch,
    encode_torch,
    record_nbytes,
    stats_center_rounded_torch,
    stats_center_torch,
)
from ..types import Collective, ReduceOp
from .hierarchical import HierarchicalPlan
from .schedule import Role, Schedule

__all__ = ["RankData", "SimulationResult", "simulate", "simulate_hierarchical"]

Progress = Callable[[int, int], None]


class RankData(Protocol):
    """Anything that hands out one fp32 1-D tensor per rank (a ``dqcoll.eval.sources`` source)."""

    world_size: int
    numel: int

    def rank_tensor(self, rank: int) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    vnmse: float
    world_size: int
    numel: int
    scheme: str
    algorithm: str
    bits_used: float | None  # wire bits per coordinate the scheme chose (DynamiQ: incl. stats)
    seconds: float
    complete: bool  # False if interrupted: vnmse covers the chunks done so far
    chunks_done: int
    chunks_total: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _StatsReplay:
    """The small all-reduces of one virtual rank's ``Scheme.begin`` (``ctx.reduce``): each
    returns values computed beforehand from every worker (in rank order, as the local transport
    sums them)."""

    def __init__(self, results: list[torch.Tensor]) -> None:
        self._results = list(results)

    def __call__(self, tensor: torch.Tensor, op: str, what: str) -> None:
        if not self._results:
            raise UnsupportedError(f"the simulator has no statistics for {what}")
        tensor.copy_(self._results.pop(0))


# -- per-scheme adapters: layout, storage rows and batched codec calls ----------------------------


class _Adapter:
    """How one scheme's rows are laid out and coded. A *row* is the unit the codec works on
    (a DynamiQ super-group; a whole chunk for element-wise schemes)."""

    op: ReduceOp
    rows: int
    row_len: int
    record_len: int  # bytes of the largest record
    chunk_bounds: list[int]  # chunk c = layout rows [chunk_bounds[c], chunk_bounds[c + 1])
    row_map: np.ndarray  # layout row -> stored row
    bits_used: float | None = None

    def store(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        """The rows [stored order] a rank starts the collective with."""
        raise NotImplementedError

    def stats(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        return []

    def layout(self, x0: torch.Tensor, stats: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def prepare_batch(self, lo: int, hi: int) -> None:
        pass

    def encode(self, values: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, records: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def estimate(self, final: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(estimated values, valid mask) of layout rows [lo, hi), comparable to the exact rows."""
        raise NotImplementedError

    def exact_rows(self, exact: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        raise NotImplementedError


class _DynamiqAdapter(_Adapter):
    def __init__(self, scheme: Any, numel: int, n: int, op: ReduceOp, seed: int, step: int):
        self.scheme = scheme
        self.config = scheme.config
        self.numel = numel
        self.n = n
        self.op = op
        self.seed = seed
        self.step = step
        self.rows = -(-numel // SUPER)
        self.row_len = SUPER
        # the longest record a row can get (raw 16-bit rows only when the scheme allows them)
        self.record_len = max(record_nbytes(w, self.config.scales) for w in ALL_WIDTHS
                              if w <= getattr(scheme, "max_width", 8))
        row_start = torch.arange(self.rows, dtype=torch.int64) * SUPER
        self.valid = (numel - row_start).clamp(max=SUPER)
        self._uniforms: torch.Tensor | None = None

    def _rows_of(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.zeros(self.rows, SUPER, dtype=torch.float32)
        flat.view(-1)[: self.numel] = x.reshape(-1).float()
        if self.op is ReduceOp.AVG:
            flat.div_(self.n)
        return flat

    def store(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        if getattr(self.scheme, "stats", "fp32") in ("bf16", "norm16"):
            centred, mean, norm2 = stats_center_rounded_torch(
                self._rows_of(x), self.valid, centre=self.scheme.stats == "bf16")
            self._last_stats = torch.stack([mean, norm2]).to(torch.bfloat16)  # summed in bf16
            if self.scheme.stats == "norm16":
                self._last_stats = self._last_stats[1:].clone()  # the norm only
        else:
            centred, mean, norm2 = stats_center_torch(self._rows_of(x), self.valid)
            self._last_stats = torch.stack([mean, norm2])
        return centred

    def stats(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        return [self._last_stats]

    def layout(self, x0: torch.Tensor, stats: list[torch.Tensor]) -> None:
        from ..schemes.dynamiq.scheme import DynamiqCall

        ctx = CallContext(0, self.n, self.op, self.seed, self.step, Collective.ALLREDUCE,
                          "simulate", _StatsReplay(stats),
                          schedule=getattr(self, "schedule_shape", None))
        call = DynamiqCall(self.scheme, x0.reshape(-1).float(), ctx)
        self.call = call
        self.chunk_bounds = list(call.chunk_bounds)
        self.row_map = call.order.cpu().numpy()
        self.widths = call.allocation.widths[call.order.cpu()]  # layout order
        self.hop = None
        if call.hop is not None:  # prototype hop_widths: widths per partial-sum size
            order = call.order.cpu()
            self.hop = {c: w[order] for c, w in call.hop.items()}
        self.index_base = call.index_base.cpu()
        self.mean_sorted = call.mean_sorted.cpu()
        self.key = call.key
        self.bits_used = float(call.info["bits"])
        self.correlated = self.config.rounding is RoundingMode.CORRELATED

    def prepare_batch(self, lo: int, hi: int) -> None:
        # Every rank's uniforms for the batch's rows: each (rank, row) is encoded exactly once
        # in the reduce phase, so this is the rounding work of the collective, done per rank.
        index = self.index_base[lo:hi, None] + torch.arange(SUPER)
        self._lo = lo
        self._uniforms = torch.stack([
            rng.rounding_uniforms(self.key, r, self.n, index, self.correlated)
            for r in range(self.n)])

    def _by_width(self, rows: torch.Tensor, counts: torch.Tensor | None = None
                  ) -> list[tuple[int, torch.Tensor]]:
        widths = self.widths[rows]
        if self.hop is not None and counts is not None:
            widths = widths.clone()
            for c, w in self.hop.items():
                sel = counts == c
                widths[sel] = w[rows[sel]]
        return [(w, torch.nonzero(widths == w).squeeze(1)) for w in ALL_WIDTHS
                if bool((widths == w).any())]

    def encode(self, values: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        assert self._uniforms is not None
        out = torch.zeros(values.shape[0], self.record_len, dtype=torch.uint8)
        for width, pick in self._by_width(rows, counts):
            u = self._uniforms[ranks[pick], rows[pick] - self._lo]
            records = encode_torch(values[pick].contiguous(), width, self.index_base[rows[pick]],
                                   0, self.n, self.key, self.config, uniforms=u)
            out[pick, : records.shape[1]] = records
        return out

    def decode(self, records: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.zeros(records.shape[0], SUPER, dtype=torch.float32)
        for width, pick in self._by_width(rows, counts):
            size = record_nbytes(width, self.config.scales)
            out[pick] = decode_torch(records[pick, :size].contiguous(), width, self.config)
        return out

    def estimate(self, final: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = final + self.mean_sorted[lo:hi, None]
        valid = self.valid[torch.as_tensor(self.row_map[lo:hi])]
        mask = torch.arange(SUPER)[None, :] < valid[:, None]
        return values, mask

    def exact_rows(self, exact: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        padded = torch.zeros(self.rows * SUPER, dtype=torch.float64)
        padded[: self.numel] = exact
        return padded.view(self.rows, SUPER)[torch.as_tensor(self.row_map[lo:hi])]


class _NoneAdapter(_Adapter):
    """``none``: one row per chunk (the BlockCall chunks, padded to the longest), values on the
    wire in fp32 (the simulator's inputs are fp32), summed in fp32."""

    def __init__(self, numel: int, n: int, op: ReduceOp):
        from ..schemes.elementwise import split_blocks

        self.numel = numel
        self.n = n
        self.op = op
        bounds = split_blocks(numel, n)
        self.element_bounds = bounds
        self.rows = n
        self.row_len = max(1, max(b - a for a, b in itertools.pairwise(bounds)))
        self.record_len = 4 * self.row_len
        self.chunk_bounds = list(range(n + 1))
        self.row_map = np.arange(n)
        lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)])
        self.mask_all = torch.arange(self.row_len)[None, :] < lengths[:, None]

    def store(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(self.rows, self.row_len, dtype=torch.float32)
        rows[self.mask_all] = x.reshape(-1).float()
        return rows

    def layout(self, x0: torch.Tensor, stats: list[torch.Tensor]) -> None:
        pass

    def encode(self, values: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        return values.contiguous().view(torch.uint8)

    def decode(self, records: torch.Tensor, rows: torch.Tensor,
               counts: torch.Tensor | None = None) -> torch.Tensor:
        return records.contiguous().view(torch.float32)

    def estimate(self, final: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        values = final / self.n if self.op is ReduceOp.AVG else final
        return values, self.mask_all[lo:hi]

    def exact_rows(self, exact: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        rows = torch.zeros(self.rows, self.row_len, dtype=torch.float64)
        rows[self.mask_all] = exact
        return rows[lo:hi]


def _adapter(scheme_name: str, options: dict[str, Any], numel: int, n: int, op: ReduceOp,
             seed: int, step: int) -> _Adapter:
    if scheme_name == "dynamiq":
        scheme = schemes.get("dynamiq", **options)
        return _DynamiqAdapter(scheme, numel, n, op, seed, step)
    if scheme_name == "none":
        return _NoneAdapter(numel, n, op)
    raise UnsupportedError(
        f"the simulator runs 'dynamiq' and 'none'; {scheme_name!r} has no batched adapter yet "
        f"(use dqcoll eval over the local transport for it)")


# -- the schedule, per step, as arrays ------------------------------------------------------------

_ROLE_CODE = {Role.ACCUMULATE: 0, Role.FORWARD: 1, Role.FINAL: 2}


@dataclasses.dataclass(frozen=True)
class _StepArrays:
    src: np.ndarray
    dst: np.ndarray
    chunk: np.ndarray
    role: np.ndarray
    leaf: np.ndarray  # the sender compresses its own chunk (nothing arrived for it)
    arrival: np.ndarray  # k-th arrival of (dst, chunk) in this step, by source rank


def _step_arrays(schedule: Schedule) -> list[_StepArrays]:
    received: set[tuple[int, int]] = set()
    result = []
    for step in schedule.reduce:
        ts = step.transfers  # sorted by (src, dst, chunk)
        src = np.array([t.src for t in ts], dtype=np.int64)
        dst = np.array([t.dst for t in ts], dtype=np.int64)
        chunk = np.array([t.chunk for t in ts], dtype=np.int64)
        role = np.array([_ROLE_CODE[t.role] for t in ts], dtype=np.int64)
        leaf = np.array([(t.src, t.chunk) not in received for t in ts], dtype=bool)
        seen: dict[tuple[int, int], int] = {}
        arrival = np.empty(len(ts), dtype=np.int64)
        for i, t in enumerate(ts):
            arrival[i] = seen.get((t.dst, t.chunk), 0)
            seen[(t.dst, t.chunk)] = arrival[i] + 1
        received.update((t.dst, t.chunk) for t in ts)
        result.append(_StepArrays(src, dst, chunk, role, leaf, arrival))
    return result


def _expand(chunks: np.ndarray, bounds: np.ndarray, lo: int) -> tuple[np.ndarray, np.ndarray]:
    """(transfer index, layout row - lo) for every row of every transfer's chunk."""
    starts = bounds[chunks]
    counts = bounds[chunks + 1] - starts
    owner = np.repeat(np.arange(len(chunks)), counts)
    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + offsets - lo


def _batches(bounds: list[int], rows_per_batch: int) -> list[tuple[int, int]]:
    """Consecutive chunk ranges [c0, c1) of at most ``rows_per_batch`` rows (at least one chunk)."""
    result = []
    c0 = 0
    n = len(bounds) - 1
    while c0 < n:
        c1 = c0 + 1
        while c1 < n and bounds[c1 + 1] - bounds[c0] <= rows_per_batch:
            c1 += 1
        result.append((c0, c1))
        c0 = c1
    return result


def _run_flat(
    schedule: Schedule,
    data: RankData,
    adapter: _Adapter,
    *,
    memory_mb: float,
    progress: Progress | None,
    scratch_dir: str | None,
) -> tuple[float, float, int, int, bool]:
    """Both passes over ``data``; returns (error, norm, chunks done, chunks total, complete)."""
    n = schedule.world_size
    numel = data.numel
    exact = torch.zeros(numel, dtype=torch.float64)
    stats_sum: list[torch.Tensor] | None = None
    with tempfile.TemporaryDirectory(dir=scratch_dir, prefix="dqcoll-sim-") as tmp:
        store = np.lib.format.open_memmap(os.path.join(tmp, "rows.npy"), mode="w+",
                                          dtype=np.float32,
                                          shape=(n, adapter.rows, adapter.row_len))
        total_units = 2 * n
        for r in range(n):  # pass 1
            x = data.rank_tensor(r)
            exact += x.double()
            store[r] = adapter.store(r, x).numpy()
            stats = adapter.stats(r, x)
            if stats_sum is None:
                stats_sum = [s.clone() for s in stats]
            else:
                for acc, s in zip(stats_sum, stats, strict=True):
                    acc.add_(s)  # rank order, like the local transport
            if progress:
                progress(r + 1, total_units)
        from ..schemes.base import ScheduleShape

        subtree = schedule.subtree_sizes()
        adapter.schedule_shape = ScheduleShape(schedule.algorithm, n, subtree)  # type: ignore
        adapter.layout(data.rank_tensor(0), stats_sum or [])
        bounds = np.asarray(adapter.chunk_bounds, dtype=np.int64)
        # Per batch row: the rows of all n workers, their uniforms, payloads: ~3 copies + records.
        per_row = n * (adapter.row_len * 4 * 3 + adapter.record_len)
        rows_per_batch = max(1, int(memory_mb * 2**20 // max(per_row, 1)))
        steps = _step_arrays(schedule)
        batches = _batches(adapter.chunk_bounds, rows_per_batch)
        error = norm = 0.0
        done = 0
        complete = True
        try:
            for c0, c1 in batches:
                lo, hi = int(bounds[c0]), int(bounds[c1])
                if hi > lo:
                    e, m = _run_batch(steps, store, adapter, exact, c0, c1, lo, hi, bounds, n,
                                      torch.tensor(subtree, dtype=torch.int64))
                    error, norm = error + e, norm + m
                done = c1
                if progress:
                    progress(n + (n * c1) // len(adapter.chunk_bounds[:-1]), total_units)
        except KeyboardInterrupt:
            complete = False
        del store
    return error, norm, done, len(adapter.chunk_bounds) - 1, complete


def _run_batch(steps: list[_StepArrays], store: np.ndarray, adapter: _Adapter,
               exact: torch.Tensor, c0: int, c1: int, lo: int, hi: int, bounds: np.ndarray,
               n: int, subtree: torch.Tensor | None = None) -> tuple[float, float]:
    rows = hi - lo
    work = torch.from_numpy(np.ascontiguousarray(store[:, adapter.row_map[lo:hi]]))
    payload = torch.zeros(n, rows, adapter.record_len, dtype=torch.uint8)
    final = torch.zeros(rows, adapter.row_len, dtype=torch.float32)
    adapter.prepare_batch(lo, hi)
    for arrays in steps:
        keep = (arrays.chunk >= c0) & (arrays.chunk < c1)
        if not keep.any():
            continue
        src, dst, chunk = arrays.src[keep], arrays.dst[keep], arrays.chunk[keep]
        role, leaf, arrival = arrays.role[keep], arrays.leaf[keep], arrays.arrival[keep]
        owner, local = _expand(chunk, bounds, lo)
        if owner.size == 0:
            continue
        t_src = torch.from_numpy(src[owner])
        t_dst = torch.from_numpy(dst[owner])
        t_row = torch.from_numpy(local)
        layout_rows = t_row + lo
        t_chunk = torch.from_numpy(chunk[owner])
        src_count = dst_count = None
        if subtree is not None:  # partial-sum sizes (the executor's counts)
            src_count = subtree[t_src, t_chunk]
            dst_count = subtree[t_dst, t_chunk]
        is_leaf = torch.from_numpy(leaf[owner])
        if bool(is_leaf.any()):  # leaves compress their own rows
            pick = torch.nonzero(is_leaf).squeeze(1)
            s, r = t_src[pick], t_row[pick]
            payload[s, r] = adapter.encode(work[s, r], s, layout_rows[pick],
                                           None if src_count is None else src_count[pick])
        t_arrival = torch.from_numpy(arrival[owner])
        for k in range(int(t_arrival.max()) + 1):  # children in order of source rank
            pick = torch.nonzero(t_arrival == k).squeeze(1)
            s, d, r = t_src[pick], t_dst[pick], t_row[pick]
            work[d, r] += adapter.decode(payload[s, r], layout_rows[pick],
                                         None if src_count is None else src_count[pick])
        t_role = torch.from_numpy(role[owner])
        for code in (_ROLE_CODE[Role.FORWARD], _ROLE_CODE[Role.FINAL]):
            pick = torch.nonzero(t_role == code).squeeze(1)
            if pick.numel() == 0:
                continue
            d, r = t_dst[pick], t_row[pick]
            cnt = None if dst_count is None else dst_count[pick]
            records = adapter.encode(work[d, r], d, layout_rows[pick], cnt)
            if code == _ROLE_CODE[Role.FORWARD]:
                payload[d, r] = records
            else:  # the sink decodes its own bytes, as every rank will after the all-gather
                final[r] = adapter.decode(records, layout_rows[pick], cnt)
    if n == 1:  # nothing moves: the only rank's rows are the result
        final = work[0]
    estimate, mask = adapter.estimate(final, lo, hi)
    truth = adapter.exact_rows(exact, lo, hi)
    if adapter.op is ReduceOp.AVG:
        truth = truth / n
    diff = (estimate.double() - truth) * mask
    return float((diff * diff).sum()), float((truth * truth * mask).sum())


def _parse_op(op: str | ReduceOp) -> ReduceOp:
    return ReduceOp.parse(op)


def simulate(
    schedule: Schedule,
    data: RankData,
    *,
    scheme: str = "dynamiq",
    bits: float | None = 5.0,
    op: str | ReduceOp = "sum",
    seed: int = 0,
    step: int = 0,
    memory_mb: float = 512.0,
    progress: Progress | None = None,
    scratch_dir: str | None = None,
    **scheme_options: Any,
) -> SimulationResult:
    """vNMSE of an all-reduce of ``data`` (one tensor per rank) along ``schedule``.

    ``seed``/``step`` key the random rounding exactly as ``dqcoll.allreduce(..., seed=, step=)``
    does. ``memory_mb`` bounds the batch of rows held for all workers at once.
    """
    n = schedule.world_size
    if data.world_size != n:
        raise InvalidArgumentError(
            f"data has {data.world_size} ranks, schedule {schedule.algorithm!r} {n}")
    start = time.perf_counter()
    options = dict(scheme_options)
    if scheme == "dynamiq" and bits is not None:
        options["bits"] = bits
    adapter = _adapter(scheme, options, data.numel, n, _parse_op(op), seed, step)
    error, norm, done, total, complete = _run_flat(
        schedule, data, adapter, memory_mb=memory_mb, progress=progress, scratch_dir=scratch_dir)
    value = error / norm if norm > 0 else (0.0 if error == 0 else math.inf)
    return SimulationResult(value, n, data.numel, scheme, schedule.algorithm, adapter.bits_used,
                            time.perf_counter() - start, complete, done, total)


class _HostShards:
    """Per-host fp32 sums of one shard of every rank's data: the inputs of the inter level."""

    def __init__(self, sums: np.ndarray, shard: int, shard_numel: int, numel: int) -> None:
        self.sums = sums
        self.world_size = sums.shape[0]
        lo = shard * shard_numel
        self.lo, self.hi = lo, min(lo + shard_numel, numel)
        self.numel = max(self.hi - self.lo, 0)

    def rank_tensor(self, rank: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.sums[rank, self.lo : self.hi]))


def simulate_hierarchical(
    plan: HierarchicalPlan,
    data: RankData,
    *,
    op: str | ReduceOp = "sum",
    seed: int = 0,
    step: int = 0,
    memory_mb: float = 512.0,
    progress: Progress | None = None,
    scratch_dir: str | None = None,
) -> SimulationResult:
    """vNMSE of :func:`dqcoll.hierarchical.hierarchical_allreduce` with an uncompressed intra level:
    every host's fp32 sum (in local-rank order) is all-reduced across hosts with the inter scheme,
    shard by shard."""
    if plan.intra.scheme != "none":
        raise UnsupportedError(
            f"the simulator runs hierarchical plans with intra scheme 'none', got "
            f"{plan.intra.scheme!r}")
    if data.world_size != plan.world_size:
        raise InvalidArgumentError(f"data has {data.world_size} ranks, plan {plan.world_size}")
    start = time.perf_counter()
    reduce_op = _parse_op(op)
    numel = data.numel
    g, h = plan.gpus_per_node, plan.nodes
    shard_numel = -(-numel // g)
    error = norm = 0.0
    complete = True
    done = 0
    with tempfile.TemporaryDirectory(dir=scratch_dir, prefix="dqcoll-simh-") as tmp:
        sums = np.lib.format.open_memmap(os.path.join(tmp, "hosts.npy"), mode="w+",
                                         dtype=np.float32, shape=(h, numel))
        sums[:] = 0
        for host, ranks in enumerate(plan.host_ranks):
            acc = torch.zeros(numel, dtype=torch.float32)
            for r in ranks:
                acc += data.rank_tensor(r).float()
            sums[host] = acc.numpy()
        schedule = plan.inter_schedule
        options = dict(plan.inter.options)
        if plan.inter.scheme == "dynamiq":
            options["bits"] = plan.inter.bits
        bits_used: list[float] = []
        try:
            for shard in range(g):
                shard_data = _HostShards(sums, shard, shard_numel, numel)
                if shard_data.numel == 0:
                    continue
                adapter = _adapter(plan.inter.scheme, options, shard_data.numel, h, reduce_op,
                                   seed, step)

                def shard_progress(i: int, total: int, shard: int = shard) -> None:
                    if progress:
                        progress(shard * total + i, g * total)

                e, m, _, _, ok = _run_flat(schedule, shard_data, adapter, memory_mb=memory_mb,
                                           progress=shard_progress, scratch_dir=tmp)
                error, norm = error + e, norm + m
                if adapter.bits_used is not None:
                    bits_used.append(adapter.bits_used)
                if not ok:
                    complete = False
                    break
                done += 1
        except KeyboardInterrupt:
            complete = False
        del sums
    value = error / norm if norm > 0 else (0.0 if error == 0 else math.inf)
    return SimulationResult(value, plan.world_size, numel, f"none|{plan.inter.scheme}",
                            plan.name, (sum(bits_used) / len(bits_used)) if bits_used else None,
                            time.perf_counter() - start, complete, done, g)
