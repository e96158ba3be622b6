"""Where a segment's slots go: each on a page of its own, or packed as the weight files hold them.

A slot on a page of its own is what every layout version reads. A mixture of experts' 100,000 tensors of
4-16 KiB each on a page would pad 1 GiB with 0.2 GiB of zeros that the writer allocates and fills; packed
(layout version 5, SPEC.md), each slot starts right after the one before it and its lead, on the next
multiple of its element's size, so a weight file's neighbouring tensors are as contiguous in the segment as
in the file. :func:`place_slots` chooses and places; ``layout`` builds the rest of the segment around it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from modelload.loader.segment.kinds import Kinds

__all__ = ["ALIGNMENT", "PACKED_ALIGNMENT", "PACKING_MIN", "PACKING_WASTE", "align", "place_slots"]

Offsets = np.ndarray[Any, np.dtype[np.int64]]

ALIGNMENT = 4096
PACKED_ALIGNMENT = 1
"""The header's alignment field in a packed (version 5) segment: each slot starts right after the one before
it (and its lead), on the next multiple of its own element's size, so neighbouring tensors of a weight file
are as contiguous in the segment as in the file and a range of them lands as one span."""
PACKING_WASTE = 0.01
"""The share of a model's bytes that page-aligned slots may add as padding before its segment is packed: a
mixture of experts' 100,000 tensors of 4-16 KiB pad 1 GiB with 0.2 GiB of zeros, each page of which the
writer allocates and fills; a dense model's few hundred big tensors pad it with far less than 1%."""
PACKING_MIN = 8 << 20
"""Nor is a segment packed for less padding than this (2048 pages): a small model costs little either way,
and an unpacked segment (versions 1 and 2) is one that older loaders read too."""


def align(value: int, to: int = ALIGNMENT) -> int:
    """The smallest multiple of ``to`` at or above ``value``."""
    return -(-value // to) * to


def place_slots(sizes: Offsets, leads: Offsets, kinds: Kinds, *, packed: bool | None) -> tuple[Offsets, int]:
    """The slots' offsets from the start of the first slot's lead, and the header's alignment: on pages, or
    packed where ``packed`` says so (None: where pages would pad the bytes by more than
    :data:`PACKING_WASTE` and :data:`PACKING_MIN`)."""
    paged = _paged_offsets(sizes, leads)
    if packed is False or not len(sizes):
        return paged, ALIGNMENT
    items = np.asarray([dtype.itemsize for dtype in kinds.dtypes], dtype=np.int64)[kinds.of]
    tight = _packed_offsets(sizes, leads, items)
    padding = int(paged[-1]) - int(tight[-1])  # the same last slot, placed both ways
    if packed or padding > max(PACKING_WASTE * int(sizes.sum()), PACKING_MIN):
        return tight, PACKED_ALIGNMENT
    return paged, ALIGNMENT


def _packed_offsets(sizes: Offsets, room: Offsets, items: Offsets) -> Offsets:
    """Each slot right after the slot before it and its own lead (``room``), moved on to the next multiple of
    its element size (``items``) where that end is not one. The first slot starts on a page."""
    relative = _stepped(align(int(room[0])), sizes[:-1] + room[1:])
    off = np.flatnonzero(relative % items)
    if not len(off):  # a weight file's tensors in their natural alignment: the usual case, all at once
        return relative
    placed, first = relative.tolist(), int(off[0])  # from the first slot off its alignment, one by one
    ends, leads, steps = sizes.tolist(), room.tolist(), items.tolist()
    for i in range(first, len(placed)):
        placed[i] = align(placed[i - 1] + ends[i - 1] + leads[i], steps[i])
    return np.asarray(placed, dtype=np.int64)


def _paged_offsets(sizes: Offsets, room: Offsets) -> Offsets:
    """Each slot on the first page boundary that leaves room for its lead (``room``) after the slot before
    it."""
    if not len(sizes):
        return np.zeros(0, dtype=np.int64)
    return _stepped(align(int(room[0])), -(-(sizes[:-1] + room[1:]) // ALIGNMENT) * ALIGNMENT)


def _stepped(first: int, steps: Offsets) -> Offsets:
    """``first``, then each of ``steps`` further on from the one before."""
    relative = np.empty(len(steps) + 1, dtype=np.int64)
    relative[0] = first
    np.cumsum(steps, out=relative[1:])
    relative[1:] += first
    return relative
