""":mod:`dqcoll.kernels.rng`, re-exported for the modules of this package that still import it
from here (``call.py``); new code imports ``dqcoll.kernels.rng``."""

from __future__ import annotations

from ...kernels.rng import *  # noqa: F403
from ...kernels.rng import __all__  # noqa: F401
