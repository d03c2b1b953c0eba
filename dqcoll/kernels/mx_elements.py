"""The MX element formats (:class:`ElementFormat`, :data:`FORMATS`), the exact fp32 :func:`pow2`
and :func:`decode_table`: one definition shared by :mod:`dqcoll.schemes.mx` and its kernels."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

__all__ = ["FORMATS", "ElementFormat", "decode_table", "pow2"]


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    name: str
    ebits: int
    mbits: int
    bias: int
    max_value: float  # largest finite magnitude (saturation bound)

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """Exponent of the largest normal value (``floor(log2(max_value))``)."""
        return math.floor(math.log2(self.max_value))

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (subnormals share it)."""
        return 1 - self.bias


FORMATS: dict[str, ElementFormat] = {
    "e4m3": ElementFormat("e4m3", 4, 3, 7, 448.0),
    "e5m2": ElementFormat("e5m2", 5, 2, 15, 57344.0),
    "e2m3": ElementFormat("e2m3", 2, 3, 1, 7.5),
    "e3m2": ElementFormat("e3m2", 3, 2, 3, 28.0),
    "e2m1": ElementFormat("e2m1", 2, 1, 1, 6.0),
}


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2**e`` for int ``e`` in [-149, 127], built from its bits (``torch.ldexp``
    goes through ``pow`` and is not guaranteed exact)."""
    e = e.to(torch.int64)
    normal = ((e.clamp(-126, 127) + 127) << 23).to(torch.int32).view(torch.float32)
    sub = (1 << (e.clamp(-149, -127) + 149)).to(torch.int32).view(torch.float32)
    return torch.where(e >= -126, normal, sub)


@functools.lru_cache(maxsize=16)
def decode_table(fmt: ElementFormat, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp32 value of every code (codes above the largest finite value, never emitted: NaN);
    cached per device, so read-only."""
    values = []
    for code in range(1 << fmt.bits):
        sign = -1.0 if code >> (fmt.ebits + fmt.mbits) else 1.0
        biased = (code >> fmt.mbits) & ((1 << fmt.ebits) - 1)
        mant = code & ((1 << fmt.mbits) - 1)
        significand = mant + (1 << fmt.mbits if biased else 0)  # subnormals: no implicit 1
        magnitude = significand * 2.0 ** (max(biased, 1) - fmt.bias - fmt.mbits)  # exact
        values.append(sign * magnitude if magnitude <= fmt.max_value else math.nan)
    return torch.tensor(values, dtype=torch.float32, device=device)
