"""What the GPU check's torchrun scripts share (tools/gpu_check.sh runs them).

Several NCCL ranks on one GPU: :func:`fake_host_env` gives each rank a ``NCCL_HOSTID`` of its own
(NCCL then treats every rank as a host of its own and connects them with sockets over loopback)
and ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL 2.30 and later refuse two ranks on one device without
it). :func:`add_common_args` and :func:`start_group` are the scripts' shared command line and
start-up. :func:`crc` and :func:`agreed` compare bytes across ranks; :func:`write_report` prints a
``REPORT`` line and, on rank 0, writes the JSON the check keeps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def fake_host_env(rank: int | str, hostname: str | None = None) -> dict[str, str]:
    """The NCCL variables of rank ``rank`` when several ranks share one GPU: its own host id, the
    multi-rank switch, sockets over loopback, no InfiniBand, peer-to-peer or shared memory."""
    host = socket.gethostname() if hostname is None else hostname
    return {"NCCL_HOSTID": f"{host}-gpucheck-rank{rank}", "NCCL_MULTI_RANK_GPU_ENABLE": "1",
            "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1"}


def apply_fake_host_env() -> int:
    """Set :func:`fake_host_env` of this torchrun rank (``RANK``) in ``os.environ``, before
    any NCCL communicator exists; returns the rank."""
    rank = int(os.environ.get("RANK", "0"))
    os.environ.update(fake_host_env(rank))
    return rank


def crc(tensors: Iterable[torch.Tensor]) -> int:
    """CRC-32 of the tensors' bytes, in order (read from a host copy: numpy must not hold the
    tensor's own storage, which FSDP2 resizes when it reshards)."""
    value = 0
    for t in tensors:
        host = t.detach().to("cpu", copy=True).contiguous().reshape(-1)
        data = host.view(torch.uint8).numpy().tobytes()
        value = zlib.crc32(data, value)
    return value


def agreed(value: Any, group: dist.ProcessGroup | None = None) -> tuple[bool, list[Any]]:
    """Whether every rank of ``group`` passed the same ``value``, and the values by rank."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return all(v == values[0] for v in values), values


def write_report(report: dict[str, Any], out: Path | None) -> None:
    """Print ``REPORT <json>`` (every rank) and write the JSON to ``out`` (rank 0)."""
    text = json.dumps(report, sort_keys=True)
    print("REPORT " + text, flush=True)
    if out is not None and report.get("rank", 0) == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every script takes: steps, bits, backend, the report's path."""
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                        help="nccl: every rank on GPU 0; gloo: CPU processes")
    parser.add_argument("--out", type=Path, default=None, help="rank 0's JSON report")


def start_group(backend: str) -> tuple[int, torch.device, int]:
    """This torchrun rank's NCCL variables (:func:`apply_fake_host_env`), its device (GPU 0 for
    every rank under NCCL, else the CPU) and the default process group; (rank, device, world
    size)."""
    rank = apply_fake_host_env()
    if backend == "nccl":
        torch.cuda.set_device(0)  # every rank on the one GPU
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=120))
    return rank, device, dist.get_world_size()
