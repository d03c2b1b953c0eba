"""``dqcoll bench``: an nccl-tests-style all-reduce benchmark, dqcoll next to the peers.

For each message size of a ``-b/-e/-f`` sweep it runs, on the same ranks and in the same
process group: dqcoll's all-reduce for every requested (scheme, bits, algorithm), and the peers a
user would pick instead --

* ``torch fp32`` / ``torch bf16``: ``torch.distributed.all_reduce`` of an fp32 / bf16 tensor
  (gloo on CPU, NCCL on GPU);
* ``ddp fp16_hook`` / ``ddp bf16_hook``: PyTorch's own DDP compression hooks,
  ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``, called on a one-tensor bucket
  (the hooks accept a ``(tensor,)`` tuple in place of a ``GradBucket``): cast to 16 bits, divide
  by ``n``, ``all_reduce``, copy back into the fp32 bucket. This is the real hook code, not a
  re-implementation.

and prints nccl-tests' columns, ``size(B) count type redop | time(us) algbw busbw``, followed by
``wire_B ratio vnmse``. ``size(B)`` is the *uncompressed* size of the row's input
(``count * sizeof(type)``) and algbw/busbw are computed on it (``busbw = algbw * 2(n-1)/n``, as
nccl-tests does for all-reduce), so rows compare with NCCL's; ``wire_B`` is what one rank puts on
the wire per call (measured from dqcoll's counters, all traffic included; for the peers, modelled
as a ring all-reduce of the wire dtype), and ``ratio`` is the uncompressed ring bytes over
``wire_B``. Compare rows of the same ``count``: that is the same number of gradients.

Correctness comes first (``-c 1``, the default): before a row is timed, one call runs on
per-rank pseudo-random inputs and its output is compared with the exact sum (an fp64 all-reduce
of the same inputs): every rank must hold bit-identical values, finite where the exact sum is
finite, with vNMSE within the row's tolerance (``16 n eps^2`` of the wire dtype for uncompressed
paths, ``--max-vnmse`` for quantized schemes). A row that fails is printed as ``FAILED`` with the
reason and *no* time, and the command exits with status 1.

Timing follows nccl-tests: ``-w`` warm-up calls, then ``-n`` calls timed as one loop (no barrier
per call), averaged per rank; ``-a`` picks how ranks are combined (0 rank 0, 1 mean, 2 min,
3 max). Calls run in place on the same buffer; with ``redop=sum`` the values grow by ``n`` per
call, so the buffer is refilled from the input (outside the timed region) before it could
overflow.

Ranks: ``-g N`` spawns ``N`` processes on this machine (gloo over loopback, a free port); inside
a job that already set the env:// variables (torchrun, ``tools/netns_cluster.py``) every process
is one rank (``--launcher env``, chosen automatically when ``RANK`` and ``WORLD_SIZE`` are set).
Rank 0 prints the table and writes ``--json``; every JSON row carries its provenance (device,
world size, topology, versions, commit).

Rejected: ``torch.multiprocessing.spawn`` (it pickles the worker into children of this process,
so it cannot place ranks in network namespaces; plain processes with env:// variables work the
same under torchrun, under the netns tool and here), and a barrier around every timed call
(it would time the barrier's latency too; nccl-tests times the loop).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import math
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .ports import rendezvous_port
from .provenance import device_name, git_commit

__all__ = ["Case", "build_cases", "busbw_factor", "main", "parse_size", "size_sweep"]

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_DTYPES = {
    "float": torch.float32, "fp32": torch.float32, "float32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "half": torch.float16, "fp16": torch.float16, "float16": torch.float16,
}
_TYPE_NAMES = {torch.float32: "float", torch.bfloat16: "bfloat16", torch.float16: "half"}
_AVERAGE_MODES = {0: "rank 0", 1: "mean over ranks", 2: "min over ranks", 3: "max over ranks"}
# Largest magnitude the in-place loop lets a sum grow to before refilling the buffer (fp16 hooks
# average, so only fp32/bf16 sums grow; both reach 3e38).
_GROWTH_LIMIT = 1e20


def parse_size(text: str) -> int:
    """nccl-tests sizes: ``256``, ``64K``, ``1M``, ``2G`` (binary multiples), optional ``B``."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"size must look like 256, 64K, 1M or 2G, got {text!r}")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2)]


