"""``dqcoll plan``: the topology this job found and the plan the planner makes for a few sizes,
with the predicted time of every alternative (:mod:`dqcoll.planner`).

Under a launcher (torchrun, ``tools/netns_cluster.py exec``: ``RANK`` in the environment) every
process is one rank of the job and rank 0 prints; otherwise ``-g N`` processes are started on this
machine over loopback. Every rank discovers the job (hosts from host names and network
namespaces, machines from boot ids), measures its links and kernels, and plans; rank 0 prints the
result and checks that every rank made the same plans.

    dqcoll plan -g 4 -b 1M -e 64M -f 4
    python -m dqcoll.cli.netns exec --hosts 2 --ranks-per-host 2 --rate 1gbit -- dqcoll plan
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from .local import parse_count, run_local_ranks

__all__ = ["main"]


def _sizes(args: argparse.Namespace) -> list[int]:
    sizes, n = [], args.begin
    while n <= args.end:
        sizes.append(n)
        n *= args.factor
    return sizes


def _plan_on(comm: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank: discover, measure, plan; rank 0 gets the report (None elsewhere)."""
    from .. import planner

    job = planner.discover_job(comm.transport)
    rates = planner.measure_rates(comm.transport, job, bits=args.bits)
    plans = planner.Planner(job, rates)
    made = [plans.plan(args.collective, n, args.dtype, scheme=args.scheme, bits=args.bits)
            for n in _sizes(args)]
    digest = torch.tensor([planner.fingerprint(p) for p in made], dtype=torch.int64)
    low, high = digest.clone(), digest.clone().neg_()
    comm.transport.allreduce(low, "max", what="plan check")
    comm.transport.allreduce(high, "max", what="plan check")
    same = bool(torch.equal(low, digest) and torch.equal(high.neg(), digest))
    if comm.rank != 0:
        return None
    return {"topology": plans.describe(), "job": {"hosts": [list(h) for h in job.hosts],
                                                  "machines": list(job.machines)},
            "identical_on_every_rank": same,
            "plans": [dict(p.as_dict(), nbytes=n) for p, n in zip(made, _sizes(args),
                                                                   strict=True)]}


def _print(report: dict[str, Any]) -> None:
    print(f"topology: {report['topology']}")
    print(f"plans identical on every rank: {'yes' if report['identical_on_every_rank'] else 'NO'}")
    for plan in report["plans"]:
        print(f"\n{plan['collective']} of {plan['nbytes']:,} B: {plan['label']} "
              f"({plan['reason']})")
        for label, us in plan["alternatives"]:
            mark = "*" if label == plan["label"] else " "
            print(f"  {mark} {label:<44} {us / 1e3:>10.2f} ms predicted")


def _local_rank(rank: int, world_size: int, port: int, args: argparse.Namespace,
                out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import dqcoll

    comm = dqcoll.init("gloo", rank=rank, world_size=world_size, master_addr="127.0.0.1",
                       master_port=port)
    report = _plan_on(comm, args)
    if rank == 0:
        out.put(report)
    comm.barrier()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dqcoll plan", description=__doc__.split("\n")[0])
    parser.add_argument("-g", "--world-size", type=int, default=4,
                        help="ranks to start on this machine (without a launcher)")
    parser.add_argument("-b", "--begin", type=parse_count, default=1 << 20)
    parser.add_argument("-e", "--end", type=parse_count, default=64 << 20)
    parser.add_argument("-f", "--factor", type=int, default=8)
    parser.add_argument("--collective", default="allreduce",
                        choices=("allreduce", "reduce_scatter", "all_gather"))
    parser.add_argument("--scheme", default="auto")
    parser.add_argument("--bits", type=float, default=5.0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", default="", help="write the report here too")
    args = parser.parse_args(argv)
    if args.factor < 2 or args.begin <= 0 or args.end < args.begin:
        parser.error("need 0 < begin <= end and factor >= 2")
    if "RANK" in os.environ:
        import dqcoll

        comm = dqcoll.init("gloo")
        report = _plan_on(comm, args)
        comm.barrier()
    else:
        report = run_local_ranks(_local_rank, args.world_size, args, what="plan")
    if report is None:
        return 0
    _print(report)
    if args.json:
        from .provenance import device_name, git_commit

        report["provenance"] = {"commit": git_commit(), "device": device_name("cpu"),
                                "command": " ".join(sys.argv)}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0 if report["identical_on_every_rank"] else 1


if __name__ == "__main__":
    sys.exit(main())
