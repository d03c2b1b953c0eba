"""Launchers of the DynamiQ Triton kernels: check shapes, allocate, launch. ``OPS`` is what
:func:`dqcoll.kernels.dynamiq_ops` hands out for CUDA tensors.

Width 16 (raw fp16 records: no random numbers, a few vectorised passes) runs the torch reference
on the tensors' own device, so every width the scheme can choose works on every path.

Each launcher has the signature of its torch reference in :mod:`dqcoll.kernels.codec`
and returns the same bytes (codes, scales) and the same fp32 values (statistics, decoded and
accumulated rows; NaN payloads aside, which no record carries: a non-finite scale is stored as the
canonical bf16 NaN). Extensions over the references, all exact: ``stats_center`` and ``encode``
also take bf16/fp16 rows (upcast in registers, equal to the reference on ``x.float()``), and rows
may be strided (unit stride inside a row).

On CUDA tensors the compiled kernels run, queued on the caller's current stream: a launcher
returns without a host wait, and the small per-row arrays that come from the host (``valid``, the
permutation table) are copied from pinned memory with ``non_blocking``
(:func:`dqcoll.interop.host_to_device`). :func:`warm_up` compiles every variant a call can launch.

On CPU tensors the same kernels run in Triton's interpreter (``TRITON_INTERPRET`` semantics,
without the variable): this module loads a second, interpreted copy of :mod:`._dynamiq_kernels`
on first use, so CPU tests check the very kernel source byte for byte against the reference, and
nothing leaks into other code that uses Triton. The interpreter patches ``triton.language``
globally while it runs, so interpreted launches are serialised by a lock (the ``local`` transport
runs ranks as threads). Rejected: requiring ``TRITON_INTERPRET=1`` in the environment (it must be
set before Triton is imported and then turns *every* kernel in the process into the interpreter,
GPU tests included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

from ..interop import host_to_device
from . import _dynamiq_kernels as compiled_kernels
from . import codec
from ._launch import Kernel, LaunchConfig, compile_options, launch_config
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
    restore_torch,
)
from .ops import DynamiqOps, check_format

__all__ = [
    "FORMATS",
    "OPS",
    "decode",
    "decode_accumulate",
    "decode_accumulate_encode",
    "encode",
    "restore",
    "restore_torch",
    "stats_center",
    "warm_up",
]

FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16)

# -- which copy of the kernels ----------------------------------------------------------------

_INTERPRETER_LOCK = threading.RLock()
_COMPILE_LOCK = threading.Lock()  # held for a launch's host side only (microseconds once compiled)


@contextlib.contextmanager
def _interpret_mode() -> Iterator[None]:
    """``@triton.jit`` builds interpreted functions inside this block (Triton reads the switch
    when a function is decorated)."""
    import triton

    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4 caches the switch in knobs
    scope = knobs.runtime.scope() if knobs is not None else contextlib.nullcontext()
    try:
        with scope:
            if knobs is not None:
                knobs.runtime.interpret = True
            yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


@functools.lru_cache(maxsize=1)
def _interpreted_kernels() -> ModuleType:
    name = f"{compiled_kernels.__name__}_interpreted"
    spec = importlib.util.spec_from_file_location(name, compiled_kernels.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with _INTERPRETER_LOCK, _interpret_mode():
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def _kernels_for(device: torch.device) -> tuple[ModuleType, bool]:
    """(kernel module, interpreted?) for tensors on ``device``."""
    if device.type == "cuda":
        return compiled_kernels, False
    if device.type == "cpu":
        return _interpreted_kernels(), True
    raise ValueError(f"dynamiq Triton kernels run on CUDA or (interpreted) CPU, got {device}")


def _launch_device(args: tuple[Any, ...]) -> torch.device:
    """The device of the first tensor argument: the launch must run there."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device
    raise ValueError("a kernel launch needs at least one tensor argument")


