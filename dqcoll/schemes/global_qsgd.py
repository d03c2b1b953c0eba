"""``global_qsgd``: one global max, int8 codes with 1/n of the range each, exact integer sums.

One max all-reduce gives ``G = max |x|``; each of ``n`` ranks gets ``L = floor(127 / n)`` levels
per sign, ``delta = G / L``, code ``q = floor(x / delta + u) + L`` in ``[0, 2L]`` (unbiased); the
sums fit one byte, the result ``(S - n L) * delta``. More than 127 ranks raise.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any

import torch

from ..errors import InvalidArgumentError
from .base import CallContext, SchemeSpec
from .integer_sum import IntegerSumCodec, NonFiniteGroups, global_statistic

__all__ = ["GlobalQSGDScheme"]

INT8_MAX = 127


@dataclasses.dataclass(frozen=True)
class _State:
    levels: int  # L: levels per sign for one rank
    delta: float  # quantization step; NaN when the global max is not finite
    nonfinite: NonFiniteGroups | None = None  # super-groups with a non-finite input somewhere


def _largest(work: torch.Tensor) -> tuple[torch.Tensor, None]:
    """This rank's ``max |x|`` (1 element, ``inf`` where a value is not finite)."""
    amax = work.abs().amax().reshape(1) if work.numel() else torch.zeros(1, device=work.device)
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.inf)), None


class GlobalQSGDScheme(IntegerSumCodec):
    spec = SchemeSpec(
        name="global_qsgd",
        description="global max (one max all-reduce), int8 with 1/n of the range per rank, "
        "stochastic rounding, exact integer sums",
        bits_per_coord=8.0,
        unbiased=True,
        exact_sums=True,
        needs_global_stats=True,
        options=("seed",),
    )
    stream = 0x51534744  # "QSGD": its random stream

    def __init__(self, seed: int = 0) -> None:
        self.seed = int(seed)

    def prepare(self, work: torch.Tensor, ctx: CallContext) -> _State:
        n = ctx.world_size
        levels = INT8_MAX // n
        if levels < 1:
            raise InvalidArgumentError(
                f"{ctx.what}: global_qsgd gives each rank 127 // n levels of int8; "
                f"n={n} leaves none"
            )
        g, _, nonfinite = global_statistic(work, ctx, _largest, f"{ctx.what} global max")
        return _State(levels, g / levels if math.isfinite(g) else math.nan, nonfinite)

    def code_bits(self, count: int, state: Any) -> int:
        return 8

    def quantize(self, values: torch.Tensor, uniforms: torch.Tensor, state: Any) -> torch.Tensor:
        levels = state.levels
        if not math.isfinite(state.delta) or state.delta == 0.0:
            return torch.full(values.shape, levels, dtype=torch.int64, device=values.device)
        y = (values / state.delta).clamp(-levels, levels)
        q = torch.floor(y + uniforms).clamp(-levels, levels)
        return q.to(torch.int64) + levels

    def quantize_fast(
        self, kernels: ModuleType, values: torch.Tensor, key: int, index_base: int, state: Any
    ) -> torch.Tensor | None:
        if not math.isfinite(state.delta) or state.delta == 0.0:
            return None
        return kernels.qsgd_quantize(  # type: ignore[no-any-return]
            values, key, index_base, state.levels, state.delta)

    def dequantize_fast(
        self, kernels: ModuleType, sums: torch.Tensor, count: int, state: Any, out: torch.Tensor
    ) -> bool:
        kernels.qsgd_dequantize(sums, count * state.levels, state.delta, out)
        return True

    def dequantize(self, sums: torch.Tensor, count: int, state: Any) -> torch.Tensor:
        centred = (sums - count * state.levels).to(torch.float32)
        return centred * torch.tensor(state.delta, dtype=torch.float32)
