"""``dqcoll simulate``: what one configuration would do at a scale you do not have.

Prints the cost model's predicted time on a topology, the speed-up over an uncompressed
NCCL-style ring (fp32, the same topology), and the vNMSE of the real codecs run over the schedule
for ``--world-size`` virtual workers on a gradient source::

    dqcoll simulate --world-size 8192 --algorithm ring --scheme dynamiq --bits 8.5 \\
      --source 'lognormal-mixture:weights=0.79,0.21;mu=-3.99,-16.41;sigma=1.22,4.63;\\
      supergroups=8192'   (one argument, without the line break)

``--scheme`` is a scheme spec, ``name[:key=value;...]`` (``dynamiq``, ``mxfp8``,
``mxfp8:scale=global``, ``none``); ``--bits`` is DynamiQ's budget. The paper's configuration and
DynamiQ's research knobs: ``python -m dqcoll_lab simulate`` (the same arguments).
``--algorithm hier:ring/butterfly`` simulates a hierarchical plan (uncompressed ring inside hosts,
the scheme across them). The default topology is hosts of 8 GPUs behind 100 Gb/s NICs
(``N/8 x 8 @ 100``; one host if N < 8). The flat algorithms are simulated from their closed-form
reduce plans (:mod:`dqcoll.topology.steps`), so any ``n`` runs in the memory ``--memory-mb``
bounds (:mod:`dqcoll.topology.simulator`); the cost model still builds the schedule, so above
:data:`PRICE_TRANSFERS` transfers it is skipped unless ``--price`` is given. The JSON report
has the wall time, the peak RSS and the machine's load. Ctrl-C stops the simulation and prints
the vNMSE of the chunks done so far.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

from ..errors import DqcollError
from ..topology.detect import parse_topology
from ..topology.graph import Topology
from .bench import parse_size
from .progress import ProgressBar
from .provenance import git_commit

__all__ = ["main"]

DEFAULT_SOURCE = "lognormal-mixture:supergroups=4096"
# Above this many transfers (2 n (n - 1) for ring, butterfly and direct: n > ~1450) the cost
# model's schedule object takes gigabytes and minutes; the price is then skipped unless --price.
PRICE_TRANSFERS = 1 << 22


def default_topology(world_size: int) -> Topology:
    if world_size >= 8 and world_size % 8 == 0:
        return Topology.cluster(world_size // 8, 8, inter_gbps=100.0)
    return Topology.cluster(1, world_size, inter_gbps=100.0)



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dqcoll simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", "-n", type=int, required=True)
    p.add_argument("--algorithm", default="butterfly",
                   help="ring | butterfly | direct | hier:<intra>/<inter> (default butterfly)")
    p.add_argument("--scheme", default="dynamiq",
                   help="scheme spec name[:key=value;...]: dynamiq, mxfp8, mxfp8:scale=global, "
                   "none (default dynamiq)")
    p.add_argument("--bits", type=float, default=5.0, help="DynamiQ's bit budget (default 5)")
    p.add_argument("--source", default=DEFAULT_SOURCE, help="gradient source spec "
                   "(dqcoll.topology.sources), default %(default)s")
    p.add_argument("--numel", type=int, default=None, help="coordinates per rank "
                   "(default: the source's own length)")
    p.add_argument("--topology", default=None, help="JSON file, 'detect', 'NxG[-intra]@GBPS', "
                   "'host:N' or 'flat:N@GBPS' (default: N/8 hosts x 8 GPUs @ 100 Gb/s)")
    p.add_argument("--nbytes", type=parse_size, default=None,
                   help="message size to price (default: the simulated buffer in fp32)")
    p.add_argument("--tiles", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-mb", type=float, default=None,
                   help="what the simulation holds at once (default: a quarter of this machine's "
                   "memory, at most 4096 MB)")
    p.add_argument("--no-error", action="store_true", help="price only, skip the simulation")
    price = p.add_mutually_exclusive_group()
    price.add_argument("--price", action="store_true",
                       help=f"price even above {PRICE_TRANSFERS} transfers (slow, "
                       "memory-hungry)")
    price.add_argument("--no-price", action="store_true", help="skip the cost model")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def _load() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..schemes.choice import parse_scheme_spec
    from ..topology.cost import price_allreduce
    from ..topology.simulator import (
        default_memory_mb,
        peak_rss_bytes,
        simulate,
        simulate_hierarchical,
    )
    from ..topology.sources import make_source
    from ..topology.steps import placed_plan
    from ..topology.tuning import Candidate, _hier_plan, predict_us

    wall_start = time.perf_counter()
    load_start = _load()
    n = args.world_size
    started_at = git_commit()  # the code that runs is the code at start
    topology = (parse_topology(args.topology, world_size=n) if args.topology
                else default_topology(n))
    if topology.world_size != n:
        print(f"dqcoll simulate: topology {topology.name!r} has {topology.world_size} ranks, "
              f"--world-size is {n}", file=sys.stderr)
        return 2
    choice = parse_scheme_spec(args.scheme)
    scheme, options = choice.name, dict(choice.options)
    bits = (float(options.pop("bits", args.bits)) if scheme == "dynamiq" else None)
    candidate = Candidate(args.algorithm, scheme, bits, args.tiles)
    data = make_source(args.source, world_size=n, numel=args.numel, seed=args.seed)
    nbytes = args.nbytes if args.nbytes is not None else data.numel * 4
    memory_mb = default_memory_mb() if args.memory_mb is None else args.memory_mb
    t0 = time.perf_counter()
    predicted_us = baseline_us = None
    price_skipped = None
    transfers = 2 * n * (n - 1)
    if args.no_price:
        price_skipped = "--no-price"
    elif transfers > PRICE_TRANSFERS and not args.price:
        price_skipped = (f"{transfers} transfers: the cost model's schedule would take minutes "
                         f"and gigabytes (--price to price anyway)")
    else:
        try:
            predicted_us = predict_us(candidate, topology, nbytes)
            baseline_us = price_allreduce("ring", topology, nbytes, scheme="none").total_us
        except DqcollError as exc:
            price_skipped = f"the cost model cannot price it: {exc}"
    price_s = time.perf_counter() - t0
    result = None
    if not args.no_error:
        bar = ProgressBar(f"simulate n={n}", every=0.02)  # stderr: --json output stays clean
        def progress(done: int, total: int) -> None:
            bar(done, total, f"peak RSS {peak_rss_bytes() / 2**30:.2f} GB")

        if candidate.is_hierarchical:
            result = simulate_hierarchical(_hier_plan(candidate, topology), data, seed=args.seed,
                                           memory_mb=memory_mb, progress=progress)
        else:
            result = simulate(placed_plan(args.algorithm, topology), data, scheme=scheme,
                              bits=bits, seed=args.seed, memory_mb=memory_mb, progress=progress,
                              **options)
        if bar:
            bar.close()
    report = {
        "world_size": n,
        "topology": topology.name,
        "algorithm": args.algorithm,
        "scheme": args.scheme,
        "scheme_name": scheme,
        "scheme_options": options,
        "bits": bits,
        "tiles": args.tiles,
        "source": args.source,
        "seed": args.seed,
        "numel": data.numel,
        "nbytes": nbytes,
        "predicted_us": predicted_us,
        "ring_none_us": baseline_us,
        "speedup_vs_ring_none": (baseline_us / predicted_us
                                 if predicted_us and baseline_us is not None else None),
        "price_skipped": price_skipped,
        "vnmse": None if result is None else result.vnmse,
        "bits_used": None if result is None else result.bits_used,
        "complete": None if result is None else result.complete,
        "chunks_done": None if result is None else result.chunks_done,
        "chunks_total": None if result is None else result.chunks_total,
        "simulate_s": None if result is None else result.seconds,
        "pass1_s": None if result is None else result.pass1_s,
        "layout_s": None if result is None else result.layout_s,
        "pass2_s": None if result is None else result.pass2_s,
        "batches": None if result is None else result.batches,
        "memory_mb": memory_mb,
        "price_s": price_s,
        "wall_s": time.perf_counter() - wall_start,
        "cpu_s": time.process_time(),
        "peak_rss_mb": peak_rss_bytes() / 2**20,
        "load_average_start": load_start,
        "load_average_end": _load(),
        "cpus": os.cpu_count(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "command": "dqcoll simulate " + shlex.join(sys.argv[1:] if argv is None else argv),
        "commit": started_at,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(topology.describe())
    if predicted_us is not None and baseline_us is not None:
        print(f"{candidate.label} on {n} ranks, {nbytes} B (fp32): predicted "
              f"{predicted_us:.1f} us; uncompressed ring {baseline_us:.1f} us; speed-up "
              f"{report['speedup_vs_ring_none']:.2f}x")
    else:
        print(f"{candidate.label} on {n} ranks, {nbytes} B (fp32): not priced ({price_skipped})")
    if result is not None:
        status = "" if result.complete else (
            f" (INTERRUPTED after {result.chunks_done}/{result.chunks_total} chunks)")
        used = f", {result.bits_used:.3f} bits/coord used" if result.bits_used else ""
        print(f"vNMSE {result.vnmse:.4e} on {args.source} ({data.numel} coords/rank{used}); "
              f"simulated in {result.seconds:.1f} s, peak RSS "
              f"{report['peak_rss_mb']:.0f} MB{status}")
    return 0
