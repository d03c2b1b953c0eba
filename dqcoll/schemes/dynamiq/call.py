"""One ``dynamiq`` collective call: the planning steps of docs/design.md §2 (step 5), one method
each, then the per-hop operations; at the end each rank adds back the summed means and undoes the
reorder. Random numbers are keyed by the original coordinate index; the state kept between calls
is design.md §6's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
from typing import Any, Protocol

import numpy as np
import torch

from ... import scratch
from ...errors import InvalidArgumentError
from ...interop import host_to_device
from ...kernels import DynamiqOps, dynamiq_ops, rng, torch_ops
from ...kernels.codec import (
    ALL_WIDTHS,
    RAW_WIDTH,
    SUPER,
    CodecConfig,
    Scales,
    record_nbytes,
    restore_torch,
    stats_center_rounded_torch,
)
from ...types import Collective, ReduceOp
from ..base import CallContext
from .allocation import (
    Allocation,
    Classes,
    allocate_for_target,
    allocate_for_target_by_count,
    allocate_widths,
    allocate_widths_by_count,
    count_classes,
)
from .error_model import (
    ErrorModel,
    estimate_row_rho,
    measure_crests,
    row_error_terms,
    row_moments,
)
from .geometry import Geometry, Segments
from .options import Balance, DynamiqFormat

__all__ = ["RHO_ENTRIES", "DynamiqCall", "SchemeSettings"]


class SchemeSettings(Protocol):
    """What a call reads from its :class:`.scheme.DynamiqScheme` (a protocol: no import circle)."""

    format: DynamiqFormat
    config: CodecConfig
    bits: float
    target_vnmse: float | None
    energy_exponent: float
    balance: Balance
    error_model: ErrorModel
    stats: str
    hop_widths: bool
    max_width: int
    reference_only: bool
    stats_bytes: int
    measured_errors: dict[int, float] | None


_EXACT_BUDGET_ROWS = 64  # see DynamiqCall._allocate
# Target mode's estimates kept per communicator and kind, per (numel, collective, algorithm) key
RHO_ENTRIES = 1024
_INPUT_BUFFER = "dynamiq.input"
_WORK_BUFFER = "dynamiq.work"

log = logging.getLogger("dqcoll")


@functools.cache  # once per distinct reason, not per call
def _warn_once(message: str) -> None:
    log.warning("%s", message)


def _state_buffer(ctx: CallContext, name: str, rows: int,
                  device: torch.device) -> torch.Tensor | None:
    """A CPU call's fp32 ``[rows, 256]`` buffer kept on the communicator (design.md §6), or None."""
    if ctx.state is None or device.type != "cpu":
        return None
    key = (name, str(device))
    buffer = ctx.state.get(key)
    if not isinstance(buffer, torch.Tensor) or buffer.shape[0] < rows:
        buffer = ctx.state[key] = torch.empty((rows, SUPER), dtype=torch.float32, device=device)
    return buffer[:rows]


def _recall(state: dict[Any, Any] | None, kind: str, key: tuple[Any, ...]) -> Any:
    """Target mode's estimate ``kind`` that the last call of ``key`` measured, or None (an LRU)."""
    table = None if state is None else state.get(f"dynamiq.{kind}")
    if table is None or key not in table:
        return None
    table.move_to_end(key)
    return table[key]


def _remember(state: dict[Any, Any], kind: str, key: tuple[Any, ...], value: Any) -> None:
    table = state.setdefault(f"dynamiq.{kind}", collections.OrderedDict())
    table[key] = value
    table.move_to_end(key)
    while len(table) > RHO_ENTRIES:
        table.popitem(last=False)


@dataclasses.dataclass
class _Layout:
    """The call's super-groups in their original order (host tables, one entry per row)."""

    flat: torch.Tensor  # fp32 [rows, 256]: the padded input (may be the caller's: never written)
    row_start: torch.Tensor  # int64: global index of each row's first coordinate
    valid: torch.Tensor  # int64: valid (unpadded) coordinates of each row
    shard_row_counts: torch.Tensor | None  # int64 [n]: rows per shard (shard layout)


@dataclasses.dataclass
class _Statistics:
    """The rows after step 2: local statistics and their all-reduced sums."""

    ops: DynamiqOps  # the kernels that computed them (the reorder's gather runs on them too)
    flat: torch.Tensor | None  # the rows, divided by n for avg unless ``ops`` gathers and divides
    centred: torch.Tensor | None  # centred rows where already computed, else None
    mean: torch.Tensor  # fp32 [rows]: this rank's means (zero without centring)
    divisor: int  # n for avg, else 1 (what the gather still divides by)
    summed: torch.Tensor  # fp32 [2, rows]: the ranks' summed means and squared norms


