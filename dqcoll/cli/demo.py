"""``dqcoll demo``: quantized all-reduce across several ranks on this machine, on loopback, over
an emulated 1 Gb/s link, and on an emulated two-level cluster (2 hosts x 2 ranks).

Spawns ``--world-size`` processes (default 4) that join a gloo process group, each holding a
gradient-like buffer (default 16M coordinates) whose super-group magnitudes follow the log-normal
mixture fitted in the DynamiQ paper (most super-groups around e^-4, a fifth of them around
e^-16: strongly heavy-tailed). Every rank all-reduces it with the process group's own fp32
all-reduce (``torch``: gloo's, what DDP runs without a hook, the baseline of every speed-up),
with dqcoll's ``none`` (exact sums), ``bf16`` and ``dynamiq`` on ring and butterfly, ``dynamiq``
in two levels (exact inside hosts, dynamiq across; where there are hosts of several ranks), and
with the defaults (``scheme="auto"``, ``algorithm="auto"``: the planner's plan, named in the
row), three times:

* over **loopback** (the ranks share this machine's cores; the network costs only CPU);
* over an **emulated 1 Gb/s link** (``--link-rate``): one network namespace per rank, each with a
  veth port to a bridge capped at the rate in both directions by the kernel's ``tc tbf``
  (:mod:`dqcoll.cli.netns`). Real bytes go through a real rate limit: nothing is modelled. As root
  the namespaces are named ones; otherwise they live in one user namespace of this run (rootless;
  needs unprivileged user namespaces, and without them the demo says why and shows loopback only);
* on an **emulated two-level cluster** (``--hosts-layout``, by default 2 hosts of half the
  ranks each: 2 x 2): one namespace per host with one port capped at the link rate, the ranks
  of a host talking over that namespace's loopback, so only traffic between hosts crosses a
  slow link, as in a cluster of multi-GPU machines.

Rank 0 prints one row per (scheme, algorithm), with the times side by side:

* ``bits/coord``: the bytes this rank put on the wire (payload, scales, statistics, checks) per
  coordinate, normalised by the all-reduce's 2 (n-1)/n traffic factor, so fp32 reads 32;
* ``vNMSE`` against the exact sum computed in float64;
* ``time`` (median of 7 calls after an untimed one; the planned row after the planner settled:
  its probes, then its measured calls, the candidates it explores included, until two calls in
  a row ran the same plan without exploring, at least 6 and at most 24 untimed calls) and
  ``algbw`` (uncompressed bytes / time, as nccl-tests reports it);
* ``x fp32``: the ``torch`` row's time on the same network over the row's (>1: faster than
  the fp32 all-reduce a user would otherwise run);
* ``identical``: whether every rank ended with the same bits.

A row that cannot run (two levels on one host) reads "not available".

Rejected: a cost model for the link section (the point is to show what a user would measure), and
shaping ``lo`` (all ranks would share one qdisc: one link, not a port per rank).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from .local import parse_count, run_local_ranks

__all__ = ["gradient_like", "main"]

# DynamiQ paper's fit of super-group magnitudes (natural log): weights, means, std devs.
MIXTURE = ((0.79, -3.99, 1.22), (0.21, -16.41, 4.63))


def gradient_like(rank: int, numel: int, *, seed: int = 0) -> torch.Tensor:
    """Per-rank fp32 gradient: super-group magnitude M from the mixture (shared by all ranks),
    coordinates i.i.d. N(0, (M / 16)^2) per rank."""
    rows = -(-numel // 256)
    shared = torch.Generator().manual_seed(seed)
    pick = torch.rand(rows, generator=shared)
    log_m = torch.empty(rows)
    low = 0.0
    for weight, mu, sigma in MIXTURE:
        mask = (pick >= low) & (pick < low + weight)
        log_m[mask] = mu + sigma * torch.randn(int(mask.sum()), generator=shared)
        low += weight
    log_m[pick >= low] = MIXTURE[-1][1]
    magnitude = torch.exp(log_m) / 16.0
    own = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    values = torch.randn(rows, 256, generator=own) * magnitude[:, None]
    return values.reshape(-1)[:numel].contiguous()


# Calls of one configuration vary by about +-10 % on a 2-core machine (4 ranks share its cores):
# the median of 7, not 3, keeps the rows of a column comparable.
TIMED_CALLS = 7
# Untimed calls of a planned row (scheme="auto", algorithm="auto") before the timed ones: the
# first makes the planner (probes), the next are measured and calibrate it, as the first steps of
# a training job do; each candidate predicted close to the best runs once (explored), one a call,
# so with 8-10 candidates a job's first ~10 calls can include such runs. The row is timed once
# two calls in a row ran the same plan without exploring (the plan a job then keeps), after at
# least PLANNED_WARMUP_CALLS and at most PLANNED_WARMUP_MAX calls (the same count on every rank:
# plans are).
PLANNED_WARMUP_CALLS = 6
PLANNED_WARMUP_MAX = 24
TWO_LEVEL = "two-level"
# The row every speed-up is relative to: the process group's own fp32 all-reduce (gloo's), what
# DDP runs without a hook and what a user runs without dqcoll.
BASELINE = "torch"
BASELINE_ALGORITHM = "all_reduce"
# On loopback a link costs only CPU, so the fewer tile-steps (each ~0.5 ms of host time on the dev
# VM) the better, for every scheme alike: measured 4 ranks x 16M coordinates, none / dynamiq ring
# 233 / 262 ms at 4 MiB tiles and 200-220 / 196-204 ms at 16 MiB (dqcoll.executor's comment has
# why the library's default stays 4 MiB: slow links want the overlap of more tiles).
LOOPBACK_TILE_NBYTES = 16 << 20


def _digest(x: torch.Tensor) -> int:
    return zlib.crc32(x.contiguous().view(torch.uint8).numpy().tobytes())


def _settle(call: Any, comm: Any) -> int:
    """Run planned ``call`` until two in a row ran the same plan without exploring (at least
    PLANNED_WARMUP_CALLS in all, with the one before, at most PLANNED_WARMUP_MAX); the calls."""
    labels: list[str | None] = []
    for calls in range(2, PLANNED_WARMUP_MAX + 1):
        call()
        planned = comm.last_info.get("planned")
        settled = (isinstance(planned, dict)
                   and not str(planned.get("reason", "")).startswith("explored"))
        labels.append(planned["label"] if settled else None)
        if (calls >= PLANNED_WARMUP_CALLS and len(labels) >= 2 and labels[-1] is not None
                and labels[-1] == labels[-2]):
            return calls
    return PLANNED_WARMUP_MAX


def _measure(comm: Any, rank: int, world_size: int, args: argparse.Namespace,
             tile_nbytes: int | None) -> list[dict[str, Any]]:
    """Every (scheme, algorithm) row, run by every rank; the rows on rank 0 (empty elsewhere)."""
    import dqcoll
    from dqcoll.errors import InvalidArgumentError
    from dqcoll.metrics import vnmse
    from dqcoll.planner import discover_job
    from dqcoll.topology.hierarchical import HierarchicalPlan, LevelSpec

    base = gradient_like(rank, args.numel, seed=args.seed)
    exact = None
    if rank == 0:
        exact = torch.zeros(args.numel, dtype=torch.float64)
        for r in range(world_size):
            exact += gradient_like(r, args.numel, seed=args.seed).double()
    rows: list[dict[str, Any]] = []
    job = discover_job(comm.transport)  # the hosts, for the explicit two-level rows

    def run(x: torch.Tensor, scheme: str, algorithm: str) -> None:
        if scheme == BASELINE:  # the process group's own fp32 all-reduce: what DDP runs
            comm.transport.native_allreduce(x, what="demo torch all_reduce")
            comm.last_info = {"scheme": BASELINE}
            return
        if algorithm == TWO_LEVEL:  # exact inside hosts, the scheme across them
            if not job.two_level:
                raise InvalidArgumentError(f"{job.describe()}: no two levels")
            plan = HierarchicalPlan(job.hosts, LevelSpec("none", algorithm="ring"),
                                    LevelSpec(scheme, args.bits, "ring"))
            dqcoll.allreduce(x, algorithm=plan)
            return
        dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, bits=args.bits,
                         tile_nbytes=tile_nbytes)

    def run_fresh(scheme: str, algorithm: str) -> None:
        run(base.clone(), scheme, algorithm)

    for scheme in args.schemes:
        for algorithm in _algorithms(scheme, args):
            # Untimed calls first (one-time costs; a planned row: the planner's probes and its
            # first measured calls, as in the first steps of a job), then the median of
            # TIMED_CALLS calls, each from the same input (a call is in place) and ended by a
            # barrier on every rank.
            settled = 0
            try:
                run(base.clone(), scheme, algorithm)
                if algorithm == "auto":
                    settled = _settle(functools.partial(run_fresh, scheme, algorithm), comm)
            except InvalidArgumentError as exc:  # the same on every rank: argument check
                if rank == 0:
                    reason = str(exc).split(";")[0].splitlines()[0][:70]
                    rows.append({"scheme": scheme, "algorithm": algorithm,
                                 "status": f"not available ({reason})"})
                continue
            times = []
            for _ in range(TIMED_CALLS):
                x = base.clone()
                comm.barrier()
                comm.counters.reset()
                start = time.perf_counter()
                run(x, scheme, algorithm)
                comm.barrier()
                times.append(time.perf_counter() - start)
            planned = comm.last_info.get("planned")
            chosen = planned["label"] if isinstance(planned, dict) else ""
            elapsed_s = sorted(times)[len(times) // 2]
            stats = torch.tensor([elapsed_s, comm.counters["bytes_sent"], 0.0], dtype=torch.float64)
            digest = _digest(x)
            check = torch.tensor([digest, -digest], dtype=torch.int64)
            comm.transport.allreduce(stats, "max", what="demo stats")
            comm.transport.allreduce(check, "max", what="demo digest")
            if rank == 0:
                assert exact is not None
                traffic = 2 * (world_size - 1) / world_size * args.numel
                rows.append({
                    "scheme": scheme,
                    "algorithm": algorithm,
                    "status": "ok",
                    "chosen": f"{chosen} after {settled} calls" if scheme == "auto" else "",
                    "bits_per_coord": float(stats[1]) * 8 / traffic,
                    "vnmse": vnmse(x, exact),
                    "time_ms": float(stats[0]) * 1e3,
                    "algbw_gbps": 4 * args.numel / float(stats[0]) / 1e9,
                    "identical": int(check[0]) == -int(check[1]),
                })
    return rows


def _algorithms(scheme: str, args: argparse.Namespace) -> list[str]:
    """The rows of ``scheme``: the baseline's one; ``auto`` with ``algorithm="auto"`` too (the
    defaults, the planner's choice); the others on each of ``--algorithms``, and ``dynamiq`` in
    two levels as well (exact inside hosts, dynamiq across; where the cluster has them)."""
    if scheme == BASELINE:
        return [BASELINE_ALGORITHM]
    if scheme == "auto":
        return ["auto"]
    return list(args.algorithms) + ([TWO_LEVEL] if scheme == "dynamiq" else [])


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: Any) -> None:
    """One loopback rank (started by torch.multiprocessing's spawn)."""
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))  # the ranks share these cores
    import dqcoll

    comm = dqcoll.init("gloo", rank=rank, world_size=world_size, master_addr="127.0.0.1",
                       master_port=port)
    rows = _measure(comm, rank, world_size, args, args.tile_nbytes)
    if rank == 0:
        out.put(rows)
    comm.barrier()


