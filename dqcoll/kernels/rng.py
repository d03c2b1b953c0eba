"""Counter-based random numbers for DynamiQ, identical in torch (CPU or CUDA) and Triton.

Every number is a 32-bit hash of ``(seed, step, rank, coordinate)``: nothing is communicated,
and any implementation of the same uint32 arithmetic gets the same numbers (``torch.Generator``
streams depend on device and launch shape). The torch reference holds uint32 bit patterns in
int32 tensors: multiplication wraps, a logical right shift is an arithmetic shift and a mask.

Definitions (all arithmetic mod 2**32):

* ``mix32`` (hash-prospector's two-multiply xorshift): ``x ^= x >> 16; x *= 0x21f0aaad;
  x ^= x >> 15; x *= 0x735a2d97; x ^= x >> 15``.
* The call key is ``mix32(mix32(mix32(seed_lo ^ C0) ^ seed_hi) ^ mix32(step_lo ^ C1) ^ step_hi)``
  (computed once per call on the host); ``stream_key(key, s) = mix32(key ^ s)`` separates streams.
* ``coord_hash(k, g) = mix32(mix32(k ^ g_hi) ^ g_lo)`` with the 64-bit global coordinate index
  ``g`` in 32-bit halves (the inner hash is constant over a row).
* Private jitter of rank ``i``:
  ``gamma = (coord_hash(mix32(key_j ^ mix32(i ^ C2)), g) >> 8) * 2**-24``, a uniform on [0, 1)
  with 24 random bits (exact in fp32).
* Shared permutations, computed once per call: a table of :data:`PERMUTATION_TABLE` (4096)
  random permutations of ``[0, n)``; permutation ``t`` is an 8-round balanced Feistel network over
  ``2h`` bits (``h = max(1, ceil(bitlen(n - 1) / 2))``) with round function
  ``F_j(R) = mix32(ck_t ^ (R | j << 24)) & (2**h - 1)`` and key ``ck_t = mix32(key_t ^ t)``
  (``key_t = stream_key(key, STREAM_TABLE)``), applied repeatedly until the value falls below
  ``n`` (cycle-walking). Rank ``i`` needs only its column ``T_i[t] = sigma_t(i)``.
* Each run of 16 consecutive coordinates of a row (a scale group) whose first global index is
  ``g`` uses permutation ``t(g) = coord_hash(key_p, g) >> 20`` (the top 12 bits;
  ``key_p = stream_key(key, STREAM_PERM)``), so ``pi_g(i) = T_i[t(g)]``.
* Correlated uniform of rank ``i``: ``u = (pi_g(i) + gamma) * fp32(1 / n)``; independent:
  ``u = gamma``.

Sharing a permutation over a run of 16, drawn from the per-call table, leaves every coordinate's
ranks in ``n`` distinct strata (never a cyclic shift): the expected error is unchanged.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["MASK32", "PERMUTATION_RUN", "PERMUTATION_TABLE", "STREAM_JITTER", "STREAM_PERM",
           "STREAM_TABLE", "call_key", "coord_hash", "feistel_rounds", "mix32", "mix32_int",
           "permutation_index", "permutation_table", "permute_rank", "rank_key",
           "rounding_uniforms", "stream_key", "to_uint32_bits", "uniform24"]

MASK32 = 0xFFFFFFFF
_M1 = 0x21F0AAAD
_M2 = 0x735A2D97
_C0 = 0x243F6A88  # digits of pi: arbitrary, fixed constants that separate inputs
_C1 = 0x85A308D3
_C2 = 0x13198A2E
STREAM_JITTER = 0x03707344
STREAM_PERM = 0xA4093822
STREAM_TABLE = 0x299F31D0
# 8 rounds: with fewer, pi_g(0) is measurably non-uniform for small n (biasing each rank's rounding)
FEISTEL_ROUNDS = 8
PERMUTATION_RUN = 16  # coordinates sharing one permutation (a hierarchical scale group)
PERMUTATION_TABLE = 4096  # random permutations per call; a run picks one by its hash's top bits
PERMUTATION_SHIFT = 20  # 32 - log2(PERMUTATION_TABLE)


def mix32_int(x: int) -> int:
    """``mix32`` on a Python int (host-side keys)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _M1) & MASK32
    x ^= x >> 15
    x = (x * _M2) & MASK32
    x ^= x >> 15
    return x


def _signed(value: int) -> int:
    """A uint32 value as the int32 with the same bits."""
    value &= MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of uint32 bit patterns held in int32."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` on an int32 tensor holding uint32 bit patterns (int32 multiplication wraps)."""
    x = x ^ _shr(x, 16)
    x = x * _signed(_M1)
    x = x ^ _shr(x, 15)
    x = x * _signed(_M2)
    return x ^ _shr(x, 15)


