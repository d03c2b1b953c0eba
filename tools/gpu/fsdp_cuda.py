"""FSDP2 with ``compress()`` on CUDA tensors, several ranks on one GPU (tools/gpu_check.sh).

    torchrun --nproc-per-node 2 tools/gpu/fsdp_cuda.py --steps 3 --out fsdp_cuda.json

Every rank takes GPU 0 (its own ``NCCL_HOSTID`` and ``NCCL_MULTI_RANK_GPU_ENABLE=1``:
:func:`common.fake_host_env`), joins an NCCL process group, shards the same MLP with
``fully_shard`` (each block, then the model) and calls :func:`dqcoll.integrations.fsdp.compress`
with int8 blocks for the weights' all-gather and dynamiq at 5 bits for the gradients'
reduce-scatter, from the first step and for every tensor of a few KiB or more. Each step trains on
the rank's own batch with AdamW. The checks:

* the compressed lane was used on CUDA: ``state.summary()`` counts compressed weights and
  gradients calls (every step's), and they sent fewer bytes than FSDP2's own collectives;
* the replicas agree: the unsharded weights every block computed with in the last forward (the
  decoded all-gather) are bit-identical on every rank, and so are the full parameters after the
  last optimizer step;
* losses and parameters are finite.

Exit status 0 when all hold; rank 0 writes the report (the summary included) to ``--out``.
``--backend gloo`` runs the same on CPU processes (the CPU test of this script).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_common_args, agreed, crc, start_group, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args(argv)

    rank, device, world_size = start_group(args.backend)

    from dqcoll.integrations import fsdp as dqfsdp
    from dqcoll.integrations.policy import CompressionPolicy, RoleRule

    torch.manual_seed(0)  # the same initial model on every rank
    width = args.width
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                            for _ in range(args.blocks)], nn.Linear(width, width)).to(device)
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    policy = CompressionPolicy(weights=RoleRule("int8_block"),
                               gradients=RoleRule("dynamiq", args.bits), min_nbytes=4096,
                               warmup_steps=0)
    state = dqfsdp.compress(model, policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # the unsharded weights each Linear computes with (captured in the last step's forward)
    used: dict[str, int] = {}

    def capture(name: str) -> Any:
        def hook(module: nn.Module, inputs: Any) -> None:
            used[name] = crc([module.weight, module.bias])
        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(capture(name))

    report: dict[str, Any] = {"rank": rank, "world_size": world_size, "backend": args.backend,
                              "device": str(device), "torch": torch.__version__,
                              "policy": str(policy), "losses": []}
    for step in range(args.steps):
        used.clear()
        g = torch.Generator(device=device).manual_seed(1000 * rank + step)
        x = torch.randn(32, width, device=device, generator=g)
        y = torch.randn(32, width, device=device, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report["losses"].append(float(loss.detach()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    summary = state.summary()
    compressed = summary["compressed"]
    lanes = sorted({device_type for _, device_type in state.lanes})
    weights_identical, _ = agreed(sorted(used.items()))
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    params_identical, _ = agreed(crc(full))
    finite = all(bool(torch.isfinite(p).all()) for p in full) and all(
        v == v and abs(v) != float("inf") for v in report["losses"])
    wire = sum(c["wire_bytes"] for c in compressed.values())
    exact = sum(c["exact_bytes"] for c in compressed.values())
    lane_used = (compressed["weights"]["calls"] >= args.steps
                 and compressed["gradients"]["calls"] >= args.steps
                 and lanes == [device.type] and 0 < wire < exact)
    ok = lane_used and weights_identical and params_identical and finite and len(used) > 0
    report.update(summary=summary, lanes=lanes, lane_used=lane_used, wire_bytes=wire,
                  exact_bytes=exact, weights_identical=weights_identical,
                  params_identical=params_identical, finite=finite, ok=ok)
    write_report(report, args.out)
    state.close()
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