def size_sweep(min_nbytes: int, max_nbytes: int, factor: int, step_nbytes: int = 0) -> list[int]:
    """The sizes of ``-b min -e max -f factor`` (or ``-i step``), as nccl-tests walks them."""
    if min_nbytes <= 0 or max_nbytes < min_nbytes:
        raise ValueError(f"need 0 < minbytes <= maxbytes, got {min_nbytes} and {max_nbytes}")
    if step_nbytes <= 0 and factor < 2:
        raise ValueError(f"stepfactor must be >= 2 (or give a step in bytes), got {factor}")
    sizes = []
    size = min_nbytes
    while size <= max_nbytes:
        sizes.append(size)
        size = size + step_nbytes if step_nbytes > 0 else size * factor
    return sizes


def busbw_factor(world_size: int) -> float:
    """nccl-tests' all-reduce bus-bandwidth factor ``2 (n-1) / n``."""
    return 2.0 * (world_size - 1) / world_size if world_size > 1 else 0.0


class Impl(enum.Enum):
    DQCOLL = "dqcoll"
    TORCH = "torch"
    DDP_HOOK = "ddp"


@dataclasses.dataclass(frozen=True)
class Case:
    """One row kind of the table: who all-reduces what."""

    label: str
    impl: Impl
    dtype: torch.dtype  # input dtype (size(B) = count * its itemsize)
    wire_dtype: torch.dtype | None  # peers: the dtype on the wire
    scheme: str = ""
    bits: float | None = None
    algorithm: str = ""
    hook: str = ""  # DDP_HOOK: name of the function in ddp_comm_hooks.default_hooks

    @property
    def is_average(self) -> bool:
        return self.impl is Impl.DDP_HOOK  # the hooks always average


def _peer_cases(dtype: torch.dtype) -> dict[str, Case]:
    return {
        "fp32": Case("torch fp32", Impl.TORCH, torch.float32, torch.float32),
        "bf16": Case("torch bf16", Impl.TORCH, torch.bfloat16, torch.bfloat16),
        "fp16_hook": Case("ddp fp16_hook", Impl.DDP_HOOK, dtype, torch.float16,
                          hook="fp16_compress_hook"),
        "bf16_hook": Case("ddp bf16_hook", Impl.DDP_HOOK, dtype, torch.bfloat16,
                          hook="bf16_compress_hook"),
    }


PEERS = tuple(_peer_cases(torch.float32))


def build_cases(
    dtype: torch.dtype,
    schemes: Sequence[str],
    bits: Sequence[float],
    algorithms: Sequence[str],
    peers: Sequence[str],
) -> list[Case]:
    """dqcoll rows for every (scheme, bits, algorithm), then the peers, in the order given."""
    from .. import schemes as registry

    cases = []
    for name in schemes:
        takes_bits = "bits" in registry.spec(name).options  # raises for an unknown name
        for b in bits if takes_bits else [None]:
            for algorithm in algorithms:
                label = f"dqcoll {name}" + (f" {b:g}b" if b is not None else "") + f" {algorithm}"
                cases.append(Case(label, Impl.DQCOLL, dtype, None, name, b, algorithm))
    table = _peer_cases(dtype)
    for peer in peers:
        if peer not in table:
            raise ValueError(f"unknown peer {peer!r}; known peers: {sorted(table)} or 'none'")
        cases.append(table[peer])
    return cases


# -- runners: one per implementation ---------------------------------------------------------


class _Runner:
    """Runs one case on one rank: ``reset`` refills the buffer, ``run`` is one collective."""

    def __init__(self, case: Case, x: torch.Tensor, ctx: _Context) -> None:
        self.case = case
        self.ctx = ctx
        self.source = x.to(case.dtype)
        self.buffer = self.source.clone()

    def reset(self) -> None:
        self.buffer.copy_(self.source)

    def run(self) -> None:
        raise NotImplementedError

    def wire_nbytes(self) -> int:
        from ..transports.base import ring_allreduce_nbytes

        assert self.case.wire_dtype is not None
        return ring_allreduce_nbytes(self.buffer.numel() * self.case.wire_dtype.itemsize,
                                     self.ctx.world_size)