def to_uint32_bits(value: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 tensors with the same low 32 bits."""
    return (value - ((value & (1 << 31)) << 1)).to(torch.int32)


def call_key(seed: int, step: int) -> int:
    """The 32-bit key of one collective call."""
    seed &= (1 << 64) - 1
    step &= (1 << 64) - 1
    k_seed = mix32_int(mix32_int((seed & MASK32) ^ _C0) ^ (seed >> 32))
    k_step = mix32_int((step & MASK32) ^ _C1) ^ (step >> 32)
    return mix32_int(k_seed ^ k_step)


def stream_key(key: int, stream: int) -> int:
    return mix32_int(key ^ stream)


def rank_key(key: int, rank: int) -> int:
    """The jitter key of one rank: ``mix32(key_j ^ mix32(rank ^ C2))``."""
    return mix32_int(key ^ mix32_int(rank ^ _C2))


def coord_hash(key: int, index: torch.Tensor) -> torch.Tensor:
    """``mix32(mix32(key ^ g_hi) ^ g_lo)`` for int64 global coordinate indices (int32 bits)."""
    lo = to_uint32_bits(index & MASK32)
    hi = to_uint32_bits(index >> 32)
    return mix32(mix32(hi ^ _signed(key)) ^ lo)


def uniform24(h: torch.Tensor) -> torch.Tensor:
    """Top 24 bits of a uint32 hash as an fp32 uniform on [0, 1) (exact: 24-bit mantissa)."""
    return _shr(h, 8).to(torch.float32) * (2.0**-24)


def feistel_half_bits(world_size: int) -> int:
    return max(1, -(-(max(world_size - 1, 1)).bit_length() // 2))


def feistel_rounds(v: torch.Tensor, ck: torch.Tensor, half_bits: int) -> torch.Tensor:
    """One pass of the Feistel network over ``2 * half_bits`` bits."""
    mask = (1 << half_bits) - 1
    left = v >> half_bits  # v < 2**(2 * half_bits) <= 2**32: non-negative as int32 when half < 16
    right = v & mask
    for j in range(FEISTEL_ROUNDS):
        f = mix32(ck ^ (right | (j << 24))) & mask
        left, right = right, left ^ f
    return (left << half_bits) | right


def permute_rank(rank: int, world_size: int, ck: torch.Tensor) -> torch.Tensor:
    """``pi_g(rank)`` for every coordinate key in ``ck`` (cycle-walking into ``[0, n)``)."""
    if world_size == 1:
        return torch.zeros_like(ck)
    half = feistel_half_bits(world_size)
    if half > 15:
        raise ValueError(f"world sizes up to 2**30 are supported, got {world_size}")
    flat_ck = ck.reshape(-1)
    v = feistel_rounds(torch.full_like(flat_ck, rank), flat_ck, half)
    outside = (v >= world_size).nonzero().squeeze(1)
    while outside.numel():
        v[outside] = feistel_rounds(v[outside], flat_ck[outside], half)
        outside = outside[v[outside] >= world_size]
    return v.view(ck.shape)


@functools.lru_cache(maxsize=16)
def permutation_table(key: int, rank: int, world_size: int) -> torch.Tensor:
    """``T_rank[t] = sigma_t(rank)`` for the call ``key``: int32 ``[PERMUTATION_TABLE]`` on the CPU,
    values in ``[0, world_size)`` (cached)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    t = torch.arange(PERMUTATION_TABLE, dtype=torch.int32)
    ck = mix32(t ^ _signed(stream_key(key, STREAM_TABLE)))
    return permute_rank(rank, world_size, ck)


def permutation_index(key: int, first: torch.Tensor) -> torch.Tensor:
    """Which table permutation the runs starting at global indices ``first`` use (int64)."""
    return _shr(coord_hash(stream_key(key, STREAM_PERM), first), PERMUTATION_SHIFT).long()


def rounding_uniforms(
    key: int, rank: int, world_size: int, index: torch.Tensor, correlated: bool
) -> torch.Tensor:
    """fp32 uniforms on [0, 1) for rank ``rank`` at global coordinate indices ``index`` (int64),
    whose last dimension is whole runs of :data:`PERMUTATION_RUN` (else ValueError)."""
    gamma = uniform24(coord_hash(rank_key(stream_key(key, STREAM_JITTER), rank), index))
    if not correlated or world_size == 1:
        return gamma
    if index.shape[-1] % PERMUTATION_RUN:
        raise ValueError(
            f"index's last dimension ({index.shape[-1]}) must be whole runs of {PERMUTATION_RUN}"
        )
    table = permutation_table(key, rank, world_size).to(index.device)
    pi = table[permutation_index(key, index[..., ::PERMUTATION_RUN])].to(torch.float32)
    pi = pi.repeat_interleave(PERMUTATION_RUN, dim=-1)
    inv_n = torch.tensor(1.0 / world_size, dtype=torch.float32)  # fp32(1/n), rounded once
    return (pi + gamma) * inv_n
