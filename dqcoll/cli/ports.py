"""A port for a rendezvous on this machine (``torch.distributed``'s TCP store on 127.0.0.1).

The launchers (``dqcoll demo``, ``dqcoll bench``, ``benchmarks/ddp_step.py``, the tools and
the tests) pick a free port, release it and hand it to the ranks, whose rank 0 binds it a
moment later. A port that ``bind(0)`` hands out comes from the kernel's ephemeral range, and
once released it is back in the pool from which every outgoing connection on the machine takes
its local port: a concurrent job's gloo mesh (dozens of connections per rank) can take it in
between, and the store then fails to bind (the likely cause of a launcher's test failing once
under ``pytest -n 2`` and passing on every rerun; not reproduced). :func:`rendezvous_port`
takes a random free port *below* the ephemeral range,
which outgoing connections never use; where that range cannot be read or leaves no room, it
falls back to ``bind(0)``.
"""

from __future__ import annotations

import random
import socket

__all__ = ["rendezvous_port"]

EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PORT = 10000  # above the registered services a developer's machine tends to run
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's default if unreadable)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return low, high


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def rendezvous_port(host: str = "127.0.0.1", *, attempts: int = 64) -> int:
    """A TCP port that is free on ``host`` now, outside the ephemeral range where it can be
    (see the module docstring)."""
    below = ephemeral_range()[0]
    if below - LOWEST_PORT >= 1024:
        pick = random.SystemRandom()
        for _ in range(attempts):
            port = pick.randrange(LOWEST_PORT, below)
            if _bindable(host, port):
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
