#!/usr/bin/env python3
"""Run the training-step benchmark's whole matrix in one command, then print its summary.

For every link x world size x model it runs ``benchmarks/ddp_step.py`` (all rows in one run) and
writes ``benchmarks/results/ddp-step-<link>-<n>-<model>.json``:

* links: ``loopback`` (ranks spawned here, gloo over ``lo``) and the emulated cluster at
  ``10gbit``, ``1gbit`` and ``200mbit`` (``python -m dqcoll.cli.netns exec``: one network
  namespace per rank, veth ports through a bridge, each port capped by ``tc tbf`` in both
  directions; as root with named namespaces, otherwise rootless in a user namespace);
* world sizes 4 and 2; models ``mlp`` and ``transformer``.

At the end it prints how long the matrix took and the markdown tables of docs/benchmarks.md's
"Training step" section (``ddp_step.py --render`` over the files written). ``--dry-run`` prints
the commands only. A configuration that fails is reported and the matrix goes on; the exit status
says whether any failed.

Usage (from the repository root)::

    .venv/bin/python tools/ddp_step_matrix.py --note "quiet machine"
    .venv/bin/python tools/ddp_step_matrix.py --links 1gbit --world-sizes 4 --models mlp

Rejected: a shell loop in the docs (no timing, no summary, and a failed run would stop it or be
missed).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks" / "ddp_step.py"
RESULTS = ROOT / "benchmarks" / "results"
LINKS = ("loopback", "10gbit", "1gbit", "200mbit")
WORLD_SIZES = (4, 2)
MODELS = ("mlp", "transformer")


@dataclass(frozen=True)
class Run:
    """One configuration of the matrix: its command and where it writes."""

    link: str
    world_size: int
    model: str
    json_path: Path
    command: tuple[str, ...]


def result_path(out_dir: Path, link: str, world_size: int, model: str) -> Path:
    return out_dir / f"ddp-step-{link}-{world_size}-{model}.json"


def build_runs(links: list[str], world_sizes: list[int], models: list[str], *,
               out_dir: Path = RESULTS, bench_args: tuple[str, ...] = (),
               mode: str = "auto", python: str = sys.executable) -> list[Run]:
    """The matrix's commands, in the order they run (plain data; nothing is started)."""
    runs = []
    for link in links:
        for world_size in world_sizes:
            for model in models:
                path = result_path(out_dir, link, world_size, model)
                common = ("--model", model, "--json", str(path), *bench_args)
                if link == "loopback":
                    command: tuple[str, ...] = (python, str(BENCH), "-n", str(world_size),
                                                "--link", "loopback", *common)
                else:
                    topology = (f"{world_size} network namespaces, veth ports to a bridge, tbf "
                                f"{link} per port and direction (dqcoll.cli.netns, mode {mode})")
                    command = (python, "-m", "dqcoll.cli.netns", "exec", "-n", str(world_size),
                               "--rate", link, "--mode", mode, "--", python, str(BENCH),
                               "--launcher", "env", "--link", link, "--topology", topology,
                               *common)
                runs.append(Run(link, world_size, model, path, command))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddp_step_matrix.py", description=__doc__.split("\n")[0])
    p.add_argument("--links", nargs="+", default=list(LINKS),
                   help="loopback and/or tc rates (10gbit, 1gbit, 200mbit, ...)")
    p.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--note", default="", help="recorded in every result (machine state)")
    p.add_argument("--mode", default="auto", choices=("auto", "root", "rootless"),
                   help="how the emulated cluster is built (dqcoll.cli.netns)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    bench_args = ("--steps", str(args.steps), "--warmup", str(args.warmup),
                  *(("--note", args.note) if args.note else ()))
    runs = build_runs(args.links, args.world_sizes, args.models, out_dir=args.out_dir,
                      bench_args=bench_args, mode=args.mode)
    if args.dry_run:
        for run in runs:
            print(subprocess.list2cmdline(run.command))
        return 0
    sys.path.insert(0, str(ROOT))
    import torch

    from dqcoll import kernels

    kernels.warm_up(torch.device("cpu"))  # compile once; the ranks load numba's disk cache
    start = time.monotonic()
    written, failed = [], []
    for i, run in enumerate(runs, 1):
        print(f"\n## [{i}/{len(runs)}] {run.link}, {run.world_size} ranks, {run.model} "
              f"({time.monotonic() - start:.0f} s so far)", flush=True)
        t0 = time.time()
        code = subprocess.call(run.command, cwd=ROOT)
        print(f"## took {time.time() - t0:.0f} s, exit status {code}", flush=True)
        # A rank that a crashing row aborts (PowerSGD on gloo) makes the status non-zero after
        # rank 0 wrote its results: the file of this run counts.
        fresh = run.json_path.exists() and run.json_path.stat().st_mtime >= t0
        (written if fresh else failed).append(run)
    elapsed = time.monotonic() - start
    print(f"\n# matrix: {len(runs)} runs in {elapsed / 60:.1f} min; failed: "
          f"{[f'{r.link}-{r.world_size}-{r.model}' for r in failed] or 'none'}\n")
    if written:
        subprocess.call([sys.executable, str(BENCH), "--render",
                         *(str(r.json_path) for r in written)], cwd=ROOT)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
