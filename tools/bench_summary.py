#!/usr/bin/env python3
"""Summary tables of docs/benchmarks.md from the result files, so the page is reproducible.

Reads ``benchmarks/results/bench64m-{loopback,netns-<rate>}-<n>.json`` (``dqcoll bench`` at 64 MiB,
dynamiq 5 bits with the fp32 and bf16 peers) and ``benchmarks/results/dynamiq-cpu-rates.json``
(``benchmarks/dynamiq_cpu_rates.py``) and prints, as markdown:

* per world size, one row per link: the three times, dynamiq's speed-up over each peer, and each
  row against its link floor (wire bytes / link rate);
* the crossover link rate below which dynamiq beats each peer: every time is fitted as
  ``T(rate) = c + wire_B * 8 / rate`` from the two slowest links (c: what the link does not
  explain, mostly CPU), and ``T_dynamiq = T_peer`` solved for the rate;
* the codec rates per op, width and rounding, numba against the torch reference.

Usage: ``python tools/bench_summary.py [--results benchmarks/results]``
"""

from __future__ import annotations

import argparse
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


def _fit(times: list[tuple[float, float]], wire: float) -> float:
    """``c`` of ``T = c + wire * 8 / rate`` (rate in Gb/s, T in s), least squares over points."""
    return sum(t - wire * 8 / (g * 1e9) for g, t in times) / len(times)


def link_tables(results: Path) -> str:
    out = []
    for n in (4, 2):
        out.append(f"\n**{n} ranks** (one process per rank, one kernel thread each)\n")
        out.append("| link | dynamiq 5 b (ms) | torch fp32 (ms) | torch bf16 (ms) | vs fp32 | "
                   "vs bf16 | dynamiq % of link floor | fp32 % of link floor | vNMSE |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        fits: dict[str, list[tuple[float, float]]] = {"dynamiq": [], "fp32": [], "bf16": []}
        wires: dict[str, float] = {}
        for link, gbps in LINKS:
            rows = _rows(results, link, n)
            if rows is None or not {"dynamiq", "fp32", "bf16"} <= rows.keys():
                continue
            t = {k: rows[k]["time_us"] / 1e3 for k in ("dynamiq", "fp32", "bf16")}
            floors = {"dynamiq": "--", "fp32": "--"}
            if gbps:
                for k in t:
                    wires[k] = rows[k]["wire_nbytes"]
                    if link != "10gbit":
                        fits[k].append((gbps, t[k] / 1e3))
                for k in floors:
                    floor_ms = rows[k]["wire_nbytes"] * 8 / (gbps * 1e9) * 1e3
                    floors[k] = f"{floor_ms / t[k] * 100:.0f} %"
            out.append(f"| {LABELS[link]} | {t['dynamiq']:.0f} | {t['fp32']:.0f} | "
                       f"{t['bf16']:.0f} | {t['fp32'] / t['dynamiq']:.2f}x | "
                       f"{t['bf16'] / t['dynamiq']:.2f}x | {floors['dynamiq']} | "
                       f"{floors['fp32']} | {rows['dynamiq']['vnmse']:.3g} |")
        if all(len(v) >= 2 for v in fits.values()):
            c = {k: _fit(v, wires[k]) for k, v in fits.items()}
            for peer in ("fp32", "bf16"):
                saved = (wires[peer] - wires["dynamiq"]) * 8
                extra = c["dynamiq"] - c[peer]
                if extra <= 0:
                    text = "dynamiq is ahead at every rate (its fixed cost is lower)"
                else:
                    text = f"{saved / extra / 1e9:.2f} Gb/s"
                out.append(f"\nCrossover vs {peer} ({n} ranks): {text} (fit T = c + wire/rate on "
                           f"1 Gb/s and 200 Mb/s: c = {c['dynamiq'] * 1e3:.0f} ms dynamiq, "
                           f"{c[peer] * 1e3:.0f} ms {peer})")
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
           f"{meta['world_size']}, commit {meta['commit']}, {meta['date_utc']}; M coordinates/s, "
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
