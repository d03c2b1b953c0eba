#!/usr/bin/env python3
"""FSDP2 with and without dqcoll on an emulated cluster, in one command; results as JSON.

    sudo .venv/bin/python tools/fsdp_bench.py --out docs/fsdp.json

Two parts (both on by default):

* **Step time** (``--rates``, ``--modes``): for every link rate, every mode of
  ``examples/fsdp_train.py`` (``exact`` = FSDP2's own collectives, ``qwz``, ``qgz``, ``both``,
  ``backend``) runs on ``tools/netns_cluster.py exec -n 4 --rate <rate>`` (4 ranks, one per
  network namespace, links capped with tc tbf; needs root) for ``--steps`` steps; the step time
  is the median of the slowest rank's step after 2 untimed ones, wire bytes per step come from
  dqcoll's counters (exact calls: the bytes of a bandwidth-optimal exact collective,
  ``(n-1)/n`` of the buffer, which is what FSDP2's own collectives send at best).
* **Held-out loss** (``--loss-seeds``): ``exact`` and ``both`` train ``--loss-steps`` steps with
  the same seed (same data, same initial weights) on 4 ranks over loopback (the link does not
  change the numbers), and the held-out loss of each pair is compared.

Every row carries its provenance (commit, CPU, cores, torch version, model size, world size);
``--note`` adds free text (e.g. that the machine was shared).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ("exact", "qwz", "qgz", "both", "backend")


def provenance() -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip()

    cpu = platform.processor()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
            "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                      time.gmtime())}


def _train_args(args: argparse.Namespace, mode: str, steps: int, seed: int) -> list[str]:
    return [str(ROOT / "examples" / "fsdp_train.py"), "--mode", mode, "--steps", str(steps),
            "--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads),
            "--batch", str(args.batch), "--context", str(args.context), "--bits", str(args.bits),
            "--gradients", args.gradients,
            "--seed", str(seed), "--lr", str(args.lr),
            "--warmup-steps", str(args.warmup_steps)]


def _run(command: list[str], out: pathlib.Path, timeout_s: float) -> dict[str, Any] | None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("$", " ".join(command), flush=True)
    proc = subprocess.run([*command, "--json", str(out)], env=env, timeout=timeout_s,
                          check=False)
    if proc.returncode != 0 or not out.exists():
        print(f"fsdp_bench: exit status {proc.returncode}", file=sys.stderr)
        return None
    result = json.loads(out.read_text())
    out.unlink()
    return result


def _row(result: dict[str, Any]) -> dict[str, Any]:
    keys = ("numel", "world_size", "held_out_loss", "step_s_median", "step_s",
            "wire_bytes_per_step", "exact_bytes_per_step", "losses")
    row = {k: result[k] for k in keys}
    row["compressed"] = result["summary"]["compressed"]
    return row


def markdown(report: dict[str, Any]) -> str:
    """The step-time and loss tables of a report, as Markdown (for docs/fsdp.md)."""
    lines = ["| link | mode | step (ms) | vs exact | wire MB/step | exact MB/step | bytes ratio |",
             "|---|---|---|---|---|---|---|"]
    exact_ms = {r["rate"]: r["step_s_median"] * 1e3 for r in report["step_time"]
                if r.get("ok") and r["mode"] == "exact"}
    for row in report["step_time"]:
        if not row.get("ok"):
            lines.append(f"| {row['rate']} | {row['mode']} | failed | | | | |")
            continue
        ms = row["step_s_median"] * 1e3
        base = exact_ms.get(row["rate"])
        speedup = f"{base / ms:.2f}x" if base else ""
        sent, exact = row["wire_bytes_per_step"], row["exact_bytes_per_step"]
        lines.append(f"| {row['rate']} | {row['mode']} | {ms:.0f} | {speedup} | {sent / 1e6:.2f} "
                     f"| {exact / 1e6:.2f} | {exact / sent:.2f}x |")
    if report["loss"]:
        lines += ["", "| seed | held-out loss, exact FSDP2 | held-out loss, dqcoll (both) "
                  "| difference |", "|---|---|---|---|"]
        for pair in report["loss"]:
            if "relative_difference" in pair:
                lines.append(f"| {pair['seed']} | {pair['exact']['held_out_loss']:.4f} | "
                             f"{pair['both']['held_out_loss']:.4f} | "
                             f"{pair['relative_difference']:+.2%} |")
        if "loss_mean_relative_difference" in report:
            lines.append(f"| mean | | | {report['loss_mean_relative_difference']:+.2%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fsdp_bench.json")
    parser.add_argument("--rates", default="10gbit,1gbit,200mbit", help="'' skips step times")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--loss-seeds", default="0,1,2", help="'' skips the loss comparison")
    parser.add_argument("--loss-steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--gradients", default="dynamiq",
                        help="the gradients' reduce-scatter scheme (qgz, both, backend)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--note", default="")
    parser.add_argument("--markdown", default=None,
                        help="print the tables of this report file and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(pathlib.Path(args.markdown).read_text())))
        return 0

    report: dict[str, Any] = {"provenance": provenance(), "note": args.note,
                              "settings": vars(args), "step_time": [], "loss": []}
    out_path = pathlib.Path(args.out)

    def save() -> None:
        out_path.write_text(json.dumps(report, indent=1))

    scratch = pathlib.Path(tempfile.mkdtemp(prefix="fsdp_bench_"))
    os.chmod(scratch, 0o777)
    for rate in filter(None, args.rates.split(",")):
        for mode in filter(None, args.modes.split(",")):
            command = [sys.executable, str(ROOT / "tools" / "netns_cluster.py"), "exec", "-n",
                       str(args.world_size), "--rate", rate, "--", sys.executable,
                       *_train_args(args, mode, args.steps, 0)]
            result = _run(command, scratch / f"{rate}-{mode}.json", args.timeout_s)
            row = {"rate": rate, "mode": mode, "ok": result is not None}
            if result is not None:
                row.update(_row(result))
                print(f"{rate:>8} {mode:>8}: step {row['step_s_median'] * 1e3:8.0f} ms, "
                      f"{row['wire_bytes_per_step'] / 1e6:7.2f} MB/step sent "
                      f"(exact {row['exact_bytes_per_step'] / 1e6:.2f})", flush=True)
            report["step_time"].append(row)
            save()
    for seed in (int(s) for s in filter(None, args.loss_seeds.split(","))):
        pair: dict[str, Any] = {"seed": seed}
        for mode in ("exact", "both"):
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(args.world_size), "--master-port", str(29650 + seed), *
                       _train_args(args, mode, args.loss_steps, seed)]
            result = _run(command, scratch / f"loss-{seed}-{mode}.json", args.timeout_s)
            pair[mode] = None if result is None else _row(result)
        if pair["exact"] and pair["both"]:
            exact, both = pair["exact"]["held_out_loss"], pair["both"]["held_out_loss"]
            pair["relative_difference"] = (both - exact) / exact
            print(f"seed {seed}: held-out loss exact {exact:.4f}, dqcoll {both:.4f} "
                  f"({pair['relative_difference']:+.2%})", flush=True)
        report["loss"].append(pair)
        save()
    diffs = [p["relative_difference"] for p in report["loss"] if "relative_difference" in p]
    if diffs:
        report["loss_mean_relative_difference"] = sum(diffs) / len(diffs)
    save()
    print(markdown(report))
    print(f"fsdp_bench: wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
