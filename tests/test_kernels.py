"""DynamiQ fast paths against the torch reference: the same bytes, the same fp32 values.

CPU tier, for both fast paths (the ``impl`` fixture): the compiled numba kernels, and the Triton
kernels in Triton's interpreter on CPU tensors (``dynamiq_triton`` loads an interpreted copy of
the kernel module itself, so ``TRITON_INTERPRET`` need not be set and nothing leaks into other
tests). Grids stay small: the interpreter costs ~10 ms per program.

GPU tier (``gpu`` marker, skipped without CUDA): the same comparisons at large sizes, tensors above
2**31 elements (64-bit offsets), and the full all-reduce on CUDA tensors over the ``local``
transport against the CPU result for the same seed.

Comparisons: records with ``torch.equal`` (bytes); fp32 outputs bit for bit, except that where the
reference has NaN the kernel must have NaN (payloads differ between CPU and GPU arithmetic and are
not part of the format: no record stores a NaN payload).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from conftest import has_cuda, heavy_tailed

import dqcoll
from dqcoll.kernels import codec, dynamiq_ops
from dqcoll.kernels.codec import (
    FINE_WIDTHS,
    RAW_WIDTH,
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    RoundingMode,
    Scales,
    record_nbytes,
)
from dqcoll.testing import run_local

KEY = 0x5EED1234
CONFIGS = {
    "default": CodecConfig(),
    "uniform": CodecConfig(levels=Levels.UNIFORM),
    "flat": CodecConfig(scales=Scales.FLAT),
    "independent": CodecConfig(rounding=RoundingMode.INDEPENDENT),
    "h4x32": CodecConfig(levels=Levels.TUNED, scales=Scales.HIERARCHICAL4X32),
}


def widths_of(scales: Scales) -> tuple[int, ...]:
    """The widths both fast paths implement with ``scales`` (format 3's every width; the paper's
    scale modes 2, 4, 8): the tests' cases, so nothing is generated only to be skipped."""
    return FINE_WIDTHS if scales is Scales.HIERARCHICAL4X32 else WIDTHS


def need(impl: Any, width: int, config: CodecConfig) -> None:
    """Skip a (width, scales) the fast path does not implement: ``impl.FORMATS`` lists what it
    does, and the scheme runs the rest on the torch reference (tests/test_dense_gap_prototypes)."""
    if width not in impl.FORMATS.get(config.scales, ()):
        pytest.skip(f"{impl.__name__} does not implement {width}-bit {config.scales.value}")




@pytest.fixture(params=["triton", "numba"])
def impl(request: pytest.FixtureRequest) -> Any:
    """The launcher module of one fast path (same signatures as the torch references)."""
    if request.param == "triton":
        pytest.importorskip("triton")
        from dqcoll.kernels import dynamiq_triton as module
    else:
        pytest.importorskip("numba")
        from dqcoll.kernels import dynamiq_numba as module
    return module


@pytest.fixture
def tri() -> Any:
    """The Triton launchers (GPU tier)."""
    pytest.importorskip("triton")
    from dqcoll.kernels import dynamiq_triton

    return dynamiq_triton


# -- inputs ----------------------------------------------------------------------------------


