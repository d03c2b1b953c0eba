#!/usr/bin/env python3
"""Thin wrapper so that ``python tools/bench.py ARGS`` runs ``dqcoll bench ARGS`` from a checkout
(see :mod:`dqcoll.cli.bench` for the flags and the columns)."""

from __future__ import annotations

import sys

from dqcoll.cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
