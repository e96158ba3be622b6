"""Byte-level progress within a chunk: ``/status``, ``/metrics`` and ``monitor`` move as bytes land.

A chunk is up to ``--chunk-size`` (32 MiB) of one range request; on a slow link it takes minutes, and
progress counted per chunk would sit still that long. The sources layer reports each read of a transfer
(:func:`~modelload.sidecar.sources.metered`); a :class:`ChunkMeter` turns those into tensor bytes for the
observers. A chunk's range can hold more than tensor data (a tensorizer chunk carries headers), so landed
bytes are scaled to the chunk's tensor bytes, and :meth:`ChunkMeter.finish` reports what rounding left, so
a chunk counts exactly its tensor bytes, once, whatever retries happened inside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["ChunkMeter"]


class ChunkMeter:
    """Counts one chunk's landed bytes into ``report`` as tensor bytes (``data`` of ``length`` landed)."""

    def __init__(self, report: Callable[[int], None], *, data: int, length: int) -> None:
        self._report = report
        self._data = data
        self._length = max(length, 1)
        self._landed = 0
        self._reported = 0
        self._lock = threading.Lock()  # a chunk is one thread's, but a source may hand off to a helper

    def __call__(self, count: int) -> None:
        with self._lock:
            self._landed = min(self._landed + count, self._length)
            due = self._landed * self._data // self._length - self._reported
            self._reported += due
        if due > 0:
            self._report(due)

    def finish(self) -> None:
        """The chunk is in: report the rest of its tensor bytes."""
        with self._lock:
            due, self._reported = self._data - self._reported, self._data
        if due > 0:
            self._report(due)
