"""Runs any :class:`~dqcoll.topology.Schedule` with any scheme call over any transport, one
message per peer and step, cut into tiles that pipeline exchange and codec (docs/gpu_transport.md,
"Tiles and pipelining").
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from .handles import Worker
from .schemes.base import SchemeCall
from .topology.schedule import Role, Schedule, Step
from .transports.base import Transport, exchange_framed
from .types import Collective

__all__ = [
    "DEFAULT_CUDA_TILE_NBYTES",
    "DEFAULT_TILES_IN_FLIGHT",
    "DEFAULT_TILE_NBYTES",
    "RankPlan",
    "TilePlan",
    "default_tile_nbytes",
    "plan_tiles",
    "rank_plan",
    "run_schedule",
    "tile_nbytes_for",
]

# Per-chunk fp32 work bytes of one tile on CPUs: small enough to overlap codec and transfer on
# slow links (benchmarks/results/history-benchmarks.md, tile sizes).
DEFAULT_TILE_NBYTES = 4 << 20
DEFAULT_TILES_IN_FLIGHT = 2
# On CUDA a tile-step's host time would dwarf a 4 MiB tile's GPU codec (docs/gpu_transport.md).
DEFAULT_CUDA_TILE_NBYTES = 64 << 20


def default_tile_nbytes(device: torch.device) -> int:
    """The API's tile size for buffers on ``device`` (see the constants above)."""
    return DEFAULT_CUDA_TILE_NBYTES if device.type == "cuda" else DEFAULT_TILE_NBYTES


@dataclasses.dataclass(frozen=True)
class StepPlan:
    # (peer, chunks in send order); payloads for one peer travel as one message
    sends: tuple[tuple[int, tuple[int, ...]], ...]
    # (peer, ((chunk, role), ...)) in processing order
    recvs: tuple[tuple[int, tuple[tuple[int, Role], ...]], ...]


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's view of a schedule."""

    reduce: tuple[StepPlan, ...]
    gather: tuple[StepPlan, ...]
    # contributions summed in the partial sum rank r holds for chunk c once its children arrived:
    subtree: tuple[tuple[int, ...], ...]  # subtree[rank][chunk]


@functools.lru_cache(maxsize=256)
def rank_plan(schedule: Schedule, rank: int) -> RankPlan:
    """Rank ``rank``'s sends and receives per step of ``schedule`` (cached)."""

    def plan(step: Step) -> StepPlan:
        sends: dict[int, list[int]] = {}
        recvs: dict[int, list[tuple[int, Role]]] = {}
        for t in step.transfers:  # sorted by (src, dst, chunk)
            if t.src == rank:
                sends.setdefault(t.dst, []).append(t.chunk)
            if t.dst == rank:
                recvs.setdefault(t.src, []).append((t.chunk, t.role))
        return StepPlan(tuple((p, tuple(c)) for p, c in sorted(sends.items())),
                        tuple((p, tuple(c)) for p, c in sorted(recvs.items())))

    return RankPlan(tuple(map(plan, schedule.reduce)), tuple(map(plan, schedule.gather)),
                    schedule.subtree_sizes())


# -- tiles ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """How one call's chunks are cut into tiles."""

    tiles: int  # T: tiles per chunk (some may be empty in short chunks)
    bounds: tuple[int, ...]  # refined chunk_bounds: fine chunk c * T + t is tile t of chunk c
    unit_nbytes: int  # fp32 work bytes of one chunk_bounds unit (a DynamiQ row: 1 KiB)


