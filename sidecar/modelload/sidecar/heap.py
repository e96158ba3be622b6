"""How the sidecar's C heap hands freed memory back: big blocks always go straight back to the system.

glibc's ``malloc`` serves a block of 128 KiB or more with a mapping of its own, returned to the system when
freed, but it raises that threshold to the size of every such block freed (up to 32 MiB): after the first
few big blocks a load frees (a shard's header text, a column of 100,000 offsets, a batch of the manifest),
blocks of that size come from the heap instead, where what is freed stays in the process, interleaved with
what lives on: a 100,000-tensor load peaked 11 MiB higher that way (120 MiB against 109, a local directory).
:func:`tune_heap` pins the threshold at :data:`MMAP_THRESHOLD`, which also pins the trim threshold: freed
big blocks leave the process, and the heap's free top is returned. It also caps the heaps (arenas) glibc
keeps for threads at :data:`ARENAS`: each of 8 or 16 reader threads otherwise gets one, each keeping what its
thread freed (about 2.5 MiB in all with 16 readers). The threads seldom take a block from the C heap
(Python objects come from Python's own allocator, under the GIL), so two heaps are enough.

Python's small objects come from its own allocator, in arenas, and are not touched by this. The settings
are the process's, which is the sidecar's own (the loader library, in an application's process, never
sets them). Where the C library is not glibc, or where whoever runs the sidecar set any ``MALLOC_*``
variable (glibc's own way to tune these: ``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``...), nothing is
changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from collections.abc import Mapping

__all__ = ["ARENAS", "MMAP_THRESHOLD", "tune_heap"]

log = logging.getLogger(__name__)

MMAP_THRESHOLD = (1 << 20) + (64 << 10)
"""Blocks of this many bytes or more get a mapping of their own, fixed. Not glibc's 128 KiB: the 1 MiB
blocks a load reads and frees by the hundred (a shard's look-up and index, one request each) would then be
a fresh mapping each, 256 zeroed pages faulted in every time; measured on the 100,000-tensor local load
(median of 5, load 3.5), 128 KiB cost about 0.15 CPU-s per GiB more than this for 2 MiB less at the peak
(101-103 MiB against 103-106; 117 with glibc's own moving threshold)."""

ARENAS = 2
"""The most heaps glibc's threads share (its default is 8 per core)."""

_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt()'s parameter numbers, from glibc's malloc.h


def tune_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Pin glibc's mapping threshold at :data:`MMAP_THRESHOLD` and its threads' heaps at :data:`ARENAS` (see
    the module's docstring); whether both were set. Harmless to call twice."""
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name.startswith("MALLOC_") for name in environ):
        log.debug("MALLOC_* variables set: the C heap is left as they tune it")
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mapped = libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))
        arenas = libc.mallopt(ctypes.c_int(_M_ARENA_MAX), ctypes.c_int(ARENAS))
        return bool(mapped and arenas)
    except (OSError, AttributeError):  # no C library to load, or one without mallopt
        return False
