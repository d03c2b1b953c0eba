"""Accuracy of every scheme on the same gradients: real all-reduces, measured vNMSE and wire bits.

The measurement behind ``python -m dqcoll_lab eval`` and ``tools/make_accuracy_docs.py``. For
each gradient source (:mod:`.sources`) x algorithm x scheme, :func:`evaluate_source` runs the
all-reduce for real: ``n`` ranks as threads over the ``local`` transport
(:func:`dqcoll.testing.run_local`), the real codecs and the real schedules. Reported per row
(:class:`EvalRow`):

* ``vnmse``: ``||X̂ - X||² / ||X||²`` with ``X`` the fp64 sum of the ranks' inputs (rank 0's
  result; summed over ``repeats`` calls with different random numbers before dividing);
* ``wire_bits``: bits per coordinate actually sent, from the transport's byte counters averaged
  over ranks (payloads, statistics all-reduces and the argument check), normalised by the
  ``2 (n-1)/n`` coordinates per rank of a bandwidth-optimal all-reduce, so it compares directly
  with a scheme's declared ``bits_per_coord``;
* ``identical``: whether every rank ended with the same bits (it must).

:func:`bits_needed` answers the other question, *how many bits does each scheme need for
vNMSE <= target*: a fixed-format family (:data:`FAMILIES`: MX 4/6/8, int blocks 4/8, top-k
densities, ...) reports its cheapest member that meets the target; ``dynamiq`` reports what
``target_vnmse=`` spent (second of two calls on one communicator, so the ranks' correlation is
measured) and the smallest fixed budget that meets the target (bisection to ``resolution`` bits;
raw 16-bit super-groups allowed, as by default).

Scheme specs are ``name[:key=value[;key=value]]`` (:func:`parse_scheme_spec`: the runtime's
:mod:`dqcoll.schemes.choice`, with DynamiQ's research knobs accepted); :func:`expand_bits`
expands every scheme that takes a ``bits`` option into one entry per budget (a spec that sets
``bits`` itself is kept as is).

Rejected: a pure simulator here (the simulator lives in the topology package and scales to
thousands of virtual ranks; this module runs the collective itself, so what it reports is what a
user's job would get, byte counts included).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from dqcoll import schemes as scheme_registry
from dqcoll.api import allreduce
from dqcoll.schemes.choice import SchemeChoice
from dqcoll.schemes.choice import parse_scheme_spec as parse_runtime_spec
from dqcoll.testing import run_local

from ..dynamiq import scheme_spec
from .sources import GradientSource, make_source

__all__ = [
    "DEFAULT_SCHEMES",
    "FAMILIES",
    "EvalRow",
    "NeededRow",
    "SchemeChoice",
    "bits_needed",
    "evaluate",
    "evaluate_source",
    "expand_bits",
    "format_needed",
    "format_table",
    "parse_scheme_spec",
    "plot_rows",
    "write_csv",
    "write_json",
]

DEFAULT_SCHEMES = ("dynamiq", "bf16", "mxfp8", "mxfp8:scale=global", "mxfp6", "mxfp4",
                   "int8_block", "int4_block", "thc", "global_qsgd", "topk_block")


@dataclasses.dataclass(frozen=True)
class EvalRow:
    source: str
    world_size: int
    numel: int
    algorithm: str
    scheme: str
    declared_bits: float | None
    wire_bits: float
    vnmse: float
    identical: bool
    time_s: float


def parse_scheme_spec(text: str) -> SchemeChoice:
    """The runtime's scheme spec, DynamiQ's research knobs accepted (folded into a registered
    format by :func:`dqcoll_lab.dynamiq.scheme_spec`)."""
    return parse_runtime_spec(scheme_spec(text))


def expand_bits(choices: Sequence[SchemeChoice], bits: Sequence[float]) -> list[SchemeChoice]:
    """One entry per bit budget for each scheme that takes ``bits`` and does not set it."""
    out: list[SchemeChoice] = []
    for choice in choices:
        takes_bits = "bits" in scheme_registry.spec(choice.name).options
        if not bits or not takes_bits or any(k == "bits" for k, _ in choice.options):
            out.append(choice)
            continue
        for b in bits:
            value = int(b) if float(b).is_integer() else b
            out.append(SchemeChoice(choice.name, (("bits", value), *choice.options)))
    return out


def _run_rank(comm, inputs, choice, algorithm, repeats):  # type: ignore[no-untyped-def]
    comm.counters.reset()
    outs = []
    for step in range(repeats):
        x = inputs[comm.rank].clone()
        allreduce(x, scheme=choice.name, algorithm=algorithm, step=step, **dict(choice.options))
        outs.append(x)
    return outs, comm.counters["bytes_sent"]


def evaluate_source(
    source: GradientSource,
    choices: Sequence[SchemeChoice],
    algorithms: Sequence[str],
    *,
    repeats: int = 1,
    progress: Any = None,
) -> list[EvalRow]:
    """Rows for one source (its world size) over every scheme and algorithm."""
    n = source.world_size
    inputs = source.tensors()
    exact = source.exact_sum()
    norm2 = float(exact.square().sum())
    rows = []
    for algorithm in algorithms:
        for choice in choices:
            start = time.perf_counter()
            results = run_local(n, _run_rank, inputs, choice, algorithm, repeats)
            elapsed = time.perf_counter() - start
            first = results[0][0]
            identical = all(torch.equal(a, b) for outs, _ in results[1:]
                            for a, b in zip(outs, first, strict=True))
            err2 = sum(float((out.double() - exact).square().sum()) for out in first)
            vn = err2 / (repeats * norm2) if norm2 > 0 else (0.0 if err2 == 0 else float("inf"))
            sent = sum(nbytes for _, nbytes in results) / n / repeats
            per_rank = 2 * (n - 1) / n * source.numel
            wire_bits = 8.0 * sent / per_rank if per_rank else 0.0
            obj = scheme_registry.get(choice.name, **dict(choice.options))
            declared = obj.spec.bits_per_coord
            if declared is None and "bits" in dict(choice.options):
                declared = float(dict(choice.options)["bits"])
            row = EvalRow(source.name, n, source.numel, algorithm, choice.label, declared,
                          wire_bits, vn, identical, elapsed)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def evaluate(
    sources: Sequence[str],
    choices: Sequence[SchemeChoice],
    algorithms: Sequence[str],
    world_sizes: Sequence[int],
    *,
    numel: int | None = None,
    seed: int = 0,
    repeats: int = 1,
    progress: Any = None,
) -> list[EvalRow]:
    rows: list[EvalRow] = []
    for spec in sources:
        for n in world_sizes:
            source = make_source(spec, world_size=n, numel=numel, seed=seed)
            rows += evaluate_source(source, choices, algorithms, repeats=repeats,
                                    progress=progress)
    return rows


# Families of fixed-format schemes, cheapest first: "bits needed" is the first member that meets
# the target.
FAMILIES: dict[str, tuple[str, ...]] = {
    "mx": ("mxfp4", "mxfp6", "mxfp8"),
    "mx (global scale)": ("mxfp4:scale=global", "mxfp6:scale=global", "mxfp8:scale=global"),
    "int blocks": ("int4_block", "int8_block"),
    "thc": ("thc",),
    "global_qsgd": ("global_qsgd",),
    "topk_block": ("topk_block:density=0.1", "topk_block:density=0.25", "topk_block:density=0.5"),
    "bf16": ("bf16",),
}


@dataclasses.dataclass(frozen=True)
class NeededRow:
    """The cheapest way a scheme (family) meets a vNMSE target on one source and schedule."""

    source: str
    world_size: int
    algorithm: str
    target: float
    family: str
    choice: str  # the member or setting that met the target ("" if none did)
    wire_bits: float  # what it sent (nan if none met the target)
    vnmse: float
    note: str = ""


def _measure(source: GradientSource, algorithm: str, choice: SchemeChoice,
             calls: int = 1) -> tuple[float, float]:
    """(vNMSE, wire bits) of the last of ``calls`` all-reduces on one communicator."""
    n = source.world_size
    inputs = source.tensors()
    exact = source.exact_sum()

    def body(comm):  # type: ignore[no-untyped-def]
        for step in range(calls):
            comm.counters.reset()
            x = inputs[comm.rank].clone()
            allreduce(x, scheme=choice.name, algorithm=algorithm, step=step,
                      **dict(choice.options))
        return x, comm.counters["bytes_sent"]

    results = run_local(n, body)
    norm2 = float(exact.square().sum())
    err2 = float((results[0][0].double() - exact).square().sum())
    sent = sum(nbytes for _, nbytes in results) / n
    return err2 / norm2 if norm2 > 0 else 0.0, 8.0 * sent / (2 * (n - 1) / n * source.numel)


def bits_needed(
    source: GradientSource,
    algorithm: str,
    target: float,
    *,
    families: dict[str, tuple[str, ...]] | None = None,
    resolution: float = 0.1,
) -> list[NeededRow]:
    """Per scheme family, the bits needed for vNMSE <= ``target`` (see the module docstring)."""
    rows = []

    def row(family: str, choice: str, bits: float, error: float, note: str = "") -> NeededRow:
        return NeededRow(source.name, source.world_size, algorithm, target, family, choice, bits,
                         error, note)

    error, bits = _measure(source, algorithm, SchemeChoice("dynamiq", (("target_vnmse", target),)),
                           calls=2)
    rows.append(row("dynamiq target_vnmse", f"target_vnmse={target:g}", bits, error,
                    "met" if error <= target else f"x{error / target:.2f} of target"))
    lo, hi = 2.82, 16.9  # every super-group at 2 bits .. raw 16-bit (with statistics)
    error_hi, bits_hi = _measure(source, algorithm,
                                 SchemeChoice("dynamiq", (("bits", hi),)))
    if error_hi > target:
        rows.append(row("dynamiq bits", "", float("nan"), error_hi, "not met at 16.9 bits"))
    else:
        best = (hi, bits_hi, error_hi)
        while hi - lo > resolution:
            mid = round(0.5 * (lo + hi), 4)
            error, bits = _measure(source, algorithm,
                                   SchemeChoice("dynamiq", (("bits", mid),)))
            if error <= target:
                hi, best = mid, (mid, bits, error)
            else:
                lo = mid
        rows.append(row("dynamiq bits", f"bits={best[0]:g}", best[1], best[2]))
    for family, members in (families or FAMILIES).items():
        for member in members:
            choice = parse_scheme_spec(member)
            error, bits = _measure(source, algorithm, choice)
            if error <= target:
                rows.append(row(family, choice.label, bits, error))
                break
        else:
            rows.append(row(family, "", float("nan"), error,
                            f"not met (best {members[-1]}: {error:.2e})"))
    return rows


def format_needed(rows: Sequence[NeededRow]) -> str:
    header = (f"{'source':<24}{'n':>3} {'algorithm':<10}{'target':>8}  {'scheme':<22}"
              f"{'choice':<26}{'bits':>7}{'vnmse':>11}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        bits = f"{r.wire_bits:.2f}" if r.wire_bits == r.wire_bits else "-"
        lines.append(f"{r.source[:23]:<24}{r.world_size:>3} {r.algorithm:<10}{r.target:>8.0e}  "
                     f"{r.family:<22}{r.choice[:25]:<26}{bits:>7}{r.vnmse:>11.3e}  {r.note}")
    return "\n".join(lines)


_COLUMNS = ("source", "world_size", "algorithm", "scheme", "declared_bits", "wire_bits", "vnmse",
            "identical", "time_s")


def format_table(rows: Sequence[EvalRow]) -> str:
    """A fixed-width table, one line per row (units in the header)."""
    header = (f"{'source':<28} {'n':>3} {'algorithm':<10} {'scheme':<28} {'bits(decl)':>10} "
              f"{'bits(wire)':>10} {'vnmse':>10} {'same':>5} {'time(s)':>8}")
    lines = [header, "-" * len(header)]
    for r in rows:
        declared = "-" if r.declared_bits is None else f"{r.declared_bits:.3g}"
        lines.append(
            f"{r.source[:28]:<28} {r.world_size:>3} {r.algorithm:<10} {r.scheme[:28]:<28} "
            f"{declared:>10} {r.wire_bits:>10.3f} {r.vnmse:>10.3g} "
            f"{'yes' if r.identical else 'NO':>5} {r.time_s:>8.2f}"
        )
    return "\n".join(lines)


def write_csv(rows: Sequence[EvalRow], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow((*_COLUMNS, "numel"))
        for r in rows:
            writer.writerow([getattr(r, c) for c in _COLUMNS] + [r.numel])


def write_json(rows: Sequence[EvalRow], path: str, meta: dict[str, Any] | None = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "rows": [dataclasses.asdict(r) for r in rows]}, f,
                  indent=1)


def plot_rows(rows: Sequence[EvalRow], path: str, *, title: str = "") -> None:
    """vNMSE vs world size, one line per scheme, one panel per (source, algorithm)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r.source, r.algorithm) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (source, algorithm) in zip(axes[0], panels, strict=True):
        subset = [r for r in rows if r.source == source and r.algorithm == algorithm]
        for scheme in dict.fromkeys(r.scheme for r in subset):
            points = sorted((r.world_size, r.vnmse) for r in subset if r.scheme == scheme)
            ax.plot([p[0] for p in points], [max(p[1], 1e-12) for p in points], marker="o",
                    label=scheme)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("vNMSE")
        ax.set_title(f"{algorithm} — {source}"[:60], fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
