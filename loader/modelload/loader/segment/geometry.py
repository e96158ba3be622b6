"""Where a tensor's bytes lie in a segment, and where a ring keeps them: the arithmetic every side shares.

Two pieces of geometry, each written once, here, for the planner, the peers, the memory modes, the layout,
the writer and the reader:

- **A tensor's record** (:class:`Record`). A weight file stores a tensor as a record: a header (tensorizer's
  hashes and encryption parameters; nothing for safetensors), then the data. The sidecar fetches the record
  in one range and lands the header in the *lead*, the padding right before the slot that readers ignore
  (SPEC.md allows a writer scratch there), so the data lands in the slot with no copy. A record therefore
  starts ``header`` bytes before its slot; what a fetch lands is the header and the file's data; what the
  tensor holds in the segment is the header and its whole slot (a meta tensor's zeros, which no fetch
  brings, included).
- **The ring** (:class:`Ring`) of a layout-version-4 segment (memory mode ring): the data byte at segment
  offset ``x`` lives at ring position ``(x - data_offset) mod size``, file offset ``data_offset +`` that.
  Bytes before the data region (the first slot's record header, in the tables' padding) are not in the
  ring: they stay where they are and take no ring bytes. A span of at most ``size`` ring bytes is one piece
  of the file, or two where it wraps past the ring's end.

Spans are ``(offset, length)`` pairs of segment offsets (the manifest's arithmetic), ring positions are
``[start, stop)`` pairs. Nothing here reads or allocates: the ring's admission asks :meth:`Ring.positions`
for every chunk a load lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:  # the layout builds its ring from this module
    from modelload.loader.formats._index import TensorEntry
    from modelload.loader.segment.layout import Slot

__all__ = ["Record", "Ring", "footprints", "place"]

Span = tuple[int, int]
"""``(segment offset, length)``."""
Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Record:
    """Where one tensor's record lies in a segment: its header in the lead, then its slot."""

    start: int
    """Segment offset of the record's first byte: its header's, or the slot's when it has none."""
    header: int
    """Bytes of record header before the data (tensorizer); 0 for safetensors."""
    data: int
    """Bytes of data the weight file holds: the slot's, or 0 for a meta tensor (zeros, no data)."""
    nbytes: int
    """Bytes of the slot."""

    @property
    def slot(self) -> int:
        """Segment offset of the slot: right after the header."""
        return self.start + self.header

    @property
    def data_end(self) -> int:
        """Segment offset past the last data byte a fetch lands."""
        return self.start + self.header + self.data

    @property
    def end(self) -> int:
        """Segment offset past the slot's last byte."""
        return self.start + self.header + self.nbytes

    @property
    def header_span(self) -> Span:
        """The record header as landed (length 0: none)."""
        return self.start, self.header

    @property
    def landed(self) -> Span:
        """What fetching the record lands: header, then the file's data."""
        return self.start, self.header + self.data

    @property
    def footprint(self) -> Span:
        """What the tensor holds in the segment: header and whole slot. A ring's admission takes it, and
        releasing the tensor gives back its pages."""
        return self.start, self.header + self.nbytes

    @property
    def unlanded(self) -> Span:
        """The slot bytes no fetch writes (a meta tensor's zeros); length 0 for most tensors."""
        return self.data_end, self.nbytes - self.data

    @classmethod
    def in_slot(cls, slot: Slot, *, header: int = 0, data: int | None = None) -> Record:
        """The record of ``header`` bytes of header and ``data`` bytes of data (default: the whole slot)
        landed into ``slot`` and its lead."""
        data = slot.nbytes if data is None else data
        return cls(start=slot.offset - header, header=header, data=data, nbytes=slot.nbytes)


def footprints(offsets: Ints, nbytes: Ints, headers: Ints) -> tuple[Ints, Ints]:
    """:attr:`Record.footprint` of many records at once (starts, lengths), from their slots' offsets and
    sizes and their headers' bytes: what asking every tensor of a large model costs as numpy."""
    return offsets - headers, headers + nbytes


def place(slot: Slot, entry: TensorEntry) -> Record:
    """Where tensor ``entry``'s record lies, given the slot a plan gave it (its lead holds the header)."""
    return Record.in_slot(slot, header=entry.header_length, data=entry.data_length)


@dataclass(frozen=True, slots=True)
class Ring:
    """A ring segment's data region: ``size`` bytes from file offset ``data_offset``, reused lap after lap."""

    data_offset: int
    size: int

    def file_offset(self, offset: int) -> int:
        """Where segment byte ``offset`` lives in the file (bytes before the data region stay put)."""
        if offset < self.data_offset:
            return offset
        return self.data_offset + (offset - self.data_offset) % self.size

    def taken(self, offset: int, length: int) -> int:
        """How many ring bytes segment bytes ``[offset, offset + length)`` take: all but those before the
        data region."""
        return max(offset + length - max(offset, self.data_offset), 0)

    def taken_each(self, offsets: Ints, lengths: Ints) -> Ints:
        """:meth:`taken` of each span of two columns: a model of 100,000 tensors is checked against the
        ring at once."""
        return np.maximum(offsets + lengths - np.maximum(offsets, self.data_offset), 0)

    def file_ranges(self, offset: int, length: int) -> list[Span]:
        """``(file offset, length)`` of the pieces of the file that hold segment bytes ``[offset, offset +
        length)``, in order: one, or two where the ring wraps. ValueError when they take more bytes than the
        ring holds."""
        self._check(offset, length)
        start = self.file_offset(offset)
        first = min(length, self.data_offset + self.size - start)
        return [(start, length)] if first == length else [(start, first), (self.data_offset, length - first)]

    def positions(self, offset: int, length: int) -> list[tuple[int, int]]:
        """The ring positions ``[start, stop)`` that segment bytes ``[offset, offset + length)`` take: one
        interval, two where they wrap, none for bytes all before the data region."""
        return [
            (max(at, self.data_offset) - self.data_offset, at + n - self.data_offset)
            for at, n in self.file_ranges(offset, length)
            if at + n > max(at, self.data_offset)
        ]

    def _check(self, offset: int, length: int) -> None:
        taken = self.taken(offset, length)
        if taken > self.size:
            stop = offset + length
            raise ValueError(
                f"{taken} bytes do not fit in a ring of {self.size} (segment bytes [{offset}, {stop}))"
            )
