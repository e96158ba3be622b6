"""Where a weight file's bytes sit in a segment, and which member of a fleet reads a tensor from the origin.

Peers address bytes as the origin does (a weight file and a byte range of it), so a receiver asks a peer for
exactly the range it would have asked the origin for, and the answer lands where the origin's would have.
A sidecar maps such a range to its own segment through its load plan: every tensor's record
``[record_offset, data_offset + data_length)`` lies contiguously in the segment, the record header (a
tensorizer tensor's) in the slot's lead and the data in the slot. A range is servable when it lies inside
one tensor's record: that is what every chunk the planner cuts is.

Who reads what from the origin is rendezvous hashing (highest random weight) over tensors and members: every
sidecar computes the same owner for a tensor from the same member ids, with no coordination, and when a
member joins or leaves only the tensors it owns move. Tensors, not chunks, because a peer serves only
verified tensors: two owners of one tensor's chunks would each wait for the other.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from modelload.sidecar.planner import LoadPlan

__all__ = ["RangeMap", "Span", "owner", "rank"]


@dataclass(frozen=True)
class Span:
    """A range of a weight file inside one tensor's record, and where those bytes are in the segment."""

    tensor: int
    segment_offset: int


class RangeMap:
    """Maps ``(file, offset, length)`` of a model's weight files to tensors and segment offsets."""

    def __init__(self, plan: LoadPlan) -> None:
        self.plan = plan
        files = max((t.file for t in plan.index.tensors), default=0) + 1
        records: list[list[tuple[int, int, int]]] = [[] for _ in range(files)]
        for i, entry in enumerate(plan.index.tensors):
            if entry.record_length > 0:
                records[entry.file].append(
                    (entry.record_offset, entry.record_offset + entry.record_length, i)
                )
        for row in records:
            row.sort()
        self._starts = [[start for start, _, _ in row] for row in records]
        self._records = records

    def span(self, file: int, offset: int, length: int) -> Span | None:
        """The tensor whose record holds all of ``[offset, offset + length)`` of ``file``; None if none does
        (an index read, or a range across records)."""
        if not 0 <= file < len(self._records) or length <= 0:
            return None
        row = self._records[file]
        at = bisect.bisect_right(self._starts[file], offset) - 1
        if at < 0:
            return None
        start, end, tensor = row[at]
        if offset + length > end:
            return None
        return Span(tensor=tensor, segment_offset=self.plan.record(tensor).start + (offset - start))


def rank(tensor: int, member: str, *, salt: str) -> int:
    """A member's weight for a tensor: 64 bits of SHA-256, the same on every sidecar."""
    digest = hashlib.sha256(f"{salt}\0{tensor}\0{member}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def owner(tensor: int, members: Iterable[str], *, salt: str) -> str | None:
    """The member that reads ``tensor`` from the origin: the one of highest weight (ties broken by id)."""
    return max(members, key=lambda m: (rank(tensor, m, salt=salt), m), default=None)
