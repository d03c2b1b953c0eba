"""Where one ``dynamiq`` call's records lie (step 6 of :mod:`.call`): byte offsets, runs of equal
width, the ``n`` chunks and each chunk's segments, over the rows in the call's sorted order; with
hop widths per count class, the chunks striped.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np
import torch

from ...kernels.codec import Scales
from .allocation import cost_lookup

__all__ = ["Geometry"]

Runs = list[tuple[int, int, int]]  # (width, first row, end row) of equal non-zero width
Segments = list[tuple[int, int, int, int]]  # (width, first row, end row, byte offset in chunk)


def _offsets_and_runs(sizes: np.ndarray, sorted_widths: np.ndarray) -> tuple[np.ndarray, Runs]:
    """Each sorted row's byte offset (and the end), and the maximal runs of equal non-zero
    width."""
    rows = sorted_widths.shape[0]
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(sizes[sorted_widths], out=offsets[1:])
    change = np.flatnonzero(sorted_widths[1:] != sorted_widths[:-1]) + 1
    runs = [(int(sorted_widths[a]), a, b)
            for a, b in itertools.pairwise([0, *change.tolist(), rows])
            if b > a and sorted_widths[a]]
    return offsets, runs


class Geometry:
    """Byte offset of each sorted row's record (``row_offsets``) and the runs of equal width
    (``runs``); with hop widths also per count class (``by_count``). Shared by a call's tile
    views, so :meth:`segments` is memoised."""

    def __init__(self, sorted_widths: np.ndarray, order: np.ndarray, scales: Scales,
                 hop: dict[int, torch.Tensor] | None) -> None:
        self.rows = sorted_widths.shape[0]
        sizes = cost_lookup(scales).numpy()
        self.row_offsets, self.runs = _offsets_and_runs(sizes, sorted_widths)
        self.by_count: dict[int, tuple[np.ndarray, Runs]] = {
            c: _offsets_and_runs(sizes, widths.numpy()[order]) for c, widths in (hop or {}).items()}
        # (first row, end row, count class) -> segments
        self._segment_cache: dict[tuple[int, int, int | None], Segments] = {}

    def chunk_bounds(self, n: int, shard_row_counts: torch.Tensor | None) -> list[int]:
        """The first sorted row of each of the ``n`` chunks, and the end: striped with hop widths,
        shards given ``shard_row_counts``, else chunks of (nearly) equal bytes."""
        rows = self.rows
        if self.by_count:  # hop widths: chunk c holds sorted rows c, c + n, ... (stripe c)
            return [0, *np.cumsum([rows // n + (c < rows % n) for c in range(n)]).tolist()]
        if shard_row_counts is not None:
            return [0, *torch.cumsum(shard_row_counts, 0).tolist()]
        total = int(self.row_offsets[-1])
        targets = [(c * total + n // 2) // n for c in range(1, n)]
        return [0, *np.searchsorted(self.row_offsets, targets).tolist(), rows]

    def _tables(self, count: int) -> tuple[np.ndarray, Runs]:
        return self.by_count[count] if self.by_count else (self.row_offsets, self.runs)

    def segments(self, lo: int, hi: int, count: int) -> Segments:
        """(width, first row, end row, byte offset in the chunk payload) of each run in sorted
        rows ``[lo, hi)``, cached per (rows, count)."""
        key = (lo, hi, count if self.by_count else None)
        if key not in self._segment_cache:
            row_offsets, runs = self._tables(count)
            base = int(row_offsets[lo])
            first = max(0, bisect.bisect_right(runs, lo, key=lambda run: run[1]) - 1)
            segments = []
            for width, start, stop in runs[first:]:
                if start >= hi:
                    break
                a, b = max(lo, start), min(hi, stop)
                if a < b:
                    segments.append((width, a, b, int(row_offsets[a]) - base))
            self._segment_cache[key] = segments
        return self._segment_cache[key]

    def payload_nbytes(self, lo: int, hi: int, count: int) -> int:
        """Bytes of the records of sorted rows ``[lo, hi)`` at partial-sum size ``count``."""
        row_offsets, _ = self._tables(count)
        return int(row_offsets[hi] - row_offsets[lo])

    def hop_wire_payload(self, chunk_bounds: list[int], subtree: np.ndarray, n: int) -> int:
        """With hop widths, the all-reduce's payload bytes over every rank: each partial sum
        (subtree < n) once, and each final payload ``n - 1`` times."""
        bounds = np.asarray(chunk_bounds, dtype=np.int64)
        classes = sorted(self.by_count)
        class_of = np.zeros(n + 1, np.int64)
        class_of[classes] = np.arange(len(classes))
        payload = np.stack([offsets[bounds[1:]] - offsets[bounds[:-1]]
                            for offsets, _ in (self.by_count[c] for c in classes)])
        chunks = np.arange(n, dtype=np.int64)[None, :]
        total = int(((n - 1) * payload[class_of[n]]).sum())
        block = max(1, (1 << 22) // max(n, 1))
        for r0 in range(0, n, block):
            sizes = subtree[r0 : r0 + block].astype(np.int64)
            sent = sizes < n
            total += int(np.where(sent, payload[class_of[np.where(sent, sizes, n)], chunks],
                                  0).sum())
        return total
