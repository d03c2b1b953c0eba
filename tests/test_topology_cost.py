"""The cost model on hand-computed cases: latency + bytes / bandwidth per step, shared NICs
counted once, kernel time on shared devices, tiles overlapping, measured rates overriding."""

from __future__ import annotations

import json

import pytest

from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.cost import (
    CostParams,
    KernelRates,
    SchemeCost,
    load_kernel_rates,
    price_allreduce,
    price_hierarchical,
    price_schedule,
    scheme_cost,
)
from dqcoll.topology.graph import Topology
from dqcoll.topology.hierarchical import LevelSpec, build_hierarchical_plan

NO_KERNEL = KernelRates(0.0, 0.0, 0.0)
QUIET = CostParams(message_us=0.0, handshake=False)


def fp32(rates: KernelRates = NO_KERNEL) -> SchemeCost:
    return SchemeCost("none", 4.0, False, rates)


def test_two_ranks_direct_by_hand():
    """2 ranks, 1 Gb/s (125 B/us) links, 10 us: each step moves one 500-coordinate fp32 chunk
    (2000 B, 16 us) each way, so 2 x (10 + 16) = 52 us."""
    t = Topology.flat(2, bandwidth_gbps=1.0, latency_us=10.0)
    cost = price_schedule(build_schedule("direct", 2), t, 1000, fp32(), params=QUIET)
    assert cost.total_us == pytest.approx(52.0)
    assert [s.wire_us for s in cost.steps] == pytest.approx([16.0, 16.0])
    assert cost.steps[0].max_link_bytes == pytest.approx(2000.0)


def test_ring_by_hand():
    """4 ranks on 8 Gb/s (1000 B/us), 5 us: a ring has 6 steps of one 1000-coordinate chunk
    (4000 B): 6 x (5 + 4) = 54 us."""
    t = Topology.flat(4, bandwidth_gbps=8.0, latency_us=5.0)
    cost = price_schedule(build_schedule("ring", 4), t, 4000, fp32(), params=QUIET)
    assert len(cost.steps) == 6
    assert cost.total_us == pytest.approx(54.0)


def test_shared_nic_counted_once():
    """Both GPUs of a host send through its one NIC: in a direct all-reduce on 2 hosts x 2 GPUs
    (chunks of 1000 fp32 = 4000 B), host 0's NIC carries 4 messages (ranks 0,1 -> 2,3) = 16000 B
    at 1000 B/us = 16 us, while with a NIC per GPU the busiest NIC carries 3 messages = 12 us."""
    shared = Topology.cluster(2, 2, inter_gbps=8.0, inter_latency_us=0.0, intra_gbps=8e6,
                              intra_latency_us=0.0)
    own = Topology.flat(4, bandwidth_gbps=8.0, latency_us=0.0)
    numel = 4000
    a = price_schedule(build_schedule("direct", 4), shared, numel, fp32(), params=QUIET)
    b = price_schedule(build_schedule("direct", 4), own, numel, fp32(), params=QUIET)
    assert a.steps[0].wire_us == pytest.approx(16.0)
    assert a.steps[0].max_link_bytes == pytest.approx(16000.0)
    assert a.steps[0].bottleneck in ("nic0 tx", "nic0 rx", "nic1 tx", "nic1 rx")
    assert b.steps[0].wire_us == pytest.approx(12.0)


def test_hierarchical_prices_levels_separately():
    """A 2x2 plan with fp32 inside hosts and 4-bit dynamiq across: intra steps move fp32 over
    NVLink, inter steps move (4 - 0.0625)/8 B per coordinate over the NIC."""
    t = Topology.cluster(2, 2, inter_gbps=8.0, inter_latency_us=0.0, intra_gbps=80.0,
                         intra_latency_us=0.0)
    plan = build_hierarchical_plan(t, intra=LevelSpec("none", algorithm="direct"),
                                   inter=LevelSpec("dynamiq", 4.0, "direct"))
    numel = 8000
    cost = price_hierarchical(plan, t, numel * 4, params=QUIET)
    levels = [lv.value for lv in plan.step_levels()]
    assert levels == ["intra", "inter", "inter", "intra"]
    # intra reduce: each rank sends its partner 2 chunks (the partner's shard) of 2000 coords in
    # fp32 = 16000 B over a 10000 B/us port; inter: 1 chunk of 2000 coords at 3.9375/8 B =
    # 984.375 B per GPU, two GPUs share the 1000 B/us NIC.
    assert cost.steps[0].wire_us == pytest.approx(1.6)
    assert cost.steps[1].wire_us == pytest.approx(2 * 984.375 / 1000)


