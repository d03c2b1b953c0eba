"""The training step, not the all-reduce: DDP step time with every gradient hook in one run.

Users run training steps. This measures what one costs under PyTorch DDP over gloo, with each way
of averaging the gradients, **in the same run**: the same ranks (processes), the same model and
data, rows one after another, so that rows compare with each other even on a noisy machine:

=============  ==================================================================================
row            what averages the gradients
=============  ==================================================================================
``floor``      nothing: the same step without DDP (forward, backward, SGD): the compute floor
``ddp``        DDP's default (no hook): fp32 all-reduce per bucket, overlapped with backward
``fp16_hook``  torch's ``default_hooks.fp16_compress_hook``
``dynamiq``    dqcoll's ``dynamiq_hook``, ``DynamiqState(scheme="dynamiq", bits=5,
               warmup_steps=0, monitor_every=0)``
``auto``       the same with ``scheme="auto"`` ("not available" where ``DynamiqState``
               rejects it)
``dynamiq_1``  ``dynamiq`` with ``lanes=1``: one bucket at a time (the default on CPU is two
               lanes; docs/ddp.md), to show what the lanes change
``auto_1``     ``auto`` with ``lanes=1``
``warmup``     ``DynamiqState()`` (the defaults) with every step a warm-up step (``warmup_steps``
               beyond the run): the warm-up's 16-bit all-reduce; run only when ``--rows`` names it
``defaults``   ``DynamiqState()`` as a user gets it, timed after its warm-up (10 steps) and
               ``scheme="auto"``'s step-time check (6 more: docs/ddp.md), untimed, have run;
               its choice is in ``step_choices``; run only when ``--rows`` names it
``powersgd``   torch's ``powerSGD_hook`` (rank 2, compressing from the 2nd step); last, because
               it crashes on gloo in some torch versions: the row then reads "crashed: <error>"
=============  ==================================================================================

Every rank: ``torch.set_num_threads(1)``, SGD (lr 1e-3), a fixed batch of ``--batch`` (32) per
rank, ``bucket_cap_mb=25``. Each row builds DDP around a fresh copy of the same initial model;
a dqcoll row first runs untimed steps until, for two steps in a row, every lane ran the plan it
ran the step before and none explored a candidate (at most 24; ``settle_steps`` in the JSON:
each lane explores one candidate per call, so a job's first steps can include such calls, and
the timed ones should be the plans it keeps); then every row runs ``--warmup`` (3) untimed
steps and ``--steps`` (10) timed ones (``zero_grad`` to
``optimizer.step``, no barrier between steps, as in training). Each rank times its own steps; the
row reports the **slowest rank's median** (the largest of the ranks' medians) with that rank's
p10 and p90, and beside it ``wall_ms_per_step`` (each rank's time for all the timed
steps, from a barrier, over their number; the slowest rank's) and, as the files before
2026-11-28 reported it, ``slowest_per_step_median_ms`` (the median over steps of the slowest
rank's time in each step). That older statistic reads high wherever the ranks drift against each
other from step to step (a rank whose step ended early waits longer in the next one, so the
maximum per step is larger than any rank's typical step and than the wall time per step): by
about 6 % for dqcoll's CPU-bound rows at 1 Gb/s, under 1 % for DDP's wire-bound ones.

After the timed steps, one more (untimed) step measures the error beside the time: the
gradients DDP left in the model against the exact average (every rank's own gradients from a
copy of the model without DDP, all-reduced in float64), ``vNMSE = |g - g_exact|^2 /
|g_exact|^2`` over all parameters; and for the dqcoll rows the bytes the communicator sent in that
step (its counters: payload, scales, statistics, argument check) per coordinate, normalised by the
all-reduce's ``2 (n-1)/n`` traffic factor, so fp32 reads 32. Torch's rows carry their wire
dtype's nominal bits (PowerSGD: none).

Models (``--model``): ``mlp``, the issue's ``nn.Sequential`` of 12 x (``Linear(1024, 1024)`` +
ReLU), 12.6 M parameters; ``transformer``, ``nn.TransformerEncoder`` (4 layers, d_model 512,
8 heads, feed-forward 2048, no dropout), 12.6 M parameters, on ``--seq-len`` (default 2) tokens
per sample, so that its step costs about what the MLP's does.

Ranks: ``-n N`` spawns N processes here (gloo over loopback); under an env:// launcher
(``tools/netns_cluster.py exec ... -- python benchmarks/ddp_step.py``, torchrun) each process is
one rank. Rank 0 prints the table and writes ``--json`` with provenance (commit, device, versions,
world size, link, model, bucket cap). ``--render FILE...`` prints results as markdown (the
"Training step" section of docs/benchmarks.md); ``tools/ddp_step_matrix.py`` runs the whole
matrix.

Rejected: timing the hooks on a synthetic bucket (``dqcoll bench`` does that; it misses DDP's
overlap of communication with backward, which is what a user gets or loses), one process per row
(rows would see different machine states; here they share the processes and run back to back),
and comparing against the exact average with the hook's own ``monitor_every`` (it exists only for
dqcoll's hook; the direct comparison measures every row the same way).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from dqcoll.cli.ports import rendezvous_port  # noqa: E402
from dqcoll.cli.provenance import device_name, git_commit  # noqa: E402

__all__ = ["ROWS", "build_model", "main", "percentile", "render_markdown", "summarize"]

# row name -> label in tables; also the order the rows run in (powersgd last: see docstring)
ROWS: dict[str, str] = {
    "floor": "no communication (no DDP)",
    "ddp": "DDP default (no hook)",
    "fp16_hook": "torch fp16_compress_hook",
    "dynamiq": "dqcoll dynamiq_hook, dynamiq 5 b",
    "auto": "dqcoll dynamiq_hook, auto",
    "dynamiq_1": "dqcoll dynamiq 5 b, one lane",
    "auto_1": "dqcoll auto, one lane",
    "warmup": "dqcoll DynamiqState() in warm-up",
    "defaults": "dqcoll DynamiqState() after its warm-up and step check",
    "powersgd": "torch powerSGD_hook (rank 2)",
}
# column names of the markdown summary
SHORT: dict[str, str] = {"floor": "no comm. (floor)", "ddp": "DDP default",
                         "fp16_hook": "fp16 hook", "dynamiq": "dqcoll dynamiq 5 b",
                         "auto": "dqcoll auto", "dynamiq_1": "dynamiq, 1 lane",
                         "auto_1": "auto, 1 lane", "warmup": "dqcoll warm-up",
                         "defaults": "dqcoll defaults",
                         "powersgd": "PowerSGD"}
# rows run only when --rows names them (and shown by --render only where a file has them)
OPT_IN_ROWS = ("warmup", "defaults")
# rows whose collectives dqcoll's counters do not see (torch's, and the warm-up's 16-bit
# all-reduce on DDP's group): the wire dtype's bits
NOMINAL_BITS = {"ddp": 32.0, "fp16_hook": 16.0, "warmup": 16.0}
BUCKET_CAP_MB = 25
POWERSGD_RANK = 2
LEARNING_RATE = 1e-3


class RowUnavailable(Exception):
    """A row that cannot run here (e.g. ``scheme="auto"`` before dqcoll has it)."""


# -- models and data -------------------------------------------------------------------------


def build_model(name: str, *, width: int = 1024, layers: int = 12, seed: int = 0) -> nn.Module:
    """The benchmark's models (see the module docstring); the same weights for the same seed."""
    torch.manual_seed(seed)
    if name == "mlp":
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*blocks)
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(d_model=width // 2, nhead=8,
                                           dim_feedforward=2 * width, dropout=0.0,
                                           batch_first=True)
        return nn.TransformerEncoder(layer, num_layers=max(1, layers // 3),
                                     enable_nested_tensor=False)
    raise ValueError(f"model must be mlp or transformer, got {name!r}")


def make_batch(model_name: str, rank: int, args: argparse.Namespace
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed (input, target) batch per rank (data loading is not what is measured)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if model_name == "mlp":
        shape: tuple[int, ...] = (args.batch, args.width)
    else:
        shape = (args.batch, args.seq_len, args.width // 2)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


# -- statistics ------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(step_ms: Sequence[float]) -> dict[str, float]:
    return {"median_ms": percentile(step_ms, 50), "p10_ms": percentile(step_ms, 10),
            "p90_ms": percentile(step_ms, 90)}


# -- one rank --------------------------------------------------------------------------------


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                y: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _register_hook(row: str, ddp: nn.parallel.DistributedDataParallel) -> Any:
    """Register the row's hook on ``ddp``; returns its state (None for DDP's default)."""
    if row == "ddp":
        return None
    if row == "fp16_hook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if row == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=POWERSGD_RANK,
                                            start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    from dqcoll.integrations.torch_ddp import DynamiqState, dynamiq_hook

    scheme = "dynamiq" if row.startswith("dynamiq") else "auto"
    lanes = 1 if row.endswith("_1") else None
    try:  # a checkout older than the hook's runtime options takes lanes= itself
        from dqcoll.integrations.torch_ddp import HookRuntime
        runtime: dict[str, Any] = {"runtime": HookRuntime(lanes=lanes)}
    except ImportError:
        runtime = {"lanes": lanes} if lanes else {}
    warmup_steps = 1 << 30 if row == "warmup" else 0  # "warmup": no step leaves the warm-up
    try:
        if row == "defaults":  # as a user gets it: warm-up, then auto's step-time check
            state = DynamiqState()
        else:
            state = DynamiqState(scheme=scheme, bits=5, warmup_steps=warmup_steps,
                                 monitor_every=0, **runtime)
    except Exception as exc:  # the same on every rank: it is the argument check
        raise RowUnavailable(f"DynamiqState(scheme={scheme!r}) rejected: "
                             f"{type(exc).__name__}: {_first_line(exc)}") from None
    ddp.register_comm_hook(state, dynamiq_hook)
    if hasattr(state, "prepare"):  # communicator, kernels (and auto's measurements) now
        state.prepare()
    return state


def _first_line(exc: BaseException) -> str:
    """The innermost message of a (possibly future-chained) error, first line, <= 200 chars."""
    text = str(exc)
    marker = "running the callback: "  # torch.futures wraps a callback's error once per `then`
    if marker in text:
        text = text.rsplit(marker, 1)[1]
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


def _flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1).double() if p.grad is not None
                      else torch.zeros(p.numel(), dtype=torch.float64)
                      for p in model.parameters()])


