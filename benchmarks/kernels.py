"""Throughput of the DynamiQ Triton kernels on one GPU, against memory bandwidth and the reference.

For each kernel x width x size (2**20 ... 2**28 coordinates by default) this times the Triton
kernel with CUDA events after warm-up, converts the bytes the kernel must read and write (the
model below, docs/design.md §7) into GB/s, divides by the device-to-device copy bandwidth measured
in the same run (``dst.copy_(src)`` of 1 GiB, read + write bytes), and times the torch reference
on the same GPU for the speed-up. Before anything is timed, the kernel's output on the first rows
is checked against the CPU reference: no speed is reported for a wrong answer.

Bytes moved per super-group of 256 coordinates (``R_b`` = record bytes, 32b + 18 hierarchical):

=============================  ==========================================================
kernel                         read + written
=============================  ==========================================================
stats_center                   256*in (x) + 4 (valid) | 256*4 (centred) + 8 (mean, norm2)
encode                         256*4 (x) + 8 (index)  | R_b
decode                         R_b                    | 256*4
decode_accumulate              R_b + 256*4 (acc)      | 256*4 (acc)
decode_accumulate_encode       R_b + 256*4 + 8        | R_b  (keep_sum=False, as the executor
                                                      calls it: the sum stays in registers)
restore                        256*4 + 16 (mean, index, valid) | 256*out
=============================  ==========================================================

Writes ``benchmarks/results/kernels-<device>.json``: ``{"meta": {...}, "records": [...]}``, one
record per kernel x bits x numel with ``kernel, bits, numel, time_us, nbytes, gbps,
pct_of_copy, torch_time_us, speedup_vs_torch, device, commit`` (``bits`` is null for the
width-independent kernels; ``speedup_vs_torch`` is null above ``--torch-max-log2``, where the
reference would take minutes). ``--tune`` first sweeps rows-per-program x warps for the
fused kernel and reports the best per width (the table in ``dqcoll/kernels/_launch.py`` is
untuned until then). ``--device cpu`` runs the same code on tiny sizes in Triton's interpreter
(a smoke test of this script; its timings mean nothing). ``--aot 90 [--json FILE]`` needs no
GPU: it compiles every kernel exactly as launched for sm_90 and counts the SASS instructions
executed per coordinate, registers, spills and the implied share of H100 copy bandwidth
(definitions in ``benchmarks/kernels_aot.py``); ``--scales``/``--levels`` pick the format
(default: hierarchical, nonuniform), ``--append`` merges the records into an existing file.

Usage: ``python benchmarks/kernels.py [--min-log2 20 --max-log2 28 --step 2] [--tune]``
       ``python benchmarks/kernels.py --aot 90 --json benchmarks/results/kernels-aot-sm90.json``
       ``python benchmarks/kernels.py --aot 90 --json ... --append --scales hierarchical4x32
       --levels tuned --widths 2 3 4 5 6 7 8``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dqcoll.cli.provenance import git_commit  # noqa: E402
from dqcoll.kernels import (  # noqa: E402
    _launch,
    codec,
    dynamiq_triton,
)
from dqcoll.kernels.codec import (  # noqa: E402
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    RoundingMode,
    Scales,
    record_nbytes,
)

KERNELS = (
    "stats_center",
    "encode",
    "decode",
    "decode_accumulate",
    "decode_accumulate_encode",
    "restore",
)
WIDTHLESS = {"stats_center", "restore"}
KEY = 0x1234ABCD
CHECK_ROWS = 64  # rows checked against the CPU reference before timing


@dataclasses.dataclass
class Case:
    """One kernel at one width and size: its inputs, both implementations and its bytes."""

    kernel: str
    bits: int | None
    numel: int
    nbytes: int
    run: Callable[[], Any]  # the Triton kernel (outputs preallocated where the op allows)
    run_torch: Callable[[], Any]  # the torch reference on the same device
    check: Callable[[], None]  # raises if the first rows differ from the CPU reference


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu-interpreter"
    name = torch.cuda.get_device_name(device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")



def time_us(fn: Callable[[], Any], device: torch.device, *, warmup: int, min_time_s: float,
            max_iters: int) -> float:
    """Median time of one call: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    spent = 0.0
    while len(samples) < 3 or (spent < min_time_s and len(samples) < max_iters):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            elapsed_s = start.elapsed_time(stop) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            elapsed_s = time.perf_counter() - t0
        samples.append(elapsed_s)
        spent += elapsed_s
    return statistics.median(samples) * 1e6


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), device, warmup=3, min_time_s=0.2, max_iters=50)
    return 2 * nbytes / (t * 1e-6) / 1e9


