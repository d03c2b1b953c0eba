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
    count, nbytes, device = flat.numel(), packed_nbytes(flat.numel(), width), flat.device
    if width % 8 == 0:  # whole bytes, little-endian
        shifts = torch.arange(0, width, 8, device=device)
        return ((flat[:, None] >> shifts) & 0xFF).reshape(-1).to(torch.uint8)
    if 8 % width:  # general width (FP6, THC's sums): each bit a code of width 1; reference only
        flat = ((flat[:, None] >> torch.arange(width, device=device)) & 1).reshape(-1)
        count, width = flat.numel(), 1
    per_byte = 8 // width  # code j of a byte at bits [j w, (j + 1) w): disjoint, so sum = OR
    padded = torch.zeros(nbytes * per_byte, dtype=torch.int64, device=device)
    padded[:count] = flat
    shifts = torch.arange(0, 8, width, device=device)
    return (padded.view(nbytes, per_byte) << shifts).sum(1).to(torch.uint8)


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
    if 8 % width:  # general width: its bits as codes of width 1, regrouped
        bits = unpack_bits_torch(data, 1, count * width).view(count, width)
        return (bits << torch.arange(width, device=device)).sum(1)
    shifts = torch.arange(0, 8, width, device=device)
    return ((data[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]
