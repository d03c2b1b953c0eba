"""Packing integer codes of any width into bytes, LSB-first, for the baseline schemes.

Code ``j`` of width ``w`` occupies bits ``[j w, (j + 1) w)`` of the little-endian bit string, as
DynamiQ's codes. The ``*_torch`` references define the bytes; CPU tensors run compiled kernels.
"""

from __future__ import annotations

import torch

from ..kernels.baselines import cpu_kernels

__all__ = ["pack_bits", "pack_bits_torch", "packed_nbytes", "unpack_bits", "unpack_bits_torch"]


def packed_nbytes(count: int, width: int) -> int:
    """Bytes holding ``count`` codes of ``width`` bits (the last byte zero-padded)."""
    return -(-count * width // 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative int codes below ``2**width`` (any shape) -> flat uint8, LSB-first."""
    kernels = cpu_kernels(codes.device)
    return (pack_bits_torch if kernels is None else kernels.pack_bits)(codes, width)


def unpack_bits(payload: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Flat uint8 -> int64 ``[count]`` codes (inverse of :func:`pack_bits`)."""
    kernels = cpu_kernels(payload.device)
    return (unpack_bits_torch if kernels is None else kernels.unpack_bits)(payload, width, count)


def pack_bits_torch(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Reference of :func:`pack_bits`."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in [1, 32], got {width}")
    flat = codes.reshape(-1).to(torch.int64)
    count = flat.numel()
    nbytes = packed_nbytes(count, width)
    device = flat.device
    if width % 8 == 0:  # whole bytes, little-endian
        parts = [(flat >> (8 * k)) & 0xFF for k in range(width // 8)]
        return torch.stack(parts, dim=1).reshape(-1).to(torch.uint8)
    if 8 % width == 0:  # several codes per byte: code j of a byte at bits [j w, (j+1) w)
        per_byte = 8 // width
        padded = torch.zeros(nbytes * per_byte, dtype=torch.int64, device=device)
        padded[:count] = flat
        grid = padded.view(nbytes, per_byte)
        out = torch.zeros(nbytes, dtype=torch.int64, device=device)
        for j in range(per_byte):
            out |= grid[:, j] << (j * width)
        return out.to(torch.uint8)
    # General width (FP6, THC's sums): one bit per byte, regrouped by 8; reference only.
    shifts = torch.arange(width, device=device)
    bits = ((flat[:, None] >> shifts[None, :]) & 1).reshape(-1)
    padded_bits = torch.zeros(nbytes * 8, dtype=torch.int64, device=device)
    padded_bits[: bits.numel()] = bits
    weights = (1 << torch.arange(8, device=device)).to(torch.int64)
    return (padded_bits.view(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits_torch(payload: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Reference of :func:`unpack_bits`."""
    if not 1 <= width <= 32:
        raise ValueError(f"width must be in [1, 32], got {width}")
    nbytes = packed_nbytes(count, width)
    if payload.numel() < nbytes:
        raise ValueError(
            f"{count} codes of {width} bits need {nbytes} bytes, got {payload.numel()}"
        )
    data = payload.reshape(-1)[:nbytes].to(torch.int64)
    device = data.device
    if width % 8 == 0:  # whole bytes, little-endian (disjoint bits: the sum is their OR)
        return (data.view(count, width // 8) << torch.arange(0, width, 8, device=device)).sum(1)
    if 8 % width == 0:
        per_byte = 8 // width
        mask = (1 << width) - 1
        parts = [(data >> (j * width)) & mask for j in range(per_byte)]
        return torch.stack(parts, dim=1).reshape(-1)[:count]
    bits = ((data[:, None] >> torch.arange(8, device=device)[None, :]) & 1).reshape(-1)
    bits = bits[: count * width].view(count, width)
    weights = (1 << torch.arange(width, device=device)).to(torch.int64)
    return (bits * weights).sum(dim=1)