def _launch(kernel: Any, cfg: LaunchConfig, n_rows: int, interpreted: bool, *args: Any,
            **constexprs: Any) -> None:
    grid = cfg.grid(n_rows)
    if interpreted:
        import numpy

        # The kernels compute values they then discard (0/0 where a scale is zero); numpy would
        # warn about each.
        with _INTERPRETER_LOCK, numpy.errstate(all="ignore"):
            kernel[grid](*args, **constexprs)
        return
    # Triton launches on torch's *current* device and its current stream there, never on the
    # tensors' (its pointer check accepts any GPU's memory): make the tensors' device current for
    # the launch, so that a communicator on cuda:1, or a thread that never called set_device,
    # launches on the GPU that holds the data, on the caller's stream of that GPU.
    device = _launch_device(args)
    # (meta tensors: benchmarks/kernels_aot.py captures launches without a GPU)
    guard = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with guard:
        # Rank threads of the local transport may hit a kernel's first (compiling) launch at once.
        with _COMPILE_LOCK:
            kernel[grid](*args, **constexprs, num_warps=cfg.num_warps, **compile_options())


# -- host-side parameters ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LevelParams:
    """Level tables of one width on one device (see :func:`._params.level_tables`)."""

    # fp32 [256 * (8 // width)]: value of code k of byte b at b*(8//w) + k (2, 4, 8 bits); fp32
    # [2**width]: the value of each code (bitstream widths 3, 5, 6, 7, decoded code by code)
    codes: torch.Tensor
    rows: torch.Tensor  # int32 [bins + 1, 4]: the level search's rows (_params.LevelTables.rows)
    bins: int


@functools.lru_cache(maxsize=64)
def _level_params(width: int, levels: Levels, device: torch.device) -> LevelParams:
    """Made once per device (by the warm-up) and read by every stream afterwards: plain copies,
    complete when they return, unlike a non-blocking copy, which one stream alone is ordered
    after."""
    tables = level_tables(width, levels)
    return LevelParams(
        codes=torch.from_numpy(tables.table).to(device),
        rows=torch.from_numpy(tables.rows).to(device),
        bins=tables.bins,
    )


# The widths per scale encoding these kernels implement (plus raw width 16 in every mode): the
# scheme runs any other (scales, width) on the torch reference.
FORMATS: dict[Scales, tuple[int, ...]] = {
    Scales.HIERARCHICAL: WIDTHS,
    Scales.FLAT: WIDTHS,
    Scales.HIERARCHICAL4X32: FINE_WIDTHS,
}


def _int32_bits(value: int) -> int:
    """A uint32 key as the int32 with the same bits: every key then has the same argument type
    (Triton types Python ints by value, i32 / u32 / i64), so no launch compiles a new variant."""
    return value - (1 << 32) if value >= 1 << 31 else value


def _tile(config: CodecConfig) -> tuple[int, int, str]:
    """(blocks per row, coordinates per block, scale encoding) of the kernels' row tile. The
    4-bit codes per 32 coordinates keep blocks of 16 (each thread one, as with uint8 codes): the
    kernels take each scale over a pair of blocks."""
    if config.scales is Scales.FLAT:
        return 8, 32, config.scales.value
    return 16, 16, config.scales.value


# -- checks -----------------------------------------------------------------------------------


def _check_width(width: int, config: CodecConfig) -> None:
    check_format(FORMATS, width, config)


def _check_rows(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in dtypes or t.dim() != 2 or t.shape[1] != SUPER:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected [k, {SUPER}] of {allowed}, got {t.dtype} "
                         f"{tuple(t.shape)}")
    if t.shape[0] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: expected unit stride inside a row, got strides {t.stride()}")


def _check_records(records: torch.Tensor, width: int, config: CodecConfig) -> None:
    size = record_nbytes(width, config.scales)
    if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != size:
        raise ValueError(f"records: expected uint8 [k, {size}] ({width}-bit "
                         f"{config.scales.value} records), got {records.dtype} "
                         f"{tuple(records.shape)}")
    if records.shape[0] > 1 and records.stride(1) != 1:
        raise ValueError(f"records: expected unit stride inside a record, got strides "
                         f"{records.stride()}")


