"""Where one rank's CPU goes in a DynamiQ all-reduce: CPU ms per phase per call.

Spawns ``-n`` gloo ranks on this machine (loopback, one intra-op thread each, the compiled kernels
on one thread per rank as when 4 ranks share 2 cores: ``DQCOLL_CPU_THREADS=1``), each averaging
the DDP buckets of ``benchmarks/ddp_step.py --model transformer`` (a first bucket of 1.05 M
coordinates and buckets of 7.36 M and 4.20 M: 12.6 M parameters, ``bucket_cap_mb=25``) filled with
that model's gradients (one backward on a per-rank batch), with ``dqcoll.allreduce(op="avg",
scheme="dynamiq", bits=5, tile_nbytes=16 MiB)`` as ``dynamiq_hook`` calls it with two lanes.

Each function of the call path is wrapped; a wrapper charges the *thread* CPU time
(``time.thread_time``) spent inside it, less what its wrapped callees spent, to its phase
(exclusive times, so that the phases add up). Phases:

* ``kernel:<op>``: a compiled kernel (``dqcoll.kernels.dynamiq_numba.OPS``'s fields);
* ``call:<step>``: the Python of :class:`dqcoll.schemes.dynamiq.call.DynamiqCall`'s planning
  steps (layout, statistics, allocation, reorder, geometry, info) and per-hop methods, with
  their kernels taken out; ``call:stats_allreduce`` is the small statistics all-reduce;
* ``executor:prepare`` / ``executor:complete``: the executor's Python per step (tile and hop);
* ``transport:exchange``: posting, copying and waiting for the messages (gloo), thread CPU;
* ``argument check``: ``dqcoll.validate.handshake`` (its compiled range-check pass is
  ``kernel:stats_range``);
* ``api``: the rest of ``dqcoll.allreduce`` on the calling thread (preparation, recording);
* ``other threads``: process CPU time (``time.process_time``) less the calling thread's: gloo's
  I/O threads and the executor's communication thread.

Every call is timed ``--repeats`` times after ``--warmup`` untimed ones; the table shows, per
bucket, the median over repeats of the median over ranks, and ``[min-max]`` over the repeats
(of that rank median). Usage::

    .venv/bin/python tools/codec_cpu_profile.py [-n 4] [--repeats 7] [--json FILE]
    .venv/bin/python tools/codec_cpu_profile.py --cprofile 7355392   # rank 0: cProfile, thread CPU

The machine's other load shows in ``process_time`` only through cache and frequency effects, not
as time charged to the ranks, so alternating runs of two checkouts compare the code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import functools
import io
import json
import os
import pstats
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the DDP buckets of benchmarks/ddp_step.py --model transformer (width 1024 -> d_model 512,
# 4 layers): torch's bucket assignment with a 1 MiB first bucket and bucket_cap_mb=25
TRANSFORMER_BUCKETS = (1051136, 7355392, 4203008)
LANE_TILE_NBYTES = 16 << 20  # dqcoll.integrations.torch_ddp.LANE_TILE_NBYTES (two lanes)


# -- the per-thread stack of wrapped calls ------------------------------------------------------


class Profile:
    """Exclusive thread CPU seconds per phase, summed over the wrapped calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: dict[str, int] = collections.defaultdict(int)
        self.local = threading.local()
        self.lock = threading.Lock()

    def reset(self) -> None:
        with self.lock:
            self.seconds.clear()
            self.calls.clear()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        stack = self.local.__dict__.setdefault("stack", [])
        frame = [0.0]  # CPU time of wrapped callees
        stack.append(frame)
        start = time.thread_time()
        try:
            yield
        finally:
            elapsed = time.thread_time() - start
            stack.pop()
            if stack:
                stack[-1][0] += elapsed
            with self.lock:
                self.seconds[name] += elapsed - frame[0]
                self.calls[name] += 1

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return fn(*args, **kwargs)

        wrapped.__profiled__ = True  # type: ignore[attr-defined]
        return wrapped


def _patch(profile: Profile, owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr, None)
    if fn is None:
        raise AttributeError(f"{owner.__name__}.{attr} is gone: update the phases of "
                             f"tools/codec_cpu_profile.py to the call path")
    if not getattr(fn, "__profiled__", False):
        setattr(owner, attr, profile.wrap(name, fn))


