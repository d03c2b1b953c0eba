"""``dqcoll demo``: quantized all-reduce across several ranks on this machine, on loopback and
over an emulated 1 Gb/s link.

Spawns ``--world-size`` processes (default 4) that join a gloo process group, each holding a
gradient-like buffer (default 16M coordinates) whose super-group magnitudes follow the log-normal
mixture fitted in the DynamiQ paper (most super-groups around e^-4, a fifth of them around
e^-16: strongly heavy-tailed). Every rank all-reduces it with ``none`` (fp32), ``bf16``,
``dynamiq`` and ``auto`` on ring and butterfly, twice:

* over **loopback** (the ranks share this machine's cores; the network costs only CPU);
* over an **emulated 1 Gb/s link** (``--link-rate``): one network namespace per rank, each with a
  veth port to a bridge capped at the rate in both directions by the kernel's ``tc tbf``
  (:mod:`dqcoll.cli.netns`). Real bytes go through a real rate limit: nothing is modelled. As root
  the namespaces are named ones; otherwise they live in one user namespace of this run (rootless;
  needs unprivileged user namespaces, and without them the demo says why and shows loopback only).

Rank 0 prints one row per (scheme, algorithm), with the two times side by side:

* ``bits/coord``: the bytes this rank put on the wire (payload, scales, statistics, checks) per
  coordinate, normalised by the all-reduce's 2 (n-1)/n traffic factor, so fp32 reads 32;
* ``vNMSE`` against the exact sum computed in float64;
* ``time`` (median of 3 calls after an untimed one) and ``algbw`` (uncompressed bytes / time,
  as nccl-tests reports it);
* ``identical``: whether every rank ended with the same bits.

A row whose scheme this dqcoll does not have (``auto`` before it exists) reads "not available".

Rejected: a cost model for the link section (the point is to show what a user would measure), and
shaping ``lo`` (all ranks would share one qdisc: one link, not a port per rank).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from .ports import rendezvous_port

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


TIMED_CALLS = 3
# On loopback a link costs only CPU, so the fewer tile-steps (each ~0.5 ms of host time on the dev
# VM) the better, for every scheme alike: measured 4 ranks x 16M coordinates, none / dynamiq ring
# 233 / 262 ms at 4 MiB tiles and 200-220 / 196-204 ms at 16 MiB (dqcoll.executor's comment has
# why the library's default stays 4 MiB: slow links want the overlap of more tiles).
LOOPBACK_TILE_NBYTES = 16 << 20


def _digest(x: torch.Tensor) -> int:
    return zlib.crc32(x.contiguous().view(torch.uint8).numpy().tobytes())


def _measure(comm: Any, rank: int, world_size: int, args: argparse.Namespace,
             tile_nbytes: int) -> list[dict[str, Any]]:
    """Every (scheme, algorithm) row, run by every rank; the rows on rank 0 (empty elsewhere)."""
    import dqcoll
    from dqcoll.errors import InvalidArgumentError
    from dqcoll.metrics import vnmse

    base = gradient_like(rank, args.numel, seed=args.seed)
    exact = None
    if rank == 0:
        exact = torch.zeros(args.numel, dtype=torch.float64)
        for r in range(world_size):
            exact += gradient_like(r, args.numel, seed=args.seed).double()
    rows: list[dict[str, Any]] = []
    for scheme in args.schemes:
        for algorithm in args.algorithms:
            # One untimed call (one-time costs), then the median of TIMED_CALLS calls, each from
            # the same input (a call is in place) and ended by a barrier on every rank.
            try:
                dqcoll.allreduce(base.clone(), scheme=scheme, algorithm=algorithm,
                                 bits=args.bits, tile_nbytes=tile_nbytes)
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
                dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, bits=args.bits,
                                 tile_nbytes=tile_nbytes)
                comm.barrier()
                times.append(time.perf_counter() - start)
            chosen = comm.last_info.get("scheme")
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
                    "chosen": chosen if isinstance(chosen, str) and chosen != scheme else "",
                    "bits_per_coord": float(stats[1]) * 8 / traffic,
                    "vnmse": vnmse(x, exact),
                    "time_ms": float(stats[0]) * 1e3,
                    "algbw_gbps": 4 * args.numel / float(stats[0]) / 1e9,
                    "identical": int(check[0]) == -int(check[1]),
                })
    return rows


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
    rows = _measure(comm, comm.rank, comm.world_size, args, args.link_tile_nbytes)
    if comm.rank == 0:
        Path(args.rows_json).write_text(json.dumps(rows))
    comm.barrier()
    return 0


def _link_rows(args: argparse.Namespace) -> tuple[list[dict[str, Any]] | None, str]:
    """The rows over the emulated link, or None and why not; and how the link was emulated."""
    from . import netns

    mode = netns.choose_mode("auto")
    reason = netns.check_prerequisites(mode)
    if reason:
        return None, reason
    where = ("named, as root" if mode is netns.Mode.ROOT
             else "rootless: inside a user namespace of this run")
    how = (f"{args.world_size} network namespaces ({where}), a veth port per rank to a "
           f"bridge, each port capped at {args.link_rate} in both directions by tc tbf: "
           "real bytes through a real rate limit")
    print(f"# over {args.link_rate}: {how} ...", flush=True)
    with tempfile.TemporaryDirectory(prefix="dqcoll-demo-") as tmp:
        rows_json = Path(tmp) / "rows.json"
        # (c10d warns on every rank that a namespace has no hostname to resolve; errors still show)
        command = ["env", "TORCH_CPP_LOG_LEVEL=ERROR", sys.executable, "-m", "dqcoll.cli.demo",
                   "--rank-from-env",
                   "--rows-json", str(rows_json), "--numel", str(args.numel),
                   "--bits", f"{args.bits:g}", "--seed", str(args.seed),
                   "--schemes", *args.schemes, "--algorithms", *args.algorithms,
                   "--link-tile-nbytes", str(args.link_tile_nbytes)]
        code = netns.run_cluster(args.world_size, args.link_rate, command, timeout_s=900.0)
        if code or not rows_json.exists():
            return None, f"the ranks on the emulated link failed (exit status {code})"
        return json.loads(rows_json.read_text()), how



def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _run_loopback(args: argparse.Namespace) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = rendezvous_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world_size, port, args, out))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    rows = None
    try:
        while rows is None:
            try:
                rows = out.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        "a demo rank failed: exit codes "
                        f"{[p.exitcode for p in procs]}"
                    ) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return rows


def _print_table(rows: list[dict[str, Any]], link_rows: list[dict[str, Any]] | None,
                 link_rate: str) -> None:
    """One line per (scheme, algorithm): bits and vNMSE (loopback run), and the time on loopback
    and, where it ran, over the link."""
    link = {(r["scheme"], r["algorithm"]): r for r in link_rows or []}
    link_head = f"{link_rate + ' ms':>12}{'x none':>8}" if link_rows is not None else ""
    header = (f"{'scheme':<9}{'algorithm':<11}{'bits/coord':>11}{'vNMSE':>12}"
              f"{'loopback ms':>13}{'x none':>8}{link_head}  identical")
    print(header)
    print("-" * len(header))
    none_ms = {r["algorithm"]: r["time_ms"] for r in rows
               if r["scheme"] == "none" and r["status"] == "ok"}
    link_none_ms = {r["algorithm"]: r["time_ms"] for r in link.values()
                    if r["scheme"] == "none" and r["status"] == "ok"}
    for row in rows:
        name = f"{row['scheme']:<9}{row['algorithm']:<11}"
        if row["status"] != "ok":
            print(name + row["status"])
            continue
        line = (f"{name}{row['bits_per_coord']:>11.3f}{row['vnmse']:>12.3e}"
                f"{row['time_ms']:>13.1f}{_ratio(none_ms.get(row['algorithm']), row):>8}")
        identical = row["identical"]
        other = link.get((row["scheme"], row["algorithm"]))
        if link_rows is not None:
            if other is None or other["status"] != "ok":
                line += f"{'-':>12}{'':>8}"
            else:
                line += (f"{other['time_ms']:>12.1f}"
                         f"{_ratio(link_none_ms.get(row['algorithm']), other):>8}")
                identical = identical and other["identical"]
        chosen = [f"{where}: {r['chosen']}" for where, r in (("loopback", row),
                                                              (link_rate, other or {}))
                  if r.get("chosen")]
        print(f"{line}  {'yes' if identical else 'NO'}"
              + (f"  (chose {', '.join(chosen)})" if chosen else ""))


def _ratio(none_ms: float | None, row: dict[str, Any]) -> str:
    """Speed-up over ``none`` on the same algorithm and network (>1: faster than fp32)."""
    return f"{none_ms / row['time_ms']:.2f}x" if none_ms else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dqcoll demo", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", "-g", type=int, default=4)
    parser.add_argument("--numel", type=_parse_count, default=16 * 2**20,
                        help="coordinates per rank (suffix K/M/G), default 16M")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", nargs="+", default=["none", "bf16", "dynamiq", "auto"])
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--tile-nbytes", type=_parse_count, default=LOOPBACK_TILE_NBYTES,
                        help="pipelining tile on loopback (fp32 bytes per chunk tile) for every "
                        "row; default 16M: on loopback the link is free, so fewer tiles cost "
                        "less host time")
    parser.add_argument("--link-rate", default="1gbit",
                        help="rate of the emulated link (tc syntax), or 'off' for loopback only")
    parser.add_argument("--link-tile-nbytes", type=_parse_count, default=0,
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
    rows = _run_loopback(args)
    link_rows: list[dict[str, Any]] | None = None
    if args.link_rate != "off":
        link_rows, how = _link_rows(args)
        if link_rows is None:
            print(f"# no {args.link_rate} section: {how}; showing loopback only", flush=True)
    print()
    _print_table(rows, link_rows, args.link_rate)
    if link_rows is not None:
        print(f"\n{args.link_rate}: {args.world_size} network namespaces, one veth port per "
              f"rank to a bridge, capped at {args.link_rate} per port and direction by tc tbf "
              f"(dqcoll.cli.netns); library default tiles. x none: speed-up over 'none' on the "
              "same algorithm and network.")
    every = [*rows, *(link_rows or [])]
    return 0 if all(r.get("identical", True) for r in every) else 1


if __name__ == "__main__":
    sys.exit(main())
