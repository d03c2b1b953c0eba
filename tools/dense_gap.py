#!/usr/bin/env python3
"""Issue 14: dynamiq vNMSE on dense i.i.d. N(0, 1) data, 8 ranks, ring/butterfly, 5 and 8.5 bits.

Data: rank r holds 2^18 coordinates drawn from ``torch.Generator().manual_seed(SEED0 + r)``
(i.i.d. N(0, 1), fp32). The all-reduce is run by the numerical simulator
(:func:`dqcoll.topology.simulator.simulate`), which reproduces the executor's bytes (the local
transport's output bit for bit) with the torch reference codec, so prototype format changes in
the reference are measured as they would run. vNMSE against the exact fp64 sum.

Run: ``PYTHONPATH=. DQCOLL_KERNELS=torch python tools/dense_gap.py [--variants a b ...]``

Other data (docs/dense_gap.md, "Other data" and (f)): ``--source skewed|skewed-t|lognormal``
(tools/ablation.py's sources, ``--data-seed`` their seed) or ``--source half-zero`` (the
Gaussian data with every other super-group zero), with ``--algorithms`` and ``--bits`` for the
cells (the issue's targets then do not apply).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.simulator import simulate
from dqcoll_lab.dynamiq import scheme_options

SEED0 = 1234
N = 8
NUMEL = 1 << 18
DEFAULT_CELLS = [("ring", 5.0), ("ring", 8.5), ("butterfly", 5.0), ("butterfly", 8.5)]
CELLS = list(DEFAULT_CELLS)
PAPER = [3.28e-2, 1.78e-3, 1.94e-2, 1.08e-3]
TARGET = [2.5e-2, 1.0e-3, 1.5e-2, 6e-4]


class Dense:
    world_size = N
    numel = NUMEL
    source = "gaussian"

    def rank_tensor(self, rank: int) -> torch.Tensor:
        if self.source in ("skewed", "skewed-t", "lognormal"):
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            import ablation

            make = ablation.SOURCES["dense" if self.source == "lognormal" else self.source]
            return make(rank, NUMEL, seed=SEED0).float()
        g = torch.Generator().manual_seed(SEED0 + rank)
        x = torch.randn(NUMEL, generator=g, dtype=torch.float32)
        if self.source == "half-zero":  # every other super-group all zero
            x.view(-1, 256)[1::2] = 0.0
        return x


# name -> scheme options (every candidate is an option of the dynamiq scheme; see docs/dense_gap.md)
# PAPER_CONFIG: the paper's configuration, the defaults before format 3 ("main" of the research)
PAPER_CONFIG = {"stats": "fp32", "thresholds": "paper", "width_set": "paper",
                "levels": "nonuniform", "scales": "hierarchical", "max_width": 8,
                "hop_widths": False}
BACK = PAPER_CONFIG  # leave-one-out: what each candidate's option goes back to
FULL = {"stats": "bf16", "thresholds": "measured", "width_set": "fine", "levels": "tuned",
        "scales": "hierarchical4", "max_width": 16, "hop_widths": False}
LABEL = {"stats": "(a) 16-bit stats", "thresholds": "(b) measured thresholds",
         "width_set": "(c) widths 2..8", "levels": "(c') tuned epsilons",
         "scales": "(d) 4-bit group codes", "max_width": "(f) width 16 allowed",
         "hop_widths": "(g) hop widths"}
HOP = {**FULL, "hop_widths": True}
VARIANTS: dict[str, dict] = {
    "default (format 3)": {},
    "paper's configuration": dict(PAPER_CONFIG),
    "paper's configuration, 16-bit stats (bf16 mean + norm)": {**PAPER_CONFIG, "stats": "bf16"},
    "paper's configuration, bf16 norm only": {**PAPER_CONFIG, "stats": "norm16"},
}
for key in HOP:  # leave-one-out from the default
    VARIANTS[f"default - {LABEL[key]}"] = {key: BACK[key]}
VARIANTS["default, stats bf16 mean + norm (centring)"] = {"stats": "bf16"}
VARIANTS["default, 4-bit codes per 16"] = {"scales": "hierarchical4"}
VARIANTS["default, permutation per coordinate"] = {"_permutation_run": 1}
VARIANTS["default, independent rounding"] = {"rounding": "independent"}
# the research's variants (docs/dense_gap.md), in explicit options
for key, value in HOP.items():  # one candidate added to the paper's configuration
    VARIANTS[f"main + {LABEL[key]}"] = {**PAPER_CONFIG, key: value}
VARIANTS["A = (a)-(f)"] = dict(FULL)
for key in FULL:  # leave-one-out from A
    if key != "hop_widths":
        VARIANTS[f"A - {LABEL[key]}"] = {**FULL, key: BACK[key]}
VARIANTS["A, (e) permutation per coordinate"] = {**FULL, "_permutation_run": 1}
VARIANTS["A, independent rounding"] = {**FULL, "rounding": "independent"}
VARIANTS["B = A + (g) hop widths"] = dict(HOP)
for key in HOP:  # leave-one-out from B
    VARIANTS[f"B - {LABEL[key]}"] = {**HOP, key: BACK[key]}
VARIANTS["B, (e) permutation per coordinate"] = {**HOP, "_permutation_run": 1}
VARIANTS["B, stats norm only (no centring)"] = {**HOP, "stats": "norm16"}
VARIANTS["B, 4-bit codes per 32"] = {**HOP, "scales": "hierarchical4x32"}
VARIANTS["C = B, norm only, 4-bit codes per 32"] = {**HOP, "stats": "norm16",
                                                    "scales": "hierarchical4x32"}


def run(options: dict, seed: int = 0) -> list[float]:
    from dqcoll.kernels import rng

    options = dict(options)
    run_len = options.pop("_permutation_run", 16)
    rng.PERMUTATION_RUN = run_len  # read at call time by rng.rounding_uniforms (rng.py unchanged)
    out = []
    for algorithm, bits in CELLS:
        r = simulate(build_schedule(algorithm, N), Dense(), scheme="dynamiq", bits=bits,
                     seed=seed, **scheme_options(**options))
        out.append(r.vnmse)
    return out


def main(argv: list[str] | None = None) -> int:
    global SEED0
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--seed", type=int, default=0, help="rounding seed (dqcoll's seed=)")
    p.add_argument("--data-seed", type=int, default=1234, help="rank r's data: seed + r")
    p.add_argument("--source", default="gaussian",
                   choices=["gaussian", "half-zero", "skewed", "skewed-t", "lognormal"])
    p.add_argument("--algorithms", nargs="*", default=None)
    p.add_argument("--bits", nargs="*", type=float, default=None)
    args = p.parse_args(argv)
    SEED0 = args.data_seed
    Dense.source = args.source
    if args.algorithms or args.bits:
        CELLS[:] = [(a, b) for a in (args.algorithms or ["ring", "butterfly"])
                    for b in (args.bits or [5.0, 8.5])]
    issue = args.source == "gaussian" and CELLS == DEFAULT_CELLS
    torch.set_num_threads(1)
    print(f"{'variant':58s} " + " ".join(f"{a[:4]} {b:<4g}  " for a, b in CELLS))
    if issue:
        print(f"{'paper (independent impl.)':58s} " + " ".join(f"{v:.3e}  " for v in PAPER))
        print(f"{'must reach':58s} " + " ".join(f"{v:.3e}  " for v in TARGET))
    for name in args.variants:
        t = time.time()
        v = run(VARIANTS[name], args.seed)
        ok = issue and all(a <= b for a, b in zip(v, TARGET, strict=False))
        print(f"{name:58s} " + " ".join(f"{x:.3e}  " for x in v)
              + f"{'MEETS' if ok else ''} ({time.time() - t:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
