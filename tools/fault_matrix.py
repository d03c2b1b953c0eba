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
    """Run ``action(sends)`` (it may return other sends) at the exchange whose label contains
    ``label``: plain exchanges and framed ones (dynamiq's payloads over gloo travel in frames
    whose first bytes the transport fills with the header; cutting or flipping a frame cuts or
    flips the payload)."""

    def wrap(original):
        def exchange(sends, recvs, *, what):
            if label in what:
                sends = action(sends) or sends
            return original(sends, recvs, what=what)
        return exchange

    comm.transport.exchange = wrap(comm.transport.exchange)
    if hasattr(comm.transport, "exchange_framed"):
        comm.transport.exchange_framed = wrap(comm.transport.exchange_framed)


class Died(Exception):
    pass


def outcome(report, fn, buf=None):
    dense = isinstance(buf, torch.Tensor) and buf.layout is torch.strided
    keep = buf.clone() if dense else None
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
    elif scenario == "seed-above-bit-62":  # thc hashes the whole seed: ranks used to diverge
        seed = 2**62 if rank == 1 else 0
        call = lambda: dqcoll.allreduce(buf, scheme="thc", seed=seed)  # noqa: E731
    elif scenario in ("step-2**63", "bits-2**1100"):
        bad = {"step": 2**63} if scenario == "step-2**63" else {"bits": 2**1100}
        kwargs = bad if rank == 1 else {}
        call = lambda: dqcoll.allreduce(buf, **kwargs)  # noqa: E731
    elif scenario == "sparse":
        if rank == 1:
            buf = torch.zeros(NUMEL).to_sparse()
    elif scenario.startswith("fp16-sum-90000-"):
        buf = torch.full((NUMEL,), 30000.0, dtype=torch.float16)
        scheme = scenario.rsplit("-", 1)[1]
        call = lambda: dqcoll.allreduce(buf, scheme=scheme)  # noqa: E731
    elif scenario == "none-1e-8-next-to-1e38":
        buf = torch.full((4096,), 1e-8 * (rank + 1))
        if rank == 0:
            buf[:256] = 1e38
        call = lambda: dqcoll.allreduce(buf, scheme="none")  # noqa: E731
    elif scenario == "async-timeout-wait":
        if rank == 1:
            time.sleep(2 * fault_s)
            report["error"] = "(the faulty rank)"
            return
        call = lambda: dqcoll.allreduce(buf, async_op=True).wait()  # noqa: E731
    elif scenario == "sync-async-order":  # rank 0: sync call first; the others: async first
        later = {}
        def second_call():
            time.sleep(0.2)
            if rank == 0:
                outcome(later, lambda: dqcoll.allreduce(data(rank), async_op=True,
                                                        comm=comm).wait(10))
            else:
                outcome(later, lambda: dqcoll.allreduce(data(rank), comm=comm))
        thread = threading.Thread(target=second_call)
        thread.start()
        if rank != 0:
            call = lambda: dqcoll.allreduce(buf, async_op=True, comm=comm).wait(10)  # noqa: E731
    elif scenario == "async-after-close":
        if rank == 1:
            comm.close()
            before = threading.active_count()
            handle = dqcoll.allreduce(buf, async_op=True)
            call = lambda: handle.wait(10)  # noqa: E731
            report["threads_started"] = threading.active_count() - before
    elif scenario == "kill-shrink":
        import signal
        def sigkill(sends):
            if rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
        on_step(comm, "reduce step 1", sigkill)
    outcome(report, call, buf if isinstance(buf, torch.Tensor) else None)
    if scenario == "sync-async-order":
        thread.join()
        report["first"] = dict(report)
        report.update(later)
    if scenario.startswith("fp16-sum") or scenario.startswith("none-1e-8"):
        exact = 90000.0 if scenario.startswith("fp16") else 6e-8
        tail = buf[256:].double() if scenario.startswith("none") else buf.double()
        report["value"] = float(tail.max())
        report["rel_err"] = abs(float(tail.min()) - exact) / exact if not scenario.startswith(
            "fp16") else None
    if scenario == "kill-shrink":
        first = dict(report)
        start = time.monotonic()
        try:
            comm = comm.shrink()
            report["shrink_s"] = round(time.monotonic() - start, 3)
            report["members"] = comm.members
            buf = data(rank)
            outcome(report, lambda: dqcoll.allreduce(buf, comm=comm), buf)
            exact = sum(data(r).double() for r in comm.members)
            report["vnmse"] = float(((buf.double() - exact).norm() / exact.norm()) ** 2)
        except DqcollError as exc:
            report["error"], report["message"] = type(exc).__name__, str(exc)[:300]
        report["first"] = first
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
elif scenario == "nan-timeout":
    outcome(report, lambda: dqcoll.init(backend="gloo", timeout_s=float("nan")))
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
         "huge-values", "dead-reuse", "two-threads", "after-close", "missing-rank",
         # issue 25
         "seed-above-bit-62", "step-2**63", "bits-2**1100", "sparse", "fp16-sum-90000-none",
         "fp16-sum-90000-dynamiq", "fp16-sum-90000-thc", "none-1e-8-next-to-1e38",
         "async-timeout-wait", "sync-async-order", "async-after-close", "nan-timeout",
         "kill-shrink")
LOCAL_ONLY = ("two-threads", "after-close", "sync-async-order", "async-after-close")
GLOO_ONLY = ("missing-rank", "nan-timeout", "kill-shrink")
WORLD_SIZE = {"kill-shrink": 4}  # one of 4 ranks SIGKILLed, as issue 25 asks


def _free_port() -> int:
    """A free port for a rendezvous on 127.0.0.1, outside the ephemeral range
    (:func:`dqcoll.cli.ports.rendezvous_port`)."""
    from dqcoll.cli.ports import rendezvous_port

    return rendezvous_port()


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
        if "value" in rep:
            text += f", max {rep['value']:.6g}"
            if rep.get("rel_err") is not None:
                text += f", rel. error {rep['rel_err']:.1e}"
        if "shrink_s" in rep:
            text += (f", after shrink() in {rep['shrink_s']:.2f} s to {rep.get('members')} "
                     f"(vNMSE {rep.get('vnmse', float('nan')):.4f})")
        if rep.get("threads_started"):
            text += f", {rep['threads_started']} thread(s) started"
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
                reports = run_gloo(scenario, args.timeout_s, WORLD_SIZE.get(scenario, 3))
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
