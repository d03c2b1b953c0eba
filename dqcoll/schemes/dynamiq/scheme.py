"""The ``dynamiq`` scheme: its options (:mod:`.options`), and its codec as a single-shot
compressor. Each collective call plans itself in a :class:`~.call.DynamiqCall`; the format is
:mod:`dqcoll.kernels.codec`, the allocation :mod:`.allocation`.
"""

from __future__ import annotations

import math

import torch

from ...kernels.codec import SUPER, CodecConfig, ProtoScales, RoundingMode, record_nbytes
from ..base import FLOAT_DTYPES, CallContext, SchemeSpec
from ..integer_sum import IntegerSumCodec
from .allocation import MEASURED_ERRORS, STATS_BYTES
from .call import DynamiqCall, survey
from .error_model import ErrorModel
from .options import (
    USER_OPTIONS,
    Balance,
    DynamiqFormat,
    parse_bits,
    parse_energy_exponent,
    parse_enum,
    parse_target,
    resolve_format,
)

__all__ = ["Balance", "DynamiqCall", "DynamiqScheme"]


class DynamiqScheme:
    """DynamiQ: variable widths per 256-coordinate super-group, non-uniform levels, hierarchical
    scales, correlated stochastic rounding.

    ``bits``: the budget per coordinate, everything on the wire included (at least 2.25 for
    ``"dqcoll"``, 2.81 for ``"paper"``); ``target_vnmse``: the fewest bits whose predicted vNMSE
    meets it (docs/target_vnmse.md); ``format``: a registered format's name (``"dqcoll"``) or a
    :class:`.options.DynamiqFormat`; ``rounding``: ``"correlated"`` or ``"independent"``;
    ``seed``: the single-shot codec's; ``energy_exponent`` in [0, 1] (docs/allocation.md);
    ``balance``: :class:`.options.Balance`.
    """

    spec = SchemeSpec(
        name="dynamiq",
        description="DynamiQ: variable widths per 256-coordinate super-group, non-uniform levels, "
        "hierarchical scales, correlated stochastic rounding",
        bits_per_coord=None,
        unbiased=True,  # each rounding; correlated rounding is unbiased only approximately
        exact_sums=False,
        dtypes=FLOAT_DTYPES,
        supports_reduce_scatter=True,
        needs_global_stats=True,
        options=USER_OPTIONS,
    )

    def __init__(
        self,
        bits: float = 5.0,
        *,
        format: str | DynamiqFormat = "dqcoll",
        target_vnmse: float | None = None,
        rounding: str | RoundingMode = "correlated",
        seed: int = 0,
        energy_exponent: float = 1.0,
        balance: str | Balance = "bytes",
    ) -> None:
        fmt = self.format = resolve_format(format)
        self.config = CodecConfig(levels=fmt.levels, scales=fmt.scales,  # type: ignore[arg-type]
                                  rounding=parse_enum(RoundingMode, rounding, "rounding"))
        self.bits = parse_bits(bits, fmt)
        self.target_vnmse = parse_target(target_vnmse, fmt)
        self.energy_exponent = parse_energy_exponent(energy_exponent, self.target_vnmse)
        self.seed = int(seed)
        self.balance: Balance = parse_enum(Balance, balance, "balance")
        self.error_model: ErrorModel = fmt.error_model or ErrorModel()
        # the format's fields, by the names the call and repr read
        self.width_set, self.thresholds, self.stats = fmt.width_set, fmt.thresholds, fmt.stats
        self.hop_widths, self.max_width = fmt.hop_widths, fmt.max_width
        # prototype scale encodings exist in the torch reference only
        self.reference_only = isinstance(fmt.scales, ProtoScales)
        self.stats_bytes = STATS_BYTES[self.stats]  # statistics bytes per super-group
        # the hull rule's errors per width: measured for the codec, or None (``4**-w``)
        self.measured_errors: dict[int, float] | None = (
            MEASURED_ERRORS[(self.config.levels, self.config.scales)]
            if self.thresholds == "measured" else None)

    def __repr__(self) -> str:
        c = self.config
        budget = (f"target_vnmse={self.target_vnmse:g}, model={self.error_model}"
                  if self.target_vnmse is not None else f"bits={self.bits:g}")
        exponent = (f", energy_exponent={self.energy_exponent:g}"
                    if self.energy_exponent != 1.0 else "")
        rule = f", rule={self.format.rule}" if self.format.rule is not None else ""
        return (f"DynamiqScheme({budget}, max_width={self.max_width}, levels={c.levels.value}, "
                f"scales={c.scales.value}, rounding={c.rounding.value}, "
                f"balance={self.balance.value}{exponent}, width_set={self.width_set}, "
                f"thresholds={self.thresholds}, stats={self.stats}, "
                f"hop_widths={self.hop_widths}{rule})")

    def begin(self, x: torch.Tensor, ctx: CallContext) -> DynamiqCall:
        return DynamiqCall(self, x, ctx)

    survey = survey  # the range check's pass with the call's statistics in it

    def wire_nbytes(self, numel: int) -> int:
        fixed = self.format.rule.fixed_width if self.format.rule is not None else None
        width = 2 if fixed is None else fixed  # the cheapest records, or the rule's one width
        records = -(-numel // SUPER) * (record_nbytes(width, self.config.scales) + self.stats_bytes)
        return records if fixed is not None else max(math.floor(self.bits * numel / 8.0), records)

    # single-shot use: one rank's call with local statistics (IntegerSumCodec's, on begin)
    encode = IntegerSumCodec.encode
    decode = IntegerSumCodec.decode
