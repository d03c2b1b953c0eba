#!/usr/bin/env python3
"""``tools/netns_cluster.py``: the emulated cluster's command line (see :mod:`dqcoll.cli.netns`).

Kept as a script beside the other tools so that the commands in docs/benchmarks.md keep working;
the code lives in the package, where ``dqcoll demo`` can use it on an installed dqcoll. Rejected:
two copies (the demo and the tool would drift).
"""

from __future__ import annotations

import sys

from dqcoll.cli.netns import *  # noqa: F403  (the tool's names, for scripts that import it)
from dqcoll.cli.netns import main

if __name__ == "__main__":
    sys.exit(main())
