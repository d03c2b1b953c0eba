#!/usr/bin/env python3
"""Where does the error model of ``target_vnmse`` go wrong? Its terms, measured one by one.

Runs one target-mode all-reduce of a gradient source in the simulator (the executor's layout and
bytes, :func:`dqcoll.topology.simulator.simulate`) and records every quantization the schedule
makes: per partial-sum size ``c`` and width ``w``, the squared error it injected against the
energy of what it quantized. Reported per (c, w):

* ``measured / EPSILON``: the codec's error per unit energy on this data, relative to the
  Gaussian table the model used before its crest term;
* ``measured / model``: the same relative to ``EPSILON * shape_factor(crest)`` with the crests
  per width of the exact aggregate's rows at the widths the sink sent them (what a second call
  measures from the decoded aggregate; what the crest term predicts).

and overall: the sum of injected errors against ``||X||^2``, the final vNMSE, and their ratio
(what correlated rounding cancels; the model's ``gamma``), plus the ranks' correlation of the
exact data. The all-reduce runs with ``ErrorModel(rho=<exact rho>)`` so that the allocation is
not the question; the simulator keeps no state between calls, so the allocation itself uses
the Gaussian's crest, as a first call does (the vNMSE printed is such a call's).

Writes a JSON (``--json``, default docs/target_vnmse_terms.json) with provenance and prints a
markdown table. Example: ``python tools/target_terms.py --source minilm:stride=8 --target 1e-4``.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import dqcoll.topology.simulator as sim
from dqcoll.cli.provenance import git_commit
from dqcoll.kernels.codec import SUPER, decode_torch, record_nbytes, stats_center_torch
from dqcoll.schemes.dynamiq import DynamiqFormat
from dqcoll.schemes.dynamiq import error_model as em
from dqcoll.topology.algorithms import build_schedule
from dqcoll_lab.eval.sources import make_source


def exact_terms(source) -> tuple[float, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(rho, centred rows) of the exact aggregate."""
    rows = -(-source.numel // SUPER)
    valid = (source.numel - torch.arange(rows) * SUPER).clamp(max=SUPER)
    total = None
    summed = 0.0
    for rank in range(source.world_size):
        flat = torch.zeros(rows, SUPER)
        flat.view(-1)[: source.numel] = source.rank_tensor(rank)
        centred, _, norm2 = stats_center_torch(flat, valid)
        total = centred.double() if total is None else total + centred.double()
        summed += float(norm2.double().sum())
    assert total is not None
    n = source.world_size
    rho = (float(total.square().sum()) / summed - 1.0) / (n - 1)
    return rho, total.float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--source", default="minilm:stride=8")
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--target", type=float, default=1e-4)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="docs/target_vnmse_terms.json")
    parser.add_argument("--markdown", default="docs/target_vnmse_terms.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    source = make_source(args.source, world_size=args.world_size, seed=args.seed)
    rho, aggregate = exact_terms(source)
    seen: dict[str, Any] = {}
    record: dict[tuple[int, int], list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    encode = sim._DynamiqAdapter.encode

    def spy(self, values, ranks, rows, counts=None):  # type: ignore[no-untyped-def]
        out = encode(self, values, ranks, rows, counts)
        seen["adapter"] = self
        for width, pick in self._by_width(rows, counts):
            size = record_nbytes(width, self.config.scales)
            decoded = decode_torch(out[pick, :size].contiguous(), width, self.config).double()
            exact = values[pick].double()
            sizes = counts[pick] if counts is not None else torch.zeros_like(pick)
            for c in sizes.unique().tolist():
                sel = sizes == c
                entry = record[(int(c), width)]
                entry[0] += float((decoded[sel] - exact[sel]).square().sum())
                entry[1] += float(exact[sel].square().sum())
                entry[2] += int(sel.sum())
        return out

    sim._DynamiqAdapter.encode = spy  # type: ignore[method-assign]
    try:
        result = sim.simulate(build_schedule(args.algorithm, args.world_size), source,
                              scheme="dynamiq", bits=None, target_vnmse=args.target,
                              format=DynamiqFormat(error_model=em.ErrorModel(rho=max(rho, 0.0))))
    finally:
        sim._DynamiqAdapter.encode = encode  # type: ignore[method-assign]
    from dqcoll.schemes.dynamiq.scheme import DynamiqScheme

    # the crests per width as a second call would measure them: the sink's widths of the rows
    crests = em.measure_crests(aggregate, seen["adapter"].call.allocation.widths)

    config = DynamiqScheme().config
    table = em.EPSILON[(config.levels, config.scales)]
    exact = source.exact_sum()
    norm = float(exact.square().sum())
    rows = []
    injected = 0.0
    for (c, w), (error, energy, count) in sorted(record.items()):
        injected += error
        if energy <= 0:
            continue
        measured = error / energy
        rows.append({"count": c, "width": w, "rows": count, "error": error, "energy": energy,
                     "over_epsilon": measured / table[w],
                     "over_model": measured / (table[w] * em.shape_factor(w, crests))})
    out = {"meta": {"command": "python tools/target_terms.py " + " ".join(argv or sys.argv[1:]),
                    "commit": git_commit("tools"), "date": datetime.date.today().isoformat(),
                    "machine": f"{platform.machine()} CPU (2-core dev VM)",
                    "elapsed_s": round(time.time() - started, 1)},
           "source": args.source, "numel": source.numel, "algorithm": args.algorithm,
           "target": args.target, "world_size": args.world_size, "rho_exact": rho,
           "crests_exact": crests, "vnmse": result.vnmse, "bits": result.bits_used,
           "injected_over_norm": injected / norm, "final_over_injected": result.vnmse * norm
           / injected, "rows": rows}
    Path(args.json).write_text(json.dumps(out, indent=1))
    meta = out["meta"]
    lines = [
        "# The error model's terms, measured one by one",
        "",
        f"Generated by `{meta['command'].strip()}` ({meta['machine']}, {meta['elapsed_s']} s; "
        f"commit and date: `{args.json}`). The method is the tool's "
        "docstring: one target-mode all-reduce in the simulator, every quantization's error "
        "recorded.",
        "",
        f"{args.source} ({source.numel} coordinates), {args.algorithm}, {args.world_size} ranks, "
        f"target {args.target:g}, allocated with the exact rho ({rho:.3f}) and the Gaussian's "
        f"crest (a first call): vNMSE {result.vnmse:.3e} at {result.bits_used:.2f} bits. "
        f"Crests of the exact aggregate per sink width: " + ", ".join(
            f"{w}: {c:.2f}" for w, c in crests.items() if w) + f" (all rows: "
        f"{crests.get(0, float('nan')):.2f}; Gaussian {em.CREST_GAUSSIAN}). Sum of the injected "
        f"errors / ||X||^2 = {injected / norm:.3e}; final / injected = "
        f"{out['final_over_injected']:.3f} (the model's gamma for this algorithm: "
        f"{em.CORRELATED_FACTOR.get(args.algorithm, float('nan'))}).",
        "",
        "Per partial-sum size and width (cells of 50 rows or more): the codec's error per unit of "
        "the energy it quantized, over the Gaussian table `EPSILON` and over the model with the "
        "crest term.",
        "",
        "| partial-sum size | width | rows | measured / EPSILON | measured / model |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["rows"] >= 50:
            lines.append(f"| {r['count']} | {r['width']} | {r['rows']} | "
                         f"{r['over_epsilon']:.2f} | {r['over_model']:.2f} |")
    Path(args.markdown).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