def plan_tiles(call: SchemeCall, tile_nbytes: int | None) -> TilePlan | None:
    """The tiles of ``call`` for ``tile_nbytes`` per chunk tile; None when it runs untiled."""
    unit = getattr(call, "tile_unit", None)
    if not tile_nbytes or unit is None:
        return None
    tile_nbytes = int(tile_nbytes)
    if tile_nbytes < 0:
        raise ValueError(f"tile_nbytes must be >= 0, got {tile_nbytes}")
    work = call.work
    rows = work.shape[0] if work.dim() else 0
    unit_nbytes = (work.numel() // rows if rows else 1) * work.element_size()
    bounds = list(call.chunk_bounds)
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    longest = max(lengths, default=0)
    tiles = min(-(-longest * unit_nbytes // tile_nbytes), -(-longest // unit))  # >= one unit each
    if tiles <= 1:  # also no chunk with work
        return None
    fine = [bounds[0]]
    for lo, length in zip(bounds[:-1], lengths, strict=True):
        fine += [lo + (t * (length // unit) // tiles) * unit for t in range(1, tiles)]
        fine.append(lo + length)  # a remainder that is not a whole unit stays in the last tile
    return TilePlan(tiles, tuple(fine), unit_nbytes)


def tile_nbytes_for(numel: int, world_size: int, tiles: int) -> int:
    """The ``tile_nbytes`` that cuts a ``numel``-coordinate all-reduce's chunks into about
    ``tiles`` tiles (the cost model's ``T``); 0 (untiled) for ``tiles <= 1``."""
    if tiles <= 1 or numel <= 0:
        return 0
    chunk_nbytes = -(-numel // max(1, world_size)) * 4  # fp32 work
    return max(1, -(-chunk_nbytes // tiles))


# -- one tile's walk through the schedule ---------------------------------------------------------


@dataclasses.dataclass
class _Exchange:
    label: str
    sends: list[tuple[int, torch.Tensor]]
    recvs: list[tuple[int, torch.Tensor]]
    layouts: list[tuple[int, tuple[tuple[int, Role], ...], list[int], torch.Tensor]]
    framed: bool = False  # sends and recvs are frames (transports.base.exchange_framed)

    def run(self, transport: Transport) -> None:
        if self.framed:
            exchange_framed(transport, self.sends, self.recvs, what=self.label)
        else:
            transport.exchange(self.sends, self.recvs, what=self.label)


class _TileRun:
    """The executor's state for one tile (for the whole buffer when untiled)."""

    def __init__(self, call: SchemeCall, plan: RankPlan, rank: int, n: int,
                 collective: Collective, what: str, *, tile: int = 0, tiles: int = 1) -> None:
        self.call = call
        self.rank, self.n = rank, n
        self.subtree = plan.subtree
        self.collective = collective
        self.tile, self.tiles = tile, tiles
        self.prefix = what if tiles == 1 else f"{what} tile {tile}"
        self.outgoing: dict[int, torch.Tensor] = {}  # reduce phase: the payload this rank forwards
        self.final: dict[int, torch.Tensor] = {}  # gather phase: each chunk's result, compressed
        self.gather_count = 1 if collective is Collective.ALL_GATHER else n
        self.steps: list[tuple[str, int, StepPlan]] = []
        if collective is not Collective.ALL_GATHER:
            self.steps += [("reduce", i, s) for i, s in enumerate(plan.reduce)]
        if collective is not Collective.REDUCE_SCATTER:
            self.steps += [("gather", i, s) for i, s in enumerate(plan.gather)]

    def _index(self, chunk: int) -> int:
        """The call's chunk index of schedule chunk ``chunk`` in this tile."""
        return chunk * self.tiles + self.tile

    def start(self) -> None:
        if self.collective is Collective.ALL_GATHER:
            # each chunk is one rank's data, not a sum; the owner decodes its own bytes too
            index = self._index(self.rank)
            self.final[self.rank] = self.call.compress(index, 1)
            self.call.decompress(index, self.final[self.rank], 1)

    def _leaf_or_forward(self, chunk: int) -> torch.Tensor:
        if chunk in self.outgoing:
            return self.outgoing.pop(chunk)
        return self.call.compress(self._index(chunk), 1)  # a leaf: nothing arrived for this chunk

    def prepare(self, position: int) -> _Exchange:
        phase, index, step = self.steps[position]
        call = self.call
        payload_of = self._leaf_or_forward if phase == "reduce" else self.final.__getitem__
        # byte buffers: the call's reused ones, if it has them
        alloc = getattr(call, "scratch", None) or functools.partial(
            torch.empty, dtype=torch.uint8, device=call.work.device)
        sends = []
        for peer, chunks in step.sends:
            parts = [payload_of(c) for c in chunks]
            message = (parts[0] if len(parts) == 1
                       else torch.cat(parts, out=alloc(sum(p.numel() for p in parts))))
            if message.numel():
                sends.append((peer, message))
        recvs, layouts = [], []
        for peer, items in step.recvs:
            sizes = [call.payload_nbytes(self._index(c), self.subtree[peer][c] if phase == "reduce"
                                         else self.gather_count) for c, _ in items]
            buffer = alloc(sum(sizes))
            if buffer.numel():
                recvs.append((peer, buffer))
            layouts.append((peer, items, sizes, buffer))
        label = f"{self.prefix} {phase} step {index}"
        framer = getattr(call, "frame", None)
        if framer is not None:  # every message in its frame (a pooled buffer's), or none
            frames = [(peer, framer(tensor)) for peer, tensor in (*sends, *recvs)]
            if all(frame is not None for _, frame in frames):
                framed = cast(list[tuple[int, torch.Tensor]], frames)
                return _Exchange(label, framed[: len(sends)], framed[len(sends) :], layouts,
                                 framed=True)
        return _Exchange(label, sends, recvs, layouts)

    def complete(self, exchange: _Exchange) -> None:
        call, subtree, rank, n = self.call, self.subtree, self.rank, self.n
        for peer, items, sizes, buffer in exchange.layouts:
            offset = 0
            for (chunk, role), size in zip(items, sizes, strict=True):
                payload = buffer[offset : offset + size]
                offset += size
                index = self._index(chunk)
                if role is Role.GATHER:
                    self.final[chunk] = payload
                    call.decompress(index, payload, self.gather_count)
                    continue
                count = subtree[peer][chunk]
                if role is Role.ACCUMULATE:
                    call.decompress_accumulate(index, payload, count)
                elif role is Role.FORWARD:
                    self.outgoing[chunk] = call.decompress_accumulate_recompress(
                        index, payload, count, subtree[rank][chunk])
                else:  # Role.FINAL: the sink recompresses once more and decodes its own bytes
                    self.final[chunk] = call.decompress_accumulate_recompress(
                        index, payload, count, n)
                    call.decompress(index, self.final[chunk], n)


# -- how an exchange runs beside the codec ------------------------------------------------------


_Pending = Callable[[], Any]  # waits until a submitted exchange is done (on the compute stream)


class _InlineDriver:
    """One tile in flight (or untiled): the exchange runs in the calling thread when waited for."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def submit(self, exchange: _Exchange) -> _Pending:
        return functools.partial(exchange.run, self.transport)

    def close(self) -> None:
        pass


class _ThreadDriver:
    """Exchanges of a host-blocking transport on a worker thread, in order, on the caller's CUDA
    stream; a daemon, so an exchange stuck until its timeout cannot hold up exit."""

    def __init__(self, transport: Transport, device: torch.device, name: str) -> None:
        self.transport = transport
        self.failed: BaseException | None = None
        self.worker = Worker(f"dqcoll-comm {name}")
        if device.type == "cuda":
            self.worker.submit(functools.partial(torch.cuda.set_stream,
                                                 torch.cuda.current_stream(device)))

    def _run(self, exchange: _Exchange) -> None:
        if self.failed is None:  # else the caller raises the first error before this one
            try:
                exchange.run(self.transport)
            except BaseException as exc:  # handed to the waiting thread
                self.failed = exc
        if self.failed is not None:
            raise self.failed

    def submit(self, exchange: _Exchange) -> _Pending:
        return self.worker.submit(functools.partial(self._run, exchange)).result

    def close(self) -> None:
        self.worker.jobs.put(None)


_side = threading.local()  # .streams: this thread's {device index: communication stream}


class _StreamDriver(_InlineDriver):
    """Exchanges of a stream-ordered transport (NCCL) on a side stream, ordered by events."""

    def __init__(self, transport: Transport, device: torch.device) -> None:
        self.transport = transport
        self.compute = torch.cuda.current_stream(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        streams = _side.__dict__.setdefault("streams", {})  # one per (device, thread)
        if index not in streams:
            streams[index] = torch.cuda.Stream(device=index)
        self.side = streams[index]

    def submit(self, exchange: _Exchange) -> _Pending:
        ready = torch.cuda.Event()
        ready.record(self.compute)
        self.side.wait_event(ready)
        with torch.cuda.stream(self.side):
            exchange.run(self.transport)
        for _, tensor in (*exchange.sends, *exchange.recvs):
            # used on the side stream: the allocator must not reuse it before that stream is done
            tensor.record_stream(self.side)
        done = torch.cuda.Event()
        done.record(self.side)
        return functools.partial(self.compute.wait_event, done)


def _make_driver(transport: Transport, device: torch.device, tiles_in_flight: int,
                 what: str) -> _InlineDriver | _ThreadDriver:
    if tiles_in_flight <= 1:
        return _InlineDriver(transport)
    if device.type == "cuda" and getattr(transport, "stream_ordered", False):
        return _StreamDriver(transport, device)
    return _ThreadDriver(transport, device, what)


# -- the entry point ------------------------------------------------------------------------------


def run_schedule(
    schedule: Schedule,
    call: SchemeCall,
    transport: Transport,
    *,
    what: str,
    collective: Collective = Collective.ALLREDUCE,
    tile_nbytes: int | None = None,
    tiles_in_flight: int = DEFAULT_TILES_IN_FLIGHT,
) -> None:
    """Run ``collective`` on ``call.work`` across the ranks of ``transport`` along ``schedule``.

    On return, all-reduce: every rank holds every chunk, decoded from the same bytes;
    reduce-scatter: chunk ``rank`` holds the result; all-gather: every rank's chunk, its owner's
    included, decoded from the same bytes. ``tile_nbytes`` (None or 0: untiled) and
    ``tiles_in_flight`` must be the same on every rank; ``call.info["tiles"]`` gets the tile count.
    """
    rank, n = transport.rank, transport.world_size
    if schedule.world_size != n:
        raise ValueError(f"schedule is for {schedule.world_size} ranks, transport has {n}")
    if tiles_in_flight < 1:
        raise ValueError(f"tiles_in_flight must be >= 1, got {tiles_in_flight}")
    plan = rank_plan(schedule, rank)
    tiling = plan_tiles(call, tile_nbytes)
    call.info["tiles"] = tiling.tiles if tiling is not None else 1
    if tiling is None:
        runs, window = [_TileRun(call, plan, rank, n, collective, what)], 1
    else:
        view = copy.copy(call)  # shares work, state and every per-chunk table with the call
        view.chunk_bounds = list(tiling.bounds)
        runs = [_TileRun(view, plan, rank, n, collective, what, tile=t, tiles=tiling.tiles)
                for t in range(tiling.tiles)]
        window = tiles_in_flight
    driver = _make_driver(transport, call.work.device, window, what)
    try:
        _pipeline(runs, driver, window)
    finally:
        driver.close()


def _pipeline(runs: list[_TileRun], driver: _InlineDriver | _ThreadDriver, window: int) -> None:
    """Round-robin over at most ``window`` tiles, in an order that depends only on the tile count,
    the step count and ``window``: the same on every rank."""
    active: collections.deque[tuple[_TileRun, int, _Exchange, _Pending]] = collections.deque()
    waiting = collections.deque(runs)

    def submit(run: _TileRun, position: int) -> None:
        exchange = run.prepare(position)
        active.append((run, position, exchange, driver.submit(exchange)))

    while True:
        while waiting and len(active) < window:
            run = waiting.popleft()
            run.start()
            if run.steps:
                submit(run, 0)
        if not active:
            return
        run, position, exchange, wait = active.popleft()
        wait()
        run.complete(exchange)
        if position + 1 < len(run.steps):
            submit(run, position + 1)