def rows_with_edge_cases(k: int, seed: int) -> torch.Tensor:
    """fp32 ``[k, 256]``: log-normal row magnitudes, plus (k >= 8) a zero row, a partial row
    (zero padding), rows with NaN, +Inf, -Inf, fp32 denormals, a huge row and a zero group."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(k, 1, generator=g) * 3.0)
    x = torch.randn(k, SUPER, generator=g) * scale
    if k >= 8:
        x[0] = 0.0
        x[1, 100:] = 0.0
        x[2, 17] = float("nan")
        x[3, 200] = float("inf")
        x[4, 5] = float("-inf")
        x[5] = torch.randn(SUPER, generator=g) * 1e-39  # denormals
        x[6] = torch.randn(SUPER, generator=g) * 1e37
        x[7, 32:48] = 0.0
    return x


def index_bases(k: int) -> torch.Tensor:
    """Global index of each row's first coordinate: unaligned, and crossing 2**32 inside a row,
    so the 64-bit split of the index into hash words is exercised."""
    return (2**32 - 300) + torch.arange(k, dtype=torch.int64) * (3 * SUPER) + 7


def boundary_rows(width: int, levels: Levels, scales: Scales = Scales.HIERARCHICAL
                  ) -> torch.Tensor:
    """Rows whose values sit exactly on level magnitudes (and one ulp either side) of their
    decoded scale: the level search must agree with ``searchsorted`` at every boundary."""
    mags = codec.level_magnitudes(width, levels)
    unit = 2.0**-8  # top = levels * unit exactly, so unit and every q * unit are exact
    # hierarchical: uint8 codes per group of 16; hierarchical4x32: 4-bit codes per 32
    top, step, size = (255, 13, codec.GROUP) if scales is Scales.HIERARCHICAL else (16, 1, 32)
    rows = []
    for shift in range(3):
        x = torch.zeros(SUPER // size, size)
        for group in range(SUPER // size):
            q = top - step * group - shift
            scale = torch.tensor(q * unit, dtype=torch.float32)
            x[group, 0] = scale if group else top * unit
            r = (torch.arange(1, size) * (7 + group) + shift) % mags.numel()
            on = mags[r] * scale
            nudged = torch.nextafter(on, torch.where(torch.arange(r.numel()) % 3 == 0,
                                                     on * 2 + 1, -on - 1))
            x[group, 1:] = torch.where(torch.arange(r.numel()) % 3 == 2, on, nudged)
            x[group, 1::2] *= -1
        rows.append(x.reshape(SUPER))
    return torch.stack(rows)


def random_records(k: int, width: int, scales: Scales, seed: int) -> torch.Tensor:
    """Arbitrary bytes as records: codes above 2R, q = 0, bf16 units that are NaN, Inf, denormal."""
    g = torch.Generator().manual_seed(seed)
    records = torch.randint(0, 256, (k, record_nbytes(width, scales)), generator=g,
                            dtype=torch.uint8)
    special = torch.tensor([0x7FC0, 0x7F80, 0x0001, 0x0000, 0xFF80], dtype=torch.int32)
    if scales is not Scales.FLAT:  # the bf16 unit is the last two bytes
        unit = records[:, -2:].clone()
        for i, bits in enumerate(special.tolist()):
            if i < k:
                unit[i] = torch.tensor([bits & 0xFF, bits >> 8], dtype=torch.uint8)
        records[:, -2:] = unit
    return records


def assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical floats, NaN matching NaN whatever its payload."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"NaN positions differ at {(nan_a != nan_e).nonzero()[:5]}"
    as_int = torch.int32 if actual.element_size() == 4 else torch.int16
    bits_a = torch.where(nan_a, 0, actual).view(as_int)
    bits_e = torch.where(nan_e, 0, expected).view(as_int)
    wrong = (bits_a != bits_e).nonzero()
    assert wrong.numel() == 0, f"{wrong.shape[0]} values differ, first at {wrong[:5].tolist()}"


# -- CPU tier: numba and the Triton interpreter, byte for byte ---------------------------------


@pytest.mark.parametrize(
    "config_name, world_size, width",
    [(c, n, w) for c, n in [("default", 1), ("default", 3), ("default", 8), ("uniform", 3),
                            ("flat", 3), ("independent", 8), ("h4x32", 1), ("h4x32", 8)]
     for w in widths_of(CONFIGS[c].scales)],
)
def test_encode_bytes_match_reference(
    impl: Any, width: int, config_name: str, world_size: int
) -> None:
    """Leaf compression: codes and scales are the reference's bytes for every rank's rounding
    (NaN/Inf/zero/denormal rows, unaligned indices above 2**32 included)."""
    config = CONFIGS[config_name]
    need(impl, width, config)
    x = rows_with_edge_cases(12, seed=width)
    index = index_bases(12)
    for rank in sorted({0, world_size - 1}):
        expected = codec.encode_torch(x, width, index, rank, world_size, KEY, config)
        actual = impl.encode(x, width, index, rank, world_size, KEY, config)
        assert torch.equal(actual, expected), (rank, (actual != expected).nonzero()[:5].tolist())


@pytest.mark.parametrize("scales, width", [
    (s, w) for s in (Scales.HIERARCHICAL, Scales.HIERARCHICAL4X32) for w in widths_of(s)])
@pytest.mark.parametrize("levels", list(Levels))
def test_level_search_exact_at_boundaries(
    impl: Any, width: int, levels: Levels, scales: Scales
) -> None:
    """Values exactly on (and one ulp around) every level magnitude get the reference's codes:
    the bin table and its one-step correction equal ``searchsorted``."""
    config = CodecConfig(levels=levels, scales=scales, rounding=RoundingMode.INDEPENDENT)
    need(impl, width, config)
    x = boundary_rows(width, levels, scales)
    index = torch.arange(x.shape[0], dtype=torch.int64) * SUPER
    expected = codec.encode_torch(x, width, index, 0, 1, KEY, config)
    assert torch.equal(impl.encode(x, width, index, 0, 1, KEY, config), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encode_low_precision_rows_equal_upcast(impl: Any, dtype: torch.dtype) -> None:
    """bf16/fp16 rows encode exactly as the reference encodes their fp32 upcast."""
    x = rows_with_edge_cases(8, seed=3).clamp(-6e4, 6e4).to(dtype)
    index = torch.arange(8, dtype=torch.int64) * SUPER
    expected = codec.encode_torch(x.float(), 4, index, 1, 3, KEY, CodecConfig())
    assert torch.equal(impl.encode(x, 4, index, 1, 3, KEY, CodecConfig()), expected)


@pytest.mark.parametrize("levels", list(Levels))
@pytest.mark.parametrize("scales, width", [(s, w) for s in Scales for w in widths_of(s)])
def test_decode_matches_reference_on_any_bytes(
    impl: Any, width: int, scales: Scales, levels: Levels
) -> None:
    """Decompression of arbitrary bytes (codes never written, q = 0, NaN/Inf/denormal units) and
    of real records gives the reference's fp32 values."""
    config = CodecConfig(levels=levels, scales=scales)
    need(impl, width, config)
    real = codec.encode_torch(rows_with_edge_cases(8, seed=5), width,
                              torch.arange(8, dtype=torch.int64) * SUPER, 0, 1, KEY, config)
    for records in (random_records(8, width, scales, seed=width), real):
        assert_same_floats(impl.decode(records, width, config), codec.decode_torch(records, width,
                                                                              config))


