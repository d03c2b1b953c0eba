"""Settings every rank must share, agreed once where ranks start to talk: never per call.

Settings that change which messages a collective sends (:func:`wire_settings`, an integration's
policy) are agreed before any payload moves, as ranks that differ would fail uncleanly later.
:func:`agree_over` (a new communicator over :data:`AGREED_TRANSPORTS`): one all-reduce of hashes,
then only where they differ one of every rank's text, so that the
:class:`~dqcoll.errors.MismatchError` every rank raises names each value.
:func:`agree_through_store`: the same through a key-value store (the FSDP2 classes).
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Mapping
from typing import Any

import torch

from . import envs
from .errors import CollectiveTimeoutError, MismatchError

__all__ = ["AGREED_TRANSPORTS", "SKIPPED", "agree_over", "agree_through_store", "hash62",
           "wire_settings"]

# transports whose ranks are processes of their own: a communicator over one agrees at creation
AGREED_TRANSPORTS = ("torch", "nccl4py", "nccl-cupy")
SKIPPED = {
    "local": "in-process ranks share one environment",
    "subgroup": "a view of a transport whose ranks agreed when its communicator was created",
}
SLOTS = 32  # settings per agreement (the vector has a fixed size whatever the settings)
TEXT_NBYTES = 2048  # each rank's text in the second exchange (longer texts are cut)
_LIMIT = (1 << 62) - 1


def wire_settings(seed: int) -> dict[str, str]:
    """The settings every rank of a communicator must share, as canonical text."""
    return {
        "DQCOLL_VALIDATE": "1" if envs.validate() else "0",
        "DQCOLL_AUTO_FORCE": envs.auto_force() or "",
        "seed": str(int(seed)),
    }


def hash62(text: str) -> int:
    """A 62-bit hash of ``text`` (collisions of probability 2**-62)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _LIMIT


def _text(settings: Mapping[str, str]) -> str:
    return "\n".join(f"{name}={settings[name]}" for name in sorted(settings))


def _parse(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def agree_over(transport: Any, settings: Mapping[str, str], *, what: str) -> str | None:
    """Raise :class:`MismatchError` on every rank of ``transport`` unless all hold the same
    ``settings`` (at most :data:`SLOTS`; ``what`` the same on every rank). Returns why nothing
    was exchanged (one rank, a transport in :data:`SKIPPED`), else None."""
    name = getattr(transport, "name", "")
    if transport.world_size == 1:
        return "one rank"
    if name not in AGREED_TRANSPORTS:
        return SKIPPED.get(name, f"transport {name!r} is not one of {AGREED_TRANSPORTS}")
    if len(settings) > SLOTS:
        raise ValueError(f"at most {SLOTS} settings are agreed, got {len(settings)}")
    names = sorted(settings)
    hashes = [hash62(" ".join(names)), *(hash62(f"{k}={settings[k]}") for k in names)]
    hashes += [0] * (1 + SLOTS - len(hashes))
    values = torch.tensor(hashes, dtype=torch.int64)
    # on the transport's device: an NCCL group's small all-reduces take its GPU's tensors
    device = getattr(transport, "device", None) or torch.device("cpu")
    vector = torch.cat([values, -values]).to(device)
    transport.allreduce(vector, "max", what=f"{what}: settings agreement")
    vector = vector.cpu()
    k = 1 + SLOTS
    if torch.equal(vector[:k], -vector[k:]):
        return None
    # they differ: every rank's text, so that each rank's message names every value
    rows = TEXT_NBYTES // 8
    texts = torch.zeros(transport.world_size, rows, dtype=torch.int64)
    mine = _text(settings).encode()[:TEXT_NBYTES]
    texts[transport.rank].view(torch.uint8)[: len(mine)] = torch.tensor(list(mine))
    texts = texts.to(device)
    transport.allreduce(texts, "sum", what=f"{what}: settings of every rank")
    texts = texts.cpu()
    found = [_parse(bytes(row.view(torch.uint8).tolist()).rstrip(b"\0").decode(
        errors="replace")) for row in texts]
    raise MismatchError(_describe(transport.rank, what, found))


def agree_through_store(store: Any, prefix: str, rank: int, world_size: int,
                        settings: Mapping[str, str], *, timeout_s: float,
                        what: str) -> None:
    """:func:`agree_over` through a key-value store (keys ``prefix + str(rank)``); a rank missing
    after ``timeout_s`` is named in a :class:`~dqcoll.errors.CollectiveTimeoutError`."""
    if world_size == 1:
        return
    keys = [f"{prefix}{r}" for r in range(world_size)]
    store.set(keys[rank], _text(settings))
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise CollectiveTimeoutError(
                f"rank {rank}: {what}: ranks {missing} did not publish their settings within "
                f"{timeout_s:g} s (every rank of the group must reach this point)")
        time.sleep(pause)
        pause = min(0.05, 2 * pause)
    found = [_parse(bytes(store.get(key)).decode(errors="replace")) for key in keys]
    # all read before any goes on: a raising rank 0 may exit, and the store it serves with it
    done = [f"{prefix}read/{r}" for r in range(world_size)]
    store.set(done[rank], "1")
    with contextlib.suppress(Exception):  # the store went away once everyone had read
        while not store.check(done) and time.monotonic() < deadline:
            time.sleep(0.002)
    if any(other != found[rank] for other in found):
        raise MismatchError(_describe(rank, what, found))


def _describe(rank: int, what: str, found: list[dict[str, str]]) -> str:
    """Every setting on which the ranks differ, with each rank's value."""
    parts = []
    for name in sorted(set().union(*found)):
        groups: dict[str, list[int]] = {}
        for r, settings in enumerate(found):
            groups.setdefault(settings.get(name, "<not set>"), []).append(r)
        if len(groups) > 1:
            parts.append(f"{name} (" + "; ".join(
                f"{_ranks(ranks)}: {value!r}" for value, ranks in groups.items()) + ")")
    return (f"rank {rank}: {what}: ranks disagree on {', '.join(parts) or 'their settings'}; "
            f"these settings change the messages (or which connection a call takes), so every "
            f"rank must have the same (this rank: {found[rank]})")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)"
                                              if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"

