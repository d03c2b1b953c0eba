"""Ranks as processes on this machine, for the commands that start their own (``dqcoll demo``,
``dqcoll plan``): spawn them with a rendezvous port, return what rank 0 reports, and stop at
once with the exit codes when a rank fails instead of waiting for a report that never comes."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from .ports import rendezvous_port

__all__ = ["parse_count", "run_local_ranks"]


def parse_count(text: str) -> int:
    """``16M``, ``64K``, ``1G`` or a plain integer (suffixes are powers of 2)."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def run_local_ranks(target: Callable[..., None], world_size: int, args: argparse.Namespace,
                    *, what: str) -> Any:
    """Start ``world_size`` processes running ``target(rank, world_size, port, args, out)``;
    rank 0 puts its result on the queue ``out``, which this returns. Raises ``RuntimeError``
    with every rank's exit code as soon as one fails."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = rendezvous_port()
    procs = [ctx.Process(target=target, args=(r, world_size, port, args, out))
             for r in range(world_size)]
    for p in procs:
        p.start()
    result = None
    received = False
    try:
        while not received:
            try:
                result = out.get(timeout=5)
                received = True
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a {what} rank failed: exit codes "
                                       f"{[p.exitcode for p in procs]}") from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return result