@pytest.mark.parametrize("scales, width", [(s, w) for s in Scales for w in widths_of(s)])
def test_decode_accumulate_matches_reference(impl: Any, width: int, scales: Scales) -> None:
    """``acc += decode(records)`` in place, with the reference's single fp32 rounding; rows are a
    strided view (as the executor's slices of its work buffer can be)."""
    config = CodecConfig(scales=scales)
    need(impl, width, config)
    records = random_records(12, width, scales, seed=11 + width)
    base = rows_with_edge_cases(12, seed=6)
    expected = base.clone()
    codec.decode_accumulate_torch(records, width, config, expected)
    wide = torch.full((12, 2 * SUPER), float("nan"))
    wide[:, :SUPER] = base
    acc = wide[:, :SUPER]
    impl.decode_accumulate(records, width, config, acc)
    assert_same_floats(acc, expected)
    assert torch.isnan(wide[:, SUPER:]).all(), "wrote outside the rows"


@pytest.mark.parametrize(
    "config_name, world_size, width",
    [(c, n, w) for c, n in [("default", 1), ("default", 3), ("default", 8), ("uniform", 8),
                            ("flat", 3), ("independent", 3), ("h4x32", 3), ("h4x32", 8)]
     for w in widths_of(CONFIGS[c].scales)],
)
def test_fused_hop_matches_reference(
    impl: Any, width: int, config_name: str, world_size: int
) -> None:
    """The fused decompress-accumulate-recompress returns the reference's bytes and leaves the
    reference's partial sum in ``acc``."""
    config = CONFIGS[config_name]
    need(impl, width, config)
    incoming = codec.encode_torch(rows_with_edge_cases(12, seed=20), width, index_bases(12), 0,
                                  world_size, KEY ^ 1, config)
    local = rows_with_edge_cases(12, seed=21)
    rank = world_size - 1
    acc_ref = local.clone()
    expected = codec.decode_accumulate_encode_torch(incoming, width, acc_ref, index_bases(12),
                                                    rank, world_size, KEY, config)
    acc = local.clone()
    actual = impl.decode_accumulate_encode(incoming, width, acc, index_bases(12), rank, world_size,
                                        KEY, config)
    assert torch.equal(actual, expected)
    assert_same_floats(acc, acc_ref)
    # keep_sum=False (the executor's call): the same records; acc's contents are unspecified by
    # the reference, and each fast path says which it leaves: Triton the input (the sum stays in
    # registers), numba the sum (accumulated in place, the cheaper pass on a CPU)
    scratch = local.clone()
    fast = impl.decode_accumulate_encode(incoming, width, scratch, index_bases(12), rank,
                                      world_size, KEY, config, keep_sum=False)
    assert torch.equal(fast, expected)
    assert_same_floats(scratch, acc_ref if impl.__name__.endswith("numba") else local)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stats_center_matches_reference(impl: Any, dtype: torch.dtype) -> None:
    """Mean, squared norm (the fixed halving tree) and centred rows equal the reference's, for
    full, partial (1, 100, 255 valid), zero and non-finite rows."""
    x = rows_with_edge_cases(40, seed=7).clamp(-6e4, 6e4)
    x[2, 17] = float("nan")
    valid = torch.full((40,), SUPER, dtype=torch.int64)
    for row, count in ((1, 100), (9, 1), (10, 255), (11, 128)):
        valid[row] = count
        x[row, count:] = 0.0
    x = x.to(dtype)
    expected = codec.stats_center_torch(x.float(), valid)
    actual = impl.stats_center(x, valid)
    for a, e in zip(actual, expected, strict=True):
        assert_same_floats(a, e)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_restore_matches_reference(impl: Any, dtype: torch.dtype) -> None:
    """Adding back the means and scattering rows to their original place (partial last rows of
    each shard dropped) matches :func:`restore_torch`, and touches nothing else."""
    rows, shard = 12, 700  # 3 shards of 700 coordinates = 3 rows each (last one partial)
    g = torch.Generator().manual_seed(8)
    work = torch.randn(rows, SUPER, generator=g)
    mean = torch.randn(rows, generator=g)
    work[3, 5] = float("nan")
    shard_rows = -(-shard // SUPER)
    in_shard = torch.arange(shard_rows).repeat(4)
    shard_id = torch.arange(4).repeat_interleave(shard_rows)
    index = shard_id * shard + in_shard * SUPER
    valid = (shard - in_shard * SUPER).clamp(max=SUPER)
    order = torch.randperm(rows, generator=g)
    expected = torch.full((4 * shard,), -7.0, dtype=dtype)
    actual = expected.clone()
    codec.restore_torch(work, mean[order], index[order], valid[order], expected)
    impl.restore(work, mean[order], index[order], valid[order], actual)
    assert_same_floats(actual, expected)
    assert not (expected == -7.0).any(), "restore left coordinates unwritten"


def _raw_rows() -> torch.Tensor:
    """Rows for the raw width: heavy-tailed ones, and rows of zeros (+0, -0), a NaN, an Inf,
    fp32 subnormals, values near fp32's top, a unit below 2**-64 (the prescale), and rows whose
    fp16 codes are subnormal (one large value beside tiny ones)."""
    g = torch.Generator().manual_seed(11)
    x = heavy_tailed(1, 40 * SUPER, seed=3).view(40, SUPER).clone()
    x[0] = 0.0
    x[1] = -0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("-inf")
    x[4] = 1e-42
    x[5] = torch.randn(SUPER, generator=g) * 1e-38
    x[6] = torch.randn(SUPER, generator=g) * 3e38
    x[7] = torch.randn(SUPER, generator=g) * 1e-21
    x[8] = torch.randn(SUPER, generator=g) * 1e-6
    x[8, 0] = 1.0
    x[9, ::2] = -0.0
    return x


def test_width_16_matches_reference(impl: Any) -> None:
    """Raw 16-bit super-groups (encode, decode, decode-accumulate, the fused hop) give the
    reference's bytes and values through the fast paths' launchers, special values included,
    and decode any bytes (fp16 NaN, Inf and subnormal patterns, any bf16 unit) as it does."""
    x = _raw_rows()
    rows = x.shape[0]
    index = torch.arange(rows, dtype=torch.int64) * SUPER
    config = CodecConfig()
    expected = codec.encode_torch(x, RAW_WIDTH, index, 0, 3, KEY, config)
    records = impl.encode(x, RAW_WIDTH, index, 0, 3, KEY, config)
    assert torch.equal(records, expected)
    arbitrary = torch.randint(0, 256, tuple(records.shape), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(5))
    for recs in (records, arbitrary):
        assert_same_floats(impl.decode(recs, RAW_WIDTH, config),
                           codec.decode_torch(recs, RAW_WIDTH, config))
        acc, acc_ref = x.clone(), x.clone()
        impl.decode_accumulate(recs, RAW_WIDTH, config, acc)
        codec.decode_accumulate_torch(recs, RAW_WIDTH, config, acc_ref)
        assert_same_floats(acc, acc_ref)
    acc, acc_ref = x.clone(), x.clone()
    hop = impl.decode_accumulate_encode(records, RAW_WIDTH, acc, index, 1, 3, KEY,
                                                 config)
    ref = codec.decode_accumulate_encode_torch(records, RAW_WIDTH, acc_ref, index, 1, 3, KEY,
                                               config)
    assert torch.equal(hop, ref)
    assert_same_floats(acc, acc_ref)
    # records written at an odd byte offset of a payload (widths before them of odd size)
    payload = torch.zeros(records.numel() + 1, dtype=torch.uint8)
    impl.encode(x, RAW_WIDTH, index, 0, 3, KEY, config, out=payload[1:].view(records.shape))
    assert torch.equal(payload[1:].view(records.shape), expected)


def test_empty_inputs_and_bad_shapes(impl: Any) -> None:
    """Zero rows give empty outputs without a launch; malformed inputs raise with the values."""
    empty = torch.empty(0, SUPER)
    index = torch.empty(0, dtype=torch.int64)
    assert impl.encode(empty, 4, index, 0, 1, KEY, CodecConfig()).shape == (0, record_nbytes(4))
    assert impl.decode(torch.empty(0, record_nbytes(2), dtype=torch.uint8), 2,
                    CodecConfig()).shape == (0, SUPER)
    with pytest.raises(ValueError, match=r"\[k, 256\].*\(3, 128\)"):
        impl.encode(torch.zeros(3, 128), 4, index, 0, 1, KEY, CodecConfig())
    with pytest.raises(ValueError, match="width must be one of"):  # 16 is one of them
        impl.encode(torch.zeros(1, SUPER), 3, torch.zeros(1, dtype=torch.int64), 0, 1, KEY,
                 CodecConfig())
    with pytest.raises(ValueError, match=r"uint8 \[k, 146\]"):
        impl.decode(torch.zeros(2, 82, dtype=torch.uint8), 4, CodecConfig())
    if impl.__name__.endswith("triton"):  # numba takes any strides (through a copy)
        with pytest.raises(ValueError, match="unit stride"):
            impl.decode_accumulate(torch.zeros(2, 146, dtype=torch.uint8), 4, CodecConfig(),
                                   torch.zeros(SUPER, 2).t())


@pytest.mark.parametrize("fast", ["triton", "numba"])
@pytest.mark.parametrize("dtype, algorithm, kwargs", [
    (torch.float32, "ring", {}),
    (torch.bfloat16, "butterfly", {}),
    (torch.float32, "ring", {"target_vnmse": 1e-7}),  # tight: raw 16-bit super-groups too
    (torch.float32, "butterfly", {"op": "avg"}),  # the division by n fused into the centring
])
def test_forced_fast_path_allreduce_equals_reference(
    monkeypatch: pytest.MonkeyPatch, fast: str, dtype: torch.dtype, algorithm: str,
    kwargs: dict[str, Any],
) -> None:
    """The whole all-reduce (statistics, reorder, every hop, all-gather, restore) with
    DQCOLL_KERNELS=triton (interpreted kernels on CPU tensors) or =numba ends with the same bits
    as with the torch reference."""
    pytest.importorskip(fast)

    def body(comm):  # type: ignore[no-untyped-def]
        x = heavy_tailed(comm.rank, 3 * SUPER * 3 + 77, seed=4).to(dtype)
        dqcoll.allreduce(x, scheme="dynamiq", algorithm=algorithm, seed=9, **kwargs)
        return x, dict(comm.last_info)

    monkeypatch.setenv("DQCOLL_KERNELS", "torch")
    assert dynamiq_ops(torch.device("cpu")).name == "torch"
    expected = run_local(3, body)
    monkeypatch.setenv("DQCOLL_KERNELS", fast)
    assert dynamiq_ops(torch.device("cpu")).name == fast
    actual = run_local(3, body)
    for (a, _), (e, _) in zip(actual, expected, strict=True):
        assert torch.equal(a, e)
    # what ran, not what the variable asked for: a regression that fell back to the reference
    # would otherwise compare the reference with itself and pass
    codec = {"encode", "decode", "decode_accumulate", "decode_accumulate_encode", "restore",
             "decode_restore"}
    for _, info in expected:
        assert set(info["kernels"].values()) == {"torch"}, info["kernels"]
    for _, info in actual:
        ran = {step: impl for step, impl in info["kernels"].items() if step in codec}
        assert ran and set(ran.values()) == {fast}, info["kernels"]
    if "target_vnmse" in kwargs:
        assert expected[0][1]["widths"][16] > 0, "the case meant to reach width 16 did not"


def test_import_without_triton() -> None:
    """``import dqcoll`` does not import Triton; without Triton, automatic dispatch uses the torch
    reference for CUDA tensors (CPU tensors keep the numba kernels) and DQCOLL_KERNELS=triton
    raises an error that names the reason."""
    script = """
import sys
import dqcoll, torch
assert "triton" not in sys.modules, "import dqcoll imported triton"
sys.modules["triton"] = None  # as if not installed
from dqcoll.kernels import dynamiq_ops, triton_available
from dqcoll.errors import UnsupportedError
import os
assert "not importable" in triton_available()
assert dynamiq_ops(torch.device("cuda")).name == "torch"
assert dynamiq_ops(torch.device("cpu")).name == "numba"
os.environ["DQCOLL_KERNELS"] = "triton"
try:
    dynamiq_ops(torch.device("cpu"))
except UnsupportedError as exc:
    assert "DQCOLL_KERNELS=triton" in str(exc) and "triton is not importable" in str(exc)
else:
    raise AssertionError("no error")
"""
    env = {k: v for k, v in os.environ.items() if k != "DQCOLL_KERNELS"}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)


