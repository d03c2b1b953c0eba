"""The ``dynamiq`` scheme: per-call planning around the codec of :mod:`.codec`.

Per call, before the main collective (format 3, the defaults; the paper's configuration in
brackets):

1. ``op="avg"`` divides by ``n``; each rank computes, per super-group of 256, its squared norm
   (``stats="norm16"``) [``"fp32"``: its mean, and the squared norm after subtracting it].
2. One uncompressed sum all-reduce of the bf16 norms, 2 B per super-group = 0.0625 bit per
   coordinate, counted in the budget [fp32 mean and norm: 8 B, 0.25 bit].
3. Widths from the summed norms: the lower convex hull of (record bytes, measured error) over
   widths 2..8 and raw 16 (:func:`.allocation.hull_offsets`) [the paper's closed form over
   {2, 4, 8}], one bisection for the budget. With ``hop_widths`` (all-reduce) every super-group
   gets a width per partial-sum size (:func:`.allocation.allocate_widths_by_count`): a partial
   sum of more ranks weighs more in the error, and the sink's encoding is forwarded n - 1 times.
   ``energy_exponent=a < 1`` ranks super-groups by ``F ** a`` instead (1 aims at the least
   vNMSE). That rule starves low-energy super-groups: on the convergence experiment's gradients at
   5 bits (4 ranks, ring, format 2) the lowest-energy quarter came back with an error as large as
   itself (relative 0.997), and AdamW, which normalises every coordinate by its own gradient
   scale, turns that into noisy updates of whole layers; ``a = 0.5`` cut that quarter's error to
   0.041 for +8 % vNMSE (docs/convergence.md; x1.7-3.1 with format 3, docs/accuracy.md).
4. Reorder: super-groups are sorted by width (stable, a local permutation) and cut into ``n``
   chunks of equal *bytes* (one multi-segment pass through the schedule, not one pass per
   width). Equal-byte chunks keep every rank's traffic at ``2 (n-1)/n`` of the total to within
   one record per transfer, which is what makes the byte budget hold per rank. With hop widths
   the sorted rows are striped over the chunks instead, so that every chunk holds the same mix
   at every count. With ``balance="shards"`` the all-reduce uses the reduce-scatter layout
   instead: chunk ``c`` is shard ``c`` (``ceil(numel / n)`` coordinates, padded to whole
   super-groups on its own), so its result is bit for bit the reduce-scatter's followed by the
   all-gather of its bytes, at the price of per-rank traffic that follows how the widths fall
   across shards. Reduce-scatter and all-gather always use the shard layout.

At every hop the executor calls the fused decompress-accumulate-recompress on each run (where a
row's width changes with the count: decompress-accumulate, then compress); at the end each rank
adds back the summed means (zero without centring) and undoes the reorder.

Random numbers are keyed by the *original* coordinate index, so chunking, reordering and tiling do
not change them.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
from typing import Any

import numpy as np
import torch

from ...errors import InvalidArgumentError
from ...kernels import _torch_ops, dynamiq_ops
from ...types import Collective, ReduceOp
from ..base import FLOAT_DTYPES, CallContext, SchemeSpec
from . import rng
from .allocation import (
    MEASURED_ERRORS,
    STATS_BYTES,
    allocate_for_target,
    allocate_for_target_by_count,
    allocate_widths,
    allocate_widths_by_count,
    count_classes,
    min_bits,
)
from .codec import (
    ALL_WIDTHS,
    FINE_WIDTHS,
    RAW_WIDTH,
    SUPER,
    CodecConfig,
    Levels,
    ProtoScales,
    RoundingMode,
    Scales,
    Widths,
    record_nbytes,
    stats_center_rounded_torch,
)
from .error_model import EPSILON, ErrorModel, estimate_rho

__all__ = ["Balance", "DynamiqCall", "DynamiqScheme"]


def _parse(enum_type: Any, value: Any, name: str) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(str(value).lower())
    except ValueError:
        raise InvalidArgumentError(
            f"dynamiq: {name} must be one of {[e.value for e in enum_type]}, got {value!r}"
        ) from None


class Balance(enum.Enum):
    """How the all-reduce cuts the sorted super-groups into the ``n`` chunks of the schedule."""

    BYTES = "bytes"  # chunks of equal wire bytes (per-rank traffic meets the budget)
    SHARDS = "shards"  # chunk c = shard c, the reduce-scatter layout


_EXACT_BUDGET_ROWS = 64


class DynamiqScheme:
    spec = SchemeSpec(
        name="dynamiq",
        description="DynamiQ: variable widths per 256-coordinate super-group, non-uniform levels, "
        "hierarchical scales, correlated stochastic rounding",
        bits_per_coord=None,
        unbiased=True,  # each rounding; correlated rounding is unbiased only approximately
        exact_sums=False,
        dtypes=FLOAT_DTYPES,
        supports_reduce_scatter=True,
        needs_global_stats=True,
        options=("bits", "target_vnmse", "error_model", "max_width", "levels", "widths",
                 "scales", "rounding", "seed", "balance", "energy_exponent",
                 "width_set", "thresholds", "stats", "hop_widths"),
    )

    def __init__(
        self,
        bits: float = 5.0,
        *,
        target_vnmse: float | None = None,
        error_model: ErrorModel | None = None,
        max_width: int | None = None,
        levels: str | Levels = "tuned",
        widths: str | Widths = "variable",
        scales: str | Scales = "hierarchical4x32",
        rounding: str | RoundingMode = "correlated",
        seed: int = 0,
        balance: str | Balance = "bytes",
        energy_exponent: float = 1.0,
        width_set: str = "fine",
        thresholds: str = "auto",
        stats: str = "norm16",
        hop_widths: bool | str = True,
    ) -> None:
        # The format (docs/dense_gap.md; the paper's configuration is levels="nonuniform",
        # scales="hierarchical", width_set="paper", thresholds="paper", stats="fp32",
        # hop_widths=False, max_width=8): width_set "fine" = widths {2, ..., 8} ("paper":
        # {2, 4, 8}); thresholds "measured" (from the codec's own single-shot errors, the lower
        # convex hull of (bytes, error)), "paper" (4**-w errors) or "auto" ("measured" where those
        # errors are measured for the levels and scales, else "paper"); stats "norm16" (only the
        # bf16 squared norm, 2 B per super-group, no centring), "bf16" (bf16 mean and norm, 4 B: the
        # local mean is rounded to bf16 before centring) or "fp32" (8 B, the paper's).
        if width_set not in ("paper", "fine") or \
                thresholds not in ("paper", "measured", "auto") or \
                stats not in STATS_BYTES:
            raise InvalidArgumentError(
                f"dynamiq: bad width_set/thresholds/stats {width_set!r} {thresholds!r} {stats!r}")
        self.width_set = width_set
        # hop_widths: each super-group's width also depends on how many ranks the partial sum
        # being encoded holds (the executor's ``count``): see allocate_widths_by_count and
        # allocate_for_target_by_count. All-reduce only (reduce-scatter and all-gather use the
        # shard layout, one width per super-group).
        self.hop_widths = str(hop_widths).lower() in ("1", "true", "yes")
        self.thresholds = thresholds  # "auto" is settled below, once the format is known
        self.stats = stats
        proto_scales = str(getattr(scales, "value", scales)).lower() in {
            e.value for e in ProtoScales}
        self.config = CodecConfig(
            levels=_parse(Levels, levels, "levels"),
            scales=(_parse(ProtoScales, scales, "scales") if proto_scales
                    else _parse(Scales, scales, "scales")),
            rounding=_parse(RoundingMode, rounding, "rounding"),
        )
        self.widths_mode: Widths = _parse(Widths, widths, "widths")
        try:
            bits = float(bits)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"dynamiq: bits must be a number, got {bits!r}") from None
        floor = min_bits(self.config.scales, STATS_BYTES[stats])
        if not math.isfinite(bits) or (self.widths_mode is Widths.VARIABLE and bits < floor):
            raise InvalidArgumentError(
                f"dynamiq: bits={bits:g} is below the minimum of {floor:g} bits per coordinate "
                f"(2-bit codes, {self.config.scales.value} scales and statistics)"
            )
        self.bits = bits
        self.seed = int(seed)
        self.balance: Balance = _parse(Balance, balance, "balance")
        if target_vnmse is not None:
            try:
                target_vnmse = float(target_vnmse)
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"dynamiq: target_vnmse must be a number, got {target_vnmse!r}"
                ) from None
            if not (math.isfinite(target_vnmse) and target_vnmse > 0):
                raise InvalidArgumentError(
                    f"dynamiq: target_vnmse must be positive and finite, got {target_vnmse!r}"
                )
        self.target_vnmse = target_vnmse
        try:
            energy_exponent = float(energy_exponent)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"dynamiq: energy_exponent must be a number, got {energy_exponent!r}") from None
        if not 0.0 <= energy_exponent <= 1.0:
            raise InvalidArgumentError(
                f"dynamiq: energy_exponent must be in [0, 1], got {energy_exponent!r}")
        if energy_exponent != 1.0 and target_vnmse is not None:
            raise InvalidArgumentError(
                "dynamiq: energy_exponent applies to a bit budget; target_vnmse allocates for "
                "the error itself (leave energy_exponent at 1)")
        self.energy_exponent = energy_exponent
        self.error_model = error_model or ErrorModel()
        # Raw 16-bit super-groups (514 B): on by default, so that a budget larger than every
        # super-group at 8 bits buys a lower error (with many all-zero super-groups), and tight
        # targets can be met. max_width=8 (the paper's) leaves such a budget unused.
        if max_width is None:
            max_width = RAW_WIDTH
        if max_width not in (8, RAW_WIDTH):
            raise InvalidArgumentError(f"dynamiq: max_width must be 8 or 16, got {max_width!r}")
        self.max_width = int(max_width)
        # The prototype scale encodings exist in the torch reference only; a call whose widths
        # or scales the device's kernels do not implement (``DynamiqOps.formats``) runs on the
        # reference too (DynamiqCall).
        self.reference_only = isinstance(self.config.scales, ProtoScales)
        if target_vnmse is not None and not set(
                FINE_WIDTHS if width_set == "fine" else (2, 4, 8)) <= set(
                EPSILON.get((self.config.levels, self.config.scales), {})):
            raise InvalidArgumentError(
                f"dynamiq: target_vnmse has no error model for levels={self.config.levels.value}, "
                f"scales={self.config.scales.value}, width_set={width_set} "
                f"(docs/target_vnmse.md)")
        if thresholds == "auto":
            thresholds = self.thresholds = (
                "measured" if (self.config.levels, self.config.scales) in MEASURED_ERRORS
                else "paper")
        if thresholds == "measured" and (self.config.levels, self.config.scales) not in \
                MEASURED_ERRORS:
            raise InvalidArgumentError(
                f"dynamiq: thresholds='measured' has no measured errors for "
                f"levels={self.config.levels.value}, scales={self.config.scales.value}")

    def allocation_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"stats_bytes": STATS_BYTES[self.stats]}
        if self.width_set == "fine":
            options["width_set"] = FINE_WIDTHS
        if self.thresholds == "measured":
            options["errors"] = MEASURED_ERRORS[(self.config.levels, self.config.scales)]
        elif self.width_set == "fine":
            options["errors"] = None  # 4**-w over the fine widths
        return options

    def __repr__(self) -> str:
        c = self.config
        budget = (f"target_vnmse={self.target_vnmse:g}, model={self.error_model}"
                  if self.target_vnmse is not None else f"bits={self.bits:g}")
        return (
            f"DynamiqScheme({budget}, max_width={self.max_width}, levels={c.levels.value}, "
            f"widths={self.widths_mode.value}, scales={c.scales.value}, "
            f"rounding={c.rounding.value}, balance={self.balance.value}"
            + (f", energy_exponent={self.energy_exponent:g}" if self.energy_exponent != 1.0
               else "")
            + f", width_set={self.width_set}, thresholds={self.thresholds}, stats={self.stats}"
            + f", hop_widths={self.hop_widths}"
            + ")"
        )

    def begin(self, x: torch.Tensor, ctx: CallContext) -> DynamiqCall:
        return DynamiqCall(self, x, ctx)

    # -- single-shot codec (one worker, local statistics) -----------------------------------

    def wire_nbytes(self, numel: int) -> int:
        rows = -(-numel // SUPER)
        stats = STATS_BYTES[self.stats]
        cheapest = rows * (record_nbytes(2, self.config.scales) + stats)
        if self.widths_mode is Widths.FIXED:
            return rows * (record_nbytes(4, self.config.scales) + stats)
        return max(math.floor(self.bits * numel / 8.0), cheapest)

    def encode(self, x: torch.Tensor) -> dict[str, Any]:
        """Compress one tensor on its own (statistics local, world size 1)."""
        ctx = CallContext(0, 1, ReduceOp.SUM, self.seed, 0, Collective.ALLREDUCE, "encode")
        call = DynamiqCall(self, x.detach().reshape(-1), ctx)
        return {"shape": tuple(x.shape), "call": call, "data": call.compress(0, 1)}

    def decode(self, payload: dict[str, Any]) -> torch.Tensor:
        call: DynamiqCall = payload["call"]
        call.decompress(0, payload["data"], 1)
        out = torch.empty(call.numel, dtype=torch.float32, device=call.work.device)
        call.finish(out)
        return out.reshape(payload["shape"])


def _state_buffer(ctx: CallContext, name: str, rows: int,
                  device: torch.device) -> torch.Tensor | None:
    """An fp32 ``[rows, 256]`` buffer of a CPU call kept by the communicator between calls
    under ``name`` (None where there is no communicator state, or off the CPU: CUDA has torch's
    caching allocator). Calls on one communicator run one at a time, and nothing reads a call's
    buffers after its ``finish``. A fresh 64 MiB buffer per call cost page faults on first
    touch: 91 ms for the centring pass vs ~15 ms into a reused one (2^24 coordinates, 2-core
    VM); the padded copy of an input whose length is no multiple of 256 cost 40 ms of
    ``torch.zeros`` per 12.6 M coordinates. Each buffer holds the largest call seen so far on
    its communicator (``ctx.state``), and goes with it."""
    if ctx.state is None or device.type != "cpu":
        return None
    key = (name, str(device))
    buffer = ctx.state.get(key)
    if not isinstance(buffer, torch.Tensor) or buffer.shape[0] < rows:
        buffer = torch.empty((rows, SUPER), dtype=torch.float32, device=device)
        ctx.state[key] = buffer
    return buffer[:rows]


def _work_buffer(ctx: CallContext, rows: int, device: torch.device) -> torch.Tensor | None:
    """The call's fp32 ``[rows, 256]`` work rows (see :func:`_state_buffer`)."""
    return _state_buffer(ctx, "dynamiq.work", rows, device)


