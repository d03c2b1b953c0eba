"""Train a small transformer with FSDP2 on CPU over gloo, its collectives from dqcoll.

    torchrun --nproc-per-node 4 examples/fsdp_train.py --mode both     # qwZ + qgZ (dqcoll)
    torchrun --nproc-per-node 4 examples/fsdp_train.py --mode exact    # FSDP2's own collectives
    torchrun --nproc-per-node 4 examples/fsdp_train.py --mode backend  # the "dqcoll" backend

Each rank trains :class:`dqcoll_lab.eval.tinylm.TinyLM` (a GPT-style decoder;
``--width 384 --layers 6`` has 10.7 M parameters) on its own random windows of the Python
standard library's source text (present on every machine), with AdamW, every block and the model
wrapped by ``fully_shard``.
``--mode``:

* ``exact``: FSDP2's own all-gather and reduce-scatter (``dist.all_gather_single`` /
  ``reduce_scatter_single``, through :func:`dqcoll.integrations.fsdp.compress` with every role
  exact, which only counts the bytes);
* ``qwz``: weights' all-gather in int8 blocks, gradients exact;
* ``qgz``: gradients' reduce-scatter with dynamiq at ``--bits``, weights exact;
* ``both``: both;
* ``backend``: no FSDP2 custom classes; the process group is the ``dqcoll`` backend
  (:mod:`dqcoll.integrations.torch_backend`), with the policy of ``both``.

Rank 0 prints the loss, the step time (the median over the steps after ``--warmup-timing``,
each the slowest rank's) and the bytes per step, and with ``--json`` writes them. ``train(config,
rank, world_size)`` is importable (the tests run it in spawned processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dqcoll import schemes
from dqcoll.integrations import fsdp as dqfsdp
from dqcoll.integrations.policy import CompressionPolicy, RoleRule
from dqcoll.schemes.seeds import derived_seed
from dqcoll_lab.eval.tinylm import LMConfig, TinyLM, sample_batch, split_corpus, stdlib_corpus

MODES = ("exact", "qwz", "qgz", "both", "backend")


@dataclasses.dataclass
class TrainConfig:
    mode: str = "both"
    bits: float = 5.0
    gradients: str = "dynamiq"  # reduce-scatter scheme of qgz / both / backend (with --bits)
    steps: int = 20
    warmup_steps: int = 0  # exact steps at the start (policy.warmup_steps)
    warmup_timing: int = 2  # steps left out of the step time
    batch: int = 4  # windows per rank and step
    context: int = 64
    lr: float = 1e-3
    width: int = 64
    layers: int = 2
    heads: int = 4
    seed: int = 0
    eval_batches: int = 8
    prefetch: bool = True  # explicit forward prefetch of the next block's all-gather
    threads: int = 1  # torch intra-op threads per rank (ranks share the machine's cores)


def policy_of(config: TrainConfig) -> CompressionPolicy:
    """The compression policy of a mode (``backend`` uses that of ``both``)."""
    none = RoleRule("none")
    takes_bits = "bits" in schemes.spec(config.gradients).options
    gradients = RoleRule(config.gradients, config.bits if takes_bits else None)
    weights = RoleRule("int8_block")
    rules = {"exact": (none, none), "qwz": (weights, none), "qgz": (none, gradients),
             "both": (weights, gradients), "backend": (weights, gradients)}[config.mode]
    return CompressionPolicy(weights=rules[0], gradients=rules[1], allreduce=gradients,
                             warmup_steps=config.warmup_steps, seed=config.seed)


def build_model(config: TrainConfig) -> TinyLM:
    """The model, every block and the whole wrapped by ``fully_shard`` (same init on every
    rank: TinyLM draws from a seeded generator)."""
    cfg = LMConfig(width=config.width, layers=config.layers, heads=config.heads,
                   context=config.context)
    model = TinyLM(cfg, seed=config.seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if config.prefetch:
        blocks = list(model.blocks)
        for block, following in itertools.pairwise(blocks):
            block.set_modules_to_forward_prefetch([following])
    return model


def _held_out_loss(model: TinyLM, val: torch.Tensor, config: TrainConfig) -> float:
    """Mean loss over ``eval_batches`` windows, the same windows on every rank."""
    g = torch.Generator().manual_seed(derived_seed(config.seed, "fsdp-eval"))
    total = 0.0
    with torch.no_grad():
        for _ in range(config.eval_batches):
            inputs, targets = sample_batch(val, config.batch, config.context, g)
            total += float(model(inputs, targets))
    return total / config.eval_batches


def _wire_bytes(summary: dict[str, Any]) -> tuple[int, int]:
    """(bytes this rank sent, bytes FSDP2's own collectives send for the same calls)."""
    sent = sum(c["wire_bytes"] for c in summary["compressed"].values())
    sent += sum(summary.get("exact_bytes", {}).values())
    exact = sum(c["exact_bytes"] for c in summary["compressed"].values())
    exact += sum(summary.get("exact_bytes", {}).values())
    return sent, exact


def train(config: TrainConfig, rank: int, world_size: int) -> dict[str, Any]:
    """Train on an initialised process group; every rank returns its results."""
    if config.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}")
    train_data, val = split_corpus(stdlib_corpus())
    model = build_model(config)
    state = None if config.mode == "backend" else dqfsdp.compress(model, policy_of(config))
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    g = torch.Generator().manual_seed(derived_seed(config.seed, "fsdp-train", rank))
    losses, step_s = [], []
    for _ in range(config.steps):
        inputs, targets = sample_batch(train_data, config.batch, config.context, g)
        start = time.perf_counter()
        loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
        step_s.append(float(elapsed))
        losses.append(float(loss.detach()))
    summary = state.summary() if state is not None else dist.group.WORLD.summary()
    sent, exact = _wire_bytes(summary)
    params = [p.full_tensor().detach() for p in model.parameters()]
    timed = step_s[config.warmup_timing:] or step_s
    return {
        "config": dataclasses.asdict(config),
        "world_size": world_size,
        "numel": sum(p.numel() for p in params),
        "losses": losses,
        "held_out_loss": _held_out_loss(model, val, config),
        "step_s": step_s,
        "step_s_median": statistics.median(timed),
        "wire_bytes_per_step": sent / config.steps,
        "exact_bytes_per_step": exact / config.steps,
        "summary": summary,
        "params": params if rank == 0 else None,
        "params_sum": [float(p.detach().double().sum()) for p in params],
    }