def test_kernel_module_uses_only_triton_builtins() -> None:
    """The kernel module calls no ``@triton.jit`` helper of ``triton.language`` (``tl.sum``,
    ``tl.max``, ``tl.zeros``, ...), which the interpreted copy could not call."""
    import inspect

    import triton.language.standard as standard

    from dqcoll.kernels import _dynamiq_kernels

    source = inspect.getsource(_dynamiq_kernels)
    code = "\n".join(line.split("#")[0] for line in source.splitlines()
                     if not line.strip().startswith(("\"", "``", "*")))
    helpers = [name for name, obj in vars(standard).items()
               if not name.startswith("_") and hasattr(obj, "fn")]
    used = [name for name in helpers if f"tl.{name}(" in code]
    assert not used, f"uses @triton.jit helpers {used}"


def test_compiled_kernels_keep_the_exactness_rules() -> None:
    """Compiled for sm_90 as their launchers launch them (no GPU needed: Triton's bundled
    ptxas), the fused hop and the statistics kernel contain no fp32 FMA and no approximate
    division; every division is IEEE ``div.rn``."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    import re

    import triton

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import kernels_aot  # compiles a kernel exactly as its launcher launches it
    finally:
        sys.path.pop(0)
    for kernel, width in (("decode_accumulate_encode", 4), ("stats_center", 0)):
        try:
            launch = kernels_aot.capture_launch(kernel, width, RoundingMode.CORRELATED)
            source, options, target = kernels_aot._specialise(launch, 90)
            compiled = triton.compile(source, target=target, options=options)
        except RuntimeError as exc:  # no ptxas usable on this machine
            pytest.skip(f"cannot compile for sm_90 here: {exc}")
        name = launch.kernel.__name__
        ptx = compiled.asm["ptx"]
        assert not re.findall(r"\bfma\.\S*f32", ptx), f"{name}: fp32 FMA in the PTX"
        assert not re.findall(r"\bdiv\.(approx|full)", ptx), f"{name}: inexact division"
        assert "div.rn.f32" in ptx, f"{name}: expected IEEE divisions"


# -- GPU tier ---------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not has_cuda(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config_name, width", [
    (c, w) for c in CONFIGS for w in widths_of(CONFIGS[c].scales)])
def test_gpu_kernels_match_cpu_reference(tri: Any, width: int, config_name: str) -> None:
    """On CUDA, at 2**20 coordinates: every kernel's bytes and values equal the CPU reference's."""
    config = CONFIGS[config_name]
    need(tri, width, config)
    k, n = 4096, 8
    x = rows_with_edge_cases(k, seed=30 + width)
    index = index_bases(k)
    cuda = torch.device("cuda")
    records = codec.encode_torch(x, width, index, 2, n, KEY, config)
    assert torch.equal(tri.encode(x.to(cuda), width, index.to(cuda), 2, n, KEY, config).cpu(),
                       records)
    assert_same_floats(tri.decode(records.to(cuda), width, config).cpu(),
                       codec.decode_torch(records, width, config))
    local = rows_with_edge_cases(k, seed=40 + width)
    acc_ref = local.clone()
    codec.decode_accumulate_torch(records, width, config, acc_ref)
    acc = local.to(cuda)
    tri.decode_accumulate(records.to(cuda), width, config, acc)
    assert_same_floats(acc.cpu(), acc_ref)
    acc_ref = local.clone()
    expected = codec.decode_accumulate_encode_torch(records, width, acc_ref, index, 5, n, KEY,
                                                    config)
    acc = local.to(cuda)
    actual = tri.decode_accumulate_encode(records.to(cuda), width, acc, index.to(cuda), 5, n, KEY,
                                        config)
    assert torch.equal(actual.cpu(), expected)
    assert_same_floats(acc.cpu(), acc_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("scales, width", [
    (s, w) for s in (Scales.HIERARCHICAL, Scales.HIERARCHICAL4X32) for w in widths_of(s)])
@pytest.mark.parametrize("levels", list(Levels))
def test_gpu_level_search_exact_at_boundaries(
    tri: Any, width: int, levels: Levels, scales: Scales
) -> None:
    """On CUDA, values on every level boundary get the reference's codes."""
    config = CodecConfig(levels=levels, scales=scales, rounding=RoundingMode.INDEPENDENT)
    need(tri, width, config)
    x = boundary_rows(width, levels, scales)
    index = torch.arange(x.shape[0], dtype=torch.int64) * SUPER
    expected = codec.encode_torch(x, width, index, 0, 1, KEY, config)
    actual = tri.encode(x.cuda(), width, index.cuda(), 0, 1, KEY, config)
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gpu_stats_and_restore_match_cpu_reference(tri: Any, dtype: torch.dtype) -> None:
    """On CUDA, statistics, centring and restore equal the CPU reference at 2**22 coordinates."""
    k = 16384
    x = rows_with_edge_cases(k, seed=50).clamp(-6e4, 6e4)
    valid = torch.randint(1, SUPER + 1, (k,), generator=torch.Generator().manual_seed(1))
    x[torch.arange(SUPER)[None, :] >= valid[:, None]] = 0.0
    x = x.to(dtype)
    expected = codec.stats_center_torch(x.float(), valid)
    actual = tri.stats_center(x.cuda(), valid)
    for a, e in zip(actual, expected, strict=True):
        assert_same_floats(a.cpu(), e)
    index = torch.randperm(k, generator=torch.Generator().manual_seed(2)) * SUPER
    out_ref = torch.zeros(k * SUPER, dtype=dtype)
    codec.restore_torch(expected[0], expected[1], index, valid, out_ref)
    out = torch.zeros(k * SUPER, dtype=dtype, device="cuda")
    tri.restore(expected[0].cuda(), expected[1].cuda(), index.cuda(), valid.cuda(), out)
    assert_same_floats(out.cpu(), out_ref)