def _error_step(ddp: nn.parallel.DistributedDataParallel, state: Any, x: torch.Tensor,
                y: torch.Tensor, world_size: int) -> dict[str, Any]:
    """One untimed step's vNMSE against the exact average, and the dqcoll hook's bits/coord."""
    reference = copy.deepcopy(ddp.module)  # the same weights, no DDP
    # every lane's communicator (DynamiqState.lane_comms: lanes 1, 2, ...), each its own counters
    comms = [c for c in (getattr(state, "comm", None), *getattr(state, "lane_comms", ()))
             if getattr(c, "counters", None) is not None]
    for comm in comms:
        comm.counters.reset()
    ddp.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    averaged = _flat_grads(ddp.module)
    nn.functional.mse_loss(reference(x), y).backward()
    exact = _flat_grads(reference)
    dist.all_reduce(exact)
    exact /= world_size
    norm2 = float(exact.square().sum())
    error2 = float((averaged - exact).square().sum())
    out: dict[str, Any] = {"vnmse": error2 / norm2 if norm2 > 0 else math.nan}
    if comms:
        traffic = 2 * (world_size - 1) / world_size * averaged.numel()
        sent = sum(float(comm.counters["bytes_sent"]) for comm in comms)
        out["bits_per_coord"] = sent * 8 / traffic
        out["bits_source"] = "measured (dqcoll counters, one step)"
    last_info = getattr(state, "last_info", None)
    if last_info:
        out["last_info"] = {k: v for k, v in last_info.items()
                            if isinstance(v, (str, int, float, bool))}
        planned = last_info.get("planned")  # the planner's plan of the last bucket, and why
        if isinstance(planned, dict):
            out["planned"] = json.loads(json.dumps(planned, default=str))
    return out


