"""The record every DynamiQ fast path fills: :class:`DynamiqOps`, and the format check they share.

:func:`dqcoll.kernels.dynamiq_ops` returns one of these for a device (the torch reference, the
numba kernels of :mod:`.dynamiq_numba` or the Triton kernels of :mod:`.dynamiq_triton`); each
kernel module builds its own ``OPS`` from this module. It is a module of its own so that the
kernel modules do not import the package's ``__init__``, which picks among them (an import
circle).
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
    # restore(work, mean, index_base, valid, out_flat): add back the means and undo the reorder in
    # one pass; None: the scheme does it with torch ops (reference: codec.restore_torch).
    restore: Callable[..., None] | None = None
    # stats(x, valid, divisor=) -> (mean, norm2) and center_gather(x, mean, valid, order,
    # divisor=, out=) -> the centred rows of x / divisor in ``order``: stats_center split in two
    # so that the centred rows are written once, already reordered (and divided, for avg).
    # None: the scheme divides, uses stats_center and a torch gather. stats takes
    # keep_underflowed=True: its norms then already carry the call's underflow check.
    stats: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    center_gather: Callable[..., torch.Tensor] | None = None
    # decode_restore(records, width, config, mean, index_base, valid, out): restore(decode(...))
    # in one pass, into a flat fp32 out (an all-reduce's last decode of each row), raw width 16
    # included. None: the scheme decodes into its work rows and restores them.
    decode_restore: Callable[..., None] | None = None
    # restore_mean(mean, index_base, valid, out): restore of rows whose work values are all
    # +-0 (out = mean + 0) without reading them, and center_gather's skip= (rows left
    # unwritten): the all-reduce's width-0 rows. None: those rows are centred and restored.
    restore_mean: Callable[..., None] | None = None
    # decode_restore_runs(runs, config, mean, index_base, valid, out) and encode_runs(x, runs,
    # index_base, rank, world_size, key, config, out): decode_restore of (records, width, first
    # row, end row) runs, and encode of (width, first row, end row, byte offset) runs of x's rows
    # into one payload, with the views and checks made once for all runs (the same kernels,
    # the same bits). None: the scheme calls decode_restore / encode once per run.
    decode_restore_runs: Callable[..., None] | None = None
    encode_runs: Callable[..., None] | None = None
    # hop_runs(payload, pieces, acc, index_base, rank, world_size, key, config, out): a hop's
    # (incoming width, outgoing width, first row, end row, payload offset, out offset) pieces,
    # fused decode-accumulate-encode where the widths agree; decode_accumulate_runs(payload,
    # runs, config, acc). None: the scheme calls the single-run ops per piece.
    hop_runs: Callable[..., None] | None = None
    decode_accumulate_runs: Callable[..., None] | None = None
    # stats_range(x, valid, divisor=, centre=, keep_underflowed=) -> (mean, norm2, largest
    # finite |x|, plus_zero): stats and the range check's maximum in one pass, the same bits as
    # the two apart, and which rows of x are all +0 (bool per row) (the call's statistics taken
    # before the argument check: DynamiqScheme.survey).
    # None: the range check is its own pass and the statistics follow the argument check.
    stats_range: Callable[..., tuple[torch.Tensor, torch.Tensor, float, Any]] | None = None
    # The widths each scale encoding is implemented for (raw width 16 always is); None: every
    # format (the reference). The scheme runs a call whose widths are not all here on the
    # reference ops.
    formats: Mapping[Any, tuple[int, ...]] | None = None

    def implements(self, scales: Any, widths: Iterable[int]) -> bool:
        """Whether these kernels encode and decode every one of ``widths`` with ``scales``."""
        if self.formats is None:
            return True
        have = self.formats.get(scales, ())
        return all(w in have or w in (0, 16) for w in widths)


def check_format(formats: Mapping[Any, tuple[int, ...]], width: int, config: Any) -> None:
    """Raise unless a fast path with ``formats`` (``DynamiqOps.formats``) implements ``width``
    with ``config.scales`` (raw width 16, the reference's torch ops, always)."""
    widths = formats.get(config.scales, ())
    if width not in widths and width != 16:
        raise ValueError(f"width must be one of {(*widths, 16)} with {config.scales.value} "
                         f"scales, got {width}")
