"""``dqcoll simulate``: what one configuration would do at a scale you do not have.

Prints the cost model's predicted time on a topology, the speed-up over an uncompressed
NCCL-style ring (fp32, the same topology), and the vNMSE of the real codecs run over the schedule
for ``--world-size`` virtual workers on a gradient source::

    dqcoll simulate --world-size 1024 --algorithm butterfly --scheme dynamiq --bits 6 \\
      --source 'lognormal-mixture:weights=0.79,0.21;mu=-3.99,-16.41;sigma=1.22,4.63;\\
      supergroups=4096'   (one argument, without the line break)

``--algorithm hier:ring/butterfly`` simulates a hierarchical plan (uncompressed ring inside hosts,
the scheme across them). The default topology is hosts of 8 GPUs behind 100 Gb/s NICs
(``N/8 x 8 @ 100``; one host if N < 8). Ctrl-C stops the simulation and prints the vNMSE of the
chunks done so far.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

from ..topology.detect import parse_topology
from ..topology.graph import Topology
from .bench import parse_size
from .progress import ProgressBar
from .provenance import git_commit

__all__ = ["main"]

DEFAULT_SOURCE = "lognormal-mixture:supergroups=4096"


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
    p.add_argument("--scheme", default="dynamiq", help="dynamiq | none (default dynamiq)")
    p.add_argument("--bits", type=float, default=5.0)
    p.add_argument("--source", default=DEFAULT_SOURCE, help="gradient source spec "
                   "(dqcoll.eval.sources), default %(default)s")
    p.add_argument("--numel", type=int, default=None, help="coordinates per rank "
                   "(default: the source's own length)")
    p.add_argument("--topology", default=None, help="JSON file, 'detect', 'NxG[-intra]@GBPS', "
                   "'host:N' or 'flat:N@GBPS' (default: N/8 hosts x 8 GPUs @ 100 Gb/s)")
    p.add_argument("--nbytes", type=parse_size, default=None,
                   help="message size to price (default: the simulated buffer in fp32)")
    p.add_argument("--tiles", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory-mb", type=float, default=512.0,
                   help="rows of all workers held at once (default %(default)s MB)")
    p.add_argument("--no-error", action="store_true", help="price only, skip the simulation")
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..eval.sources import make_source
    from ..topology.cost import price_allreduce
    from ..topology.placement import build_placed_schedule
    from ..topology.simulator import simulate, simulate_hierarchical
    from ..topology.tuning import Candidate, _hier_plan, predict_us

    n = args.world_size
    started_at = git_commit()  # the code that runs is the code at start
    topology = (parse_topology(args.topology, world_size=n) if args.topology
                else default_topology(n))
    if topology.world_size != n:
        print(f"dqcoll simulate: topology {topology.name!r} has {topology.world_size} ranks, "
              f"--world-size is {n}", file=sys.stderr)
        return 2
    bits = None if args.scheme == "none" else args.bits
    candidate = Candidate(args.algorithm, args.scheme, bits, args.tiles)
    data = make_source(args.source, world_size=n, numel=args.numel, seed=args.seed)
    nbytes = args.nbytes if args.nbytes is not None else data.numel * 4
    t0 = time.perf_counter()
    predicted_us = predict_us(candidate, topology, nbytes)
    baseline_us = price_allreduce("ring", topology, nbytes, scheme="none").total_us
    price_s = time.perf_counter() - t0
    result = None
    if not args.no_error:
        bar = ProgressBar(f"simulate n={n}")  # stderr: --json output stays clean
        progress = (lambda d, t: bar(d, t)) if bar else None
        if candidate.is_hierarchical:
            result = simulate_hierarchical(_hier_plan(candidate, topology), data, seed=args.seed,
                                           memory_mb=args.memory_mb, progress=progress)
        else:
            schedule = build_placed_schedule(args.algorithm, topology)
            result = simulate(schedule, data, scheme=args.scheme, bits=bits, seed=args.seed,
                              memory_mb=args.memory_mb, progress=progress)
        if bar:
            bar.close()
    report = {
        "world_size": n,
        "topology": topology.name,
        "algorithm": args.algorithm,
        "scheme": args.scheme,
        "bits": bits,
        "tiles": args.tiles,
        "source": args.source,
        "numel": data.numel,
        "nbytes": nbytes,
        "predicted_us": predicted_us,
        "ring_none_us": baseline_us,
        "speedup_vs_ring_none": baseline_us / predicted_us if predicted_us > 0 else None,
        "vnmse": None if result is None else result.vnmse,
        "bits_used": None if result is None else result.bits_used,
        "complete": None if result is None else result.complete,
        "chunks_done": None if result is None else result.chunks_done,
        "chunks_total": None if result is None else result.chunks_total,
        "simulate_s": None if result is None else result.seconds,
        "price_s": price_s,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "commit": started_at,
    }
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(topology.describe())
    print(f"{candidate.label} on {n} ranks, {nbytes} B (fp32): predicted "
          f"{predicted_us:.1f} us; uncompressed ring {baseline_us:.1f} us; speed-up "
          f"{report['speedup_vs_ring_none']:.2f}x")
    if result is not None:
        status = "" if result.complete else (
            f" (INTERRUPTED after {result.chunks_done}/{result.chunks_total} chunks)")
        used = f", {result.bits_used:.3f} bits/coord used" if result.bits_used else ""
        print(f"vNMSE {result.vnmse:.4e} on {args.source} ({data.numel} coords/rank{used}); "
              f"simulated in {result.seconds:.1f} s{status}")
    return 0
