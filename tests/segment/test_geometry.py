"""The geometry every side shares: where a tensor's record lies around its slot, where a ring keeps bytes."""

from __future__ import annotations

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.formats import TensorEntry
from modelload.loader.segment import MemoryMode, TensorSpec, plan_layout
from modelload.loader.segment.geometry import Record, Ring, place

DATA = 8192  # where the data region (the ring) starts in the segment
SIZE = 1000


def test_a_range_maps_to_ring_positions_and_splits_where_it_wraps() -> None:
    ring = Ring(DATA, SIZE)
    assert ring.positions(DATA + 10, 100) == [(10, 110)]
    assert ring.positions(DATA + 2950, 100) == [(950, 1000), (0, 50)], "lap 3, across the end"
    assert ring.positions(DATA - 40, 100) == [(0, 60)], "a first record header before the ring takes no room"
    assert ring.positions(DATA - 40, 40) == []
    assert ring.positions(DATA + 5, 0) == []
    with pytest.raises(ValueError, match="do not fit in a ring of 1000"):
        ring.positions(DATA, SIZE + 1)


def test_a_range_lands_in_one_piece_of_the_file_or_two_where_the_ring_wraps() -> None:
    ring = Ring(DATA, SIZE)
    assert ring.file_offset(DATA - 1) == DATA - 1, "the tables' padding is not in the ring"
    assert ring.file_offset(DATA + 2 * SIZE + 7) == DATA + 7
    assert ring.file_ranges(DATA + 1010, 90) == [(DATA + 10, 90)]
    assert ring.file_ranges(DATA + 1950, 100) == [(DATA + 950, 50), (DATA, 50)]
    # A first record header in the padding continues into the ring: one piece of the file, one request.
    assert ring.file_ranges(DATA - 40, 1040) == [(DATA - 40, 1040)]
    assert ring.taken(DATA - 40, 1040) == SIZE
    with pytest.raises(ValueError, match="1001 bytes do not fit"):
        ring.file_ranges(DATA - 40, 1041)


def test_the_ring_bytes_of_columns_of_spans_are_each_spans_own() -> None:
    ring = Ring(DATA, SIZE)
    spans = [
        (offset, length) for offset in range(DATA - 50, DATA + 60, 7) for length in (0, 1, 30, 49, 50, 500)
    ]
    offsets = np.array([offset for offset, _ in spans], dtype=np.int64)
    lengths = np.array([length for _, length in spans], dtype=np.int64)
    assert ring.taken_each(offsets, lengths).tolist() == [ring.taken(*span) for span in spans]


def _entry(record_offset: int, header: int, data: int, shape: tuple[int, ...]) -> TensorEntry:
    return TensorEntry(
        name="t",
        dtype=by_name("uint8"),
        shape=shape,
        record_offset=record_offset,
        data_offset=record_offset + header,
        data_length=data,
    )


def test_a_record_lies_with_its_header_in_the_lead_and_its_data_in_the_slot() -> None:
    layout = plan_layout([TensorSpec("t", by_name("uint8"), (5000,), lead=300)])
    slot = layout.slots[0]
    record = place(slot, _entry(1000, 300, 5000, (5000,)))
    assert record == Record(start=slot.offset - 300, header=300, data=5000, nbytes=5000)
    assert record.slot == slot.offset and record.start >= layout.state_offset
    assert record.header_span == (slot.offset - 300, 300)
    assert record.landed == record.footprint == (slot.offset - 300, 5300)
    assert record.unlanded == (slot.offset + 5000, 0)


def test_a_meta_tensor_holds_its_whole_slot_though_no_fetch_brings_its_zeros() -> None:
    layout = plan_layout([TensorSpec("m", by_name("uint8"), (4096,), lead=120)])
    slot = layout.slots[0]
    record = place(slot, _entry(0, 120, 0, (4096,)))
    assert record.landed == (slot.offset - 120, 120), "the header alone"
    assert record.footprint == (slot.offset - 120, 120 + 4096)
    assert record.unlanded == (slot.offset, 4096) and record.data_end == slot.offset
    assert record.end == slot.offset + 4096


def test_a_ring_layout_gives_its_ring_and_other_modes_none() -> None:
    spec = TensorSpec("t", by_name("uint8"), (100,))
    ring = plan_layout([spec], memory_mode=MemoryMode.RING, ring_size=5000)
    assert ring.ring == Ring(ring.data_offset, 8192), "rounded up to whole pages"
    assert plan_layout([spec]).ring is None
    assert plan_layout([spec], memory_mode=MemoryMode.RELEASE).ring is None
