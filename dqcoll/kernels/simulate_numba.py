"""Launchers of the simulator's codec work (:mod:`dqcoll.topology.simulator`): DynamiQ encodes
of rows that belong to different ranks, in one launch.

:class:`RankTables` holds, for one collective call (its key) and world size, every rank's
rounding parameters (:class:`._params.RoundingParams` per rank: the jitter key and the
permutation column, ``n x 4096`` int32, 128 MiB at n = 8192); :func:`encode_ranked` encodes
row ``i`` with the parameters of rank ``ranks[i]``, the bytes of
:func:`dqcoll.kernels.codec.encode_torch` called by that rank. Decodes do not depend on
the rank: the simulator calls :mod:`.dynamiq_numba`'s directly.

Where numba is not usable, or the kernels do not implement a (width, scales) pair, the rows
are encoded by the torch reference, one call per distinct rank (the same bytes, slower).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from . import codec, rng
from ._params import level_tables
from .codec import RAW_WIDTH, CodecConfig, RoundingMode, Scales
from .cpu_runtime import numba_available, run_rows

__all__ = ["RankTables", "decode_raw", "encode_ranked", "encode_raw"]


@dataclasses.dataclass(frozen=True)
class RankTables:
    """Every rank's rounding parameters for the call ``key`` on ``world_size`` ranks."""

    key: int
    world_size: int
    correlated: bool
    jitter_keys: np.ndarray  # uint32 [n]
    perm_key: int
    perm_tables: np.ndarray  # int32 [n, PERMUTATION_TABLE] (or [n, 1] when not correlated)
    inv_n: np.float32

    @classmethod
    def build(cls, key: int, world_size: int, config: CodecConfig) -> RankTables:
        n = world_size
        correlated = config.rounding is RoundingMode.CORRELATED and n > 1
        jitter = rng.stream_key(key, rng.STREAM_JITTER)
        jitter_keys = np.array([rng.rank_key(jitter, r) for r in range(n)], dtype=np.uint32)
        if correlated:
            tables = np.empty((n, rng.PERMUTATION_TABLE), dtype=np.int32)
            kernels = _kernels()
            if kernels is not None:
                from . import _dynamiq_numba_kernels as K

                table_key = np.uint32(rng.stream_key(key, rng.STREAM_TABLE))
                half = rng.feistel_half_bits(n)
                for r in range(n):
                    K.perm_table(table_key, r, n, half, tables[r])
            else:
                for r in range(n):
                    tables[r] = rng.permutation_table(key, r, n).numpy()
        else:
            tables = np.zeros((n, 1), dtype=np.int32)
        inv_n = np.float32(torch.tensor(1.0 / n, dtype=torch.float32).item())
        return cls(key, n, correlated, jitter_keys, rng.stream_key(key, rng.STREAM_PERM),
                   tables, inv_n)


@functools.lru_cache(maxsize=1)
def _kernels():  # type: ignore[no-untyped-def]
    if numba_available() is not None:
        return None
    from . import _simulate_numba_kernels as S

    q, h, f = Scales.HIERARCHICAL4X32, Scales.HIERARCHICAL, Scales.FLAT
    table = {(w, q): getattr(S, f"encode_ranked_w{w}q") for w in range(2, 9)}
    table.update({(w, h): getattr(S, f"encode_ranked_w{w}h") for w in (2, 4, 8)})
    table.update({(w, f): getattr(S, f"encode_ranked_w{w}f") for w in (2, 4, 8)})
    return table