def _every_rank(values: list[float]) -> list[list[float]]:
    """``values`` (this rank's, the same length on every rank) of every rank, in rank order."""
    mine = torch.tensor(values, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [[float(v) for v in t] for t in everyone]


def step_statistics(rank_step_ms: Sequence[Sequence[float]],
                    wall_ms: Sequence[float]) -> dict[str, Any]:
    """A row's step time from every rank's own step times (ms, ``[rank][step]``) and each
    rank's wall time for all its timed steps: the slowest rank's median (the row's
    ``median_ms``) with that rank's p10 and p90, the slowest rank's wall time per step, and
    the median over steps of the slowest rank in each step (what earlier files reported)."""
    steps = len(rank_step_ms[0])
    per_step_max = [max(times[i] for times in rank_step_ms) for i in range(steps)]
    slowest = max(rank_step_ms, key=lambda times: percentile(times, 50))
    return {**summarize(slowest), "wall_ms_per_step": max(wall_ms) / steps,
            "slowest_per_step_median_ms": percentile(per_step_max, 50),
            "step_ms": per_step_max}


def _time_steps(step: Callable[[], None], args: argparse.Namespace,
                result: dict[str, Any]) -> None:
    """Time ``args.steps`` steps after ``args.warmup`` untimed ones, from a barrier; into
    ``result``: every rank's step times (``rank_step_ms``), :func:`step_statistics`, and each
    rank's process CPU time per timed step (``cpu_ms_per_rank``: every thread, backward, the
    hook's workers, gloo's; what a step costs the cores, which decides the step where ranks
    share them)."""
    for _ in range(args.warmup):
        step()
    dist.barrier()
    step_ms = []
    cpu_start = time.process_time()
    wall_start = time.perf_counter()
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        step_ms.append((time.perf_counter() - start) * 1e3)
    wall_ms = (time.perf_counter() - wall_start) * 1e3
    cpu_ms = (time.process_time() - cpu_start) * 1e3 / max(args.steps, 1)
    every = _every_rank([*step_ms, wall_ms, cpu_ms])
    steps = args.steps
    rank_step_ms = [row[:steps] for row in every]
    result["rank_step_ms"] = [[round(t, 2) for t in row] for row in rank_step_ms]
    result.update(step_statistics(rank_step_ms, [row[steps] for row in every]))
    result["cpu_ms_per_rank"] = [round(row[steps + 1], 2) for row in every]


# Untimed steps of a planned row beyond --warmup, at most: until every lane kept its plan without
# exploring for two steps in a row (a lane explores one candidate per call, and each lane and size
# class explores on its own), so the timed steps are the plans a job keeps.
SETTLE_MAX_STEPS = 24


def _lane_comms(state: Any) -> list[Any]:
    return [c for c in (getattr(state, "comm", None), *getattr(state, "lane_comms", []))
            if c is not None]


def _settle(step: Callable[[], None], state: Any) -> int:
    """Untimed steps until, for two steps in a row, every lane ran the plan it ran the step
    before and none explored (the same count on every rank: the flag is all-reduced); the steps
    run."""
    quiet, before = 0, None
    for steps in range(1, SETTLE_MAX_STEPS + 1):
        step()
        plans = [c.last_info.get("planned") or {} for c in _lane_comms(state)]
        labels = [p.get("label") for p in plans]
        moving = labels != before or any(
            str(p.get("reason", "")).startswith("explored") for p in plans)
        before = labels
        flag = torch.tensor([1.0 if moving else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        quiet = 0 if flag.item() else quiet + 1
        if quiet >= 2:
            return steps
    return SETTLE_MAX_STEPS


def _run_row(row: str, base: nn.Module, args: argparse.Namespace, x: torch.Tensor,
             y: torch.Tensor, world_size: int) -> dict[str, Any]:
    model = copy.deepcopy(base)
    if row == "floor":
        opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        dist.barrier()
        floor: dict[str, Any] = {}
        _time_steps(lambda: _train_step(model, opt, x, y), args, floor)
        return floor
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=BUCKET_CAP_MB)
    state = _register_hook(row, ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    dist.barrier()
    result: dict[str, Any] = {}
    choice = getattr(state, "step_choice", None)
    if row == "defaults" and choice is not None and choice.enabled:
        # untimed: the warm-up and the compressed steps the check times, until it decides
        # (one step more for each the planner explored in, at most samples more)
        for _ in range(choice.warmup_steps + 2 * choice.samples + 1):
            _train_step(ddp, opt, x, y)
            if choice.choices:
                break
    if state is not None and row not in ("powersgd", "warmup"):  # dqcoll's planned buckets
        result["settle_steps"] = _settle(lambda: _train_step(ddp, opt, x, y), state)
    _time_steps(lambda: _train_step(ddp, opt, x, y), args, result)
    if choice is not None and choice.choices:
        result["step_choices"] = [dataclasses.asdict(c) for c in choice.choices]
    sixteen = getattr(state, "sixteen_bit", None)
    if sixteen is not None and sixteen.history:
        result["sixteen_bit_formats"] = [list(entry) for entry in sixteen.history]
    lanes = _lane_comms(state)
    planners = [getattr(c, "planner", None) for c in lanes]
    if any(p is not None for p in planners):
        # each lane's planner after the timed steps: its last plan and what it measured
        result["plans"] = [((c.last_info.get("planned") or {}).get("label"),
                            {k: round(v, 3) for k, v in (p.factors if p else {}).items()})
                           for c, p in zip(lanes, planners, strict=True)]
    result.update(_error_step(ddp, state, x, y, world_size))
    if row in NOMINAL_BITS:
        result.update(bits_per_coord=NOMINAL_BITS[row], bits_source="nominal (wire dtype)")
    elif choice is not None and choice.choices and not choice.compressing():
        result.update(bits_per_coord=16.0, bits_source="nominal (the step check chose 16 bits on "
                                                       "DDP's group)")
    return result


def _agree(ok: bool) -> bool:
    """Whether every rank finished the row (a row that failed on one rank fails on all)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def provenance(args: argparse.Namespace, world_size: int, numel: int) -> dict[str, Any]:
    import numba

    import dqcoll

    return {
        "commit": git_commit("benchmarks"),
        "device": device_name("cpu"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch_version": torch.__version__,
        "numba_version": numba.__version__,
        "dqcoll_version": dqcoll.__version__,
        "backend": "gloo",
        "world_size": world_size,
        "link": args.link,
        "topology": args.topology,
        "model": args.model,
        "params": numel,
        "batch_per_rank": args.batch,
        "seq_len": args.seq_len if args.model == "transformer" else None,
        "bucket_cap_mb": BUCKET_CAP_MB,
        "optimizer": f"SGD lr {LEARNING_RATE:g}",
        "threads_per_rank": torch.get_num_threads(),
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "step_time": ("median_ms: the slowest rank's median of its own timed steps; p10 / p90 "
                      "over every rank's steps; wall_ms_per_step: the slowest rank's wall time "
                      "for the timed steps over their number; slowest_per_step_median_ms: the "
                      "median over steps of the slowest rank in each step (before 2026-11-28)"),
        "note": args.note,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/ddp_step.py " + shlex.join(args.argv),
    }


def run_rank(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    base = build_model(args.model, width=args.width, layers=args.layers, seed=args.seed)
    numel = sum(p.numel() for p in base.parameters())
    x, y = make_batch(args.model, rank, args)
    rows: list[dict[str, Any]] = []
    args.provenance = provenance(args, world_size, numel)  # once: the code that runs, as it starts
    header = _table_header(args, world_size, numel)
    if rank == 0:
        print(header[0], flush=True)
        print(header[1], flush=True)
    broken = False
    for row in args.rows:
        entry: dict[str, Any] = {"row": row, "label": ROWS[row]}
        if rank == 0:  # what the file says if this row never finishes (a rank aborted)
            _write(args, world_size, numel, [*rows, {**entry, "status": _UNFINISHED}])
        watchdog = _watchdog(row, _row_deadline_s(rows, args), rank == 0,
                             lambda status, e=entry: _write(args, world_size, numel,
                                                            [*rows, {**e, "status": status}]))
        if broken:
            entry["status"] = "not run: the process group failed in an earlier row"
        else:
            try:
                entry.update(_run_row(row, base, args, x, y, world_size))
                entry["status"] = "ok"
            except RowUnavailable as exc:
                entry["status"] = f"not available: {exc}"
            except Exception as exc:  # torch's hooks that do not run here (PowerSGD on gloo)
                entry = {"row": row, "label": ROWS[row],
                         "status": f"crashed: {type(exc).__name__}: {_first_line(exc)}"}
            try:
                if not _agree(entry["status"] == "ok") and entry["status"] == "ok":
                    entry = {"row": row, "label": ROWS[row], "status": "crashed on another rank"}
            except Exception as exc:
                broken = True
                if entry["status"] == "ok":
                    entry = {"row": row, "label": ROWS[row],
                             "status": f"crashed: {type(exc).__name__}: {_first_line(exc)}"}
        watchdog.cancel()
        rows.append(entry)
        if rank == 0:
            print(_format_row(entry, _baseline(rows)), flush=True)
            _write(args, world_size, numel, rows)
    if rank == 0 and args.json:
        print(f"# wrote {args.json}", flush=True)
    if not broken:
        dist.barrier()
    dist.destroy_process_group()
    return 0


def _row_deadline_s(rows: list[dict[str, Any]], args: argparse.Namespace) -> float:
    """How long a row may run before it counts as hung: 60 s plus 10 times what its steps take
    at the slowest step of DDP's default row (before that row: ``--timeout-s``). Generous: the
    slowest row that finished on the loaded 2-core machine took ~2.5x DDP's slowest step."""
    ddp = next((r for r in rows if r["row"] == "ddp" and r.get("step_ms")), None)
    if ddp is None:
        return args.timeout_s
    return 60.0 + 10.0 * (args.warmup + args.steps + 1) * max(ddp["step_ms"]) / 1e3


def _watchdog(row: str, deadline_s: float, leader: bool,
              record: Callable[[str], None]) -> threading.Timer:
    """A timer that ends this rank if the row hangs (PowerSGD on gloo can block forever in a
    collective whose peer died); rank 0 first records the row as hung."""

    def fire() -> None:
        status = f"crashed: hung (no result after {deadline_s:.0f} s; the run was stopped)"
        if leader:
            record(status)
            print(f"{ROWS[row]:<34}{status}", flush=True)
        os._exit(3)

    timer = threading.Timer(deadline_s, fire)
    timer.daemon = True
    timer.start()
    return timer


# A row that crashes by aborting a rank's process (gloo's C++ errors in PowerSGD) can leave the
# others blocked until the launcher stops them: the file is rewritten after every row, and the
# row in progress reads this until it finishes.
_UNFINISHED = "crashed: did not finish (a rank aborted or hung; the launcher stopped the run)"


def _write(args: argparse.Namespace, world_size: int, numel: int,
           rows: list[dict[str, Any]]) -> None:
    """Rank 0: the results so far, with provenance and each row's speed-up over DDP's default."""
    if not args.json:
        return
    baseline = _baseline(rows)
    for entry in rows:
        if baseline and "median_ms" in entry and entry["row"] != "floor":
            entry["speedup_vs_ddp"] = baseline / entry["median_ms"]
    result = {"provenance": args.provenance, "rows": rows}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


# -- output ----------------------------------------------------------------------------------


def _baseline(rows: list[dict[str, Any]]) -> float | None:
    return next((r["median_ms"] for r in rows if r["row"] == "ddp" and "median_ms" in r), None)


def _table_header(args: argparse.Namespace, world_size: int, numel: int) -> tuple[str, str]:
    what = (f"# ddp_step: {args.model} ({numel / 1e6:.1f} M params), {world_size} ranks, "
            f"link {args.link}, gloo, bucket {BUCKET_CAP_MB} MB, batch {args.batch}/rank, "
            f"1 thread/rank, median of {args.steps} steps after {args.warmup}")
    columns = (f"{'row':<34}{'step(ms)':>9}{'p10':>8}{'p90':>8}{'vs DDP':>8}"
               f"{'bits/coord':>11}{'vNMSE':>11}")
    return what, columns


def _format_row(entry: dict[str, Any], baseline: float | None) -> str:
    label = f"{entry['label']:<34}"
    if "median_ms" not in entry:
        return label + entry["status"]
    speedup = f"{baseline / entry['median_ms']:.2f}x" if baseline else "-"
    bits = entry.get("bits_per_coord")
    vnmse = entry.get("vnmse")
    chosen = entry.get("planned", {}).get("label")
    return (f"{label}{entry['median_ms']:>9.1f}{entry['p10_ms']:>8.1f}{entry['p90_ms']:>8.1f}"
            f"{speedup:>8}{'-' if bits is None else f'{bits:.2f}':>11}"
            f"{'-' if vnmse is None else f'{vnmse:.2e}':>11}"
            + (f"  (planned {chosen} for the last bucket)" if chosen else ""))


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    if "median_ms" not in entry:
        return entry["status"].split(":")[0]
    speedup = entry.get("speedup_vs_ddp") if entry["row"] != "floor" else None
    return f"{entry['median_ms']:.0f}" + (f" ({speedup:.2f}x)" if speedup else "")


def _order(result: dict[str, Any]) -> tuple[float, int, str]:
    """Loopback first, then links from the fastest; more ranks first; then the model."""
    prov = result["provenance"]
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", prov["link"].split(" (")[0].lower())
    units = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
    rate = float(match.group(1)) * units[match.group(2)] if match else math.inf
    return (-rate, -int(prov["world_size"]), str(prov["model"]))


def render_markdown(paths: Sequence[str]) -> str:
    """One markdown table of step times (ms, and speed-up over DDP's default) per result file,
    then the bits/coord and vNMSE of the compressed rows."""
    results = sorted((json.loads(Path(p).read_text()) for p in paths), key=_order)
    present = {r["row"] for result in results for r in result["rows"]}
    order = [r for r in ROWS  # one-lane and opt-in rows where a file has them
             if not (r.endswith("_1") or r in OPT_IN_ROWS) or r in present]
    time_rows = ["| link | ranks | model | " + " | ".join(SHORT[r] for r in order) + " |",
                 "|---|---:|---|" + "---:|" * len(order)]
    error_rows = ["| link | ranks | model | row | bits/coord | vNMSE |",
                  "|---|---:|---|---|---:|---:|"]
    for result in results:
        prov = result["provenance"]
        by_row = {r["row"]: r for r in result["rows"]}
        link = prov["link"].split(" (")[0]  # the rate; the topology is in the JSON
        key = f"| {link} | {prov['world_size']} | {prov['model']} |"
        time_rows.append(key + " " + " | ".join(_cell(by_row.get(r)) for r in order) + " |")
        for name in ("fp16_hook", "dynamiq", "auto", "dynamiq_1", "auto_1", "warmup",
                     "powersgd"):
            entry = by_row.get(name)
            if entry and "vnmse" in entry:
                bits = entry.get("bits_per_coord")
                error_rows.append(f"{key} {SHORT[name]} | {'-' if bits is None else f'{bits:.2f}'}"
                                  f" | {entry['vnmse']:.2e} |")
    commits = sorted({r["provenance"]["commit"] for r in results})
    devices = sorted({r["provenance"]["device"] for r in results})
    notes = sorted({r["provenance"].get("note") or "" for r in results} - {""})
    footer = (f"\nStep time in ms (the slowest rank's median over the timed steps; files before "
              f"2026-11-28: the median of the slowest rank per step), and speed-up over "
              f"DDP's default in parentheses. Commit {', '.join(commits)}; {'; '.join(devices)}."
              + (f" Notes: {'; '.join(notes)}." if notes else ""))
    return "\n".join([*time_rows, footer, "", *error_rows])


# -- launcher --------------------------------------------------------------------------------



def spawn(argv: Sequence[str], world_size: int, timeout_s: float,
          script: str | None = None) -> int:
    """``world_size`` ranks as processes on this machine (gloo over loopback), each running
    ``script`` (default: this file) with ``argv`` and ``--launcher env``."""
    from dqcoll import kernels

    kernels.warm_up(torch.device("cpu"))  # compile (or load) once here, not in every rank
    port = rendezvous_port()
    procs: list[subprocess.Popen[bytes]] = []
    child = [sys.executable, str(Path(script or __file__).resolve()), *argv, "--launcher", "env"]
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
            procs.append(subprocess.Popen(child, env=env,
                                          stdout=None if rank == 0 else subprocess.DEVNULL))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 60)  # let the others report
            time.sleep(0.1)
        return max(abs(p.returncode) if p.returncode is not None else 124 for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddp_step.py", description=__doc__.split("\n")[0])
    p.add_argument("-n", "--world-size", type=int, default=4,
                   help="ranks to spawn here (ignored under --launcher env)")
    p.add_argument("--model", default="mlp", choices=("mlp", "transformer"))
    p.add_argument("--rows", type=lambda t: [r for r in t.split(",") if r],
                   default=[r for r in ROWS if r not in OPT_IN_ROWS],
                   help=f"comma-separated from {list(ROWS)} (default: all but {OPT_IN_ROWS})")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--batch", type=int, default=32, help="samples per rank")
    p.add_argument("--width", type=int, default=1024,
                   help="MLP width; the transformer's d_model is half of it")
    p.add_argument("--layers", type=int, default=12,
                   help="MLP layers; the transformer has a third of them")
    p.add_argument("--seq-len", type=int, default=2, help="transformer tokens per sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--link", default="", help="label of the network (default: loopback)")
    p.add_argument("--topology", default="", help="how the network is built (recorded)")
    p.add_argument("--note", default="", help="recorded with the results (machine state)")
    p.add_argument("--json", default="", metavar="FILE")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="gloo timeout per collective, and the spawn launcher's bound per run")
    p.add_argument("--launcher", default="auto", choices=("auto", "spawn", "env"))
    p.add_argument("--render", nargs="+", default=None, metavar="FILE",
                   help="print result files as markdown and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.render:
        print(render_markdown(args.render))
        return 0
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    launcher = args.launcher
    if launcher == "auto":
        launcher = "env" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "spawn"
    if launcher == "env":
        args.link = args.link or "env://"
        return run_rank(args)
    if args.world_size < 2:
        parser.error(f"-n must be >= 2 (an all-reduce needs peers), got {args.world_size}")
    if not args.link:
        argv = [*argv, "--link", "loopback"]
    if not args.topology:
        argv = [*argv, "--topology", f"1 host, {args.world_size} processes, gloo over lo"]
    return spawn(argv, args.world_size, timeout_s=4 * args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
