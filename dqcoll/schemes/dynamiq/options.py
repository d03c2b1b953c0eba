"""The ``dynamiq`` scheme's options, parsed and checked once at construction.

A user sets :data:`USER_OPTIONS`; ``format`` names a registered :class:`DynamiqFormat` or is one.
The lab (``dqcoll_lab.dynamiq``) registers the others (the paper's, the ablations' variants),
which may bring their own :class:`AllocationRule`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Protocol

import numpy as np
import torch

from ...errors import InvalidArgumentError
from ...kernels.codec import FINE_WIDTHS, RAW_WIDTH, WIDTHS, Levels, ProtoScales, Scales
from .allocation import MEASURED_ERRORS, STATS_BYTES, Allocation, min_bits
from .error_model import EPSILON, ErrorModel

__all__ = [
    "FORMATS",
    "USER_OPTIONS",
    "AllocationRule",
    "Balance",
    "DynamiqFormat",
    "check_format",
    "parse_enum",
    "parse_flag",
    "register_format",
    "resolve_format",
]


class Balance(enum.Enum):
    """How the all-reduce cuts the sorted super-groups into the ``n`` chunks of the schedule."""

    BYTES = "bytes"  # chunks of equal wire bytes (per-rank traffic meets the budget)
    SHARDS = "shards"  # chunk c = shard c, the reduce-scatter layout


class AllocationRule(Protocol):
    """A format's own allocation rule in place of the hull rule (:mod:`.allocation`): one width
    per super-group from the summed squared norms, identical on every rank. ``fixed_width``: the
    one width a rule always gives (the budget is then not checked against the floor), or None."""

    @property
    def fixed_width(self) -> int | None: ...

    def budget(self, norm2: torch.Tensor, numel: int, bits: float, *, scales: Scales,
               stats_bytes: int, max_width: int, energy_exponent: float) -> Allocation: ...

    def target(self, norm2: torch.Tensor, mean_sum: torch.Tensor, valid: torch.Tensor,
               target: float, *, world_size: int, rho: float, error_per_energy: torch.Tensor,
               scales: Scales, width_set: tuple[int, ...], errors: dict[int, float] | None,
               stats_bytes: int, max_width: int) -> Allocation: ...


@dataclasses.dataclass(frozen=True)
class DynamiqFormat:
    """What a format fixes (docs/dense_gap.md measures each field): the codec's ``levels`` and
    ``scales`` (or a torch-only :class:`~dqcoll.kernels.codec.ProtoScales`), ``width_set``
    ("fine": 2-8, "paper": {2, 4, 8}), ``thresholds`` ("measured": the hull of the codec's own
    errors, "paper": ``4**-w``), ``stats`` ("norm16" 2 B, "bf16" 4 B, "fp32" 8 B per
    super-group), ``hop_widths`` (widths per partial-sum size, all-reduce only), ``max_width``
    (16: raw super-groups allowed), ``rule`` (None: the hull rule), ``error_model`` (target
    mode's; None: :class:`.error_model.ErrorModel`'s defaults)."""

    levels: Levels = Levels.TUNED
    scales: Scales | ProtoScales = Scales.HIERARCHICAL4X32
    width_set: str = "fine"
    thresholds: str = "measured"
    stats: str = "norm16"
    hop_widths: bool = True
    max_width: int = RAW_WIDTH
    rule: AllocationRule | None = None
    error_model: ErrorModel | None = None

    @property
    def width_choices(self) -> tuple[int, ...]:
        """The coded widths the allocation chooses among (raw 16 aside)."""
        return FINE_WIDTHS if self.width_set == "fine" else WIDTHS


# Format 3, dqcoll's default (docs/dense_gap.md); the lab registers the others.
FORMATS: dict[str, DynamiqFormat] = {"dqcoll": DynamiqFormat()}
# the options a user sets (DynamiqScheme's keywords)
USER_OPTIONS = ("bits", "format", "target_vnmse", "rounding", "seed", "energy_exponent",
                "balance")

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
    if isinstance(value, int | np.bool_) and value in (0, 1):  # bool is an int
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise InvalidArgumentError(
        f"dynamiq: {name} must be true or false (True/False, 1/0, or one of the strings "
        f"{list(_TRUE + _FALSE)}), got {value!r}")


def register_format(name: str, fmt: DynamiqFormat) -> None:
    """Make ``fmt`` reachable as ``format=name`` (checked first)."""
    FORMATS[name] = check_format(fmt)


def resolve_format(format: str | DynamiqFormat) -> DynamiqFormat:
    """The format named ``format`` (or ``format`` itself), checked."""
    if isinstance(format, DynamiqFormat):
        return check_format(format)
    if format not in FORMATS:
        raise InvalidArgumentError(
            f"dynamiq: format must be one of {list(FORMATS)} or a DynamiqFormat, got "
            f"{format!r} (the paper's configuration and the research variants: "
            f"dqcoll_lab.dynamiq)")
    return FORMATS[format]


def check_format(fmt: DynamiqFormat) -> DynamiqFormat:
    """``fmt`` if its fields hold values the codec and the allocation implement."""
    def bad(name: str, choices: Any) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"dynamiq: {name} must be one of {list(choices)}, got {getattr(fmt, name)!r}")

    if not isinstance(fmt.levels, Levels):
        raise bad("levels", [e.value for e in Levels])
    if not isinstance(fmt.scales, Scales | ProtoScales):
        raise bad("scales", [e.value for e in (*Scales, *ProtoScales)])
    for name, choices in (("width_set", ("fine", "paper")), ("thresholds", ("measured", "paper")),
                          ("stats", STATS_BYTES), ("max_width", (8, RAW_WIDTH))):
        if getattr(fmt, name) not in choices:
            raise bad(name, choices)
    if fmt.thresholds == "measured" and (fmt.levels, fmt.scales) not in MEASURED_ERRORS:
        raise InvalidArgumentError(
            f"dynamiq: thresholds='measured' has no measured errors for "
            f"levels={fmt.levels.value}, scales={fmt.scales.value}")
    return fmt


def _number(value: Any, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"dynamiq: {name} must be a number, got {value!r}") from None


def parse_bits(bits: Any, fmt: DynamiqFormat) -> float:
    """The bit budget per coordinate, at least the format's floor when the widths vary."""
    value = _number(bits, "bits")
    floor = min_bits(fmt.scales, STATS_BYTES[fmt.stats])  # type: ignore[arg-type]
    fixed = fmt.rule is not None and fmt.rule.fixed_width is not None
    if not math.isfinite(value) or (not fixed and value < floor):
        raise InvalidArgumentError(
            f"dynamiq: bits={value:g} is below the minimum of {floor:g} bits per coordinate "
            f"(2-bit codes, {fmt.scales.value} scales and statistics)"
        )
    return value


def parse_target(target_vnmse: Any, fmt: DynamiqFormat) -> float | None:
    """``target_vnmse``: None, or a positive finite number for a format the error model knows."""
    if target_vnmse is None:
        return None
    target = _number(target_vnmse, "target_vnmse")
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
    value = _number(energy_exponent, "energy_exponent")
    if not 0.0 <= value <= 1.0:
        raise InvalidArgumentError(
            f"dynamiq: energy_exponent must be in [0, 1], got {energy_exponent!r}")
    if value != 1.0 and target_vnmse is not None:
        raise InvalidArgumentError(
            "dynamiq: energy_exponent applies to a bit budget; target_vnmse allocates for "
            "the error itself (leave energy_exponent at 1)")
    return value
