#!/usr/bin/env python3
"""The fault matrix of docs/reliability.md: every fault scenario, transport by transport, with the
error class each rank raised and how long it took.

Each scenario runs one 3-rank all-reduce (3000 fp32 coordinates, dynamiq, butterfly unless said)
in which rank 1 (rank 0 where said) misbehaves, with a fault timeout of ``--timeout-s`` seconds:

* ``local``: ranks as threads (``dqcoll.testing.run_local``, no abort on error, so a failed rank
  looks like a dead one to its peers);
* ``gloo``: three processes over ``torch.distributed`` gloo (``dqcoll.init``).

Prints a Markdown table (``--json`` for the raw reports). About 2 minutes on the 2-core dev VM.
Run: ``python tools/fault_matrix.py [--timeout-s 2] [--only kill,stall]``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

# The scenario code, shared by both transports: `comm` is the rank's communicator, `fault_s` the
# fault timeout. Returns nothing; fills `report` with the faulty call's outcome.
SCENARIOS = textwrap.dedent(r'''
import os, threading, time
import numpy as np
import torch
import dqcoll
from dqcoll.errors import DqcollError

NUMEL = 3000


def data(rank, numel=NUMEL):
    return torch.randn(numel, generator=torch.Generator().manual_seed(50 + rank))


def on_step(comm, label, action):
    original = comm.transport.exchange

    def exchange(sends, recvs, *, what):
        if label in what:
            sends = action(sends) or sends
        return original(sends, recvs, what=what)

    comm.transport.exchange = exchange


class Died(Exception):
    pass


def outcome(report, fn, buf=None):
    keep = buf.clone() if isinstance(buf, torch.Tensor) else None
    start = time.monotonic()
    try:
        fn()
        report["error"] = "ok"
    except DqcollError as exc:
        report["error"], report["message"] = type(exc).__name__, str(exc)[:300]
    except Died:
        report["error"] = "(the faulty rank)"
    except Exception as exc:
        report["error"], report["message"] = "raw " + type(exc).__name__, str(exc)[:300]
    report["elapsed_s"] = round(time.monotonic() - start, 3)
    if keep is not None:
        report["untouched"] = bool(torch.equal(buf, keep))
        report["finite"] = bool(torch.isfinite(buf).all())
        report["digest"] = float(buf.double().sum())


def run(scenario, comm, fault_s, report, process):
    rank = comm.rank
    buf = data(rank)
    call = lambda: dqcoll.allreduce(buf, algorithm="butterfly")  # noqa: E731
    if scenario == "kill":
        def die(sends):
            if rank == 1:
                if process:
                    os._exit(17)
                raise Died()
        on_step(comm, "reduce step 1", die)
    elif scenario in ("stall", "dead-reuse"):
        on_step(comm, "reduce step 1", lambda s: time.sleep(2 * fault_s) if rank == 1 else None)
    elif scenario == "never-calls":
        if rank == 1:
            time.sleep(2 * fault_s)
            report["error"] = "(the faulty rank)"
            return
    elif scenario == "mismatch":
        buf = data(rank, NUMEL + (rank == 1))
    elif scenario == "bad-input":
        buf = data(rank, 2 * NUMEL)[::2] if rank == 1 else buf
    elif scenario == "short-message":
        on_step(comm, "reduce step 0", lambda sends: [
            (p, t.view(-1)[: t.numel() // 2]) for p, t in sends] if rank == 1 else None)
        call = lambda: dqcoll.allreduce(buf, algorithm="ring")  # noqa: E731
    elif scenario == "corrupt-bytes":
        def flip(sends):
            if rank == 1:
                return [(p, t ^ 0x55) for p, t in sends]
        on_step(comm, "reduce step 0", flip)
        call = lambda: dqcoll.allreduce(buf, algorithm="ring")  # noqa: E731
    elif scenario == "different-collective":
        if rank != 0:
            out = torch.empty(comm.world_size * NUMEL)
            call = lambda: dqcoll.all_gather(buf, out)  # noqa: E731
    elif scenario == "unusable-buffer":
        if rank == 1:
            buf = np.ascontiguousarray(data(rank).numpy())[::-1]
    elif scenario == "unwritable-buffer":
        if rank == 1:
            buf = data(rank).requires_grad_()
    elif scenario == "nan":
        if rank == 1:
            buf[700] = float("nan")
    elif scenario == "huge-values":
        if rank == 0:
            buf[256:512] = torch.linspace(3e37, 6e37, 256)
    elif scenario == "two-threads":
        if rank == 0:
            second = {}
            def intruder():
                time.sleep(0.2)
                outcome(second, lambda: dqcoll.allreduce(data(0), comm=comm))
            thread = threading.Thread(target=intruder)
            thread.start()
        else:
            time.sleep(1.0)  # keeps rank 0's first call in flight
    elif scenario == "after-close":
        if rank == 1:
            comm.close()
    outcome(report, call, buf if isinstance(buf, torch.Tensor) else None)
    if scenario == "two-threads" and rank == 0:
        thread.join()
        report["first"] = dict(report)
        report.update(second)
    if scenario == "dead-reuse" and rank != 1:
        first = dict(report)
        outcome(report, lambda: dqcoll.allreduce(data(rank)))
        report["first"] = first
    if scenario == "nan":
        report["nan_at_700"] = bool(torch.isnan(buf[700]))
''')

_GLOO_MAIN = r'''
import json, os, sys, time, torch
import dqcoll
exec(compile(sys.argv[3], "scenarios", "exec"))
scenario, fault_s = sys.argv[1], float(sys.argv[2])
report = {}
if scenario == "missing-rank":
    outcome(report, lambda: dqcoll.init(backend="gloo", timeout_s=fault_s))
else:
    comm = dqcoll.init(backend="gloo")
    report["rank"] = comm.rank
    torch.distributed.barrier()
    comm.transport.timeout_s = fault_s
    run(scenario, comm, fault_s, report, True)
print("REPORT " + json.dumps(report), flush=True)
os._exit(0)
'''

ORDER = ("kill", "stall", "never-calls", "mismatch", "bad-input", "different-collective",
         "unusable-buffer", "unwritable-buffer", "short-message", "corrupt-bytes", "nan",
         "huge-values", "dead-reuse", "two-threads", "after-close", "missing-rank")
LOCAL_ONLY = ("two-threads", "after-close")
GLOO_ONLY = ("missing-rank",)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_gloo(scenario: str, fault_s: float, world_size: int = 3) -> dict[int, dict[str, Any]]:
    port = _free_port()
    ranks = [0, 1] if scenario == "missing-rank" else list(range(world_size))
    procs = {}
    for rank in ranks:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DQCOLL_TIMEOUT_S="60",
                   OMP_NUM_THREADS="1")
        procs[rank] = subprocess.Popen(
            [sys.executable, "-c", _GLOO_MAIN, scenario, str(fault_s), SCENARIOS], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reports: dict[int, dict[str, Any]] = {}
    for rank, p in procs.items():
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        reports[rank] = json.loads(lines[0][7:]) if lines else {"error": f"exit {p.returncode}",
                                                                 "stderr": err[-300:]}
        reports[rank]["exit"] = p.returncode
    return reports


def run_local_scenario(scenario: str, fault_s: float) -> dict[int, dict[str, Any]]:
    from dqcoll.testing import run_local

    namespace: dict[str, Any] = {}
    exec(compile(SCENARIOS, "scenarios", "exec"), namespace)

    def fn(comm: Any) -> dict[str, Any]:
        report: dict[str, Any] = {"rank": comm.rank}
        namespace["run"](scenario, comm, fault_s, report, False)
        return report

    results = run_local(3, fn, timeout_s=fault_s, return_exceptions=True)
    return {r: (res if isinstance(res, dict) else {"error": f"raised {type(res).__name__}"})
            for r, res in enumerate(results)}


def summarise(reports: dict[int, dict[str, Any]]) -> str:
    parts = []
    for rank, rep in sorted(reports.items()):
        text = rep.get("error", "?")
        if "elapsed_s" in rep and not text.startswith("("):
            text += f" {rep['elapsed_s']:.2f} s"
        if rep.get("exit") not in (None, 0):
            text += f" (exit {rep['exit']})"
        if "first" in rep:
            first = rep["first"]
            text = f"{first.get('error')} {first.get('elapsed_s', 0):.2f} s, then {text}"
        if text.startswith("ok") and "finite" in rep:
            text += " (finite)" if rep["finite"] else " (non-finite)"
        parts.append(f"r{rank}: {text}")
    digests = {repr(rep["digest"]) for rep in reports.values()
               if rep.get("error") == "ok" and "digest" in rep}
    if len(digests) > 1:
        parts.append("ranks DISAGREE")
    elif digests:
        parts.append("ranks agree")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-s", type=float, default=2.0)
    parser.add_argument("--only", default="", help="comma-separated scenarios")
    parser.add_argument("--json", default="", help="write the raw reports here")
    args = parser.parse_args(argv)
    chosen = [s for s in ORDER if not args.only or s in args.only.split(",")]
    raw: dict[str, dict[str, Any]] = {}
    print(f"| scenario | transport | outcome per rank (timeout {args.timeout_s:g} s) |")
    print("|---|---|---|")
    for scenario in chosen:
        for transport in ("local", "gloo"):
            if (transport == "gloo" and scenario in LOCAL_ONLY) or (
                    transport == "local" and scenario in GLOO_ONLY):
                continue
            if transport == "gloo":
                reports = run_gloo(scenario, args.timeout_s)
            else:
                reports = run_local_scenario(scenario, args.timeout_s)
            raw[f"{scenario}/{transport}"] = {str(k): v for k, v in reports.items()}
            print(f"| {scenario} | {transport} | {summarise(reports)} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
