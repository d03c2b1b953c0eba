"""DynamiQ's CPU codec per operation: the compiled (numba) kernels against the torch reference.

Per format, width and rounding mode, one thread
(``torch.set_num_threads(1)``, ``DQCOLL_CPU_THREADS=1``), on ``--numel`` coordinates (default
``2**24``) of N(0, 1) rows, as rank 1 of ``--world-size`` (default 4) ranks:

========================  =================================================================
op                        call (the executor's role)
========================  =================================================================
``encode``                ``encode`` (a leaf compresses its chunk)
``hop``                   ``decode_accumulate_encode(keep_sum=False)`` (the fused hop)
``decode``                ``decode`` (all-gather receive)
``decode_accumulate``     ``decode_accumulate`` (a non-last child)
``stats``                 ``stats`` + ``center_gather`` (numba) / ``stats_center`` + gather
``restore``               ``restore`` (fp32 output)
========================  =================================================================

Formats: ``hierarchical`` (the paper's scales and levels) at widths 2, 4, 8, correlated and
independent rounding; ``hierarchical4x32`` with ``Levels.TUNED`` (format 3) at every fine width
(2..8), correlated rounding.

Before timing, the numba outputs must equal the reference's bit for bit (no speed for a wrong
answer). Best of ``--repeats`` after one untimed warm-up (which also pays the JIT), into reused
output buffers. Writes ``--out`` (default ``benchmarks/results/dynamiq-cpu-rates.json``) with
provenance and prints a table in M coordinates/s.

Usage: ``python benchmarks/dynamiq_cpu_rates.py [--numel 16777216] [--repeats 3] [--reference 1]``
(``--reference 0`` skips the slow torch reference, ~2 minutes at 2**24).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["DQCOLL_CPU_THREADS"] = "1"

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dqcoll.cli.provenance import device_name, git_commit  # noqa: E402
from dqcoll.kernels import codec  # noqa: E402
from dqcoll.kernels import dynamiq_numba as fast  # noqa: E402
from dqcoll.kernels.codec import (  # noqa: E402
    FINE_WIDTHS,
    SUPER,
    WIDTHS,
    CodecConfig,
    Levels,
    RoundingMode,
    Scales,
)

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "dynamiq-cpu-rates.json"
KEY = 0x5EED
# (scales, levels, widths, rounding modes) measured
FORMATS = (
    (Scales.HIERARCHICAL, Levels.NONUNIFORM, WIDTHS, tuple(RoundingMode)),
    (Scales.HIERARCHICAL4X32, Levels.TUNED, FINE_WIDTHS, (RoundingMode.CORRELATED,)),
)


def _best(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _timed_ops(
    x: torch.Tensor, incoming: torch.Tensor, acc: torch.Tensor, out: torch.Tensor,
    decoded: torch.Tensor, width: int, config: CodecConfig, index: torch.Tensor, rank: int,
    n: int,
) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """op -> (numba call, reference call), writing into the given buffers."""
    return {
        "encode": (
            lambda: fast.encode(x, width, index, rank, n, KEY, config, out=out),
            lambda: codec.encode_torch(x, width, index, rank, n, KEY, config, out=out)),
        "hop": (
            lambda: fast.decode_accumulate_encode(incoming, width, acc, index, rank, n, KEY,
                                                  config, keep_sum=False, out=out),
            lambda: codec.decode_accumulate_encode_torch(incoming, width, acc, index, rank, n,
                                                         KEY, config, out=out)),
        "decode": (lambda: fast.decode(incoming, width, config, out=decoded),
                   lambda: codec.decode_torch(incoming, width, config, out=decoded)),
        "decode_accumulate": (lambda: fast.decode_accumulate(incoming, width, config, acc),
                              lambda: codec.decode_accumulate_torch(incoming, width, config, acc)),
    }


def measure(numel: int, repeats: int, world_size: int, reference: bool) -> list[dict[str, Any]]:
    rows = numel // SUPER
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, SUPER, generator=g)
    local = torch.randn(rows, SUPER, generator=g)
    index = torch.arange(rows, dtype=torch.int64) * SUPER
    valid = torch.full((rows,), SUPER, dtype=torch.int64)
    order = torch.randperm(rows, generator=g)
    rank, n = 1, world_size
    records: list[dict[str, Any]] = []

    def add(op: str, width: int | None, rounding: str | None, kernels: str, seconds: float,
            config: CodecConfig | None = None) -> None:
        scales = None if config is None else config.scales.value
        levels = None if config is None else config.levels.value
        records.append({"op": op, "width": width, "rounding": rounding, "scales": scales,
                        "levels": levels, "kernels": kernels,
                        "numel": rows * SUPER, "time_ms": seconds * 1e3,
                        "mcoords_per_s": rows * SUPER / seconds / 1e6})
        print(f"{op:<18}{scales or '':<18}{levels or '':<11}{width or '':>4}  "
              f"{rounding or '':<12}{kernels:<7}{rows * SUPER / seconds / 1e6:>10.1f}", flush=True)

    print(f"{'op':<18}{'scales':<18}{'levels':<11}{'bits':>4}  {'rounding':<12}{'impl':<7}"
          f"{'M coords/s':>10}")
    cases = [(CodecConfig(levels=levels, scales=scales, rounding=rounding), width)
             for scales, levels, widths, roundings in FORMATS
             for rounding in roundings for width in widths]
    for config, width in cases:
        rounding = config.rounding
        incoming = codec.encode_torch(x, width, index, 0, n, KEY ^ 1, config)
        expected = codec.encode_torch(x, width, index, rank, n, KEY, config)
        out = torch.empty_like(expected)
        assert torch.equal(fast.encode(x, width, index, rank, n, KEY, config, out=out),
                           expected), (width, rounding)
        acc = local.clone()
        hop_ref = codec.decode_accumulate_encode_torch(incoming, width, acc, index, rank, n,
                                                       KEY, config)
        acc = local.clone()
        assert torch.equal(fast.decode_accumulate_encode(incoming, width, acc, index, rank,
                                                         n, KEY, config), hop_ref)
        decoded = torch.empty_like(x)
        assert torch.equal(fast.decode(incoming, width, config, out=decoded),
                           codec.decode_torch(incoming, width, config))
        timed = _timed_ops(x, incoming, acc, out, decoded, width, config, index, rank, n)
        for op, (numba_fn, torch_fn) in timed.items():
            add(op, width, rounding.value, "numba", _best(numba_fn, repeats), config)
            if reference:
                add(op, width, rounding.value, "torch", _best(torch_fn, 1), config)
    mean, _ = fast.stats(x, valid)
    work = torch.empty_like(x)
    result = torch.empty(rows * SUPER)
    _, ref_mean, _ = codec.stats_center_torch(x, valid)
    assert torch.equal(mean, ref_mean)
    add("stats", None, None, "numba", _best(
        lambda: fast.center_gather(x, fast.stats(x, valid)[0], valid, order, out=work), repeats))
    add("restore", None, None, "numba", _best(
        lambda: fast.restore(x, mean, index[order], valid, result), repeats))
    if reference:
        add("stats", None, None, "torch", _best(
            lambda: codec.stats_center_torch(x, valid)[0][order], 1))
        add("restore", None, None, "torch", _best(
            lambda: codec.restore_torch(x, mean, index[order], valid, result), 1))
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--reference", type=int, choices=(0, 1), default=1)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    import numba

    meta = {
        "device": device_name("cpu"), "threads": 1,
        "torch": torch.__version__, "numba": numba.__version__,
        "python": platform.python_version(), "commit": git_commit("benchmarks"),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "numel": args.numel, "repeats": args.repeats, "world_size": args.world_size,
        "rank": 1,
    }
    print(f"# {meta['device']}, one thread, {args.numel} coordinates, commit {meta['commit']}")
    records = measure(args.numel, args.repeats, args.world_size, bool(args.reference))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    print(f"# wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
