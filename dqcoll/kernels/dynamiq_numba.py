"""Launchers of the compiled CPU DynamiQ kernels: check, allocate, split rows over threads.
``OPS`` is what :func:`dqcoll.kernels.dynamiq_ops` hands out for CPU tensors.

Each launcher has the signature of its torch reference in :mod:`dqcoll.kernels.codec`
(plus ``out=``, to write records or rows straight into the caller's buffer) and returns the same
bytes and the same fp32 values, raw width 16 (fp16 values relative to a bf16 unit) included: it
was the reference's torch passes until real gradients showed what it costs (a ReLU MLP's dead
units leave half its rows at width 0, so the budget lifts a third of the rest to 16 bits, and
those passes were a fifth of the codec's CPU). Tensors are handed to the kernels as NumPy
views (zero copy); inputs that are not row-contiguous are copied once.

Per-call tables (level magnitudes, the level-search table, the decode table) are built once per
(width, levels) and cached; the kernels are compiled on first use and cached on disk by numba
(:func:`warm_up` compiles or loads all of them, which the communicators do at creation so that
ranks do not compile at different steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
from collections.abc import Iterator

import numpy as np
import torch

from . import _dynamiq_numba_kernels as K
from ._params import RoundingParams, level_tables
from .codec import (
    FINE_WIDTHS,
    RAW_WIDTH,
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    Scales,
    record_nbytes,
)
from .cpu_runtime import cpu_threads, run_rows
from .ops import DynamiqOps, check_format

__all__ = [
    "FORMATS",
    "OPS",
    "GatherSource",
    "center_gather",
    "decode",
    "decode_accumulate",
    "decode_accumulate_encode",
    "decode_accumulate_runs",
    "decode_restore",
    "decode_restore_runs",
    "encode",
    "encode_runs",
    "gather_source",
    "hop_runs",
    "max_finite_abs",
    "restore",
    "restore_mean",
    "stats",
    "stats_center",
    "stats_range",
    "warm_up",
]

_H, _F, _Q = Scales.HIERARCHICAL, Scales.FLAT, Scales.HIERARCHICAL4X32
# One encode and one hop entry point per (width, scales), both literals in the kernel; the
# decodes take the scales at run time (see _dynamiq_numba_kernels).
_ENCODE = {(2, _H): K.encode_w2h, (4, _H): K.encode_w4h, (8, _H): K.encode_w8h,
           (2, _F): K.encode_w2f, (4, _F): K.encode_w4f, (8, _F): K.encode_w8f,
           (2, _Q): K.encode_w2q, (3, _Q): K.encode_w3q, (4, _Q): K.encode_w4q,
           (5, _Q): K.encode_w5q, (6, _Q): K.encode_w6q, (7, _Q): K.encode_w7q,
           (8, _Q): K.encode_w8q}
_HOP = {(2, _H): K.hop_w2h, (4, _H): K.hop_w4h, (8, _H): K.hop_w8h,
        (2, _F): K.hop_w2f, (4, _F): K.hop_w4f, (8, _F): K.hop_w8f,
        (2, _Q): K.hop_w2q, (3, _Q): K.hop_w3q, (4, _Q): K.hop_w4q, (5, _Q): K.hop_w5q,
        (6, _Q): K.hop_w6q, (7, _Q): K.hop_w7q, (8, _Q): K.hop_w8q}
_DECODE = {2: K.decode_w2, 3: K.decode_w3, 4: K.decode_w4, 5: K.decode_w5, 6: K.decode_w6,
           7: K.decode_w7, 8: K.decode_w8}
_DECODE_RESTORE = {2: K.decode_restore_w2, 3: K.decode_restore_w3, 4: K.decode_restore_w4,
                   5: K.decode_restore_w5, 6: K.decode_restore_w6, 7: K.decode_restore_w7,
                   8: K.decode_restore_w8}
_SCALES = {_F: K.SCALES_FLAT, _H: K.SCALES_H, _Q: K.SCALES_H4X32}


# The widths per scale encoding these kernels implement (plus raw width 16 in every mode): the
# scheme runs any other (scales, width) on the torch reference. The fine widths are compiled for
# format 3 (HIERARCHICAL4X32) only: with the two older encodings (``width_set="fine"`` and their
# scales) each would add ~5 s of cold compile per encode and hop entry point, for combinations
# format 3 supersedes; those calls run on the reference.
FORMATS: dict[Scales, tuple[int, ...]] = {_H: WIDTHS, _F: WIDTHS, _Q: FINE_WIDTHS}

# -- array views -----------------------------------------------------------------------------


_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _rows_f32(name: str, t: torch.Tensor) -> np.ndarray:
    """fp32 rows as a C-contiguous NumPy array (bf16/fp16 rows upcast exactly, as the Triton
    launchers do in registers)."""
    if t.dtype not in _FLOAT_INPUTS or t.dim() != 2 or t.shape[1] != SUPER:
        raise ValueError(f"{name}: expected [k, {SUPER}] of fp32, bf16 or fp16, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the numba kernels take CPU tensors")
    return t.detach().to(torch.float32).contiguous().numpy()


def _check_inplace(name: str, t: torch.Tensor, rows: int) -> None:
    if t.dtype != torch.float32 or t.dim() != 2 or tuple(t.shape) != (rows, SUPER):
        raise ValueError(f"{name}: expected fp32 [{rows}, {SUPER}], got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; the numba kernels take CPU tensors")


@contextlib.contextmanager
def _inplace_rows(t: torch.Tensor) -> Iterator[np.ndarray]:
    """A writable C-contiguous NumPy view of ``t``'s rows: ``t`` itself, or a temporary copied
    back afterwards where ``t`` is strided (the executor's own slices never are)."""
    if t.is_contiguous():
        yield t.detach().numpy()
        return
    temporary = t.detach().contiguous()
    yield temporary.numpy()
    t.detach().copy_(temporary)


def _records(records: torch.Tensor, width: int, config: CodecConfig) -> np.ndarray:
    size = record_nbytes(width, config.scales)
    if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != size:
        raise ValueError(f"records: expected uint8 [k, {size}] ({width}-bit "
                         f"{config.scales.value} records), got {records.dtype} "
                         f"{tuple(records.shape)}")
    return records.detach().contiguous().numpy()


def _index(index_base: torch.Tensor, rows: int) -> np.ndarray:
    if index_base.dim() != 1 or index_base.shape[0] != rows:
        raise ValueError(f"index_base: expected [{rows}], got {tuple(index_base.shape)}")
    return index_base.detach().to(dtype=torch.int64).contiguous().numpy()


def _out_records(out: torch.Tensor | None, rows: int, width: int,
                 config: CodecConfig) -> torch.Tensor:
    size = record_nbytes(width, config.scales)
    if out is None:
        return torch.empty((rows, size), dtype=torch.uint8)
    if (out.dtype != torch.uint8 or tuple(out.shape) != (rows, size) or not out.is_contiguous()
            or out.device.type != "cpu"):
        raise ValueError(f"out: expected contiguous uint8 [{rows}, {size}] on the CPU, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _check_width(width: int, config: CodecConfig) -> None:
    check_format(FORMATS, width, config)


def _rounding_args(width: int, config: CodecConfig, key: int, rank: int,
                   world_size: int) -> tuple[object, ...]:
    lv = level_tables(width, config.levels)
    rp = RoundingParams.build(key, rank, world_size, config)
    return (lv.mags, lv.nxt, lv.rtab, lv.bins,
            np.uint32(rp.jitter_key), np.uint32(rp.perm_key), rp.perm_table,
            np.float32(rp.inv_n), rp.correlated)


# -- operations (signatures of the torch references) --------------------------------------------


def stats_center(
    x: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codec.stats_center_torch: ``(centred [S, 256] fp32, mean [S], norm2 [S])``."""
    xs = _rows_f32("x", x)
    rows = xs.shape[0]
    valid_np = _valid(valid, rows)
    centred = torch.empty((rows, SUPER), dtype=torch.float32)
    mean = torch.empty(rows, dtype=torch.float32)
    norm2 = torch.empty(rows, dtype=torch.float32)
    run_rows(K.stats_center, rows, xs, valid_np, centred.numpy(), mean.numpy(), norm2.numpy())
    return centred, mean, norm2


def stats(x: torch.Tensor, valid: torch.Tensor, *, divisor: int = 1,
          centre: bool = True, keep_underflowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean, norm2)`` of ``stats_center(x / divisor, valid)`` without the centred rows (same
    bits; the division is the reference's fp32 ``x / n`` for ``op="avg"``, fused). With
    ``centre=False``: ``(zeros, norm2)``, norm2 that of the uncentred rows as
    ``codec.stats_center_rounded_torch(x / divisor, valid, centre=False)`` gives it; then
    :func:`center_gather` with these zeros writes ``x / divisor`` reordered, bit for bit. With
    ``keep_underflowed`` the norms are those the call's underflow check makes of them
    (``schemes.dynamiq.call._keep_underflowed_rows``: the smallest normal norm for a row of
    non-zero centred values whose squares all underflowed), found in the same pass."""
    mean, norm2, _, _ = _stats(x, valid, divisor, centre, keep_underflowed, False)
    return mean, norm2


def stats_range(x: torch.Tensor, valid: torch.Tensor, *, divisor: int = 1, centre: bool = True,
                keep_underflowed: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, float, np.ndarray]:
    """:func:`stats` and :func:`max_finite_abs` of ``x`` (the rows, before the division) in
    one pass: ``(mean, norm2, largest finite |x| or 0.0, plus_zero)``, the same bits as the
    two apart; ``plus_zero`` (bool per row) says which rows of ``x`` are all +0."""
    return _stats(x, valid, divisor, centre, keep_underflowed, True)


def _stats(x: torch.Tensor, valid: torch.Tensor, divisor: int, centre: bool,
           keep_underflowed: bool, ranged: bool
           ) -> tuple[torch.Tensor, torch.Tensor, float, np.ndarray]:
    xs = _rows_f32("x", x)
    rows = xs.shape[0]
    valid_np = _valid(valid, rows)
    mean = torch.empty(rows, dtype=torch.float32)
    norm2 = torch.empty(rows, dtype=torch.float32)
    top = np.zeros(rows if ranged else 0, np.uint32)
    plus_zero = np.zeros(rows if ranged else 0, np.bool_)
    run_rows(K.stats_only, rows, xs, xs.view(np.uint32), valid_np, _divisor(divisor), bool(centre),
             bool(keep_underflowed), mean.numpy(), norm2.numpy(), top, plus_zero)
    largest = float(top.max().view(np.float32)) if ranged and rows else 0.0
    return mean, norm2, largest, plus_zero


def _divisor(divisor: int) -> np.float32:
    if int(divisor) != divisor or not 1 <= divisor < 2**24:
        raise ValueError(f"divisor must be an integer in [1, 2**24), got {divisor!r}")
    return np.float32(divisor)  # exact, as torch's fp32 ``x / n``


_NO_SKIP = np.zeros(0, np.uint8)


@dataclasses.dataclass(frozen=True)
class GatherSource:
    """:func:`center_gather`'s arguments, checked once: the rows ``encode_runs`` and
    ``hop_runs`` (``source=``) make themselves, row by row as they encode, instead of reading
    the centred rows from a buffer a pass wrote before. ``rows``: fp32 ``[rows, 256]`` in the
    original order; ``mean``, ``valid``: per original row; ``order``: sorted row -> original."""

    rows: np.ndarray
    mean: np.ndarray
    valid: np.ndarray
    order: np.ndarray
    divisor: np.float32

    def args(self, a: int, b: int) -> tuple[object, ...]:
        """The gather arguments of the format-3 kernels for sorted rows ``[a, b)``."""
        return (self.rows, self.order[a:b], self.mean, self.valid, self.divisor)

    def write(self, out: torch.Tensor, a: int, b: int, skip: np.ndarray | None = None,
              threads: int | None = None) -> None:
        """:func:`center_gather` of sorted rows ``[a, b)`` into ``out[a:b]`` (rows of ``out``
        ``k`` with ``skip[k]`` left unwritten)."""
        rows = self.order.shape[0]
        _check_inplace("out", out, rows)
        if not out.is_contiguous():
            raise ValueError(f"out: expected contiguous rows, got strides {out.stride()}")
        if not 0 <= a <= b <= rows:
            raise ValueError(f"rows [{a}, {b}): outside the {rows} rows")
        self.write_rows(out.detach().numpy(), a, b,
                        _NO_SKIP if skip is None else _skip(skip, rows)[a:b], threads)

    def write_rows(self, out: np.ndarray, a: int, b: int, skip: np.ndarray = _NO_SKIP,
                   threads: int | None = None) -> None:
        """:meth:`write` into checked fp32 ``[rows, 256]`` NumPy rows (``skip``: rows [a, b)'s
        flags, or empty)."""
        run_rows(K.center_gather, b - a, self.rows, self.mean, self.valid, self.order[a:b],
                 self.divisor, skip, out[a:b], threads=threads)


# The format-3 kernels' gather arguments where they read their rows from ``x`` (no gather)
_NO_GATHER = (np.zeros((0, SUPER), np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
              np.zeros(0, np.int64), np.float32(1))


def gather_source(x: torch.Tensor, mean: torch.Tensor, valid: torch.Tensor,
                  order: torch.Tensor, *, divisor: int = 1) -> GatherSource:
    """The :class:`GatherSource` of :func:`center_gather` with these arguments (the same
    checks). ``x`` is held, not copied: it must not change while the source is used."""
    xs = _rows_f32("x", x)
    rows = xs.shape[0]
    valid_np = _valid(valid, rows)
    mean_np = mean.detach().to(dtype=torch.float32).contiguous().numpy()
    order_np = order.detach().to(dtype=torch.int64).contiguous().numpy()
    if mean_np.shape != (rows,) or order_np.shape != (rows,):
        raise ValueError(f"mean and order: expected [{rows}], got {tuple(mean.shape)} and "
                         f"{tuple(order.shape)}")
    if rows and (order_np.min() < 0 or order_np.max() >= rows):
        raise ValueError(f"order: row indices must be in [0, {rows})")
    return GatherSource(xs, mean_np, valid_np, order_np, _divisor(divisor))


def _skip(skip: np.ndarray, rows: int) -> np.ndarray:
    skip_np = np.ascontiguousarray(skip, dtype=np.uint8).reshape(-1)
    if skip_np.shape[0] != rows:
        raise ValueError(f"skip: expected [{rows}], got {skip_np.shape}")
    return skip_np


def center_gather(x: torch.Tensor, mean: torch.Tensor, valid: torch.Tensor,
                  order: torch.Tensor, *, divisor: int = 1,
                  out: torch.Tensor | None = None,
                  skip: np.ndarray | None = None) -> torch.Tensor:
    """``stats_center(x / divisor, valid)[0][order]`` with the local ``mean`` :func:`stats`
    returned: the centred rows, already in ``order``, in one pass (no divided or centred copy in
    between), into ``out`` when given. Rows ``k`` where ``skip[k]`` (bool, one per output row)
    are left unwritten."""
    source = gather_source(x, mean, valid, order, divisor=divisor)
    rows = source.order.shape[0]
    if out is None:
        out = torch.empty((rows, SUPER), dtype=torch.float32)
    source.write(out, 0, rows, skip)
    return out


def _valid(valid: torch.Tensor, rows: int) -> np.ndarray:
    valid_np = valid.detach().to(dtype=torch.int64).reshape(-1).contiguous().numpy()
    if valid_np.shape[0] != rows:
        raise ValueError(f"valid: expected [{rows}], got {tuple(valid.shape)}")
    if rows and (valid_np.min() < 1 or valid_np.max() > SUPER):
        raise ValueError(f"valid: counts must be in [1, {SUPER}]")
    return valid_np


def encode(
    x: torch.Tensor,
    width: int,
    index_base: torch.Tensor,
    rank: int,
    world_size: int,
    key: int,
    config: CodecConfig,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """codec.encode_torch: rows ``[k, 256]`` -> records uint8 ``[k, record_nbytes]``."""
    _check_width(width, config)
    xs = _rows_f32("x", x)
    rows = xs.shape[0]
    index = _index(index_base, rows)
    records = _out_records(out, rows, width, config)
    if width == RAW_WIDTH:
        run_rows(K.encode_raw, rows, xs, xs.view(np.uint32), records.numpy())
        return records
    run_rows(_ENCODE[width, config.scales], rows, xs, index, records.numpy(),
             *_rounding_args(width, config, key, rank, world_size), *_gather_args(config))
    return records


def decode(records: torch.Tensor, width: int, config: CodecConfig, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """codec.decode_torch: records -> fp32 ``[k, 256]`` (into ``out`` when given)."""
    _check_width(width, config)
    rec = _records(records, width, config)
    rows = rec.shape[0]
    result = torch.empty((rows, SUPER), dtype=torch.float32) if out is None else out
    _check_inplace("out", result, rows)
    with _inplace_rows(result) as target:
        if width == RAW_WIDTH:
            run_rows(K.decode_raw, rows, rec, target, False)
            return result
        run_rows(_DECODE[width], rows, rec, _SCALES[config.scales],
                 level_tables(width, config.levels).table, target, False)
    return result


def decode_accumulate(
    records: torch.Tensor, width: int, config: CodecConfig, acc: torch.Tensor
) -> None:
    """codec.decode_accumulate_torch: ``acc += decode(records)`` in place."""
    _check_width(width, config)
    rec = _records(records, width, config)
    _check_inplace("acc", acc, rec.shape[0])
    with _inplace_rows(acc) as target:
        if width == RAW_WIDTH:
            run_rows(K.decode_raw, rec.shape[0], rec, target, True)
            return
        run_rows(_DECODE[width], rec.shape[0], rec, _SCALES[config.scales],
                 level_tables(width, config.levels).table, target, True)


def decode_accumulate_encode(
    records: torch.Tensor,
    width: int,
    acc: torch.Tensor,
    index_base: torch.Tensor,
    rank: int,
    world_size: int,
    key: int,
    config: CodecConfig,
    *,
    keep_sum: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """codec.decode_accumulate_encode_torch, fused per row: each row's partial sum is
    accumulated in ``acc`` in place and encoded while it is in cache (so ``acc`` holds the sums
    whatever ``keep_sum`` says; with ``keep_sum=False`` the reference leaves its contents
    unspecified). In place measured 2.65 -> 2.55 ns per coordinate at 2 bits against a separate
    1 KiB row buffer."""
    _check_width(width, config)
    rec = _records(records, width, config)
    rows = rec.shape[0]
    _check_inplace("acc", acc, rows)
    index = _index(index_base, rows)
    result = _out_records(out, rows, width, config)
    with _inplace_rows(acc) as target:
        if width == RAW_WIDTH:
            run_rows(K.hop_raw, rows, rec, target, target.view(np.uint32), result.numpy())
            return result
        run_rows(_HOP[width, config.scales], rows, rec, level_tables(width, config.levels).table,
                 target, index, result.numpy(),
                 *_rounding_args(width, config, key, rank, world_size), *_gather_args(config))
    return result


def max_finite_abs(x: torch.Tensor) -> float:
    """The largest finite ``|x|`` of a contiguous fp32 CPU tensor (0.0 if there is none)."""
    bits = np.asarray(K.max_finite_abs_bits(x.detach().reshape(-1).numpy().view(np.uint32)),
                      dtype=np.uint32)
    return float(bits.view(np.float32))


def restore(
    work: torch.Tensor, mean: torch.Tensor, index_base: torch.Tensor, valid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Add back the summed means and undo the reorder in one pass (reference:
    ``codec.restore_torch``): ``out[index_base[i] + j] = work[i, j] + mean[i]`` for
    ``j < valid[i]``; ``out`` is a flat contiguous fp32/bf16/fp16 CPU tensor."""
    ws = _rows_f32("work", work)
    rows = ws.shape[0]
    if out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu" or out.dtype not in (
            torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out: expected a flat contiguous float CPU tensor, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    mean_np = mean.detach().to(dtype=torch.float32).reshape(-1).contiguous().numpy()
    index = _index(index_base, rows)
    valid_np = valid.detach().to(dtype=torch.int64).reshape(-1).contiguous().numpy()
    if mean_np.shape[0] != rows or valid_np.shape[0] != rows:
        raise ValueError(f"mean and valid: expected [{rows}], got {tuple(mean.shape)} and "
                         f"{tuple(valid.shape)}")
    if rows:
        ends = index + valid_np
        if index.min() < 0 or ends.max() > out.numel() or valid_np.min() < 0 or (
                valid_np.max() > SUPER):
            raise ValueError(f"index_base/valid address coordinates outside out "
                             f"({out.numel()} elements)")
    if out.dtype == torch.float32:
        run_rows(K.restore_f32, rows, ws, mean_np, index, valid_np, out.detach().numpy())
    elif out.dtype == torch.bfloat16:
        run_rows(K.restore_bf16, rows, ws, mean_np, index, valid_np,
                 out.detach().view(torch.int16).numpy().view(np.uint16))
    else:  # fp16: fp32 sums, then torch's own rounding to fp16 (no fp16 kernel to keep exact)
        summed = torch.empty((rows, SUPER), dtype=torch.float32)
        run_rows(K.restore_add, rows, ws, mean_np, summed.numpy())
        coord = torch.arange(SUPER)
        keep = coord[None, :] < torch.from_numpy(valid_np)[:, None]
        target = torch.from_numpy(index)[:, None] + coord[None, :]
        out[target[keep]] = summed[keep].to(out.dtype)


def restore_mean(mean: torch.Tensor, index_base: torch.Tensor, valid: torch.Tensor,
                 out: torch.Tensor) -> None:
    """``out[index_base[i] + j] = mean[i] + 0`` for ``j < valid[i]`` (flat contiguous fp32
    ``out``): :func:`restore` of rows whose work values are all +-0, without reading them."""
    mean_np = mean.detach().to(dtype=torch.float32).reshape(-1).contiguous().numpy()
    rows = mean_np.shape[0]
    index = _index(index_base, rows)
    valid_np = _valid(valid, rows)
    if out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu" or (
            out.dtype != torch.float32):
        raise ValueError(f"out: expected a flat contiguous fp32 CPU tensor, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if rows and (index.min() < 0 or (index + valid_np).max() > out.numel()):
        raise ValueError(f"index_base/valid address coordinates outside out "
                         f"({out.numel()} elements)")
    run_rows(K.restore_mean_f32, rows, mean_np, index, valid_np, out.detach().numpy())


def decode_restore(
    records: torch.Tensor, width: int, config: CodecConfig, mean: torch.Tensor,
    index_base: torch.Tensor, valid: torch.Tensor, out: torch.Tensor,
) -> None:
    """``restore(decode(records), mean, index_base, valid, out)`` in one pass, the same bits:
    each record decoded and its valid coordinates, plus the row's mean, written straight to
    their place in the flat fp32 ``out`` (the all-reduce's last decode, without the work rows
    in between). The widths of ``FORMATS`` and raw 16."""
    rows = mean.numel()
    if records.dim() != 2 or records.shape[0] != rows:
        raise ValueError(f"mean: expected one per record ({tuple(records.shape)} records), got "
                         f"{tuple(mean.shape)}")
    decode_restore_runs([(records, width, 0, rows)], config, mean, index_base, valid, out)


def _flat_bytes(name: str, t: torch.Tensor) -> np.ndarray:
    """A flat contiguous uint8 CPU tensor's NumPy view (a payload the run launchers address)."""
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a flat contiguous uint8 CPU tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t.detach().numpy()


def _whole_rows(name: str, acc: torch.Tensor) -> np.ndarray:
    """Contiguous fp32 ``[rows, 256]`` CPU rows as a writable NumPy view (no copy back needed)."""
    if not acc.is_contiguous():
        raise ValueError(f"{name}: expected contiguous rows")
    _check_inplace(name, acc, acc.shape[0] if acc.dim() == 2 else -1)
    return acc.detach().numpy()


def _run_records(payload: np.ndarray, width: int, config: CodecConfig, a: int, b: int,
                 offset: int, rows: int) -> np.ndarray:
    """Records ``[b - a, record_nbytes]`` of rows ``[a, b)`` at byte ``offset`` of a flat
    payload, after checking that the run lies within the ``rows`` rows and the payload."""
    _check_width(width, config)
    size = record_nbytes(width, config.scales)
    if not 0 <= a <= b <= rows or offset < 0 or offset + (b - a) * size > payload.shape[0]:
        raise ValueError(f"run [{a}, {b}) at byte {offset}: outside the {rows} rows or the "
                         f"{payload.shape[0]}-byte payload")
    return payload[offset : offset + (b - a) * size].reshape(b - a, size)


def decode_restore_runs(
    runs: list[tuple[torch.Tensor, int, int, int]], config: CodecConfig, mean: torch.Tensor,
    index_base: torch.Tensor, valid: torch.Tensor, out: torch.Tensor,
) -> None:
    """:func:`decode_restore` of several runs of one call's rows into the same flat fp32
    ``out``: ``runs`` holds ``(records, width, first row, end row)``, rows of ``mean``,
    ``index_base`` and ``valid`` (which cover every row). The same kernels with the same
    arguments, so the same bits; the views are made and the addresses checked once for all
    rows instead of once per run (an all-reduce's last decode has one run per width and chunk,
    ~30 of them)."""
    threads = cpu_threads()  # once per call, not per run (an environment look-up)
    if out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu" or (
            out.dtype != torch.float32):
        raise ValueError(f"out: expected a flat contiguous fp32 CPU tensor, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    mean_np = mean.detach().to(dtype=torch.float32).reshape(-1).contiguous().numpy()
    rows = mean_np.shape[0]
    index = _index(index_base, rows)
    valid_np = _valid(valid, rows)
    if rows and (index.min() < 0 or (index + valid_np).max() > out.numel()):
        raise ValueError(f"index_base/valid address coordinates outside out "
                         f"({out.numel()} elements)")
    target = out.detach().numpy()
    widths = FORMATS.get(config.scales, ())
    for records, width, a, b in runs:
        if width not in widths and width != RAW_WIDTH:
            raise ValueError(f"width must be one of {widths} with {config.scales.value} "
                             f"scales, got {width}")
        rec = _records(records, width, config)
        if not 0 <= a <= b <= rows or rec.shape[0] != b - a:
            raise ValueError(f"run [{a}, {b}) of {rec.shape[0]} records: outside the {rows} "
                             f"rows or of another length")
        if width == RAW_WIDTH:
            run_rows(K.decode_restore_raw, b - a, rec, mean_np[a:b], index[a:b], valid_np[a:b],
                     target, threads=threads)
            continue
        run_rows(_DECODE_RESTORE[width], b - a, rec, _SCALES[config.scales],
                 level_tables(width, config.levels).table, mean_np[a:b], index[a:b],
                 valid_np[a:b], target, threads=threads)


def _gather_args(config: CodecConfig, source: GatherSource | None = None, a: int = 0,
                 b: int = 0) -> tuple[object, ...]:
    """The trailing gather arguments of ``config``'s encode and hop kernels: the format-3 ones
    take them (``source``'s rows ``[a, b)``, or none), the others none."""
    if config.scales is not _Q:
        return ()
    return _NO_GATHER if source is None else source.args(a, b)


def encode_runs(
    x: torch.Tensor, runs: list[tuple[int, int, int, int]], index_base: torch.Tensor, rank: int,
    world_size: int, key: int, config: CodecConfig, out: torch.Tensor,
    source: GatherSource | None = None,
) -> None:
    """:func:`encode` of several runs of rows of ``x`` into one flat uint8 payload ``out``:
    ``runs`` holds ``(width, first row, end row, byte offset)``. The same kernels with the same
    arguments, so the same bytes; the views are made once per call and the rounding tables
    once per width, not once per run (a payload has one run per width). With ``source``, the
    rows are ``source``'s (:class:`GatherSource`), not ``x``'s: format 3's kernels gather them
    as they encode and leave ``x`` as it was; the other formats' runs gather them into ``x``
    first."""
    threads = cpu_threads()  # once per call, not per run (an environment look-up)
    xs = _rows_f32("x", x)
    rows = xs.shape[0]
    index = _index(index_base, rows)
    payload = _flat_bytes("out", out)
    _check_source(source, rows)
    tables: dict[int, tuple[object, ...]] = {}
    for width, a, b, offset in runs:
        records = _run_records(payload, width, config, a, b, offset, rows)
        fused = source is not None and width != RAW_WIDTH and config.scales is _Q
        if source is not None and not fused:
            source.write_rows(xs, a, b, threads=threads)
        if width == RAW_WIDTH:
            run_rows(K.encode_raw, b - a, xs[a:b], xs[a:b].view(np.uint32), records,
                     threads=threads)
            continue
        if width not in tables:
            tables[width] = _rounding_args(width, config, key, rank, world_size)
        run_rows(_ENCODE[width, config.scales], b - a, xs[a:b], index[a:b], records,
                 *tables[width], *_gather_args(config, source if fused else None, a, b),
                 threads=threads)


def _check_source(source: GatherSource | None, rows: int) -> None:
    if source is not None and source.order.shape[0] != rows:
        raise ValueError(f"source: {source.order.shape[0]} rows for {rows}")


def hop_runs(
    payload: torch.Tensor, pieces: list[tuple[int, int, int, int, int, int]], acc: torch.Tensor,
    index_base: torch.Tensor, rank: int, world_size: int, key: int, config: CodecConfig,
    out: torch.Tensor, source: GatherSource | None = None,
) -> None:
    """One hop of several runs: ``pieces`` holds ``(incoming width, outgoing width, first row,
    end row, byte offset in payload, byte offset in out)``; each piece's records are decoded
    and added into ``acc``'s rows and the sums encoded into ``out`` at the outgoing width: the
    fused :func:`decode_accumulate_encode` where the widths are equal, else
    :func:`decode_accumulate` then :func:`encode` (the same kernels and arguments, so the same
    bits and the same sums in ``acc``). Views and checks once per call. With ``source``,
    ``acc``'s rows are ``source``'s (:class:`GatherSource`) rather than what ``acc`` holds:
    format 3's fused hop gathers each row, adds and encodes it in a scratch row (``acc`` is
    not written: the reference's ``keep_sum=False``); the other pieces gather into ``acc``
    first."""
    threads = cpu_threads()  # once per call, not per run (an environment look-up)
    target = _whole_rows("acc", acc)
    rows = target.shape[0]
    index = _index(index_base, rows)
    src, dst = _flat_bytes("payload", payload), _flat_bytes("out", out)
    _check_source(source, rows)
    tables: dict[int, tuple[object, ...]] = {}
    for w_in, w_out, a, b, off_in, off_out in pieces:
        rec = _run_records(src, w_in, config, a, b, off_in, rows)
        result = _run_records(dst, w_out, config, a, b, off_out, rows)
        part = target[a:b]
        fused = source is not None and w_in == w_out != RAW_WIDTH and config.scales is _Q
        if source is not None and not fused:
            source.write_rows(target, a, b, threads=threads)
        if w_in == w_out:
            if w_in == RAW_WIDTH:
                run_rows(K.hop_raw, b - a, rec, part, part.view(np.uint32), result, threads=threads)
                continue
            if w_in not in tables:
                tables[w_in] = _rounding_args(w_in, config, key, rank, world_size)
            run_rows(_HOP[w_in, config.scales], b - a, rec,
                     level_tables(w_in, config.levels).table, part, index[a:b], result,
                     *tables[w_in], *_gather_args(config, source if fused else None, a, b),
                     threads=threads)
            continue
        if w_in == RAW_WIDTH:
            run_rows(K.decode_raw, b - a, rec, part, True, threads=threads)
        else:
            run_rows(_DECODE[w_in], b - a, rec, _SCALES[config.scales],
                     level_tables(w_in, config.levels).table, part, True, threads=threads)
        if w_out == RAW_WIDTH:
            run_rows(K.encode_raw, b - a, part, part.view(np.uint32), result, threads=threads)
            continue
        if w_out not in tables:
            tables[w_out] = _rounding_args(w_out, config, key, rank, world_size)
        run_rows(_ENCODE[w_out, config.scales], b - a, part, index[a:b], result,
                 *tables[w_out], *_gather_args(config), threads=threads)


def decode_accumulate_runs(payload: torch.Tensor, runs: list[tuple[int, int, int, int]],
                           config: CodecConfig, acc: torch.Tensor) -> None:
    """:func:`decode_accumulate` of several runs of one payload into ``acc``'s rows: ``runs``
    holds ``(width, first row, end row, byte offset)``; views and checks once per call."""
    threads = cpu_threads()  # once per call, not per run (an environment look-up)
    target = _whole_rows("acc", acc)
    rows = target.shape[0]
    src = _flat_bytes("payload", payload)
    for width, a, b, offset in runs:
        rec = _run_records(src, width, config, a, b, offset, rows)
        if width == RAW_WIDTH:
            run_rows(K.decode_raw, b - a, rec, target[a:b], True, threads=threads)
            continue
        run_rows(_DECODE[width], b - a, rec, _SCALES[config.scales],
                 level_tables(width, config.levels).table, target[a:b], True, threads=threads)


_warm_lock = threading.Lock()
_warmed: set[Scales] = set()  # the formats warm_up has compiled or loaded


# The scale encodings whose kernels warm_up compiles: the default format's. The paper's
# configuration (``scales="hierarchical"``) and the flat ablation compile at their first call
# (~1 min more of cold compile otherwise, for options few calls use).
WARM_FORMATS = (_Q,)


@contextlib.contextmanager
def _machine_lock() -> Iterator[None]:
    """Held while a process warms up: the ranks of one machine start together, and without it
    every one of them compiles every kernel at once on cores they share (n ranks: n times the
    work, each finishing at the end). With it the first compiles and writes numba's cache,
    and the others load from it (~0.5 s). Advisory (``fcntl.flock``), per user; where it cannot
    be taken, nothing is serialised."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    path = os.path.join(tempfile.gettempdir(), f"dqcoll-numba-warm-up-{os.getuid()}.lock")
    try:
        handle = open(path, "a+")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def warm_up(formats: tuple[Scales, ...] = WARM_FORMATS) -> None:
    """Compile (or load from numba's disk cache) the kernels of ``formats`` (default: the
    default format's) for the argument types the launchers pass, on a few rows: ~0.5 s with a
    warm cache, minutes cold (one process of the machine at a time: :func:`_machine_lock`)."""
    with _warm_lock:
        if set(formats) <= _warmed:
            return
    with _warm_lock, _machine_lock():
        x = torch.randn(2, SUPER)
        index = torch.arange(2, dtype=torch.int64) * SUPER
        valid = torch.full((2,), SUPER, dtype=torch.int64)
        centred, mean, _ = stats_center(x, valid)
        stats(x, valid)
        center_gather(x, mean, valid, torch.arange(2))
        stats(x, valid, divisor=3)
        stats(x, valid, divisor=3, keep_underflowed=True)
        records = encode(centred, RAW_WIDTH, index, 0, 1, 1, CodecConfig())
        decode_accumulate_encode(records, RAW_WIDTH, centred.clone(), index, 0, 1, 1,
                                 CodecConfig())
        decode(records, RAW_WIDTH, CodecConfig())
        decode_restore(records, RAW_WIDTH, CodecConfig(), mean, index, valid,
                       torch.empty(2 * SUPER))
        decode_accumulate(records, RAW_WIDTH, CodecConfig(), centred.clone())
        center_gather(x, mean, valid, torch.arange(2), divisor=3)
        center_gather(x, mean, valid, torch.arange(2), skip=np.array([True, False]))
        restore_mean(mean, index, valid, torch.empty(2 * SUPER))
        for scales in formats:
            widths = FORMATS[scales]
            config = CodecConfig(scales=scales, levels=Levels.TUNED)
            for width in widths:
                for world_size in (1, 3):  # independent and correlated rounding
                    records = encode(centred, width, index, 0, world_size, 1, config)
                    acc = centred.clone()
                    decode_accumulate(records, width, config, acc)
                    decode_accumulate_encode(records, width, acc, index, 0, world_size, 1, config)
                decode(records, width, config)
                decode_restore(records, width, config, mean, index, valid,
                               torch.empty(2 * SUPER))
        for dtype in (torch.float32, torch.bfloat16):
            restore(centred, mean, index, valid, torch.empty(2 * SUPER, dtype=dtype))
        max_finite_abs(x)
        from .allocation_numba import bisect, hull_by_count

        bisect(np.zeros(2), np.zeros(2, np.bool_), np.zeros(17, np.int64), 0, 0.0, 1.0, 1, 1.0, 8)
        hull_by_count(np.zeros(2), np.zeros(2, np.bool_), np.zeros(2, np.bool_), np.zeros(1),
                      np.ones(1), np.array([2, 4], np.int64), np.array([-np.inf, 1.0]),
                      np.zeros(17, np.int64), 8, 0, 1, 0.0, 1.0, 1, np.empty((1, 2), np.int64))
        _warmed.update(formats)


OPS = DynamiqOps(
    name="numba",
    stats_center=stats_center,
    encode=encode,
    decode=decode,
    decode_accumulate=decode_accumulate,
    decode_accumulate_encode=decode_accumulate_encode,
    restore=restore,
    stats=stats,
    center_gather=center_gather,
    gather_source=gather_source,
    decode_restore=decode_restore,
    restore_mean=restore_mean,
    decode_restore_runs=decode_restore_runs,
    encode_runs=encode_runs,
    hop_runs=hop_runs,
    decode_accumulate_runs=decode_accumulate_runs,
    stats_range=stats_range,
    formats=FORMATS,
)
