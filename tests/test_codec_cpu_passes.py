"""The compiled CPU passes that the codec profile (tools/codec_cpu_profile.py) made cheaper give
the reference's results bit for bit: the per-class hull widths and the division by a
power-of-two world size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dqcoll.kernels import numba_available
from dqcoll.kernels.codec import stats_center_torch

pytestmark = pytest.mark.skipif(numba_available() is not None, reason="needs numba")


def test_hull_widths_equal_the_reference_rule() -> None:
    """``allocation_numba._hull_widths`` (one select pass per threshold) gives every class the
    widths of the reference ``allocation._hull_rule``, with zero and NaN rows, keys exactly on
    a threshold and equal thresholds."""
    from dqcoll.kernels.allocation_numba import _hull_widths
    from dqcoll.schemes.dynamiq.allocation import _hull_rule

    rng = np.random.default_rng(7)
    for trial in range(60):
        rows = int(rng.integers(1, 2000))
        log_f = rng.normal(0.0, 20.0, rows)
        if trial % 3 == 0:
            log_f = np.round(log_f)  # keys on the (integer) thresholds below
        zero = rng.random(rows) < 0.2
        nan = rng.random(rows) < 0.05
        log_f[nan] = np.nan
        k = int(rng.integers(2, 8))
        hull = np.sort(rng.choice(np.arange(2, 17), k, replace=False)).astype(np.int64)
        offsets = np.concatenate([[-np.inf], np.sort(np.round(rng.normal(0.0, 10.0, k - 1)))])
        if k > 2:
            offsets[2] = offsets[1]
        shifts = np.array([0.0, 1.0, float(np.log2(3.0)), -2.5])
        u = float(np.round(rng.normal(0.0, 10.0)))
        widths = np.empty((shifts.shape[0], rows), np.int64)
        _hull_widths(log_f, zero, nan, shifts, u, offsets, hull, 16, widths)
        for c, shift in enumerate(shifts):
            want = _hull_rule(torch.from_numpy(log_f), torch.from_numpy(zero),
                              torch.from_numpy(nan), hull.tolist(), offsets.tolist(), 16, u,
                              float(shift))
            assert np.array_equal(widths[c], want.numpy()), (trial, c)


@pytest.mark.parametrize("divisor", [2, 3, 4, 8, 1024])
def test_divided_rows_equal_the_reference(divisor: int) -> None:
    """``stats`` and ``center_gather`` of ``x / divisor`` (a multiply by ``2**-k`` where the
    divisor is a power of two) equal the torch reference on ``x / divisor``, subnormal
    quotients, signed zeros, infinities and a short last row included."""
    from dqcoll.kernels import dynamiq_numba

    rng = np.random.default_rng(divisor)
    values = rng.normal(0.0, 1.0, (6, 256)).astype(np.float32)
    values[1] *= np.float32(2.0**-126)  # quotients below the smallest normal
    values[2, :7] = [0.0, -0.0, np.inf, -np.inf, 2.0**-149, -(2.0**-149), 3.0 * 2.0**-149]
    values[3] *= np.float32(2.0**100)
    x = torch.from_numpy(values)
    valid = torch.tensor([256, 256, 256, 256, 256, 100])
    centred, mean, norm2 = stats_center_torch(x / divisor, valid)
    got_mean, got_norm2 = dynamiq_numba.stats(x, valid, divisor=divisor)
    assert torch.equal(got_mean.view(torch.int32), mean.view(torch.int32))
    assert torch.equal(got_norm2.view(torch.int32), norm2.view(torch.int32))
    order = torch.tensor([5, 0, 3, 1, 4, 2])
    gathered = dynamiq_numba.center_gather(x, got_mean, valid, order, divisor=divisor)
    assert torch.equal(gathered.view(torch.int32), centred[order].view(torch.int32))