@pytest.mark.gpu
@gpu
def test_gpu_offsets_above_2_pow_31(tri: Any) -> None:
    """Rows beyond element 2**31 of a buffer are encoded and fused-updated correctly (int64
    offsets): the last rows of an 8.6 GB buffer equal the reference on those rows alone."""
    k = (2**31) // SUPER + 64
    tail = 64
    width, n, config = 4, 8, CodecConfig()
    try:
        big = torch.zeros(k, SUPER, device="cuda")
    except torch.OutOfMemoryError:
        pytest.skip("needs 9 GB of GPU memory")
    x = rows_with_edge_cases(tail, seed=60)
    big[-tail:] = x.cuda()
    index = torch.arange(k, dtype=torch.int64, device="cuda") * SUPER
    records = tri.encode(big, width, index, 1, n, KEY, config)
    expected = codec.encode_torch(x, width, index[-tail:].cpu(), 1, n, KEY, config)
    assert torch.equal(records[-tail:].cpu(), expected)
    out = tri.decode_accumulate_encode(records, width, big, index, 3, n, KEY, config)
    acc_ref = x.clone()
    expected = codec.decode_accumulate_encode_torch(expected, width, acc_ref, index[-tail:].cpu(),
                                                    3, n, KEY, config)
    assert torch.equal(out[-tail:].cpu(), expected)
    assert_same_floats(big[-tail:].cpu(), acc_ref)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("world_size", [1, 3, 8])
def test_gpu_allreduce_matches_cpu(tri: Any, world_size: int) -> None:
    """The full all-reduce on CUDA tensors (Triton kernels, ``local`` transport) ends with exactly
    the bits the CPU run (torch reference) gives for the same seed."""
    numel = 1_000_003

    def body(comm, device):  # type: ignore[no-untyped-def]
        x = heavy_tailed(comm.rank, numel, seed=12).to(device)
        dqcoll.allreduce(x, scheme="dynamiq", algorithm="butterfly", seed=3)
        return x.cpu()

    assert dynamiq_ops(torch.device("cuda")).name == "triton"
    on_gpu = run_local(world_size, body, "cuda", device="cuda")
    on_cpu = run_local(world_size, body, "cpu")
    for g, c in zip(on_gpu, on_cpu, strict=True):
        assert torch.equal(g, c)
