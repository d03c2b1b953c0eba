"""Per-phase CPU time of one dqcoll all-reduce, per rank (where a call's CPU goes).

Runs ``n`` gloo ranks as processes on this machine (loopback), each all-reducing the same size
of N(0, 1) fp32 ``--repeats`` times after ``--warmup`` calls, and wraps the call path's steps
(prepare, the argument check, each planning step of ``DynamiqCall``, the statistics'
all-reduce, the codec kernels, the transfers, the final decode) with timers that add up the
*thread* CPU time (``time.thread_time``) and the wall time of each step in the thread that runs
it. Thread CPU time, unlike wall time, does not count waiting for the other ranks or for a
core another process holds, so the numbers stay meaningful on a loaded machine. Nested steps
count in their parents too (the tree is printed with indentation). The transfers run on the
executor's communication thread; their CPU is gloo's copies and framing.

``python benchmarks/call_profile.py -n 4 --numel 12582912 --algorithm ring --json out.json``
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import platform
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TOTALS: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
_STACK = threading.local()


@contextlib.contextmanager
def _timed(name: str) -> Iterator[None]:
    stack = getattr(_STACK, "names", None)
    if stack is None:
        stack = _STACK.names = []
    path = "/".join([*stack, name])
    stack.append(name)
    cpu, wall = time.thread_time(), time.perf_counter()
    try:
        yield
    finally:
        entry = _TOTALS[path]
        entry[0] += time.thread_time() - cpu
        entry[1] += time.perf_counter() - wall
        entry[2] += 1
        stack.pop()


def _wrap(owner: Any, attr: str, name: str) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _timed(name):
            return original(*args, **kwargs)

    setattr(owner, attr, wrapper)


def _instrument() -> None:
    from dqcoll import execute, validate
    from dqcoll.kernels import dynamiq_numba
    from dqcoll.schemes.dynamiq import call
    from dqcoll.transports import torch_dist

    _wrap(execute, "prepare_call", "prepare")
    _wrap(validate, "handshake", "argument check")
    _wrap(execute, "_execute", "execute")
    _wrap(call.DynamiqCall, "__init__", "plan")
    for step in ("_lay_out", "_statistics", "_allocate", "_choose_codec_kernels", "_reorder",
                 "_byte_geometry", "_chunk_bounds", "_describe"):
        _wrap(call.DynamiqCall, step, step.lstrip("_"))
    _wrap(call, "_reduce_statistics", "statistics all-reduce")
    _wrap(call, "_keep_underflowed_rows", "underflow check")
    _wrap(execute, "run_schedule", "schedule")
    _wrap(execute, "_restore", "finish")
    _wrap(torch_dist.TorchTransport, "exchange", "transfer")
    _wrap(dynamiq_numba, "run_rows", "numba launch")  # the compiled body and its dispatch
    for op in ("stats", "stats_range", "center_gather", "encode", "decode", "decode_accumulate",
               "decode_accumulate_encode", "restore", "decode_restore", "encode_runs",
               "decode_accumulate_runs", "hop_runs", "decode_restore_runs"):
        fn = getattr(dynamiq_numba.OPS, op, None)
        if fn is None:
            continue

        def timed_op(*args: Any, _fn: Callable[..., Any] = fn, _op: str = op,
                     **kwargs: Any) -> Any:
            with _timed(f"kernel {_op}"):
                return _fn(*args, **kwargs)

        object.__setattr__(dynamiq_numba.OPS, op, timed_op)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each thread of this process so far, summed by thread name
    (``/proc/self/task``; empty where there is none)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = collections.defaultdict(float)
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return dict(out)


def _data(args: argparse.Namespace, rank: int) -> torch.Tensor:
    """This rank's buffer: N(0, 1), or (``--data mlp``) the gradient of the DDP benchmark's
    12-layer 1024-wide ReLU MLP on a random batch of 32, in DDP's bucket order (last layer
    first), repeated to ``--numel``: about half its weight-gradient rows are dead units' zeros."""
    gen = torch.Generator().manual_seed(rank)
    if args.data == "normal":
        return torch.randn(args.numel, generator=gen)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(12):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(32, 1024, generator=gen)
    y = torch.randn(32, 1024, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    return grads.repeat(-(-args.numel // grads.numel()))[: args.numel].clone()


def _rank(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(args.n))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.n)
    import dqcoll
    from dqcoll.comm import Communicator
    from dqcoll.transports.torch_dist import TorchTransport

    comm = Communicator(TorchTransport(), seed=1)
    _instrument()
    x0 = _data(args, rank)
    x = x0.clone()
    kwargs = dict(op="avg", scheme="dynamiq", bits=args.bits, algorithm=args.algorithm,
                  comm=comm, tile_nbytes=args.tile_nbytes, tiles_in_flight=args.tiles_in_flight)
    for _ in range(args.warmup):
        x.copy_(x0)
        dqcoll.allreduce(x, **kwargs)
    _TOTALS.clear()
    dist.barrier()
    profiler = None
    if args.cprofile and rank == 0:
        import cProfile

        profiler = cProfile.Profile(time.thread_time)  # CPU, not wall: a loaded machine
        profiler.enable()
    threads_before = _thread_cpu()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    process_cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(args.repeats):
        x.copy_(x0)
        with _timed("call"):
            dqcoll.allreduce(x, **kwargs)
    process_cpu = time.process_time() - process_cpu
    wall = time.perf_counter() - wall
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    print(f"rank {rank}: {faults / args.repeats:.0f} minor page faults per call", flush=True)
    threads = {name: cpu - threads_before.get(name, 0.0)
               for name, cpu in _thread_cpu().items()}
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.cprofile)
    queue.put((rank, {k: v[:] for k, v in _TOTALS.items()}, process_cpu, wall,
               dict(comm.last_info.get("kernels", {})), comm.last_info.get("algorithm"),
               threads))
    dist.barrier()
    dist.destroy_process_group()


def _commit() -> str:
    """The commit of the dqcoll that ran (its own checkout, not the working directory's)."""
    import dqcoll

    root = os.path.dirname(os.path.dirname(os.path.abspath(dqcoll.__file__)))
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=4)
    parser.add_argument("--numel", type=int, default=12 * 1024 * 1024)
    parser.add_argument("--bits", type=float, default=5)
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tile-nbytes", type=int, default=None,
                        help="the call's tile_nbytes (default: dqcoll's; 0: untiled)")
    parser.add_argument("--tiles-in-flight", type=int, default=2)
    parser.add_argument("--data", choices=("normal", "mlp"), default="normal",
                        help="normal: N(0, 1); mlp: the DDP benchmark MLP's gradient")
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--json", default=None)
    parser.add_argument("--note", default="")
    parser.add_argument("--cprofile", default=None, metavar="FILE",
                        help="also write rank 0's cProfile of the timed calls (calling thread)")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, args.port, queue)) for r in range(args.n)]
    for p in procs:
        p.start()
    results = sorted(queue.get() for _ in procs)
    for p in procs:
        p.join()
    per_call: dict[str, dict[str, float]] = {}
    for name in results[0][1]:
        cpus = [r[1].get(name, [0, 0, 0]) for r in results]
        per_call[name] = {
            "cpu_ms": 1e3 * sum(c[0] for c in cpus) / len(cpus) / args.repeats,
            "wall_ms": 1e3 * sum(c[1] for c in cpus) / len(cpus) / args.repeats,
            "count": sum(c[2] for c in cpus) / len(cpus) / args.repeats,
        }
    process_cpu_ms = 1e3 * sum(r[2] for r in results) / len(results) / args.repeats
    wall_ms = 1e3 * max(r[3] for r in results) / args.repeats
    print(f"{args.n} ranks, {args.numel} fp32, {args.bits} bits, {results[0][5]}, "
          f"mean per rank per call: process CPU {process_cpu_ms:.1f} ms, wall {wall_ms:.1f} ms")
    print(f"{'step':58s} {'cpu ms':>8s} {'wall ms':>8s} {'calls':>6s}")
    for name in sorted(per_call):
        depth = name.count("/")
        row = per_call[name]
        print(f"{'  ' * depth + name.split('/')[-1]:58s} {row['cpu_ms']:8.1f} "
              f"{row['wall_ms']:8.1f} {row['count']:6.1f}")
    names = sorted({name for r in results for name in r[6]})
    threads_ms = {name: 1e3 * sum(r[6].get(name, 0.0) for r in results) / len(results)
                  / args.repeats for name in names}
    print("process CPU by thread name (user + system, /proc; 10 ms ticks), ms per call:")
    for name in sorted(threads_ms, key=lambda k: -threads_ms[k]):
        if threads_ms[name] > 0:
            print(f"  {name:30s} {threads_ms[name]:8.1f}")
    if args.json:
        import numba

        import dqcoll

        payload = {
            "command": " ".join(sys.argv),
            "provenance": {"commit": _commit(), "dqcoll": dqcoll.__version__,
                           "dqcoll_path": os.path.dirname(os.path.abspath(dqcoll.__file__)),
                           "torch": torch.__version__, "numba": numba.__version__,
                           "cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(), "note": args.note,
                           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            "world_size": args.n, "numel": args.numel, "bits": args.bits,
            "algorithm": results[0][5], "kernels": results[0][4],
            "process_cpu_ms_per_call": process_cpu_ms, "wall_ms_per_call": wall_ms,
            "thread_cpu_ms_per_call": threads_ms,
            "steps": per_call,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)


if __name__ == "__main__":
    main()
