"""OCP MX v1.0 element encodings and block scales, bit for bit against ml_dtypes and a
plain-Python reference of the shared-exponent rule."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from dqcoll.schemes.bitpack import pack_bits, packed_nbytes, unpack_bits
from dqcoll.schemes.mx import (
    FORMATS,
    MX_BLOCK,
    bf16_round_up,
    decode_table,
    encode_elements,
    mx_decode_torch,
    mx_encode_torch,
    pow2,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

REFERENCE = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
}
NAMES = sorted(FORMATS)


def _reference_codes(values: torch.Tensor, name: str) -> torch.Tensor:
    """ml_dtypes' codes for the values clamped to the format's range (MX saturates; a plain
    ml_dtypes cast would overflow to Inf/NaN instead)."""
    fmt = FORMATS[name]
    clipped = np.clip(values.numpy().astype(np.float32), -fmt.max_value, fmt.max_value)
    return torch.from_numpy(clipped.astype(REFERENCE[name]).view(np.uint8).astype(np.int64))


def _finite_codes(name: str) -> list[int]:
    fmt = FORMATS[name]
    table = decode_table(fmt)
    return [c for c in range(1 << fmt.bits) if math.isfinite(float(table[c]))]


@pytest.mark.parametrize("name", NAMES)
def test_decode_table_matches_ml_dtypes(name: str) -> None:
    """The value of every finite code equals ml_dtypes' value for the same bit pattern."""
    codes = np.array(_finite_codes(name), dtype=np.uint8)
    ours = decode_table(FORMATS[name])[torch.from_numpy(codes.astype(np.int64))]
    ref = torch.from_numpy(codes.view(REFERENCE[name]).astype(np.float32))
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("name", NAMES)
def test_every_representable_value_encodes_to_its_code(name: str) -> None:
    """Every finite representable value (both zeros included) encodes to exactly its own code."""
    codes = torch.tensor(_finite_codes(name))
    values = decode_table(FORMATS[name])[codes]
    assert torch.equal(encode_elements(values, FORMATS[name]), codes)


@pytest.mark.parametrize("name", NAMES)
def test_ties_round_to_even(name: str) -> None:
    """Midpoints between neighbouring positive values (normal and subnormal) round to the even
    code, as ml_dtypes does; just above/below a midpoint round away/towards."""
    table = decode_table(FORMATS[name])
    positive = sorted({float(v) for v in table if math.isfinite(float(v)) and float(v) >= 0})
    mids = torch.tensor([(a + b) / 2 for a, b in itertools.pairwise(positive)])
    probes = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)),
                        torch.nextafter(mids, torch.tensor(0.0))])
    probes = torch.cat([probes, -probes])
    assert torch.equal(encode_elements(probes, FORMATS[name]), _reference_codes(probes, name))


@pytest.mark.parametrize("name", NAMES)
def test_random_values_match_ml_dtypes(name: str) -> None:
    """Random inputs over the whole range: normals, subnormals, values that underflow to zero,
    and values beyond the largest finite value (saturating), both signs."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(3)
    log_mag = torch.empty(100_000).uniform_(fmt.emin - fmt.mbits - 3, fmt.emax + 3, generator=g)
    sign = torch.randint(0, 2, (100_000,), generator=g) * 2 - 1
    values = sign * torch.exp2(log_mag)
    values = torch.cat([values, torch.tensor([0.0, -0.0, 1e30, -1e30, math.inf, -math.inf])])
    assert torch.equal(encode_elements(values, fmt), _reference_codes(values, name))


def _reference_block_scale(block: list[float], emax: int) -> int:
    """E8M0 byte from the spec's rule, in plain Python."""
    if any(math.isnan(v) or math.isinf(v) for v in block):
        return 0xFF
    amax = max(abs(v) for v in block)
    if amax == 0:
        return 0
    e = math.floor(math.log2(amax)) - emax
    return max(-127, min(127, e)) + 127


@pytest.mark.parametrize("name", NAMES)
def test_mx_blocks_match_reference(name: str) -> None:
    """Whole MX blocks: E8M0 scale = floor(log2 amax) - emax (clamped; 0xFF for NaN/Inf), elements
    = ml_dtypes(clamp(v / 2**scale)), decoded = element * 2**scale; blocks of very different
    magnitudes (down to fp32 subnormals), a zero block and a NaN block."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(7)
    magnitudes = torch.tensor([1.0, 3e-3, 7e4, 2.0**-140, 2.0**100, 0.0, 1.0, 0.5])
    values = torch.randn(len(magnitudes), MX_BLOCK, generator=g) * magnitudes[:, None]
    values[6, 5] = math.nan
    values[7, 0] = 2.0**fmt.emax * 1.999  # amax just below the next power of two
    payload = mx_encode_torch(values.reshape(-1), fmt)
    nblocks = len(magnitudes)
    assert payload.numel() == nblocks + packed_nbytes(nblocks * MX_BLOCK, fmt.bits)
    decoded = mx_decode_torch(payload, nblocks * MX_BLOCK, fmt).view(nblocks, MX_BLOCK)
    for b in range(nblocks):
        row = values[b].tolist()
        scale_byte = _reference_block_scale(row, fmt.emax)
        assert int(payload[b]) == scale_byte, (b, int(payload[b]), scale_byte)
        if scale_byte == 0xFF:
            assert decoded[b].isnan().all()
            continue
        scale = 2.0 ** (scale_byte - 127)
        scaled = torch.tensor([v / scale for v in row], dtype=torch.float32)
        ref_codes = _reference_codes(scaled, name)
        ref = decode_table(fmt)[ref_codes].double() * scale
        assert torch.equal(decoded[b].double(), ref.float().double()), b


def test_pow2_is_exact() -> None:
    """pow2(e) is exactly 2**e for every exponent fp32 can hold, subnormals included."""
    e = torch.arange(-149, 128)
    expected = torch.tensor([2.0**k for k in range(-149, 128)], dtype=torch.float64)
    assert torch.equal(pow2(e).double(), expected)


def test_bf16_round_up() -> None:
    """bf16_round_up gives the smallest bf16 >= x: bf16 values stay, others go one ulp up."""
    g = torch.Generator().manual_seed(1)
    x = torch.rand(10_000, generator=g) * torch.exp2(torch.randint(-100, 100, (10_000,),
                                                                  generator=g).float())
    up = bf16_round_up(x)
    assert torch.equal(up.to(torch.bfloat16).float(), up)  # representable in bf16
    assert torch.all(up >= x)
    below = torch.nextafter(up.to(torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16))
    assert torch.all(below.float() < x)
    exact = x.to(torch.bfloat16).float()
    assert torch.equal(bf16_round_up(exact), exact)


@pytest.mark.parametrize("width", [*list(range(1, 17)), 24, 32])
def test_bitpack_roundtrip_and_order(width: int) -> None:
    """pack_bits/unpack_bits round-trip any width; code j starts at bit j*width (LSB-first)."""
    count = 1001
    g = torch.Generator().manual_seed(width)
    codes = torch.randint(0, 2**width, (count,), generator=g, dtype=torch.int64)
    packed = pack_bits(codes, width)
    assert packed.numel() == packed_nbytes(count, width)
    assert torch.equal(unpack_bits(packed, width, count), codes)
    one = torch.zeros(3, dtype=torch.int64)
    one[1] = 1  # bit `width` of the stream
    assert int(pack_bits(one, width)[width // 8]) == 1 << (width % 8)
