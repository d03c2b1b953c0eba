"""``python -m dqcoll_lab simulate``: the runtime's ``dqcoll simulate`` with DynamiQ's research
formats and knobs (``--scheme "dynamiq:format=paper;max_width=16"``, :mod:`dqcoll_lab.dynamiq`).

Arguments are ``dqcoll simulate``'s (``dqcoll simulate --help``); ``--scheme`` is folded by
:func:`dqcoll_lab.dynamiq.scheme_spec` before the runtime parses it.
"""

from __future__ import annotations

import sys

from dqcoll.cli import simulate as runtime_simulate
from dqcoll_lab.dynamiq import scheme_spec

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args):
        if arg == "--scheme" and i + 1 < len(args):
            args[i + 1] = scheme_spec(args[i + 1])
        elif arg.startswith("--scheme="):
            args[i] = "--scheme=" + scheme_spec(arg.split("=", 1)[1])
    return int(runtime_simulate.main(args) or 0)
