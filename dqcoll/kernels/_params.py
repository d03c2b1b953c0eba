"""Host-side per-call parameters shared by the DynamiQ fast paths (Triton and numba)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..schemes.dynamiq import rng
from ..schemes.dynamiq.codec import CodecConfig, RoundingMode

__all__ = ["RoundingParams"]


@dataclasses.dataclass(frozen=True)
class RoundingParams:
    """Per-call scalars of :func:`rng.rounding_uniforms`, computed once on the host."""

    jitter_key: int  # rank_key(stream_key(key, STREAM_JITTER), rank)
    perm_key: int  # stream_key(key, STREAM_PERM)
    rank: int
    world_size: int
    inv_n: float  # fp32(1 / n), exactly representable as a Python float
    correlated: bool  # correlated rounding with more than one rank
    half_bits: int  # Feistel half width

    @classmethod
    @functools.lru_cache(maxsize=64)  # per launch otherwise: ~20 us of torch.tensor and hashing
    def build(cls, key: int, rank: int, world_size: int, config: CodecConfig) -> RoundingParams:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        correlated = config.rounding is RoundingMode.CORRELATED and world_size > 1
        return cls(
            jitter_key=rng.rank_key(rng.stream_key(key, rng.STREAM_JITTER), rank),
            perm_key=rng.stream_key(key, rng.STREAM_PERM),
            rank=rank,
            world_size=world_size,
            inv_n=float(torch.tensor(1.0 / world_size, dtype=torch.float32)),
            correlated=correlated,
            half_bits=rng.feistel_half_bits(world_size) if correlated else 1,
        )
