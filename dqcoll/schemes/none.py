"""``none``: no compression, over the same schedules as every other scheme.

Values travel in the input's own dtype (fp32, bf16 or fp16) and are summed in fp32 at each hop,
as NCCL does; the average divides the final sum. On integer-valued inputs that fit the dtype the
result is exact, which makes this scheme the executor's and the schedules' correctness check.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import CallContext, SchemeSpec
from .elementwise import BlockCall, BlockCodec

__all__ = ["NoneScheme"]

_WIRE_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.bfloat16,
                torch.float16: torch.float16}


class NoneScheme(BlockCodec):
    spec = SchemeSpec(
        name="none",
        description="uncompressed pass-through in the input dtype (fp32/bf16/fp16)",
        bits_per_coord=None,
        unbiased=True,
        exact_sums=True,
        options=("wire_dtype",),
    )
    block = 1
    avg_mode = "post"

    def __init__(self, wire_dtype: torch.dtype | None = None) -> None:
        self.wire_dtype = wire_dtype

    def begin(self, x: torch.Tensor, ctx: CallContext) -> BlockCall:
        call = super().begin(x, ctx)
        call.state = self.wire_dtype or _WIRE_DTYPES[x.dtype]
        return call

    def single_shot_state(self, padded: torch.Tensor) -> Any:
        return self.wire_dtype or torch.float32

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        dtype: torch.dtype = state or self.wire_dtype or torch.float32
        return numel * dtype.itemsize

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        return values.to(ctx).view(torch.uint8).reshape(-1)

    def decode_values(
        self, payload: torch.Tensor, numel: int, count: int, ctx: Any
    ) -> torch.Tensor:
        return payload.view(ctx).float()
