"""Tiles, pipelining and ``async_op``: the executor's tiled path gives the untiled result bit for
bit, really overlaps codec work with transfers, and the asynchronous API orders with the
synchronous one. Over the ``local`` transport (threads) and over gloo (processes)."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch
from conftest import run_gloo_script

import dqcoll
from dqcoll import schemes
from dqcoll.errors import MismatchError, PeerError
from dqcoll.executor import DEFAULT_TILE_NBYTES, default_tile_nbytes, plan_tiles
from dqcoll.schemes.base import SchemeSpec
from dqcoll.schemes.elementwise import BlockCodec
from dqcoll.testing import run_local
from dqcoll.types import Collective

ALGORITHMS = ("ring", "butterfly", "direct")


def _data(rank: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(77 + rank)
    rows = -(-numel // 256)
    scale = torch.exp(torch.randn(rows, generator=torch.Generator().manual_seed(5)) * 2)
    return (torch.randn(rows, 256, generator=g) * scale[:, None]).reshape(-1)[:numel].contiguous()


def _collective(comm: Any, collective: Collective, scheme: str, algorithm: str, numel: int,
                kwargs: dict[str, Any]) -> torch.Tensor:
    n, rank = comm.world_size, comm.rank
    x = _data(rank, numel)
    common = dict(scheme=scheme, algorithm=algorithm, seed=11, step=4, **kwargs)
    if collective is Collective.ALLREDUCE:
        dqcoll.allreduce(x, **common)
        out = x
    elif collective is Collective.REDUCE_SCATTER:
        out = torch.empty(numel // n)
        dqcoll.reduce_scatter(x, out, **common)
    else:
        out = torch.empty(n * numel)
        dqcoll.all_gather(x, out, **common)
    return torch.cat([out, torch.tensor([float(comm.last_info.get("tiles", 0))])])


@pytest.mark.parametrize("collective", list(Collective), ids=lambda c: c.value)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("scheme", schemes.list_schemes())
def test_tiles_give_the_untiled_result_bit_for_bit(scheme: str, algorithm: str,
                                                   collective: Collective) -> None:
    """For every registered scheme, algorithm and collective, cutting the chunks into 2 KiB tiles
    (several per chunk, two in flight) changes no bit of any rank's result: statistics,
    allocation and random numbers belong to the whole call and are keyed by global index."""
    if collective is not Collective.ALLREDUCE and not schemes.spec(scheme).supports_reduce_scatter:
        pytest.skip(f"{scheme} declares supports_reduce_scatter=False")
    n, numel = 3, 3 * 1536
    # topk_block keeps half of the blocks so that its chunks (the kept blocks) span several tiles
    options: dict[str, Any] = {"density": 0.5} if scheme == "topk_block" else {}
    untiled = run_local(n, _collective, collective, scheme, algorithm, numel,
                        {"tile_nbytes": 0, **options})
    tiled = run_local(n, _collective, collective, scheme, algorithm, numel,
                      {"tile_nbytes": 2048, **options})
    for rank in range(n):
        assert untiled[rank][-1].item() == 1
        assert tiled[rank][-1].item() > 1, "the tiled run did not cut the chunks"
        assert torch.equal(untiled[rank][:-1], tiled[rank][:-1]), (scheme, algorithm, rank)


@pytest.mark.parametrize("tiles_in_flight", [1, 3])
def test_any_number_of_tiles_in_flight_gives_the_same_bits(tiles_in_flight: int) -> None:
    """One tile at a time (inline exchanges) and three in flight give the untiled dynamiq
    all-reduce bit for bit, over 5 ranks (a non-power of two) and an odd length."""
    n, numel = 5, 3_001
    untiled = run_local(n, _collective, Collective.ALLREDUCE, "dynamiq", "butterfly", numel,
                        {"tile_nbytes": 0})
    tiled = run_local(n, _collective, Collective.ALLREDUCE, "dynamiq", "butterfly", numel,
                      {"tile_nbytes": 1024, "tiles_in_flight": tiles_in_flight})
    for a, b in zip(untiled, tiled, strict=True):
        assert b[-1].item() > 1
        assert torch.equal(a[:-1], b[:-1])


def test_tile_plan_refines_chunks_in_whole_units() -> None:
    """plan_tiles cuts every chunk into the same number of tiles, each boundary a whole number of
    ``tile_unit`` from its chunk's start, the refined bounds keep every chunk boundary, and the
    tile count is ceil(largest chunk's fp32 bytes / tile_nbytes); no tile_nbytes means untiled."""

    def body(comm: Any) -> tuple[Any, ...]:
        from dqcoll.context import call_context
        from dqcoll.types import ReduceOp

        ctx = call_context(comm.transport, ReduceOp.SUM, 0, 0, Collective.ALLREDUCE, "t")
        results = []
        for name in ("dynamiq", "mxfp8", "none"):
            call = schemes.get(name).begin(_data(comm.rank, 50_000), ctx)
            results.append((name, call, plan_tiles(call, 8192), plan_tiles(call, None)))
        return tuple(results)

    for name, call, plan, untiled in run_local(3, body)[0]:
        assert untiled is None
        assert plan is not None
        bounds, unit = list(call.chunk_bounds), call.tile_unit
        rows = call.work.shape[0]
        unit_nbytes = call.work.numel() // rows * call.work.element_size()
        longest = max(b - a for a, b in itertools.pairwise(bounds))
        assert plan.tiles == -(-longest * unit_nbytes // 8192), name
        assert len(plan.bounds) == 3 * plan.tiles + 1
        for c in range(3):
            tiles = plan.bounds[c * plan.tiles : (c + 1) * plan.tiles + 1]
            assert tiles[0] == bounds[c] and tiles[-1] == bounds[c + 1]
            assert all((t - bounds[c]) % unit == 0 for t in tiles[:-1]), name
            assert list(tiles) == sorted(tiles)


# -- overlap: a codec and a link that take known time ---------------------------------------------

_CODEC_S = 0.02
_LINK_S = 0.02


class _TimedCodec(BlockCodec):
    """A pass-through codec that sleeps in encode/decode and records when, per rank."""

    spec = SchemeSpec(name="timed", description="test codec", bits_per_coord=32, unbiased=True,
                      exact_sums=True)
    block = 256

    def __init__(self, log: dict[int, list[tuple[float, float]]]) -> None:
        self.log = log

    def __repr__(self) -> str:
        return "TimedCodec()"

    def prepare(self, work: torch.Tensor, ctx: Any) -> Any:
        return ctx.rank

    def chunk_nbytes(self, numel: int, count: int, state: Any) -> int:
        return 4 * numel

    def _sleep(self, rank: int) -> None:
        start = time.monotonic()
        time.sleep(_CODEC_S)
        self.log.setdefault(rank, []).append((start, time.monotonic()))

    def encode_values(self, values: torch.Tensor, count: int, ctx: Any) -> torch.Tensor:
        self._sleep(ctx)
        return values.clone().view(torch.uint8)

    def decode_values(self, payload: torch.Tensor, numel: int, count: int,
                      ctx: Any) -> torch.Tensor:
        self._sleep(ctx)
        return payload.clone().view(torch.float32)


def _overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def test_pipelined_tiles_overlap_codec_with_transfers() -> None:
    """With a codec and a link that each take 20 ms per call, the untiled executor never runs
    them at the same time on a rank, while with 4 tiles and two in flight more than a third of
    the link time is covered by codec work - the overlap the pipelining exists for."""

    def body(comm: Any, tile_nbytes: int, codec_log: dict[int, Any],
             link_log: dict[int, Any]) -> None:
        original = comm.transport.exchange

        def slow_exchange(sends: Any, recvs: Any, *, what: str) -> None:
            start = time.monotonic()
            time.sleep(_LINK_S)  # the wire: releases the GIL like a real transfer
            original(sends, recvs, what=what)
            link_log.setdefault(comm.rank, []).append((start, time.monotonic()))

        comm.transport.exchange = slow_exchange
        x = torch.ones(2 * 4 * 256)  # 2 chunks of 4 blocks: 4 tiles of 1 KiB
        dqcoll.allreduce(x, scheme=_TimedCodec(codec_log), algorithm="direct",
                         tile_nbytes=tile_nbytes)
        assert torch.equal(x, torch.full_like(x, 2.0))

    overlap = {}
    for tile_nbytes in (0, 1024):
        codec_log: dict[int, list[tuple[float, float]]] = {}
        link_log: dict[int, list[tuple[float, float]]] = {}
        run_local(2, body, tile_nbytes, codec_log, link_log)
        overlap[tile_nbytes] = [
            (_overlap_s(codec_log[r], link_log[r]), sum(e - s for s, e in link_log[r]))
            for r in range(2)
        ]
    for rank in range(2):
        assert overlap[0][rank][0] == 0.0
        covered, link_total = overlap[1024][rank]
        assert covered > link_total / 3, (rank, covered, link_total)


# -- async_op ------------------------------------------------------------------------------------


def test_async_op_returns_handles_that_match_sync_calls() -> None:
    """async_op=True returns a handle at once; wait() gives back the buffer with exactly the
    synchronous result (same seed and step), is_completed() is then True, and a synchronous call
    issued while asynchronous ones are pending runs after them (same results, no mixed-up
    messages), for all three collectives (a named algorithm: a planned call may run another
    plan than an earlier one of the same size)."""

    def body(comm: Any) -> list[torch.Tensor]:
        n, rank = comm.world_size, comm.rank
        a, b, c = _data(rank, 6000), _data(rank + 10, 6000), _data(rank + 20, 3000)
        rs_out, ag_out = torch.empty(6000 // n), torch.empty(n * 3000)
        h1 = dqcoll.allreduce(a, async_op=True, seed=1, step=1, tile_nbytes=1024,
                              algorithm="ring")
        h2 = dqcoll.reduce_scatter(b, rs_out, async_op=True, seed=1, step=2, algorithm="ring")
        sync = _data(rank + 30, 6000)
        # waits for h1, h2 first
        dqcoll.allreduce(sync, seed=1, step=3, scheme="none", algorithm="ring")
        h3 = dqcoll.all_gather(c, ag_out, async_op=True, seed=1, step=4, algorithm="ring")
        assert h3.wait() is ag_out and h1.wait() is a and h2.wait() is rs_out
        assert h1.is_completed() and h2.is_completed() and h3.is_completed()
        # the same calls, synchronously
        a2, b2, c2 = _data(rank, 6000), _data(rank + 10, 6000), _data(rank + 20, 3000)
        rs2, ag2 = torch.empty(6000 // n), torch.empty(n * 3000)
        dqcoll.allreduce(a2, seed=1, step=1, tile_nbytes=0, algorithm="ring")
        dqcoll.reduce_scatter(b2, rs2, seed=1, step=2, algorithm="ring")
        sync2 = _data(rank + 30, 6000)
        dqcoll.allreduce(sync2, seed=1, step=3, scheme="none", algorithm="ring")
        dqcoll.all_gather(c2, ag2, seed=1, step=4, algorithm="ring")
        return [a - a2, rs_out - rs2, ag_out - ag2, sync - sync2,
                torch.tensor([float(torch.equal(a, a2) and torch.equal(rs_out, rs2)
                                    and torch.equal(ag_out, ag2) and torch.equal(sync, sync2))])]

    for result in run_local(3, body):
        assert result[-1].item() == 1.0


def test_async_errors_surface_at_wait_on_every_rank() -> None:
    """An asynchronous call with a mismatched length on one rank raises at wait() on every rank
    (MismatchError), and the communicator stays usable afterwards."""

    def body(comm: Any) -> tuple[str, bool]:
        x = torch.ones(1000 + (comm.rank == 1))
        handle = dqcoll.allreduce(x, async_op=True)
        try:
            handle.wait()
            kind = "none"
        except MismatchError as exc:
            kind = "numel" if "numel" in str(exc) else str(exc)
        y = torch.ones(512)
        dqcoll.allreduce(y, scheme="none")
        return kind, bool(torch.equal(y, torch.full_like(y, comm.world_size)))

    assert run_local(3, body) == [("numel", True)] * 3


def test_ranks_with_different_tile_settings_all_raise() -> None:
    """Tiling changes the message sequence, so ranks must agree on it: one rank with another
    tile_nbytes (or tiles_in_flight) makes every rank raise a MismatchError naming the field
    before any payload moves."""

    def body(comm: Any, field: str) -> tuple[str, int]:
        kwargs: dict[str, Any] = {"tile_nbytes": 4096, "tiles_in_flight": 2}
        if comm.rank == 2:
            kwargs[field] = 2 * kwargs[field]
        x = _data(comm.rank, 20_000)
        try:
            dqcoll.allreduce(x, **kwargs)
        except (MismatchError, PeerError) as exc:
            return str(exc), comm.counters["payload_bytes_sent"]
        return "no error", comm.counters["payload_bytes_sent"]

    for field in ("tile_nbytes", "tiles_in_flight"):
        for message, sent in run_local(3, body, field):
            assert field in message and sent == 0, message


def test_default_tile_size_is_documented_and_used() -> None:
    """The API's default tile size is the executor's DEFAULT_TILE_NBYTES: a buffer whose chunks
    are 3x that size runs as 3 tiles, and comm.last_info says so."""

    def body(comm: Any) -> int:
        x = torch.ones(2 * 3 * DEFAULT_TILE_NBYTES // 4)
        dqcoll.allreduce(x, scheme="none", algorithm="ring")
        assert torch.equal(x, torch.full_like(x, 2.0))
        return int(comm.last_info["tiles"])

    assert run_local(2, body) == [3, 3]


# -- gloo processes ------------------------------------------------------------------------------

_GLOO_WORKER = r"""
import json, sys, torch, dqcoll
from dqcoll.testing import run_local
comm = dqcoll.init(backend="gloo")
rank, n = comm.rank, comm.world_size

def data(r, numel=6000):
    return torch.randn(numel, generator=torch.Generator().manual_seed(300 + r))

report = {}
for scheme, algorithm in (("dynamiq", "butterfly"), ("none", "ring")):
    key = f"{scheme}_{algorithm}"
    runs = {}
    for label, kwargs in (("untiled", {"tile_nbytes": 0}),
                          ("tiled3", {"tile_nbytes": 2048, "tiles_in_flight": 3})):
        x = data(rank)
        dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, seed=5, step=9, **kwargs)
        runs[label] = x
        report[f"tiles_{label}_{key}"] = comm.last_info["tiles"]
    x = data(rank)
    handle = dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, seed=5, step=9,
                              tile_nbytes=2048, async_op=True)
    handle.wait()
    runs["tiled"] = x
    for label in ("tiled3", "tiled"):
        report[f"same_{label}_{key}"] = bool(torch.equal(runs["untiled"], runs[label]))
    digest = torch.tensor([float(runs["tiled"].double().sum())], dtype=torch.float64)
    low, high = digest.clone(), digest.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX)
    report[f"ranks_agree_{key}"] = bool(low.item() == high.item())
    if scheme == "none" or n == 2:  # 2 ranks: fp32 sums of the statistics are order-free
        local = run_local(n, lambda c: dqcoll.allreduce(data(c.rank), scheme=scheme,
                          algorithm=algorithm, seed=5, step=9, tile_nbytes=0))
        report[f"same_as_local_{key}"] = bool(torch.equal(runs["tiled"], local[rank]))
print("REPORT " + json.dumps(report), flush=True)
"""


def _run_gloo(world_size: int) -> dict[int, dict[str, Any]]:
    return run_gloo_script(_GLOO_WORKER, world_size, timeout_s=180,
                           env={"DQCOLL_TIMEOUT_S": "60"})


def test_gloo_processes_tiled_and_async_match_untiled() -> None:
    """Over gloo (3 processes): a tiled run (2 KiB tiles, three in flight) and a tiled async_op
    run give the untiled result bit for bit, every rank ends with the same values, and for
    ``none`` they equal the local transport's."""
    reports = _run_gloo(3)
    for rank, rep in reports.items():
        assert rep["exit"] == 0, rep
        checked = [k for k in rep if k.startswith(("same_", "ranks_agree_"))]
        assert len(checked) >= 6, rep
        for key in checked:
            assert rep[key] is True, (rank, key)
        for key, tiles in rep.items():
            if key.startswith("tiles_untiled"):
                assert tiles == 1
            elif key.startswith("tiles_"):
                assert tiles > 1, (key, tiles)


def test_comm_thread_names_are_per_call() -> None:
    """The pipelined executor's communication thread ends with its call: no thread is left
    behind after a tiled collective."""

    def body(comm: Any) -> None:
        x = _data(comm.rank, 8000)
        dqcoll.allreduce(x, tile_nbytes=1024)

    before = {t.name for t in threading.enumerate()}
    run_local(2, body)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = {t.name for t in threading.enumerate() if t.name.startswith("dqcoll-comm")} - before
        if not left:
            break
        time.sleep(0.05)
    assert not left


# -- GPU tier: tiles and async_op on CUDA tensors (local transport, one GPU) -----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["dynamiq", "none", "mxfp8", "thc"])
def test_cuda_tiles_and_async_match_untiled(scheme: str) -> None:
    """On CUDA tensors (Triton kernels for dynamiq), 3 ranks on one GPU: 16 KiB tiles with two
    in flight and an async_op call give the untiled result bit for bit on every rank, and every
    rank ends identical."""

    def body(comm: Any) -> list[torch.Tensor]:
        x = _data(comm.rank, 3 * 40_000).cuda()
        results = []
        for kwargs in ({"tile_nbytes": 0}, {"tile_nbytes": 16384}):
            y = x.clone()
            dqcoll.allreduce(y, scheme=scheme, algorithm="butterfly", seed=2, step=1, **kwargs)
            results.append(y.cpu())
        y = x.clone()
        handle = dqcoll.allreduce(y, scheme=scheme, algorithm="butterfly", seed=2, step=1,
                                  tile_nbytes=16384, async_op=True)
        handle.wait()
        torch.cuda.current_stream().synchronize()
        results.append(y.cpu())
        return results

    ranks = run_local(3, body, device="cuda")
    for results in ranks:
        assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
        assert torch.equal(results[0], ranks[0][0])


def test_tuner_tile_count_maps_to_tile_nbytes() -> None:
    """tile_nbytes_for(numel, n, T) makes the executor cut an evenly chunked buffer (``none``)
    into exactly T tiles, and T <= 1 means untiled."""
    from dqcoll.executor import tile_nbytes_for

    assert tile_nbytes_for(1 << 20, 4, 1) == 0

    def body(comm: Any, tiles: int) -> int:
        numel = 3 * 64 * 1024
        x = torch.ones(numel)
        dqcoll.allreduce(x, scheme="none", tile_nbytes=tile_nbytes_for(numel, 3, tiles))
        return int(comm.last_info["tiles"])

    for tiles in (2, 5, 16):
        assert run_local(3, body, tiles) == [tiles] * 3


def test_default_tile_per_device() -> None:
    """CPU buffers default to 4 MiB tiles; CUDA buffers to 64 MiB (the host side of a tile-step
    would otherwise dwarf its microseconds of GPU codec work; see dqcoll.executor)."""
    assert default_tile_nbytes(torch.device("cpu")) == DEFAULT_TILE_NBYTES == 4 << 20
    assert default_tile_nbytes(torch.device("cuda", 0)) == 64 << 20