def rows_like_gradients(rows: int, device: torch.device, seed: int) -> torch.Tensor:
    """Gaussian rows with log-normal row magnitudes, generated on the device."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(torch.randn(rows, 1, generator=g, device=device) * 2.0)
    return torch.randn(rows, SUPER, generator=g, device=device) * scale


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    actual = actual.cpu()
    same = torch.equal(actual, expected) if actual.dtype == torch.uint8 else torch.equal(
        torch.nan_to_num(actual), torch.nan_to_num(expected))
    if not same:
        raise AssertionError(f"{what}: Triton output differs from the CPU reference")


def build_case(kernel: str, width: int | None, numel: int, device: torch.device,
               config: CodecConfig, world_size: int) -> Case:
    rows = numel // SUPER
    rank = world_size // 2
    x = rows_like_gradients(rows, device, seed=1)
    index = torch.arange(rows, dtype=torch.int64, device=device) * SUPER
    head = slice(0, min(CHECK_ROWS, rows))
    x_cpu, index_cpu = x[head].cpu(), index[head].cpu()
    ops = dynamiq_triton
    if kernel == "stats_center":
        valid = torch.full((rows,), SUPER, dtype=torch.int32, device=device)

        def check() -> None:
            got = ops.stats_center(x[head], valid[head])
            want = codec.stats_center_torch(x_cpu, valid[head].cpu())
            for a, e, name in zip(got, want, ("centred", "mean", "norm2"), strict=True):
                _assert_equal(a, e, f"stats_center {name}")

        return Case(kernel, None, numel, rows * (SUPER * 4 * 2 + 4 + 8),
                    lambda: ops.stats_center(x, valid),
                    lambda: codec.stats_center_torch(x, valid), check)
    if kernel == "restore":
        mean = torch.randn(rows, device=device)
        valid = torch.full((rows,), SUPER, dtype=torch.int32, device=device)
        order = torch.randperm(rows, device=device)
        out = torch.empty(numel, dtype=torch.float32, device=device)

        def check() -> None:
            n_head = x_cpu.shape[0]
            idx = torch.randperm(n_head) * SUPER
            got = torch.empty(n_head * SUPER, dtype=torch.float32, device=device)
            want = torch.empty(n_head * SUPER, dtype=torch.float32)
            ops.restore(x[head], mean[head], idx.to(device), valid[head], got)
            ops.restore_torch(x_cpu, mean[head].cpu(), idx, valid[head].cpu(), want)
            _assert_equal(got, want, "restore")

        return Case(kernel, None, numel, rows * (SUPER * 4 * 2 + 16),
                    lambda: ops.restore(x, mean, index[order], valid, out),
                    lambda: ops.restore_torch(x, mean, index[order], valid, out), check)

    assert width is not None
    record = record_nbytes(width, config.scales)
    records = ops.encode(x, width, index, 0, world_size, KEY ^ 7, config)
    records_cpu = records[head].cpu()
    acc = rows_like_gradients(rows, device, seed=2)
    acc_cpu = acc[head].cpu()
    if kernel == "encode":
        def check() -> None:
            _assert_equal(ops.encode(x[head], width, index[head], rank, world_size, KEY, config),
                          codec.encode_torch(x_cpu, width, index_cpu, rank, world_size, KEY,
                                             config), "encode")

        return Case(kernel, width, numel, rows * (SUPER * 4 + 8 + record),
                    lambda: ops.encode(x, width, index, rank, world_size, KEY, config),
                    lambda: codec.encode_torch(x, width, index, rank, world_size, KEY, config),
                    check)
    if kernel == "decode":
        def check() -> None:
            _assert_equal(ops.decode(records[head], width, config),
                          codec.decode_torch(records_cpu, width, config), "decode")

        return Case(kernel, width, numel, rows * (record + SUPER * 4),
                    lambda: ops.decode(records, width, config),
                    lambda: codec.decode_torch(records, width, config), check)
    if kernel == "decode_accumulate":
        def check() -> None:
            got, want = acc[head].clone(), acc_cpu.clone()
            ops.decode_accumulate(records[head], width, config, got)
            codec.decode_accumulate_torch(records_cpu, width, config, want)
            _assert_equal(got, want, "decode_accumulate")

        # Repeated calls keep adding into acc: same bytes moved, values stay finite for timing.
        return Case(kernel, width, numel, rows * (record + SUPER * 8),
                    lambda: ops.decode_accumulate(records, width, config, acc),
                    lambda: codec.decode_accumulate_torch(records, width, config, acc), check)
    if kernel == "decode_accumulate_encode":
        def check() -> None:
            got, want = acc[head].clone(), acc_cpu.clone()
            out = ops.decode_accumulate_encode(records[head], width, got, index[head], rank,
                                               world_size, KEY, config, keep_sum=False)
            ref = codec.decode_accumulate_encode_torch(records_cpu, width, want, index_cpu, rank,
                                                       world_size, KEY, config)
            _assert_equal(out, ref, "decode_accumulate_encode records")

        # keep_sum=False: acc is read, never written, so repeated calls time the same work.
        return Case(kernel, width, numel, rows * (2 * record + SUPER * 4 + 8),
                    lambda: ops.decode_accumulate_encode(records, width, acc, index, rank,
                                                         world_size, KEY, config,
                                                         keep_sum=False),
                    lambda: codec.decode_accumulate_encode_torch(records, width, acc, index, rank,
                                                                 world_size, KEY, config),
                    check)
    raise ValueError(f"unknown kernel {kernel!r}; choose from {KERNELS}")


def tune(device: torch.device, numel: int, config: CodecConfig, world_size: int,
         timing: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows per program x warps for the fused kernel at each width; returns one row per try."""
    results = []
    for width in WIDTHS:
        case = build_case("decode_accumulate_encode", width, numel, device, config, world_size)
        best = None
        for rows_per_program in (1, 2, 4, 8):
            for num_warps in (2, 4, 8):
                cfg = _launch.LaunchConfig(rows_per_program=rows_per_program, num_warps=num_warps)
                _launch.OVERRIDES[(_launch.Kernel.DECODE_ACCUMULATE_ENCODE, width)] = cfg
                try:
                    case.check()
                    t = time_us(case.run, device, **timing)
                finally:
                    _launch.OVERRIDES.clear()
                gbps = case.nbytes / (t * 1e-6) / 1e9
                results.append({"kernel": case.kernel, "bits": width, "numel": numel,
                                "rows_per_program": rows_per_program, "num_warps": num_warps,
                                "time_us": t, "gbps": gbps})
                print(f"tune fused {width}b rows={rows_per_program} warps={num_warps}: "
                      f"{t:10.1f} us {gbps:8.1f} GB/s", flush=True)
                if best is None or t < best[0]:
                    best = (t, rows_per_program, num_warps)
        assert best is not None
        print(f"tune fused {width}b best: rows_per_program={best[1]} num_warps={best[2]}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (interpreter)")
    parser.add_argument("--min-log2", type=int, default=20)
    parser.add_argument("--max-log2", type=int, default=28)
    parser.add_argument("--step", type=int, default=2, help="log2 step between sizes")
    parser.add_argument("--widths", type=int, nargs="+", default=list(WIDTHS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--world-size", type=int, default=8,
                        help="ranks keying correlated rounding (cycle walking depends on it)")
    parser.add_argument("--rounding", choices=[m.value for m in RoundingMode],
                        default=RoundingMode.CORRELATED.value)
    parser.add_argument("--torch-max-log2", type=int, default=24,
                        help="largest size at which the torch reference is timed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-time-s", type=float, default=0.1)
    parser.add_argument("--max-iters", type=int, default=50)
    parser.add_argument("--tune", action="store_true", help="sweep launch configs first")
    parser.add_argument("--json", "--out", dest="out", type=Path, default=None,
                        help="JSON path (default benchmarks/results/kernels-<device>.json; "
                        "with --aot: written only when given)")
    parser.add_argument("--scales", nargs="+", choices=[m.value for m in Scales],
                        default=[Scales.HIERARCHICAL.value],
                        help="with --aot: scale encodings to count (widths the kernels do not "
                        "implement for one are left out)")
    parser.add_argument("--levels", choices=[m.value for m in Levels],
                        default=Levels.NONUNIFORM.value, help="with --aot: level set")
    parser.add_argument("--append", action="store_true",
                        help="with --aot --json: merge into the existing file (records of the "
                        "same kernel, bits, rounding, scales and levels are replaced; the "
                        "command and commit go to meta.appended)")
    parser.add_argument("--aot", type=int, metavar="ARCH", default=None,
                        help="compile every kernel as launched for sm_ARCH (e.g. 90) without a "
                        "GPU and count executed SASS instructions per coordinate "
                        "(benchmarks/kernels_aot.py)")
    args = parser.parse_args(argv)
    if args.aot is not None:
        return aot_main(args)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device (use --device cpu for a smoke run)",
              file=sys.stderr)
        return 2
    config = CodecConfig(rounding=RoundingMode(args.rounding))
    slug = device_slug(device)
    commit = git_commit("benchmarks")
    timing = dict(warmup=args.warmup, min_time_s=args.min_time_s, max_iters=args.max_iters)
    copy_nbytes = 1 << 30 if device.type == "cuda" else 1 << 24
    copy_gbps = copy_bandwidth_gbps(device, copy_nbytes)
    print(f"# device {slug}  commit {commit}  copy bandwidth {copy_gbps:.1f} GB/s "
          f"(read+write, {copy_nbytes >> 20} MiB)  world_size {args.world_size}  "
          f"rounding {args.rounding}", flush=True)

    tuning = tune(device, 1 << 26 if device.type == "cuda" else 1 << 12, config,
                  args.world_size, timing) if args.tune else []

    records: list[dict[str, Any]] = []
    print(f"{'kernel':>26} {'bits':>4} {'numel':>11} {'time(us)':>10} {'GB/s':>8} {'%copy':>6} "
          f"{'torch(us)':>11} {'speedup':>8}")
    for log2 in range(args.min_log2, args.max_log2 + 1, args.step):
        numel = 1 << log2
        for kernel in args.kernels:
            for width in ([None] if kernel in WIDTHLESS else args.widths):
                case = build_case(kernel, width, numel, device, config, args.world_size)
                case.check()  # never report a speed for a wrong answer
                t = time_us(case.run, device, **timing)
                torch_t = (time_us(case.run_torch, device, warmup=1, min_time_s=0.0, max_iters=3)
                           if log2 <= args.torch_max_log2 else None)
                gbps = case.nbytes / (t * 1e-6) / 1e9
                record = {
                    "kernel": kernel, "bits": width, "numel": numel, "time_us": t,
                    "nbytes": case.nbytes, "gbps": gbps, "pct_of_copy": 100.0 * gbps / copy_gbps,
                    "torch_time_us": torch_t,
                    "speedup_vs_torch": None if torch_t is None else torch_t / t,
                    "world_size": args.world_size, "rounding": args.rounding,
                    "device": slug, "commit": commit,
                }
                records.append(record)
                speed = "-" if torch_t is None else f"{torch_t / t:7.1f}x"
                torch_s = "-" if torch_t is None else f"{torch_t:11.1f}"
                print(f"{kernel:>26} {width or '-':>4} {numel:>11} {t:>10.1f} {gbps:>8.1f} "
                      f"{record['pct_of_copy']:>6.1f} {torch_s:>11} {speed:>8}", flush=True)
                del case
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    out = args.out or ROOT / "benchmarks" / "results" / f"kernels-{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": slug, "commit": commit, "copy_gbps": copy_gbps, "copy_nbytes": copy_nbytes,
        "torch": torch.__version__, "triton": _triton_version(), "world_size": args.world_size,
        "rounding": args.rounding, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "launch_table_tuned": False, "tuning": tuning,
    }
    out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    print(f"# wrote {out}")
    fused = [r for r in records if r["kernel"] == "decode_accumulate_encode" and r["bits"] == 4
             and r["numel"] >= 1 << 26]
    for r in fused:
        verdict = "meets" if r["pct_of_copy"] >= 60.0 else "MISSES"
        print(f"# fused 4-bit at 2^{int(math.log2(r['numel']))}: {r['pct_of_copy']:.1f}% of copy "
              f"bandwidth ({verdict} the 60% target)")
    hop = [r for r in records if r["kernel"] == "decode_accumulate_encode"
           and r["speedup_vs_torch"] is not None]
    if hop:
        worst = min(hop, key=lambda r: r["speedup_vs_torch"])
        print(f"# per-hop (fused) speed-up vs torch: min {worst['speedup_vs_torch']:.1f}x "
              f"({worst['bits']}-bit, {worst['numel']} coordinates; target 10x)")
    return 0


