"""The ``dynamiq`` scheme's options, parsed and checked once at construction.

A user picks a format preset (:data:`FORMATS`: ``"dqcoll"``, the default, or ``"paper"``, the
DynamiQ paper's configuration) and sets :data:`USER_OPTIONS`; the research knobs
(:data:`RESEARCH_OPTIONS`, for ablations) override one field of the :class:`DynamiqFormat` each.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError
from ...kernels.codec import FINE_WIDTHS, RAW_WIDTH, WIDTHS, Levels, ProtoScales, Scales, Widths
from .allocation import MEASURED_ERRORS, STATS_BYTES, min_bits
from .error_model import EPSILON

__all__ = [
    "FORMATS",
    "RESEARCH_OPTIONS",
    "USER_OPTIONS",
    "Balance",
    "DynamiqFormat",
    "parse_enum",
    "parse_flag",
    "resolve_format",
]


class Balance(enum.Enum):
    """How the all-reduce cuts the sorted super-groups into the ``n`` chunks of the schedule."""

    BYTES = "bytes"  # chunks of equal wire bytes (per-rank traffic meets the budget)
    SHARDS = "shards"  # chunk c = shard c, the reduce-scatter layout


@dataclasses.dataclass(frozen=True)
class DynamiqFormat:
    """What a format preset fixes: the codec's levels and scales (``scales`` may be a torch-only
    :class:`~dqcoll.kernels.codec.ProtoScales`), ``widths`` (``VARIABLE`` or ``FIXED`` at 4),
    ``width_set`` (``"fine"``: 2-8, ``"paper"``: {2, 4, 8}), ``thresholds`` (``"measured"``: the
    hull of the codec's own errors, ``"paper"``: ``4**-w``, ``"auto"``: measured where known),
    ``stats`` (``"norm16"`` 2 B, ``"bf16"`` mean and norm 4 B, ``"fp32"`` 8 B per super-group),
    ``hop_widths`` (widths per partial-sum size, all-reduce only) and ``max_width`` (16: raw
    super-groups allowed; 8: the paper's). docs/dense_gap.md measures each field."""

    levels: Levels = Levels.TUNED
    scales: Scales | ProtoScales = Scales.HIERARCHICAL4X32
    widths: Widths = Widths.VARIABLE
    width_set: str = "fine"
    thresholds: str = "auto"
    stats: str = "norm16"
    hop_widths: bool = True
    max_width: int = RAW_WIDTH

    @property
    def width_choices(self) -> tuple[int, ...]:
        """The coded widths the allocation chooses among (raw 16 aside)."""
        return FINE_WIDTHS if self.width_set == "fine" else WIDTHS


# Format 3, dqcoll's default (docs/dense_gap.md), and the paper's configuration.
FORMATS: dict[str, DynamiqFormat] = {
    "dqcoll": DynamiqFormat(),
    "paper": DynamiqFormat(levels=Levels.NONUNIFORM, scales=Scales.HIERARCHICAL,
                           width_set="paper", thresholds="paper", stats="fp32",
                           hop_widths=False, max_width=8),
}
# the options a user sets (DynamiqScheme's keywords), and the research knobs (**research_options)
USER_OPTIONS = ("bits", "format", "target_vnmse", "rounding", "seed", "energy_exponent",
                "balance")
RESEARCH_OPTIONS = ("levels", "scales", "widths", "width_set", "thresholds", "stats",
                    "hop_widths", "max_width", "error_model")

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def parse_enum(enum_type: Any, value: Any, name: str) -> Any:
    """``value`` as a member of ``enum_type`` (a member, or its value in any case)."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(str(value).lower())
    except ValueError:
        raise InvalidArgumentError(
            f"dynamiq: {name} must be one of {[e.value for e in enum_type]}, got {value!r}"
        ) from None


def parse_flag(value: Any, name: str) -> bool:
    """A boolean option: a bool, ``1``/``0`` or a string such as ``"false"`` (command line)."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE or text in _FALSE:
            return text in _TRUE
    raise InvalidArgumentError(
        f"dynamiq: {name} must be true or false (True/False, 1/0, or one of the strings "
        f"{list(_TRUE + _FALSE)}), got {value!r}")


def _choice(value: Any, choices: tuple[str, ...] | Mapping[str, Any], name: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(
            f"dynamiq: {name} must be one of {list(choices)}, got {value!r}")
    return value


def _scales(value: Any) -> Scales | ProtoScales:
    """A scale encoding: a :class:`Scales` member, or a prototype one (:class:`ProtoScales`)."""
    if str(getattr(value, "value", value)).lower() in {e.value for e in ProtoScales}:
        return parse_enum(ProtoScales, value, "scales")
    return parse_enum(Scales, value, "scales")


def resolve_format(format: str, research: Mapping[str, Any]) -> DynamiqFormat:
    """The preset named ``format`` with the research knobs applied, checked, ``"auto"`` settled
    (``research`` may hold ``error_model``, which the caller reads)."""
    if format not in FORMATS:
        raise InvalidArgumentError(
            f"dynamiq: format must be one of {list(FORMATS)}, got {format!r}")
    unknown = sorted(set(research) - set(RESEARCH_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"dynamiq does not take {unknown}; its options are {list(USER_OPTIONS)} and the "
            f"research options {list(RESEARCH_OPTIONS)}")
    preset = FORMATS[format]
    fields = {f.name: research.get(f.name, getattr(preset, f.name))
              for f in dataclasses.fields(DynamiqFormat)}
    if fields["max_width"] is None:  # "the preset's"
        fields["max_width"] = preset.max_width
    if fields["max_width"] not in (8, RAW_WIDTH):
        raise InvalidArgumentError(
            f"dynamiq: max_width must be 8 or 16, got {fields['max_width']!r}")
    fmt = DynamiqFormat(
        levels=parse_enum(Levels, fields["levels"], "levels"),
        scales=_scales(fields["scales"]),
        widths=parse_enum(Widths, fields["widths"], "widths"),
        width_set=_choice(fields["width_set"], ("fine", "paper"), "width_set"),
        thresholds=_choice(fields["thresholds"], ("auto", "measured", "paper"), "thresholds"),
        stats=_choice(fields["stats"], STATS_BYTES, "stats"),
        hop_widths=parse_flag(fields["hop_widths"], "hop_widths"),
        max_width=int(fields["max_width"]),
    )
    measured = (fmt.levels, fmt.scales) in MEASURED_ERRORS
    if fmt.thresholds == "auto":
        fmt = dataclasses.replace(fmt, thresholds="measured" if measured else "paper")
    elif fmt.thresholds == "measured" and not measured:
        raise InvalidArgumentError(
            f"dynamiq: thresholds='measured' has no measured errors for "
            f"levels={fmt.levels.value}, scales={fmt.scales.value}")
    return fmt


def parse_bits(bits: Any, fmt: DynamiqFormat) -> float:
    """The bit budget per coordinate, at least the format's floor when the widths vary."""
    try:
        value = float(bits)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"dynamiq: bits must be a number, got {bits!r}") from None
    floor = min_bits(fmt.scales, STATS_BYTES[fmt.stats])  # type: ignore[arg-type]
    if not math.isfinite(value) or (fmt.widths is Widths.VARIABLE and value < floor):
        raise InvalidArgumentError(
            f"dynamiq: bits={value:g} is below the minimum of {floor:g} bits per coordinate "
            f"(2-bit codes, {fmt.scales.value} scales and statistics)"
        )
    return value


def parse_target(target_vnmse: Any, fmt: DynamiqFormat) -> float | None:
    """``target_vnmse``: None, or a positive finite number for a format the error model knows."""
    if target_vnmse is None:
        return None
    try:
        target = float(target_vnmse)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"dynamiq: target_vnmse must be a number, got {target_vnmse!r}") from None
    if not (math.isfinite(target) and target > 0):
        raise InvalidArgumentError(
            f"dynamiq: target_vnmse must be positive and finite, got {target_vnmse!r}")
    model: tuple[Any, Any] = (fmt.levels, fmt.scales)
    if not set(fmt.width_choices) <= set(EPSILON.get(model, {})):
        raise InvalidArgumentError(
            f"dynamiq: target_vnmse has no error model for levels={fmt.levels.value}, "
            f"scales={fmt.scales.value}, width_set={fmt.width_set} (docs/target_vnmse.md)")
    return target


def parse_energy_exponent(energy_exponent: Any, target_vnmse: float | None) -> float:
    """``energy_exponent`` in [0, 1]; only 1 (the default) with ``target_vnmse``."""
    try:
        value = float(energy_exponent)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"dynamiq: energy_exponent must be a number, got {energy_exponent!r}") from None
    if not 0.0 <= value <= 1.0:
        raise InvalidArgumentError(
            f"dynamiq: energy_exponent must be in [0, 1], got {energy_exponent!r}")
    if value != 1.0 and target_vnmse is not None:
        raise InvalidArgumentError(
            "dynamiq: energy_exponent applies to a bit budget; target_vnmse allocates for "
            "the error itself (leave energy_exponent at 1)")
    return value
