"""Where a DDP training step's time goes: a per-rank timeline of the step of ``ddp_step.py``.

``ddp_step.py`` says how long a step takes; this says why. It runs the same DDP step (the same
model, batch, bucket cap, one thread per rank) with one way of averaging the gradients and
records, for every timed step and every rank:

* the step's marks: forward done, the first layer's gradient (backward's last), ``backward()``
  returned, ``optimizer.step()`` done;
* dqcoll's hook: each bucket's submission, release and completion;
* each call's phases on the lane worker that ran it (prepare, argument check, schedule,
  final decode; wall and thread CPU) and every exchange the gloo transport made (label, bytes
  sent, wall and thread CPU): when a bucket's first payload left, and how long each wait was;
* every thread's CPU time in the step (``/proc/self/task``, 10 ms ticks), by thread name.

Rank 0 prints the median step's timeline of ``--show`` ranks and the CPU per thread; ``--json``
writes every rank's steps. Launch it like ``ddp_step.py``: ``-n N`` spawns N processes on
loopback, ``--launcher env`` runs one rank per process under ``tools/netns_cluster.py exec``
(the emulated cluster) or torchrun::

    python -m dqcoll.cli.netns exec -n 4 --rate 1gbit -- \\
        python benchmarks/ddp_timeline.py --launcher env --row dynamiq --json timeline.json

It instruments dqcoll by wrapping a few internal functions (``TorchTransport._exchange``,
``execute.prepare_call`` / ``run_schedule`` / ``_restore``, ``validate.handshake``, the DDP
hook's ``_compressed_average`` and ``_release``): a development tool, not an API. The wrappers
cost a few microseconds per event; the timeline is for reading, the step times of record are
``ddp_step.py``'s. docs/benchmarks.md ("sixth round") reads one.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

ROWS = ("dynamiq", "auto", "fp16_hook", "ddp")


class Recorder:
    """Events of the current step, ``(ms since the step began, thread, kind, details)``."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str, dict[str, Any]]] = []
        self.start = time.perf_counter()
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            self.events = []
            self.start = time.perf_counter()

    def add(self, at: float, kind: str, **details: Any) -> None:
        with self._lock:
            self.events.append((round((at - self.start) * 1e3, 2),
                                threading.current_thread().name, kind, details))

    def mark(self, kind: str, **details: Any) -> None:
        self.add(time.perf_counter(), kind, **details)


def _timed(recorder: Recorder, owner: Any, name: str, kind: str,
           describe: Callable[..., dict[str, Any]] | None = None) -> None:
    """Replace ``owner.name`` by a wrapper that records its wall and thread-CPU time."""
    inner = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            details = describe(*args, **kwargs) if describe is not None else {}
            recorder.add(start, kind, ms=round((time.perf_counter() - start) * 1e3, 2),
                         cpu_ms=round((time.thread_time() - cpu) * 1e3, 2), **details)

    setattr(owner, name, wrapper)


def instrument(recorder: Recorder) -> None:
    """Wrap the functions the timeline records (see the module docstring)."""
    from dqcoll import execute, validate
    from dqcoll.integrations import torch_ddp
    from dqcoll.transports import torch_dist

    def exchange(self: Any, sends: Any, recvs: Any, what: str, **_: Any) -> dict[str, Any]:
        return {"what": what, "bytes_sent": sum(t.numel() * t.element_size() for _, t in sends)}

    _timed(recorder, torch_dist.TorchTransport, "_exchange", "exchange", exchange)
    _timed(recorder, torch_dist.TorchTransport, "allreduce", "small all-reduce",
           lambda self, tensor, op="sum", *, what: {"what": what})
    _timed(recorder, execute, "prepare_call", "prepare")
    _timed(recorder, validate, "handshake", "argument check")
    _timed(recorder, execute, "run_schedule", "schedule")
    _timed(recorder, execute, "_restore", "final decode")

    submit = torch_ddp._compressed_average

    def compressed_average(state: Any, buf: torch.Tensor, index: int, iteration: int,
                           last: bool) -> Any:
        recorder.mark("bucket submitted", bucket=index, numel=buf.numel())
        future = submit(state, buf, index, iteration, last)
        future.then(lambda _: recorder.mark("bucket done", bucket=index))
        return future

    torch_ddp._compressed_average = compressed_average
    release = torch_ddp._release

    def released(state: Any, bucket: Any) -> None:
        recorder.mark("bucket released", bucket=bucket.index)
        release(state, bucket)

    torch_ddp._release = released


