"""The compiled CPU (numba) kernels of the baseline codecs against their torch references, bit for
bit: payload bytes, decoded values (NaN bits included), accumulations and fused hops, on data
that exercises every rounding and special case; plus the ``DQCOLL_KERNELS`` dispatch and whole
collectives run both ways."""

from __future__ import annotations

import math

import pytest
import torch

from dqcoll import schemes
from dqcoll.errors import UnsupportedError
from dqcoll.kernels import baselines, rng
from dqcoll.kernels.cpu_runtime import numba_available
from dqcoll.schemes.bitpack import pack_bits_torch, unpack_bits_torch
from dqcoll.schemes.global_qsgd import GlobalQSGDScheme
from dqcoll.schemes.global_qsgd import _State as QSGDState
from dqcoll.schemes.int_block import int_block_decode_torch, int_block_encode_torch
from dqcoll.schemes.mx import (
    FORMATS,
    MX_BLOCK,
    MXScheme,
    decode_table,
    mx_decode_global_torch,
    mx_decode_torch,
    mx_encode_global_torch,
    mx_encode_torch,
)
from dqcoll.schemes.thc import THCScheme
from dqcoll.schemes.thc import _State as THCState
from dqcoll.testing import run_local

if numba_available() is not None:
    pytest.skip(f"numba kernels: {numba_available()}", allow_module_level=True)

from dqcoll.kernels import baselines_numba as K


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bits (floats compared as bit patterns: NaN payloads and -0 too)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype.is_floating_point:
        got, want = _bits(got), _bits(want)
    wrong = (got != want).nonzero().flatten()
    assert wrong.numel() == 0, f"{wrong.numel()} differ, first at {wrong[:5].tolist()}"


def _ties(block: int) -> torch.Tensor:
    """Blocks led by a format's largest value times ``s`` (so the OCP block scale is ``s``),
    then exact midpoints between consecutive values of that format times ``s`` (RNE ties), for
    every MX element format and ``s`` in {1, 2**-3}."""
    rows = []
    for name in sorted(FORMATS):
        fmt = FORMATS[name]
        table = decode_table(fmt)
        pos = torch.unique(table[torch.isfinite(table) & (table >= 0)])
        mids = (pos[1:] + pos[:-1]) / 2
        mids = torch.cat([mids, -mids])
        for scale in (1.0, 2.0**-3):
            for chunk in mids.split(block - 1):
                row = torch.zeros(block)
                row[0] = fmt.max_value
                row[1 : 1 + chunk.numel()] = chunk
                rows.append(row * scale)
    return torch.cat(rows)


