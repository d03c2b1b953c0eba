"""``dqcoll`` console script: one sub-command per module of :mod:`dqcoll.cli`."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# sub-command -> (module, help)
COMMANDS = {
    "demo": ("dqcoll.cli.demo",
             "4 ranks over gloo: all-reduce table on loopback and over an emulated 1 Gb/s link"),
    "bench": ("dqcoll.cli.bench", "all-reduce benchmark (nccl-tests style) vs torch and DDP hooks"),
    "eval": ("dqcoll.cli.eval", "vNMSE of every scheme on the same gradients (table, CSV, PNG)"),
    "tune": ("dqcoll.cli.tune", "auto-tune algorithm x scheme x bits x tiles for a topology"),
    "plan": ("dqcoll.cli.plan",
             "the topology this job found and the planner's plan per size, with alternatives"),
    "simulate": ("dqcoll.cli.simulate", "predicted time and vNMSE of a configuration at any scale"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dqcoll", description="quantized collectives")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / error and exits
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
