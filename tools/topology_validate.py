#!/usr/bin/env python3
"""Validate the cost model (dqcoll/topology/cost.py) against measured gloo all-reduces here.

Three sub-commands:

``calibrate``
    single-process, single-thread codec timings on this CPU (ns per coordinate of dynamiq's
    encode and decode-accumulate, the statistics pass, and none's copy/add), written as kernel
    rate records the cost model reads (``dqcoll.topology.cost.load_kernel_rates``).
``run --mode loopback|netns [--rate 1gbit]``
    ``n`` ranks (processes) over gloo - on loopback, or one per network namespace through
    ``tools/netns_cluster.py exec`` with tbf-capped links - time ``dqcoll.allreduce`` for every
    scheme x algorithm x size (median of ``--iters`` after a warm-up, the slowest rank's time per
    iteration), then fit the link (latency and bandwidth) on the ``none`` ring runs only and
    predict every other run with the cost model: the table and the JSON report list the
    prediction error of each held-out configuration.
``worker``
    the per-rank body (env:// variables), used by ``run``.

The CPU "device" of the model is the whole host: ranks share its cores, so the per-rank kernel
rate is the single-thread rate divided by the number of cores (each rank runs one torch thread).

Rejected: fitting every parameter to the validation runs themselves (a model fitted to what it
predicts validates nothing); only the two link figures are fitted, on the none/ring runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from dqcoll.cli.provenance import git_commit

SCHEMES = (("none", None), ("dynamiq", 5.0))
ALGORITHMS = ("ring", "butterfly", "direct")


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _time_on(fn, repeat: int = 5, clock=time.thread_time) -> float:  # type: ignore[no-untyped-def]
    """Median time of ``fn`` on ``clock``: thread CPU time (what the codec costs on an idle
    core) or wall time (what one process gets of a shared, busy machine right now)."""
    fn()
    samples = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
    return statistics.median(samples)


def calibrate(numel: int = 1 << 18, clock: str = "thread") -> list[dict[str, object]]:
    """Kernel rates. ``clock="thread"``: per *host* (single-thread CPU time / cores: the ranks
    share the host's cores). ``clock="wall"``: per *rank* (single-process wall time under the
    current load, each rank being one more process competing for the cores)."""
    from dqcoll.kernels import codec, dynamiq_ops

    torch.set_num_threads(1)
    os.environ["DQCOLL_CPU_THREADS"] = "1"
    ops = dynamiq_ops(torch.device("cpu"))  # the kernels a CPU call runs (numba when importable)
    timer = time.thread_time if clock == "thread" else time.perf_counter

    def _time(fn, repeat: int = 5):  # type: ignore[no-untyped-def]
        return _time_on(fn, repeat, timer)

    rows = numel // 256
    x = torch.randn(rows, 256)
    valid = torch.full((rows,), 256)
    index = torch.arange(rows, dtype=torch.int64) * 256
    config = codec.CodecConfig()
    records = codec.encode_torch(x, 4, index, 1, 4, 7, config)
    acc = torch.zeros_like(x)
    out = torch.empty_like(records)
    enc = _time(lambda: ops.encode(x, 4, index, 1, 4, 7, config, out=out)) / numel * 1e9
    dec = _time(lambda: ops.decode_accumulate(records, 4, config, acc)) / numel * 1e9
    stats = _time(lambda: ops.stats_center(x, valid)) / numel * 1e9 * 2  # + restore
    flat = x.reshape(-1)
    copy = _time(lambda: flat.view(torch.uint8).clone()) / numel * 1e9
    add = _time(lambda: acc.view(-1).add_(flat)) / numel * 1e9
    cores = _cores() if clock == "thread" else 1
    return [
        {"device": "cpu", "scheme": "dynamiq", "kernels": ops.name, "compress_ns": enc / cores,
         "decompress_ns": dec / cores, "stats_ns": stats / cores,
         "single_thread_ns": {"encode": enc, "decode_accumulate": dec, "stats": stats}},
        {"device": "cpu", "scheme": "none", "compress_ns": copy / cores,
         "decompress_ns": add / cores, "stats_ns": 0.0,
         "single_thread_ns": {"copy": copy, "add": add}},
    ]


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    import dqcoll

    torch.set_num_threads(1)
    comm = dqcoll.init("gloo")
    rank, n = comm.rank, comm.world_size
    rows = []
    for nbytes in args.sizes:
        numel = nbytes // 4
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        for scheme, bits in SCHEMES:
            for algorithm in ALGORITHMS:
                buf = x.clone()
                times = []
                for i in range(args.iters + 1):
                    buf.copy_(x)
                    dist.barrier()
                    t0 = time.perf_counter()
                    dqcoll.allreduce(buf, scheme=scheme, bits=bits or 5.0, algorithm=algorithm)
                    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if i:  # the first is the warm-up
                        times.append(float(elapsed) * 1e6)
                # The fastest iteration: on a machine shared with other jobs, the others only
                # ever add time (scheduling delays), so the minimum is the least disturbed.
                rows.append({"nbytes": nbytes, "scheme": scheme, "bits": bits,
                             "algorithm": algorithm, "time_us": min(times),
                             "median_us": statistics.median(times), "samples_us": times})
                if rank == 0:
                    print(f"{nbytes:>10} {scheme:<8} {algorithm:<10} {min(times):12.0f} us "
                          f"(median {statistics.median(times):.0f})", flush=True)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": n, "rows": rows}, f)
    dist.barrier()
    return 0


def _launch_loopback(n: int, command: list[str]) -> int:
    from dqcoll.cli.ports import rendezvous_port

    port = rendezvous_port()  # outside the ephemeral range (see dqcoll/cli/ports.py)
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(command, env=env,
                                      stdout=None if rank == 0 else subprocess.DEVNULL))
    return max(p.wait() for p in procs)



def _predict(rows, topology, params):  # type: ignore[no-untyped-def]
    from dqcoll.topology.cost import price_allreduce

    return [price_allreduce(r["algorithm"], topology, r["nbytes"], scheme=r["scheme"],
                            bits=r["bits"], params=params).total_us for r in rows]


def _fit_link(rows, make_topology, params):  # type: ignore[no-untyped-def]
    """Latency and bandwidth minimising the relative error on the none/ring rows."""
    fit_rows = [r for r in rows if r["scheme"] == "none" and r["algorithm"] == "ring"]
    best = None
    for gbps in [0.05 * 1.2**k for k in range(45)]:
        for latency in [5.0 * 1.25**k for k in range(40)]:
            topology = make_topology(gbps, latency)
            pred = _predict(fit_rows, topology, params)
            err = sum(abs(p / r["time_us"] - 1) for p, r in zip(pred, fit_rows, strict=True))
            if best is None or err < best[0]:
                best = (err, gbps, latency)
    assert best is not None
    return best[1], best[2]


def run(args: argparse.Namespace) -> int:
    from dqcoll.topology.cost import CostParams, KernelRates
    from dqcoll.topology.graph import LinkKind, Topology

    n = args.world_size
    raw = args.out.replace(".json", "-raw.json")
    command = [sys.executable, os.path.abspath(__file__), "worker", "--out", raw,
               "--iters", str(args.iters), "--sizes", *map(str, args.sizes)]
    load_before = os.getloadavg()
    start = time.time()
    if args.predict_only:  # re-price an earlier measurement
        raw = args.predict_only
    elif args.mode == "loopback":
        code = _launch_loopback(n, command)
    else:
        code = subprocess.call([sys.executable, "tools/netns_cluster.py", "exec", "-n", str(n),
                                "--rate", args.rate, "--", *command])
    if not args.predict_only and code:
        print(f"ranks failed with exit code {code}", file=sys.stderr)
        return code
    load_after = os.getloadavg()
    with open(raw) as f:
        rows = json.load(f)["rows"]
    rates = calibrate(clock=args.clock)
    params = CostParams(message_us=0.0, kernel_rates=tuple(
        (("cpu", str(r["scheme"])), KernelRates(float(r["compress_ns"]),  # type: ignore[arg-type]
                                                 float(r["decompress_ns"]),  # type: ignore[arg-type]
                                                 float(r["stats_ns"])))  # type: ignore[arg-type]
        for r in rates))

    def make_topology(gbps: float, latency: float) -> Topology:
        shared = args.clock == "thread"  # see calibrate()
        if args.mode == "loopback":
            return Topology.single_host(n, kind=LinkKind.LOOPBACK, bandwidth_gbps=gbps,
                                        latency_us=latency, shared_device=shared)
        return Topology.flat(n, bandwidth_gbps=gbps, latency_us=latency, shared_device=shared)

    gbps, latency = _fit_link(rows, make_topology, params)
    topology = make_topology(gbps, latency)
    predicted = _predict(rows, topology, params)
    table = []
    for r, p in zip(rows, predicted, strict=True):
        held_out = not (r["scheme"] == "none" and r["algorithm"] == "ring")
        table.append({**{k: r[k] for k in ("nbytes", "scheme", "bits", "algorithm", "time_us")},
                      "predicted_us": p, "error": p / r["time_us"] - 1, "held_out": held_out})
    held = [abs(t["error"]) for t in table if t["held_out"]]
    summary = {
        "mode": args.mode, "rate": args.rate if args.mode == "netns" else None,
        "world_size": n, "clock": args.clock, "fitted_link_gbps": gbps,
        "fitted_latency_us": latency,
        "kernel_rates": rates, "rows": table,
        "mean_abs_error_held_out": statistics.mean(held),
        "median_abs_error_held_out": statistics.median(held),
        "max_abs_error_held_out": max(held),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "load_avg_before_after": [load_before[0], load_after[0]],
        "commit": git_commit("tools"), "wall_s": time.time() - start,
        "command": "tools/topology_validate.py " + " ".join(sys.argv[1:]),
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(f"fitted on none/ring: link {gbps:.3f} Gb/s, latency {latency:.0f} us")
    print(f"{'size(B)':>10} {'scheme':<8} {'algorithm':<10} {'measured':>11} {'predicted':>11} "
          f"{'error':>7}")
    for t in table:
        mark = "" if t["held_out"] else "  (fit)"
        print(f"{t['nbytes']:>10} {t['scheme']:<8} {t['algorithm']:<10} {t['time_us']:>11.0f} "
              f"{t['predicted_us']:>11.0f} {100 * t['error']:>6.0f}%{mark}")
    print(f"held-out |error|: mean {100 * summary['mean_abs_error_held_out']:.0f}%, median "
          f"{100 * summary['median_abs_error_held_out']:.0f}%, max "
          f"{100 * summary['max_abs_error_held_out']:.0f}%; wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("calibrate")
    c.add_argument("--out", default=None)
    c.add_argument("--clock", choices=("thread", "wall"), default="thread")
    w = sub.add_parser("worker")
    w.add_argument("--out", required=True)
    w.add_argument("--iters", type=int, default=3)
    w.add_argument("--sizes", type=int, nargs="+", required=True)
    r = sub.add_parser("run")
    r.add_argument("--mode", choices=("loopback", "netns"), default="loopback")
    r.add_argument("--rate", default="1gbit")
    r.add_argument("-n", "--world-size", type=int, default=4)
    r.add_argument("--iters", type=int, default=5)
    r.add_argument("--sizes", type=int, nargs="+", default=[1 << 18, 1 << 20, 1 << 22])
    r.add_argument("--out", default="benchmarks/results/topology-validation-loopback.json")
    r.add_argument("--clock", choices=("thread", "wall"), default="thread",
                   help="kernel calibration: thread CPU time on an idle machine (per host), or "
                   "wall time under the current load (per rank); see calibrate()")
    r.add_argument("--predict-only", default=None, metavar="RAW_JSON",
                   help="skip the measurement: price the rows of an earlier run's -raw.json")
    args = p.parse_args(argv)
    if args.action == "worker":
        return worker(args)
    if args.action == "calibrate":
        rates = calibrate(clock=args.clock)
        text = json.dumps({"device": "cpu", "records": rates}, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        print(text)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