def instrument(profile: Profile) -> None:
    """Wrap the call path of a CPU DynamiQ all-reduce (see the module docstring)."""
    from dqcoll import api, executor, validate
    from dqcoll.kernels import dynamiq_numba
    from dqcoll.schemes.dynamiq import call as call_mod
    from dqcoll.transports import base as transport_base

    ops = dynamiq_numba.OPS
    wrapped = {f.name: profile.wrap(f"kernel:{f.name}", getattr(ops, f.name))
               for f in dataclasses.fields(ops)
               if f.name not in ("name", "formats") and callable(getattr(ops, f.name))}
    dynamiq_numba.OPS = dataclasses.replace(ops, **wrapped)
    if hasattr(dynamiq_numba, "max_finite_abs"):
        _patch(profile, dynamiq_numba, "max_finite_abs", "kernel:max_finite_abs")
    cls = call_mod.DynamiqCall
    for attr, name in (("_lay_out", "layout"), ("_statistics", "statistics"),
                       ("_allocate", "allocation"), ("_choose_codec_kernels", "kernel choice"),
                       ("_reorder", "reorder"), ("_byte_geometry", "geometry"),
                       ("_chunk_bounds", "geometry"), ("_describe", "info"),
                       ("compress", "compress"), ("decompress", "decompress"),
                       ("decompress_accumulate", "decompress_accumulate"),
                       ("decompress_accumulate_recompress", "hop"), ("finish", "finish"),
                       ("scratch", "scratch")):
        _patch(profile, cls, attr, f"call:{name}")
    _patch(profile, call_mod, "_reduce_statistics", "call:stats_allreduce")
    _patch(profile, call_mod, "survey", "argument check")
    _patch(profile, validate, "handshake", "argument check")
    _patch(profile, executor._TileRun, "prepare", "executor:prepare")
    _patch(profile, executor._TileRun, "complete", "executor:complete")
    _patch(profile, executor._TileRun, "start", "executor:prepare")
    _patch(profile, executor, "plan_tiles", "executor:prepare")
    _patch(profile, executor._Exchange, "run", "transport:exchange")
    _patch(profile, transport_base, "exchange_framed", "transport:exchange")
    _patch(profile, api, "allreduce", "api")


# -- one rank ---------------------------------------------------------------------------------


