"""Surviving a lost rank: the survivors of a failed communicator agree on who is left and build
a new group of exactly those ranks (``Communicator.shrink()``).

After a rank dies, every survivor's collective raises (a :class:`~dqcoll.errors.PeerError` within
~0.1 s over gloo) and the communicator is dead: messages of the failed call may still be in
flight, and gloo's connections to the dead rank are gone. The survivors then meet in the job's
key-value store (the ``TCPStore`` every gloo job already has) under a fresh key prefix, one per
shrink:

1. **Abort the old group.** Each survivor aborts its old gloo group first, closing its
   connections: a survivor still blocked on a peer that has already left the failed call (rather
   than on the dead rank) then fails at once instead of waiting for its timeout.
2. **Check in.** Each survivor sets ``<prefix>alive/<old rank>``.
3. **Close the membership.** A survivor waits until every rank it expects has checked in: all
   ranks but ``exclude`` (when the caller names the dead ranks, e.g. from the error) or, without
   ``exclude``, all ranks, until ``wait_s`` seconds passed without a new arrival (survivors
   that fail one after another, each released by the previous one's abort, keep the window
   open), and never longer than the timeout. Then it proposes the ranks it saw with
   one ``compare_set`` on ``<prefix>members``: the first proposal wins, and every survivor adopts
   it, so all survivors agree on the same ordered list even when one of them was slow to arrive.
   A rank that is not in the list (it arrived after the membership was closed) raises
   :class:`~dqcoll.errors.CommAbortedError`.
4. **New group.** The members form a new gloo process group (``ProcessGroupGloo`` over a
   ``PrefixStore`` of ``<prefix>pg/``, ranks renumbered in the old order) and a new
   communicator over it, with the old communicator's seed and device.

The old default process group (``torch.distributed``'s WORLD) is left as it is: it still counts
the dead rank, so code that must continue (DDP's gradient averaging) has to use the new
communicator (see :mod:`dqcoll.integrations.torch_ddp`).

The store must outlive the lost rank. ``dqcoll.init(backend="gloo")`` serves it from rank 0 (as
``init_process_group`` does), so losing rank 0 loses the store: pass ``store=`` (a ``TCPStore``
served elsewhere, e.g. by torchrun's agent), or expect a :class:`~dqcoll.errors.CommAbortedError`
naming the store. NCCL (``ncclCommShrink``) and the in-process ``local`` transport are not
covered here (:class:`~dqcoll.errors.UnsupportedError`).

Rejected: ``torch.distributed.new_group(survivors)``, which every rank of the *old* world
(the dead one included) must call; and re-initialising the default process group, which would
invalidate every other group and object (DDP models) built on it in the surviving processes.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Sequence
from typing import Any

from . import envs
from .errors import CommAbortedError, InvalidArgumentError, UnsupportedError, one_line

__all__ = ["DEFAULT_WAIT_S", "agree_on_members", "shrink_torch_transport"]

log = logging.getLogger("dqcoll")

# How long a survivor waits for the ranks it expects (without ``exclude``) before it closes the
# membership with the ranks it has seen. Survivors of a SIGKILLed rank reach shrink() within
# ~0.1 s of each other over gloo (docs/reliability.md); 2 s leaves room for a loaded machine.
DEFAULT_WAIT_S = 2.0
_POLL_S = 0.02


def agree_on_members(store: Any, prefix: str, rank: int, world_size: int, *,
                     exclude: Sequence[int] = (), wait_s: float = DEFAULT_WAIT_S,
                     timeout_s: float) -> list[int]:
    """Steps 2 and 3 of the module docstring: the agreed, ordered list of surviving old ranks."""
    expected = [r for r in range(world_size) if r not in set(exclude)]
    if rank not in expected:
        raise InvalidArgumentError(f"rank {rank}: shrink(exclude={list(exclude)}) excludes this "
                                   f"rank itself")
    keys = {r: f"{prefix}alive/{r}" for r in range(world_size)}
    patience = wait_s if not exclude else timeout_s
    try:
        store.set(keys[rank], "1")
        start = last_arrival = time.monotonic()
        seen: list[int] = []
        while True:
            now_seen = [r for r in range(world_size) if store.check([keys[r]])]
            now = time.monotonic()
            if now_seen != seen:  # survivors arriving one after another extend the window
                seen, last_arrival = now_seen, now
            if all(r in seen for r in expected) or now - last_arrival >= patience or (
                    now - start >= timeout_s):
                break
            time.sleep(_POLL_S)
        proposal = ",".join(str(r) for r in seen if r in expected)
        agreed = store.compare_set(f"{prefix}members", "", proposal)
    except Exception as exc:
        raise CommAbortedError(
            f"rank {rank}: shrink: the store is unreachable ({one_line(exc)}); it lived in a "
            f"lost rank's process (dqcoll.init serves it from rank 0): pass store= with a store "
            f"served elsewhere (e.g. torchrun's)") from None
    members = [int(r) for r in agreed.decode().split(",") if r]
    if rank not in members:
        raise CommAbortedError(
            f"rank {rank}: shrink: the survivors closed their new group without this rank "
            f"(members {members}, old world size {world_size}): it arrived more than "
            f"{patience:g} s after the last of them")
    return members


def shrink_torch_transport(transport: Any, *, generation: str, exclude: Sequence[int] = (),
                           wait_s: float = DEFAULT_WAIT_S, timeout_s: float | None = None,
                           store: Any = None) -> tuple[Any, list[int]]:
    """Steps 1 to 4 for the ``torch`` transport over gloo: (new transport, agreed old ranks)."""
    import torch.distributed as dist

    from .transports.torch_dist import TorchTransport

    if not isinstance(transport, TorchTransport) or transport.backend != "gloo":
        raise UnsupportedError(
            f"rank {transport.rank}: shrink() needs the torch transport over gloo, not "
            f"{getattr(transport, 'name', type(transport).__name__)!r}"
            f"{' (' + transport.backend + ')' if isinstance(transport, TorchTransport) else ''}: "
            f"NCCL communicators and in-process (local) groups are recreated instead")
    timeout = transport.timeout_s if timeout_s is None else envs.check_timeout_s(timeout_s)
    base = store if store is not None else transport.store
    if base is None:
        raise UnsupportedError(
            f"rank {transport.rank}: shrink() needs the job's key-value store and found none: "
            f"pass store=")
    transport.abort("shrinking after a lost rank")  # step 1
    prefix = f"{transport.store_prefix}shrink/{generation}/"
    members = agree_on_members(base, prefix, transport.rank, transport.world_size,
                               exclude=exclude, wait_s=wait_s, timeout_s=timeout)
    new_rank = members.index(transport.rank)
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}pg/", base), new_rank,
                                      len(members), datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise CommAbortedError(
            f"rank {transport.rank}: shrink: creating the gloo group of the survivors "
            f"{members} failed: {one_line(exc)}") from exc
    new = TorchTransport(group, timeout_s=timeout, store=base, store_prefix=prefix)
    log.warning("rank %d: shrank to ranks %s of %d (now rank %d of %d)", transport.rank, members,
                transport.world_size, new_rank, len(members))
    return new, members
