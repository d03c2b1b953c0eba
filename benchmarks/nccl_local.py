"""Per-hop codec overhead on a GPU: 8 ranks on one GPU through the ``local`` transport.

All ranks are threads of this process sharing one GPU; a message is a device-to-device copy, so
the transfers cost next to nothing and what is left is what a real cluster pays on top of its
network at every hop: the codec kernels (DynamiQ's stats/encode/decode-accumulate-encode/restore,
or ``none``'s casts and adds) and the host time that launches them. For each scheme and tile
setting this reports, for a ``--size`` buffer per rank (default 256 MiB of fp32):

* ``time_ms``: wall time of one all-reduce (all ranks, median of ``--iters``, after warm-up);
* ``kernel_ms``: GPU time inside kernels during one profiled all-reduce (all ranks together,
  torch.profiler / CUPTI), ``copy_ms`` the device copies (the ``local`` transport's messages);
* ``kernel_share``: ``kernel_ms / time_ms`` - how much of the wall time the GPU spends in kernels
  (near 1: kernel-bound; small: host-bound, launches and Python dominate);
* ``kernel_ms_per_rank``: ``kernel_ms / world_size``, the codec time one GPU would spend in a
  real cluster for its share of the collective;
* ``vnmse`` against the exact float64 sum and ``identical`` (every rank's result has the same
  bytes) - checked before any time is reported.

Usage: ``python benchmarks/nccl_local.py [--world-size 8 --size 256M --schemes none,dynamiq
--tile-nbytes 0,4M]``; ``--device cpu --size 1M`` is a smoke test of the script (its timings mean
nothing). Writes ``benchmarks/results/nccl_local-<device>.json`` with provenance (device, torch,
commit, world size) beside every row.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dqcoll  # noqa: E402
from dqcoll.cli.provenance import git_commit  # noqa: E402
from dqcoll.executor import DEFAULT_TILE_NBYTES  # noqa: E402
from dqcoll.testing import run_local  # noqa: E402


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)



def gradient(rank: int, numel: int, device: torch.device) -> torch.Tensor:
    """Gradient-like input of one rank: log-normal magnitude per 256 coordinates."""
    rows = -(-numel // 256)
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    shared = torch.Generator(device=device).manual_seed(1)
    magnitude = torch.exp(torch.randn(rows, 1, generator=shared, device=device) * 1.5)
    values = torch.randn(rows, 256, generator=g, device=device) * magnitude
    return values.reshape(-1)[:numel].contiguous()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profile_device_ms(fn: Any) -> tuple[float, float, float]:
    """(wall ms, kernel ms, copy ms) of one call of ``fn`` under torch.profiler (CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn()
        wall_ms = (time.perf_counter() - start) * 1e3
    kernel_us = copy_us = 0.0
    for event in prof.key_averages():
        self_us = float(getattr(event, "self_device_time_total", 0.0)
                        or getattr(event, "self_cuda_time_total", 0.0) or 0.0)
        if self_us <= 0:
            continue
        name = event.key.lower()
        if "memcpy" in name or "memset" in name:
            copy_us += self_us
        else:
            kernel_us += self_us
    return wall_ms, kernel_us / 1e3, copy_us / 1e3


def bench(scheme: str, tile_nbytes: int, args: argparse.Namespace, device: torch.device,
          exact: torch.Tensor) -> dict[str, Any]:
    n, numel = args.world_size, args.numel
    state: dict[str, Any] = {}

    def body(comm: dqcoll.Communicator, iterations: int, keep: bool) -> Any:
        times = []
        x = None
        for i in range(iterations):
            x = gradient(comm.rank, numel, device)
            _sync(device)
            comm.barrier()
            start = time.perf_counter()
            dqcoll.allreduce(x, scheme=scheme, algorithm=args.algorithm, bits=args.bits,
                             seed=3, step=i, tile_nbytes=tile_nbytes)
            _sync(device)
            comm.barrier()
            times.append(time.perf_counter() - start)
        if keep:
            assert x is not None
            state.setdefault("info", dict(comm.last_info))
            crc = zlib.crc32(x.cpu().view(torch.uint8).numpy().tobytes())
            return times, crc, (x.double() if comm.rank == 0 else None)
        return times, None, None

    # 1. correctness before timing: identical ranks, error against the exact sum
    results = run_local(n, body, 1, True, device=device, timeout_s=600)
    crcs = {crc for _, crc, _ in results}
    result0 = results[0][2]
    vnmse = float(((result0 - exact) ** 2).sum() / (exact ** 2).sum())
    del results, result0
    # 2. timing
    timed = run_local(n, body, args.iters, False, device=device, timeout_s=600)
    per_iteration = [max(t[i] for t, _, _ in timed) for i in range(args.iters)]
    time_ms = statistics.median(per_iteration) * 1e3
    row: dict[str, Any] = {
        "scheme": scheme, "tile_nbytes": tile_nbytes, "tiles": state["info"].get("tiles"),
        "algorithm": state["info"].get("algorithm"), "bits": state["info"].get("bits"),
        "time_ms": time_ms, "times_ms": [t * 1e3 for t in per_iteration],
        "algbw_gbps": numel * 4 / (time_ms / 1e3) / 1e9, "vnmse": vnmse,
        "identical": len(crcs) == 1,
    }
    # 3. kernel share: one profiled all-reduce (CUDA only)
    if device.type == "cuda" and not args.no_profile:
        wall_ms, kernel_ms, copy_ms = _profile_device_ms(
            lambda: run_local(n, body, 1, False, device=device, timeout_s=600))
        row.update(profiled_wall_ms=wall_ms, kernel_ms=kernel_ms, copy_ms=copy_ms,
                   kernel_ms_per_rank=kernel_ms / n, kernel_share=kernel_ms / wall_ms)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--size", default="256M", help="fp32 bytes per rank (K/M/G suffixes)")
    parser.add_argument("--schemes", default="none,dynamiq")
    parser.add_argument("--algorithm", default="butterfly")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--tile-nbytes", default=f"0,{DEFAULT_TILE_NBYTES}",
                        help="comma-separated tile sizes (0: untiled)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    args.numel = _size(args.size) // 4
    exact = torch.zeros(args.numel, dtype=torch.float64, device=device)
    for r in range(args.world_size):
        exact += gradient(r, args.numel, device).double()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"device": name, "torch": torch.__version__, "dqcoll": dqcoll.__version__,
            "commit": git_commit("benchmarks"), "world_size": args.world_size,
            "nbytes_per_rank": args.numel * 4,
            "transport": "local", "kernels": "auto (Triton on CUDA)"}
    rows = []
    print(f"# {meta}")
    print(f"{'scheme':<8} {'tile_B':>9} {'tiles':>5} {'time(ms)':>9} {'algbw':>7} "
          f"{'kernel(ms)':>10} {'copy(ms)':>9} {'k/rank':>7} {'k_share':>7} {'vnmse':>9} ident")
    for scheme in [s for s in args.schemes.split(",") if s]:
        for tile in [_size(t) for t in args.tile_nbytes.split(",")]:
            row = bench(scheme, tile, args, device, exact)
            row.update(meta)
            rows.append(row)
            print(f"{scheme:<8} {tile:>9} {row['tiles']!s:>5} {row['time_ms']:>9.2f} "
                  f"{row['algbw_gbps']:>7.2f} {row.get('kernel_ms', float('nan')):>10.2f} "
                  f"{row.get('copy_ms', float('nan')):>9.2f} "
                  f"{row.get('kernel_ms_per_rank', float('nan')):>7.2f} "
                  f"{row.get('kernel_share', float('nan')):>7.3f} {row['vnmse']:>9.3g} "
                  f"{'yes' if row['identical'] else 'NO'}", flush=True)
    by_scheme = {(r["scheme"], r["tile_nbytes"]): r for r in rows}
    for tile in [_size(t) for t in args.tile_nbytes.split(",")]:
        if ("none", tile) in by_scheme and ("dynamiq", tile) in by_scheme:
            ratio = by_scheme[("dynamiq", tile)]["time_ms"] / by_scheme[("none", tile)]["time_ms"]
            print(f"# tile_nbytes={tile}: dynamiq / none time = {ratio:.2f}")
    out = Path(args.out) if args.out else (
        ROOT / "benchmarks" / "results" / f"nccl_local-{name.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "records": rows}, indent=1))
    print(f"# wrote {out}")
    failed = [r for r in rows if not r["identical"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
