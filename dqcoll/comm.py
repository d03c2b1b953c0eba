"""Communicators: a transport plus the per-communicator state every collective needs.

``dqcoll.init()`` makes one and sets it as the process default; ``dqcoll.testing.run_local``
gives each in-process rank its own (a thread-local default). The call counter keys the random
numbers of each call, so every rank must issue the same collectives in the same order, as with
NCCL.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import torch

from . import envs, kernels
from .errors import InvalidArgumentError, UnsupportedError
from .kernels import cpu_runtime
from .transports.base import Counters, Transport

__all__ = ["Communicator", "get_default_comm", "init", "set_default_comm"]

log = logging.getLogger("dqcoll")

_default: Communicator | None = None
_thread_default = threading.local()


class Communicator:
    """A group of ranks that run collectives together."""

    def __init__(
        self,
        transport: Transport,
        *,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.transport = transport
        self.seed = int(seed)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        if self.device.type == "cpu":
            # Ranks sharing this machine share its cores: the compiled CPU kernels divide them.
            local_ranks = transport.world_size if transport.name == "local" else 1
            if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():  # torchrun sets it
                local_ranks = max(local_ranks, int(os.environ["LOCAL_WORLD_SIZE"]))
            cpu_runtime.set_local_ranks(local_ranks)
            # Compile (or load from the disk cache) the CPU kernels now, not at some step.
            kernels.warm_up(self.device)
        self._calls = 0
        self.last_info: dict[str, Any] = {}
        # what schemes remember across calls (calibration); every rank updates it identically
        self.scheme_state: dict[Any, Any] = {}

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def counters(self) -> Counters:
        """``bytes_sent`` (payload + statistics + checks), ``bytes_recv``, message counts."""
        return self.transport.counters

    def next_step(self) -> int:
        step = self._calls
        self._calls += 1
        return step

    def barrier(self) -> None:
        self.transport.barrier(what="barrier")

    def abort(self, reason: str = "aborted by the caller") -> None:
        self.transport.abort(reason)

    def close(self) -> None:
        self.transport.close()
        global _default
        if _default is self:
            _default = None

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, "
            f"transport={self.transport.name!r})"
        )


def get_default_comm() -> Communicator:
    comm = getattr(_thread_default, "comm", None) or _default
    if comm is None:
        raise InvalidArgumentError(
            "no communicator: pass comm=..., call dqcoll.init() first, or run inside "
            "dqcoll.testing.run_local"
        )
    return comm


def set_default_comm(comm: Communicator | None, *, thread_local: bool = False) -> None:
    global _default
    if thread_local:
        _thread_default.comm = comm
    else:
        _default = comm


def _env_int(name: str, value: int | None) -> int:
    if value is not None:
        return int(value)
    if name not in os.environ:
        raise InvalidArgumentError(
            f"{name} is not set: pass it to dqcoll.init() or launch with torchrun"
        )
    return int(os.environ[name])


def init(
    backend: str = "gloo",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    group: Any = None,
    seed: int = 0,
    timeout_s: float | None = None,
    device: torch.device | str | None = None,
) -> Communicator:
    """Create the default communicator.

    * ``backend="gloo"``: initialise ``torch.distributed`` with gloo (unless already initialised)
      from the arguments or the torchrun variables (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE),
      and run dqcoll over it.
    * ``backend="torch"``: run over an existing torch.distributed ``group`` (default: WORLD).
    * ``backend="nccl"``: CuPy's NCCL bindings (needs CUDA GPUs and CuPy).
    """
    import torch.distributed as dist

    from .transports.torch_dist import TorchTransport

    timeout = envs.timeout_s() if timeout_s is None else float(timeout_s)
    if backend == "gloo":
        if not dist.is_initialized():
            r = _env_int("RANK", rank)
            n = _env_int("WORLD_SIZE", world_size)
            addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = int(master_port or os.environ.get("MASTER_PORT", "29500"))
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{addr}:{port}",
                rank=r,
                world_size=n,
                timeout=datetime.timedelta(seconds=timeout),
            )
        transport: Transport = TorchTransport(group, timeout_s=timeout)
    elif backend == "torch":
        transport = TorchTransport(group, timeout_s=timeout)
    elif backend == "nccl":
        try:
            from .transports import cupy_nccl  # type: ignore[attr-defined]
        except ImportError as exc:
            raise UnsupportedError(f"backend='nccl' is not available: {exc}") from exc
        transport = cupy_nccl.init_transport(  # type: ignore[attr-defined]
            rank=rank, world_size=world_size, master_addr=master_addr, master_port=master_port,
            timeout_s=timeout, device=device,
        )
        device = transport.device  # small all-reduces (argument checks) run on the GPU
    else:
        raise InvalidArgumentError(
            f"unknown backend {backend!r}; expected 'gloo', 'torch' or 'nccl'"
        )
    comm = Communicator(transport, seed=seed, device=device)
    set_default_comm(comm)
    return comm
