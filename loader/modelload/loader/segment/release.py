"""Giving a consumed tensor's pages back: the writer's side of SPEC.md's memory modes (layout versions 3, 4).

A RELEASED tensor's state word is stored first, then its pages are punched out of the file
(``fallocate(PUNCH_HOLE | KEEP_SIZE)``): a reader that checks the state after its copy (the loader does)
knows the copy was whole when the state still says READY. Offsets never move: the file keeps its full size
and layout, only its resident pages shrink, so readers need no new arithmetic.

Neighbouring tensors can share a page: the tail of one slot and the lead (scratch room for a record header)
or start of the next. Such a page is punched only once every tensor touching it is released, so punching
never takes bytes from a tensor still in use or still landing.

Pages are the volume's (the layout's ``page_size``): on huge pages a page is 2 MiB (or 1 GiB) and many small
tensors share one. hugetlbfs frees only whole huge pages (a partial punch merely zeroes the bytes), and a
partial punch of a huge tmpfs page splits it, so a huge page is punched whole, once every tensor on it is
released.

In ring mode (layout version 4) a released tensor's bytes are not punched but reused for newer tensors: the
releaser only stores the state word, and the whole ring is punched once every tensor is released.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import mmap
import os
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import SegmentError
from modelload.loader.segment import _memory
from modelload.loader.segment.geometry import footprints
from modelload.loader.segment.layout import ALIGNMENT, STATE_ENTRY_LENGTH, Layout, TensorState, align

__all__ = ["Releaser", "page_span", "page_spans", "punch_hole"]

Ints = npt.NDArray[np.int64]

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the file's pages in ``[offset, offset + length)``; the file keeps its size, the range reads 0."""
    if length <= 0:
        return
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise SegmentError(
            f"cannot give pages back (fallocate PUNCH_HOLE: {os.strerror(code)}); memory modes release and "
            "ring need a memory-backed volume (tmpfs, emptyDir medium: Memory): use --memory-mode full "
            "elsewhere"
        ) from OSError(code, os.strerror(code))


def page_span(offset: int, length: int, page: int = ALIGNMENT) -> tuple[int, int]:
    """The first page and the page past the last that bytes ``[offset, offset + length)`` touch, for pages of
    ``page`` bytes."""
    if length <= 0:
        return offset // page, offset // page
    return offset // page, -(-(offset + length) // page)


def page_spans(offsets: Ints, lengths: Ints, page: int = ALIGNMENT) -> tuple[Ints, Ints]:
    """:func:`page_span` of each span of two columns: the first pages, and the pages past the last."""
    first = offsets // page
    return first, np.where(lengths > 0, -(-(offsets + lengths) // page), first)


def _shared_pages(first: Ints, stop: Ints) -> dict[int, int]:
    """The pages that several spans (``first`` to ``stop`` pages) start or end on, with how many do: the
    pages a span shares with its neighbours are only its first and its last."""
    touching = stop > first
    last = stop[touching] - 1
    starts = first[touching]
    pages, counts = np.unique(np.concatenate((starts, last[last != starts])), return_counts=True)
    several = counts > 1
    return dict(zip(pages[several].tolist(), counts[several].tolist(), strict=True))


class Releaser:
    """Marks tensors RELEASED and punches their pages, through its own descriptor and mapping of the state
    table (so it outlives the :class:`SegmentWriter`, which closes when the load ends)."""

    def __init__(self, fd: int, layout: Layout, *, leads: Sequence[int] = (), punch: bool = True) -> None:
        """``fd`` is the segment's (duplicated here); ``leads`` the scratch bytes each slot's writer used
        before the slot (a tensorizer record header), which belong to the tensor's pages too. Without
        ``punch`` (a ring, whose pages are reused) releasing only marks the state."""
        self._punch = punch
        self._fd = os.dup(fd)
        self.layout = layout
        self._page = layout.page_size
        # Whole pages: a partial huge page of hugetlbfs would never be unmapped (segment.pages.mapped_length).
        self._mm = mmap.mmap(self._fd, align(layout.data_offset, self._page), flags=mmap.MAP_SHARED)
        self._u32 = np.frombuffer(self._mm, dtype="<u4")
        first = layout.state_offset // 4
        self.states = self._u32[
            first : first + len(layout.slots) * (STATE_ENTRY_LENGTH // 4) : STATE_ENTRY_LENGTH // 4
        ]
        # Each tensor's pages, from columns: a model of 100,000 tensors would make a Slot and a Record each.
        table = layout.table
        headers = np.zeros(len(table), dtype=np.int64)
        headers[: min(len(leads), len(table))] = np.asarray(leads[: len(table)], dtype=np.int64)
        starts, lengths = footprints(table.offsets, table.nbytes, headers)
        low, high = page_spans(starts, lengths, self._page)
        self.spans = list(zip(low.tolist(), high.tolist(), strict=True))
        self._shared = _shared_pages(low, high)
        """Pages that several tensors touch, with how many of them still hold the page."""

    def fileno(self) -> int:
        return self._fd

    def release(self, index: int) -> int:
        """Mark READY tensor ``index`` RELEASED and punch what only it (or released neighbours) held.

        Returns the bytes punched. A tensor that is not READY is left alone (returns 0).
        """
        if int(self.states[index]) != TensorState.READY:
            return 0
        self.states[index] = TensorState.RELEASED
        _memory.release_fence()  # the state before the pages: a reader rechecking after a copy sees it
        start, stop = self.spans[index]
        if stop <= start or not self._punch:
            return 0
        low, high = start, stop
        for page in {start, stop - 1}:
            if page in self._shared:
                self._shared[page] -= 1
        if self._shared.get(start, 0) > 0:
            low += 1
        if self._shared.get(stop - 1, 0) > 0:
            high -= 1
        if high <= low:
            return 0
        punch_hole(self._fd, low * self._page, (high - low) * self._page)
        return (high - low) * self._page

    def close(self) -> None:
        self.states = self._u32 = np.empty(0, dtype="<u4")
        with contextlib.suppress(BufferError):
            self._mm.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)


def resident_bytes(fd: int) -> int:
    """Bytes the file holds in memory now (its allocated blocks)."""
    try:
        return os.fstat(fd).st_blocks * 512
    except OSError as exc:  # pragma: no cover - a closed descriptor
        if exc.errno == errno.EBADF:
            return 0
        raise