def special_values(block: int, seed: int = 0) -> torch.Tensor:
    """Whole blocks of ``block``: Gaussians at magnitudes 1e-38..1e38, fp32 subnormals, exact
    ties, +-0, all-zero blocks, NaN / +-Inf / -NaN in otherwise normal blocks, huge blocks that
    saturate, and blocks mixing 1e30 with 1e-30 (elements underflowing after scaling)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for exponent in (-38, -20, -5, 0, 5, 20, 38):
        parts.append(torch.randn(4 * block, generator=g) * 10.0**exponent)
    parts.append(torch.randn(2 * block, generator=g) * 1e-42)  # fp32 subnormals
    parts.append(torch.randn(block, generator=g).clamp(-3, 3) * 3.4e38)  # near fp32 max
    parts.append(_ties(block))
    zeros = torch.zeros(2 * block)
    zeros[1::2] = -0.0
    parts.append(zeros)
    mixed = torch.randn(2 * block, generator=g) * 1e-30
    mixed[0] = 1e30
    mixed[block] = -1e30
    parts.append(mixed)
    for bad in (math.nan, math.inf, -math.inf, -math.nan):
        row = torch.randn(block, generator=g)
        row[block // 3] = bad
        parts.append(row)
    x = torch.cat(parts)
    return torch.cat([x, torch.zeros(-x.numel() % block)]).float()


MX_CASES = [pytest.param(name, scale, id=f"{name}-{scale}")
            for name in sorted(FORMATS) for scale in ("ocp", "global")]


def _global_scales(x: torch.Tensor, name: str, count: int) -> torch.Tensor:
    """The global variant's block scales for ``x`` as one rank's block maxima, plus a zero and an
    Inf scale (an all-zero and a non-finite block maximum)."""
    codec = _mx_codec(name, "global")
    gmax = codec.encode(x)["state"]  # one rank's block maxima
    gmax[0] = 0.0
    gmax[1] = math.inf
    return codec.global_scale(gmax, count)


def _mx_codec(name: str, scale: str) -> MXScheme:
    scheme = {"e4m3": "mxfp8", "e5m2": "mxfp8", "e2m3": "mxfp6", "e3m2": "mxfp6",
              "e2m1": "mxfp4"}[name]
    codec = schemes.get(scheme, element=name, scale=scale)
    assert isinstance(codec, MXScheme)
    return codec


@pytest.mark.parametrize(("name", "scale"), MX_CASES)
def test_mx_kernels_match_reference(name: str, scale: str) -> None:
    """MX encode, decode, decode-accumulate and the fused hop: the numba kernels give the
    reference's payload bytes and fp32 bits, for every element format and both scale modes
    (scales 0 and Inf included), on special values, ties, subnormals and non-finite blocks."""
    fmt = FORMATS[name]
    x = special_values(MX_BLOCK)
    acc = special_values(MX_BLOCK, seed=1)[torch.randperm(x.numel(),
                                                          generator=torch.Generator())]
    scale_in = scale_out = None
    if scale == "global":
        scale_in, scale_out = _global_scales(x, name, 1), _global_scales(x, name, 2)
        payload = mx_encode_global_torch(x, scale_in, fmt)
        want_decoded = mx_decode_global_torch(payload, x.numel(), scale_in, fmt)
    else:
        payload = mx_encode_torch(x, fmt)
        want_decoded = mx_decode_torch(payload, x.numel(), fmt)
    _assert_same(K.mx_encode(x, fmt, scale_in), payload)

    decoded = torch.full_like(x, math.nan)
    K.mx_decode(payload, decoded, fmt, scale_in, accumulate=False)
    _assert_same(decoded, want_decoded)

    summed = acc.clone()
    K.mx_decode(payload, summed, fmt, scale_in, accumulate=True)
    _assert_same(summed, acc + want_decoded)

    work = acc.clone()
    fused = K.mx_decode_accumulate_encode(payload, work, fmt, scale_in, scale_out)
    _assert_same(work, acc + want_decoded)
    if scale_out is None:
        _assert_same(fused, mx_encode_torch(acc + want_decoded, fmt))
    else:
        _assert_same(fused, mx_encode_global_torch(acc + want_decoded, scale_out, fmt))


@pytest.mark.parametrize(("scheme", "code_bits", "block"),
                         [("int8_block", 8, 128), ("int4_block", 4, 128), ("int8_block", 8, 2),
                          ("int4_block", 4, 34), ("int8_block", 8, 30)])
def test_int_block_kernels_match_reference(scheme: str, code_bits: int, block: int) -> None:
    """int8/int4 blocks (default and odd block sizes): numba encode bytes (fp32 scales included,
    NaN scales too), decode, decode-accumulate and fused hop equal the torch reference; exact
    ties ``k + 0.5`` at scale 1 round to even."""
    qmax = (1 << (code_bits - 1)) - 1
    ties = torch.arange(-qmax, qmax, dtype=torch.float32) + 0.5
    ties = torch.cat([torch.tensor([float(qmax)]), ties])
    ties = torch.cat([ties, torch.zeros(-ties.numel() % block)])
    x = torch.cat([special_values(block), ties])
    acc = special_values(block, seed=2)
    acc = torch.cat([acc, torch.randn(x.numel() - acc.numel())])
    payload = int_block_encode_torch(x, block, code_bits)
    _assert_same(K.int_block_encode(x, block, code_bits), payload)
    want = int_block_decode_torch(payload, x.numel(), block, code_bits)
    out = torch.full_like(x, 1.0)
    K.int_block_decode(payload, out, block, code_bits, accumulate=False)
    _assert_same(out, want)
    out = acc.clone()
    K.int_block_decode(payload, out, block, code_bits, accumulate=True)
    _assert_same(out, acc + want)
    work = acc.clone()
    fused = K.int_block_decode_accumulate_encode(payload, work, block, code_bits)
    _assert_same(work, acc + want)
    _assert_same(fused, int_block_encode_torch(acc + want, block, code_bits))
    # a payload at an odd byte offset (fp32 scales not 4-byte aligned)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), payload])[1:]
    out = torch.empty_like(x)
    K.int_block_decode(shifted, out, block, code_bits, accumulate=False)
    _assert_same(out, want)


@pytest.mark.parametrize("width", list(range(1, 33)))
def test_bitpack_kernels_match_reference(width: int) -> None:
    """pack/unpack of every width 1..32 at odd counts (partial last byte and group): the same
    bytes and codes as the torch reference; unpack_accumulate adds the codes to int64 sums."""
    g = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 1 << width, (count,), generator=g, dtype=torch.int64)
        packed = pack_bits_torch(codes, width)
        _assert_same(K.pack_bits(codes, width), packed)
        _assert_same(K.unpack_bits(packed, width, count), unpack_bits_torch(packed, width, count))
        sums = torch.randint(-(1 << 40), 1 << 40, (count,), generator=g, dtype=torch.int64)
        _assert_same(K.unpack_accumulate(sums, packed, width), sums + codes)


def _integer_values(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4099, generator=g) * 2.0
    x[:5] = torch.tensor([0.0, -0.0, 1e30, -1e30, 1e-40])
    return x


@pytest.mark.parametrize("index_base", [0, 12345, (1 << 32) - 100, 3 << 33])
def test_thc_quantize_dequantize_match_reference(index_base: int) -> None:
    """THC's compiled quantizer draws the reference's uniforms (hash of the 64-bit coordinate
    index, high half included) and gives the reference's codes, clamped values included; its
    dequantization gives the reference's fp32 bits at several counts."""
    scheme = THCScheme()
    x = _integer_values(index_base % 97)
    state = THCState(torch.empty(0), torch.empty(0), 2.5 * 1.7, 2 * 2.5 * 1.7 / 15)
    key = rng.rank_key(rng.stream_key(rng.call_key(7, 3), scheme.stream), 2)
    index = torch.arange(index_base, index_base + x.numel(), dtype=torch.int64)
    uniforms = rng.uniform24(rng.coord_hash(key, index))  # the reference call's uniforms
    want = scheme.quantize(x, uniforms, state)
    got = scheme.quantize_fast(K, x, key, index_base, state)
    assert got is not None
    _assert_same(got, want)
    for count in (1, 2, 7):
        sums = torch.randint(0, 15 * count + 1, (x.numel(),), dtype=torch.int64)
        out = torch.empty(x.numel())
        assert scheme.dequantize_fast(K, sums, count, state, out)
        _assert_same(out, scheme.dequantize(sums, count, state))


