"""Property-based tests (hypothesis) of the invariants of docs/design.md §3, over every scheme.

Hypothesis draws the world size (1-5), length (empty, tiny, around multiples of 256 and of the
world size, and a few thousand), dtype (among those the scheme takes), algorithm, op, scheme and
seeds; each example runs the ranks as threads (``dqcoll.testing.run_local``) and checks:

1. every rank ends bit-identical, with the input's shape and dtype, finite for finite input;
2. the byte budget is honest: the bytes on the wire match the declared bits per coordinate
   (exactly for ``none`` and ``dynamiq``, up to block padding for fixed-rate schemes);
3. the same seed and step give the same bytes;
4. nothing is lost: the result is the exact sum up to the scheme's error budget.

Budgets are per scheme (measured worst vNMSE on N(0,1) inputs of >= 1024 elements over n <= 5
and all algorithms, times about three); a scheme added later without an entry must still stay
below vNMSE 1 (no worse than returning zeros).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

# a test-only package (the [test] extra): without it (a bare GPU machine running the `gpu`
# tests) this module is skipped, not an error that stops the collection
pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dqcoll
from dqcoll import metrics, schemes
from dqcoll.kernels.codec import SUPER, Scales, record_nbytes
from dqcoll.schemes.dynamiq.allocation import STATS_BYTES_PER_SUPER
from dqcoll.topology import algorithms
from dqcoll.transports.base import ring_allreduce_nbytes

SCHEMES = schemes.list_schemes()
ALGORITHMS = algorithms.list_algorithms()
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# vNMSE budget for >= 1024 elements (measured worst over n = 2, 3, 5 x ring/butterfly/direct on
# N(0,1), this machine: bf16 0.0, dynamiq 0.031, global_qsgd 0.0054, int4_block 0.042,
# int8_block 1e-4, mxfp4 0.040, mxfp6 0.0023, mxfp8 0.0025, thc 0.019, topk_block 0.67).
VNMSE_BUDGET = {
    "bf16": 1e-4, "dynamiq": 0.1, "global_qsgd": 0.02, "int4_block": 0.12, "int8_block": 1e-3,
    "mxfp4": 0.12, "mxfp6": 0.01, "mxfp8": 0.01, "thc": 0.06, "topk_block": 0.9,
}
# Schemes whose aggregate width grows with the number of summed ranks (integer sums,
# docs/design.md §4): their bits per coordinate are per contribution, so the fixed-rate budget
# check does not apply.
WIDENING = {"thc"}
_HANDSHAKE_FIELDS = 7  # validate._FIELDS: the argument check all-reduces (2 * 7 + n) int64 values


@dataclasses.dataclass(frozen=True)
class Setup:
    world_size: int
    numel: int
    dtype: torch.dtype
    scheme: str
    algorithm: str
    op: str
    seed: int
    data_seed: int


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    n = draw(st.integers(1, 5))
    scheme = draw(st.sampled_from(SCHEMES))
    dtypes = [d for d in DTYPES if d in schemes.spec(scheme).dtypes]
    numel = draw(st.one_of(
        st.integers(0, 600),
        st.sampled_from([255, 256, 257, 511, 512, 513, SUPER * n - 1, SUPER * n + 1,
                         16 * n - 1, 16 * n + 1]),
        st.integers(1024, 3000),
    ))
    algorithm = draw(st.sampled_from(ALGORITHMS))
    assume(algorithms.get(algorithm).supports(n))
    return Setup(n, numel, draw(st.sampled_from(dtypes)), scheme, algorithm,
                 draw(st.sampled_from(["sum", "avg"])), draw(st.integers(0, 2**31 - 1)),
                 draw(st.integers(0, 2**31 - 1)))


def _inputs(s: Setup) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(s.data_seed)
    return [torch.randn(s.numel, generator=gen).to(s.dtype) for _ in range(s.world_size)]


def _run(s: Setup, inputs: list[torch.Tensor], step: int = 0) -> list[tuple]:
    def fn(comm):
        buf = inputs[comm.rank].clone()
        comm.counters.reset()
        dqcoll.allreduce(buf, scheme=s.scheme, algorithm=s.algorithm, op=s.op, seed=s.seed,
                         step=step)
        return buf, dict(comm.counters), dict(comm.last_info)

    return dqcoll.testing.run_local(s.world_size, fn)


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _exact(s: Setup, inputs: list[torch.Tensor]) -> torch.Tensor:
    total = sum((x.double() for x in inputs), torch.zeros(s.numel, dtype=torch.float64))
    return total / s.world_size if s.op == "avg" else total


_SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@_SETTINGS
@given(s=setups())
def test_ranks_bit_identical_and_nothing_lost(s: Setup) -> None:
    """Invariants 1 and 4: every rank holds the same bytes, shape and dtype; finite inputs give
    finite outputs; the result equals the exact sum (none) or is within the scheme's budget."""
    inputs = _inputs(s)
    results = _run(s, inputs)
    first = results[0][0]
    for out, _, _ in results:
        assert out.shape == (s.numel,) and out.dtype == s.dtype
        assert _bytes(out) == _bytes(first)
    assert torch.isfinite(first.float()).all()
    exact = _exact(s, inputs)
    error = metrics.vnmse(first, exact)
    if s.world_size == 1:  # one rank: sum and average are the input itself
        assert torch.equal(first, inputs[0])
    if s.scheme == "none":
        eps = torch.finfo(s.dtype).eps
        assert error <= 16 * s.world_size * eps * eps + 1e-12
    elif s.numel >= 1024:
        budget = VNMSE_BUDGET.get(s.scheme, 1.0)
        widths = results[0][2].get("widths", {})
        if s.scheme == "dynamiq" and widths.get(2, 0):
            # The budget forced some super-groups down to 2 bits (e.g. 1026 = 4 x 256 + 2: the
            # 2-element tail costs a whole record): noisy but unbiased, measured up to 2.6 at n=5.
            budget = 3.0
        assert error < budget, (error, widths)


