"""A plain progress bar on stderr for long commands (``dqcoll tune``, ``dqcoll simulate``).

One line redrawn with ``\\r`` when stderr is a terminal; otherwise a line per 10 % so logs stay
short. No dependency: tqdm would be the only one the package needs for this.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, label: str, *, stream: TextIO | None = None, width: int = 30,
                 every: float = 0.1) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every  # without a terminal: a line per this fraction of the work
        self._last_decile = -1
        self._last_draw = float("-inf")

    def __call__(self, done: int, total: int, note: str = "") -> None:
        total = max(total, 1)
        frac = min(max(done / total, 0.0), 1.0)
        elapsed = time.monotonic() - self.start
        eta = elapsed / frac - elapsed if frac > 0 else float("nan")
        filled = round(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        text = (f"{self.label} [{bar}] {100 * frac:5.1f}% {elapsed:6.1f}s"
                + (f" eta {eta:5.0f}s" if frac > 0 and frac < 1 else "")
                + (f" {note}" if note else ""))
        if self.tty:
            now = time.monotonic()
            if frac < 1 and now - self._last_draw < 0.2:  # redraw at most 5 times a second
                return
            self._last_draw = now
            self.stream.write("\r" + text[:160].ljust(100))
            if frac >= 1:
                self.stream.write("\n")
        else:
            decile = int(frac / self.every + 1e-9)
            if decile == self._last_decile:
                return
            self._last_decile = decile
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
