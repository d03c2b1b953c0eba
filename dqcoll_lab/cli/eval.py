"""``python -m dqcoll_lab eval``: accuracy of every scheme on the same gradients, in one run.

For each gradient source × world size × algorithm × scheme (× bit budget for schemes that take
``bits``), the all-reduce runs for real over the ``local`` transport and the table reports the
vNMSE, the declared and the measured wire bits per coordinate and whether every rank ended
identical; :mod:`dqcoll_lab.eval.accuracy` does the measuring (its docstring defines each column),
:mod:`dqcoll_lab.eval.sources` makes the gradients.

Examples::

    dqcoll-lab eval --source lognormal-mixture --world-sizes 2,4,8 --algorithms ring,butterfly
    dqcoll-lab eval --source "files:path=grads/rank{rank}.pt" --schemes dynamiq mxfp8 --bits 4,6
    dqcoll-lab eval --source stdlib-lm --schemes dynamiq mxfp8:scale=global --csv o.csv --plot o.png

(``dqcoll-lab`` is the console script of ``python -m dqcoll_lab``.)

Scheme specs are ``name[:key=value[;key=value]]``; ``--bits`` expands every scheme that takes a
``bits`` option into one entry per budget (a spec that sets ``bits`` itself is kept as is).
``--target-vnmse 1e-2,1e-3`` answers the other question, *how many bits does each scheme need
for vNMSE <= target* (:func:`dqcoll_lab.eval.accuracy.bits_needed`).

This module is only the command line; the evaluation lives in :mod:`dqcoll_lab.eval`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from dqcoll.errors import DqcollError

from ..eval.accuracy import (
    DEFAULT_SCHEMES,
    FAMILIES,
    EvalRow,
    NeededRow,
    bits_needed,
    evaluate,
    expand_bits,
    format_needed,
    format_table,
    parse_scheme_spec,
    plot_rows,
    write_csv,
    write_json,
)
from ..eval.sources import list_sources, make_source

__all__ = ["build_parser", "main"]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    sources = ", ".join(e.kind for e in list_sources())
    p = argparse.ArgumentParser(
        prog="dqcoll-lab eval",
        description="vNMSE of the all-reduced result for schemes x algorithms x world sizes x "
        "bit budgets on the same gradients",
    )
    p.add_argument("--source", action="append", default=None,
                   help=f"gradient source spec, repeatable (kinds: {sources}); "
                   "default lognormal-mixture")
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                   help="scheme specs name[:key=value;...]")
    p.add_argument("--bits", type=_floats, default=[5.0],
                   help="bit budgets for schemes that take bits (comma list, default 5)")
    p.add_argument("--algorithms", type=lambda s: s.split(","), default=["ring", "butterfly"])
    p.add_argument("--world-sizes", type=_ints, default=[2, 4, 8])
    p.add_argument("--numel", type=int, default=None,
                   help="coordinates per rank (default: the source's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="calls per configuration")
    p.add_argument("--csv", default=None, help="write the rows as CSV")
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--plot", default=None, help="write a PNG: vNMSE vs world size per scheme")
    p.add_argument("--quiet", action="store_true", help="print only the final table")
    p.add_argument("--target-vnmse", type=_floats, default=None,
                   help="instead of a vNMSE table: the bits each scheme needs for vNMSE <= each "
                        "target (comma-separated)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        choices = expand_bits([parse_scheme_spec(s) for s in args.schemes], args.bits)
        sources = args.source or ["lognormal-mixture"]

        def progress(row: EvalRow) -> None:
            if not args.quiet:
                print(f"  n={row.world_size} {row.algorithm} {row.scheme}: vnmse "
                      f"{row.vnmse:.3g}, {row.wire_bits:.3f} bits ({row.time_s:.1f} s)",
                      file=sys.stderr, flush=True)

        if args.target_vnmse:
            needed: list[NeededRow] = []
            for spec in sources:
                for n in args.world_sizes:
                    source = make_source(spec, world_size=n, numel=args.numel, seed=args.seed)
                    for algorithm in args.algorithms:
                        for target in args.target_vnmse:
                            needed += bits_needed(source, algorithm, target)
                            if not args.quiet:
                                print(format_needed(needed[-len(FAMILIES) - 2:]),
                                      file=sys.stderr, flush=True)
            print(format_needed(needed))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump([dataclasses.asdict(r) for r in needed], f, indent=1)
            return 0
        rows = evaluate(sources, choices, args.algorithms, args.world_sizes, numel=args.numel,
                        seed=args.seed, repeats=args.repeats, progress=progress)
    except DqcollError as exc:
        print(f"dqcoll-lab eval: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    meta = {"argv": list(argv) if argv is not None else sys.argv[1:],
            "torch": torch.__version__, "seed": args.seed}
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        write_json(rows, args.json, meta)
    if args.plot:
        plot_rows(rows, args.plot)
    bad = [r for r in rows if not r.identical]
    if bad:
        print(f"dqcoll-lab eval: ranks differ in {len(bad)} rows", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
