"""The ``torch`` transport: any ``torch.distributed`` process group (gloo on CPU, nccl on GPU).

This is how dqcoll drops into a job launched by torchrun: the job's own process group carries
dqcoll's grouped point-to-point messages (``batch_isend_irecv``) and small all-reduces. Every wait
goes through ``Work.wait(timeout)``; a timeout or a broken connection becomes a
:class:`~dqcoll.errors.CollectiveTimeoutError` / :class:`~dqcoll.errors.PeerError` that names the
peer and the step. The group's own timeout (``init_process_group(timeout=...)``) still bounds
gloo's internals.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import envs
from ..errors import CollectiveTimeoutError, InvalidArgumentError, PeerError
from .base import ALLREDUCE_OPS, Counters, reduce_in_rank_order

__all__ = ["TorchTransport"]



class TorchTransport:
    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout_s: float | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError(
                "the torch transport needs an initialised torch.distributed process group "
                "(call torch.distributed.init_process_group first, or dqcoll.init(backend='gloo'))"
            )
        world = dist.group.WORLD
        assert world is not None  # initialised above
        self.group: dist.ProcessGroup = group if group is not None else world
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout_s = envs.timeout_s() if timeout_s is None else timeout_s
        self.counters = Counters()
        self.backend = str(dist.get_backend(self.group))
        self._global = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]

    def _wait(self, works: list[tuple[str, int, dist.Work]], what: str) -> None:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for kind, peer, work in works:
            try:
                ok = work.wait(timeout)
            except RuntimeError as exc:
                text = str(exc)
                if "imed out" in text or "imeout" in text:
                    raise CollectiveTimeoutError(
                        f"rank {self.rank}: timed out after {self.timeout_s:g} s on {kind} rank "
                        f"{peer} at {what}: {text.splitlines()[0]}"
                    ) from exc
                raise PeerError(
                    f"rank {self.rank}: {kind} rank {peer} failed at {what}: {text.splitlines()[0]}"
                ) from exc
            if ok is False:
                raise CollectiveTimeoutError(
                    f"rank {self.rank}: timed out after {self.timeout_s:g} s on {kind} rank {peer} "
                    f"at {what}"
                )

    def exchange(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        *,
        what: str,
    ) -> None:
        self._post(sends, recvs, what)
        for _, tensor in sends:
            self.counters.count_send(tensor.numel() * tensor.element_size())
        for _, buffer in recvs:
            self.counters.count_recv(buffer.numel() * buffer.element_size())

    def _post(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        what: str,
    ) -> None:
        """Post one grouped exchange and wait for it (no counting)."""
        ops = []
        labels: list[tuple[str, int]] = []
        for peer, tensor in sends:
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), self._global[peer], self.group))
            labels.append(("sending to", peer))
        for peer, buffer in recvs:
            ops.append(dist.P2POp(dist.irecv, buffer, self._global[peer], self.group))
            labels.append(("receiving from", peer))
        if not ops:
            return
        try:
            works = dist.batch_isend_irecv(ops)
        except RuntimeError as exc:
            raise PeerError(f"rank {self.rank}: posting messages failed at {what}: {exc}") from exc
        self._wait([(k, p, w) for (k, p), w in zip(labels, works, strict=True)], what)

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, what: str) -> None:
        """Small all-reduce in rank order over point-to-point messages, not gloo's or NCCL's own
        all-reduce: the same bits as every other dqcoll transport (see
        :func:`~dqcoll.transports.base.reduce_in_rank_order`)."""
        if op not in ALLREDUCE_OPS:
            raise InvalidArgumentError(f"allreduce op must be one of {ALLREDUCE_OPS}, got {op!r}")
        if self.world_size > 1 and tensor.numel():
            flat = tensor.detach().contiguous().reshape(-1)
            reduced = reduce_in_rank_order(self._post, self.rank, self.world_size, flat, op, what)
            tensor.copy_(reduced.view(tensor.shape))
        self.counters.count_allreduce(tensor.numel() * tensor.element_size(), self.world_size)

    def barrier(self, *, what: str = "barrier") -> None:
        self.allreduce(torch.zeros(1), "sum", what=what)

    def abort(self, reason: str) -> None:
        # torch.distributed has no portable abort for gloo; peers learn of it through their timeouts
        # or the closed connections once this process exits.
        pass

    def close(self) -> None:
        pass