def _gradients(rank: int, total: int) -> Any:
    """The transformer's gradients on this rank's batch, flattened in DDP's bucket order."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from ddp_step import build_model

    model = build_model("transformer", width=1024, layers=12, seed=0)
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(32, 2, 512, generator=generator)
    model(x).square().mean().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    if grads.numel() < total:
        grads = torch.cat([grads, grads[: total - grads.numel()]])
    return grads[:total].clone()


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from dqcoll import api
    from dqcoll.comm import Communicator
    from dqcoll.transports.torch_dist import TorchTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    comm = Communicator(TorchTransport(), seed=0, device="cpu")
    sizes = args.sizes
    grads = _gradients(rank, sum(sizes))
    buckets, start = [], 0
    for size in sizes:
        buckets.append(grads[start : start + size].clone())
        start += size
    profile = Profile()
    instrument(profile)
    work = [torch.empty_like(b) for b in buckets]
    rows: dict[int, list[dict[str, float]]] = {size: [] for size in sizes}
    infos: dict[int, dict[str, Any]] = {}
    # thread CPU time, as the phases
    profiler = cProfile.Profile(time.thread_time) if args.cprofile and rank == 0 else None
    for repeat in range(args.warmup + args.repeats):
        for index, (size, bucket) in enumerate(zip(sizes, buckets, strict=True)):
            work[index].copy_(bucket)
            comm.barrier()
            profile.reset()
            timed = repeat >= args.warmup
            if profiler is not None and timed and size == args.cprofile:
                profiler.enable()
            process0, thread0 = time.process_time(), time.thread_time()
            api.allreduce(work[index], op="avg", scheme="dynamiq", bits=args.bits,
                             algorithm=args.algorithm, comm=comm, seed=repeat, step=index,
                             tile_nbytes=args.tile_nbytes)
            thread_s, process_s = time.thread_time() - thread0, time.process_time() - process0
            if profiler is not None:
                profiler.disable()
            if not timed:
                continue
            row = {name: 1e3 * s for name, s in profile.seconds.items()}
            row["other threads"] = 1e3 * (process_s - thread_s)
            row["calling thread"] = 1e3 * thread_s
            row["process"] = 1e3 * process_s
            rows[size].append(row)
            info = comm.last_info
            infos[size] = {"algorithm": info.get("algorithm"), "tiles": info.get("tiles"),
                           "bits": info.get("bits"), "kernels": info.get("kernels"),
                           "calls": dict(profile.calls)}
    comm.barrier()
    report: dict[str, Any] = {"rank": rank, "rows": rows, "infos": infos}
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out).sort_stats("tottime")
        stats.print_stats(r"^(?!.*_dynamiq_numba_kernels)", 60)  # the kernels are phases above
        report["cprofile"] = out.getvalue()
    comm.close()
    dist.destroy_process_group()
    return report


# -- the launcher and the table -----------------------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: argparse.Namespace, argv: list[str]) -> list[dict[str, Any]]:
    port = _port()
    procs = []
    for rank in range(args.world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world_size),
                   LOCAL_WORLD_SIZE=str(args.world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", DQCOLL_CPU_THREADS="1",
                   PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank",
                                       *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    reports = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=args.timeout_s)
            lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
            if not lines:
                raise RuntimeError(f"a rank failed (exit {p.returncode}):\n{err[-4000:]}")
            reports.append(json.loads(lines[0][7:]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return reports


def summarize(reports: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    """Per size and phase: the median over repeats of the median over ranks, and its range."""
    table: dict[str, Any] = {}
    for size in sizes:
        per_rank = [r["rows"][str(size)] for r in reports]
        repeats = min(len(rows) for rows in per_rank)
        names = sorted({name for rows in per_rank for row in rows for name in row})
        phases = {}
        for name in names:
            over_ranks = [statistics.median(rows[i].get(name, 0.0) for rows in per_rank)
                          for i in range(repeats)]
            phases[name] = {"median": statistics.median(over_ranks), "min": min(over_ranks),
                            "max": max(over_ranks)}
        table[str(size)] = {"phases": phases, "info": reports[0]["infos"].get(str(size))}
    return table


_TOTALS = ("calling thread", "other threads", "process")


def render(table: dict[str, Any]) -> str:
    sizes = list(table)
    names = sorted({n for s in sizes for n in table[s]["phases"]} - set(_TOTALS),
                   key=lambda n: -max(table[s]["phases"].get(n, {"median": 0})["median"]
                                      for s in sizes))
    header = f"{'phase (CPU ms per call)':32}" + "".join(f"{int(s):>22,}" for s in sizes)
    lines = [header, "-" * len(header)]
    for name in [*names, *_TOTALS]:
        if name in _TOTALS and name == _TOTALS[0]:
            lines.append("-" * len(header))
        cells = []
        for s in sizes:
            cell = table[s]["phases"].get(name)
            cells.append(f"{'-':>22}" if cell is None else
                         f"{cell['median']:>9.2f} [{cell['min']:6.2f}-{cell['max']:6.2f}]")
        lines.append(f"{name:32}" + "".join(cells))
    for s in sizes:
        info = table[s]["info"] or {}
        lines.append(f"{int(s):,}: algorithm {info.get('algorithm')}, tiles {info.get('tiles')}, "
                     f"bits {info.get('bits', 0):.3f}, kernel calls "
                     f"{ {k: v for k, v in (info.get('calls') or {}).items() if 'kernel' in k} }")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="codec_cpu_profile.py", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--world-size", type=int, default=4)
    p.add_argument("--sizes", type=lambda t: [int(v) for v in t.split(",") if v],
                   default=list(TRANSFORMER_BUCKETS), help="bucket sizes (coordinates)")
    p.add_argument("--bits", type=float, default=5.0)
    p.add_argument("--algorithm", default="ring")
    p.add_argument("--tile-nbytes", type=int, default=LANE_TILE_NBYTES)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--cprofile", type=int, default=0, metavar="SIZE",
                   help="also print rank 0's cProfile (thread CPU time, Python only: the kernels "
                        "are phases) of the calls of this bucket size")
    p.add_argument("--json", default="", metavar="FILE")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.rank:
        print("REPORT " + json.dumps(run_rank(args)), flush=True)
        return 0
    reports = spawn(args, argv)
    table = summarize(reports, args.sizes)
    print(render(table))
    for report in reports:
        if "cprofile" in report:
            print(report["cprofile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": argv, "world_size": args.world_size, "table": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
