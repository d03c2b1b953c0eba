"""Per-hop CPU codec rates of every scheme: M coordinates/s per operation, one thread, one rank.

What one rank's host cores do per hop of a collective (docs/design.md §7: on slow links the codec
must outrun the link), measured on rank 0's own :class:`~dqcoll.schemes.SchemeCall` of a two-rank
all-reduce of ``2 * --numel`` coordinates, on its chunk 0 of ``--numel`` coordinates (default
``2**24``; two ranks so that a payload summing 2 ranks is valid and the incoming payload is
rank 1's real leaf payload), with ``torch.set_num_threads(1)`` and one compiled-kernel thread
(``DQCOLL_CPU_THREADS=1``):

=====================================  ===================================================
op                                     call
=====================================  ===================================================
``compress``                           ``compress(0, count=1)`` (a leaf; integer-sum schemes
                                       quantize their own values here, as a leaf does)
``decompress``                         ``decompress(0, payload, 1)``
``decompress_accumulate``              ``decompress_accumulate(0, payload, 1)``
``decompress_accumulate_recompress``   ``decompress_accumulate_recompress(0, payload, 1, 2)``
=====================================  ===================================================

Each op is timed under ``DQCOLL_KERNELS=torch`` (the reference) and under the fast path
(``numba``), best of ``--repeats`` after one untimed warm-up (which also pays the JIT), on the
same input (gradient-like: N(0, 1) times a per-block log-normal scale, so block scales differ).
Before timing, the fast path's payload and decoded values must equal the reference's bit for bit
(no speed is reported for a wrong answer). A scheme/op pair is one function of
:data:`CASES`/:data:`OPS`, so other schemes (DynamiQ) can add rows by adding a case.

Writes ``--out`` (default ``benchmarks/results/codec-rates-baselines-cpu.json``):
``{"meta": {device, torch, numba, commit, numel, repeats, threads}, "records": [{scheme,
options, op, kernels, numel, time_ms, mcoords_per_s}]}`` and prints a table.

Usage: ``python benchmarks/codec_rates.py [--numel 16777216] [--repeats 3] [--kernels both]
[--schemes mxfp8,int8_block]``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dqcoll import schemes  # noqa: E402
from dqcoll.cli.provenance import device_name, git_commit  # noqa: E402
from dqcoll.schemes.base import CallContext, SchemeCall  # noqa: E402
from dqcoll.transports.local import LocalHub  # noqa: E402
from dqcoll.types import Collective, ReduceOp  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "codec-rates-baselines-cpu.json"


@dataclasses.dataclass(frozen=True)
class Case:
    """One scheme configuration to measure."""

    scheme: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return self.scheme + "".join(f" {k}={v}" for k, v in self.options)


# Every baseline and every variant whose codec differs (element format, scale mode).
CASES: list[Case] = [
    Case("none"),
    Case("bf16"),
    Case("mxfp8"),
    Case("mxfp8", (("element", "e5m2"),)),
    Case("mxfp8", (("scale", "global"),)),
    Case("mxfp6"),
    Case("mxfp6", (("element", "e3m2"),)),
    Case("mxfp6", (("scale", "global"),)),
    Case("mxfp4"),
    Case("mxfp4", (("scale", "global"),)),
    Case("int8_block"),
    Case("int4_block"),
    Case("thc"),
    Case("global_qsgd"),
    Case("topk_block"),
]


def gradient_like(numel: int, seed: int = 0) -> torch.Tensor:
    """N(0, 1) times a log-normal scale per 256 coordinates (block scales spread over ~2**6)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g)
    blocks = -(-numel // 256)
    scale = torch.exp(2.0 * torch.randn(blocks, generator=g)).repeat_interleave(256)[:numel]
    return x * scale


@contextlib.contextmanager
def kernels_env(choice: str) -> Iterator[None]:
    """``DQCOLL_KERNELS=choice`` and one compiled-kernel thread while the block runs."""
    saved = {k: os.environ.get(k) for k in ("DQCOLL_KERNELS", "DQCOLL_CPU_THREADS")}
    os.environ["DQCOLL_KERNELS"] = choice
    os.environ["DQCOLL_CPU_THREADS"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_calls(case: Case, inputs: list[torch.Tensor], seed: int = 0) -> list[SchemeCall]:
    """The all-reduce calls of ``case`` of two ranks (``begin`` runs the schemes' statistics
    all-reduces, so the ranks begin together, one thread each); chunk 0 is the first half."""
    hub = LocalHub(len(inputs))
    scheme = schemes.get(case.scheme, **dict(case.options))
    calls: list[Any] = [None] * len(inputs)

    def begin(rank: int) -> None:
        ctx = CallContext(hub.transport(rank), ReduceOp.SUM, seed, 0, Collective.ALLREDUCE,
                          "bench")
        calls[rank] = scheme.begin(inputs[rank].clone(), ctx)

    threads = [threading.Thread(target=begin, args=(r,)) for r in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return calls


def _reset(call: SchemeCall, work: torch.Tensor) -> None:
    """Back to the state right after ``begin``: the call's own values, no partial sums."""
    call.work.copy_(work)
    sums = getattr(call, "sums", None)
    if isinstance(sums, dict):
        sums.clear()


# op -> fn(call, payload) returning what the op produced (compared between implementations)
OPS: dict[str, Callable[[SchemeCall, torch.Tensor], torch.Tensor]] = {
    "compress": lambda call, payload: call.compress(0, 1),
    "decompress": lambda call, payload: (call.decompress(0, payload, 1), call.work)[1],
    "decompress_accumulate": lambda call, payload: (
        call.decompress_accumulate(0, payload, 1), call.work)[1],
    "decompress_accumulate_recompress": lambda call, payload: (
        call.decompress_accumulate_recompress(0, payload, 1, 2)),
}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return bool(torch.equal(a, b))


def measure_case(case: Case, numel: int, repeats: int, kernels: list[str]) -> list[dict[str, Any]]:
    inputs = [gradient_like(2 * numel, seed=rank) for rank in range(2)]
    records: list[dict[str, Any]] = []
    reference: dict[str, torch.Tensor] = {}
    for choice in kernels:
        with kernels_env(choice):
            call, peer = make_calls(case, inputs)
            work = call.work.clone()
            payload = peer.compress(0, 1).clone()  # what a leaf sends for chunk 0
            for op, fn in OPS.items():
                _reset(call, work)
                result = fn(call, payload).clone()  # warm-up (and JIT), checked below
                key = op
                if choice == kernels[0]:
                    reference[key] = result
                elif not _same_bits(result, reference[key]):
                    raise AssertionError(f"{case.label} {op}: {choice} differs from {kernels[0]}")
                best = float("inf")
                for _ in range(repeats):
                    _reset(call, work)
                    start = time.perf_counter()
                    fn(call, payload)
                    best = min(best, time.perf_counter() - start)
                chunk = call.chunk_bounds[1] - call.chunk_bounds[0]
                records.append({
                    "scheme": case.scheme, "options": dict(case.options), "op": op,
                    "kernels": choice, "numel": chunk, "time_ms": best * 1e3,
                    "mcoords_per_s": chunk / best / 1e6,
                })
    return records


def _numba_version() -> str | None:
    try:
        import numba
    except Exception:
        return None
    return str(numba.__version__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", default="both", choices=["both", "torch", "numba"])
    parser.add_argument("--schemes", default="", help="comma-separated scheme names (all: empty)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    kernels = ["torch", "numba"] if args.kernels == "both" else [args.kernels]
    wanted = {s for s in args.schemes.split(",") if s}
    cases = [c for c in CASES if not wanted or c.scheme in wanted]
    records: list[dict[str, Any]] = []
    print(f"{'scheme':<28} {'op':<34} " + " ".join(f"{k + ' M/s':>11}" for k in kernels))
    for case in cases:
        rows = measure_case(case, args.numel, args.repeats, kernels)
        records += rows
        for op in OPS:
            rates = [r["mcoords_per_s"] for r in rows if r["op"] == op]
            print(f"{case.label:<28} {op:<34} " + " ".join(f"{v:11.1f}" for v in rates),
                  flush=True)
    meta = {
        "device": device_name("cpu"), "torch": torch.__version__, "numba": _numba_version(),
        "python": platform.python_version(), "commit": git_commit("benchmarks"),
        "numel": args.numel, "repeats": args.repeats, "threads": 1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