def test_kernel_time_and_shared_device():
    """Kernel time per step: a direct all-reduce's sink decompresses n-1 payloads and
    re-compresses once; ranks on one device (CPU) add up, ranks on their own devices do not."""
    rates = KernelRates(compress_ns=10.0, decompress_ns=1.0)
    cost = SchemeCost("x", 1.0, False, rates)
    own = Topology.flat(4, bandwidth_gbps=1e9, latency_us=0.0)
    shared = Topology.flat(4, bandwidth_gbps=1e9, latency_us=0.0, shared_device=True)
    numel = 4000  # chunk = 1000 coords
    a = price_schedule(build_schedule("direct", 4), own, numel, cost, params=QUIET)
    # reduce step, per rank: 3 leaf compresses (30 us) + 2 accumulate + FINAL (2 + 10 + 1 us)
    # -> 30 + 2 + 12 = 44 us? leaf: 3 x 1000 x 10 ns = 30 us; receive: 2 x 1 us + (2 x 1 + 10) us.
    assert a.steps[0].kernel_us == pytest.approx(30.0 + 2.0 + 12.0)
    assert a.steps[1].kernel_us == pytest.approx(3.0)  # gather: 3 decompresses of 1000
    b = price_schedule(build_schedule("direct", 4), shared, numel, cost, params=QUIET)
    assert b.steps[0].kernel_us == pytest.approx(4 * 44.0)


def test_tiles_overlap_by_formula():
    """With T tiles: sum_s (A + (W + K)/T) + (T - 1) max(sum (A + W/T), sum K/T)."""
    rates = KernelRates(compress_ns=2.0, decompress_ns=2.0)
    t = Topology.flat(2, bandwidth_gbps=8.0, latency_us=1.0)  # 1000 B/us
    cost = SchemeCost("x", 4.0, False, rates)
    one = price_schedule(build_schedule("direct", 2), t, 2000, cost, params=QUIET)
    # per step: A = 1, W = 1000 coords x 4 B / 1000 = 4 us; K: step 0 = leaf 2 + FINAL 6 = 8,
    # step 1 = 2 us.
    assert [s.kernel_us for s in one.steps] == pytest.approx([8.0, 2.0])
    assert one.total_us == pytest.approx(2 * (1 + 4) + 10.0)
    four = price_schedule(build_schedule("direct", 2), t, 2000, cost, tiles=4, params=QUIET)
    first = 2 * 1 + (8 + 10) / 4
    period = max(2 * 1 + 8 / 4, 10 / 4)
    assert four.total_us == pytest.approx(first + 3 * period)
    assert four.tiles == 4


def test_message_overhead_and_latency():
    """A direct step where each rank posts n-1 messages pays (n-2) extra message costs."""
    t = Topology.flat(5, bandwidth_gbps=1e9, latency_us=7.0)
    params = CostParams(message_us=3.0, handshake=False)
    cost = price_schedule(build_schedule("direct", 5), t, 5, fp32(), params=params)
    assert cost.steps[0].latency_us == pytest.approx(7.0 + 3 * 3.0)


def test_dynamiq_wire_bytes_and_prologue():
    """dynamiq at b bits puts (b - 0.0625)/8 bytes per coordinate on the wire (the 2 B of
    statistics per 256 are separate) and adds a statistics all-reduce; tiny messages are faster
    uncompressed."""
    c = scheme_cost("dynamiq", 5.0, "float32", "h100")
    assert c.wire_bytes_per_coord == pytest.approx(4.9375 / 8) and c.has_stats
    assert scheme_cost("none", None, "bfloat16", "h100").wire_bytes_per_coord == 2.0
    t = Topology.cluster(2, 4, inter_gbps=100)
    tiny_none = price_allreduce("ring", t, 4096, scheme="none")
    tiny_dq = price_allreduce("ring", t, 4096, scheme="dynamiq", bits=5)
    assert tiny_dq.prologue_us > tiny_none.prologue_us
    assert tiny_none.total_us < tiny_dq.total_us
    big_none = price_allreduce("ring", t, 1 << 28, scheme="none")
    big_dq = price_allreduce("ring", t, 1 << 28, scheme="dynamiq", bits=5)
    assert big_dq.total_us < big_none.total_us / 3


def test_load_kernel_rates(tmp_path):
    """Rates are read from both record shapes; the largest numel wins for kernel records."""
    (tmp_path / "a.json").write_text(json.dumps([
        {"device": "cpu", "scheme": "none", "compress_ns": 0.5, "decompress_ns": 0.7}]))
    (tmp_path / "kernels-h200.json").write_text(json.dumps({"device": "NVIDIA H200", "records": [
        {"kernel": "encode", "bits": 4, "numel": 1 << 20, "gbps": 100.0},
        {"kernel": "encode", "bits": 4, "numel": 1 << 26, "gbps": 2300.0},
        {"kernel": "decode_accumulate", "bits": 4, "numel": 1 << 26, "gbps": 1720.0},
        {"something": "else"}]}))
    rates = load_kernel_rates(sorted(str(p) for p in tmp_path.iterdir()))
    assert rates[("cpu", "none")].compress_ns == 0.5
    h200 = rates[("h200", "dynamiq")]
    assert h200.compress_ns == pytest.approx(4.6 / 2300.0)
    assert h200.decompress_ns == pytest.approx(8.6 / 1720.0)
    params = CostParams(kernel_rates=tuple(rates.items()))
    assert params.rates("cpu", "none").decompress_ns == 0.7
