#!/usr/bin/env python3
"""Error-targeted DynamiQ: does ``target_vnmse`` hit its target on gradients it was not fitted to?

One script for the whole evaluation of the error model (dqcoll/schemes/dynamiq/error_model.py):

1. **Crest fit** (the codec alone): single-shot error per width on eleven synthetic families of
   different within-group tails, relative to the Gaussian's ``EPSILON``; the least-squares slope
   of log(ratio) on log(crest / Gaussian crest) per width is ``CREST_EXPONENT``.
2. **Model runs**: for each source, algorithm and target, two all-reduces with
   ``target_vnmse=target`` on one communicator (8 ranks, threads over the ``local`` transport), as
   a training loop runs them, with the residual calibration off (``calibration=1,
   uncertainty=1``). The first call knows neither rho nor the crests; the second uses those the
   first measured. The second call's achieved / predicted vNMSE is the model's residual.
3. **Leave-one-source-out**, by family: for each held-out source, ``calibration`` = the
   geometric mean of the residuals of the sources *outside its family* (:data:`FAMILIES`: a
   source's relatives, e.g. the same model at another training stage or a part of the same
   gradient, leave with it) and ``uncertainty`` = their largest residual over it; the
   held-out source's cells are run again with those (two calls). These are the out-of-sample
   numbers; the README quotes their range.
4. **In sample**: the constants fitted on every source (what error_model.py ships) on every
   source.
5. **Sweep**: the smallest fixed budget (``bits=b, max_width=16``, same data and seed as the
   second call, bisection to 0.1 bit) whose achieved vNMSE meets the target; its bits are the
   run's measured ones.

6. **Full size** (``--full-check``, after the above): the issue's own setting, the whole 22.7 M
   coordinates of all-MiniLM-L6-v2 and its encoder layers (no sampling), with the calibration
   fitted on the non-MiniLM sources of the JSON written before; appended to both files.

Writes docs/target_vnmse.json (command, machine, commit, date, sizes) and docs/target_vnmse.md
(the command and the machine; it names the JSON file for the commit and the date). About 15
minutes on the 2-core dev VM; the ``minilm`` sources need the ``eval-models`` extra and are
left out (said so in the output) without it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

import dqcoll
from dqcoll.cli.provenance import git_commit
from dqcoll.errors import InvalidArgumentError
from dqcoll.metrics import vnmse
from dqcoll.schemes.dynamiq import error_model as em
from dqcoll.schemes.dynamiq.error_model import ErrorModel
from dqcoll.testing import run_local
from dqcoll_lab.dynamiq import scheme_options
from dqcoll_lab.eval.sources import make_source

# name -> (spec, numel or None for the source's own length)
SOURCES: dict[str, tuple[str, int | None]] = {
    "gaussian": ("gaussian", 1 << 18),
    "gaussian-shared": ("gaussian:shared=0.5", 1 << 18),
    # noise=torch: the stream docs/target_vnmse.md was measured with
    "lognormal-mixture": ("lognormal-mixture:supergroups=1024;noise=torch", None),
    "heavy-sparse": ("lognormal-mixture:supergroups=1024;dof=3;sparsity=0.5", None),
    "stdlib-lm-init": ("stdlib-lm:steps=0", None),
    "stdlib-lm": ("stdlib-lm", None),
    "stdlib-lm-words": ("stdlib-lm:steps=300;vocab=4096", None),
    "minilm": ("minilm:stride=32", None),
    "minilm-encoder": ("minilm:part=encoder;stride=16", None),
}
# sources that share data or model: held out together
FAMILIES = {"gaussian": "gaussian", "gaussian-shared": "gaussian",
            "lognormal-mixture": "lognormal", "heavy-sparse": "lognormal",
            "stdlib-lm-init": "stdlib-lm", "stdlib-lm": "stdlib-lm", "stdlib-lm-words": "stdlib-lm",
            "minilm": "minilm", "minilm-encoder": "minilm"}
OK_RATIO = (0.6, 1.1)  # the acceptance range for achieved / target (second calls)
OK_BITS = 0.5  # and for bits over the sweep's


# -- 1. crest fit -------------------------------------------------------------------------------


def crest_family(name: str, rows: int, g: torch.Generator) -> torch.Tensor:
    """fp32 [rows, 256] of one synthetic family (tools docstring)."""
    shape = (rows, 256)
    if name.startswith("t"):
        dof = int(name[1:])
        chi2 = (torch.randn(rows, 256, dof, generator=g) ** 2).sum(-1)
        return torch.randn(shape, generator=g) / torch.sqrt(chi2 / dof)
    if name == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        return -torch.sign(u) * torch.log1p(-2 * u.abs())
    if name.startswith("group-scales"):
        sigma = float(name.split("-")[-1])
        scale = torch.exp(sigma * torch.randn(rows, 16, 1, generator=g))
        return (torch.randn(rows, 16, 16, generator=g) * scale).reshape(shape)
    if name.startswith("spikes"):
        p = float(name.split("-")[-1])
        return torch.randn(shape, generator=g) * (1 + 5 * (torch.rand(shape, generator=g) < p))
    x = torch.randn(shape, generator=g)
    if name == "half-zero":
        x[:, 128:] = 0
    return x


def crest_fit(rows: int = 2048) -> dict[str, Any]:
    from dqcoll.kernels.codec import decode_torch, encode_torch
    from dqcoll.schemes.dynamiq.scheme import DynamiqScheme

    config = DynamiqScheme().config
    table = em.EPSILON[(config.levels, config.scales)]
    g = torch.Generator().manual_seed(1)
    families = ["gaussian", "t30", "t10", "t5", "t3", "laplace", "group-scales-0.5",
                "group-scales-1", "spikes-0.01", "spikes-0.05", "half-zero"]
    measured: dict[str, dict[str, Any]] = {}
    for name in families:
        x = crest_family(name, rows, g).float()
        x = (x - x.mean(1, keepdim=True)).contiguous()
        crest = em.measure_crests(x, torch.zeros(rows, dtype=torch.int64))[0]
        index = torch.arange(rows, dtype=torch.int64) * 256
        ratios = {}
        for width in sorted(table):
            decoded = decode_torch(encode_torch(x, width, index, 0, 8, 7, config), width, config)
            error = float((decoded.double() - x.double()).square().sum()
                          / x.double().square().sum())
            ratios[width] = error / table[width]
        measured[name] = {"crest": crest, "ratio": ratios}
    gauss = measured["gaussian"]["crest"]
    exponents = {}
    for width in sorted(table):
        xs = [math.log(m["crest"] / gauss) for m in measured.values()]
        ys = [math.log(m["ratio"][width]) for m in measured.values()]
        exponents[width] = sum(a * b for a, b in zip(xs, ys, strict=True)) / sum(a * a for a in xs)
    return {"rows": rows, "families": measured, "crest_gaussian": gauss, "exponents": exponents}


def source_shape(source) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Rank 0's centred super-groups: crest and single-shot error per width relative to
    ``EPSILON`` (reference codec, independent rounding), i.e. what the crest term corrects."""
    from dqcoll.kernels.codec import SUPER, decode_torch, encode_torch, stats_center_torch
    from dqcoll.schemes.dynamiq.scheme import DynamiqScheme

    config = DynamiqScheme().config
    table = em.EPSILON[(config.levels, config.scales)]
    x = source.rank_tensor(0)
    rows = -(-source.numel // SUPER)
    flat = torch.zeros(rows, SUPER)
    flat.view(-1)[: source.numel] = x
    valid = (source.numel - torch.arange(rows) * SUPER).clamp(max=SUPER)
    centred, _, norm2 = stats_center_torch(flat, valid)
    centred = centred[norm2 > 0].contiguous()
    crest = em.measure_crests(centred, torch.zeros(centred.shape[0], dtype=torch.int64))[0]
    index = torch.arange(centred.shape[0], dtype=torch.int64) * SUPER
    energy = float(centred.double().square().sum())
    ratios = {}
    for width in sorted(table):
        decoded = decode_torch(encode_torch(centred, width, index, 0, 8, 7, config), width,
                               config)
        ratios[width] = float((decoded.double() - centred.double()).square().sum()) / energy \
            / table[width]
    return {"crest": crest, "ratio": ratios,
            "predicted_ratio": {w: em.shape_factor(w, {0: crest}) for w in sorted(table)}}


# -- 2.-5. all-reduces --------------------------------------------------------------------------


def run(source, algorithm: str, seed: int, calls: int = 1, **options: Any  # type: ignore[no-untyped-def]
        ) -> list[dict[str, Any]]:
    """Per call of ``calls`` consecutive all-reduces (seeds seed, seed+1, ...) on one
    communicator: achieved vNMSE, bits (the busiest rank's wire bits per coordinate, normalised
    by 2(n-1)/n) and rank 0's ``last_info`` fields of the error model."""
    tensors = source.tensors()
    exact = source.exact_sum()

    def body(comm):  # type: ignore[no-untyped-def]
        out = []
        for call in range(calls):
            x = tensors[comm.rank].clone()
            comm.counters.reset()
            dqcoll.allreduce(x, algorithm=algorithm, seed=seed + call,
                             **scheme_options(**options))
            info = comm.last_info
            out.append((x, comm.counters["bytes_sent"],
                        {k: info.get(k) for k in ("predicted_vnmse", "predicted_vnmse_upper",
                                                  "rho", "target_met")}))
        return out

    results = run_local(source.world_size, body)
    n = source.world_size
    traffic = 2 * (n - 1) / n * source.numel
    return [{"achieved": vnmse(results[0][call][0], exact),
             "bits": max(r[call][1] for r in results) * 8 / traffic, **results[0][call][2]}
            for call in range(calls)]


def smallest_budget(source, algorithm: str, seed: int, target: float,  # type: ignore[no-untyped-def]
                    resolution: float) -> tuple[float, float]:
    """(bits on the wire, achieved vNMSE) of the smallest fixed budget ``bits=b, max_width=16``
    (bisection on ``b`` to ``resolution``) whose achieved vNMSE meets ``target``. The bits are
    the run's measured ones (as for target mode): budgets can go below 2-bit-everywhere when
    super-groups are zero (no record), and a budget too small to hold every non-zero
    super-group at 2 bits is exceeded (its run says so in bits)."""
    lo, hi = 2.25, 16.9  # the smallest budget dynamiq takes .. raw 16-bit everywhere
    result = run(source, algorithm, seed, bits=hi, max_width=16)[0]
    if result["achieved"] > target:
        return float("nan"), result["achieved"]
    best = result
    while hi - lo > resolution:
        mid = 0.5 * (lo + hi)
        result = run(source, algorithm, seed, bits=mid, max_width=16)[0]
        if result["achieved"] <= target:
            hi, best = mid, result
        else:
            lo = mid
    return best["bits"], best["achieved"]


def fit(residuals: list[float]) -> tuple[float, float]:
    """(calibration, uncertainty): the geometric mean of the residuals, and the factor from it
    to the largest."""
    central = math.exp(sum(math.log(r) for r in residuals) / len(residuals))
    return central, max(residuals) / central


def two_calls(source, algorithm: str, seed: int, target: float, calibration: float,  # type: ignore[no-untyped-def]
              uncertainty: float) -> dict[str, Any]:
    first, second = run(source, algorithm, seed, calls=2, target_vnmse=target,
                        error_model=ErrorModel(calibration=calibration, uncertainty=uncertainty))
    return {"first": first, "second": second, "first_ratio": first["achieved"] / target,
            "ratio": second["achieved"] / target}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--targets", type=float, nargs="+", default=[1e-2, 1e-3, 1e-4])
    parser.add_argument("--sources", nargs="+", default=list(SOURCES))
    parser.add_argument("--algorithms", nargs="+", default=["ring", "butterfly"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resolution", type=float, default=0.1)
    parser.add_argument("--json", default="docs/target_vnmse.json")
    parser.add_argument("--markdown", default="docs/target_vnmse.md")
    parser.add_argument("--full-check", action="store_true",
                        help="only step 6, appended to the JSON and markdown already written")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.full_check:
        return full_check(args, argv)
    started = time.time()
    crest = crest_fit()
    print("crest exponents:", {w: round(a, 2) for w, a in crest["exponents"].items()}, flush=True)
    sources, skipped = {}, []
    for name in args.sources:
        spec, numel = SOURCES.get(name, (name, None))
        try:
            sources[name] = (spec, make_source(spec, world_size=args.world_size, numel=numel,
                                               seed=args.seed))
        except InvalidArgumentError as exc:  # minilm without its package
            skipped.append({"source": name, "reason": str(exc)})
            print(f"skipped {name}: {exc}", flush=True)
    shapes = {name: source_shape(src) for name, (_, src) in sources.items()}
    cells = [(name, a, t) for name in sources for a in args.algorithms for t in args.targets]
    records: dict[tuple[str, str, float], dict[str, Any]] = {}
    for name, algorithm, target in cells:  # 2. the model, residual calibration off
        source = sources[name][1]
        model = two_calls(source, algorithm, args.seed, target, 1.0, 1.0)
        residual = model["second"]["achieved"] / model["second"]["predicted_vnmse"]
        records[(name, algorithm, target)] = {
            "source": name, "spec": sources[name][0], "numel": source.numel,
            "algorithm": algorithm, "target": target, "model": model, "residual": residual}
        print(f"{name:18s} {algorithm:9s} {target:.0e}: model x{model['first_ratio']:.2f} / "
              f"x{model['ratio']:.2f}, residual {residual:.3f}", flush=True)
    everything = fit([r["residual"] for r in records.values()])
    for name, algorithm, target in cells:  # 3.-5.
        record = records[(name, algorithm, target)]
        source = sources[name][1]
        family = FAMILIES.get(name, name)
        held_out = fit([r["residual"] for r in records.values()
                        if FAMILIES.get(r["source"], r["source"]) != family])
        record["loso_fit"] = held_out
        record["loso"] = two_calls(source, algorithm, args.seed, target, *held_out)
        record["in_sample"] = two_calls(source, algorithm, args.seed, target, *everything)
        sweep_bits, sweep_vnmse = smallest_budget(source, algorithm, args.seed + 1, target,
                                                  args.resolution)
        record["sweep_bits"], record["sweep_vnmse"] = sweep_bits, sweep_vnmse
        for part in ("loso", "in_sample"):
            record[part]["extra_bits"] = record[part]["second"]["bits"] - sweep_bits
        print(f"{name:18s} {algorithm:9s} {target:.0e}: held out x{record['loso']['ratio']:.2f} "
              f"{record['loso']['second']['bits']:.2f} bits (sweep {sweep_bits:.2f}); in sample "
              f"x{record['in_sample']['ratio']:.2f}", flush=True)
    meta = {"command": "python tools/target_eval.py " + " ".join(argv or sys.argv[1:]),
            "commit": git_commit("tools"), "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()} CPU (2-core dev VM), torch {torch.__version__}",
            "world_size": args.world_size, "elapsed_s": round(time.time() - started, 1),
            "fit_all_sources": {"calibration": everything[0], "uncertainty": everything[1]},
            "shipped": {"calibration": em.CALIBRATION, "uncertainty": em.UNCERTAINTY,
                        "crest_exponent": em.CREST_EXPONENT, "crest_gaussian": em.CREST_GAUSSIAN},
            "skipped": skipped}
    rows = list(records.values())
    result: dict[str, Any] = {"meta": meta, "crest_fit": crest, "shapes": shapes, "records": rows}
    previous = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {}
    text = render(meta, crest, rows, shapes, json_path=args.json)
    if "full_check" in previous:  # step 6 (its residual fit reads only non-MiniLM sources)
        result["full_check"] = previous["full_check"]
        text = text.rstrip() + "\n\n" + render_full(previous["full_check"], args.json)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.markdown).write_text(text)
    return 0


FULL_SPECS = {"minilm whole model": "minilm", "minilm encoder layers": "minilm:part=encoder"}


def full_check(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Step 6: the issue's setting at full size, calibrated without any MiniLM source."""
    data = json.loads(Path(args.json).read_text())
    fitted = fit([r["residual"] for r in data["records"] if not r["source"].startswith("minilm")])
    started = time.time()
    rows = []
    for name, spec in FULL_SPECS.items():
        try:
            source = make_source(spec, world_size=args.world_size, seed=args.seed)
        except InvalidArgumentError as exc:
            print(f"skipped {name}: {exc}", flush=True)
            continue
        for algorithm in args.algorithms:
            for target in args.targets:
                cell = two_calls(source, algorithm, args.seed, target, *fitted)
                sweep_bits, sweep_vnmse = smallest_budget(source, algorithm, args.seed + 1,
                                                          target, args.resolution)
                rows.append({"slice": name, "spec": spec, "numel": source.numel,
                             "algorithm": algorithm, "target": target, **cell,
                             "sweep_bits": sweep_bits, "sweep_vnmse": sweep_vnmse,
                             "extra_bits": cell["second"]["bits"] - sweep_bits})
                print(f"{name:22s} {algorithm:9s} {target:.0e}: x{cell['first_ratio']:.2f} / "
                      f"x{cell['ratio']:.2f} {cell['second']['bits']:.2f} bits (sweep "
                      f"{sweep_bits:.2f})", flush=True)
    data["full_check"] = {
        "command": "python tools/target_eval.py " + " ".join(argv or sys.argv[1:]),
        "commit": git_commit("tools"), "date": datetime.date.today().isoformat(),
        "elapsed_s": round(time.time() - started, 1),
        "calibration": fitted[0], "uncertainty": fitted[1], "rows": rows}
    Path(args.json).write_text(json.dumps(data, indent=1))
    text = Path(args.markdown).read_text()
    marker = "## The issue's setting at full size"
    text = text.split(marker)[0].rstrip() + "\n\n" + render_full(data["full_check"], args.json)
    Path(args.markdown).write_text(text)
    return 0


def render_full(check: dict[str, Any], json_path: str = "docs/target_vnmse.json") -> str:
    rows = check["rows"]
    extra = [r["extra_bits"] for r in rows] or [float("nan")]
    lines = [
        "## The issue's setting at full size",
        "",
        f"`{check['command'].strip()}` ({check['elapsed_s']} s; commit and date: "
        f"`full_check` of `{json_path}`): "
        "every coordinate of all-MiniLM-L6-v2's fine-tuning gradient (22 713 216) and of its "
        "encoder layers alone, 8 ranks each on its own mini-batch of 16 pairs, two calls, with "
        f"the calibration fitted on the seven non-MiniLM sources only ({check['calibration']:.3f}"
        f" / {check['uncertainty']:.3f}): out of sample for the whole MiniLM family. Achieved / "
        f"target, second calls: {_range([r['ratio'] for r in rows])}; first calls: "
        f"{_range([r['first_ratio'] for r in rows])}; bits over the sweep (as above): "
        f"{min(extra):+.2f} to {max(extra):+.2f}.",
        "",
        "| slice | coordinates | algorithm | target | first call: achieved / target | second "
        "call: achieved / target | bits | sweep bits | extra bits | target_met |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['slice']} | {r['numel']} | {r['algorithm']} | {r['target']:.0e} | "
            f"{r['first_ratio']:.2f} | {r['ratio']:.2f} | {r['second']['bits']:.2f} | "
            f"{r['sweep_bits']:.2f} | {r['extra_bits']:+.2f} | {r['second']['target_met']} |")
    return "\n".join(lines) + "\n"


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def render(meta: dict[str, Any], crest: dict[str, Any], rows: list[dict[str, Any]],
           shapes: dict[str, dict[str, Any]], json_path: str = "docs/target_vnmse.json") -> str:
    loso = [r["loso"]["ratio"] for r in rows]
    ok_ratio = sum(OK_RATIO[0] <= v <= OK_RATIO[1] for v in loso)
    ok_bits = sum(abs(r["loso"]["extra_bits"]) <= OK_BITS for r in rows
                  if r["sweep_bits"] == r["sweep_bits"])
    met = sum(bool(r["loso"]["second"]["target_met"]) for r in rows)
    met_true = sum(bool(r["loso"]["second"]["target_met"]) and r["loso"]["ratio"] <= 1.0
                   for r in rows)
    fit_all = meta["fit_all_sources"]
    lines = [
        "# Error-targeted DynamiQ (`target_vnmse`)",
        "",
        f"Generated by `{meta['command'].strip()}` ({meta['machine']}, {meta['elapsed_s']} s; "
        f"commit and date: `{json_path}`). {meta['world_size']} ranks "
        "over the `local` transport, two calls per cell on one communicator (seeds 0 and 1), as a "
        "training loop runs them: the first call knows neither the ranks' correlation rho nor the "
        "data's crests, the second uses those the first measured. `bits` is what the busiest rank "
        "put on the wire per coordinate (statistics included, normalised by 2(n-1)/n); `sweep` is "
        "the smallest fixed budget (`bits=b, max_width=16`, same data and seed as the second "
        "call, bisection to 0.1 bit) whose achieved vNMSE meets the target, with the bits that "
        "run measured (zero super-groups cost no record, so a budget can go below 2.8 bits).",
        "",
        "## Out of sample (leave one source out, with its family)",
        "",
        "For each held-out source the residual calibration is fitted only on the sources outside "
        "its family (calibration = geometric mean of their second calls' achieved / modelled "
        "vNMSE, uncertainty = their largest such ratio over it), and the held-out source's cells "
        "are run with it. Families leave together, so that no relative of the held-out source "
        "is in the fit: " + "; ".join(
            f"{f}: {', '.join(n for n in FAMILIES if FAMILIES[n] == f)}"
            for f in dict.fromkeys(FAMILIES.values())) + ". These are the numbers the README "
        "quotes.",
        "",
        f"Second call: achieved / target **{_range(loso)}** over {len(rows)} held-out cells; "
        f"within [{OK_RATIO[0]}, {OK_RATIO[1]}] in {ok_ratio} of {len(rows)}; bits within "
        f"{OK_BITS} of the sweep in {ok_bits} of {len(rows)}. `target_met` said True in {met} "
        f"cells, and the target was met in {met_true} of them. First call (neither rho nor "
        f"crests measured; `target_met` is False there): "
        f"{_range([r['loso']['first_ratio'] for r in rows])}.",
        "",
        "| held-out source | algorithm | target | calibration / uncertainty (fitted without it) | "
        "first call: achieved / target | achieved | achieved / target | predicted (upper) / "
        "target | target_met | bits | sweep bits | extra bits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["loso"]["second"]
        lines.append(
            f"| {r['source']} | {r['algorithm']} | {r['target']:.0e} | "
            f"{r['loso_fit'][0]:.3f} / {r['loso_fit'][1]:.3f} | {r['loso']['first_ratio']:.2f} | "
            f"{s['achieved']:.2e} | {r['loso']['ratio']:.2f} | "
            f"{s['predicted_vnmse_upper'] / r['target']:.2f} | {s['target_met']} | "
            f"{s['bits']:.2f} | {r['sweep_bits']:.2f} | {r['loso']['extra_bits']:+.2f} |")
    per_source: dict[str, list[float]] = {}
    for r in rows:
        per_source.setdefault(r["source"], []).append(r["loso"]["ratio"])
    lines += ["", "Per held-out source (second calls): " + "; ".join(
        f"{name} {_range(v)}" for name, v in per_source.items()) + ".", ""]
    ins = [r["in_sample"]["ratio"] for r in rows]
    lines += [
        "## In sample (not quoted)",
        "",
        f"The constants fitted on every source (calibration {fit_all['calibration']:.3f}, "
        f"uncertainty {fit_all['uncertainty']:.3f}; shipped in error_model.py as "
        f"CALIBRATION = {meta['shipped']['calibration']}, UNCERTAINTY = "
        f"{meta['shipped']['uncertainty']}) on the same sources: achieved / target "
        f"{_range(ins)} (second calls).",
        "",
        "| source | algorithm | target | model residual (achieved / modelled, calibration off) | "
        "first call: achieved / target | achieved / target | bits | extra bits |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['algorithm']} | {r['target']:.0e} | {r['residual']:.3f} | "
            f"{r['in_sample']['first_ratio']:.2f} | {r['in_sample']['ratio']:.2f} | "
            f"{r['in_sample']['second']['bits']:.2f} | {r['in_sample']['extra_bits']:+.2f} |")
    lines += [
        "",
        "## Crest fit (the codec alone)",
        "",
        f"Single-shot error per width relative to `EPSILON` (i.i.d. Gaussian) on {crest['rows']} "
        "super-groups of each synthetic family (reference codec, format 3), and the crest "
        "C = sum 16 max_g^2 / sum ||g||^2 over groups of 16. Fitted exponents "
        "(error ratio = (C / C_gaussian) ^ a): " + ", ".join(
            f"{w}: {a:.2f}" for w, a in crest["exponents"].items()) + ".",
        "",
        "| family | crest | " + " | ".join(f"{w} bits" for w in crest["exponents"]) + " |",
        "|---|---|" + "---|" * len(crest["exponents"]),
    ]
    for name, m in crest["families"].items():
        lines.append(f"| {name} | {m['crest']:.2f} | " + " | ".join(
            f"{m['ratio'][w]:.2f}" for w in crest["exponents"]) + " |")
    widths = list(crest["exponents"])
    lines += [
        "",
        "The sources' own shape (rank 0's centred gradient, every non-zero super-group): crest, "
        "and single-shot error per width relative to `EPSILON`, measured / predicted by the "
        "crest term.",
        "",
        "| source | numel | crest | " + " | ".join(f"{w} bits" for w in widths) + " |",
        "|---|---|---|" + "---|" * len(widths),
    ]
    numel = {r["source"]: r["numel"] for r in rows}
    for name, shape in shapes.items():
        lines.append(f"| {name} | {numel.get(name, '')} | {shape['crest']:.2f} | " + " | ".join(
            f"{shape['ratio'][w]:.2f} / {shape['predicted_ratio'][w]:.2f}" for w in widths)
            + " |")
    lines += ["", MODEL_TEXT, ""]
    if meta["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{s['source']} ({s['reason']})"
                                          for s in meta["skipped"]), ""]
    return "\n".join(lines) + "\n"


MODEL_TEXT = """## The model

dqcoll/schemes/dynamiq/error_model.py: predicted vNMSE = calibration * kappa * gamma *
sum_c w_c sum_s c_b s_b(C) eps_b F_s / (F (1 + (n-1) rho) + mean energy), where eps_b is the
single-shot error of width b on Gaussian coordinates (`EPSILON`), s_b(C) = (C_b / C_gaussian) ^ a_b
scales it to the data's crest C_b (energy-weighted 16 max^2 / ||g||^2 over groups of 16, measured
on the previous call's decoded aggregate among the super-groups sent at width b), c_2 = 1 +
0.2 log2 n (2-bit errors compound along a path), w_c = alpha_c (1 + (c-1) rho) / n the weight of
partial-sum size c (hop widths; summing to the schedule's growth H), gamma the gain of correlated
rounding per algorithm, rho the ranks' correlation measured after the previous call, kappa = 1
unless the DDP hook's monitor calibrates it. The allocation spends bits until the upper bound
(prediction x uncertainty) meets the target; `last_info["target_met"]` is True only then and only
once the crests are measured (not on a first call), `last_info["predicted_vnmse"]` is the central
prediction, `predicted_vnmse_upper` its upper bound; the DDP hook's monitored iterations add
`measured_vnmse` beside them.

Why both are measured: the codec's errors on Gaussian coordinates (`EPSILON`) alone under-predict
on real gradients. The encoder's gradients have a crest of ~8.9 against the Gaussian's 4.55
(table above), and the codec's single-shot error grows with it, to ~2x at 6-8 bits, the widths
that carry the error at tight targets (a 1.3-1.7x overshoot on all-MiniLM-L6-v2 without the
crests). One correlation for all super-groups over-predicts on the uncorrelated sparse rows
(the correlated dense rows raise the average; by up to 1.8x on the word-vocabulary LM), which
moves bits away from where they are needed. So the crest is measured per width and rho per
super-group from the previous call's decoded aggregate, with that call's own expected error
taken off. The first-call columns show what remains before anything is measured."""


if __name__ == "__main__":
    sys.exit(main())