@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_qsgd_quantize_dequantize_match_reference(world_size: int) -> None:
    """Global QSGD's compiled quantizer and dequantizer equal the reference (codes in [0, 2L],
    values clamped to the range), and a NaN step decodes as NaN in both."""
    scheme = GlobalQSGDScheme()
    x = _integer_values(world_size)
    levels = 127 // world_size
    state = QSGDState(levels, 3.0 / levels)
    key = rng.rank_key(rng.stream_key(rng.call_key(5, 9), scheme.stream), 1)
    uniforms = rng.uniform24(rng.coord_hash(key, torch.arange(x.numel())))
    got = scheme.quantize_fast(K, x, key, 0, state)
    assert got is not None
    _assert_same(got, scheme.quantize(x, uniforms, state))
    sums = torch.randint(0, 2 * levels * world_size + 1, (x.numel(),), dtype=torch.int64)
    for st in (state, QSGDState(levels, math.nan)):
        out = torch.empty(x.numel())
        assert scheme.dequantize_fast(K, sums, world_size, st, out)
        _assert_same(out, scheme.dequantize(sums, world_size, st))


def test_dispatch_follows_dqcoll_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto and numba pick the compiled kernels for CPU tensors, torch and triton the reference;
    CUDA devices always get the reference; an explicit numba without numba raises, auto falls
    back."""
    cpu = torch.device("cpu")
    for choice, expected in (("auto", K), ("numba", K), ("torch", None), ("triton", None)):
        monkeypatch.setenv("DQCOLL_KERNELS", choice)
        assert baselines.cpu_kernels(cpu) is expected
        assert baselines.cpu_kernels(torch.device("cuda")) is None
    monkeypatch.setattr(baselines, "numba_available", lambda: "numba is not importable (test)")
    monkeypatch.setenv("DQCOLL_KERNELS", "numba")
    with pytest.raises(UnsupportedError, match="numba"):
        baselines.cpu_kernels(cpu)
    monkeypatch.setenv("DQCOLL_KERNELS", "auto")
    assert baselines.cpu_kernels(cpu) is None


COLLECTIVE_CASES = [
    ("mxfp8", {}), ("mxfp8", {"element": "e5m2"}), ("mxfp8", {"scale": "global"}),
    ("mxfp6", {}), ("mxfp6", {"element": "e3m2"}), ("mxfp6", {"scale": "global"}),
    ("mxfp4", {}), ("mxfp4", {"scale": "global"}), ("int8_block", {}), ("int4_block", {}),
    ("int8_block", {"block": 30}), ("thc", {}), ("global_qsgd", {}),
]


def _allreduce(comm, inputs, scheme, algorithm, options):  # type: ignore[no-untyped-def]
    import dqcoll

    x = inputs[comm.rank].clone()
    dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, **options)
    return x


@pytest.mark.parametrize("algorithm", ["ring", "butterfly"])
@pytest.mark.parametrize(("scheme", "options"), [
    pytest.param(s, o, id=s + "".join(f"-{v}" for v in o.values())) for s, o in COLLECTIVE_CASES])
def test_collective_identical_with_and_without_kernels(
    scheme: str, options: dict, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3-rank all-reduce of an odd length (partial last block) gives the same bits on every
    rank with DQCOLL_KERNELS=numba as with torch (block schemes: special values and a NaN in one
    rank's input; integer-sum schemes: Gaussians with one large outlier, which gets clamped)."""
    numel = 3 * 1024 + 77
    if scheme in ("thc", "global_qsgd"):
        inputs = [_integer_values(r)[:numel] for r in range(3)]
        for x in inputs:
            x[2:4] = 0.0  # no +-1e30: a range that Gaussians use
        inputs[2][100] = 40.0
    else:
        inputs = [special_values(32, seed=r)[:numel] for r in range(3)]
        inputs = [torch.where(torch.isfinite(x), x, torch.zeros_like(x)) for x in inputs]
        inputs[1][5] = math.nan
    results = {}
    for choice in ("torch", "numba"):
        monkeypatch.setenv("DQCOLL_KERNELS", choice)
        outs = run_local(3, _allreduce, inputs, scheme, algorithm, options)
        for out in outs[1:]:
            _assert_same(out, outs[0])
        results[choice] = outs[0]
    _assert_same(results["numba"], results["torch"])