def aot_main(args: argparse.Namespace) -> int:
    """``--aot ARCH``: instruction counts of every kernel x width x rounding, as a table and
    (with ``--json FILE``) as ``{"meta": ..., "records": [...]}``."""
    import kernels_aot  # benchmarks/kernels_aot.py, next to this script

    print(kernels_aot._HEADER, flush=True)
    kernels = tuple(k for k in kernels_aot.KERNELS if k in args.kernels)
    records = []
    for scales in args.scales:
        records += kernels_aot.aot_records(args.aot, world_size=args.world_size,
                                           kernels=kernels, widths=tuple(args.widths),
                                           log=lambda line: print(line, flush=True),
                                           scales=Scales(scales), levels=Levels(args.levels))
    command = " ".join(["benchmarks/kernels.py", *sys.argv[1:]])
    commit = git_commit("benchmarks/*.py")  # not the results: --append's file is one of them
    if args.out is not None and args.append and args.out.exists():
        old = json.loads(args.out.read_text())
        key = _aot_key
        new_keys = {key(r) for r in records}
        records = [r for r in old["records"] if key(r) not in new_keys] + records
        meta = old["meta"]
        meta.setdefault("appended", []).append({"command": command, "commit": commit})
    else:
        meta = kernels_aot.meta(args.aot, args.world_size, kernels_aot.NUMEL, commit)
        meta["command"] = command
    for line in kernels_aot.verdict(records):
        print(f"# {line}")
    warnings = sorted({w for r in records for w in r["warnings"]})
    for w in warnings:
        print(f"# warning: {w}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
        print(f"# wrote {args.out}")
    return 0


def _aot_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies an --aot record (records written before the scales/levels fields were
    the default encoding's)."""
    widthless = r["kernel"] in WIDTHLESS
    return (r["kernel"], r["bits"], r["rounding"],
            None if widthless else r.get("scales", Scales.HIERARCHICAL.value),
            None if widthless else r.get("levels", Levels.NONUNIFORM.value))


def _triton_version() -> str:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
