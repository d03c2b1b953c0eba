"""``dqcoll tune``: the topology auto-tuning tool.

Prices every candidate (flat ring/butterfly/direct placed on the topology, and hierarchical
plans: uncompressed ring inside hosts, each algorithm across them) x scheme x bits x tiles with
the cost model at every message size, checks each configuration's error with the simulator, and
writes the table of the fastest configuration within the error budget per size bucket::

    dqcoll tune --topology 4x8@100 -b 4K -e 1G -f 4 --error-budget 0.01

The table goes to ``dqcoll/topology/tuned/<topology>-w<n>-<dtype>.json`` (``--out-dir``), where
``allreduce(..., algorithm="auto")`` finds it; a PNG of predicted time vs size per configuration
(best tiling each, the chosen one marked) goes next to it. Ctrl-C keeps what was computed (the
table is written with ``"complete": false``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence

from ..topology.detect import parse_topology
from ..topology.tuning import TUNED_DIR, TunedTable, default_candidates, size_buckets
from .bench import parse_size
from .progress import ProgressBar
from .provenance import git_commit

__all__ = ["bits_needed_command", "main", "plot_table"]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dqcoll tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", "-t", default="detect",
                   help="JSON file, 'detect', 'NxG[-intra]@GBPS' (e.g. 4x8@100), 'host:N', "
                   "'flat:N@GBPS' (default detect)")
    p.add_argument("--world-size", type=int, default=None, help="for --topology detect")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("4K"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--error-budget", type=float, default=0.01, help="max vNMSE (default 0.01)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--schemes", default="none,dynamiq")
    p.add_argument("--bits", type=_floats, default=[4.0, 5.0, 6.0, 8.0])
    p.add_argument("--tiles", type=_ints, default=[1, 2, 4, 8])
    p.add_argument("--no-hierarchical", action="store_true")
    p.add_argument("--source", default="lognormal-mixture:supergroups=512",
                   help="gradients the error is simulated on (default %(default)s)")
    p.add_argument("--sim-numel", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--errors-from", default=None, help="reuse the simulated errors of another "
                   "table with the same ranks and hosts (e.g. the same cluster at another link "
                   "speed): errors do not depend on link speeds")
    p.add_argument("--out-dir", default=TUNED_DIR)
    p.add_argument("--png", default=None, help="plot path (default: next to the table)")
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--bits-needed", action="store_true",
                   help="also print the lab's command that reports, per scheme family, the bits "
                        "each needs for vNMSE <= the error budget on --source at this world size "
                        "(python -m dqcoll_lab eval --target-vnmse: real all-reduces over the "
                        "local transport, minutes at 32 ranks)")
    return p


def plot_table(table: TunedTable, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [e.nbytes for e in table.entries]
    labels = sorted({label for e in table.entries for label, _ in e.times_us})
    configs: dict[str, list[float]] = {}
    for e in table.entries:  # best tiling per configuration
        times = dict(e.times_us)
        for label in labels:
            config = label.split(" x")[0]
            best = configs.setdefault(config, [float("inf")] * len(sizes))
            i = sizes.index(e.nbytes)
            best[i] = min(best[i], times[label])
    errors = dict(table.errors)
    fig, ax = plt.subplots(figsize=(10, 6.5))
    for config, curve in sorted(configs.items()):
        ok = errors.get(config, float("inf")) <= table.error_budget
        ax.plot(sizes, curve, linestyle="-" if ok else ":", linewidth=1.2 if ok else 0.7,
                alpha=0.9 if ok else 0.35,
                label=config + ("" if ok else " (over budget)"))
    chosen = [e.predicted_us for e in table.entries]
    ax.scatter(sizes, chosen, marker="*", s=160, color="black", zorder=5, label="chosen")
    for e in table.entries:
        ax.annotate(e.choice.label, (e.nbytes, e.predicted_us), fontsize=6,
                    xytext=(3, -9), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes, uncompressed)")
    ax.set_ylabel("predicted time (us)")
    ax.set_title(f"dqcoll tune {table.topology} (n={table.world_size}, {table.dtype}), "
                 f"vNMSE budget {table.error_budget:g}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..topology.sources import make_source
    from ..topology.tuning import tune

    topology = parse_topology(args.topology, world_size=args.world_size)
    sizes = size_buckets(args.minbytes, args.maxbytes, args.stepfactor)
    candidates = default_candidates(
        topology, schemes=[s.strip() for s in args.schemes.split(",") if s.strip()],
        bits=args.bits, tiles=args.tiles, hierarchical=not args.no_hierarchical)
    configs = len({(c.algorithm, c.scheme, c.bits) for c in candidates})
    print(f"{topology.describe()}\n{len(candidates)} candidates ({configs} configurations x "
          f"tiles {args.tiles}), {len(sizes)} sizes {sizes[0]}..{sizes[-1]} B, "
          f"error budget {args.error_budget:g}", file=sys.stderr)
    bar = ProgressBar("tune")
    provenance = {
        "command": "dqcoll tune " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.node()} {platform.machine()}",
        "commit": git_commit(),
        "source": args.source,
        "topology": json.dumps(topology.to_dict()),
    }
    known = None
    if args.errors_from:
        other = TunedTable.load(args.errors_from)
        if other.world_size != topology.world_size:
            print(f"dqcoll tune: {args.errors_from} is for {other.world_size} ranks, not "
                  f"{topology.world_size}", file=sys.stderr)
            return 2
        known = dict(other.errors)
        provenance["errors_from"] = args.errors_from
    data = make_source(args.source, world_size=topology.world_size, numel=args.sim_numel,
                       seed=args.seed)
    table = tune(topology, sizes, error_budget=args.error_budget, data=data,
                 candidates=candidates, dtype=args.dtype, seed=args.seed, progress=bar,
                 provenance=provenance, known_errors=known)
    path = table.save(args.out_dir)
    png = args.png or os.path.splitext(path)[0] + ".png"
    if table.entries:
        plot_table(table, png)
    if args.json:
        print(json.dumps(table.to_dict(), indent=1))
    else:
        print(table.render())
        errors = ", ".join(f"{k} {v:.2e}" for k, v in table.errors)
        print(f"simulated vNMSE per configuration: {errors}")
        print(f"wrote {path}" + (f" and {png}" if table.entries else ""))
    if not table.complete:
        print("interrupted: the table holds the sizes computed so far", file=sys.stderr)
    if args.bits_needed:
        command = bits_needed_command(args, topology.world_size,
                                      sorted({c.algorithm for c in candidates}))
        print(f"bits needed for vNMSE <= {args.error_budget:g}, per scheme family: {command}")
    return 0


def bits_needed_command(args: argparse.Namespace, world_size: int,
                        algorithms: Sequence[str] = ("ring", "butterfly", "direct")) -> str:
    """The lab's command (it measures with real all-reduces; the runtime does not import it)
    that reports each scheme family's bits for vNMSE <= ``--error-budget`` on the data the
    tuner simulated: the same source, size, seed and world size, the flat algorithms tuned."""
    flat = [a for a in algorithms if a in ("ring", "butterfly", "direct")] or ["ring"]
    command = ["python", "-m", "dqcoll_lab", "eval", "--source", args.source,
               "--world-sizes", str(world_size), "--algorithms", ",".join(flat),
               "--target-vnmse", f"{args.error_budget:g}", "--seed", str(args.seed)]
    if args.sim_numel is not None:
        command += ["--numel", str(args.sim_numel)]
    return shlex.join(command)

