"""The record every DynamiQ fast path fills: :class:`DynamiqOps`, and the format check they share.

:func:`dqcoll.kernels.dynamiq_ops` returns one of these for a device; each kernel module builds
its own ``OPS`` from this module, which exists apart so that they need not import the package's
``__init__`` (an import circle). Optional ops are None where the scheme composes them itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["DynamiqOps", "check_format"]


@dataclasses.dataclass(frozen=True)
class DynamiqOps:
    """One implementation of every DynamiQ step (signatures of the torch reference)."""

    name: str
    stats_center: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    encode: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    decode_accumulate: Callable[..., None]
    decode_accumulate_encode: Callable[..., torch.Tensor]
    # restore(work, mean, index_base, valid, out_flat): add back the means and undo the reorder
    restore: Callable[..., None] | None = None
    # stats(x, valid, divisor=, keep_underflowed=) -> (mean, norm2) and center_gather(x, mean,
    # valid, order, divisor=, out=) -> the centred rows of x / divisor in ``order``, written once
    stats: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    center_gather: Callable[..., torch.Tensor] | None = None
    # gather_source(x, mean, valid, order, divisor=) -> a source of center_gather's rows that
    # encode_runs and hop_runs take as ``source=`` (they gather the rows themselves as they
    # encode; its ``write(out, a, b, skip)`` gathers rows [a, b) into a buffer)
    gather_source: Callable[..., Any] | None = None
    # decode_restore(records, width, config, mean, index_base, valid, out): restore(decode(...))
    decode_restore: Callable[..., None] | None = None
    # restore_mean(mean, index_base, valid, out): restore of width-0 rows without reading them
    restore_mean: Callable[..., None] | None = None
    # decode_restore_runs(runs, config, mean, index_base, valid, out) and encode_runs(x, runs,
    # index_base, rank, world_size, key, config, out): the single-run ops over many runs at once
    decode_restore_runs: Callable[..., None] | None = None
    encode_runs: Callable[..., None] | None = None
    # hop_runs(payload, pieces, acc, index_base, rank, world_size, key, config, out): a hop's
    # pieces, fused where the widths agree; decode_accumulate_runs(payload, runs, config, acc)
    hop_runs: Callable[..., None] | None = None
    decode_accumulate_runs: Callable[..., None] | None = None
    # stats_range(x, valid, divisor=, centre=, keep_underflowed=) -> (mean, norm2, largest
    # finite |x|, plus_zero per row): stats and the range check in one pass (DynamiqScheme.survey)
    stats_range: Callable[..., tuple[torch.Tensor, torch.Tensor, float, Any]] | None = None
    # widths implemented per scale encoding (raw 16 always); None: every format (the reference)
    formats: Mapping[Any, tuple[int, ...]] | None = None

    def implements(self, scales: Any, widths: Iterable[int]) -> bool:
        """Whether these kernels encode and decode every one of ``widths`` with ``scales``."""
        have = () if self.formats is None else self.formats.get(scales, ())
        return self.formats is None or all(w in have or w in (0, 16) for w in widths)


def check_format(formats: Mapping[Any, tuple[int, ...]], width: int, config: Any) -> None:
    """Raise unless a fast path with ``formats`` (``DynamiqOps.formats``) implements ``width``
    with ``config.scales`` (raw width 16, the reference's torch ops, always)."""
    widths = formats.get(config.scales, ())
    if width not in widths and width != 16:
        raise ValueError(f"width must be one of {(*widths, 16)} with {config.scales.value} "
                         f"scales, got {width}")
