""":mod:`dqcoll.kernels.codec`, re-exported for the modules of this package that still import it
from here (``call.py``); new code imports ``dqcoll.kernels.codec``."""

from __future__ import annotations

from ...kernels.codec import *  # noqa: F403
from ...kernels.codec import __all__  # noqa: F401
