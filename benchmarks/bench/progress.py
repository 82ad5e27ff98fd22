"""A progress bar on stderr: redrawn in place on a terminal, a line per 10% elsewhere."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from benchmarks.bench.client import RequestRecord

_WIDTH = 30


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.errors = 0
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._started = time.monotonic()
        self._drawn = 0.0
        self._decile = -1

    def line(self) -> str:
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * _WIDTH)
        bar = "#" * filled + "-" * (_WIDTH - filled)
        elapsed = time.monotonic() - self._started
        return (f"{self.label:<26} [{bar}] {self.done}/{self.total} requests, "
                f"{self.errors} errors, {elapsed:5.1f} s")

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += 0 if record.ok else 1
        now = time.monotonic()
        if self._tty:
            if now - self._drawn >= 0.1 or self.done >= self.total:
                self._drawn = now
                self._stream.write("\r" + self.line())
                self._stream.flush()
            return
        decile = int(10 * self.done / self.total)
        if decile != self._decile:
            self._decile = decile
            self._stream.write(self.line() + "\n")
            self._stream.flush()

    def close(self, note: str = "") -> None:
        end = f"  {note}" if note else ""
        if self._tty:
            self._stream.write("\r" + self.line() + end + "\n")
        elif note:
            self._stream.write(f"{self.label:<26} {note}\n")
        self._stream.flush()