class _DqcollRunner(_Runner):
    def run(self) -> None:
        import dqcoll

        c = self.case
        # Schemes without a bits option ignore it (allreduce's default is passed).
        dqcoll.allreduce(self.buffer, op=self.ctx.redop, scheme=c.scheme,
                         bits=5.0 if c.bits is None else c.bits, algorithm=c.algorithm,
                         comm=self.ctx.comm)

    def wire_nbytes(self) -> int:
        # Measured: everything this rank sends in one call (payload, statistics, argument check).
        counters = self.ctx.comm.counters
        before = counters["bytes_sent"]
        self.reset()
        self.run()
        return int(counters["bytes_sent"] - before)


class _TorchRunner(_Runner):
    def run(self) -> None:
        import torch.distributed as dist

        dist.all_reduce(self.buffer)
        if self.ctx.redop == "avg":  # gloo has no AVG: what a user writes instead
            self.buffer.div_(self.ctx.world_size)


class _HookRunner(_Runner):
    def __init__(self, case: Case, x: torch.Tensor, ctx: _Context) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        super().__init__(case, x, ctx)
        self.hook = getattr(default_hooks, case.hook)

    def run(self) -> None:
        # The hooks take a (tensor,) tuple as the bucket and average in place.
        self.hook(None, (self.buffer,)).wait()


_RUNNERS: dict[Impl, type[_Runner]] = {
    Impl.DQCOLL: _DqcollRunner,
    Impl.TORCH: _TorchRunner,
    Impl.DDP_HOOK: _HookRunner,
}


# -- one rank --------------------------------------------------------------------------------


@dataclasses.dataclass
class _Context:
    comm: Any  # dqcoll Communicator over the job's process group
    rank: int
    world_size: int
    redop: str
    device: torch.device


@dataclasses.dataclass
class _Check:
    ok: bool
    vnmse: float
    reason: str = ""


def _tolerance(case: Case, world_size: int, max_vnmse: float) -> float:
    """vNMSE a correct row stays under: dtype rounding for uncompressed paths, else a budget."""
    wire = case.wire_dtype
    if case.impl is Impl.DQCOLL and case.scheme == "none":
        wire = case.dtype
    if wire is None:
        return max_vnmse
    eps = torch.finfo(wire).eps
    # Each of the <= n additions on a path rounds once (relative error <= eps/2), plus the casts.
    return 16.0 * world_size * eps * eps


def _all_ranks(values: list[float], ctx: _Context) -> list[float]:
    """Every rank's value of a small per-rank vector, gathered with one all-reduce."""
    import torch.distributed as dist

    k = len(values)
    table = torch.zeros(ctx.world_size * k, dtype=torch.float64)
    table[ctx.rank * k : (ctx.rank + 1) * k] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(table)
    return table.tolist()


def _check(runner: _Runner, exact: torch.Tensor, ctx: _Context, tolerance: float) -> _Check:
    runner.reset()
    runner.run()
    out = runner.buffer.double()
    scale = 1.0 / ctx.world_size if (runner.case.is_average or ctx.redop == "avg") else 1.0
    reference = exact * scale
    finite = torch.isfinite(reference)
    bad_finite = int((finite & ~torch.isfinite(out)).sum())
    norm = float(reference[finite].square().sum())
    err = float((out - reference)[finite].square().sum()) if bad_finite == 0 else math.inf
    vnmse = err / norm if norm > 0 else (0.0 if err == 0 else math.inf)
    crc = zlib.crc32(runner.buffer.contiguous().view(torch.uint8).numpy().tobytes())
    table = _all_ranks([float(crc), float(bad_finite), vnmse], ctx)
    crcs = table[0::3]
    reasons = []
    if len(set(crcs)) != 1:
        reasons.append("ranks differ (output checksums " + ", ".join(f"{int(c):08x}" for c in crcs)
                       + ")")
    bad = [int(b) for b in table[1::3]]
    if any(bad):
        reasons.append(f"non-finite outputs for finite sums on ranks: {bad}")
    worst = max(table[2::3])
    if not worst <= tolerance:
        reasons.append(f"vnmse {worst:.3g} above tolerance {tolerance:.3g}")
    return _Check(not reasons, worst, "; ".join(reasons))