def _runs(sorted_widths: np.ndarray, rows: int) -> list[tuple[int, int, int]]:
    """Maximal runs (width, first row, end row) of equal non-zero width."""
    runs = []
    change = np.flatnonzero(sorted_widths[1:] != sorted_widths[:-1]) + 1
    for a, b in itertools.pairwise([0, *change.tolist(), rows]):
        width = int(sorted_widths[a])
        if width and b > a:
            runs.append((width, a, b))
    return runs


log = logging.getLogger("dqcoll")
_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log a fallback to the reference once per distinct reason (not per call)."""
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


class DynamiqCall:
    """One collective call: statistics, allocation, reorder, and the per-hop operations."""

    tile_unit = 1  # the executor may cut chunks into tiles of whole rows (super-groups)

    def __init__(self, scheme: DynamiqScheme, x: torch.Tensor, ctx: CallContext) -> None:
        n = ctx.world_size
        device = x.device
        self.config = scheme.config
        self.rank = ctx.rank
        self.world_size = n
        self.key = rng.call_key(ctx.seed, ctx.step)
        self.numel = numel = x.numel()
        self.ops = dynamiq_ops(device)
        if scheme.reference_only and self.ops.name != "torch":
            self.ops = _torch_ops()
        prep = self.ops  # statistics and the reorder; the codec's ops are settled in step 3

        # Layout: the byte-balanced all-reduce pads the tail only; reduce-scatter / all-gather (and
        # the all-reduce with balance="shards") pad each shard of ceil(numel / n) coordinates on
        # its own, so that chunk c is exactly shard c.
        self.sharded = (ctx.collective is not Collective.ALLREDUCE
                        or scheme.balance is Balance.SHARDS)
        self.uneven = False  # sharded with numel % n != 0 (all-reduce only): shards differ
        if self.sharded:
            if numel % n and ctx.collective is not Collective.ALLREDUCE:
                raise InvalidArgumentError(
                    f"{ctx.what}: {numel} elements do not split into {n} equal shards"
                )
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
            row_chunk = torch.arange(n, dtype=torch.int64).repeat_interleave(shard_rows)
            shard_row_counts = -(-lengths // SUPER)
            flat = flat.view(n * shard_rows, SUPER)
            if numel % n:  # drop the rows past the end (a row with no valid coordinate)
                self.uneven = True
                exists = valid > 0
                flat, row_start, valid, row_chunk = (
                    flat[exists.to(device)], row_start[exists], valid[exists], row_chunk[exists])
            rows = flat.shape[0]
            self.shard: tuple[int, int] | None = (shard, shard_rows)
        else:
            rows = -(-numel // SUPER)
            if numel == rows * SUPER and x.dtype == torch.float32 and x.is_contiguous():
                flat = x.view(rows, SUPER)  # the input itself: read, never written below
            else:
                kept = _state_buffer(ctx, "dynamiq.input", rows, device)
                flat = (kept if kept is not None
                        else torch.empty(rows, SUPER, dtype=torch.float32, device=device))
                flat.view(-1)[:numel] = x.reshape(-1)
                flat.view(-1)[numel:] = 0.0  # the tail's padding
            row_start = torch.arange(rows, dtype=torch.int64) * SUPER
            valid = (numel - row_start).clamp(max=SUPER)
            row_chunk = torch.zeros(rows, dtype=torch.int64)
            self.shard = None
        flat = flat.view(rows, SUPER)

        # 1. Scale for avg, statistics and centring (rows in the original order).
        # The fast paths that split stats_center write the centred rows only once, already in
        # the sorted order (step 4), dividing by n for avg on the way; the others divide and
        # centre here and gather later.
        split = (prep.stats is not None and prep.center_gather is not None
                 and scheme.stats in ("fp32", "norm16"))
        divisor = n if ctx.op is ReduceOp.AVG else 1
        if divisor != 1 and not split:
            flat = flat / n  # a new buffer: flat may be the caller's tensor
        centred: torch.Tensor | None = None
        # What ran, step by step (comm.last_info["kernels"]); filled in as the steps run.
        self.kernels: dict[str, str] = {}
        if split:
            assert prep.stats is not None
            # norm16: no centring (zero means; center_gather then writes x / divisor itself)
            mean, norm2 = prep.stats(flat, valid, divisor=divisor,
                                     centre=scheme.stats == "fp32")
            self.kernels["stats"] = prep.name
        elif scheme.stats in ("bf16", "norm16"):
            centred, mean, norm2 = stats_center_rounded_torch(flat, valid,
                                                              centre=scheme.stats == "bf16")
            self.kernels["stats"] = "torch"
        else:
            centred, mean, norm2 = prep.stats_center(flat, valid)
            self.kernels["stats"] = prep.name
        # A row whose squares all underflow fp32 (|x| below ~1e-23) has norm2 == 0 although it is
        # not zero: give it the smallest normal norm so that it still gets a record (width 0 would
        # drop it, and each rank would keep its own centred values).
        empty = torch.nonzero(norm2 == 0).squeeze(1)
        if empty.numel():  # scan only those rows
            if centred is not None:
                centred_empty = centred[empty]
            else:
                pad = (torch.arange(SUPER, device=device)[None, :]
                       >= valid[empty].to(device)[:, None])
                centred_empty = (flat[empty] / divisor - mean[empty, None]).masked_fill(pad, 0.0)
            lost = empty[(centred_empty != 0).any(dim=1)]
            norm2 = norm2.clone()
            norm2[lost] = torch.finfo(torch.float32).tiny

        # 2. One small uncompressed all-reduce of both statistics.
        stats = torch.stack([mean, norm2])
        if scheme.stats == "bf16":  # 16-bit statistics on the wire, summed in bf16
            wire = stats.to(torch.bfloat16)
            ctx.reduce(wire, "sum", f"{ctx.what} statistics")
            stats = wire.float()
        elif scheme.stats == "norm16":  # no centring: only the bf16 norm is sent (2 B)
            wire = norm2.to(torch.bfloat16)[None]
            ctx.reduce(wire, "sum", f"{ctx.what} statistics")
            stats = torch.stack([torch.zeros_like(mean), wire[0].float()])
        else:
            ctx.reduce(stats, "sum", f"{ctx.what} statistics")

        # 3. Widths from the summed norms (identical on every rank): under a bit budget, or the
        #    cheapest whose predicted error meets target_vnmse.
        self.rho_key: tuple[Any, ...] | None = None
        self.hop: dict[int, torch.Tensor] | None = None
        self.hop_tau: dict[int, float] = {}
        hop_widths = (scheme.hop_widths and not self.sharded and ctx.schedule is not None
                      and scheme.widths_mode is Widths.VARIABLE)
        options = scheme.allocation_options()
        classes = (count_classes(ctx.schedule.subtree_sizes())
                   if hop_widths and ctx.schedule is not None else {})
        if scheme.target_vnmse is not None:
            schedule = ctx.schedule
            model = scheme.error_model
            rho = model.rho
            if rho is None:  # the estimate the previous call on this communicator measured
                self.rho_key = ("dynamiq.rho", numel, ctx.collective.value,
                                schedule.algorithm if schedule is not None else "")
                rho = float((ctx.state or {}).get(self.rho_key, 0.0))
            if hop_widths:
                assert schedule is not None
                self.hop, self.allocation = allocate_for_target_by_count(
                    stats[1], stats[0], valid, scheme.target_vnmse, classes, world_size=n,
                    rho=rho, unit_error=model.unit_error(schedule, self.config),
                    scales=self.config.scales,
                    width_set=options.get("width_set") or (2, 4, 8),
                    errors=options.get("errors"), stats_bytes=options["stats_bytes"],
                    max_width=scheme.max_width)
            else:
                self.allocation = allocate_for_target(
                    stats[1], stats[0], valid, scheme.target_vnmse, world_size=n, rho=rho,
                    error_per_energy=model.error_per_energy(schedule, self.config, rho),
                    scales=self.config.scales,
                    widths_mode=scheme.widths_mode, max_width=scheme.max_width, **options,
                )
            self.summed_energy = float(torch.nan_to_num(stats[1].double(), 0.0, 0.0, 0.0).sum())
            self.state = ctx.state
            self.info_rho = rho
            # after a reduce-scatter only this rank's shard is decoded: nothing to measure
            self.whole_result = ctx.collective is Collective.ALLREDUCE
        else:
            # A short tail (e.g. 1026 = 4 * 256 + 2) costs a whole record. In a small buffer that
            # starved every other super-group (2 ranks, 5 bits, 1026 coordinates: vNMSE 0.56), so
            # below 64 super-groups the tail's padding is budgeted too (at most 255 * bits / 8
            # bytes over; info["over_budget"] then says so). From 64 super-groups on, the tail is
            # under 2 % of the budget and the budget is exact.
            budget_numel = (numel if rows >= _EXACT_BUDGET_ROWS
                            else min(rows * SUPER, numel + SUPER - 1))
            if not hop_widths:
                self.allocation = allocate_widths(
                    stats[1], budget_numel, scheme.bits, widths_mode=scheme.widths_mode,
                    scales=self.config.scales, max_width=scheme.max_width,
                    energy_exponent=scheme.energy_exponent, **options,
                )
            else:
                self.hop, self.allocation = allocate_widths_by_count(
                    stats[1], budget_numel, scheme.bits, classes, scales=self.config.scales,
                    width_set=options.get("width_set") or (2, 4, 8),
                    errors=options.get("errors"), stats_bytes=options["stats_bytes"],
                    max_width=scheme.max_width, energy_exponent=scheme.energy_exponent)
        if self.hop is not None:
            self.hop_tau = {c: t for c, (_, t) in classes.items()}
        widths = self.allocation.widths  # int64 [rows], host
        # Kernels that do not implement a width this call uses (or the scales) leave the whole
        # call's codec to the reference ops (the same bytes, slower).
        used = set(np.flatnonzero(np.bincount(widths.numpy(), minlength=1)).tolist())
        for class_widths in (self.hop or {}).values():
            used |= set(np.flatnonzero(np.bincount(class_widths.numpy(), minlength=1)).tolist())
        if not self.ops.implements(self.config.scales, used):
            _warn_once(f"dynamiq: the {self.ops.name} kernels do not implement widths "
                       f"{sorted(used)} with {self.config.scales.value} scales; such calls run "
                       f"the torch reference (the same bytes, slower)")
            self.ops = _torch_ops()

        # 4. Reorder by width (within each shard when sharded) and cut into chunks. The row
        #    tables are built in NumPy on the host: a stable argsort of 16-bit keys is a radix
        #    sort (0.2 ms at 2^16 rows, torch's stable argsort 1.4 ms), and the per-row indexing
        #    and scans around it cost ~3 ms per call in torch ops on the 2-core dev VM.
        widths_np = widths.numpy()
        if self.hop is not None:
            # Every class's widths are monotone in F: sorted by their sum, rows are sorted for
            # every class. Striped over the n chunks (sorted row i -> chunk i mod n, sorted again
            # within each chunk) so that every chunk holds the same mix of widths at every count
            # and each rank's traffic meets the budget whichever (chunk, count) pairs it sends.
            hop_key = torch.stack(list(self.hop.values())).sum(0).numpy()
            by_key = np.argsort(hop_key, kind="stable")
            stripe = np.arange(rows, dtype=np.int64) % n
            order_np = by_key[np.argsort(stripe, kind="stable")]
            hop_bounds = [0, *np.cumsum(np.bincount(stripe, minlength=n)).tolist()]
        else:
            key = row_chunk.numpy() * 32 + widths_np  # widths <= 16 < 32
            order_np = np.argsort(key.astype(np.uint16 if n * 32 <= 1 << 16 else np.int64),
                                  kind="stable")
        order = torch.from_numpy(order_np)
        self.order = order.to(device)
        sorted_widths = widths_np[order_np]
        if centred is None:
            assert prep.center_gather is not None
            self.work = prep.center_gather(flat, mean, valid, self.order, divisor=divisor,
                                               out=_work_buffer(ctx, rows, device))
            self.kernels["center_gather"] = prep.name
        else:
            self.work = centred[self.order]
            self.kernels["center_gather"] = "torch"
        del centred, flat
        self.mean_sorted = (torch.from_numpy(stats[0].numpy()[order_np])
                            if device.type == "cpu" else stats[0][self.order])
        # valid coordinates and global index of each sorted row's start (for restore and rng)
        self.valid_sorted = torch.from_numpy(valid.numpy()[order_np])
        self.index_base = torch.from_numpy(row_start.numpy()[order_np]).to(device)
        sizes = np.zeros(RAW_WIDTH + 1, dtype=np.int64)
        for w in ALL_WIDTHS:
            sizes[w] = record_nbytes(w, self.config.scales)
        offsets = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(sizes[sorted_widths], out=offsets[1:])
        self.row_offsets: np.ndarray = offsets  # byte offset of each sorted row's record
        # hop_widths: per count class, the byte offsets and runs of that class's widths
        self._geom: dict[int, tuple[np.ndarray, list[tuple[int, int, int]]]] = {}
        if self.hop is not None:
            avg = np.zeros(rows + 1, dtype=np.float64)
            for c, class_widths in self.hop.items():
                class_sorted = class_widths.numpy()[order_np]
                class_offsets = np.zeros(rows + 1, dtype=np.int64)
                np.cumsum(sizes[class_sorted], out=class_offsets[1:])
                avg += self.hop_tau[c] * class_offsets.astype(np.float64)
                self._geom[c] = (class_offsets, _runs(class_sorted, rows))
            self.row_offsets = avg  # traffic-weighted average bytes (chunk geometry)
        if self.hop is not None:
            bounds = hop_bounds
        elif self.sharded:  # chunk c = the rows of shard c
            bounds = [0, *torch.cumsum(shard_row_counts, 0).tolist()]
        else:  # n chunks of (nearly) equal bytes
            total = int(offsets[-1])
            bounds = [0]
            for c in range(1, n):
                target = (c * total + n // 2) // n
                bounds.append(max(bounds[-1], int(np.searchsorted(offsets, target))))
            bounds.append(rows)
        self.chunk_bounds = bounds
        # Maximal runs of equal width in the sorted rows (width-0 rows have no records).
        self.runs: list[tuple[int, int, int]] = []
        change = np.flatnonzero(sorted_widths[1:] != sorted_widths[:-1]) + 1
        edges = [0, *change.tolist(), rows]
        for a, b in itertools.pairwise(edges):
            width = int(sorted_widths[a]) if b > a else 0
            if width:
                self.runs.append((width, a, b))
        histogram = np.bincount(widths_np, minlength=RAW_WIDTH + 1)
        counts = {w: int(histogram[w]) for w in (0, *ALL_WIDTHS)}
        bits_used = 8.0 * self.allocation.total_nbytes / max(numel, 1)
        wire_payload = None
        if self.hop is not None:
            # What the all-reduce sends in all, over every rank: each non-sink rank sends its
            # partial sum of a chunk once (count = its subtree), the sink's encoding (count n) is
            # forwarded n - 1 times. Per rank it is 2 (n - 1) / n of the records, as without hop
            # widths, and the statistics come on top.
            assert ctx.schedule is not None
            subtree = ctx.schedule.subtree_sizes()
            wire_payload = sum(
                self.payload_nbytes(c, subtree[r][c]) for c in range(n) for r in range(n)
                if subtree[r][c] < n) + sum((n - 1) * self.payload_nbytes(c, n) for c in range(n))
            bits_used = 8.0 * (wire_payload / (2 * (n - 1)) + self.allocation.stats_nbytes) \
                / max(numel, 1)
        # The all-reduce's last decode of every row (the all-gather's and the sink's own) can
        # write straight into the output with the restore (ops.decode_restore): decompress
        # then only records (rows, records) here and finish decodes them into ``out``. Not in
        # target mode, which measures the decoded work rows.
        self.deferred: list[tuple[int, int, int, torch.Tensor]] | None = (
            [] if (ctx.collective is Collective.ALLREDUCE and self.ops.decode_restore is not None
                   and scheme.target_vnmse is None) else None)
        self.info: dict[str, Any] = {
            "bits": bits_used,
            # the all-reduce's payload bytes over all ranks (hop widths; else 2 (n - 1) times
            # the records of "widths")
            "wire_payload_nbytes": wire_payload,
            "u": self.allocation.u,
            "over_budget": self.allocation.total_nbytes > math.floor(scheme.bits * numel / 8)
            if scheme.target_vnmse is None else False,
            "predicted_vnmse": self.allocation.predicted_vnmse,
            "rho": getattr(self, "info_rho", None),
            "target_met": self.allocation.target_met,
            "widths": counts,
            "kernels": self.kernels,  # the same dict: the codec steps add themselves as they run
            # the bit allocation (host code): "numba" where the compiled bisection ran, "torch"
            # for the torch allocation (hop widths, fine width sets, target mode: the defaults)
            "allocation_impl": self.allocation.kernel,
        }

    def _decode_restore(self, out: torch.Tensor) -> None:
        """Decode every deferred record straight into ``out`` (plus its mean, at its original
        place); rows decompress did not defer (width 0 or 16) are restored from ``work``."""
        assert self.deferred is not None and self.ops.decode_restore is not None
        rows = self.work.shape[0]
        for width, a, b, records in self.deferred:
            self.ops.decode_restore(records, width, self.config, self.mean_sorted[a:b],
                                    self.index_base[a:b], self.valid_sorted[a:b], out)
        gaps, end = [], 0  # the rows outside every deferred span
        for a, b in sorted((a, b) for _, a, b, _ in self.deferred):
            if a > end:
                gaps.append(torch.arange(end, a))
            end = max(end, b)
        if end < rows:
            gaps.append(torch.arange(end, rows))
        self.deferred.clear()
        if gaps:
            rest = torch.cat(gaps)
            assert self.ops.restore is not None
            self.ops.restore(self.work[rest], self.mean_sorted[rest], self.index_base[rest],
                             self.valid_sorted[rest], out)

    def _measure_rho(self) -> None:
        """Target mode: estimate the ranks' correlation from the decoded aggregate (identical on
        every rank, so every rank stores the same estimate) for the next call."""
        if self.rho_key is None or self.state is None or not self.whole_result:
            return
        decoded_energy = float(torch.nan_to_num(self.work.double(), 0.0, 0.0, 0.0).square().sum())
        rho = estimate_rho(decoded_energy, self.summed_energy, self.world_size)
        if rho is not None:
            self.state[self.rho_key] = rho
            self.info["rho_measured"] = rho

    # -- chunk geometry -----------------------------------------------------------------------

    def _geometry(self, count: int | None) -> tuple[Any, list[tuple[int, int, int]]]:
        if self._geom and count is not None:
            return self._geom[count]
        return self.row_offsets, self.runs

    def _segments(self, chunk: int, count: int | None = None) -> list[tuple[int, int, int, int]]:
        """(width, first row, end row, byte offset in the chunk payload) of each run in a chunk."""
        row_offsets, runs = self._geometry(count)
        lo, hi = self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1]
        base = int(row_offsets[lo])
        segments = []
        for width, start, stop in runs:
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                segments.append((width, a, b, int(row_offsets[a]) - base))
        return segments

    def payload_nbytes(self, chunk: int, count: int) -> int:
        row_offsets, _ = self._geometry(count)
        lo, hi = self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1]
        return int(row_offsets[hi] - row_offsets[lo])

    def _records(
        self, payload: torch.Tensor, width: int, a: int, b: int, offset: int
    ) -> torch.Tensor:
        size = record_nbytes(width, self.config.scales)
        return payload[offset : offset + (b - a) * size].view(b - a, size)

    # -- per-hop operations -------------------------------------------------------------------

    def compress(self, chunk: int, count: int) -> torch.Tensor:
        self.kernels["encode"] = self.ops.name
        out = torch.empty(self.payload_nbytes(chunk, count), dtype=torch.uint8,
                          device=self.work.device)
        for width, a, b, offset in self._segments(chunk, count):
            self.ops.encode(self.work[a:b], width, self.index_base[a:b], self.rank,
                            self.world_size, self.key, self.config,
                            out=self._records(out, width, a, b, offset))
        return out

    def decompress(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        for width, a, b, offset in self._segments(chunk, count):
            records = self._records(payload, width, a, b, offset)
            if self.deferred is not None and width != RAW_WIDTH:
                self.deferred.append((width, a, b, records))  # decoded by finish
            else:
                self.kernels["decode"] = self.ops.name
                self.ops.decode(records, width, self.config, out=self.work[a:b])

    def decompress_accumulate(self, chunk: int, payload: torch.Tensor, count: int) -> None:
        self.kernels["decode_accumulate"] = self.ops.name
        for width, a, b, offset in self._segments(chunk, count):
            self.ops.decode_accumulate(self._records(payload, width, a, b, offset), width,
                                       self.config, self.work[a:b])

    def decompress_accumulate_recompress(
        self, chunk: int, payload: torch.Tensor, count: int, out_count: int
    ) -> torch.Tensor:
        self.kernels["decode_accumulate_encode"] = self.ops.name
        if self._geom:
            return self._hop_widths_step(chunk, payload, count, out_count)
        out = torch.empty_like(payload)
        for width, a, b, offset in self._segments(chunk):
            self.ops.decode_accumulate_encode(
                self._records(payload, width, a, b, offset), width, self.work[a:b],
                self.index_base[a:b], self.rank, self.world_size, self.key, self.config,
                keep_sum=False,  # nothing reads this partial sum again (decode overwrites it)
                out=self._records(out, width, a, b, offset),
            )
        return out

    def _hop_widths_step(self, chunk: int, payload: torch.Tensor, count: int,
                         out_count: int) -> torch.Tensor:
        """The hop when widths depend on the count: rows whose width stays the same take the
        fused decode-accumulate-encode; where it changes, decode-accumulate at the incoming
        width, then encode at the outgoing one (both tables order the rows alike)."""
        out = torch.empty(self.payload_nbytes(chunk, out_count), dtype=torch.uint8,
                          device=self.work.device)
        incoming = self._segments(chunk, count)
        outgoing = self._segments(chunk, out_count)
        i = j = 0
        while i < len(incoming) and j < len(outgoing):
            w_in, a_in, b_in, off_in = incoming[i]
            w_out, a_out, b_out, off_out = outgoing[j]
            a, b = max(a_in, a_out), min(b_in, b_out)
            if a < b:
                size_in = record_nbytes(w_in, self.config.scales)
                size_out = record_nbytes(w_out, self.config.scales)
                records = payload[off_in + (a - a_in) * size_in:
                                  off_in + (b - a_in) * size_in].view(b - a, size_in)
                target = out[off_out + (a - a_out) * size_out:
                             off_out + (b - a_out) * size_out].view(b - a, size_out)
                if w_in == w_out:
                    self.ops.decode_accumulate_encode(
                        records, w_in, self.work[a:b], self.index_base[a:b], self.rank,
                        self.world_size, self.key, self.config, keep_sum=False, out=target)
                else:
                    self.ops.decode_accumulate(records, w_in, self.config, self.work[a:b])
                    self.ops.encode(self.work[a:b], w_out, self.index_base[a:b], self.rank,
                                    self.world_size, self.key, self.config, out=target)
            if b_in <= b_out:
                i += 1
            else:
                j += 1
        return out

    def finish_shard(self, shard: int, out: torch.Tensor) -> None:
        """Restore only shard ``shard`` (a reduce-scatter's own) into ``out`` (one shard's
        coordinates): the rows of chunk ``shard``, which the sharded layout keeps together."""
        if self.shard is None or self.deferred:
            raise InvalidArgumentError("finish_shard needs a sharded call (reduce-scatter)")
        size = self.shard[0]
        a, b = self.chunk_bounds[shard], self.chunk_bounds[shard + 1]
        work, mean = self.work[a:b], self.mean_sorted[a:b]
        base = self.index_base[a:b] - shard * size  # coordinates within the shard
        valid = self.valid_sorted[a:b]
        if self.ops.restore is not None and out.is_contiguous() and out.device == work.device:
            self.kernels["restore"] = self.ops.name
            self.ops.restore(work, mean, base, valid, out.view(-1))
            return
        self.kernels["restore"] = "torch"
        value = work + mean.to(work.device)[:, None]
        coord = torch.arange(SUPER, device=work.device)
        keep = coord[None, :] < valid.to(work.device)[:, None]
        target = base.to(work.device)[:, None] + coord[None, :]
        result = torch.zeros(out.numel(), dtype=torch.float32, device=work.device)
        result[target[keep]] = value[keep]
        out.copy_(result.reshape(out.shape))

    def finish(self, out: torch.Tensor) -> None:
        if self.deferred:
            if (self.ops.decode_restore is not None and out.dtype == torch.float32
                    and out.is_contiguous() and out.device == self.work.device):
                self.kernels["decode_restore"] = self.ops.name
                self._decode_restore(out.view(-1))
                return
            self.kernels["decode"] = self.ops.name
            for width, a, b, records in self.deferred:  # another output: decode, then restore
                self.ops.decode(records, width, self.config, out=self.work[a:b])
            self.deferred.clear()
        self._measure_rho()
        if self.ops.restore is not None and out.is_contiguous() and out.device == self.work.device:
            self.kernels["restore"] = self.ops.name
            self.ops.restore(self.work, self.mean_sorted, self.index_base, self.valid_sorted,
                             out.view(-1))
            return
        self.kernels["restore"] = "torch"
        if self.uneven:  # rows past the end were dropped: scatter by coordinate index
            value = self.work + self.mean_sorted[:, None]
            coord = torch.arange(SUPER, device=value.device)
            keep = coord[None, :] < self.valid_sorted.to(value.device)[:, None]
            target = self.index_base[:, None] + coord[None, :]
            result = torch.empty(self.numel, dtype=torch.float32, device=value.device)
            result[target[keep]] = value[keep]
            out.copy_(result.reshape(out.shape))
            return
        restored = torch.empty_like(self.work)
        restored[self.order] = self.work + self.mean_sorted[:, None]
        if self.shard is not None:
            shard, shard_rows = self.shard
            result = restored.view(self.world_size, shard_rows * SUPER)[:, :shard]
        else:
            result = restored.view(-1)[: self.numel]
        out.copy_(result.reshape(out.shape))
