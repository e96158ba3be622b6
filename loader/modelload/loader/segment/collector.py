"""Building many objects at once without paying Python's cyclic garbage collector for each batch of them.

The collector runs a pass every 700 new container objects, and a full pass once enough of them survive: a
segment of 100,000 tensors makes about half a million (the manifest's dicts and lists, a slot and a shape per
tensor, the torch tensors), and the passes over them took half the CPU of ``attach()`` + ``state_dict()``.
None of these objects forms a cycle, so nothing is lost by letting the collector look at them once, later.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused_collector"]


@contextlib.contextmanager
def paused_collector() -> Iterator[None]:
    """Hold off the cyclic collector inside the block (when it was enabled: a caller's choice is kept)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