def _parse(argv: list[str] | None) -> tuple[TrainConfig, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        value = getattr(defaults, field.name)
        if isinstance(value, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"),
                                default=value)
        elif field.name == "mode":
            parser.add_argument(flag, choices=MODES, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    parser.add_argument("--json", default=None, help="rank 0 writes its results here")
    args = parser.parse_args(argv)
    out = args.json
    del args.json
    return TrainConfig(**vars(args)), out


def main(argv: list[str] | None = None) -> None:
    config, out = _parse(argv)
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    backend = "gloo"
    if config.mode == "backend":
        import dqcoll.integrations.torch_backend as torch_backend

        torch_backend.set_policy(policy_of(config))
        backend = "dqcoll"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        result = train(config, rank, world_size)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        result.pop("params")
        print(f"fsdp_train: mode {config.mode}, {world_size} ranks, {result['numel'] / 1e6:.2f} M "
              f"parameters: loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}, "
              f"held-out {result['held_out_loss']:.4f}, step {result['step_s_median'] * 1e3:.0f} "
              f"ms, {result['wire_bytes_per_step'] / 1e6:.2f} MB/step sent "
              f"(exact: {result['exact_bytes_per_step'] / 1e6:.2f} MB)")
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown at exit (it occasionally aborts a finished process)


if __name__ == "__main__":
    main()