def _time_loop(runner: _Runner, iters: int, warmup: int, ctx: _Context) -> float:
    """Seconds per call on this rank: ``warmup`` calls, a barrier, then ``iters`` timed calls."""
    import torch.distributed as dist

    grows = ctx.redop == "sum" and not runner.case.is_average
    refill_every = (max(1, int(math.log(_GROWTH_LIMIT) / math.log(ctx.world_size)) - 1)
                    if grows and ctx.world_size > 1 else 0)
    runner.reset()
    done = 0
    for _ in range(warmup):
        if refill_every and done and done % refill_every == 0:
            runner.reset()
        runner.run()
        done += 1
    runner.reset()
    done = 0
    dist.barrier()
    paused = 0.0
    start = time.perf_counter()
    for _ in range(iters):
        if refill_every and done and done % refill_every == 0:
            t = time.perf_counter()
            runner.reset()
            paused += time.perf_counter() - t
        runner.run()
        done += 1
    return (time.perf_counter() - start - paused) / max(iters, 1)


def _codec_throughput(case: Case, count: int, reps: int = 1) -> dict[str, float]:
    """Single-process encode / decode throughput of a scheme (GB/s of fp32 input), one rank."""
    from .. import schemes

    scheme = schemes.get(case.scheme, **({"bits": case.bits} if case.bits is not None else {}))
    x = torch.randn(count, generator=torch.Generator().manual_seed(1))
    payload = scheme.encode(x)  # warm-up
    t0 = time.perf_counter()
    for _ in range(reps):
        payload = scheme.encode(x)
    t1 = time.perf_counter()
    for _ in range(reps):
        scheme.decode(payload)
    t2 = time.perf_counter()
    nbytes = count * 4
    return {"encode_gbps": nbytes * reps / (t1 - t0) / 1e9,
            "decode_gbps": nbytes * reps / (t2 - t1) / 1e9}


def _combine(seconds: float, mode: int, ctx: _Context) -> float:
    values = _all_ranks([seconds], ctx)
    if mode == 0:
        return values[0]
    if mode == 2:
        return min(values)
    if mode == 3:
        return max(values)
    return sum(values) / len(values)


# -- provenance ------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    return device_name(device)



