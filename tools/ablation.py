#!/usr/bin/env python3
"""DynamiQ ablation: what each component buys, on 8 ranks, ring and butterfly.

Variants follow the DynamiQ paper's Table 6. Cumulative: start from uniform levels + fixed 4-bit
widths + flat scales (one bf16 per 32 coordinates) + independent rounding, then add non-uniform
levels, variable widths (budget ``--bits``), hierarchical scales and correlated rounding (= full
DynamiQ). Leave-one-out: full DynamiQ with one component switched back.

Sources (all fp32, one tensor per rank, deterministic per seed):

* ``skewed``: the DynamiQ paper's log-normal mixture of super-group magnitudes (79 % around e^-4,
  21 % around e^-16), shared by all ranks, i.i.d. Gaussian coordinates per rank (the ``dqcoll
  demo`` gradient);
* ``skewed-t``: the same super-group magnitudes, but Student-t (3 degrees of freedom, unit
  variance) coordinates within each super-group: heavy tails inside groups, as real gradient
  coordinates have;
* ``dense``: log-normal super-group magnitudes with sigma = 1 (a mildly varying dense layer).

Writes a JSON file (default docs/ablation.json: the rows, and in ``meta`` the command, machine,
commit and date) and a Markdown report (default docs/ablation.md: the command and the machine; the
commit and the date stay in the JSON file, which the report names). Run:
``python tools/ablation.py`` (about 10 minutes on the 2-core dev VM).
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
from dqcoll.cli.demo import gradient_like
from dqcoll.cli.provenance import git_commit
from dqcoll.metrics import vnmse
from dqcoll.testing import run_local
from dqcoll_lab.dynamiq import scheme_options

BASE = {"levels": "uniform", "widths": "fixed", "scales": "flat", "rounding": "independent"}
# full = dqcoll's default (format 3: tuned non-uniform levels, 4-bit group codes per 32, widths
# 2..8 + 16, hop widths, bf16 norm statistics); the options not listed keep their defaults
FULL = {"levels": "tuned", "widths": "variable", "scales": "hierarchical4x32",
        "rounding": "correlated"}
STEPS = [("levels", "+ non-uniform levels"), ("widths", "+ variable widths"),
         ("scales", "+ hierarchical scales"), ("rounding", "+ correlated rounding")]
# the paper's configuration of full DynamiQ (format 2's defaults), for comparison
PAPER = {"levels": "nonuniform", "widths": "variable", "scales": "hierarchical",
         "rounding": "correlated", "width_set": "paper", "thresholds": "paper", "stats": "fp32",
         "hop_widths": "false", "max_width": 8}
PAPER_LABEL = "the paper's configuration (widths 2/4/8, uint8 codes per 16, fp32 stats)"


def dense_like(rank: int, numel: int, *, seed: int) -> torch.Tensor:
    rows = -(-numel // 256)
    magnitude = torch.exp(torch.randn(rows, generator=torch.Generator().manual_seed(seed)))
    own = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    return (torch.randn(rows, 256, generator=own) * magnitude[:, None]).reshape(-1)[:numel]


def skewed_t_like(rank: int, numel: int, *, seed: int) -> torch.Tensor:
    gaussian = gradient_like(rank, numel, seed=seed)  # carries the shared magnitudes
    own = torch.Generator().manual_seed(seed * 1_000_003 + rank + 7)
    # t(3) = N / sqrt(chi2_3 / 3); divided by sqrt(3) for unit variance
    chi2 = (torch.randn(numel, 3, generator=own) ** 2).sum(1)
    return (gaussian / torch.sqrt(chi2 / 3.0) / 3.0**0.5).contiguous()


SOURCES = {"skewed": gradient_like, "skewed-t": skewed_t_like, "dense": dense_like}


def variants() -> list[tuple[str, dict[str, str]]]:
    rows = [("baseline: uniform, fixed 4-bit, flat, independent", dict(BASE))]
    current = dict(BASE)
    for key, label in STEPS:
        current = {**current, key: FULL[key]}
        rows.append((label, dict(current)))
    for key, _ in STEPS:
        rows.append((f"full without {key} ({BASE[key]})", {**FULL, key: BASE[key]}))
    rows.append((PAPER_LABEL, dict(PAPER)))
    return rows


def run_variant(source: str, algorithm: str, options: dict[str, str], args: argparse.Namespace,
                seed: int) -> tuple[float, float]:
    make = SOURCES[source]

    def body(comm):  # type: ignore[no-untyped-def]
        x = make(comm.rank, args.numel, seed=seed)
        comm.counters.reset()
        dqcoll.allreduce(x, algorithm=algorithm, bits=args.bits, seed=seed,
                         **scheme_options(**options))
        return x, comm.counters["bytes_sent"]

    results = run_local(args.world_size, body)
    exact = torch.zeros(args.numel, dtype=torch.float64)
    for r in range(args.world_size):
        exact += make(r, args.numel, seed=seed).double()
    traffic = 2 * (args.world_size - 1) / args.world_size * args.numel
    bits_used = max(sent for _, sent in results) * 8 / traffic
    return vnmse(results[0][0], exact), bits_used


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--sources", nargs="+", default=list(SOURCES))
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--json", default="docs/ablation.json")
    parser.add_argument("--markdown", default="docs/ablation.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    records = []
    started = time.time()
    for source in args.sources:
        for algorithm in args.algorithms:
            for label, options in variants():
                errors, bits = [], []
                for seed in range(args.seeds):
                    e, b = run_variant(source, algorithm, options, args, seed)
                    errors.append(e)
                    bits.append(b)
                record = {"source": source, "algorithm": algorithm, "variant": label,
                          "options": options, "vnmse": sum(errors) / len(errors),
                          "bits_per_coord": max(bits)}
                records.append(record)
                print(f"{source:7s} {algorithm:10s} {label:52s} vNMSE {record['vnmse']:.3e} "
                      f"bits {record['bits_per_coord']:.3f}", flush=True)
    elapsed = time.time() - started
    commit = git_commit("tools")
    meta = {"command": "python tools/ablation.py " + " ".join(argv or sys.argv[1:]),
            "world_size": args.world_size, "numel": args.numel, "bits": args.bits,
            "seeds": args.seeds, "machine": f"{platform.machine()} CPU, {platform.node()}",
            "commit": commit, "date": datetime.date.today().isoformat(),
            "elapsed_s": round(elapsed, 1)}
    Path(args.json).write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    Path(args.markdown).write_text(render(meta, records, args))
    return 0


def render(meta: dict, records: list[dict], args: argparse.Namespace) -> str:  # type: ignore[type-arg]
    lines = [
        "# DynamiQ ablation",
        "",
        f"Generated by `{meta['command'].strip()}` ({meta['machine']}; {meta['elapsed_s']} s; "
        f"commit and date: `{args.json}`). {args.world_size} ranks "
        f"(threads over the `local` transport), {args.numel:,} fp32 coordinates per rank, budget "
        f"{args.bits:g} bits per coordinate for variable widths, vNMSE averaged over "
        f"{args.seeds} seeds against the exact float64 sum. `bits` is what the busiest rank "
        "actually put on the wire per coordinate (normalised by the all-reduce's 2(n-1)/n), "
        "statistics and checks included.",
        "",
    ]
    for source in args.sources:
        lines += [f"## Source: {source}", ""]
        header = "| variant | " + " | ".join(
            f"{a} vNMSE | {a} gain | {a} bits" for a in args.algorithms) + " |"
        lines += [header, "|" + "---|" * (1 + 3 * len(args.algorithms))]
        by_variant: dict[str, dict[str, dict]] = {}  # type: ignore[type-arg]
        for r in records:
            if r["source"] == source:
                by_variant.setdefault(r["variant"], {})[r["algorithm"]] = r
        labels = list(by_variant)
        for i, label in enumerate(labels):
            cells = []
            for a in args.algorithms:
                r = by_variant[label][a]
                if i == 0:
                    gain = "-"
                elif label.startswith("full without") or label == PAPER_LABEL:
                    full = by_variant[labels[len(STEPS)]][a]["vnmse"]
                    gain = f"x{r['vnmse'] / full:.2f} worse"
                else:
                    gain = f"x{by_variant[labels[i - 1]][a]['vnmse'] / r['vnmse']:.2f}"
                cells.append(f"{r['vnmse']:.3e} | {gain} | {r['bits_per_coord']:.2f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        total = {a: by_variant[labels[0]][a]["vnmse"] / by_variant[labels[len(STEPS)]][a]["vnmse"]
                 for a in args.algorithms}
        lines += ["", "Full DynamiQ vs baseline: " + ", ".join(
            f"{a} x{v:.1f} lower vNMSE" for a, v in total.items()) + "."]
        lines += [*_findings(by_variant, labels, args.algorithms), ""]
    lines += [
        "## Reading the tables",
        "",
        "* *Variable widths* dominate wherever super-group magnitudes are skewed: the budget moves "
        "from near-zero super-groups (2 bits, or none when zero on every rank) to the large ones.",
        "* *Non-uniform levels* (dqcoll's tuned epsilons, one per width: docs/dense_gap.md) help "
        "most at low widths and on heavy-tailed coordinates (Student-t). The paper's eps = 0.10 "
        "at 8 bits was worse than uniform levels on Gaussian groups (single-shot N(0,1): 7.9e-5 "
        "vs 4.7e-5); the tuned 0.04 measures 4.4e-5.",
        "* *Hierarchical scales* (4-bit codes per 32 coordinates under one bf16 unit: 6 bytes per "
        "super-group) cost less than half the metadata of flat bf16 scales per 32 (16 bytes); "
        "the bytes saved buy wider codes.",
        "* The last row is full DynamiQ in the paper's configuration (format 2's defaults): "
        "its ratio to the full scheme is what dqcoll's departures from the paper buy together.",
        "* *Correlated rounding* stratifies the n uniforms drawn for a coordinate across the "
        "ranks; it helps more on the ring (n-1 re-quantizations along one path) than on the "
        "butterfly (depth log2 n).",
        "* Fixed 4-bit widths spend what 4-bit records cost (flat scales: 4.6 bits per "
        "coordinate with the statistics and argument checks), variable widths the full budget.",
        "",
    ]
    return "\n".join(lines) + "\n"


def _findings(by_variant: dict, labels: list[str], algorithms: list[str]) -> list[str]:  # type: ignore[type-arg]
    """Which components did *not* lower vNMSE here (cumulatively or leave-one-out)."""
    notes = []
    for a in algorithms:
        for i in range(1, len(STEPS) + 1):
            if by_variant[labels[i]][a]["vnmse"] >= by_variant[labels[i - 1]][a]["vnmse"]:
                notes.append(f"{a}: '{labels[i]}' did not lower vNMSE cumulatively")
        full = by_variant[labels[len(STEPS)]][a]["vnmse"]
        for label in labels[len(STEPS) + 1 :]:
            if label != PAPER_LABEL and by_variant[label][a]["vnmse"] <= full:
                notes.append(f"{a}: '{label}' is not worse than the full scheme")
    if not notes:
        return ["Every component lowers vNMSE here, cumulatively and leave-one-out, on both "
                "algorithms."]
    return ["Components without a gain here: " + "; ".join(notes) + "."]


if __name__ == "__main__":
    sys.exit(main())
