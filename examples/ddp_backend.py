"""A plain DDP script (no comm hook) that gets compressed all-reduces from the "dqcoll" backend.

    torchrun --nproc-per-node 4 examples/ddp_backend.py --backend dqcoll
    torchrun --nproc-per-node 4 examples/ddp_backend.py --backend gloo    # the same, exact

Nothing in the training loop knows about dqcoll: the only change from a gloo script is
``import dqcoll.integrations.torch_backend`` and ``init_process_group("dqcoll")``. Each step
also all-reduces the loss (a 1-element fp32 tensor) and the number of tokens seen (an int64
tensor), as training scripts do for logging; under the backend's default policy those stay exact
and DDP's gradient buckets (fp32, at least 64 KiB) are compressed with dynamiq at 5 bits. Rank 0
prints the losses, the replicas' agreement and the backend's counters (``--json`` writes them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dqcoll.schemes.seeds import derived_seed
from dqcoll_lab.eval.tinylm import LMConfig, TinyLM, sample_batch, split_corpus, stdlib_corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "dqcoll"), default="dqcoll")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.backend == "dqcoll":
        import dqcoll.integrations.torch_backend  # noqa: F401  (registers "dqcoll")
    dist.init_process_group(args.backend)
    rank = dist.get_rank()

    train_data, _ = split_corpus(stdlib_corpus())
    model = DistributedDataParallel(TinyLM(LMConfig(width=args.width, layers=args.layers),
                                           seed=args.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(derived_seed(args.seed, "ddp-backend", rank))
    losses, tokens = [], torch.zeros(1, dtype=torch.int64)
    for _ in range(args.steps):
        inputs, targets = sample_batch(train_data, args.batch, 64, g)
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach().reshape(1).clone()
        dist.all_reduce(logged)  # the mean loss over ranks, for the log: exact
        seen = torch.tensor([inputs.numel()], dtype=torch.int64)
        dist.all_reduce(seen)  # an integer collective: exact
        tokens += seen
        losses.append(float(logged) / dist.get_world_size())
    crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    crcs: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(crcs, crc)
    result = {"backend": args.backend, "world_size": dist.get_world_size(), "losses": losses,
              "tokens": int(tokens), "expected_tokens": args.steps * dist.get_world_size()
              * args.batch * 64, "replicas_identical": len(set(crcs)) == 1,
              "numel": sum(p.numel() for p in model.parameters())}
    pg = dist.group.WORLD
    if hasattr(pg, "summary"):
        result["backend_summary"] = pg.summary()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at exit (it occasionally aborts a finished process)


if __name__ == "__main__":
    main()
