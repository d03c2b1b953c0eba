"""``python -m dqcoll_lab`` / ``dqcoll-lab``: one sub-command per module of :mod:`dqcoll_lab.cli`.

The runtime's ``dqcoll`` command keeps its own sub-commands (``demo``, ``bench``, ``tune``,
``plan``, ``simulate``); for one that moved here it prints where it went.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["COMMANDS", "main"]

# sub-command -> (module, help)
COMMANDS = {
    "eval": ("dqcoll_lab.cli.eval",
             "vNMSE of every scheme on the same gradients (table, CSV, PNG)"),
    "simulate": ("dqcoll_lab.cli.simulate",
                 "dqcoll simulate with DynamiQ's research formats and knobs"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dqcoll-lab",
                                     description="dqcoll's evaluation beside the runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints usage / error and exits
        return 2
    from dqcoll.errors import InvalidArgumentError

    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return int(module.main(argv[1:]) or 0)
    except InvalidArgumentError as exc:  # a bad argument: its message, not a traceback
        print(f"dqcoll-lab {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