def encode_ranked(x: np.ndarray, width: int, index_base: np.ndarray, ranks: np.ndarray,
                  tables: RankTables, config: CodecConfig, out: np.ndarray) -> None:
    """Encode fp32 rows ``x [k, 256]`` at ``width`` into ``out`` (uint8 ``[k, >= record]``: the
    record goes to the first ``record_nbytes`` bytes of each row), row ``i`` as rank
    ``ranks[i]`` would (global index of its first coordinate ``index_base[i]``)."""
    k = x.shape[0]
    if not k:
        return
    size = codec.record_nbytes(width, config.scales)
    if width == RAW_WIDTH:  # no random numbers: the rank does not matter
        out[:, :size] = encode_raw(x)
        return
    kernels = _kernels()
    kernel = None if kernels is None else kernels.get((width, config.scales))
    if rng.PERMUTATION_RUN != 16:
        # a research override of the run length (tools/dense_gap.py): the kernels' runs are the
        # 16-coordinate scale groups, the reference reads it
        kernel = None
    if kernel is None:
        _encode_reference(x, width, index_base, ranks, tables, config, out, size)
        return
    records = out if out.shape[1] == size and out.flags.c_contiguous else np.empty((k, size),
                                                                                   np.uint8)
    lv = level_tables(width, config.levels)
    run_rows(kernel, k, np.ascontiguousarray(x, dtype=np.float32),
             np.ascontiguousarray(index_base, dtype=np.int64),
             np.ascontiguousarray(ranks, dtype=np.int64), records, lv.mags, lv.nxt, lv.rtab,
             lv.bins, tables.jitter_keys, np.uint32(tables.perm_key), tables.perm_tables,
             tables.inv_n, tables.correlated)
    if records is not out:
        out[:, :size] = records


def _encode_reference(x, width, index_base, ranks, tables, config, out, size):  # type: ignore[no-untyped-def]
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    base = torch.from_numpy(np.ascontiguousarray(index_base, dtype=np.int64))
    for rank in np.unique(ranks):
        pick = np.flatnonzero(ranks == rank)
        sel = torch.from_numpy(pick)
        out[pick, :size] = codec.encode_torch(xt[sel].contiguous(), width, base[sel],
                                              int(rank), tables.world_size, tables.key,
                                              config).numpy()


_F32 = np.float32


def encode_raw(x: np.ndarray) -> np.ndarray:
    """``codec._encode_raw`` in NumPy (the torch reference's passes, broadcast instead of
    repeated: the simulator's rows at width 16 were most of its time in that reference): the
    same fp32 operations, and NumPy's fp32 -> fp16 cast rounds to nearest even as torch's."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = x.shape[0]
    amax = np.abs(x).max(axis=1)  # NaN propagates
    bits = amax.view(np.uint32).astype(np.uint64)
    unit_bits = np.where(np.isnan(amax), np.uint64(0x7FC0),
                         (bits + np.uint64(0xFFFF)) >> np.uint64(16)).astype(np.uint32)
    unit = (unit_bits << np.uint32(16)).view(np.float32)
    ok = (unit > 0) & np.isfinite(unit)
    pre = np.where(unit < _F32(codec.TINY_SCALE), _F32(codec.PRESCALE), _F32(1.0))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        inverse = np.where(ok, _F32(1.0) / np.where(ok, unit * pre, _F32(1.0)), _F32(0.0))
        y = np.where(ok[:, None], (x * pre[:, None]) * inverse[:, None], _F32(0.0))
    y = np.clip(y, _F32(-1.0), _F32(1.0))
    out = np.empty((k, 2 * codec.SUPER + 2), np.uint8)
    out[:, : 2 * codec.SUPER] = y.astype(np.float16).view(np.uint8)
    out[:, 2 * codec.SUPER :] = unit_bits.astype(np.uint16).view(np.uint8).reshape(k, 2)
    return out


def decode_raw(records: np.ndarray, out: np.ndarray, accumulate: bool) -> None:
    """``codec._decode_raw`` in NumPy (``out`` fp32 ``[k, 256]``; added to with
    ``accumulate``, one rounding each)."""
    records = np.ascontiguousarray(records[:, : 2 * codec.SUPER + 2])
    values = records[:, : 2 * codec.SUPER].copy().view(np.float16).astype(np.float32)
    unit = (records[:, 2 * codec.SUPER :].copy().view(np.uint16).astype(np.uint32)
            << np.uint32(16)).view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        decoded = values * unit
    if accumulate:
        np.add(out, decoded, out=out)
    else:
        out[...] = decoded
