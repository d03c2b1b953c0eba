"""``dqcoll demo``: quantized all-reduce across several ranks on this machine.

Spawns ``--world-size`` processes (default 4) that join a gloo process group over loopback, each
holding a gradient-like buffer (default 16M coordinates) whose super-group magnitudes follow the
log-normal mixture fitted in the DynamiQ paper (most super-groups around e^-4, a fifth of them
around e^-16: strongly heavy-tailed). Every rank all-reduces it with ``none`` and ``dynamiq`` on
ring and butterfly; rank 0 prints one row per run:

* ``bits/coord``: the bytes this rank put on the wire (payload, scales, statistics, checks) per
  coordinate, normalised by the all-reduce's 2 (n-1)/n traffic factor, so fp32 reads 32;
* ``vNMSE`` against the exact sum computed in float64;
* ``time`` (median of 3 calls after an untimed one) and ``algbw`` (uncompressed bytes / time,
  as nccl-tests reports it);
* ``identical``: whether every rank ended with the same bits.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import zlib
from typing import Any

import torch
import torch.multiprocessing as mp

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


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))  # the ranks share these cores
    import dqcoll
    from dqcoll.metrics import vnmse

    comm = dqcoll.init("gloo", rank=rank, world_size=world_size, master_addr="127.0.0.1",
                       master_port=port)
    base = gradient_like(rank, args.numel, seed=args.seed)
    exact = None
    if rank == 0:
        exact = torch.zeros(args.numel, dtype=torch.float64)
        for r in range(world_size):
            exact += gradient_like(r, args.numel, seed=args.seed).double()
    rows = []
    for scheme in args.schemes:
        for algorithm in args.algorithms:
            # One untimed call (one-time costs), then the median of TIMED_CALLS calls, each from
            # the same input (a call is in place) and ended by a barrier on every rank.
            dqcoll.allreduce(base.clone(), scheme=scheme, algorithm=algorithm, bits=args.bits,
                             tile_nbytes=args.tile_nbytes)
            times = []
            for _ in range(TIMED_CALLS):
                x = base.clone()
                comm.barrier()
                comm.counters.reset()
                start = time.perf_counter()
                dqcoll.allreduce(x, scheme=scheme, algorithm=algorithm, bits=args.bits,
                                 tile_nbytes=args.tile_nbytes)
                comm.barrier()
                times.append(time.perf_counter() - start)
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
                    "bits_per_coord": float(stats[1]) * 8 / traffic,
                    "vnmse": vnmse(x, exact),
                    "time_ms": float(stats[0]) * 1e3,
                    "algbw_gbps": 4 * args.numel / float(stats[0]) / 1e9,
                    "identical": int(check[0]) == -int(check[1]),
                })
    if rank == 0:
        out.put(rows)
    comm.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dqcoll demo", description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", "-g", type=int, default=4)
    parser.add_argument("--numel", type=_parse_count, default=16 * 2**20,
                        help="coordinates per rank (suffix K/M/G), default 16M")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--schemes", nargs="+", default=["none", "dynamiq"])
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--tile-nbytes", type=_parse_count, default=LOOPBACK_TILE_NBYTES,
                        help="pipelining tile (fp32 bytes per chunk tile) for every row; default "
                        "16M: on loopback the link is free, so fewer tiles cost less host time "
                        "(the library's default, 4M, is for slow links)")
    args = parser.parse_args(argv)
    print(f"dqcoll demo: {args.world_size} ranks (processes, gloo over loopback), "
          f"{args.numel:,} fp32 coordinates each, DynamiQ at {args.bits:g} bits, "
          f"{args.tile_nbytes >> 20} MiB tiles", flush=True)
    if "dynamiq" in args.schemes:
        # Compile the CPU kernels here, once, before the ranks start (a fresh machine compiles
        # for ~1.5 min; later runs load numba's disk cache in ~2 s), rather than in every rank.
        from .. import kernels

        kernels.warm_up(torch.device("cpu"))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
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
    header = (f"{'scheme':<9}{'algorithm':<11}{'bits/coord':>11}{'vNMSE':>12}"
              f"{'time(ms)':>11}{'algbw(GB/s)':>13}  identical")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['scheme']:<9}{row['algorithm']:<11}{row['bits_per_coord']:>11.3f}"
              f"{row['vnmse']:>12.3e}{row['time_ms']:>11.1f}{row['algbw_gbps']:>13.3f}  "
              f"{'yes' if row['identical'] else 'NO'}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
