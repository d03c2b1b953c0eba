"""Drop-in integrations of dqcoll with training frameworks.

* :mod:`dqcoll.integrations.torch_ddp`: a PyTorch DDP communication hook (``DynamiqState`` and
  ``dynamiq_hook``) that runs any registered dqcoll scheme on DDP's gradient buckets.
* :mod:`dqcoll.integrations.fsdp`: FSDP2's custom ``AllGather`` / ``ReduceScatter`` with dqcoll's
  quantized collectives (ZeRO++'s qwZ and qgZ), set on a model by ``compress(model, policy)``.
* :mod:`dqcoll.integrations.torch_backend`: the drop-in ``torch.distributed`` backend
  ``"dqcoll"`` (registered on import): compressed all-reduce, reduce-scatter and all-gather of
  large floating-point tensors, the wrapped gloo for everything else.
* :mod:`dqcoll.integrations.policy`: which collective is compressed how (``CompressionPolicy``,
  ``DQCOLL_POLICY``); :mod:`dqcoll.integrations.lane`: the thread and connection on which the
  two above run dqcoll's collectives.

Each integration is imported on its own (``from dqcoll.integrations import torch_ddp``), so that
``import dqcoll`` stays free of ``torch.distributed`` set-up.
"""

from __future__ import annotations

__all__: list[str] = []
