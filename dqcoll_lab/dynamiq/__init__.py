"""DynamiQ's research formats and knobs, beside the runtime's ``dynamiq`` scheme.

The runtime's scheme takes the options a user sets and a format (a registered name or a
:class:`~dqcoll.schemes.dynamiq.DynamiqFormat`). Here are the rest, for comparisons and ablations
(docs/dense_gap.md, docs/allocation.md, the paper's Table 7):

* :data:`PAPER`, the DynamiQ paper's configuration (non-uniform levels, uint8 group scales,
  widths {2, 4, 8} by the paper's closed form, fp32 statistics), registered with the runtime as
  ``format="paper"`` when this package is imported;
* :func:`research_format`: a preset with :data:`RESEARCH_OPTIONS` applied, each overriding one
  format field (``levels``, ``scales``, ``widths``: ``"fixed"`` for 4 bits everywhere,
  ``width_set``, ``thresholds``: ``"auto"`` = measured where known, ``stats``, ``hop_widths``,
  ``max_width``, ``error_model``);
* :func:`scheme_options`: user options and knobs together, as the runtime's ``dynamiq`` options
  (the knobs folded into ``format``), for everything that takes scheme options
  (``dqcoll.allreduce(x, **scheme_options(stats="bf16"))``, the simulator, ``schemes.get``);
  :func:`research_scheme` builds the scheme from them;
* :func:`scheme_spec`: the same for a scheme spec string (``"dynamiq:bits=5;stats=fp32"`` ->
  ``"dynamiq:bits=5;format=dqcoll+stats=fp32"``, that format registered under the name that
  spells it), for the lab's commands (``python -m dqcoll_lab eval``, ``... simulate``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from dqcoll.errors import InvalidArgumentError
from dqcoll.kernels.codec import Levels, ProtoScales, Scales
from dqcoll.schemes.dynamiq import DynamiqFormat, DynamiqScheme, register_format
from dqcoll.schemes.dynamiq.allocation import (
    MEASURED_ERRORS,
    Allocation,
    cost_lookup,
    target_energy,
)
from dqcoll.schemes.dynamiq.error_model import predicted_vnmse
from dqcoll.schemes.dynamiq.options import (
    FORMATS,
    USER_OPTIONS,
    check_format,
    parse_enum,
    parse_flag,
)

from .allocation_paper import allocate_for_target_paper, allocate_widths_paper

__all__ = [
    "FIXED_WIDTH",
    "PAPER",
    "RESEARCH_OPTIONS",
    "FixedRule",
    "PaperRule",
    "format_name",
    "research_format",
    "research_scheme",
    "scheme_options",
    "scheme_spec",
]

RESEARCH_OPTIONS = ("levels", "scales", "widths", "width_set", "thresholds", "stats",
                    "hop_widths", "max_width", "error_model")
FIXED_WIDTH = 4  # widths="fixed"


@dataclasses.dataclass(frozen=True)
class PaperRule:
    """The paper's closed-form allocation (:mod:`.allocation_paper`)."""

    fixed_width: int | None = None

    def budget(self, norm2: torch.Tensor, numel: int, bits: float, *, scales: Scales,
               stats_bytes: int, max_width: int, energy_exponent: float) -> Allocation:
        return allocate_widths_paper(norm2, numel, bits, scales=scales, max_width=max_width,
                                     energy_exponent=energy_exponent, stats_bytes=stats_bytes)

    def target(self, norm2: torch.Tensor, mean_sum: torch.Tensor, valid: torch.Tensor,
               target: float, *, world_size: int, rho: float, error_per_energy: torch.Tensor,
               scales: Scales, width_set: tuple[int, ...], errors: dict[int, float] | None,
               stats_bytes: int, max_width: int) -> Allocation:
        return allocate_for_target_paper(norm2, mean_sum, valid, target, world_size=world_size,
                                         rho=rho, error_per_energy=error_per_energy,
                                         scales=scales, max_width=max_width,
                                         stats_bytes=stats_bytes)


@dataclasses.dataclass(frozen=True)
class FixedRule:
    """``widths="fixed"``: every super-group at :data:`FIXED_WIDTH` bits, whatever the budget;
    target mode computes the prediction only."""

    fixed_width: int | None = FIXED_WIDTH

    @staticmethod
    def _widths(norm2: torch.Tensor, scales: Scales, stats_bytes: int
                ) -> tuple[torch.Tensor, int, int]:
        """Every row at :data:`FIXED_WIDTH`: ``(widths, payload bytes, statistics bytes)``."""
        widths = torch.full((norm2.numel(),), FIXED_WIDTH, dtype=torch.int64)
        return widths, int(cost_lookup(scales)[widths].sum().item()), stats_bytes * norm2.numel()

    def budget(self, norm2: torch.Tensor, numel: int, bits: float, *, scales: Scales,
               stats_bytes: int, max_width: int, energy_exponent: float) -> Allocation:
        widths, payload, stats = self._widths(norm2, scales, stats_bytes)
        budget = math.floor(bits * numel / 8.0)
        return Allocation(widths, float("nan"), payload, stats, budget, payload + stats > budget)

    def target(self, norm2: torch.Tensor, mean_sum: torch.Tensor, valid: torch.Tensor,
               target: float, *, world_size: int, rho: float, error_per_energy: torch.Tensor,
               scales: Scales, width_set: tuple[int, ...], errors: dict[int, float] | None,
               stats_bytes: int, max_width: int) -> Allocation:
        widths, payload, stats = self._widths(norm2, scales, stats_bytes)
        finite_f, energy = target_energy(norm2.detach().to("cpu", torch.float64), mean_sum,
                                         valid, world_size, rho)
        predicted = predicted_vnmse(widths, finite_f, energy, error_per_energy)
        return Allocation(widths, float("nan"), payload, stats, payload + stats, False,
                          predicted, predicted <= target)


