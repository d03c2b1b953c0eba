#!/usr/bin/env python3
"""Error-targeted DynamiQ: does ``target_vnmse`` hit its target, and at what cost in bits?

For each source, algorithm and target: two all-reduces with ``target_vnmse=target`` on one
communicator (8 ranks, threads over the ``local`` transport), as a training loop would run them.
The first call assumes uncorrelated ranks (rho = 0); every rank then measures rho from the
decoded aggregate, and the second call (another seed) uses it. Both are reported; the checks
apply to the second (steady state). A bisection over fixed budgets (``bits=b, max_width=16``,
same data and seed as the second call) finds the smallest budget whose achieved vNMSE meets the
target. The issue's checks: achieved / target within 0.5..1.5, and bits spent within 0.5 bit of
that smallest budget.

Writes docs/target_vnmse.md and .json (command, machine, commit recorded). About 10 minutes on
the 2-core dev VM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

import dqcoll
from dqcoll.cli.provenance import git_commit
from dqcoll.eval.sources import make_source
from dqcoll.metrics import vnmse
from dqcoll.testing import run_local

SOURCES = {
    "gaussian": "gaussian",
    "lognormal-mixture": "lognormal-mixture:supergroups=1024",
    "stdlib-lm": "stdlib-lm",
}


def run(source, algorithm: str, seed: int, calls: int = 1, **options) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """(vNMSE, bits) of ``calls`` consecutive all-reduces (seeds seed, seed+1, ...) on one
    communicator."""
    tensors = source.tensors()
    exact = source.exact_sum()

    def body(comm):  # type: ignore[no-untyped-def]
        out = []
        for call in range(calls):
            x = tensors[comm.rank].clone()
            comm.counters.reset()
            dqcoll.allreduce(x, algorithm=algorithm, seed=seed + call, **options)
            out.append((x, comm.counters["bytes_sent"]))
        return out

    results = run_local(source.world_size, body)
    n = source.world_size
    traffic = 2 * (n - 1) / n * source.numel
    return [(vnmse(results[0][call][0], exact),
             max(r[call][1] for r in results) * 8 / traffic) for call in range(calls)]


def smallest_budget(source, algorithm: str, seed: int, target: float,  # type: ignore[no-untyped-def]
                    resolution: float) -> tuple[float, float]:
    lo, hi = 2.82, 16.9  # 2-bit everywhere .. raw 16-bit everywhere (plus statistics)
    (error, _), = run(source, algorithm, seed, bits=hi, max_width=16)
    if error > target:
        return float("nan"), error
    best = (hi, error)
    while hi - lo > resolution:
        mid = 0.5 * (lo + hi)
        (error, _), = run(source, algorithm, seed, bits=mid, max_width=16)
        if error <= target:
            hi, best = mid, (mid, error)
        else:
            lo = mid
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--targets", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES))
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--numel", type=int, default=1 << 18)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resolution", type=float, default=0.1)
    parser.add_argument("--json", default="docs/target_vnmse.json")
    parser.add_argument("--markdown", default="docs/target_vnmse.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    records = []
    for name in args.sources:
        spec = SOURCES.get(name, name)
        numel = args.numel if name == "gaussian" else None
        source = make_source(spec, world_size=args.world_size, numel=numel, seed=args.seed)
        for algorithm in args.algorithms:
            for target in args.targets:
                (cold, cold_bits), (achieved, bits) = run(source, algorithm, args.seed, calls=2,
                                                          target_vnmse=target)
                best_bits, best_error = smallest_budget(source, algorithm, args.seed + 1, target,
                                                        args.resolution)
                record = {
                    "source": name, "spec": spec, "numel": source.numel, "algorithm": algorithm,
                    "target": target, "first_achieved": cold, "first_ratio": cold / target,
                    "first_bits": cold_bits, "achieved": achieved, "ratio": achieved / target,
                    "bits": bits, "sweep_bits": best_bits, "sweep_vnmse": best_error,
                    "extra_bits": bits - best_bits,
                }
                records.append(record)
                print(f"{name:18s} {algorithm:9s} target {target:.0e}: first call "
                      f"x{cold / target:.2f} {cold_bits:.2f} bits; second "
                      f"x{record['ratio']:.2f} {bits:.2f} bits; "
                      f"sweep {best_bits:.2f} bits -> {record['extra_bits']:+.2f}", flush=True)
    commit = git_commit("tools")
    meta = {"command": "python tools/target_eval.py " + " ".join(argv or sys.argv[1:]),
            "commit": commit, "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} CPU (2-core dev VM)", "world_size": args.world_size,
            "elapsed_s": round(time.time() - started, 1)}
    Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    Path(args.markdown).write_text(render(meta, records))
    return 0


def render(meta: dict, records: list[dict]) -> str:  # type: ignore[type-arg]
    ok_ratio = sum(0.5 <= r["ratio"] <= 1.5 for r in records)
    ok_bits = sum(abs(r["extra_bits"]) <= 0.5 for r in records
                  if r["sweep_bits"] == r["sweep_bits"])
    lines = [
        "# Error-targeted DynamiQ (`target_vnmse`)",
        "",
        f"Generated by `{meta['command'].strip()}` at commit `{meta['commit']}` on {meta['date']} "
        f"({meta['machine']}, {meta['elapsed_s']} s). {meta['world_size']} ranks over the `local` "
        "transport. `bits` is what the busiest rank put on the wire per coordinate (statistics and "
        "argument checks included, normalised by 2(n-1)/n); `sweep` is the smallest fixed budget "
        "(`bits=b, max_width=16`, same data and seed, bisection to 0.1 bit) whose achieved vNMSE "
        "meets the target.",
        "",
        f"Second call (rho measured by the first): achieved / target within 0.5..1.5 in "
        f"{ok_ratio} of {len(records)} cases; bits within 0.5 of the sweep in {ok_bits} of "
        f"{len(records)}. First call (rho = 0): achieved / target within 0.5..1.5 in "
        f"{sum(0.5 <= r['first_ratio'] <= 1.5 for r in records)} of {len(records)}.",
        "",
        "| source | algorithm | target | first call: achieved / target | first call: bits | "
        "achieved | achieved / target | bits | sweep bits | extra bits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['source']} | {r['algorithm']} | {r['target']:.0e} | {r['first_ratio']:.2f} | "
            f"{r['first_bits']:.2f} | {r['achieved']:.2e} | {r['ratio']:.2f} | {r['bits']:.2f} | "
            f"{r['sweep_bits']:.2f} | {r['extra_bits']:+.2f} |"
        )
    lines += [
        "",
        "The model (dqcoll/schemes/dynamiq/error_model.py): predicted vNMSE = kappa * gamma * H * "
        "sum_s c_b eps_b F_s / (F (1 + (n-1) rho) + mean energy), with eps_b the single-shot "
        "error of width b on Gaussian coordinates, c_2 = 1 + 0.2 log2 n (2-bit errors compound "
        "along a path; c_b = 1 otherwise), H the schedule's partial-sum growth (ring (n+1)/2, "
        "butterfly ~1 + log2(n)/2 at rho = 0), gamma the gain of correlated rounding per "
        "algorithm, rho the ranks' correlation measured after the previous call, kappa = 1 "
        "unless calibrated (the DDP hook calibrates kappa from measured errors). With hop "
        "widths (format 3's default, all-reduce) every super-group has a width per partial-sum "
        "size c, and H splits into the sizes' weights alpha_c (1 + (c-1) rho) / n (summing to "
        "H), each multiplying eps of that size's width; those terms are multiplied by "
        "HOP_WIDTHS_CALIBRATION = 1.16, the largest achieved / predicted ratio an uncalibrated "
        "run of this script measured (ring 0.99-1.16, butterfly 0.96-1.10, second calls). The "
        "widths come from the hull of the measured errors over widths 2..8 and raw 16, as under "
        "a bit budget; the sweep's budgets use hop widths too.",
        "",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
