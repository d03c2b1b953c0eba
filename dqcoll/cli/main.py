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
    "tune": ("dqcoll.cli.tune", "auto-tune algorithm x scheme x bits x tiles for a topology"),
    "plan": ("dqcoll.cli.plan",
             "the topology this job found and the planner's plan per size, with alternatives"),
    "simulate": ("dqcoll.cli.simulate", "predicted time and vNMSE of a configuration at any scale"),
}
# sub-commands that live in the evaluation package beside the runtime (dqcoll_lab), which the
# runtime never imports: the command names where to run them, with the same arguments
MOVED = {
    "eval": "python -m dqcoll_lab eval",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dqcoll", description="quantized collectives")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    for name, where in MOVED.items():
        sub.add_parser(name, help=f"moved: {where}", add_help=False)
    if argv and argv[0] in MOVED:
        print(f"dqcoll {argv[0]} moved to the lab: run `{MOVED[argv[0]]}` with the same "
              "arguments (console script dqcoll-lab)", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / error and exits
        return 2
    from ..errors import InvalidArgumentError

    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return int(module.main(argv[1:]) or 0)
    except InvalidArgumentError as exc:  # a bad argument: its message, not a traceback
        print(f"dqcoll {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
