"""The numerical simulator: the real codecs over a schedule for ``n`` virtual workers at once.

What a cluster of ``n`` ranks would compute is reproduced without ``n`` processes: every rank's
part of the reduce phase is done here, batched across ranks and chunks, and the vNMSE of the
result against the exact (fp64) sum is reported. The bytes are the executor's: for ``dynamiq``
the layout comes from one real :class:`~dqcoll.schemes.dynamiq.DynamiqCall` built with the
all-reduced statistics, every row is encoded with the random numbers of the rank that encodes it
(:mod:`dqcoll.kernels.simulate_numba`), children are accumulated in the executor's order (step,
then source rank); for the block codecs (``none``, ``mxfp8/6/4``) the scheme's own
``encode_values`` / ``decode_into`` run on each chunk. With the same seed the simulated output
equals the ``local`` transport's bit for bit (tested at small n). The all-gather forwards the
sink's bytes unchanged, so it adds no error and is not simulated.

**What is held, and why** (``n`` ranks, ``numel`` coordinates per rank, ``S = numel / 256``
super-groups; nothing is ``O(n x numel)``):

* the exact fp64 sum (``8 numel`` bytes): the reference every chunk is scored against, summed
  in pass 1 and read once per coordinate in pass 2;
* the all-reduced statistics and the layout (``O(S)``: summed means/norms or block maxima,
  widths, reorder, chunk bounds), and per rank ``O(1)`` rounding keys plus its 4096-entry
  permutation column (``16 KiB x n``, DynamiQ's correlated rounding);
* in pass 2, one *batch* of chunks at a time, sized by ``memory_mb``: per (rank, unit) of the
  batch a slot index (``4 n`` bytes per unit), the payloads in flight between steps (a ring holds
  one per chunk, a butterfly ``n / 4``), unfinished partial sums (butterfly: ``n / 4`` per chunk)
  and one step's rows. A unit is a DynamiQ super-group, or a whole chunk of a block codec.

No rank's gradient is held: a source with row access (``lognormal-mixture``: counter-based noise,
:mod:`dqcoll.kernels.noise_numba`) makes the rows a step needs, when it needs them, identical in
both passes; each (rank, unit) is made once per pass, when that rank first touches that chunk.
Other sources are written to a scratch file in pass 1 (``numpy.memmap``, ``4 n numel`` bytes
on disk) and read back a step's rows at a time.

1. **pass 1**, rank by rank: add its tensor to the exact sum and its statistics (DynamiQ:
   per-super-group mean/norm as the configured ``stats`` sends them; MX ``scale=global``: the
   block maxima) to their running all-reduce, in rank order, as the ``local`` transport sums;
2. **layout**: the scheme's call built on rank 0's tensor with those sums replayed into its
   statistics all-reduce gives the widths, the reorder and the chunks;
3. **pass 2**, batch by batch of chunks, step by step of the reduce phase
   (:class:`~.steps.ReducePlan`: closed form for the placed ring/butterfly/direct, so no
   ``Schedule`` object of ``2 n (n - 1)`` transfers is built): every transfer of the step in the
   batch at once - leaves encode their own rows, receivers decode-accumulate in arrival order
   onto their own rows, forwarding receivers re-encode, the sink encodes and decodes its own
   output, which is scored against the exact sum. A ring's step holds every chunk's hop ``k``:
   at n = 8192 that is 8192 super-groups of 8192 ranks in one launch per width.

Ctrl-C during pass 2 returns the vNMSE of the batches done so far (``complete=False``).
Hierarchical plans (uncompressed inside hosts) are simulated as what they compute: the inter-host
all-reduce of each host's fp32 sum, one shard per local rank (:func:`simulate_hierarchical`).

Rejected: running ``n`` threads over the ``local`` transport (memory ``n x buffer`` and one codec
call per rank per step); holding every rank's rows for a batch of chunks (the first version:
``n x numel`` of scratch file, and a butterfly's working set grows as ``n x batch``); drawing
each rank's whole gradient again for every chunk (``n^2 x numel`` of generation on a ring);
sampling a subset of chunks (the bit allocation couples all of them).
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import torch

from .. import schemes
from ..errors import InvalidArgumentError, UnsupportedError
from ..kernels.codec import RAW_WIDTH, SUPER, record_nbytes, stats_center_rounded_torch
from ..schemes.base import CallContext, ScheduleShape
from ..types import Collective, ReduceOp
from .hierarchical import HierarchicalPlan
from .schedule import Schedule
from .steps import ACCUMULATE, FINAL, FORWARD, ReducePlan, StepArrays, plan_of_schedule

__all__ = ["RankData", "SimulationResult", "default_memory_mb", "peak_rss_bytes", "simulate",
           "simulate_hierarchical"]

Progress = Callable[[int, int], None]
MEMORY_FRACTION = 0.25  # default memory_mb: this share of the machine's memory ...
MEMORY_CAP_MB = 4096.0  # ... up to this (larger batches buy little once a step has ~8k rows)
BLOCK_SCHEMES = ("none", "mxfp8", "mxfp6", "mxfp4")


def default_memory_mb() -> float:
    """The default ``memory_mb``: a quarter of the machine's memory, at most 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    except (ValueError, OSError, AttributeError):
        total = 8192.0
    return float(min(MEMORY_FRACTION * total, MEMORY_CAP_MB))


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (``getrusage``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class RankData(Protocol):
    """Anything that hands out one fp32 1-D tensor per rank (a :mod:`.sources` source).
    With ``row_access`` true, ``fill_rows(ranks, starts, out)`` gives slices of them."""

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
    peak_rss_bytes: int = 0  # the process's, at the end (getrusage)
    memory_mb: float = 0.0  # the bound the batches were sized for
    batches: int = 0
    pass1_s: float = 0.0
    layout_s: float = 0.0
    pass2_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _StatsReplay:
    """The small all-reduces of one virtual rank's ``Scheme.begin`` (``ctx.reduce``): each
    returns values computed beforehand from every worker."""

    def __init__(self, results: list[torch.Tensor]) -> None:
        self._results = list(results)

    def __call__(self, tensor: torch.Tensor, op: str, what: str) -> None:
        if not self._results:
            raise UnsupportedError(f"the simulator has no statistics for {what}")
        tensor.copy_(self._results.pop(0))


# -- rows of any rank, when a step needs them -----------------------------------------------------


class _Rows:
    """``fill(ranks, starts, out)``: coordinates ``[start, start + L)`` of each rank's tensor,
    zero past ``numel``; from the source itself (row access) or from pass 1's scratch file."""

    def __init__(self, data: RankData, scratch_dir: str | None) -> None:
        self.data = data
        self.numel = data.numel
        self.direct = bool(getattr(data, "row_access", False))
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.scratch: np.ndarray | None = None
        if not self.direct:
            self._tmp = tempfile.TemporaryDirectory(dir=scratch_dir, prefix="dqcoll-sim-")
            self.scratch = np.lib.format.open_memmap(
                os.path.join(self._tmp.name, "rows.npy"), mode="w+", dtype=np.float32,
                shape=(data.world_size, max(self.numel, 1)))

    def keep(self, rank: int, x: torch.Tensor) -> None:
        if self.scratch is not None:
            self.scratch[rank, : self.numel] = x.numpy()

    def fill(self, ranks: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
        if not out.shape[0]:
            return
        if self.direct:
            self.data.fill_rows(ranks, starts, out)  # type: ignore[attr-defined]
            return
        assert self.scratch is not None
        length = out.shape[1]
        idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
        inside = idx < self.numel
        values = self.scratch[ranks[:, None], np.minimum(idx, self.numel - 1)]
        out[...] = np.where(inside, values, np.float32(0.0))

    def close(self) -> None:
        self.scratch = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


# -- per-scheme adapters: units, records, codec calls, scoring ------------------------------------


class _Adapter:
    """How one scheme's data is cut into *units* (the engine's rows: a DynamiQ super-group, or a
    whole chunk of a block codec, padded to the longest) and coded. Chunk ``c`` is units
    ``[chunk_units[c], chunk_units[c + 1])``."""

    op: ReduceOp
    n: int
    numel: int
    unit_len: int
    record_len: int
    chunk_units: np.ndarray
    bits_used: float | None = None

    def pass1(self, rank: int, x: torch.Tensor) -> None:
        """Add rank ``rank``'s statistics to the running all-reduce (ranks in order). ``x`` is
        its tensor padded with zeros to whole super-groups (fp32, 1-D; not to be written)."""

    def layout(self, x0: torch.Tensor, plan: ReducePlan) -> None:
        raise NotImplementedError

    def starts(self, units: np.ndarray) -> np.ndarray:
        """The first coordinate (of a rank's tensor) of each unit."""
        raise NotImplementedError

    def prepare(self, rows: np.ndarray, units: np.ndarray) -> None:
        """Turn a rank's raw values of ``units`` into what it starts the collective with."""

    def encode(self, x: np.ndarray, ranks: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray) -> None:
        raise NotImplementedError

    def decode(self, records: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray, accumulate: bool) -> None:
        """Decode (or add the decoded values) into ``out``; units without a record are left."""
        raise NotImplementedError

    def write(self, final: np.ndarray, units: np.ndarray, out: np.ndarray) -> None:
        """Put the sink's decoded ``units`` where the all-reduce's output has them."""
        values, coords, mask = self._result(final, units)
        out[coords[mask]] = values[mask]

    def _result(self, final: np.ndarray, units: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(output values, their coordinates, which are real) of the sink's decoded units."""
        raise NotImplementedError

    def score(self, final: np.ndarray, units: np.ndarray, exact: np.ndarray
              ) -> tuple[float, float]:
        values, coords, mask = self._result(final, units)
        return self._squared(values, coords, mask, exact)

    def _squared(self, values: np.ndarray, coords: np.ndarray, mask: np.ndarray,
                 exact: np.ndarray) -> tuple[float, float]:
        truth = exact[np.where(mask, coords, 0)]
        if self.op is ReduceOp.AVG:
            truth = truth / self.n
        truth = np.where(mask, truth, 0.0)
        diff = np.where(mask, values.astype(np.float64) - truth, 0.0)
        return float(np.einsum("ij,ij->", diff, diff)), float(np.einsum("ij,ij->", truth, truth))


def _group_by(values: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """``(value, indices)`` for each distinct value (ascending)."""
    if not values.shape[0]:
        return []
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    cuts = np.flatnonzero(np.diff(sorted_values)) + 1
    return [(int(sorted_values[a]), order[a:b])
            for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), values.shape[0]], strict=True)]


class _DynamiqAdapter(_Adapter):
    def __init__(self, scheme: Any, numel: int, n: int, op: ReduceOp, seed: int, step: int):
        self.scheme = scheme
        self.config = scheme.config
        self.numel, self.n, self.op, self.seed, self.step = numel, n, op, seed, step
        self.rows = -(-numel // SUPER)
        self.unit_len = SUPER
        self.record_len = max(record_nbytes(w, self.config.scales)
                              for w in (2, 3, 4, 5, 6, 7, 8, 16)
                              if w <= getattr(scheme, "max_width", 8))
        self.valid = (numel - torch.arange(self.rows, dtype=torch.int64) * SUPER).clamp(max=SUPER)
        self.stats_mode = getattr(scheme, "stats", "fp32")
        from ..kernels import dynamiq_ops

        self.prep_ops = dynamiq_ops(torch.device("cpu"))
        if getattr(scheme, "reference_only", False):
            from ..kernels import torch_ops

            self.prep_ops = torch_ops()
        self.split = (self.prep_ops.stats is not None and self.stats_mode in ("fp32", "norm16"))
        self._summed: torch.Tensor | None = None

    def pass1(self, rank: int, x: torch.Tensor) -> None:
        """DynamiqCall._statistics of this rank (the same kernels and the same roundings), then
        its share of the statistics all-reduce, summed in rank order in the wire's dtype."""
        from ..schemes.dynamiq.call import local_statistics, statistics_wire

        divisor = self.n if self.op is ReduceOp.AVG else 1
        _, _, mean, norm2, _ = local_statistics(self.prep_ops, self.stats_mode,
                                                x.view(self.rows, SUPER), self.valid, divisor,
                                                self.split)
        wire = statistics_wire(self.stats_mode, mean, norm2)
        if self._summed is None:
            self._summed = wire.clone()
        else:
            self._summed.add_(wire)  # rank order, like the local transport

    def layout(self, x0: torch.Tensor, plan: ReducePlan) -> None:
        from ..kernels.simulate_numba import RankTables
        from ..schemes.dynamiq.scheme import DynamiqCall

        assert self._summed is not None
        shape = ScheduleShape(plan.algorithm, self.n, plan.subtree())  # type: ignore[arg-type]
        ctx = CallContext(0, self.n, self.op, self.seed, self.step, Collective.ALLREDUCE,
                          "simulate", _StatsReplay([self._summed]), schedule=shape)
        call = DynamiqCall(self.scheme, x0.reshape(-1).float(), ctx)
        del shape, ctx
        self.ops = call.ops  # the codec's kernels (the reference where they lack a width)
        self.chunk_units = np.asarray(call.chunk_bounds, dtype=np.int64)
        order = call.order.cpu().numpy()
        self.widths = call.allocation.widths.numpy()[order].astype(np.int8)
        self.hop: np.ndarray | None = None
        if call.hop is not None:  # hop widths: per partial-sum size (count class)
            classes = sorted(call.hop)
            self.class_of = np.full(self.n + 1, -1, np.int64)
            self.class_of[classes] = np.arange(len(classes))
            self.hop = np.stack([call.hop[c].numpy()[order] for c in classes]).astype(np.int8)
        self.index_base = call.index_base.cpu().numpy().astype(np.int64)
        self.mean_sorted = call.mean_sorted.cpu().numpy().astype(np.float32)
        self.valid_sorted = call.valid_sorted.cpu().numpy().astype(np.int64)
        self.bits_used = float(call.info["bits"])
        self.tables = RankTables.build(call.key, self.n, self.config)
        self._summed = None
        del call

    def starts(self, units: np.ndarray) -> np.ndarray:
        return self.index_base[units]

    def prepare(self, rows: np.ndarray, units: np.ndarray) -> None:
        if self.op is ReduceOp.AVG:
            np.divide(rows, np.float32(self.n), out=rows)  # fp32, as torch's x / n
        if self.stats_mode == "norm16":  # no centring: x - 0 is x, -0 and NaN included
            return
        valid = torch.from_numpy(self.valid_sorted[units])
        x = torch.from_numpy(rows)
        if self.stats_mode == "bf16":
            centred = stats_center_rounded_torch(x, valid, centre=True)[0]
        else:
            centred = self.prep_ops.stats_center(x, valid)[0]
        rows[...] = centred.numpy()

    def _widths(self, units: np.ndarray, counts: np.ndarray) -> np.ndarray:
        if self.hop is None:
            return self.widths[units]
        return self.hop[self.class_of[counts], units]

    def encode(self, x: np.ndarray, ranks: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray) -> None:
        from ..kernels.simulate_numba import encode_ranked

        for width, pick in _group_by(self._widths(units, counts)):
            if width == 0:  # all zero on every rank: no record
                continue
            size = record_nbytes(width, self.config.scales)
            records = np.empty((pick.shape[0], size), np.uint8)
            encode_ranked(x[pick], width, self.index_base[units[pick]], ranks[pick],
                          self.tables, self.config, records)
            out[pick, :size] = records

    def decode(self, records: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray, accumulate: bool) -> None:
        from ..kernels.simulate_numba import decode_raw

        for width, pick in _group_by(self._widths(units, counts)):
            if width == 0:
                continue
            size = record_nbytes(width, self.config.scales)
            if width == RAW_WIDTH:
                part = out[pick]
                decode_raw(records[pick], part, accumulate)
                out[pick] = part
                continue
            rec = torch.from_numpy(np.ascontiguousarray(records[pick, :size]))
            if accumulate:
                acc = torch.from_numpy(out[pick])
                self.ops.decode_accumulate(rec, width, self.config, acc)
                out[pick] = acc.numpy()
            else:
                out[pick] = self.ops.decode(rec, width, self.config).numpy()

    def _result(self, final: np.ndarray, units: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values = final + self.mean_sorted[units][:, None]  # fp32, as the restore
        j = np.arange(SUPER, dtype=np.int64)[None, :]
        mask = j < self.valid_sorted[units][:, None]
        return values, self.index_base[units][:, None] + j, mask


class _BlockAdapter(_Adapter):
    """Block codecs (``none``, MX): a unit is a whole chunk, padded with zero blocks to the
    longest chunk; payloads are the scheme's own ``encode_values`` of the units, split per unit
    (OCP MX puts its scale bytes first: each unit's record is its scale bytes, then its
    codes)."""

    def __init__(self, scheme: Any, numel: int, n: int, op: ReduceOp, seed: int, step: int):
        from ..schemes.mx import MXScheme, ScaleMode

        self.scheme = scheme
        self.numel, self.n, self.op, self.seed, self.step = numel, n, op, seed, step
        self.mx = isinstance(scheme, MXScheme)
        self.global_scale = self.mx and scheme.scale is ScaleMode.GLOBAL
        self.block = scheme.block
        self._gmax: np.ndarray | None = None

    def pass1(self, rank: int, x: torch.Tensor) -> None:
        if not self.global_scale:
            return
        padded = x[: -(-self.numel // self.block) * self.block].numpy()
        gmax = _block_max_bf16_up(padded, self.block)  # = the MX scheme's prepare (tested)
        if self._gmax is None:
            self._gmax = gmax
        else:
            np.maximum(self._gmax, gmax, out=self._gmax)

    def layout(self, x0: torch.Tensor, plan: ReducePlan) -> None:
        replay = ([] if self._gmax is None
                  else [torch.from_numpy(self._gmax).to(torch.bfloat16)])  # exact: bf16 values
        ctx = CallContext(0, self.n, self.op, self.seed, self.step, Collective.ALLREDUCE,
                          "simulate", _StatsReplay(replay))
        call = self.scheme.begin(x0.reshape(-1).float(), ctx)
        bounds = np.asarray(call.chunk_bounds, dtype=np.int64)
        self.bounds = bounds
        self.lengths = np.diff(bounds)
        self.unit_len = max(int(self.lengths.max()), self.block)
        self.chunk_units = np.arange(self.n + 1, dtype=np.int64)
        self.state = call.state
        self.blocks_per_unit = self.unit_len // self.block
        from ..schemes.mx import _GlobalScaleCall

        self.sliced_state = isinstance(call, _GlobalScaleCall)
        if self.sliced_state:  # per unit, its blocks' maxima, zero for the padding blocks
            state = self.state.numpy()
            blocks = np.zeros((self.n, self.blocks_per_unit), dtype=np.float32)
            for c in range(self.n):
                a, b = int(bounds[c]) // self.block, int(bounds[c + 1]) // self.block
                blocks[c, : b - a] = state[a:b]
            self.unit_state = blocks
        self.prefix = (self.blocks_per_unit if self.mx and not self.global_scale else 0)
        self.record_len = self.scheme.chunk_nbytes(self.unit_len, 1, self._state_of(
            np.zeros(1, np.int64)))
        self.body = self.record_len - self.prefix
        self.bits_used = None
        self._gmax = None

    def _state_of(self, units: np.ndarray) -> Any:
        if not self.sliced_state:
            return self.state
        return torch.from_numpy(self.unit_state[units].reshape(-1))

    def starts(self, units: np.ndarray) -> np.ndarray:
        return self.bounds[units]

    def prepare(self, rows: np.ndarray, units: np.ndarray) -> None:
        # coordinates past the unit's chunk belong to the next chunk: zero padding here
        j = np.arange(self.unit_len, dtype=np.int64)[None, :]
        rows[j >= self.lengths[units][:, None]] = 0.0

    def encode(self, x: np.ndarray, ranks: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray) -> None:
        for count, pick in _group_by(counts):
            k = pick.shape[0]
            values = torch.from_numpy(np.ascontiguousarray(x[pick])).reshape(-1)
            payload = self.scheme.encode_values(values, count,
                                                self._state_of(units[pick])).numpy()
            records = out[pick]
            records[:, : self.prefix] = payload[: k * self.prefix].reshape(k, self.prefix)
            records[:, self.prefix : self.record_len] = payload[k * self.prefix :].reshape(
                k, self.body)
            out[pick] = records

    def decode(self, records: np.ndarray, units: np.ndarray, counts: np.ndarray,
               out: np.ndarray, accumulate: bool) -> None:
        for count, pick in _group_by(counts):
            rec = records[pick]
            payload = torch.from_numpy(np.concatenate(
                [rec[:, : self.prefix].reshape(-1), rec[:, self.prefix : self.record_len]
                 .reshape(-1)]))
            state = self._state_of(units[pick])
            target = torch.from_numpy(np.ascontiguousarray(out[pick])).reshape(-1)
            if not self.scheme.decode_into(payload, target, count, state, accumulate):
                values = self.scheme.decode_values(payload, target.numel(), count, state)
                if accumulate:
                    target.add_(values)
                else:
                    target.copy_(values)
            out[pick] = target.view(-1, self.unit_len).numpy()

    def _result(self, final: np.ndarray, units: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values = final
        if self.op is ReduceOp.AVG and self.scheme.avg_mode == "post":
            values = final / np.float32(self.n)  # fp32, as the call's finish
        j = np.arange(self.unit_len, dtype=np.int64)[None, :]
        coords = self.bounds[units][:, None] + j
        mask = (j < self.lengths[units][:, None]) & (coords < self.numel)
        return values, coords, mask


def _block_max_bf16_up(x: np.ndarray, block: int) -> np.ndarray:
    """:meth:`dqcoll.schemes.mx.MXScheme.single_shot_state` in NumPy: per block, ``max |x|``
    (``+inf`` where the block is not finite) rounded up to bf16, as fp32."""
    amax = np.abs(x.reshape(-1, block)).max(axis=1)
    amax = np.where(np.isfinite(amax), amax, np.float32(np.inf)).astype(np.float32)
    bits = amax.view(np.uint32)
    up = (bits >> np.uint32(16)) + ((bits & np.uint32(0xFFFF)) != 0).astype(np.uint32)
    rounded = (up << np.uint32(16)).view(np.float32)
    return np.where(np.isfinite(amax), rounded, amax)


def _adapter(scheme_name: str, options: dict[str, Any], numel: int, n: int, op: ReduceOp,
             seed: int, step: int) -> _Adapter:
    if scheme_name == "dynamiq":
        return _DynamiqAdapter(schemes.get("dynamiq", **options), numel, n, op, seed, step)
    if scheme_name in BLOCK_SCHEMES:
        return _BlockAdapter(schemes.get(scheme_name, **options), numel, n, op, seed, step)
    raise UnsupportedError(
        f"the simulator runs 'dynamiq' and {', '.join(repr(s) for s in BLOCK_SCHEMES)}; "
        f"{scheme_name!r} has no batched adapter yet (use python -m dqcoll_lab eval over the "
        f"local transport for it)")


# -- pass 2: the reduce phase, a batch of chunks at a time -----------------------------------------


def _expand(chunks: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(transfer index, unit) for every unit of every transfer's chunk."""
    starts = bounds[chunks]
    counts = bounds[chunks + 1] - starts
    if bool((counts == 1).all()):
        return np.arange(chunks.shape[0]), starts
    owner = np.repeat(np.arange(chunks.shape[0]), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + offsets


def _batches(bounds: np.ndarray, units_per_batch: int) -> list[tuple[int, int]]:
    """Consecutive chunk ranges [c0, c1) of at most ``units_per_batch`` units (at least one
    chunk)."""
    result = []
    c0, n = 0, bounds.shape[0] - 1
    while c0 < n:
        c1 = int(np.searchsorted(bounds, bounds[c0] + units_per_batch, side="right")) - 1
        c1 = min(max(c1, c0 + 1), n)
        result.append((c0, c1))
        c0 = c1
    return result


class _Pool:
    """Fixed-size rows with a free list: payloads (or partial sums) held between steps,
    addressed through ``slot[rank, unit - u0]`` (-1: none)."""

    def __init__(self, n: int, units: int, rows: int, width: int, dtype: Any) -> None:
        self.slot = np.full((n, units), -1, np.int32)
        self.data = np.empty((max(rows, 1), width), dtype)
        self.free = np.arange(max(rows, 1) - 1, -1, -1, dtype=np.int32)
        self.top = self.free.shape[0]

    def take(self, ranks: np.ndarray, local: np.ndarray) -> np.ndarray:
        """The rows held for (ranks, local units), released."""
        slots = self.slot[ranks, local]
        if slots.shape[0] and int(slots.min()) < 0:
            raise AssertionError("the reduce plan sends a payload nobody holds")
        rows = self.data[slots]
        self.slot[ranks, local] = -1
        k = slots.shape[0]
        self.free[self.top : self.top + k] = slots
        self.top += k
        return rows

    def put(self, ranks: np.ndarray, local: np.ndarray, rows: np.ndarray) -> None:
        k = rows.shape[0]
        if k > self.top:
            grown = max(2 * self.data.shape[0], self.data.shape[0] + k - self.top)
            extra = np.arange(grown - 1, self.data.shape[0] - 1, -1, dtype=np.int32)
            data = np.empty((grown, self.data.shape[1]), self.data.dtype)
            data[: self.data.shape[0]] = self.data
            free = np.empty(grown, np.int32)
            free[: extra.shape[0]] = extra
            free[extra.shape[0] : extra.shape[0] + self.top] = self.free[: self.top]
            self.data, self.free, self.top = data, free, self.top + extra.shape[0]
        slots = self.free[self.top - k : self.top]
        self.top -= k
        self.data[slots] = rows
        self.slot[ranks, local] = slots


class _Engine:
    def __init__(self, plan: ReducePlan, adapter: _Adapter, rows: _Rows, exact: np.ndarray,
                 memory_mb: float, output: np.ndarray | None = None) -> None:
        self.plan, self.adapter, self.rows, self.exact = plan, adapter, rows, exact
        self.output = output
        self.n = plan.world_size
        per_step, held, partial = plan.profile()
        self.partials = partial > 0
        unit_f32 = 4 * adapter.unit_len
        chunk_units = np.diff(adapter.chunk_units)
        per_unit = (4 * self.n * (2 if self.partials else 1) + held * adapter.record_len
                    + partial * unit_f32 + max(per_step, 1) * (adapter.record_len + 3 * unit_f32
                                                               + 96))
        budget = max(memory_mb * 2**20 - self._fixed_bytes(), 0.0)
        self.units_per_batch = max(1, int(budget // per_unit))
        self.held, self.partial = held, partial
        self.batches = _batches(adapter.chunk_units, self.units_per_batch)
        self.total_units = int(chunk_units.sum())

    def _fixed_bytes(self) -> int:
        tables = getattr(self.adapter, "tables", None)
        return self.exact.nbytes + (0 if tables is None else tables.perm_tables.nbytes)

    def own(self, ranks: np.ndarray, units: np.ndarray) -> np.ndarray:
        out = np.empty((ranks.shape[0], self.adapter.unit_len), np.float32)
        self.rows.fill(ranks, self.adapter.starts(units), out)
        self.adapter.prepare(out, units)
        return out

    def run_batch(self, c0: int, c1: int) -> Iterator[tuple[int, float, float]]:
        """The reduce phase of chunks ``[c0, c1)``, step by step: yields ``(transfer units
        done, squared error, squared norm)`` of each step (the error of the chunks it finished)."""
        a = self.adapter
        u0, u1 = int(a.chunk_units[c0]), int(a.chunk_units[c1])
        chunks = np.arange(c0, c1, dtype=np.int64)
        if self.plan.num_steps == 0:  # one rank: nothing moves, its rows are the result
            units = np.arange(u0, u1, dtype=np.int64)
            final = self.own(np.zeros(units.shape[0], np.int64), units)
            if self.output is not None:
                a.write(final, units, self.output)
            e, m = a.score(final, units, self.exact)
            yield units.shape[0], e, m
            return
        span = u1 - u0
        records = _Pool(self.n, span, self.held * span, a.record_len, np.uint8)
        partials = (_Pool(self.n, span, self.partial * span, a.unit_len, np.float32)
                    if self.partials else None)
        for k in range(self.plan.num_steps):
            s = self.plan.step(k, chunks)
            if not len(s):
                continue
            e, m, items = self._step(s, u0, records, partials)
            yield items, e, m

    def _step(self, s: StepArrays, u0: int, records: _Pool, partials: _Pool | None
              ) -> tuple[float, float, int]:
        a = self.adapter
        owner, unit = _expand(s.chunk, a.chunk_units)
        src, dst = s.src[owner], s.dst[owner]
        local = unit - u0
        src_count, dst_count = s.src_count[owner], s.dst_count[owner]
        m = unit.shape[0]
        # 1. what every sender sends: a leaf encodes its own rows, the others what they held
        rec = np.empty((m, a.record_len), np.uint8)
        leaf = s.leaf[owner]
        if leaf.all():
            a.encode(self.own(src, unit), src, unit, src_count, rec)
        else:
            held = np.flatnonzero(~leaf)
            rec[held] = records.take(src[held], local[held])
            fresh = np.flatnonzero(leaf)
            if fresh.shape[0]:
                part = np.empty((fresh.shape[0], a.record_len), np.uint8)
                a.encode(self.own(src[fresh], unit[fresh]), src[fresh], unit[fresh],
                         src_count[fresh], part)
                rec[fresh] = part
        # 2. receivers: (dst, unit) groups, each accumulating its arrivals in order onto its
        #    own rows (or onto the partial sum it holds from an earlier step)
        arrival = s.arrival[owner]
        single = not bool(arrival.any())
        if single:  # one arrival per (dst, unit) in this step (ring, butterfly)
            group = np.arange(m)
            first = group
        else:
            key = dst * (local.max() + 1) + local
            order = np.lexsort((arrival, key))
            sorted_key = key[order]
            starts = np.flatnonzero(np.r_[True, sorted_key[1:] != sorted_key[:-1]])
            first = order[starts]
            group = np.empty(m, np.int64)
            group[order] = np.cumsum(np.r_[True, sorted_key[1:] != sorted_key[:-1]]) - 1
        g_dst, g_unit, g_local = dst[first], unit[first], local[first]
        work = np.empty((first.shape[0], a.unit_len), np.float32)
        continuing = (np.zeros(first.shape[0], bool) if partials is None
                      else partials.slot[g_dst, g_local] >= 0)
        if continuing.any():
            cont = np.flatnonzero(continuing)
            work[cont] = partials.take(g_dst[cont], g_local[cont])  # type: ignore[union-attr]
            new = np.flatnonzero(~continuing)
            work[new] = self.own(g_dst[new], g_unit[new])
        else:
            work[...] = self.own(g_dst, g_unit)
        if single:
            a.decode(rec, unit, src_count, work, True)
        else:
            for k in range(int(arrival.max()) + 1):
                pick = np.flatnonzero(arrival == k)
                rows = work[group[pick]]
                a.decode(rec[pick], unit[pick], src_count[pick], rows, True)
                work[group[pick]] = rows
        # 3. what each receiver does once this step's arrivals are in (its last one's role)
        g_role = s.role[owner][first] if single else _last_role(s.role[owner], group, arrival,
                                                                first.shape[0])
        g_count = dst_count[first]
        error = norm = 0.0
        fwd = np.flatnonzero(g_role == FORWARD)
        if fwd.shape[0]:
            out = np.empty((fwd.shape[0], a.record_len), np.uint8)
            a.encode(work[fwd], g_dst[fwd], g_unit[fwd], g_count[fwd], out)
            records.put(g_dst[fwd], g_local[fwd], out)
        fin = np.flatnonzero(g_role == FINAL)
        if fin.shape[0]:
            out = np.empty((fin.shape[0], a.record_len), np.uint8)
            counts = np.full(fin.shape[0], self.n, np.int64)
            a.encode(work[fin], g_dst[fin], g_unit[fin], counts, out)
            final = work[fin]  # units without a record keep the sink's own rows
            a.decode(out, g_unit[fin], counts, final, False)
            if self.output is not None:
                a.write(final, g_unit[fin], self.output)
            error, norm = a.score(final, g_unit[fin], self.exact)
        acc = np.flatnonzero(g_role == ACCUMULATE)
        if acc.shape[0]:
            assert partials is not None
            partials.put(g_dst[acc], g_local[acc], work[acc])
        return error, norm, m


def _last_role(role: np.ndarray, group: np.ndarray, arrival: np.ndarray, groups: int
               ) -> np.ndarray:
    """Per group, the role of its last arrival."""
    order = np.lexsort((arrival, group))
    last = np.r_[group[order][1:] != group[order][:-1], True]
    out = np.empty(groups, np.int8)
    out[group[order][last]] = role[order][last]
    return out


def _simulate_plan(plan: ReducePlan, data: RankData, adapter: _Adapter, *, memory_mb: float,
                   progress: Progress | None, scratch_dir: str | None,
                   output: np.ndarray | None = None
                   ) -> tuple[float, float, int, int, bool, dict[str, Any]]:
    """Both passes; returns (error, norm, chunks done, chunks total, complete, stats)."""
    n = plan.world_size
    numel = data.numel
    info: dict[str, Any] = {}
    rows = _Rows(data, scratch_dir)
    try:
        t0 = time.perf_counter()
        exact_np = np.zeros(numel, dtype=np.float64)
        work_total = 2 * n * max(numel, 1)
        groups = -(-numel // SUPER)
        padded = np.zeros((groups, SUPER), np.float32)  # one rank's tensor, reused
        flat = padded.reshape(-1)
        starts = np.arange(groups, dtype=np.int64) * SUPER
        for r in range(n):  # pass 1
            if rows.direct:
                rows.fill(np.full(groups, r, np.int64), starts, padded)
            else:
                x = data.rank_tensor(r)
                rows.keep(r, x)
                flat[:numel] = x.reshape(-1).numpy()
                del x
            np.add(exact_np, flat[:numel], out=exact_np)
            adapter.pass1(r, torch.from_numpy(flat))
            if progress:
                progress((r + 1) * numel, work_total)
        del padded, flat
        t1 = time.perf_counter()
        adapter.layout(data.rank_tensor(0), plan)
        t2 = time.perf_counter()
        engine = _Engine(plan, adapter, rows, exact_np, memory_mb, output)
        info.update(pass1_s=t1 - t0, layout_s=t2 - t1, batches=len(engine.batches))
        error = norm = 0.0
        done = 0
        complete = True
        moved = [0]
        # progress in coordinates: pass 1 touched n x numel, pass 2 moves (n - 1) per unit
        scale = (n * max(numel, 1)) / max(engine.total_units * max(n - 1, 1), 1)

        def after_step(items: int) -> None:
            moved[0] += items
            if progress:
                progress(min(n * numel + int(moved[0] * scale), work_total), work_total)

        try:
            for c0, c1 in engine.batches:
                batch_error = batch_norm = 0.0
                pending = 0
                for items, e, m in engine.run_batch(c0, c1):
                    batch_error, batch_norm = batch_error + e, batch_norm + m
                    if pending:
                        after_step(pending)
                    pending = items
                # the batch counts once its last step is in, before that step's progress call
                error, norm, done = error + batch_error, norm + batch_norm, c1
                after_step(pending)
        except KeyboardInterrupt:
            complete = False
        info["pass2_s"] = time.perf_counter() - t2
        info["units_per_batch"] = engine.units_per_batch
    finally:
        rows.close()
    return error, norm, done, plan.world_size, complete, info


def _parse_op(op: str | ReduceOp) -> ReduceOp:
    return ReduceOp.parse(op)


def _as_plan(schedule: Schedule | ReducePlan) -> ReducePlan:
    return schedule if isinstance(schedule, ReducePlan) else plan_of_schedule(schedule)


def simulate(
    schedule: Schedule | ReducePlan,
    data: RankData,
    *,
    scheme: str = "dynamiq",
    bits: float | None = 5.0,
    op: str | ReduceOp = "sum",
    seed: int = 0,
    step: int = 0,
    memory_mb: float | None = None,
    progress: Progress | None = None,
    scratch_dir: str | None = None,
    output: torch.Tensor | None = None,
    **scheme_options: Any,
) -> SimulationResult:
    """vNMSE of an all-reduce of ``data`` (one tensor per rank) along ``schedule`` (a
    :class:`Schedule`, or a :class:`~.steps.ReducePlan`: :func:`.steps.placed_plan` needs no
    schedule object, so it runs at any ``n``).

    ``seed``/``step`` key the random rounding exactly as ``dqcoll.allreduce(..., seed=, step=)``
    does. ``memory_mb`` (default :func:`default_memory_mb`) bounds what the simulation holds
    (module docstring); ``bits`` is DynamiQ's budget; other options go to the scheme. With
    ``output`` (contiguous fp32, ``numel`` long) the all-reduce's result is written there too
    (the tests compare it with the ``local`` transport's, bit for bit).
    """
    plan = _as_plan(schedule)
    n = plan.world_size
    if data.world_size != n:
        raise InvalidArgumentError(
            f"data has {data.world_size} ranks, schedule {plan.algorithm!r} {n}")
    memory = default_memory_mb() if memory_mb is None else float(memory_mb)
    start = time.perf_counter()
    options = dict(scheme_options)
    if scheme == "dynamiq" and bits is not None:
        options["bits"] = bits
    adapter = _adapter(scheme, options, data.numel, n, _parse_op(op), seed, step)
    if output is not None and (output.dtype != torch.float32 or output.numel() != data.numel
                               or not output.is_contiguous()):
        raise InvalidArgumentError(f"output: expected a contiguous fp32 tensor of {data.numel} "
                                   f"elements, got {output.dtype} {tuple(output.shape)}")
    error, norm, done, total, complete, info = _simulate_plan(
        plan, data, adapter, memory_mb=memory, progress=progress, scratch_dir=scratch_dir,
        output=None if output is None else output.view(-1).numpy())
    value = error / norm if norm > 0 else (0.0 if error == 0 else math.inf)
    return SimulationResult(value, n, data.numel, scheme, plan.algorithm, adapter.bits_used,
                            time.perf_counter() - start, complete, done, total,
                            peak_rss_bytes(), memory, info.get("batches", 0),
                            info.get("pass1_s", 0.0), info.get("layout_s", 0.0),
                            info.get("pass2_s", 0.0))


class _HostShards:
    """Per-host fp32 sums of one shard of every rank's data: the inputs of the inter level."""

    row_access = True

    def __init__(self, sums: np.ndarray, shard: int, shard_numel: int, numel: int) -> None:
        self.sums = sums
        self.world_size = sums.shape[0]
        lo = shard * shard_numel
        self.lo, self.hi = lo, min(lo + shard_numel, numel)
        self.numel = max(self.hi - self.lo, 0)

    def rank_tensor(self, rank: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.sums[rank, self.lo : self.hi]))

    def fill_rows(self, ranks: np.ndarray, starts: np.ndarray, out: np.ndarray) -> None:
        length = out.shape[1]
        idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
        inside = idx < self.numel
        values = self.sums[ranks[:, None], self.lo + np.minimum(idx, max(self.numel - 1, 0))]
        out[...] = np.where(inside, values, np.float32(0.0))


def simulate_hierarchical(
    plan: HierarchicalPlan,
    data: RankData,
    *,
    op: str | ReduceOp = "sum",
    seed: int = 0,
    step: int = 0,
    memory_mb: float | None = None,
    progress: Progress | None = None,
    scratch_dir: str | None = None,
) -> SimulationResult:
    """vNMSE of ``dqcoll.allreduce(x, algorithm=plan)`` with a two-level plan whose intra level is
    uncompressed: every host's fp32 sum (in local-rank order) is all-reduced across hosts with the
    inter scheme, shard by shard."""
    if plan.intra.scheme != "none":
        raise UnsupportedError(
            f"the simulator runs hierarchical plans with intra scheme 'none', got "
            f"{plan.intra.scheme!r}")
    if data.world_size != plan.world_size:
        raise InvalidArgumentError(f"data has {data.world_size} ranks, plan {plan.world_size}")
    memory = default_memory_mb() if memory_mb is None else float(memory_mb)
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
        inter = plan_of_schedule(plan.inter_schedule)
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

                e, m, _, _, ok, _ = _simulate_plan(inter, shard_data, adapter, memory_mb=memory,
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
                            time.perf_counter() - start, complete, done, g, peak_rss_bytes(),
                            memory)
