"""Which bytes of a ring segment's ring are taken, and by which tensor: ring mode's admission bookkeeping.

In a ring segment (SPEC.md, layout version 4) the data byte at segment offset ``x`` lives at ring position
``(x - data_offset) mod ring_size``. A range may land only where no tensor that has landed, or is landing, and
is not yet released has a byte (its record header in the padding before its slot counts too). Tensors are
released in any order, and load order need not be file order (``--priority``), so the taken bytes are a set
of intervals, not a head and a tail: kept sorted and disjoint, one bisection answers whether a range is free.
"""

from __future__ import annotations

import bisect

from modelload.loader.segment.geometry import Ring

__all__ = ["RingSpace"]


class RingSpace:
    """The ring's taken intervals, by owner. Not thread-safe: the caller holds its own lock."""

    def __init__(self, ring: Ring) -> None:
        if ring.size <= 0:
            raise ValueError(f"a ring needs a positive size, got {ring.size}")
        self.ring = ring
        self._starts: list[int] = []
        self._stops: list[int] = []
        self._owners: list[int] = []
        self._taken_by: dict[int, list[int]] = {}
        self.used = 0
        """Bytes taken."""

    def holder(self, offset: int, length: int) -> int | None:
        """The owner of a taken byte among segment bytes ``[offset, offset + length)``; None when all are
        free."""
        for start, stop in self.ring.positions(offset, length):
            i = bisect.bisect_left(self._starts, stop)  # intervals before i start below stop
            if i and self._stops[i - 1] > start:  # disjoint and sorted: the last of them ends last
                return self._owners[i - 1]
        return None

    def take(self, owner: int, offset: int, length: int) -> None:
        """Mark segment bytes ``[offset, offset + length)`` taken by ``owner``; they must be free."""
        for start, stop in self.ring.positions(offset, length):
            i = bisect.bisect_left(self._starts, stop)
            if i and self._stops[i - 1] > start:
                raise ValueError(f"ring bytes [{start}, {stop}) are taken by {self._owners[i - 1]}")
            self._starts.insert(i, start)
            self._stops.insert(i, stop)
            self._owners.insert(i, owner)
            self._taken_by.setdefault(owner, []).append(start)
            self.used += stop - start

    def free(self, owner: int) -> int:
        """Give back every byte ``owner`` took; returns how many."""
        freed = 0
        for start in self._taken_by.pop(owner, ()):
            i = bisect.bisect_left(self._starts, start)
            freed += self._stops[i] - start
            del self._starts[i], self._stops[i], self._owners[i]
        self.used -= freed
        return freed
