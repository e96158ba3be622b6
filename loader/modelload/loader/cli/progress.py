"""A progress bar for long commands, on standard error, with no dependency.

On a terminal it redraws one line (bytes, rate, ETA); elsewhere (CI logs, kubectl logs) it prints a line at
most every few seconds, so logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from modelload.loader.sizes import format_bytes

__all__ = ["ProgressBar"]


class ProgressBar:
    """Counts bytes towards ``total``; use as a context manager and call :meth:`update`."""

    def __init__(
        self,
        total: int,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        interval: float | None = None,
    ) -> None:
        self.total = total
        self.label = label
        self.done = 0
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._enabled = enabled
        self._interval = interval if interval is not None else (0.1 if self._tty else 5.0)
        self._started = time.monotonic()
        self._drawn = 0.0

    def update(self, count: int) -> None:
        self.done += count
        now = time.monotonic()
        if self._enabled and now - self._drawn >= self._interval:
            self._drawn = now
            self._draw(now)

    def _draw(self, now: float, *, final: bool = False) -> None:
        elapsed = max(now - self._started, 1e-9)
        rate = self.done / elapsed
        share = self.done / self.total if self.total else 1.0
        eta = (self.total - self.done) / rate if rate and not final else 0.0
        width = 24
        filled = int(width * share)
        bar = "#" * filled + "." * (width - filled)
        text = (
            f"{self.label} [{bar}] {share:6.1%} {format_bytes(self.done)}/{format_bytes(self.total)} "
            f"{format_bytes(rate)}/s " + (f"in {elapsed:.1f} s" if final else f"ETA {eta:.0f} s")
        )
        if self._tty:
            self._stream.write("\r" + text + ("\n" if final else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self._enabled and exc_type is None:
            self._draw(time.monotonic(), final=True)
        elif self._enabled and self._tty:
            self._stream.write("\n")
