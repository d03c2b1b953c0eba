#!/usr/bin/env python3
"""Checks tools/dense_gap.py's simulator against the executor (docs/dense_gap.md).

8 ranks over the local transport (threads), 2^16 i.i.d. N(0, 1) coordinates per rank (the script's
data at a quarter of its size), the default, the paper's configuration, B and per-16 codes on
the issue's four cells: the local transport's vNMSE and the simulator's, whether every rank's
output is bit-identical, and the busiest rank's ``bytes_sent`` (payload + statistics + argument
check) in bits per coordinate, divided by the all-reduce's 2 (n - 1) / n so that it compares
with the budget.

Run: ``PYTHONPATH=. DQCOLL_KERNELS=torch python tools/dense_gap_local.py`` (about 15 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import dense_gap as dg

import dqcoll
from dqcoll.metrics import vnmse
from dqcoll.testing import run_local
from dqcoll.topology.algorithms import build_schedule
from dqcoll.topology.simulator import simulate
from dqcoll_lab.dynamiq import scheme_options

VARIANTS = ["default (format 3)", "paper's configuration", "B = A + (g) hop widths",
            "default, 4-bit codes per 16"]


def main() -> int:
    dg.NUMEL = dg.Dense.numel = 1 << 16
    n = dg.N
    data = dg.Dense()
    exact = sum(data.rank_tensor(r).double() for r in range(n))
    torch.set_num_threads(1)
    worst = 0.0
    for name in VARIANTS:
        options = dg.VARIANTS[name]
        for algorithm, bits in dg.DEFAULT_CELLS:
            def body(comm, algorithm=algorithm, bits=bits, options=options):  # type: ignore[no-untyped-def]
                x = data.rank_tensor(comm.rank)
                dqcoll.allreduce(x, algorithm=algorithm, bits=bits, seed=0,
                                 **scheme_options(**options))
                return x, comm.counters["bytes_sent"]

            results = run_local(n, body)
            same = all(torch.equal(results[0][0], r[0]) for r in results)
            local = vnmse(results[0][0], exact)
            sim = simulate(build_schedule(algorithm, n), data, scheme="dynamiq", bits=bits,
                           seed=0, **scheme_options(**options)).vnmse
            wire = max(r[1] for r in results) * 8 / dg.NUMEL / (2 * (n - 1) / n)
            worst = max(worst, abs(local - sim) / sim)
            print(f"{name:40s} {algorithm:9s} {bits:4g}  local {local:.6e}  simulator {sim:.6e}"
                  f"  ranks identical {same}  busiest rank {wire:.3f} b", flush=True)
    print(f"largest relative difference local vs simulator: {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
