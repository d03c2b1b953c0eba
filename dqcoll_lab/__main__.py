"""``python -m dqcoll_lab <command>``: the lab's command line (:mod:`dqcoll_lab.cli.main`)."""

from __future__ import annotations

import sys

from .cli.main import main

sys.exit(main())
