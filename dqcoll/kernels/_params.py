"""Host-side per-call parameters shared by the DynamiQ fast paths (Triton and numba).

Caches (process-wide, bounded; pure functions of their arguments, so they change no byte):
:meth:`RoundingParams.build` keeps the 64 most recently used (key, rank, world size, config):
the launches of one call share one, and the key changes with every call, so it holds the last
calls' parameters, each with a 16 KiB permutation column (``rng.PERMUTATION_TABLE`` int32) and
one copy of it per device and stream it was used on; :func:`level_tables` keeps 16 (width,
levels) tables.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from ..interop import host_to_device
from . import codec, rng
from .codec import CodecConfig, Levels, RoundingMode, _magnitudes

__all__ = ["LevelTables", "RoundingParams", "level_tables",
           "permutation_table"]


def permutation_table(key: int, rank: int, world_size: int) -> np.ndarray:
    """:func:`rng.permutation_table` (int32 ``[PERMUTATION_TABLE]``), compiled where numba is
    installed: ~0.2 ms per call instead of 1-20 ms of small torch ops (cycle walking)."""
    try:
        from . import _dynamiq_numba_kernels as K
    except ImportError:  # no numba: the reference (the same values)
        return rng.permutation_table(key, rank, world_size).numpy()
    out = np.empty(rng.PERMUTATION_TABLE, dtype=np.int32)
    K.perm_table(np.uint32(rng.stream_key(key, rng.STREAM_TABLE)), rank, world_size,
                 rng.feistel_half_bits(world_size), out)
    return out


@dataclasses.dataclass(frozen=True)
class RoundingParams:
    """Per-call values of :func:`rng.rounding_uniforms`, computed once on the host."""

    jitter_key: int  # rank_key(stream_key(key, STREAM_JITTER), rank)
    perm_key: int  # stream_key(key, STREAM_PERM): picks each run's table permutation
    rank: int
    world_size: int
    inv_n: float  # fp32(1 / n), exactly representable as a Python float
    correlated: bool  # correlated rounding with more than one rank
    # This rank's column of the call's permutation table (int32, C-contiguous; one zero entry
    # when not correlated, so the kernels' argument types never change).
    perm_table: np.ndarray = dataclasses.field(compare=False, hash=False, repr=False)
    _on_device: dict[str, torch.Tensor] = dataclasses.field(
        default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    @functools.lru_cache(maxsize=64)  # per launch otherwise: the table, hashing, torch.tensor
    def build(cls, key: int, rank: int, world_size: int, config: CodecConfig) -> RoundingParams:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        correlated = config.rounding is RoundingMode.CORRELATED and world_size > 1
        table = (permutation_table(key, rank, world_size) if correlated
                 else np.zeros(1, dtype=np.int32))
        table.setflags(write=False)
        return cls(
            jitter_key=rng.rank_key(rng.stream_key(key, rng.STREAM_JITTER), rank),
            perm_key=rng.stream_key(key, rng.STREAM_PERM),
            rank=rank,
            world_size=world_size,
            inv_n=float(torch.tensor(1.0 / world_size, dtype=torch.float32)),
            correlated=correlated,
            perm_table=table,
        )

    def perm_table_on(self, device: torch.device, stream: int = 0) -> torch.Tensor:
        """The permutation table as an int32 tensor on ``device``, copied once per device and
        stream (``stream``: the CUDA stream the caller launches on, 0 elsewhere) without a host
        wait (:func:`dqcoll.interop.host_to_device`): the copy is ordered before that stream's
        launches only."""
        name = f"{device}#{stream}"
        found = self._on_device.get(name)
        if found is None:
            found = host_to_device(torch.from_numpy(self.perm_table.copy()), device, torch.int32)
            self._on_device[name] = found
        return found


@dataclasses.dataclass(frozen=True)
class LevelTables:
    """Level magnitudes and the tables of the kernels' level search and decode."""

    mags: np.ndarray  # fp32 [R + 1]: m_0 = 0 .. m_R = 1
    nxt: np.ndarray  # fp32 [R]: nxt[r] = m_{r+1} if r + 1 < R else +inf (interior levels only)
    rtab: np.ndarray  # int32 [bins + 1]: interior magnitudes <= b / bins
    bins: int
    # the decodes' table: fp32 [256 * (8 // width)], the value of code k of byte b at
    # b * (8//w) + k, where codes fill whole bytes (2, 4, 8 bits); fp32 [2**width], the value of
    # each code, for the bitstream widths (3, 5, 6, 7: decoded code by code)
    table: np.ndarray
    # int32 [bins + 1, 4], the Triton level search (one 16-byte load per coordinate): bin k holds
    # the fp32 bit patterns of m_r, m_{r+1}, m_{r+2} and r, with r = rtab[k] lowered to R - 2 in
    # the bins past the last interior magnitude (there ``m_{r+1} <= a`` always holds), so that the
    # level count is ``r + (m_{r+1} <= a)`` and lo, hi follow by two selects (zeros below 4 bits).
    rows: np.ndarray


@functools.lru_cache(maxsize=16)
def level_tables(width: int, levels: Levels) -> LevelTables:
    """The tables of ``width``/``levels``. ``bins`` is the smallest power of two whose bins are
    narrower than the closest two interior magnitudes, so a bin holds at most one level boundary
    and ``rtab[floor(a * bins)]`` is the level count up to one compare."""
    mags = np.asarray(_magnitudes(width, levels), dtype=np.float32)
    top = len(mags) - 1
    interior = mags[1:top]
    bins = 1024
    if interior.size > 1:
        gap = float(np.min(np.diff(interior.astype(np.float64))))
        while 1.0 / bins >= gap:
            bins *= 2
    if interior.size and 1.0 / bins >= float(interior[0]):
        bins = max(bins, 1 << int(np.ceil(-np.log2(float(interior[0])) + 1)))
    edges = (np.arange(bins + 1, dtype=np.float64) / bins).astype(np.float32)  # exact
    rtab = np.searchsorted(interior, edges, side="right").astype(np.int32)
    nxt = np.full(max(top, 1), np.inf, dtype=np.float32)
    nxt[: top - 1] = interior
    # Check the one-compare claim on every bin edge and every interior magnitude (+-1 ulp).
    probes = np.concatenate([edges, interior, np.nextafter(interior, np.float32(0)),
                             np.nextafter(interior, np.float32(2))]).astype(np.float32)
    probes = probes[(probes >= 0) & (probes <= 1)]
    guess = rtab[(probes * np.float32(bins)).astype(np.int64)]
    guess = guess + (nxt[guess] <= probes)
    assert np.array_equal(guess, np.searchsorted(interior, probes, side="right")), width
    codes = codec.code_table(width, levels).numpy()
    table = codes
    if 8 % width == 0:
        per_byte = 8 // width
        byte = np.arange(256)[:, None] >> (np.arange(per_byte)[None, :] * width)  # LSB-first
        table = np.ascontiguousarray(codes[byte & ((1 << width) - 1)].reshape(-1))
    rows = np.zeros((bins + 1, 4), dtype=np.int32)
    if top >= 2:
        base = np.minimum(rtab, top - 2)
        bits = mags.view(np.int32)
        rows = np.ascontiguousarray(np.stack([bits[base], bits[base + 1], bits[base + 2], base], 1))
        row = rows[(probes * np.float32(bins)).astype(np.int64)]
        up = row[:, 1].view(np.float32) <= probes
        assert np.array_equal(row[:, 3] + up, np.searchsorted(interior, probes, side="right"))
    return LevelTables(mags, nxt, rtab, bins, table, rows)
