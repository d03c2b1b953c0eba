"""Integrations of dqcoll with training frameworks (docs/design.md §1: the DDP hook, FSDP2's
custom collectives, the ``"dqcoll"`` backend), each imported on its own so that ``import dqcoll``
stays free of ``torch.distributed`` set-up.
"""

from __future__ import annotations

__all__: list[str] = []