def _check_same(name: str, t: torch.Tensor, rows: int, device: torch.device) -> None:
    if t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _out_records(out: torch.Tensor | None, rows: int, size: int,
                 device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((rows, size), dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or tuple(out.shape) != (rows, size) or out.device != device or (
            rows > 1 and out.stride(1) != 1):
        raise ValueError(f"out: expected uint8 [{rows}, {size}] on {device} with unit stride "
                         f"inside a record, got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def _index(index_base: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    if index_base.dim() != 1 or index_base.shape[0] != rows:
        raise ValueError(f"index_base: expected [{rows}], got {tuple(index_base.shape)}")
    return host_to_device(index_base, device, torch.int64)


def _stream_id(device: torch.device) -> int:
    """The stream a launch on ``device`` goes to (Triton takes torch's current stream there)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


# -- operations (signatures of the torch references) ------------------------------------------


def stats_center(
    x: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton codec.stats_center_torch: ``(centred [S, 256] fp32, mean [S], norm2 [S])``."""
    _check_rows("x", x, FLOAT_INPUTS)
    rows = x.shape[0]
    valid_dev = host_to_device(valid.reshape(-1), x.device, torch.int32)
    _check_same("valid", valid_dev, rows, x.device)
    centred = torch.empty((rows, SUPER), dtype=torch.float32, device=x.device)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    norm2 = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        kernels, interpreted = _kernels_for(x.device)
        cfg = launch_config(Kernel.STATS_CENTER, 0, rows, interpreted=interpreted)
        _launch(kernels._stats_center_kernel, cfg, rows, interpreted,
                x, x.stride(0), valid_dev, centred, mean, norm2, rows,
                ROWS=cfg.rows_per_program)
    return centred, mean, norm2


def _encode_args(width: int, config: CodecConfig, device: torch.device, key: int, rank: int,
                 world_size: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    levels = _level_params(width, config.levels, device)
    rp = RoundingParams.build(key, rank, world_size, config)
    nb, bs, scales = _tile(config)
    args = (levels.rows, _int32_bits(rp.jitter_key), _int32_bits(rp.perm_key),
            rp.perm_table_on(device, _stream_id(device)), rp.inv_n)
    constexprs = dict(WIDTH=width, NB=nb, BS=bs, SCALES=scales,
                      CORRELATED=rp.correlated, BINS=levels.bins)
    return args, constexprs


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
    """Triton codec.encode_torch: rows ``[k, 256]`` -> records uint8 ``[k, record_nbytes]``
    (into ``out`` when given)."""
    _check_width(width, config)
    _check_rows("x", x, FLOAT_INPUTS)
    rows = x.shape[0]
    index = _index(index_base, rows, x.device)
    out = _out_records(out, rows, record_nbytes(width, config.scales), x.device)
    if width == RAW_WIDTH:  # raw fp16 records: the reference's few vectorised ops, on any device
        return codec.encode_torch(x.float(), width, index, rank, world_size, key, config,
                                  out=out)
    if rows:
        kernels, interpreted = _kernels_for(x.device)
        cfg = launch_config(Kernel.ENCODE, width, rows, interpreted=interpreted)
        args, constexprs = _encode_args(width, config, x.device, key, rank, world_size)
        _launch(kernels._encode_kernel, cfg, rows, interpreted,
                x, x.stride(0), index, out, out.stride(0), *args, rows,
                ROWS=cfg.rows_per_program, **constexprs)
    return out


def decode(records: torch.Tensor, width: int, config: CodecConfig, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton codec.decode_torch: records -> fp32 ``[k, 256]`` (into ``out`` when given)."""
    _check_width(width, config)
    _check_records(records, width, config)
    rows = records.shape[0]
    if out is None:
        out = torch.empty((rows, SUPER), dtype=torch.float32, device=records.device)
    elif out.dtype != torch.float32 or tuple(out.shape) != (rows, SUPER) or (
            not out.is_contiguous()) or out.device != records.device:
        raise ValueError(f"out: expected contiguous fp32 [{rows}, {SUPER}] on {records.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    if width == RAW_WIDTH:
        return codec.decode_torch(records, width, config, out=out)
    if rows:
        kernels, interpreted = _kernels_for(records.device)
        cfg = launch_config(Kernel.DECODE, width, rows, interpreted=interpreted)
        nb, bs, scales = _tile(config)
        table = _level_params(width, config.levels, records.device).codes
        _launch(kernels._decode_kernel, cfg, rows, interpreted,
                records, records.stride(0), table, out, rows,
                WIDTH=width, ROWS=cfg.rows_per_program, NB=nb, BS=bs, SCALES=scales)
    return out


def decode_accumulate(
    records: torch.Tensor, width: int, config: CodecConfig, acc: torch.Tensor
) -> None:
    """Triton codec.decode_accumulate_torch: ``acc += decode(records)`` in place."""
    _check_width(width, config)
    _check_records(records, width, config)
    _check_rows("acc", acc, (torch.float32,))
    rows = records.shape[0]
    _check_same("acc", acc, rows, records.device)
    if width == RAW_WIDTH:
        codec.decode_accumulate_torch(records, width, config, acc)
        return
    if rows:
        kernels, interpreted = _kernels_for(records.device)
        cfg = launch_config(Kernel.DECODE_ACCUMULATE, width, rows, interpreted=interpreted)
        nb, bs, scales = _tile(config)
        table = _level_params(width, config.levels, records.device).codes
        _launch(kernels._decode_accumulate_kernel, cfg, rows, interpreted,
                records, records.stride(0), table, acc, acc.stride(0), rows,
                WIDTH=width, ROWS=cfg.rows_per_program, NB=nb, BS=bs, SCALES=scales)


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
    """Triton codec.decode_accumulate_encode_torch, one fused kernel: ``acc += decode(records)``
    (written back in place only with ``keep_sum``), then the new ``acc`` encoded at the same
    width from registers (into ``out`` when given)."""
    _check_width(width, config)
    _check_records(records, width, config)
    _check_rows("acc", acc, (torch.float32,))
    rows = records.shape[0]
    _check_same("acc", acc, rows, records.device)
    index = _index(index_base, rows, records.device)
    out = _out_records(out, rows, records.shape[1], records.device)
    if width == RAW_WIDTH:
        return codec.decode_accumulate_encode_torch(records, width, acc, index, rank, world_size,
                                                    key, config, out=out)
    if rows:
        kernels, interpreted = _kernels_for(records.device)
        cfg = launch_config(Kernel.DECODE_ACCUMULATE_ENCODE, width, rows, interpreted=interpreted)
        table = _level_params(width, config.levels, records.device).codes
        args, constexprs = _encode_args(width, config, records.device, key, rank, world_size)
        _launch(kernels._decode_accumulate_encode_kernel, cfg, rows, interpreted,
                records, records.stride(0), table, acc, acc.stride(0), index,
                out, out.stride(0), *args, rows,
                ROWS=cfg.rows_per_program, WRITE_ACC=keep_sum, **constexprs)
    return out


def restore(
    work: torch.Tensor, mean: torch.Tensor, index_base: torch.Tensor, valid: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Add back the summed means and undo the reorder in one pass (see :func:`restore_torch`):
    ``work`` fp32 ``[S, 256]`` in sorted order, ``mean`` fp32 ``[S]``, ``index_base`` and
    ``valid`` ``[S]``, ``out`` a flat contiguous fp32/bf16/fp16 tensor."""
    _check_rows("work", work, (torch.float32,))
    rows = work.shape[0]
    device = work.device
    if out.dim() != 1 or out.dtype not in FLOAT_INPUTS or (out.numel() > 1 and out.stride(0) != 1):
        raise ValueError(f"out: expected a flat contiguous float tensor, got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if out.device != device:
        raise ValueError(f"out is on {out.device}, expected {device}")
    mean_dev = host_to_device(mean, device, torch.float32)
    index = _index(index_base, rows, device)
    valid_dev = host_to_device(valid.reshape(-1), device, torch.int32)
    _check_same("mean", mean_dev, rows, device)
    _check_same("valid", valid_dev, rows, device)
    if rows:
        kernels, interpreted = _kernels_for(device)
        cfg = launch_config(Kernel.RESTORE, 0, rows, interpreted=interpreted)
        _launch(kernels._restore_kernel, cfg, rows, interpreted,
                work, work.stride(0), mean_dev, index, valid_dev, out, rows,
                ROWS=cfg.rows_per_program)


# -- warm-up ----------------------------------------------------------------------------------

_warm_lock = threading.Lock()
_warmed: set[str] = set()


def _records_at(offset: int, rows: int, size: int, device: torch.device) -> torch.Tensor:
    """``rows`` records viewed at byte ``offset`` of a fresh buffer: offset 0 is 16-byte aligned
    (CUDA's allocator aligns to 512), offset 1 is not, the two specialisations Triton compiles
    for a record pointer (chunk payloads hold runs of records at any byte offset)."""
    buf = torch.zeros(offset + rows * size, dtype=torch.uint8, device=device)
    return buf[offset:].view(rows, size)


def _rows_at(offset: int, x: torch.Tensor) -> torch.Tensor:
    """A copy of the rows ``x`` viewed at element ``offset`` of a fresh buffer: offset 0 is
    16-byte aligned, offset 1 is not (a caller's own tensor is its statistics' input, and it may
    be a view at any element of a larger one)."""
    buf = torch.zeros(offset + x.numel(), dtype=x.dtype, device=x.device)
    rows = buf[offset:].view(x.shape)
    rows.copy_(x)
    return rows


def warm_up(device: torch.device) -> None:
    """Launch every kernel variant a call can hit on ``device`` once, on a few rows, so that
    Triton compiles them (or loads them from its disk cache) now rather than at some step of
    training, where ranks would stall each other for seconds.

    A variant is a kernel's constexprs (width, rows per program, scales tile, correlated
    rounding, bins, ``WRITE_ACC``), its pointer dtypes (float inputs of ``stats_center`` and
    ``encode``, the output of ``restore``) and Triton's specialisation of the arguments
    (16-byte alignment of pointers, divisibility by 16 of integers). Alignment is warmed both ways
    where a caller can pass either: records at an aligned and an unaligned byte offset, as a chunk
    payload holds them, and the statistics' input rows (the caller's tensor). The per-row arrays
    (``index``, ``mean``, ``valid``: slices at any row offset) and the restore's output (the
    caller's tensor) do not specialise, nor do row counts and keys (``do_not_specialize`` in
    :mod:`._dynamiq_kernels`, :func:`_int32_bits`); the work rows (``x`` of ``encode``, ``acc``,
    the decode's output: whole rows of 1 KiB from a fresh buffer) are always aligned. Once per
    device per process."""
    with _warm_lock:
        if str(device) in _warmed:
            return
        rows = 2
        x = torch.randn(rows, SUPER, device=device)
        valid = torch.full((rows,), SUPER, dtype=torch.int32, device=device)
        index = torch.arange(rows, dtype=torch.int64, device=device) * SUPER
        for dtype in FLOAT_INPUTS:
            for offset in (0, 1):
                stats_center(_rows_at(offset, x.to(dtype)), valid)
            restore(x, valid.float(), index, valid, torch.empty(rows * SUPER, dtype=dtype,
                                                                 device=device))
        for scales, widths in FORMATS.items():
            for levels in Levels:
                config = CodecConfig(levels=levels, scales=scales)
                for width in widths:
                    size = record_nbytes(width, scales)
                    for world_size in (1, 2):  # independent and correlated rounding
                        for dtype in FLOAT_INPUTS:
                            encode(x.to(dtype), width, index, 0, world_size, 1, config,
                                   out=_records_at(0, rows, size, device))
                        for src in (0, 1):
                            records = _records_at(src, rows, size, device)
                            encode(x, width, index, 0, world_size, 1, config, out=records)
                            for dst in (0, 1):
                                for keep_sum in (False, True):
                                    decode_accumulate_encode(
                                        records, width, x.clone(), index, 0, world_size, 1,
                                        config, keep_sum=keep_sum,
                                        out=_records_at(dst, rows, size, device))
                    for src in (0, 1):
                        records = _records_at(src, rows, size, device)
                        decode(records, width, config)
                        decode_accumulate(records, width, config, x.clone())
        _warmed.add(str(device))


OPS = DynamiqOps(
    name="triton",
    stats_center=stats_center,
    encode=encode,
    decode=decode,
    decode_accumulate=decode_accumulate,
    decode_accumulate_encode=decode_accumulate_encode,
    restore=restore,
    formats=FORMATS,
)
