"""A minimal progress bar on stderr, shown only on a terminal and for long work."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    def __init__(self, label: str, stream: TextIO | None = None, min_seconds: float = 1.0):
        self.label = label
        self.stream = stream or sys.stderr  # looked up now: sys.stderr may be replaced (pytest capture)
        self.enabled = self.stream.isatty()
        self.started = time.monotonic()
        self.min_seconds = min_seconds
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or time.monotonic() - self.started < self.min_seconds:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r{self.label} [{bar:<30}] {frac:6.1%} {done / 1e9:.2f}/{total / 1e9:.2f} GB")
        self.stream.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