def thread_cpu_ms() -> dict[str, float]:
    """CPU time (user + system, ms) of every thread of this process, keyed "tid:name"."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            comm = (task / "comm").read_text().strip()
        except OSError:  # the thread ended
            continue
        tid = int(task.name)
        ticks = int(fields[11]) + int(fields[12])
        out[f"{tid}:{names.get(tid, comm)}"] = ticks * 1e3 / os.sysconf("SC_CLK_TCK")
    return out


def run_rank(args: argparse.Namespace) -> list[dict[str, Any]]:
    import ddp_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    recorder = Recorder()
    instrument(recorder)
    batch = argparse.Namespace(model="mlp", batch=args.batch, seq_len=2, width=args.width)
    model = ddp_step.build_model("mlp", width=args.width, layers=args.layers, seed=0)
    x, y = ddp_step.make_batch("mlp", rank, batch)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ddp_step.BUCKET_CAP_MB)
    if args.row == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.row in ("dynamiq", "auto"):
        from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

        state = DynamiqState(scheme=args.row, bits=5, warmup_steps=0, monitor_every=0)
        ddp.register_comm_hook(state, dynamiq_hook)
        state.prepare()
    first = next(iter(model.parameters()))  # the first layer's weight: backward's last gradient
    first.register_hook(lambda grad: recorder.mark("first layer's gradient") or grad)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=ddp_step.LEARNING_RATE)
    steps = []
    dist.barrier()
    for step in range(args.warmup + args.steps):
        before = thread_cpu_ms()
        recorder.begin()
        optimizer.zero_grad(set_to_none=True)
        out = ddp(x)
        recorder.mark("forward done")
        nn.functional.mse_loss(out, y).backward()
        recorder.mark("backward returned")
        optimizer.step()
        recorder.mark("optimizer done")
        if step >= args.warmup:
            after = thread_cpu_ms()
            steps.append({"ms": recorder.events[-1][0],
                          # the machine's monotonic clock: the ranks of one machine compare
                          "start_s": recorder.start,
                          "events": sorted(recorder.events, key=lambda e: e[0]),
                          "thread_cpu_ms": {k: round(v - before.get(k, 0.0), 1)
                                            for k, v in after.items()}})
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, steps)
    dist.barrier()
    dist.destroy_process_group()
    return gathered if rank == 0 else []


def render(ranks: list[list[dict[str, Any]]], show: int) -> str:
    """The median step of rank 0 (the same step index on the other ranks) and the CPU per
    thread name, averaged over steps and ranks."""
    lines = []
    times = [s["ms"] for s in ranks[0]]
    index = sorted(range(len(times)), key=times.__getitem__)[len(times) // 2]
    medians = [statistics.median(s["ms"] for s in steps) for steps in ranks]
    lines.append("each rank's median step (ms): " + ", ".join(f"{m:.0f}" for m in medians))
    for rank, steps in enumerate(ranks[:show]):
        step = steps[index]
        lines.append(f"-- rank {rank}, timed step {index}: {step['ms']:.0f} ms")
        for at, thread, kind, details in step["events"]:
            extra = ", ".join(f"{k} {v}" for k, v in details.items())
            lines.append(f"{at:8.1f}  {thread[:16]:<16}  {kind:<24} {extra}")
    per_name: dict[str, float] = {}
    count = sum(len(steps) for steps in ranks)
    for steps in ranks:
        for step in steps:
            for key, ms in step["thread_cpu_ms"].items():
                name = re.sub(r"\d+", "#", key.split(":", 1)[1])  # lanes and ranks alike
                per_name[name] = per_name.get(name, 0.0) + ms / count
    lines.append("CPU per rank and step by thread (ms, 10 ms ticks): " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in sorted(per_name.items(), key=lambda kv: -kv[1])
        if ms >= 0.05))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=ROWS, default="dynamiq",
                        help="how the gradients are averaged (ddp_step.py's rows)")
    parser.add_argument("-n", type=int, default=4, help="ranks to spawn on loopback")
    parser.add_argument("--launcher", choices=("spawn", "env"), default="spawn",
                        help="env: this process is one rank of an env:// job")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--show", type=int, default=2, help="ranks whose timeline is printed")
    parser.add_argument("--json", help="write every rank's timed steps here")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.launcher == "spawn":
        import ddp_step

        forwarded = list(argv if argv is not None else sys.argv[1:])
        return ddp_step.spawn(forwarded, args.n, args.timeout_s + 120, script=__file__)
    ranks = run_rank(args)
    if ranks:
        print(render(ranks, args.show), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"row": args.row, "ranks": ranks}) + "\n")
            print(f"# wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
