#!/usr/bin/env python3
"""Summary tables of docs/benchmarks.md from the result files, so the page is reproducible.

Reads ``benchmarks/results/bench64m-{loopback,netns-<rate>}-<n>.json`` (``dqcoll bench`` at 64 MiB,
dynamiq 5 bits with the fp32 and bf16 peers) and ``benchmarks/results/dynamiq-cpu-rates.json``
(``benchmarks/dynamiq_cpu_rates.py``) and prints, as markdown:

* per world size, one row per link: the three times, dynamiq's speed-up over each peer, and each
  row against its link floor (wire bytes / link rate);
* the crossover link rate below which dynamiq beats each peer, interpolated between the two
  measured link rates where the speed-up crosses 1;
* the codec rates per op, width and rounding, numba against the torch reference.

Usage: ``python tools/bench_summary.py [--results benchmarks/results]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path
from typing import Any

LINKS = [("loopback", None), ("10gbit", 10.0), ("1gbit", 1.0), ("200mbit", 0.2)]
LABELS = {"loopback": "loopback", "10gbit": "10 Gb/s", "1gbit": "1 Gb/s", "200mbit": "200 Mb/s"}


def _rows(results: Path, link: str, n: int) -> dict[str, dict[str, Any]] | None:
    name = "bench64m-loopback" if link == "loopback" else f"bench64m-netns-{link}"
    path = results / f"{name}-{n}.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    return {("dynamiq" if r["scheme"] == "dynamiq" else r["impl"].split()[-1]): r for r in rows}


def _crossover(points: list[tuple[float, float]]) -> str:
    """The link rate where dynamiq's speed-up over a peer crosses 1, interpolated linearly in
    log(rate) and log(speed-up) between the two measured rates around it."""
    points = sorted(points)
    for (r1, s1), (r2, s2) in itertools.pairwise(points):
        if (s1 - 1) * (s2 - 1) <= 0 and s1 != s2:
            frac = math.log(s1) / (math.log(s1) - math.log(s2))
            rate = math.exp(math.log(r1) + frac * (math.log(r2) - math.log(r1)))
            return (f"about {rate:.1f} Gb/s per link (speed-up {s1:.2f}x at {r1:g} Gb/s, "
                    f"{s2:.2f}x at {r2:g} Gb/s; interpolated in log-log)")
    if points and all(s > 1 for _, s in points):
        return f"dynamiq is faster at every measured rate up to {points[-1][0]:g} Gb/s"
    return "dynamiq is slower at every measured rate"


def link_tables(results: Path) -> str:
    out = []
    for n in (4, 2):
        out.append(f"\n**{n} ranks** (one process per rank, one kernel thread each)\n")
        out.append("| link | dynamiq 5 b (ms) | torch fp32 (ms) | torch bf16 (ms) | vs fp32 | "
                   "vs bf16 | dynamiq % of link floor | fp32 % of link floor | vNMSE |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        speedups: dict[str, list[tuple[float, float]]] = {"fp32": [], "bf16": []}
        for link, gbps in LINKS:
            rows = _rows(results, link, n)
            if rows is None or not {"dynamiq", "fp32", "bf16"} <= rows.keys():
                continue
            t = {k: rows[k]["time_us"] / 1e3 for k in ("dynamiq", "fp32", "bf16")}
            floors = {"dynamiq": "--", "fp32": "--"}
            if gbps:
                for peer in speedups:
                    speedups[peer].append((gbps, t[peer] / t["dynamiq"]))
                for k in floors:
                    floor_ms = rows[k]["wire_nbytes"] * 8 / (gbps * 1e9) * 1e3
                    floors[k] = f"{floor_ms / t[k] * 100:.0f} %"
            out.append(f"| {LABELS[link]} | {t['dynamiq']:.0f} | {t['fp32']:.0f} | "
                       f"{t['bf16']:.0f} | {t['fp32'] / t['dynamiq']:.2f}x | "
                       f"{t['bf16'] / t['dynamiq']:.2f}x | {floors['dynamiq']} | "
                       f"{floors['fp32']} | {rows['dynamiq']['vnmse']:.3g} |")
        for peer in ("fp32", "bf16"):
            out.append(f"\nCrossover vs {peer} ({n} ranks): {_crossover(speedups[peer])}")
    return "\n".join(out)


def rate_table(results: Path) -> str:
    path = results / "dynamiq-cpu-rates.json"
    if not path.exists():
        return ""
    data = json.loads(path.read_text())
    rate: dict[tuple[Any, ...], float] = {}
    for r in data["records"]:
        rate[(r["op"], r["width"], r["rounding"], r["kernels"])] = r["mcoords_per_s"]
    meta = data["meta"]
    out = [f"\n{meta['device']}, one thread, {meta['numel']} coordinates, rank 1 of "
           f"{meta['world_size']} (commit and date: `{path.name}`); M coordinates/s, "
           "numba / torch reference (speed-up)\n",
           "| op | rounding | 2 bits | 4 bits | 8 bits |", "|---|---|---:|---:|---:|"]
    for op in ("encode", "hop", "decode", "decode_accumulate"):
        for rounding in ("correlated", "independent"):
            cells = []
            for width in (2, 4, 8):
                fast = rate.get((op, width, rounding, "numba"), math.nan)
                ref = rate.get((op, width, rounding, "torch"), math.nan)
                cells.append(f"{fast:.0f} / {ref:.1f} ({fast / ref:.0f}x)")
            out.append(f"| {op} | {rounding} | " + " | ".join(cells) + " |")
    for op in ("stats", "restore"):
        fast = rate.get((op, None, None, "numba"), math.nan)
        ref = rate.get((op, None, None, "torch"), math.nan)
        out.append(f"| {op} | -- | {fast:.0f} / {ref:.1f} ({fast / ref:.0f}x) | | |")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path,
                        default=Path(__file__).resolve().parent.parent / "benchmarks" / "results")
    args = parser.parse_args()
    print(link_tables(args.results))
    print(rate_table(args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
