"""Memory ordering between the segment's writer and its readers in other processes.

SPEC.md asks the writer to make a slot's bytes visible before the state word that publishes it (release),
and readers to read the state word before the bytes (acquire). CPython offers no fence instruction. On
x86-64 (total store order, which covers the GPU nodes this runs on) stores become visible in program order
and loads are not reordered with older loads, so issuing the stores in order is enough, and these functions
do nothing. On weakly ordered CPUs (arm64) they take a round-trip through a lock, whose atomic
read-modify-write instructions order the surrounding accesses on the calling CPU in practice. That is not
a guarantee the language gives: a C extension with a real fence is the fix if arm64 inference nodes matter.
"""

from __future__ import annotations

import platform
import threading

__all__ = ["acquire_fence", "release_fence"]

_STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
_lock = threading.Lock()


def release_fence() -> None:
    """Order every earlier store before every later one (writer side)."""
    if not _STRONGLY_ORDERED:
        with _lock:
            pass


def acquire_fence() -> None:
    """Order every earlier load before every later one (reader side)."""
    if not _STRONGLY_ORDERED:
        with _lock:
            pass