def _shard_layout(x: torch.Tensor, n: int) -> tuple[_Layout, tuple[int, int]]:
    """Shard ``c`` = coordinates ``[c * shard, (c + 1) * shard)`` padded to whole rows on its own,
    rows past the end dropped: ``(layout, (shard, shard_rows))``."""
    numel, device = x.numel(), x.device
    shard = -(-numel // n)
    shard_rows = -(-shard // SUPER)
    flat = torch.zeros(n, shard_rows * SUPER, dtype=torch.float32, device=device)
    full, rest = divmod(numel, shard)  # whole shards, then a shorter one
    flat[:full, :shard] = x.reshape(-1)[: full * shard].reshape(full, shard)
    if rest:
        flat[full, :rest] = x.reshape(-1)[full * shard :]
    lengths = (numel - torch.arange(n, dtype=torch.int64) * shard).clamp(0, shard)
    in_shard = torch.arange(shard_rows, dtype=torch.int64)
    row_start = (torch.arange(n, dtype=torch.int64)[:, None] * shard
                 + in_shard[None, :] * SUPER).reshape(-1)
    valid = (lengths[:, None] - in_shard[None, :] * SUPER).clamp(max=SUPER).reshape(-1)
    flat = flat.view(n * shard_rows, SUPER)
    if numel % n:  # rows kept picked on the host (a device mask would make the host wait)
        exists = valid > 0
        kept = host_to_device(torch.nonzero(exists).squeeze(1), device, torch.int64)
        flat, row_start, valid = flat.index_select(0, kept), row_start[exists], valid[exists]
    layout = _Layout(flat, row_start, valid, -(-lengths // SUPER))
    return layout, (shard, shard_rows)


def _tail_layout(x: torch.Tensor, ctx: CallContext) -> _Layout:
    """The input's rows (the input itself where whole fp32 rows), the tail padded with zeros."""
    numel = x.numel()
    rows = -(-numel // SUPER)
    if numel == rows * SUPER and x.dtype == torch.float32 and x.is_contiguous():
        flat = x.view(rows, SUPER)  # the input itself: read, never written below
    else:
        kept = _state_buffer(ctx, _INPUT_BUFFER, rows, x.device)
        flat = (kept if kept is not None
                else torch.empty(rows, SUPER, dtype=torch.float32, device=x.device))
        flat.view(-1)[:numel] = x.reshape(-1)
        flat.view(-1)[numel:] = 0.0  # the tail's padding
    row_start = torch.arange(rows, dtype=torch.int64) * SUPER
    valid = (numel - row_start).clamp(max=SUPER)
    return _Layout(flat.view(rows, SUPER), row_start, valid, None)


@dataclasses.dataclass(frozen=True)
class Survey:
    """This rank's statistics of an all-reduce's input (whole fp32 rows), taken in the range
    check's pass (:func:`survey`): the call's own of the same rows, divisor and centring."""

    data_ptr: int  # the input's first element
    rows: int
    divisor: int  # n for avg, else 1
    centre: bool
    mean: torch.Tensor  # fp32 [rows]
    norm2: torch.Tensor  # fp32 [rows], with the underflow check (keep_underflowed)
    plus_zero: np.ndarray  # bool [rows]: the row is all +0 in the input

    def covers(self, flat: torch.Tensor, divisor: int, centre: bool) -> bool:
        return (flat.data_ptr() == self.data_ptr and flat.shape[0] == self.rows
                and divisor == self.divisor and centre == self.centre)


def survey(scheme: SchemeSettings, x: torch.Tensor, op: ReduceOp, world_size: int,
           collective: Collective) -> tuple[float, Survey] | None:
    """``(largest finite |x|, the statistics of x's rows)`` in one pass where the call would take
    the compiled split statistics of the input itself (a CPU all-reduce of whole fp32 rows, not
    by shards); None elsewhere."""
    if (collective is not Collective.ALLREDUCE or scheme.balance is Balance.SHARDS
            or scheme.reference_only or scheme.stats not in ("fp32", "norm16")
            or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous()
            or x.numel() == 0 or x.numel() % SUPER):
        return None
    ops = dynamiq_ops(x.device)
    if ops.stats_range is None or ops.stats is None or ops.center_gather is None:
        return None
    rows = x.numel() // SUPER
    divisor = world_size if op is ReduceOp.AVG else 1
    centre = scheme.stats == "fp32"
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    mean, norm2, largest, plus_zero = ops.stats_range(
        x.view(rows, SUPER), valid, divisor=divisor, centre=centre, keep_underflowed=True)
    return largest, Survey(x.data_ptr(), rows, divisor, centre, mean, norm2, plus_zero)


def _keep_underflowed_rows(norm2: torch.Tensor, centred: torch.Tensor) -> torch.Tensor:
    """``norm2`` with the smallest normal norm for a non-zero row whose squares all underflow fp32,
    so that it still gets a record (width 0 would leave each rank its own values)."""
    tiny = torch.finfo(torch.float32).tiny
    if norm2.device.type != "cpu":
        return torch.where((norm2 == 0) & (centred != 0).any(dim=1), tiny, norm2)
    empty = torch.nonzero(norm2 == 0).squeeze(1)
    lost = empty[(centred[empty] != 0).any(dim=1)]
    return norm2.index_fill(0, lost, tiny) if lost.numel() else norm2


def wire_norms16(norm2: torch.Tensor) -> torch.Tensor:
    """fp32 squared norms as the 16-bit statistics send them (bf16, nearest even), a positive norm
    below fp32's smallest normal first raised to it, so that a non-zero row keeps a record."""
    tiny = torch.finfo(torch.float32).tiny
    return torch.where((norm2 > 0) & (norm2 < tiny), tiny, norm2).to(torch.bfloat16)


def local_statistics(ops: DynamiqOps, stats: str, flat: torch.Tensor, valid: torch.Tensor,
                     divisor: int, split: bool, surveyed: Survey | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, str]:
    """This rank's statistics of its rows (original order): ``(rows, centred rows or None,
    means, squared norms, the kernels that ran)``. With ``split`` (the compiled split statistics,
    ``stats`` fp32 or norm16, or ``surveyed``'s) the rows come back as they are, for the gather
    to divide and centre; else divided by ``divisor`` into a new buffer and centred here."""
    if split:
        assert ops.stats is not None
        # norm16: no centring (zero means; center_gather then writes x / divisor itself)
        mean, norm2 = ((surveyed.mean, surveyed.norm2) if surveyed is not None
                       else ops.stats(flat, valid, divisor=divisor, centre=stats == "fp32",
                                      keep_underflowed=True))
        return flat, None, mean, norm2, ops.name
    if divisor != 1:
        flat = flat / divisor
    if stats in ("bf16", "norm16"):
        centred, mean, norm2 = stats_center_rounded_torch(flat, valid, centre=stats == "bf16")
        kernel = "torch"
    else:
        centred, mean, norm2 = ops.stats_center(flat, valid)
        kernel = ops.name
    return flat, centred, mean, _keep_underflowed_rows(norm2, centred), kernel


def statistics_wire(stats: str, mean: torch.Tensor, norm2: torch.Tensor) -> torch.Tensor:
    """What the ``stats`` option sends of a rank's statistics: bf16 mean and norm, the bf16 norm
    alone (norm16: no centring) or fp32 mean and norm."""
    if stats == "bf16":
        return torch.stack([mean.to(torch.bfloat16), wire_norms16(norm2)])
    if stats == "norm16":
        return wire_norms16(norm2)[None]
    return torch.stack([mean, norm2])


def _reduce_statistics(stats: str, mean: torch.Tensor, norm2: torch.Tensor,
                       ctx: CallContext) -> torch.Tensor:
    """The ranks' summed ``[means, squared norms]`` (fp32 ``[2, rows]``)."""
    wire = statistics_wire(stats, mean, norm2)
    ctx.reduce(wire, "sum", f"{ctx.what} statistics")
    if stats == "norm16":
        return torch.stack([torch.zeros_like(mean), wire[0].float()])
    return wire.float() if stats == "bf16" else wire


@dataclasses.dataclass
class _TargetRecord:
    """Target mode's inputs of the error model for one call."""

    key: tuple[Any, ...]  # (numel, collective, algorithm)
    source: str  # "error_model", "earlier call" or "default"
    rho: float
    crests: dict[int, float] | None
    row_error_terms: torch.Tensor  # each row's expected error (the estimate's reference)
    summed_norm2: torch.Tensor
    # the communicator's state, where the estimates go; None: nothing to measure (no state, or
    # a reduce-scatter, which decodes one shard only)
    state: dict[Any, Any] | None

    def measure(self, work: torch.Tensor, order_np: np.ndarray, widths: torch.Tensor,
                world_size: int, info: dict[str, Any]) -> None:
        """Estimate rho and the crests from the decoded aggregate for the next call."""
        if self.state is None:
            return
        moments = row_moments(work)
        order = torch.from_numpy(order_np)  # the host's copy: no read of the device's
        if self.source != "error_model":
            row_rho, rho = estimate_row_rho(work, self.summed_norm2.cpu()[order], order,
                                            world_size, self.row_error_terms[:, order],
                                            moments[0])
            _remember(self.state, "row_rho", self.key, row_rho)
            if rho is not None:
                _remember(self.state, "rho", self.key, rho)
                info["rho_measured"] = rho
        # the crests of what each width carried: the sink's widths of the decoded aggregate
        crests = measure_crests(work, widths[order], moments)
        if crests:
            _remember(self.state, "crests", self.key, crests)
            info["crests_measured"] = crests


def _hull_options(scheme: SchemeSettings) -> dict[str, Any]:
    return dict(scales=scheme.config.scales, width_set=scheme.format.width_choices,
                errors=scheme.measured_errors, stats_bytes=scheme.stats_bytes,
                max_width=scheme.max_width)


def _allocate_for_target(scheme: SchemeSettings, layout: _Layout, summed: torch.Tensor,
                         numel: int, ctx: CallContext, classes: Classes
                         ) -> tuple[dict[int, torch.Tensor] | None, Allocation, _TargetRecord]:
    """The cheapest widths meeting ``target_vnmse``, by the estimates of the last call's size."""
    assert scheme.target_vnmse is not None
    schedule, model, n = ctx.schedule, scheme.error_model, ctx.world_size
    key = (numel, ctx.collective.value, schedule.algorithm if schedule is not None else "")
    rho, source, row_rho = model.rho, "error_model", None
    if rho is None:
        recalled = _recall(ctx.state, "rho", key)
        rho = 0.0 if recalled is None else float(recalled)
        source = "default" if recalled is None else "earlier call"
        row_rho = _recall(ctx.state, "row_rho", key)
    crests = model.crests if model.crests is not None else _recall(ctx.state, "crests", key)
    # the allocation meets the target with the prediction's upper bound (model.spread)
    target = scheme.target_vnmse / model.spread
    hop: dict[int, torch.Tensor] | None = None
    if classes:
        assert schedule is not None
        table = model.unit_error(schedule, scheme.config, crests)
        hop, allocation = allocate_for_target_by_count(
            summed[1], summed[0], layout.valid, target, classes, world_size=n, rho=rho,
            unit_error=table, row_rho=row_rho, **_hull_options(scheme))
    else:
        table = model.error_per_energy(schedule, scheme.config, rho, crests)
        rule = scheme.format.rule
        allocation = (rule.target if rule is not None else allocate_for_target)(
            summed[1], summed[0], layout.valid, target, world_size=n, rho=rho,
            error_per_energy=table, **_hull_options(scheme))
    # each row's expected error, taken off its decoded energy when rho is measured
    terms = row_error_terms(summed[1], hop or {0: allocation.widths}, classes or None, table, n)
    whole = ctx.collective is Collective.ALLREDUCE
    return hop, allocation, _TargetRecord(key, source, rho, crests, terms, summed[1],
                                          ctx.state if whole else None)


def _sort_order(widths: np.ndarray, hop: dict[int, torch.Tensor] | None,
                shard_row_counts: torch.Tensor | None, n: int) -> np.ndarray:
    """The rows' order: by width within each shard (chunk), or with hop widths by the sum of the
    class widths (sorted for every class), striped over the ``n`` chunks so that each holds the
    same mix of widths at every count. 16-bit keys take NumPy's (faster) radix sort."""
    rows = widths.shape[0]
    if hop is None:
        chunk = (0 if shard_row_counts is None
                 else np.repeat(np.arange(n, dtype=np.int64), shard_row_counts.numpy()))
        key = chunk * 32 + widths  # widths <= 16 < 32
        return np.argsort(key.astype(np.uint16 if n * 32 <= 1 << 16 else np.int64),
                          kind="stable")
    hop_key = torch.stack(list(hop.values())).sum(0).numpy()
    if hop_key.size and int(hop_key.max()) < 1 << 16:
        hop_key = hop_key.astype(np.uint16)
    by_key = np.argsort(hop_key, kind="stable")
    return by_key[np.concatenate([np.arange(c, rows, n) for c in range(n)])]


def _overlaps(incoming: Segments, outgoing: Segments,
              scales: Scales) -> list[tuple[int, int, int, int, int, int]]:
    """Where an incoming and an outgoing segment overlap, in row order: ``(incoming width,
    outgoing width, first row, end row, incoming byte offset, outgoing byte offset)``."""
    pieces = []
    i = j = 0
    while i < len(incoming) and j < len(outgoing):
        w_in, a_in, b_in, off_in = incoming[i]
        w_out, a_out, b_out, off_out = outgoing[j]
        a, b = max(a_in, a_out), min(b_in, b_out)
        if a < b:
            pieces.append((w_in, w_out, a, b, off_in + (a - a_in) * record_nbytes(w_in, scales),
                           off_out + (a - a_out) * record_nbytes(w_out, scales)))
        if b_in <= b_out:
            i += 1
        else:
            j += 1
    return pieces


def _uncovered(covered: list[tuple[int, int]], rows: int, unwritten: np.ndarray | None
               ) -> list[tuple[int, int, bool]]:
    """Rows ``[0, rows)`` outside every ``covered`` span, cut into runs of rows whose work rows
    were left unwritten (``unwritten``) and the others: ``(first, end, unwritten)``."""
    kind = np.zeros(rows, np.int8) if unwritten is None else unwritten.astype(np.int8)
    for a, b in covered:
        kind[a:b] = -1
    cuts = [0, *(np.flatnonzero(kind[1:] != kind[:-1]) + 1).tolist(), rows]
    return [(a, b, bool(kind[a])) for a, b in itertools.pairwise(cuts) if b > a and kind[a] >= 0]


class _LazyRows:
    """Work rows that a gather source stands for until a step reads them (the CPU all-reduce):
    the encodes and hops gather each row from the input as they code it (the ring's every row),
    a pass that writes the centred rows out, and the kernels' read of them back, less."""

    def __init__(self, source: Any, work: torch.Tensor, unwritten: np.ndarray | None) -> None:
        self.source, self.work, self.unwritten = source, work, unwritten
        self.rows = np.ones(work.shape[0], np.bool_)  # rows the source still stands for

    def gathers(self, a: int, b: int) -> bool:
        """Whether the source stands for every row of ``[a, b)`` (the kernels gather them);
        otherwise those it still stands for are written first."""
        if self.rows[a:b].all():
            return True
        self.materialize(a, b)
        return False

    def spend(self, a: int, b: int) -> None:
        """A hop coded rows ``[a, b)`` from the source: their partial sums are spent (as
        ``keep_sum=False`` leaves them) and their work rows unspecified."""
        self.rows[a:b] = False

    def materialize(self, a: int, b: int) -> None:
        """Write the work rows of ``[a, b)`` the source still stands for (as center_gather
        writes them; the unwritten width-0 rows stay so)."""
        if not self.rows[a:b].any():
            return
        edges = np.flatnonzero(np.diff(np.concatenate(([0], self.rows[a:b], [0])).astype(np.int8)))
        for c, d in zip(edges[0::2] + a, edges[1::2] + a, strict=True):
            self.source.write(self.work, int(c), int(d), skip=self.unwritten)
        self.rows[a:b] = False


class DynamiqCall:
    """One collective call: statistics, allocation, reorder, and the per-hop operations."""

    tile_unit = 1  # the executor may cut chunks into tiles of whole rows (super-groups)

    def __init__(self, scheme: SchemeSettings, x: torch.Tensor, ctx: CallContext) -> None:
        self.config = scheme.config
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.key = rng.call_key(ctx.seed, ctx.step)
        self.numel = x.numel()
        self.kernels: dict[str, str] = {}
        self.ops = dynamiq_ops(x.device)
        if scheme.reference_only and self.ops.name != "torch":
            self.ops = torch_ops()
        self.pool = scratch.pool_for(ctx.state, x.device)
        layout = self._lay_out(scheme, x, ctx)
        statistics = self._statistics(scheme, layout, ctx)
        self._allocate(scheme, layout, statistics.summed, ctx)
        self._choose_codec_kernels(scheme, ctx)
        order, sorted_widths = self._reorder(layout, statistics, ctx)
        self._byte_geometry(sorted_widths, order)
        self.chunk_bounds = self._chunk_bounds(layout)
        self.info = self._describe(scheme, ctx)

    def _lay_out(self, scheme: SchemeSettings, x: torch.Tensor, ctx: CallContext) -> _Layout:
        """The rows: shards padded on their own, or the whole input with its tail padded."""
        self.sharded = (ctx.collective is not Collective.ALLREDUCE
                        or scheme.balance is Balance.SHARDS)
        self.shard: tuple[int, int] | None = None  # (shard, shard_rows) in the shard layout
        if not self.sharded:
            return _tail_layout(x, ctx)
        if self.numel % self.world_size and ctx.collective is not Collective.ALLREDUCE:
            raise InvalidArgumentError(
                f"{ctx.what}: {self.numel} elements do not split into {self.world_size} equal "
                f"shards")
        layout, self.shard = _shard_layout(x, self.world_size)
        return layout

    def _statistics(self, scheme: SchemeSettings, layout: _Layout,
                    ctx: CallContext) -> _Statistics:
        """The local statistics (rows in the original order), then their all-reduce. The split
        statistics leave dividing and centring to the reorder's gather; the others do it here."""
        prep = self.ops
        split = (prep.stats is not None and prep.center_gather is not None
                 and scheme.stats in ("fp32", "norm16"))
        divisor = self.world_size if ctx.op is ReduceOp.AVG else 1
        # the statistics the range check's pass took, where they are this call's
        self.surveyed = (ctx.survey if split and isinstance(ctx.survey, Survey)
                         and ctx.survey.covers(layout.flat, divisor, scheme.stats == "fp32")
                         else None)
        flat, centred, mean, norm2, self.kernels["stats"] = local_statistics(
            prep, scheme.stats, layout.flat, layout.valid, divisor, split, self.surveyed)
        return _Statistics(prep, flat, centred, mean, divisor,
                           _reduce_statistics(scheme.stats, mean, norm2, ctx))

    def _allocate(self, scheme: SchemeSettings, layout: _Layout, summed: torch.Tensor,
                  ctx: CallContext) -> None:
        """Sets ``allocation``, ``hop`` (class -> widths, or None) and ``target`` (target mode's
        record, or None)."""
        self.target: _TargetRecord | None = None
        rule = scheme.format.rule
        classes = (count_classes(ctx.schedule.subtree_sizes())
                   if scheme.hop_widths and not self.sharded and ctx.schedule is not None
                   and (rule is None or rule.fixed_width is None) else {})
        self.hop: dict[int, torch.Tensor] | None = None
        if scheme.target_vnmse is not None:
            self.hop, self.allocation, self.target = _allocate_for_target(
                scheme, layout, summed, self.numel, ctx, classes)
            return
        # A short tail costs a whole record, which starved a small buffer's other super-groups:
        # below _EXACT_BUDGET_ROWS the tail's padding is budgeted too (info["over_budget"] says so).
        rows = layout.flat.shape[0]
        numel = (self.numel if rows >= _EXACT_BUDGET_ROWS
                 else min(rows * SUPER, self.numel + SUPER - 1))
        options = dict(_hull_options(scheme), energy_exponent=scheme.energy_exponent)
        if classes:
            self.hop, self.allocation = allocate_widths_by_count(summed[1], numel, scheme.bits,
                                                                 classes, **options)
        elif rule is not None:
            self.allocation = rule.budget(
                summed[1], numel, scheme.bits, scales=scheme.config.scales,
                stats_bytes=scheme.stats_bytes, max_width=scheme.max_width,
                energy_exponent=scheme.energy_exponent)
        else:
            self.allocation = allocate_widths(summed[1], numel, scheme.bits, **options)

    def _choose_codec_kernels(self, scheme: SchemeSettings, ctx: CallContext) -> None:
        """The reference ops (the same bytes) where the kernels lack a width or the scales. Where
        the last decode can write straight into the output (all-reduce, not target mode, which
        measures the work rows), decompress defers the records to finish (``deferred``)."""
        used: set[int] = set()
        for widths in (self.allocation.widths, *(self.hop or {}).values()):
            used.update(np.flatnonzero(np.bincount(widths.numpy())).tolist())
        if not self.ops.implements(self.config.scales, used):
            _warn_once(f"dynamiq: the {self.ops.name} kernels do not implement widths "
                       f"{sorted(used)} with {self.config.scales.value} scales; such calls run "
                       f"the torch reference (the same bytes, slower)")
            self.ops = torch_ops()
        self.deferred: list[tuple[int, int, int, torch.Tensor]] | None = (
            [] if (ctx.collective is Collective.ALLREDUCE and scheme.target_vnmse is None
                   and self.ops.decode_restore_runs is not None) else None)

    def _reorder(self, layout: _Layout, statistics: _Statistics, ctx: CallContext
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Sort the rows; write the work rows, means, valid counts and global indices so."""
        rows, device = layout.flat.shape[0], layout.flat.device
        widths_np = self.allocation.widths.numpy()
        order_np = _sort_order(widths_np, self.hop, layout.shard_row_counts, self.world_size)
        self.order_np = order_np
        self.order = host_to_device(torch.from_numpy(order_np), device, torch.int64)
        sorted_widths = widths_np[order_np]
        prep = statistics.ops
        # Width-0 rows (with the split statistics, every rank's centred values +-0 by the underflow
        # check): an all-reduce whose last decode is the fused one never reads their work rows and
        # restores them as the mean (c + m == m + 0 for c = +-0). Half of a ReLU MLP's gradient.
        self.unwritten: np.ndarray | None = None
        # (the input's address, sorted rows all +0 in it): where the output is the input, the
        # width-0 rows among them with a mean of +-0 already hold what their restore would write
        self.plus_zero_in: tuple[int, np.ndarray] | None = None
        zero = sorted_widths == 0
        if (statistics.centred is None and self.deferred is not None
                and self.ops.restore_mean is not None and bool(zero.any())):
            self.unwritten = zero
            if self.surveyed is not None and not self.sharded:
                self.plus_zero_in = (self.surveyed.data_ptr,
                                     self.surveyed.plus_zero[order_np] & zero)
        # With a gather source the work rows are written only where a step reads them (_LazyRows)
        self.lazy: _LazyRows | None = None
        if statistics.centred is None:
            assert prep.center_gather is not None and statistics.flat is not None
            work = _state_buffer(ctx, _WORK_BUFFER, rows, device)
            if (prep.gather_source is not None and self.ops is prep and self.deferred is not None
                    and not self.sharded):
                self.work = (work if work is not None
                             else torch.empty((rows, SUPER), dtype=torch.float32, device=device))
                self.lazy = _LazyRows(prep.gather_source(
                    statistics.flat, statistics.mean, layout.valid, self.order,
                    divisor=statistics.divisor), self.work, self.unwritten)
            else:
                self.work = prep.center_gather(
                    statistics.flat, statistics.mean, layout.valid, self.order,
                    divisor=statistics.divisor, out=work,
                    **({} if self.unwritten is None else {"skip": self.unwritten}))
            self.kernels["center_gather"] = prep.name
        else:
            self.work = statistics.centred[self.order]
            self.kernels["center_gather"] = "torch"
        statistics.flat = statistics.centred = None  # the work rows hold them from here on
        summed_means = statistics.summed[0]
        self.mean_sorted = (torch.from_numpy(summed_means.numpy()[order_np])
                            if device.type == "cpu" else summed_means[self.order])
        # valid coordinates and global index of each sorted row's start (for restore and rng)
        self.valid_sorted = torch.from_numpy(layout.valid.numpy()[order_np])
        self.index_base = host_to_device(torch.from_numpy(layout.row_start.numpy()[order_np]),
                                         device, torch.int64)
        return order_np, sorted_widths

    def _byte_geometry(self, sorted_widths: np.ndarray, order: np.ndarray) -> None:
        self.geometry = Geometry(sorted_widths, order, self.config.scales, self.hop)

    def _chunk_bounds(self, layout: _Layout) -> list[int]:
        return self.geometry.chunk_bounds(self.world_size, layout.shard_row_counts)

    def _describe(self, scheme: SchemeSettings, ctx: CallContext) -> dict[str, Any]:
        """What the call chose (``comm.last_info``); ``wire_payload`` with hop widths only."""
        wire_payload = None
        if self.hop is not None:
            assert ctx.schedule is not None
            wire_payload = self.geometry.hop_wire_payload(
                self.chunk_bounds, np.asarray(ctx.schedule.subtree_sizes()), self.world_size)
        allocation, target, numel, n = self.allocation, self.target, self.numel, ctx.world_size
        crests = target.crests if target is not None else None
        histogram = np.bincount(allocation.widths.numpy(), minlength=RAW_WIDTH + 1)
        sent = (allocation.total_nbytes if wire_payload is None  # per rank 2 (n - 1) / n of it
                else wire_payload / (2 * (n - 1)) + allocation.stats_nbytes)
        return {
            "bits": 8.0 * sent / max(numel, 1),
            "wire_payload_nbytes": wire_payload,  # over all ranks, with hop widths (else None)
            "u": allocation.u,
            "over_budget": target is None
            and allocation.total_nbytes > math.floor(scheme.bits * numel / 8),
            "predicted_vnmse": allocation.predicted_vnmse,
            # target mode only (docs/target_vnmse.md): rho and its source (_TargetRecord), the
            # crests per width used (None: the Gaussian's); target_met is False on a first call
            "predicted_vnmse_upper": allocation.predicted_vnmse * scheme.error_model.spread
            if target is not None else float("nan"),
            "rho": target.rho if target is not None else None,
            "crests": crests,
            "rho_source": target.source if target is not None else None,
            "target_met": (allocation.target_met and crests is not None)
            if allocation.target_met is not None else None,
            "widths": {w: int(histogram[w]) for w in (0, *ALL_WIDTHS)},
            "kernels": self.kernels,  # the same dict: the codec steps add themselves as they run
            "allocation_impl": allocation.kernel,  # "numba": the compiled search (hop widths)
            "kept_buffer_nbytes": sum(  # the CPU buffers kept (_state_buffer)
                value.nbytes for key, value in (ctx.state or {}).items()
                if isinstance(key, tuple) and key[:1] in ((_INPUT_BUFFER,), (_WORK_BUFFER,))
                and isinstance(value, torch.Tensor)),
        }

    def _decode_restore(self, out: torch.Tensor) -> None:
        """Decode every deferred record straight into ``out`` (plus its mean, at its original
        place); the rows no record covers (width 0) are restored from ``work``."""
        assert self.deferred is not None and self.ops.decode_restore_runs is not None
        rows = self.work.shape[0]
        spans = _uncovered([(a, b) for _, a, b, _ in self.deferred], rows, self.unwritten)
        for c, d, unwritten in spans:  # their rows from the input, before out (maybe it) is written
            if not unwritten:
                self._materialize(c, d)
        self.ops.decode_restore_runs([(records, width, a, b)
                                      for width, a, b, records in self.deferred],
                                     self.config, self.mean_sorted, self.index_base,
                                     self.valid_sorted, out)
        self.deferred.clear()
        for c, d, unwritten in spans:  # views, not copies: width-0 rows can be half of a gradient's
            if unwritten:  # their work rows were never written (see _reorder)
                self._restore_means(c, d, out)
            else:
                assert self.ops.restore is not None
                self.ops.restore(self.work[c:d], self.mean_sorted[c:d], self.index_base[c:d],
                                 self.valid_sorted[c:d], out)

    def _restore_means(self, a: int, b: int, out: torch.Tensor) -> None:
        """Width-0 rows ``[a, b)`` restored as their means (``m + 0``) into the flat ``out``,
        except those that already hold it (``plus_zero_in`` with a mean of +-0)."""
        assert self.ops.restore_mean is not None
        mean, base, valid = self.mean_sorted[a:b], self.index_base[a:b], self.valid_sorted[a:b]
        if self.plus_zero_in is not None and out.data_ptr() == self.plus_zero_in[0]:
            left = ~(self.plus_zero_in[1][a:b] & (mean.numpy() == 0))
            if not left.any():
                return
            if not left.all():
                rows = torch.from_numpy(np.flatnonzero(left))
                mean, base, valid = mean[rows], base[rows], valid[rows]
        self.kernels["restore_mean"] = self.ops.name
        self.ops.restore_mean(mean, base, valid, out)

    def _rows_of(self, chunk: int) -> tuple[int, int]:
        return self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1]

    def _gathers(self, chunk: int) -> bool:
        return self.lazy is not None and self.lazy.gathers(*self._rows_of(chunk))

    def _materialize(self, a: int, b: int) -> None:
        if self.lazy is not None:
            self.lazy.materialize(a, b)

    def _segments(self, chunk: int, count: int) -> Segments:
        return self.geometry.segments(self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1], count)

    def payload_nbytes(self, chunk: int, count: int) -> int:
        return self.geometry.payload_nbytes(self.chunk_bounds[chunk],
                                            self.chunk_bounds[chunk + 1], count)

    def _records(self, payload: torch.Tensor, width: int, a: int, b: int,
                 offset: int) -> torch.Tensor:
        size = record_nbytes(width, self.config.scales)
        return payload[offset : offset + (b - a) * size].view(b - a, size)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 buffer (on the CPU from the communicator's pool)."""
        if self.pool is not None:
            return self.pool.take(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device=self.work.device)

    def frame(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """:meth:`dqcoll.scratch.ScratchPool.frame` of ``buffer``; None without a pool."""
        return self.pool.frame(buffer) if self.pool is not None else None

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        self.kernels["encode"] = self.ops.name
        out = self.scratch(self.payload_nbytes(chunk, count))
        if self.ops.encode_runs is not None:
            # the rows gathered by the kernels stay the source's (a leaf's rows are not spent)
            source = self.lazy.source if self.lazy and self._gathers(chunk) else None
            self.ops.encode_runs(self.work, self._segments(chunk, count), self.index_base,
                                 self.rank, self.world_size, self.key, self.config, out,
                                 **({} if source is None else {"source": source}))
            return out
        self._materialize(*self._rows_of(chunk))
        for width, a, b, offset in self._segments(chunk, count):
            self.ops.encode(self.work[a:b], width, self.index_base[a:b], self.rank,
                            self.world_size, self.key, self.config,
                            out=self._records(out, width, a, b, offset))
        return out

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        for width, a, b, offset in self._segments(chunk, count):
            records = self._records(payload, width, a, b, offset)
            if self.deferred is not None:
                self.deferred.append((width, a, b, records))  # decoded by finish
            else:
                self.kernels["decode"] = self.ops.name
                self.ops.decode(records, width, self.config, out=self.work[a:b])

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self.kernels["decode_accumulate"] = self.ops.name
        self._materialize(*self._rows_of(chunk))
        if self.ops.decode_accumulate_runs is not None and payload.dim() == 1:
            self.ops.decode_accumulate_runs(payload, self._segments(chunk, count), self.config,
                                            self.work)
            return
        for width, a, b, offset in self._segments(chunk, count):
            self.ops.decode_accumulate(self._records(payload, width, a, b, offset), width,
                                       self.config, self.work[a:b])

    def decompress_accumulate_recompress(
        self, chunk: int, payload: torch.Tensor, count: int, out_count: int
    ) -> torch.Tensor:
        """The fused step where a row's width stays (every row without hop widths), else
        decode-accumulate at the incoming width and encode at the outgoing one."""
        self.kernels["decode_accumulate_encode"] = self.ops.name
        out = self.scratch(self.payload_nbytes(chunk, out_count))
        pieces = _overlaps(self._segments(chunk, count), self._segments(chunk, out_count),
                           self.config.scales)
        if self.ops.hop_runs is not None and payload.dim() == 1:
            if self.lazy is not None and self._gathers(chunk):
                self.ops.hop_runs(payload, pieces, self.work, self.index_base, self.rank,
                                  self.world_size, self.key, self.config, out,
                                  source=self.lazy.source)
                self.lazy.spend(*self._rows_of(chunk))
                return out
            self.ops.hop_runs(payload, pieces, self.work, self.index_base, self.rank,
                              self.world_size, self.key, self.config, out)
            return out
        self._materialize(*self._rows_of(chunk))
        for w_in, w_out, a, b, off_in, off_out in pieces:
            records = self._records(payload, w_in, a, b, off_in)
            target = self._records(out, w_out, a, b, off_out)
            if w_in == w_out:  # keep_sum=False: nothing reads this partial sum again
                self.ops.decode_accumulate_encode(
                    records, w_in, self.work[a:b], self.index_base[a:b], self.rank,
                    self.world_size, self.key, self.config, keep_sum=False, out=target)
            else:
                self.ops.decode_accumulate(records, w_in, self.config, self.work[a:b])
                self.ops.encode(self.work[a:b], w_out, self.index_base[a:b], self.rank,
                                self.world_size, self.key, self.config, out=target)
        return out

    def finish_shard(self, shard: int, out: torch.Tensor) -> None:
        """Restore only shard ``shard`` (a reduce-scatter's own) into ``out``."""
        if self.shard is None or self.deferred:
            raise InvalidArgumentError("finish_shard needs a sharded call (reduce-scatter)")
        a, b = self.chunk_bounds[shard], self.chunk_bounds[shard + 1]
        self._restore(out, self.work[a:b], self.mean_sorted[a:b],
                      self.index_base[a:b] - shard * self.shard[0],  # coordinates in the shard
                      self.valid_sorted[a:b])

    def finish(self, out: torch.Tensor) -> None:
        # (an all-zero buffer has neither deferred records nor written work rows)
        if self.deferred is not None and (self.deferred or self.unwritten is not None):
            if (out.dtype == torch.float32 and out.is_contiguous()
                    and out.device == self.work.device):
                self.kernels["decode_restore"] = self.ops.name
                self._decode_restore(out.view(-1))
                return
            self._materialize(0, self.work.shape[0])
            if self.unwritten is not None:  # +0 rows restore as m + 0, the mean they stand for
                self.work[torch.from_numpy(self.unwritten)] = 0.0
                self.unwritten = None
            if self.deferred:
                self.kernels["decode"] = self.ops.name
            for width, a, b, records in self.deferred:  # another output: decode, then restore
                self.ops.decode(records, width, self.config, out=self.work[a:b])
            self.deferred.clear()
        self._materialize(0, self.work.shape[0])
        if self.target is not None:
            self.target.measure(self.work, self.order_np, self.allocation.widths,
                                self.world_size, self.info)
        self._restore(out, self.work, self.mean_sorted, self.index_base, self.valid_sorted)

    def _restore(self, out: torch.Tensor, work: torch.Tensor, mean: torch.Tensor,
                 base: torch.Tensor, valid: torch.Tensor) -> None:
        """Sorted rows plus their means into ``out``, each row's valid values at ``base``:
        ``ops.restore`` where it applies (a contiguous ``out`` on the rows' device), else the
        torch reference's through an fp32 buffer."""
        device = work.device
        if self.ops.restore is not None and out.is_contiguous() and out.device == device:
            self.kernels["restore"] = self.ops.name
            self.ops.restore(work, mean, base, valid, out.view(-1))
            return
        self.kernels["restore"] = "torch"
        result = torch.zeros(out.numel(), dtype=torch.float32, device=device)
        restore_torch(work, mean.to(device), base, valid, result)
        out.copy_(result.reshape(out.shape))