PAPER = DynamiqFormat(levels=Levels.NONUNIFORM, scales=Scales.HIERARCHICAL, width_set="paper",
                      thresholds="paper", stats="fp32", hop_widths=False, max_width=8,
                      rule=PaperRule())
# a preset's thresholds when the knobs do not set them ("auto": measured where known)
_PRESET_THRESHOLDS = {"dqcoll": "auto"}


def _choice(value: Any, choices: Any, name: str) -> Any:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(
            f"dynamiq: {name} must be one of {list(choices)}, got {value!r}")
    return value


def _scales(value: Any) -> Scales | ProtoScales:
    """A scale encoding: a :class:`Scales` member, or a prototype one (:class:`ProtoScales`)."""
    if str(getattr(value, "value", value)).lower() in {e.value for e in ProtoScales}:
        return parse_enum(ProtoScales, value, "scales")
    return parse_enum(Scales, value, "scales")


def research_format(format: str = "dqcoll", **knobs: Any) -> DynamiqFormat:
    """The registered preset ``format`` with :data:`RESEARCH_OPTIONS` applied: values as the
    command line gives them (strings) or typed; the allocation rule follows from the fields
    (``widths="fixed"``: :class:`FixedRule`; ``width_set`` and ``thresholds`` both ``"paper"``:
    :class:`PaperRule`; else the runtime's hull rule)."""
    if format not in FORMATS:
        raise InvalidArgumentError(
            f"dynamiq: format must be one of {list(FORMATS)}, got {format!r}")
    unknown = sorted(set(knobs) - set(RESEARCH_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"dynamiq does not take {unknown}; its options are {list(USER_OPTIONS)} and the "
            f"research options {list(RESEARCH_OPTIONS)}")
    preset = FORMATS[format]
    fixed = preset.rule is not None and preset.rule.fixed_width is not None
    widths = _choice(str(knobs.get("widths", "fixed" if fixed else "variable")).lower(),
                     ("variable", "fixed"), "widths")
    max_width = knobs.get("max_width", preset.max_width)
    if isinstance(max_width, str) and max_width.strip().isdigit():  # the command line's text
        max_width = int(max_width)
    fields = dict(  # the values' ranges are checked by the runtime's check_format, below
        levels=parse_enum(Levels, knobs.get("levels", preset.levels), "levels"),
        scales=_scales(knobs.get("scales", preset.scales)),
        width_set=knobs.get("width_set", preset.width_set),
        thresholds=_choice(knobs.get("thresholds",
                                     _PRESET_THRESHOLDS.get(format, preset.thresholds)),
                           ("auto", "measured", "paper"), "thresholds"),
        stats=knobs.get("stats", preset.stats),
        hop_widths=parse_flag(knobs.get("hop_widths", preset.hop_widths), "hop_widths"),
        max_width=max_width,
        error_model=knobs.get("error_model", preset.error_model),
    )
    measured = (fields["levels"], fields["scales"]) in MEASURED_ERRORS
    if fields["thresholds"] == "auto":
        fields["thresholds"] = "measured" if measured else "paper"
    if widths == "fixed":
        fields["rule"] = FixedRule()
    elif fields["width_set"] == "paper" and fields["thresholds"] == "paper":
        fields["rule"] = PaperRule()
    return check_format(DynamiqFormat(**fields))


def scheme_options(**options: Any) -> dict[str, Any]:
    """``options`` (user options and research knobs) as the runtime's ``dynamiq`` options: the
    knobs applied to the preset ``format`` names (default ``"dqcoll"``) into one
    :class:`DynamiqFormat`. Unknown options raise and name the valid ones."""
    knobs = {k: options.pop(k) for k in list(options) if k not in USER_OPTIONS}
    fmt = options.pop("format", "dqcoll")
    if isinstance(fmt, str):
        fmt = research_format(fmt, **knobs)
    elif knobs:
        raise InvalidArgumentError(
            f"dynamiq: research options {sorted(knobs)} need the preset by name (format=...)")
    return {**options, "format": fmt}


def research_scheme(bits: float = 5.0, **options: Any) -> DynamiqScheme:
    """A ``dynamiq`` scheme from user options and research knobs together
    (:func:`scheme_options`)."""
    return DynamiqScheme(bits, **scheme_options(**options))


def format_name(format: str = "dqcoll", **knobs: Any) -> str:
    """:func:`research_format` registered under a name that spells it (``"paper+max_width=16"``;
    the preset's own name without knobs); returns the name."""
    fmt = research_format(format, **knobs)
    if not knobs:
        return format
    name = "+".join([format, *(f"{k}={v}" for k, v in knobs.items())])
    if FORMATS.get(name) != fmt:
        register_format(name, fmt)
    return name


def scheme_spec(text: str) -> str:
    """A scheme spec with research knobs (``"dynamiq:bits=5;format=paper;max_width=16"``) as the
    runtime's (``"dynamiq:bits=5;format=paper+max_width=16"``, registered by
    :func:`format_name`); other schemes' specs unchanged."""
    name, _, rest = text.strip().partition(":")
    if name != "dynamiq":
        return text
    user: list[str] = []
    knobs: dict[str, str] = {}
    preset = "dqcoll"
    for item in filter(None, (p.strip() for p in rest.split(";"))):
        key, _, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key == "format":
            preset = value
        elif key in USER_OPTIONS:
            user.append(item)
        else:  # a research knob (an unknown one raises in research_format, naming them all)
            knobs[key] = value
    if not knobs:
        return text
    return f"dynamiq:{';'.join([*user, f'format={format_name(preset, **knobs)}'])}"


register_format("paper", PAPER)
