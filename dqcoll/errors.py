"""Exceptions raised by dqcoll: every one is a :class:`DqcollError`; errors that concern a peer
name the rank and the collective step."""

from __future__ import annotations

__all__ = [
    "CollectiveTimeoutError",
    "CommAbortedError",
    "DqcollError",
    "InvalidArgumentError",
    "MismatchError",
    "PeerError",
    "UnsupportedError",
    "one_line",
]


def one_line(exc: BaseException) -> str:
    """``"<type>: <first line>"`` of an exception, without c10d's appended C++ stack trace."""
    text = str(exc).split("Exception raised from", 1)[0].strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class DqcollError(RuntimeError):
    """Base class of every error raised by dqcoll."""


class InvalidArgumentError(DqcollError, ValueError):
    """An argument is invalid on this rank (dtype, contiguity, unknown name, ...)."""


class MismatchError(DqcollError, ValueError):
    """Ranks called the same collective with different arguments (length, dtype, scheme, ...)."""


class PeerError(DqcollError):
    """Another rank reported an error for this collective; this rank's inputs were fine."""


class CollectiveTimeoutError(DqcollError, TimeoutError):
    """A distributed wait ran past its timeout; the message names the peer and the step."""


class CommAbortedError(DqcollError):
    """The communicator was aborted (a peer died or a rank raised inside a local run)."""


class UnsupportedError(DqcollError, NotImplementedError):
    """An explicit request that cannot be honoured here (missing GPU, Triton, NCCL, ...)."""