def _env_rank(args: argparse.Namespace) -> int:
    """One rank of the link section: started in its namespace with the env:// variables (by
    :func:`dqcoll.cli.netns.run_cluster`); rank 0 writes the rows to ``--rows-json``."""
    torch.set_num_threads(1)
    import dqcoll

    comm = dqcoll.init("gloo")
    # 0: the library's default tile (None to the API, where 0 would mean untiled)
    rows = _measure(comm, comm.rank, comm.world_size, args, args.link_tile_nbytes or None)
    if comm.rank == 0:
        Path(args.rows_json).write_text(json.dumps(rows))
    comm.barrier()
    return 0


def _link_rows(args: argparse.Namespace, ranks_per_host: int = 1
               ) -> tuple[list[dict[str, Any]] | None, str]:
    """The rows over the emulated link (``ranks_per_host`` ranks in each host namespace), or
    None and why not; and how the link was emulated."""
    from . import netns

    mode = netns.choose_mode("auto")
    reason = netns.check_prerequisites(mode)
    if reason:
        return None, reason
    where = ("named, as root" if mode is netns.Mode.ROOT
             else "rootless: inside a user namespace of this run")
    hosts = args.world_size // ranks_per_host
    if ranks_per_host > 1:
        how = (f"{hosts} hosts x {ranks_per_host} ranks: a network namespace per host ({where}), "
               f"its ranks on its loopback, a veth port per host to a bridge capped at "
               f"{args.link_rate} in both directions by tc tbf")
    else:
        how = (f"{args.world_size} network namespaces ({where}), a veth port per rank to a "
               f"bridge, each port capped at {args.link_rate} in both directions by tc tbf: "
               "real bytes through a real rate limit")
    print(f"# over {args.link_rate}, {hosts}x{ranks_per_host}: {how} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="dqcoll-demo-") as tmp:
        rows_json = Path(tmp) / "rows.json"
        # (c10d warns on every rank that a namespace has no hostname to resolve; errors still show)
        command = ["env", "TORCH_CPP_LOG_LEVEL=ERROR", sys.executable, "-m", "dqcoll.cli.demo",
                   "--rank-from-env",
                   "--rows-json", str(rows_json), "--numel", str(args.numel),
                   "--bits", f"{args.bits:g}", "--seed", str(args.seed),
                   "--schemes", *args.schemes, "--algorithms", *args.algorithms,
                   "--link-tile-nbytes", str(args.link_tile_nbytes)]
        code = netns.run_cluster(args.world_size, args.link_rate, command, timeout_s=900.0,
                                 ranks_per_host=ranks_per_host)
        if code or not rows_json.exists():
            return None, f"the ranks on the emulated link failed (exit status {code})"
        return json.loads(rows_json.read_text()), how



def _run_loopback(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = run_local_ranks(_worker, args.world_size, args, what="demo")
    return rows


def _print_table(rows: list[dict[str, Any]],
                 columns: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """One line per (scheme, algorithm): bits and vNMSE (loopback run), and the time on loopback
    and on each emulated network that ran (``columns``: (label, rows)), each with its speed-up
    over that network's :data:`BASELINE` row."""
    by_column = [(label, {(r["scheme"], r["algorithm"]): r for r in other})
                 for label, other in columns]
    heads = "".join(f"{label + ' ms':>14}{'x fp32':>8}" for label, _ in columns)
    header = (f"{'scheme':<9}{'algorithm':<11}{'bits/coord':>11}{'vNMSE':>12}"
              f"{'loopback ms':>13}{'x fp32':>8}{heads}  identical")
    print(header)
    print("-" * len(header))
    none_ms = _baseline_ms(rows)
    column_none_ms = [_baseline_ms(list(other.values())) for _, other in by_column]
    for row in rows:
        name = f"{row['scheme']:<9}{row['algorithm']:<11}"
        key = (row["scheme"], row["algorithm"])
        elsewhere = [other[key] for _, other in by_column
                     if key in other and other[key]["status"] == "ok"]
        if row["status"] != "ok" and not elsewhere:
            print(name + row["status"])
            continue
        ok = row["status"] == "ok"
        ref = row if ok else elsewhere[0]  # bits and error where it ran (two levels: hosts)
        line = (f"{name}{ref['bits_per_coord']:>11.3f}{ref['vnmse']:>12.3e}"
                + (f"{row['time_ms']:>13.1f}{_ratio(none_ms, row):>8}" if ok
                   else f"{'-':>13}{'':>8}"))
        identical = ref["identical"]
        chosen = [f"loopback: {row['chosen']}"] if ok and row.get("chosen") else []
        for (label, other), other_none in zip(by_column, column_none_ms, strict=True):
            cell = other.get((row["scheme"], row["algorithm"]))
            if cell is None or cell["status"] != "ok":
                line += f"{'-':>14}{'':>8}"
                continue
            line += (f"{cell['time_ms']:>14.1f}"
                     f"{_ratio(other_none, cell):>8}")
            identical = identical and cell["identical"]
            if cell.get("chosen"):
                chosen.append(f"{label}: {cell['chosen']}")
        print(f"{line}  {'yes' if identical else 'NO'}"
              + (f"  (chose {', '.join(chosen)})" if chosen else ""))


def _parse_layout(parser: argparse.ArgumentParser,
                  args: argparse.Namespace) -> tuple[int, int] | None:
    """``--hosts-layout`` as (hosts, ranks per host), or None for ``off``."""
    if args.hosts_layout == "auto":
        even = args.world_size >= 4 and args.world_size % 2 == 0
        return (2, args.world_size // 2) if even else None
    if args.hosts_layout == "off":
        return None
    try:
        hosts, per_host = (int(part) for part in args.hosts_layout.lower().split("x"))
    except ValueError:
        parser.error(f"--hosts-layout must look like 2x2 or be 'off', got {args.hosts_layout!r}")
    if hosts < 2 or per_host < 2 or hosts * per_host != args.world_size:
        parser.error(f"--hosts-layout {args.hosts_layout}: needs at least 2 hosts of at least 2 "
                     f"ranks, {args.world_size} (--world-size) in all")
    return hosts, per_host


def _baseline_ms(rows: list[dict[str, Any]]) -> float | None:
    """The time of the network's :data:`BASELINE` row (the group's own fp32 all-reduce)."""
    return next((r["time_ms"] for r in rows if r["scheme"] == BASELINE and r["status"] == "ok"),
                None)


def _ratio(none_ms: float | None, row: dict[str, Any]) -> str:
    """Speed-up over the baseline row on the same network (>1: faster than torch's fp32)."""
    return f"{none_ms / row['time_ms']:.2f}x" if none_ms else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dqcoll demo", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", "-g", type=int, default=4)
    parser.add_argument("--numel", type=parse_count, default=16 * 2**20,
                        help="coordinates per rank (suffix K/M/G), default 16M")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", nargs="+",
                        default=[BASELINE, "none", "bf16", "dynamiq", "auto"],
                        help=f"'{BASELINE}': the process group's own fp32 all-reduce, the "
                        "baseline of the x fp32 columns; the others are dqcoll schemes")
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--tile-nbytes", type=parse_count, default=LOOPBACK_TILE_NBYTES,
                        help="pipelining tile on loopback (fp32 bytes per chunk tile) for every "
                        "row; default 16M: on loopback the link is free, so fewer tiles cost "
                        "less host time")
    parser.add_argument("--link-rate", default="1gbit",
                        help="rate of the emulated link (tc syntax), or 'off' for loopback only")
    parser.add_argument("--hosts-layout", default="auto",
                        help="the two-level cluster, HOSTSxRANKS (HOSTS x RANKS = --world-size), "
                        "at --link-rate between hosts; auto: 2 hosts where the world size is "
                        "even and at least 4 (2x2 for the default 4 ranks); off: none")
    parser.add_argument("--link-tile-nbytes", type=parse_count, default=0,
                        help="pipelining tile over the link; 0: the library's default (4M), "
                        "which slow links need for the overlap of codec and transfer")
    parser.add_argument("--rank-from-env", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rows-json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_from_env:
        return _env_rank(args)
    print(f"dqcoll demo: {args.world_size} ranks (processes, gloo), {args.numel:,} fp32 "
          f"coordinates each, DynamiQ at {args.bits:g} bits; loopback with "
          f"{args.tile_nbytes >> 20} MiB tiles", flush=True)
    if any(s in ("dynamiq", "auto") for s in args.schemes):
        # Compile the CPU kernels here, once, before the ranks start (a fresh machine compiles
        # for a few minutes; later runs load numba's disk cache in ~2 s), rather than in every
        # rank.
        from .. import kernels

        kernels.warm_up(torch.device("cpu"))
    layout = _parse_layout(parser, args)
    rows = _run_loopback(args)
    columns: list[tuple[str, list[dict[str, Any]]]] = []
    if args.link_rate != "off":
        for ranks_per_host in (1, *(() if layout is None else (layout[1],))):
            label = (args.link_rate if ranks_per_host == 1
                     else f"{args.world_size // ranks_per_host}x{ranks_per_host} {args.link_rate}")
            link_rows, how = _link_rows(args, ranks_per_host)
            if link_rows is None:
                print(f"# no {label} section: {how}", flush=True)
                continue
            columns.append((label, link_rows))
    print()
    _print_table(rows, columns)
    if columns:
        print(f"\n{args.link_rate}: one network namespace per rank; HxG {args.link_rate}: H "
              f"namespaces (hosts) of G ranks that talk over the namespace's loopback. Each "
              f"namespace has one veth port to a bridge, capped at {args.link_rate} per port "
              f"and direction by tc tbf (dqcoll.cli.netns); library default tiles. x fp32: "
              f"speed-up over the '{BASELINE}' row (the process group's own fp32 all-reduce, "
              "gloo's) on the same network.")
    every = [*rows, *(r for _, column in columns for r in column)]
    return 0 if all(r.get("identical", True) for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
