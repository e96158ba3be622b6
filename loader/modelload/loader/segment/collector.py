"""Building many objects at once without paying Python's cyclic garbage collector for each batch of them.

The collector runs a pass every 700 new container objects, and a full pass once enough of them survive: a
segment of 100,000 tensors makes about half a million (the manifest's dicts and lists, a slot and a shape per
tensor, the torch tensors), and the passes over them took half the CPU of ``attach()`` + ``state_dict()``.
None of these objects forms a cycle, so nothing is lost by letting the collector look at them once, later.

A load is the other case: its index, layout and plan (about half a million objects at 100,000 tensors) live
as long as the load, while its readers make small objects by the thousand (a view per landed piece). Each of
the collector's full passes walked the plan again: a fifth of a 100,000-tensor load's CPU.
:class:`LongLived` builds them with the collector off, then freezes them (``gc.freeze``) so that the passes
the readers' objects set off walk only those.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from types import TracebackType

__all__ = ["LongLived", "paused_collector"]


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


class LongLived:
    """Objects made at the start of the block live until its end and form no cycles among themselves.

    >>> with LongLived() as kept:        # the collector is off (when it was on)
    ...     plan = build_the_plan()      # doctest: +SKIP
    ...     kept.built()                 # frozen: the collector runs again, and never walks them
    ...     run_the_load(plan)           # doctest: +SKIP

    At the end of the block everything frozen goes back to the collector's oldest generation (it is then
    walked once more, at the next full pass, and freed as usual). Objects stay reference-counted all along:
    freezing only hides them from the cycle search, so what the block drops is freed at once. The pause and
    the freeze are the process's: one load at a time uses this (the sidecar runs one).
    """

    def __init__(self) -> None:
        self._resume = False
        self._frozen = False

    def __enter__(self) -> LongLived:
        self._resume = gc.isenabled()
        gc.disable()
        return self

    def built(self) -> None:
        """What the block made so far is long-lived: freeze it, and let the collector run on what follows."""
        if self._frozen:
            return
        gc.freeze()
        self._frozen = True
        if self._resume:
            gc.enable()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._frozen:
            gc.unfreeze()
        if self._resume:
            gc.enable()
