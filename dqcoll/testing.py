"""Run several ranks in one process, for tests, examples and notebooks (:func:`run_local`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .comm import Communicator, set_default_comm
from .errors import CommAbortedError
from .transports.local import LocalHub

__all__ = ["run_local"]


def run_local(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    device: str | torch.device = "cpu",
    seed: int = 0,
    timeout_s: float | None = None,
    return_exceptions: bool = False,
) -> list[Any]:
    """``fn(comm, *args)`` on one thread per rank over the ``local`` transport, the rank's
    communicator its default; returns each rank's value in rank order (its exception instead, if
    ``return_exceptions``). Else when a rank raises, the group is aborted and the first root
    cause re-raised after every thread has ended."""
    hub = LocalHub(world_size, timeout_s=timeout_s)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:  # a failed communicator creation is this rank's error too, never a lost result
            comm = Communicator(hub.transport(rank), seed=seed, device=device)
            set_default_comm(comm, thread_local=True)
            results[rank] = fn(comm, *args)
        except BaseException as exc:
            errors[rank] = exc
            if not return_exceptions:
                hub.abort(f"rank {rank} raised {exc.__class__.__name__}: {exc}")
        finally:
            set_default_comm(None, thread_local=True)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"dqcoll-rank{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if return_exceptions:
        return [results[r] if e is None else e for r, e in enumerate(errors)]
    # the first root cause, else the first abort
    raised = sorted((e for e in errors if e is not None),
                    key=lambda e: isinstance(e, CommAbortedError))
    if raised:
        raise raised[0]
    return results
