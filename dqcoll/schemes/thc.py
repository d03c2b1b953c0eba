"""``thc``: Tensor Homomorphic Compression: rotate, clamp, 4-bit uniform codes, exact integer sums.

Per call, alike on every rank from its seed and step: a shared random permutation of the padded
buffer, then a randomized Hadamard transform in blocks of ``rotation_block`` (random signs, then
``H / sqrt(B)``); one max all-reduce of the ranks' RMS gives ``T = clamp * max_rms``. Each rank
clamps to ``[-T, T]`` and rounds stochastically to 16 levels (``delta = 2T / 15``, code
``floor((y + T) / delta + u)``). Codes add exactly (:mod:`.integer_sum`), a payload summing
``count`` ranks ``ceil(log2(15 count + 1))`` bits wide; the final ``S * delta - n T`` is decoded
once and rotated back. Biased by clamping; ``clamp=2.5`` minimizes clipping plus rounding error
for Gaussian coordinates at 16 levels.
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any

import torch

from ..errors import InvalidArgumentError
from ..types import Collective
from .base import CallContext, SchemeSpec
from .integer_sum import IntegerSumCodec, NonFiniteGroups, global_statistic
from .seeds import derived_seed

__all__ = ["LEVELS", "THCScheme", "fwht"]

LEVELS = 16  # 4-bit codes


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of each row of ``x`` ``[k, B]``; its own inverse."""
    k, size = x.shape
    h = 1
    while h < size:
        x = x.reshape(k, size // (2 * h), 2, h)
        a, b = x[:, :, 0, :], x[:, :, 1, :]
        x = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return x.reshape(k, size) * (1.0 / math.sqrt(size))


@dataclasses.dataclass(frozen=True)
class _State:
    perm: torch.Tensor  # int64 [segment]: shared permutation within each rotated segment
    signs: torch.Tensor  # fp32 [segment]: shared Rademacher signs
    limit: float  # T: clamp range
    delta: float  # 2 T / 15
    nonfinite: NonFiniteGroups | None = None  # super-groups with a non-finite input somewhere


class THCScheme(IntegerSumCodec):
    spec = SchemeSpec(
        name="thc",
        description="THC: shared-seed randomized Hadamard rotation, global max RMS, clamp, 4-bit "
        "uniform levels, stochastic rounding, exact integer sums (width ceil(log2(15n+1)))",
        bits_per_coord=4.0,
        unbiased=False,
        exact_sums=True,
        needs_global_stats=True,
        options=("clamp", "rotation_block", "seed"),
    )
    stream = 0x54484321  # "THC!": its random stream

    def __init__(self, clamp: float = 2.5, rotation_block: int = 1024, seed: int = 0) -> None:
        self.block = int(rotation_block)
        if self.block < 1 or self.block & (self.block - 1):
            raise InvalidArgumentError(
                f"thc: rotation_block must be a power of two, got {self.block}")
        self.clamp = float(clamp)
        if not self.clamp > 0:
            raise InvalidArgumentError(f"thc: clamp must be positive, got {self.clamp}")
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"THCScheme(clamp={self.clamp:g}, rotation_block={self.block})"

    def _rotate(self, work: torch.Tensor, perm: torch.Tensor, signs: torch.Tensor,
                inverse: bool) -> torch.Tensor:
        segments = work.view(-1, perm.numel())
        if not inverse:
            return fwht((segments[:, perm] * signs).reshape(-1, self.block)).reshape(segments.shape)
        unrotated = fwht(segments.reshape(-1, self.block)).reshape(segments.shape) * signs
        out = torch.empty_like(unrotated)
        out[:, perm] = unrotated
        return out

    def prepare(self, work: torch.Tensor, ctx: CallContext) -> _State:
        sharded = ctx.collective is not Collective.ALLREDUCE
        segment = work.numel() // ctx.world_size if sharded else work.numel()
        g = torch.Generator().manual_seed(derived_seed(ctx.seed, ctx.step, "thc-rotation"))
        perm = torch.randperm(segment, generator=g).to(work.device)
        signs = (torch.randint(0, 2, (segment,), generator=g) * 2 - 1).float().to(work.device)
        def rotated_rms(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            rotated = self._rotate(values, perm, signs, inverse=False).reshape(-1)
            rms = (rotated.double().square().sum() / max(rotated.numel(), 1)).sqrt()
            rms = rms.float().reshape(1)
            rms = torch.where(torch.isfinite(rms), rms, torch.full_like(rms, math.inf))
            return rms, rotated

        # written only once agreed: non-finite super-groups are zeroed in the unrotated input
        rms, rotated, nonfinite = global_statistic(work, ctx, rotated_rms,
                                                   f"{ctx.what} max rms")
        work.copy_(rotated)
        limit = self.clamp * rms
        return _State(perm, signs, limit, 2.0 * limit / (LEVELS - 1), nonfinite)

    def code_bits(self, count: int, state: Any) -> int:
        return max(1, (count * (LEVELS - 1)).bit_length())  # just wide enough for the sum

    def quantize(self, values: torch.Tensor, uniforms: torch.Tensor, state: Any) -> torch.Tensor:
        if not math.isfinite(state.delta) or state.delta == 0.0:
            # all zero (T = 0: code 0 decodes to 0) or non-finite (decoded as NaN)
            return torch.zeros(values.shape, dtype=torch.int64, device=values.device)
        y = (values.clamp(-state.limit, state.limit) + state.limit) / state.delta
        return torch.floor(y + uniforms).clamp(0, LEVELS - 1).to(torch.int64)

    def quantize_fast(
        self, kernels: ModuleType, values: torch.Tensor, key: int, index_base: int, state: Any
    ) -> torch.Tensor | None:
        if not math.isfinite(state.delta) or state.delta == 0.0:
            return None
        return kernels.thc_quantize(  # type: ignore[no-any-return]
            values, key, index_base, state.limit, state.delta)

    def dequantize_fast(
        self, kernels: ModuleType, sums: torch.Tensor, count: int, state: Any, out: torch.Tensor
    ) -> bool:
        if not math.isfinite(state.delta):
            return False
        kernels.thc_dequantize(sums, state.delta, count * state.limit, out)
        return True

    def dequantize(self, sums: torch.Tensor, count: int, state: Any) -> torch.Tensor:
        if not math.isfinite(state.delta):
            return torch.full(sums.shape, math.nan, dtype=torch.float32, device=sums.device)
        delta = torch.tensor(state.delta, dtype=torch.float32)
        return sums.to(torch.float32) * delta - torch.tensor(count * state.limit,
                                                              dtype=torch.float32)

    def finish_values(self, work: torch.Tensor, state: Any) -> torch.Tensor:
        return self._rotate(work, state.perm, state.signs, inverse=True).reshape(-1)
