"""The DDP hook over an NCCL process group, several ranks on one GPU (a step of tools/gpu_check.sh).

    torchrun --nproc-per-node 2 tools/gpu/ddp_nccl.py --steps 3 --out ddp_nccl.json

Every rank takes GPU 0 (its own ``NCCL_HOSTID`` and ``NCCL_MULTI_RANK_GPU_ENABLE=1``:
:func:`common.fake_host_env`), joins an NCCL process group, wraps the same small MLP in
DistributedDataParallel (small buckets, so that a step averages several) and registers
:func:`dqcoll.integrations.torch_ddp.dynamiq_hook` with dynamiq at 5 bits from the first step. Each
step trains on the rank's own batch; afterwards every rank's gradients and parameters must be
bit-identical to every other rank's (CRC compared over the group), finite, and the hook must have
sent fewer bytes than fp32 all-reduces of the same buckets would. Exit status 0 when all of that
holds; rank 0 writes the report to ``--out``.
``--backend gloo`` runs the same on CPU processes (the CPU test of this script).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, agreed, crc, start_group, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args(argv)

    rank, device, world_size = start_group(args.backend)

    from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

    torch.manual_seed(0)  # the same initial replica everywhere (DDP broadcasts rank 0's anyway)
    width = args.width
    model = nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                          nn.Linear(width, 256)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0] if device.type == "cuda" else None,
                                  bucket_cap_mb=1)
    state = DynamiqState(scheme="dynamiq", bits=args.bits, warmup_steps=0)
    state.prepare()
    ddp.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    report: dict[str, Any] = {"rank": rank, "world_size": world_size, "steps": [],
                              "backend": args.backend, "device": str(device),
                              "torch": torch.__version__, "bits": args.bits}
    ok = True
    numel = sum(p.numel() for p in model.parameters())
    for step in range(args.steps):
        g = torch.Generator(device=device).manual_seed(1000 * rank + step)
        x = torch.randn(64, 256, device=device, generator=g)
        y = torch.randn(64, 256, device=device, generator=g)
        start = time.perf_counter()
        loss = nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = all(bool(torch.isfinite(t).all()) for t in grads)
        same_grads, _ = agreed(crc(grads))
        same_params, _ = agreed(crc(model.parameters()))
        ok = ok and finite and same_grads and same_params and len(grads) > 0
        report["steps"].append({"step": step, "loss": float(loss.detach()), "time_s": elapsed,
                                "grads_finite": finite, "grads_identical": same_grads,
                                "params_identical": same_params})
    assert state.comm is not None
    sent = int(state.comm.counters["bytes_sent"])
    # a ring all-reduce of fp32 sends 2 (n-1)/n of the buffer per rank and step
    exact = int(args.steps * numel * 4 * 2 * (world_size - 1) / world_size)
    compressed = 0 < sent < exact
    ok = ok and compressed and state.iteration == args.steps
    report.update(bytes_sent=sent, exact_fp32_bytes=exact, compressed=compressed,
                  hook_iterations=state.iteration, last_info={
                      k: v for k, v in state.comm.last_info.items()
                      if isinstance(v, (int, float, str, bool)) and not (
                          isinstance(v, float) and math.isnan(v))},
                  ok=ok, nccl_env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
    write_report(report, args.out)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown, as dqcoll.cli.bench's ranks do: after
    # destroy_process_group, gloo's C++ teardown can abort a finished rank at exit ("terminate
    # called without an active exception") after its report was written (docs/reliability.md).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
