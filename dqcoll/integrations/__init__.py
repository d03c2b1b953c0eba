"""Integrations of dqcoll with training frameworks, each imported on its own so that ``import
dqcoll`` stays free of ``torch.distributed`` set-up.

:mod:`~dqcoll.integrations.torch_ddp` (the DDP hook, docs/ddp.md), :mod:`~dqcoll.integrations.fsdp`
(FSDP2's custom collectives) and :mod:`~dqcoll.integrations.torch_backend` (the ``"dqcoll"``
backend; both docs/fsdp.md) speak :mod:`~dqcoll.integrations.policy` and run on
:mod:`~dqcoll.integrations.lane`.
"""

from __future__ import annotations

__all__: list[str] = []
