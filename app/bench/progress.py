"""A progress line on stderr: a redrawn bar on a terminal, a plain counter otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30):
        self.total, self.width = total, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = self.failed = 0
        self.started = time.monotonic()
        # Without a terminal: a line at every tenth (and the last), not one per request.
        self._every = max(1, total // 10)

    def update(self, success: bool) -> None:
        self.done += 1
        if not success:
            self.failed += 1
        if self.tty:
            filled = int(self.width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {self._counts()}")
            if self.done == self.total:
                self.stream.write("\n")
        elif self.done % self._every == 0 or self.done == self.total:
            self.stream.write(f"{self._counts()}\n")
        self.stream.flush()

    def _counts(self) -> str:
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"{self.done}/{self.total} requests{failed} "
                f"({time.monotonic() - self.started:.1f} s)")
