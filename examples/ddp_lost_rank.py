"""DDP training that survives a lost rank: 4 gloo ranks, one SIGKILLed mid-training, 3 finish.

    python examples/ddp_lost_rank.py                     # 4 ranks, rank 2 killed at step 40
    python examples/ddp_lost_rank.py --world-size 5 --kill-rank 1 --kill-step 30 --steps 100

The script starts its own ranks (not torchrun: torchrun's agent would stop every worker when one
dies). Each rank trains :class:`dqcoll_lab.eval.tinylm.TinyLM` with DDP, its gradients averaged by
``dynamiq_hook`` with ``fault_tolerant=True`` (:mod:`dqcoll.integrations.torch_ddp`). At
``--kill-step`` the victim SIGKILLs itself in the middle of a gradient all-reduce. On each
survivor that all-reduce raises a PeerError within ~0.1 s; the hook records it and hands DDP the
bucket unreduced, so backward ends; the loop then

1. skips the optimizer step (the gradients of that step are not averages),
2. ``state.shrink()``: the survivors agree on who is left and form a new gloo group (a few tens
   of milliseconds, or ``wait_s`` = 2 s when the dead ranks are not named),
3. ``resync(...)``: every survivor takes the lowest survivor's parameters, AdamW state and step
   counter (one of them may have completed the step the others lost),

and goes on averaging over 3 ranks. Rank 0 prints the loss curve, the recovery times, and at the
end whether the survivors' replicas are bit-identical.

Limits (see docs/reliability.md): rank 0 serves the job's store here (as
``init_process_group`` with env:// does), so it must not be the lost rank - use a store served
elsewhere (torchrun's agent, ``store=``) for that; the lost rank's data is gone (each rank draws
its own random windows here; a sharded loader must re-shard over the survivors); the global batch
shrinks by a quarter, which AdamW absorbs without a learning-rate change at this scale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dqcoll.errors import DqcollError
from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook, resync
from dqcoll.schemes.seeds import derived_seed
from dqcoll_lab.eval.tinylm import LMConfig, TinyLM, sample_batch, split_corpus, stdlib_corpus


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--kill-rank", type=int, default=2, help="-1: nobody dies")
    parser.add_argument("--kill-step", type=int, default=40)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--scheme", default="dynamiq")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=60.0,
                        help="DQCOLL_TIMEOUT_S of the ranks")
    parser.add_argument("--json", default=None, help="write rank 0's results to this file")
    args = parser.parse_args(argv)
    if args.kill_rank == 0:
        parser.error("rank 0 serves the store in this example: kill another rank")
    return args


def _kill_mid_call(state: DynamiqState) -> None:
    """Make this rank SIGKILL itself inside its next gradient all-reduce (after a message)."""
    comm = state.communicator(torch.device("cpu"))

    def killing(original):  # type: ignore[no-untyped-def]
        def exchange(sends, recvs, *, what):  # type: ignore[no-untyped-def]
            if "reduce step 1" in what:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(sends, recvs, what=what)
        return exchange

    # both ways a payload leaves (dynamiq's go in frames over gloo)
    comm.transport.exchange = killing(comm.transport.exchange)  # type: ignore[method-assign]
    comm.transport.exchange_framed = killing(  # type: ignore[attr-defined]
        comm.transport.exchange_framed)  # type: ignore[attr-defined]


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # several ranks share a few cores
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    torch.manual_seed(derived_seed(args.seed, "ddp-train", rank))
    train_data, _ = split_corpus(stdlib_corpus(1 << 20))
    model = TinyLM(LMConfig(width=64, layers=2, heads=4, context=64), seed=args.seed)
    # broadcast_buffers=False: DDP would broadcast buffers over its own group, which still
    # counts the lost rank (TinyLM has none; a model with constant buffers is fine too)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.1, broadcast_buffers=False)
    state = DynamiqState(policy=f"seed={args.seed}", scheme=args.scheme, bits=args.bits,
                         warmup_steps=args.warmup_steps, fault_tolerant=True)
    ddp.register_comm_hook(state, dynamiq_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    data_rng = torch.Generator().manual_seed(derived_seed(args.seed, "ddp-data", rank))

    losses: list[tuple[int, float, int]] = []  # (step, loss, ranks averaging)
    recoveries: list[dict[str, object]] = []
    step = 0
    start = time.perf_counter()
    while step < args.steps:
        if rank == args.kill_rank and step == args.kill_step:
            _kill_mid_call(state)
        inputs, targets = sample_batch(train_data, args.batch, 64, data_rng)
        loss = ddp(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if state.failure is not None:  # a rank was lost during this step's averaging
            failed_at = time.perf_counter()
            error = f"{type(state.failure).__name__}: {str(state.failure)[:160]}"
            comm = state.shrink()
            shrunk_at = time.perf_counter()
            step = resync(state, model, optimizer, step)
            recoveries.append({"step": step, "error": error, "members": comm.members,
                               "shrink_s": round(shrunk_at - failed_at, 3),
                               "resync_s": round(time.perf_counter() - shrunk_at, 3)})
            if comm.rank == 0:
                print(f"step {step:4d}  lost a rank: {error}\n"
                      f"           survivors {comm.members} (old ranks) shrank in "
                      f"{shrunk_at - failed_at:.3f} s, resynced in "
                      f"{time.perf_counter() - shrunk_at:.3f} s", flush=True)
            continue  # this step's gradients were not averages: redo it with the survivors
        optimizer.step()
        ranks = state.group_size()
        losses.append((step, float(loss.detach()), ranks))
        if state.group_rank() == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1][1]:.4f}  ({ranks} ranks)", flush=True)
        step += 1
    elapsed_s = time.perf_counter() - start

    # the survivors' replicas: identical bit for bit? (min and max of a digest, over dqcoll)
    comm = state.communicator(torch.device("cpu"))
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    low = torch.tensor([digest], dtype=torch.float64)
    high = -low.clone()
    comm.transport.allreduce(low, "min", what="digest")
    comm.transport.allreduce(high, "min", what="digest")
    identical = bool(low.item() == -high.item())
    if comm.rank == 0:
        tail = [loss for _, loss, _ in losses[-10:]]
        print(f"finished {args.steps} steps with {comm.world_size} ranks (old ranks "
              f"{comm.members}) in {elapsed_s:.1f} s; mean loss of the last 10 steps "
              f"{sum(tail) / len(tail):.4f}; replicas identical: {identical}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"losses": losses, "recoveries": recoveries,
                           "members": comm.members, "replicas_identical": identical,
                           "elapsed_s": elapsed_s, "config": vars(args)}, f, indent=1)
    # gloo's teardown can abort a finished process (docs/reliability.md, "Open"): leave now
    sys.stdout.flush()
    os._exit(0)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Start ``--world-size`` ranks of this script; the exit status of the survivors."""
    from dqcoll.cli.ports import rendezvous_port

    port = rendezvous_port()  # outside the ephemeral range (see dqcoll/cli/ports.py)
    procs = []
    for rank in range(args.world_size):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   DQCOLL_TIMEOUT_S=str(args.timeout_s))
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env))
    status = 0
    for rank, proc in enumerate(procs):
        code = proc.wait()
        if rank == args.kill_rank:
            print(f"rank {rank} exit status {code} (SIGKILL is -{int(signal.SIGKILL)})")
        elif code != 0:
            print(f"rank {rank} failed with exit status {code}")
            status = 1
    return status


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    if "RANK" in os.environ:
        try:
            worker(args)
        except DqcollError as exc:
            print(f"rank {os.environ['RANK']}: {type(exc).__name__}: {exc}", flush=True)
            os._exit(1)
    else:
        sys.exit(launch(args, argv))


if __name__ == "__main__":
    main()
