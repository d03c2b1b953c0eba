"""Drop-in integrations of dqcoll with training frameworks.

* :mod:`dqcoll.integrations.torch_ddp`: a PyTorch DDP communication hook (``DynamiqState`` and
  ``dynamiq_hook``) that runs any registered dqcoll scheme on DDP's gradient buckets.

Each integration is imported on its own (``from dqcoll.integrations import torch_ddp``), so that
``import dqcoll`` stays free of ``torch.distributed`` set-up.
"""

from __future__ import annotations

__all__: list[str] = []
