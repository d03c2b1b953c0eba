"""dqcoll: quantized collectives for data-parallel training over slow or shared networks."""

from __future__ import annotations

from . import metrics, schemes, testing, topology
from .api import all_gather, allreduce, reduce_scatter
from .comm import Communicator, init
from .errors import DqcollError
from .types import ReduceOp

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "DqcollError",
    "ReduceOp",
    "__version__",
    "all_gather",
    "allreduce",
    "init",
    "metrics",
    "reduce_scatter",
    "schemes",
    "testing",
    "topology",
]
