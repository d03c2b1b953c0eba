"""The counter-based normals of the lognormal-mixture source (dqcoll.kernels.noise_numba): a
standard normal distribution, any slice of any rank made on its own with the same bytes, the
NumPy fallback the kernel's values; and the simulator's NumPy/numba helpers are the references'
bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dqcoll.kernels import codec, noise_numba
from dqcoll.kernels.simulate_numba import RankTables, decode_raw, encode_ranked, encode_raw
from dqcoll.schemes.dynamiq.allocation import count_classes
from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.sources import make_source


def _normals(count: int, key: int = 7) -> np.ndarray:
    rows = count // 256
    out = np.empty((rows, 256), np.float32)
    noise_numba.fill(np.full(rows, key, np.uint64) ^ np.arange(rows, dtype=np.uint64),
                     np.arange(rows, dtype=np.int64) * 256, rows * 256, np.ones(rows), out)
    return out.astype(np.float64).reshape(-1)


def test_normals_are_standard_normal() -> None:
    """Moments, tails and the Kolmogorov-Smirnov distance of 2**20 values (the ziggurat's layers
    and its tail included: P(|z| > 4) is 6.3e-5)."""
    z = _normals(1 << 20)
    m = z.size
    assert abs(z.mean()) < 5 / math.sqrt(m)
    assert z.var() == pytest.approx(1.0, abs=5 * math.sqrt(2 / m))
    assert (z**4).mean() == pytest.approx(3.0, abs=5 * math.sqrt(96 / m))
    for t in (1.0, 2.0, 3.0, 4.0):
        p = math.erfc(t / math.sqrt(2))
        assert (np.abs(z) > t).mean() == pytest.approx(p, abs=5 * math.sqrt(p / m) + 1e-6)
    s = np.sort(z)[::64]
    cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2)) for v in s])
    ks = np.abs(cdf - (np.arange(s.size) * 64 + 0.5) / m).max()
    assert ks < 1.63 / math.sqrt(s.size)  # 1 % level


def test_slices_and_fallback() -> None:
    """A slice starting anywhere is the same bytes as the whole row; past numel is zero; the
    NumPy fallback gives the kernel's values."""
    keys = np.array([3, 3, 9], np.uint64)
    whole = np.empty((1, 1000), np.float32)
    noise_numba.fill(keys[:1], np.zeros(1, np.int64), 900, np.linspace(1, 2, 4), whole)
    part = np.empty((3, 77), np.float32)
    noise_numba.fill(keys, np.array([5, 850, 0]), 900, np.linspace(1, 2, 4), part)
    assert np.array_equal(part[0], whole[0, 5:82])
    assert np.array_equal(part[1, :50], whole[0, 850:900]) and not part[1, 50:].any()
    assert not whole[0, 900:].any()
    assert not np.array_equal(part[2], whole[0, :77])
    slow = np.empty((3, 77), np.float32)
    noise_numba.fill_numpy(keys, np.array([5, 850, 0]), 900, np.linspace(1, 2, 4), slow)
    assert np.array_equal(slow, part)


@pytest.mark.parametrize("numel", [None, 5000])
def test_source_rows_are_its_tensors(numel) -> None:
    """lognormal-mixture's fill_rows gives slices of rank_tensor, for any ranks and starts."""
    src = make_source("lognormal-mixture:supergroups=30", world_size=5, numel=numel, seed=2)
    assert src.row_access
    ranks = np.array([4, 0, 2, 2])
    starts = np.array([0, 300, 4990, 7000])
    out = np.empty((4, 256), np.float32)
    src.fill_rows(ranks, starts, out)
    for i, (r, a) in enumerate(zip(ranks, starts, strict=True)):
        x = src.rank_tensor(int(r)).numpy()
        want = np.zeros(256, np.float32)
        piece = x[a : a + 256]
        want[: piece.size] = piece
        assert np.array_equal(out[i], want)
    legacy = make_source("lognormal-mixture:supergroups=30;noise=torch", world_size=5,
                         numel=numel, seed=2)
    assert not legacy.row_access
    assert legacy.rank_tensor(1).shape == src.rank_tensor(1).shape
    assert not torch.equal(legacy.rank_tensor(1), src.rank_tensor(1))


def test_count_classes_is_the_loop() -> None:
    """The vectorised count_classes gives the plain loop's classes, floats and order."""

    def loop(subtree):  # the implementation it replaced
        n = len(subtree)
        chunks = len(subtree[0]) if n else 0
        sends: dict[int, float] = {}
        for c in range(chunks):
            for r in range(n):
                size = subtree[r][c]
                if size < n:
                    sends[size] = sends.get(size, 0.0) + 1.0 / chunks
        total = 2.0 * (n - 1)
        classes = {size: (m * size, m / total) for size, m in sends.items()}
        classes[n] = (float(n), (n - 1) / total)
        return classes

    for algorithm in ("ring", "butterfly", "direct"):
        for n in (2, 3, 7, 12, 33):
            subtree = build_schedule(algorithm, n).subtree_sizes()
            assert list(count_classes(subtree).items()) == list(loop(subtree).items())
            assert list(count_classes(np.asarray(subtree)).items()) == list(
                loop(subtree).items())


def test_ranked_and_raw_codecs_are_the_reference() -> None:
    """encode_ranked (rows of many ranks in one launch) and the NumPy raw-16 codec give the torch
    reference's bytes and values (NaN, Inf, zero and denormal rows included)."""
    n, key = 11, 12345
    x = (torch.randn(40, 256) * torch.logspace(-42, 30, 40)[:, None]).float()
    x[3, 5], x[4, 7], x[5] = float("nan"), float("inf"), 0.0
    ranks = np.arange(40) % n
    base = np.arange(40, dtype=np.int64) * 256 + (1 << 32) - 4096  # crosses 2**32
    for config, widths in ((codec.FORMAT3, range(2, 9)), (codec.CodecConfig(), (2, 4, 8))):
        tables = RankTables.build(key, n, config)
        for width in widths:
            size = codec.record_nbytes(width, config.scales)
            out = np.zeros((40, size), np.uint8)
            encode_ranked(x.numpy(), width, base, ranks, tables, config, out)
            for r in range(n):
                pick = np.flatnonzero(ranks == r)
                ref = codec.encode_torch(x[pick].contiguous(), width,
                                         torch.from_numpy(base[pick]), r, n, key, config)
                assert np.array_equal(out[pick], ref.numpy()), (config, width, r)
    records = encode_raw(x.numpy())
    assert np.array_equal(records, codec._encode_raw(x).numpy())
    acc = np.ones((40, 256), np.float32)
    decode_raw(records, acc, True)
    want = 1 + codec._decode_raw(torch.from_numpy(records))
    assert np.array_equal(acc.view(np.uint32), want.numpy().view(np.uint32))