def provenance(args: argparse.Namespace, world_size: int, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    import dqcoll

    return {
        "device": _device_name(device),
        "world_size": world_size,
        "topology": args.topology,
        "backend": str(dist.get_backend()) if dist.is_initialized() else "",
        "dqcoll_version": dqcoll.__version__,
        "torch_version": torch.__version__,
        "commit": git_commit(),
        "host": socket.gethostname(),
        "threads_per_rank": torch.get_num_threads(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "dqcoll bench " + shlex.join(args.argv),
    }


# -- output ----------------------------------------------------------------------------------

_HEAD = (f"# {'':<30} {'size':>10} {'count':>10} {'type':>8} {'redop':>5} | {'time':>10} "
         f"{'algbw':>7} {'busbw':>7} | {'wire_B':>11} {'ratio':>6} {'vnmse':>9}")
_UNITS = (f"# {'':<30} {'(B)':>10} {'(elements)':>10} {'':>8} {'':>5} | {'(us)':>10} "
          f"{'(GB/s)':>7} {'(GB/s)':>7} | {'(B)':>11} {'':>6} {'':>9}")


def _format_row(row: dict[str, Any], link: bool) -> str:
    head = (f"  {row['impl']:<30} {row['size_nbytes']:>10} {row['count']:>10} {row['type']:>8} "
            f"{row['redop']:>5} | ")
    if not row["check_ok"]:
        return head + f"FAILED: {row['check_reason']}"
    vnmse = "n/a" if row["vnmse"] is None else f"{row['vnmse']:.2e}"
    text = (head + f"{row['time_us']:>10.1f} {row['algbw_gbps']:>7.3f} {row['busbw_gbps']:>7.3f} | "
            f"{row['wire_nbytes']:>11} {row['ratio']:>6.2f} {vnmse:>9}")
    if link:
        text += f"  {100.0 * row['link_floor_us'] / row['time_us']:>5.1f}%"
    return text


def render_markdown(path: str) -> str:
    """A results file as a markdown table (rows in run order) with its provenance line."""
    with open(path) as f:
        data = json.load(f)
    prov = data["provenance"]
    lines = [
        f"`{prov['command']}` -- {prov['world_size']} ranks, {prov['topology']}; "
        f"{prov['device']}; dqcoll {prov['dqcoll_version']} commit {prov['commit']}, "
        f"torch {prov['torch_version']}, {prov['date_utc']}",
        "",
        "| impl | size(B) | count | type | redop | time(us) | algbw GB/s | busbw GB/s | wire_B "
        "| ratio | vnmse |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        head = (f"| {row['impl']} | {row['size_nbytes']} | {row['count']} | {row['type']} | "
                f"{row['redop']} |")
        if not row["check_ok"]:
            lines.append(head + f" FAILED: {row['check_reason']} | | | | | |")
            continue
        vnmse = "n/a" if row["vnmse"] is None else f"{row['vnmse']:.2e}"
        lines.append(head + f" {row['time_us']:.0f} | {row['algbw_gbps']:.4f} | "
                     f"{row['busbw_gbps']:.4f} | {row['wire_nbytes']} | {row['ratio']:.2f} | "
                     f"{vnmse} |")
    timed = [r for r in data["rows"] if r["check_ok"]]
    ours = sorted({r["impl"] for r in timed if r["impl"].startswith("dqcoll ")})
    peers = sorted({r["impl"] for r in timed if not r["impl"].startswith("dqcoll ")})
    if ours and peers:
        lines += ["", "Speed-up (peer time / dqcoll time at the same count; > 1: dqcoll faster):",
                  "", "| dqcoll row | count | " + " | ".join(f"vs {p}" for p in peers) + " |",
                  "|---|---:|" + "---:|" * len(peers)]
        by_key = {(r["impl"], r["count"]): r["time_us"] for r in timed}
        for impl in ours:
            for count in sorted({r["count"] for r in timed if r["impl"] == impl}):
                cells = [f"{by_key[(p, count)] / by_key[(impl, count)]:.3f}"
                         if (p, count) in by_key else "" for p in peers]
                lines.append(f"| {impl} | {count} | " + " | ".join(cells) + " |")
    codec = [(r["count"], r["codec"]) for r in data["rows"] if "codec" in r]
    if codec:
        lines += ["", "Codec alone on rank 0 (single process, single-shot encode / decode, GB/s "
                  "of fp32 input): " + "; ".join(
                      f"{count} elements: {c['encode_gbps']:.4f} / {c['decode_gbps']:.4f}"
                      for count, c in codec)]
    return "\n".join(lines)


# -- the worker (one rank) -------------------------------------------------------------------


def _exact_sum(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    import torch.distributed as dist

    exact = x.to(dtype).double()
    dist.all_reduce(exact)
    return exact


def run_rank(args: argparse.Namespace) -> int:
    """One rank of the benchmark inside an initialised env:// job; rank 0 prints."""
    import torch.distributed as dist

    import dqcoll

    comm = dqcoll.init(backend="gloo")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size))  # torchrun sets it
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // local_ranks))
    rank, n = comm.rank, comm.world_size
    ctx = _Context(comm, rank, n, args.op, torch.device("cpu"))
    dtype = _DTYPES[args.datatype]
    cases = build_cases(dtype, args.scheme, args.bits, args.algorithm, args.peers)
    sizes = size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    prov = provenance(args, n, ctx.device)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# dqcoll bench: {n} ranks, {prov['backend']}, topology: {args.topology}")
    say(f"# device: {prov['device']}, {prov['threads_per_rank']} threads per rank")
    say(f"# dqcoll {prov['dqcoll_version']} (commit {prov['commit']}), torch "
        f"{prov['torch_version']}, {prov['date_utc']}")
    say(f"# iters {args.iters}, warm-ups {args.warmup_iters}, check {args.check}, time: "
        f"{_AVERAGE_MODES[args.average]}; algbw/busbw on the uncompressed size, "
        "busbw = algbw * 2(n-1)/n")
    if args.link_gbps:
        say(f"# last column: link floor (wire_B at {args.link_gbps:g} Gb/s per link) / time")
    say("#")
    say(_HEAD + ("  link%" if args.link_gbps else ""))
    say(_UNITS)
    rows: list[dict[str, Any]] = []
    failures = 0
    for size in sizes:
        count = max(1, size // dtype.itemsize)
        gen = torch.Generator().manual_seed(args.seed * 1000003 + rank)
        x = torch.randn(count, generator=gen)
        exact_by_dtype: dict[torch.dtype, torch.Tensor] = {}
        for case in cases:
            runner = _RUNNERS[case.impl](case, x, ctx)
            nbytes = count * case.dtype.itemsize
            if args.check:
                if case.dtype not in exact_by_dtype:
                    exact_by_dtype[case.dtype] = _exact_sum(x, case.dtype)
                check = _check(runner, exact_by_dtype[case.dtype], ctx,
                               _tolerance(case, n, args.max_vnmse))
            else:
                check = _Check(True, math.nan)
            row: dict[str, Any] = {
                "impl": case.label, "scheme": case.scheme or None, "bits": case.bits,
                "algorithm": case.algorithm or None, "size_nbytes": nbytes, "count": count,
                "type": _TYPE_NAMES[case.dtype], "redop": "avg" if case.is_average else args.op,
                "check_ok": check.ok, "check_reason": check.reason,
                "vnmse": None if math.isnan(check.vnmse) else check.vnmse,
            }
            if check.ok:
                wire = int(max(_all_ranks([float(runner.wire_nbytes())], ctx)))
                seconds = _combine(_time_loop(runner, args.iters, args.warmup_iters, ctx),
                                   args.average, ctx)
                algbw = nbytes / seconds / 1e9
                from ..transports.base import ring_allreduce_nbytes

                row.update({
                    "time_us": seconds * 1e6, "algbw_gbps": algbw,
                    "busbw_gbps": algbw * busbw_factor(n), "wire_nbytes": wire,
                    "ratio": ring_allreduce_nbytes(nbytes, n) / wire if wire else math.inf,
                })
                if args.link_gbps:
                    row["link_floor_us"] = wire * 8 / (args.link_gbps * 1e9) * 1e6
            else:
                failures += 1
            if args.codec and case.impl is Impl.DQCOLL and case.algorithm == args.algorithm[0]:
                # One rank at a time, alone on the CPU: what the codec alone can do per core set.
                dist.barrier()
                if rank == 0:
                    row["codec"] = _codec_throughput(case, count)
                dist.barrier()
            row.update(prov)
            rows.append(row)
            say(_format_row(row, bool(args.link_gbps)), flush=True)
            if "codec" in row:
                say(f"#   codec alone on rank 0 ({case.scheme}, {row['count']} elements): encode "
                    f"{row['codec']['encode_gbps']:.4f} GB/s, decode "
                    f"{row['codec']['decode_gbps']:.4f} GB/s", flush=True)
    say(f"# checks failed: {failures} of {len(rows)}")
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"provenance": prov, "rows": rows}, f, indent=1)
        say(f"# wrote {args.json}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failures else 0


# -- the launcher ----------------------------------------------------------------------------



def _compile_once() -> None:
    """Compile the CPU kernels (or load them from numba's disk cache, ~2 s) in this process
    before the ranks start, so that on a fresh machine they load them instead of each compiling
    them at once (~1.5 min of CPU per process)."""
    import torch

    from .. import kernels

    kernels.warm_up(torch.device("cpu"))


def spawn(argv: Sequence[str], world_size: int, *, timeout_s: float | None = None,
          threads: int = 0) -> int:
    """Run ``world_size`` ranks of the benchmark as processes on this machine (gloo, loopback)."""
    from .. import envs

    grace_s = (envs.timeout_s() if timeout_s is None else timeout_s) + 30.0
    _compile_once()
    port = rendezvous_port()
    procs: list[subprocess.Popen[bytes]] = []
    child_argv = [sys.executable, "-m", "dqcoll.cli.bench", *argv, "--launcher", "env"]
    if threads:
        child_argv += ["--threads", str(threads)]
    try:
        for rank in range(world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                       WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                       MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen(
                child_argv, env=env, stdout=None if rank == 0 else subprocess.DEVNULL))
        return _wait_all(procs, grace_s)
    finally:
        for p in procs:  # only on an early exit (Ctrl-C, a failed rank): stop the rest
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _wait_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> int:
    """Exit status of the group: 0 if every rank succeeded; a failed rank's peers get ``grace_s``
    to report their own errors (their waits time out) before they are stopped."""
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return max((abs(c) for c in codes if c is not None), default=0)
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            return max(abs(c) for c in codes if c is not None)
        time.sleep(0.1)


def _list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [convert(t) for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dqcoll bench",
        description="nccl-tests-style all-reduce benchmark: dqcoll schemes next to "
        "torch.distributed.all_reduce (fp32, bf16) and DDP's fp16/bf16 compression hooks",
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1M"))
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("16M"))
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("-i", "--stepbytes", type=parse_size, default=0,
                   help="fixed increment instead of -f")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup-iters", "--warmup_iters", dest="warmup_iters", type=int,
                   default=1)
    p.add_argument("-c", "--check", type=int, default=1, choices=(0, 1),
                   help="1: check every row against the exact sum before timing it")
    p.add_argument("-a", "--average", type=int, default=1, choices=(0, 1, 2, 3),
                   help="time reported: 0 rank 0, 1 mean, 2 min, 3 max over ranks")
    p.add_argument("-d", "--datatype", default="float", choices=sorted(_DTYPES))
    p.add_argument("-o", "--op", default="sum", choices=("sum", "avg"))
    p.add_argument("-g", "--world-size", type=int, default=4,
                   help="ranks to spawn on this machine (ignored under --launcher env)")
    p.add_argument("--scheme", type=_list(str), default=["dynamiq"],
                   help="comma-separated dqcoll schemes ('' for none)")
    p.add_argument("--bits", type=_list(float), default=[5.0], help="comma-separated budgets")
    p.add_argument("--algorithm", type=_list(str), default=["butterfly"],
                   help="comma-separated dqcoll algorithms")
    p.add_argument("--peers", type=lambda t: [] if t == "none" else _list(str)(t),
                   default=list(PEERS), help=f"comma-separated from {list(PEERS)}, or 'none'")
    p.add_argument("--max-vnmse", type=float, default=0.25,
                   help="check tolerance for quantized schemes")
    p.add_argument("--codec", type=int, default=1, choices=(0, 1),
                   help="1: also time each scheme's codec alone on rank 0 (single process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (default: cores / ranks, at least 1)")
    p.add_argument("--topology", default="",
                   help="label recorded with the results (default: loopback / env://)")
    p.add_argument("--link-gbps", type=float, default=0.0,
                   help="per-link rate, to report each row against its link floor")
    p.add_argument("--json", default="", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--launcher", default="auto", choices=("auto", "spawn", "env"),
                   help="spawn -g processes here, or be one rank of an env:// job")
    p.add_argument("--render", default="", metavar="FILE",
                   help="print a results JSON as a markdown table and exit (runs nothing)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.render:
        print(render_markdown(args.render))
        return 0
    launcher = args.launcher
    if launcher == "auto":
        launcher = "env" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else "spawn"
    try:
        build_cases(_DTYPES[args.datatype], args.scheme, args.bits, args.algorithm, args.peers)
        size_sweep(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)
    except Exception as exc:  # bad arguments: say so before starting any process
        print(f"dqcoll bench: error: {exc}", file=sys.stderr)
        return 2
    if launcher == "env":
        if not args.topology:
            args.topology = f"env:// job ({os.environ.get('MASTER_ADDR', '?')})"
        return run_rank(args)
    if args.world_size < 1:
        print(f"dqcoll bench: error: -g must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    threads = args.threads or max(1, (os.cpu_count() or 1) // args.world_size)
    if not args.topology:
        argv = [*argv, "--topology", f"1 host, {args.world_size} processes, loopback"]
    return spawn(argv, args.world_size, threads=threads)


if __name__ == "__main__":
    code = main()
    # The ranks (``python -m dqcoll.cli.bench --launcher env``, as spawn() and
    # tools/netns_cluster.py start them) leave without the interpreter's teardown: after
    # destroy_process_group, gloo's C++ teardown at exit can abort a finished rank ("terminate
    # called without an active exception", exit 6) after every result has been written, on a
    # loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
