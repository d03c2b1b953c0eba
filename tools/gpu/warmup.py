"""Every Triton variant compiled and launched, and nothing compiled afterwards (tools/gpu_check.sh).

    python tools/gpu/warmup.py --out warmup.json

1. ``dqcoll.kernels.warm_up(cuda:0)``: the warm-up compiles (or loads from Triton's disk cache)
   and launches every variant of the DynamiQ kernels that it covers; timed, and the variants each
   kernel then holds are counted (the JIT functions' in-memory caches: what a process launched,
   whether compiled now or loaded from disk).
2. Collectives as training calls them: 2 and 3 ranks over the ``local`` transport on CUDA
   tensors, all-reduce (ring, butterfly), reduce-scatter and all-gather, dynamiq at several
   widths, fp32 / bf16 / fp16 inputs, lengths that are no multiple of anything and tiles that
   cut the chunks at odd row offsets. Every variant a kernel gains here is one a training step
   would compile mid-run (seconds each, possibly on some ranks only); they are listed by kernel
   with their specialisation keys, and the step fails when there is any.

The JSON report is rewritten after each part, so a run stopped in part 2 keeps part 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def _jit_functions() -> Iterator[tuple[str, Any]]:
    """(qualified name, JITFunction) of every Triton kernel in dqcoll's loaded modules."""
    from triton.runtime.jit import JITFunction

    seen: set[int] = set()
    for name, module in sorted(sys.modules.items()):
        if not name.startswith("dqcoll.") or module is None:
            continue
        for attr, value in sorted(vars(module).items()):
            fn = value
            while fn is not None and not isinstance(fn, JITFunction):
                fn = getattr(fn, "fn", None)  # autotuner / heuristics wrappers
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                yield f"{name}.{attr}", fn


def _cache_keys(fn: Any) -> list[str]:
    """The specialisation keys a JIT function holds compiled kernels for, on every device
    (Triton 3.2+: ``device_caches[device][0]``; earlier: ``cache[device]``)."""
    keys: list[str] = []
    caches = getattr(fn, "device_caches", None)
    if caches is not None:
        for entry in list(caches.values()):
            keys.extend(str(k) for k in entry[0])
    else:
        for cache in list(getattr(fn, "cache", {}).values()):
            keys.extend(str(k) for k in cache)
    return keys


def variants() -> dict[str, list[str]]:
    return {name: _cache_keys(fn) for name, fn in _jit_functions()}


def traffic(device: torch.device) -> list[str]:
    """Run the collectives of the module docstring; returns what ran."""
    import dqcoll
    from dqcoll.testing import run_local

    ran: list[str] = []
    for world_size in (2, 3):
        def body(comm: Any, world_size: int = world_size) -> None:
            n, rank = comm.world_size, comm.rank
            for numel in (4096 * 3 + 5, 100_003):
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    for bits in (3.0, 5.0, 8.0):
                        for tile in (0, 4096 + 16 * 3):
                            g = torch.Generator().manual_seed(rank * 7 + numel)
                            x = torch.randn(numel, generator=g).to(device=device, dtype=dtype)
                            kw = dict(scheme="dynamiq", bits=bits, tile_nbytes=tile, seed=1,
                                      step=0)
                            for algorithm in ("ring", "butterfly"):
                                dqcoll.allreduce(x.clone(), algorithm=algorithm, **kw)
                            m = numel - numel % n
                            out = torch.empty(m // n, device=device, dtype=dtype)
                            dqcoll.reduce_scatter(x[:m].clone(), out, **kw)
                            gathered = torch.empty(n * numel, device=device, dtype=dtype)
                            dqcoll.all_gather(x, gathered, **kw)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        run_local(world_size, body, device=device)
        ran.append(f"{world_size} ranks: allreduce ring/butterfly, reduce_scatter, all_gather; "
                   "dynamiq 3/5/8 bits; fp32/bf16/fp16; 12293 and 100003 coordinates; "
                   "untiled and 4144-byte tiles")
    return ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip-traffic", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"ok": False}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")

    import triton

    import dqcoll.kernels

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    report.update(device=torch.cuda.get_device_name(device), triton=triton.__version__,
                  torch=torch.__version__)
    start = time.perf_counter()
    dqcoll.kernels.warm_up(device)
    torch.cuda.synchronize(device)
    report["warm_up_s"] = round(time.perf_counter() - start, 2)
    warmed = variants()
    report["variants_after_warm_up"] = {k: len(v) for k, v in warmed.items() if v}
    report["variants_total"] = sum(len(v) for v in warmed.values())
    print(f"warm-up: {report['variants_total']} variants in {report['warm_up_s']} s", flush=True)
    save()
    if args.skip_traffic:
        report["ok"] = report["variants_total"] > 0
        save()
        return 0 if report["ok"] else 1

    start = time.perf_counter()
    report["traffic"] = traffic(device)
    report["traffic_s"] = round(time.perf_counter() - start, 2)
    after = variants()
    new = {name: sorted(set(keys) - set(warmed.get(name, []))) for name, keys in after.items()}
    new = {name: keys for name, keys in new.items() if keys}
    report["compiled_after_warm_up"] = {name: len(keys) for name, keys in new.items()}
    report["compiled_after_warm_up_keys"] = {name: [k[:400] for k in keys[:10]]
                                             for name, keys in new.items()}
    count = sum(len(keys) for keys in new.values())
    report["ok"] = report["variants_total"] > 0 and count == 0
    print(f"traffic: {report['traffic_s']} s, {count} variants compiled after the warm-up",
          flush=True)
    for name, keys in new.items():
        print(f"  {name}: {len(keys)} new, e.g. {keys[0][:300]}", flush=True)
    save()
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