@_SETTINGS
@given(s=setups())
def test_same_seed_same_answer(s: Setup) -> None:
    """Invariant 3: the same inputs, seed and step give the same bytes on every rank, run after
    run."""
    inputs = _inputs(s)
    first = _run(s, inputs, step=5)
    second = _run(s, inputs, step=5)
    for (a, _, _), (b, _, _) in zip(first, second, strict=True):
        assert _bytes(a) == _bytes(b)


def _declared_bits(scheme: str) -> float | None:
    spec = schemes.spec(scheme)
    if spec.bits_per_coord is not None:
        return spec.bits_per_coord
    if "bits" in spec.options:
        return 5.0  # allreduce's default budget
    return None


@_SETTINGS
@given(s=setups())
def test_byte_budget_is_honest(s: Setup) -> None:
    """Invariant 2: what goes on the wire is what the bits promise. ``none`` sends what it
    reports (at least 2(n-1) copies of the buffer in its dtype, partial sums as fp64);
    ``dynamiq`` sends 2(n-1) copies of its records
    (widths from the allocation), which with the statistics fit ``bits`` unless the buffer is too
    small for the cheapest allocation; fixed-rate schemes stay within their declared bits plus
    block padding."""
    assume(s.world_size > 1 and s.numel > 0)
    inputs = _inputs(s)
    results = _run(s, inputs)
    n = s.world_size
    payload = sum(c["payload_bytes_sent"] for _, c, _ in results)
    if s.scheme == "none":  # the input dtype, but fp64 for partial sums of 2..n-1 ranks
        assert payload == results[0][2]["wire_payload_nbytes"]
        assert 2 * (n - 1) * s.numel * s.dtype.itemsize <= payload
        assert payload <= (n - 1) * s.numel * (s.dtype.itemsize + 8)
        return
    if s.scheme == "dynamiq":
        info = results[0][2]
        rows = -(-s.numel // SUPER)
        stats_nbytes = STATS_BYTES_PER_SUPER * rows
        if info["wire_payload_nbytes"] is not None:  # hop widths: counted by the scheme
            assert payload == info["wire_payload_nbytes"]
            records = payload / (2 * (n - 1))
        else:
            records = sum(count * record_nbytes(w, Scales.HIERARCHICAL4X32)
                          for w, count in info["widths"].items() if w)
            assert payload == 2 * (n - 1) * records
        assert info["bits"] == pytest.approx(8 * (records + stats_nbytes) / s.numel)
        if not info["over_budget"]:
            assert info["bits"] <= 5.0
        return
    bits = _declared_bits(s.scheme)
    if bits is None or s.scheme in WIDENING:
        return
    handshake = n * ring_allreduce_nbytes((2 * _HANDSHAKE_FIELDS + n) * 8, n)
    total = sum(c["bytes_sent"] for _, c, _ in results) - handshake
    effective_bits = 8 * total / (2 * (n - 1) * s.numel)
    padding_bits = 8 * (n + 1) * 64 / s.numel  # at most one padded 64-byte block per chunk
    assert effective_bits <= bits + padding_bits, (effective_bits, bits)
