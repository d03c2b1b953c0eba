"""Some ranks of a transport as a transport of their own, numbered ``0..k-1`` (hierarchical
collectives): messages and counters are the parent's (not torch's ``new_group``: every rank)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidArgumentError
from .base import ALLREDUCE_OPS, Counters, Transport, gather_in_rank_order

__all__ = ["SubgroupTransport"]


class SubgroupTransport:
    name = "subgroup"

    def __init__(self, parent: Transport, ranks: Sequence[int]) -> None:
        members = [int(r) for r in ranks]
        if len(set(members)) != len(members) or not members:
            raise InvalidArgumentError(f"subgroup ranks must be distinct and non-empty: {members}")
        for r in members:
            if not 0 <= r < parent.world_size:
                raise InvalidArgumentError(
                    f"subgroup rank {r} outside the parent's [0, {parent.world_size})")
        if parent.rank not in members:
            raise InvalidArgumentError(
                f"rank {parent.rank} is not a member of the subgroup {members}")
        self.parent = parent
        self.ranks = tuple(members)
        self.rank = members.index(parent.rank)
        self.world_size = len(members)
        self.counters: Counters = parent.counters  # the same object: bytes go on its wire
        self.stream_ordered: bool = bool(getattr(parent, "stream_ordered", False))
        self.device = getattr(parent, "device", None) or torch.device("cpu")
        self.devices: tuple[str, ...] = tuple(getattr(parent, "devices", None) or ("cpu", "cuda"))

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, torch.Tensor]], *, what: str) -> None:
        for peer, _ in (*sends, *recvs):
            if not 0 <= peer < self.world_size:
                raise InvalidArgumentError(
                    f"subgroup rank {self.rank}: peer {peer} outside [0, {self.world_size})")
        self.parent.exchange([(self.ranks[p], t) for p, t in sends],
                             [(self.ranks[p], b) for p, b in recvs], what=what)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        if self.world_size == 1 or tensor.numel() == 0:
            return
        flat = tensor.detach().reshape(-1).clone()
        tensor.copy_(gather_in_rank_order(lambda s, r, w: self.exchange(s, r, what=w), self.rank,
                                          self.world_size, flat, op, what).view(tensor.shape))

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1, device=self.device), "sum", what=what)

    def synchronize(self, *, what: str = "synchronize") -> None:
        """The parent's host wait for what is queued (stream-ordered parents only)."""
        self.parent.synchronize(what=what)  # type: ignore[attr-defined]

    def abort(self, reason: str) -> None:
        self.parent.abort(reason)

    def close(self) -> None:
        pass  # the parent belongs to the caller
