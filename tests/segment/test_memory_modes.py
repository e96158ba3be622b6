"""Layout versions 3 (memory mode release) and 4 (ring): header fields, the consumer table, releasing pages.

The golden bytes pin what SPEC.md says about versions 3 and 4; the rest checks each rule with a real tmpfs
file (punching holes needs one) and real processes' views of it. The ring itself (version 4's modular data
region, mapped twice) is in ``test_ring.py``.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import attach
from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentError, SegmentLayoutError, SegmentVersionError, TensorReleasedError
from modelload.loader.segment import (
    MemoryMode,
    SegmentReader,
    SegmentWriter,
    TensorSpec,
    TensorState,
    plan_layout,
)
from modelload.loader.segment import consumers as consumers_module
from modelload.loader.segment import layout as layout_module
from modelload.loader.segment import validate as validate_module
from modelload.loader.segment.consumers import ConsumerTable, table_path
from modelload.loader.segment.geometry import Record
from modelload.loader.segment.release import Releaser, page_span
from tests.segment.helpers import small_layout
from tests.segment.test_golden import CREATED_NS, GOLDEN_HEADER, GOLDEN_MANIFEST, LOAD_ID

GOLDEN_RELEASE_HEADER = (
    GOLDEN_HEADER[:8]
    + bytes.fromhex("03000000")  # layout version 3
    + GOLDEN_HEADER[12:96]  # the same geometry, ids and times
    + bytes.fromhex("01000000000000000000000000000000")  # memory_mode 1 (release), reserved, ring_size 0
    + bytes(16)  # reserved
)
GOLDEN_RING_HEADER = (
    GOLDEN_HEADER[:8]
    + bytes.fromhex("04000000")  # layout version 4
    + GOLDEN_HEADER[12:16]
    + bytes.fromhex("0040000000000000")  # segment_length 16384: the tables (12288) and the ring (4096)
    + GOLDEN_HEADER[24:96]  # the same manifest, tables, data_offset, data_length 8192 (the manifest's), ids
    + bytes.fromhex("02000000000000000010000000000000")  # memory_mode 2 (ring), reserved, ring_size 4096
    + bytes(16)  # reserved
)
GOLDEN_TABLE_HEADER = bytes.fromhex(
    "4d4f44454c434f4e"
    "01000000"
    "40000000"  # magic MODELCON, table version 1, capacity 64
    "efcdab8967452301"
    "0200000000000000"  # load_id, tensor_count 2
    "80000000"
    "00000000"  # entry_length 128 (64 bytes of fields + 1 byte of bitmap, padded to 64), reserved
)


def ring_layout(ring: int = 4096, **kwargs: object) -> layout_module.Layout:
    base = small_layout()
    return plan_layout(
        [TensorSpec(s.name, s.dtype, s.shape) for s in base.slots],
        metadata=base.metadata,
        memory_mode=MemoryMode.RING,
        ring_size=ring,
        **kwargs,  # type: ignore[arg-type]
    )


def release_layout() -> layout_module.Layout:
    base = small_layout()
    return plan_layout(
        [TensorSpec(s.name, s.dtype, s.shape) for s in base.slots],
        metadata=base.metadata,
        memory_mode=MemoryMode.RELEASE,
    )


def test_a_release_segment_is_layout_3_with_its_mode_in_the_header(shm_dir: Path) -> None:
    path = shm_dir / "release.seg"
    with SegmentWriter.create(
        path, release_layout(), load_id=LOAD_ID, created_ns=CREATED_NS, heartbeat=False
    ):
        data = path.read_bytes()
        table = table_path(path).read_bytes()
    assert data[:128] == GOLDEN_RELEASE_HEADER
    assert data[4096 : 4096 + len(GOLDEN_MANIFEST)] == GOLDEN_MANIFEST, "the manifest is version 1's"
    assert table[: len(GOLDEN_TABLE_HEADER)] == GOLDEN_TABLE_HEADER
    assert len(table) == 4096 + 64 * 128 and table[len(GOLDEN_TABLE_HEADER) :] == bytes(len(table) - 40)
    assert os.stat(table_path(path)).st_mode & 0o777 == 0o666, "every container of the pod may register"
    with SegmentReader.open(path) as reader:
        assert (reader.memory_mode, reader.header.ring_size) == (MemoryMode.RELEASE, 0)


def test_a_ring_segment_is_layout_4_its_tables_then_its_ring(shm_dir: Path) -> None:
    path = shm_dir / "ring.seg"
    with SegmentWriter.create(path, ring_layout(), load_id=LOAD_ID, created_ns=CREATED_NS, heartbeat=False):
        data = path.read_bytes()
        table = table_path(path).read_bytes()
    assert data[:128] == GOLDEN_RING_HEADER
    assert len(data) == 12288 + 4096, "the file ends with the ring, not with the manifest's last slot"
    assert data[4096 : 4096 + len(GOLDEN_MANIFEST)] == GOLDEN_MANIFEST, "offsets are the manifest's as ever"
    assert table[: len(GOLDEN_TABLE_HEADER)] == GOLDEN_TABLE_HEADER
    with SegmentReader.open(path) as reader:
        assert (reader.memory_mode, reader.header.ring_size) == (MemoryMode.RING, 4096)
        assert reader.header.data_length == 8192


def test_a_version_3_ring_of_an_older_writer_is_still_read_as_a_full_size_file(shm_dir: Path) -> None:
    path = shm_dir / "old-ring.seg"
    layout = release_layout()
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        writer.slot(1)[:] = b"\x07" * 8
        writer.mark_ready(1)
    with path.open("r+b") as f:  # what an older sidecar wrote in ring mode: version 3, mode 2, a ring size
        f.seek(96)
        f.write(struct.pack("<IIQ", 2, 0, 8192))
    with SegmentReader.open(path) as reader:
        assert (reader.header.layout_version, reader.memory_mode) == (3, MemoryMode.RING)
        assert bytes(reader.view(1)) == b"\x07" * 8, "offsets are file offsets in a version-3 ring"


def test_a_full_mode_segment_keeps_layout_1_and_no_consumer_table(shm_dir: Path) -> None:
    path = shm_dir / "full.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False):
        assert struct.unpack_from("<I", path.read_bytes(), 8)[0] == 1
    assert not table_path(path).exists()


def test_a_loader_that_knows_versions_1_and_2_refuses_a_version_3_segment_saying_to_upgrade(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shm_dir / "new.seg"
    with SegmentWriter.create(path, release_layout(), heartbeat=False):
        pass
    monkeypatch.setattr(validate_module, "LAYOUT_VERSIONS", (1, 2))  # the loader of the previous release
    with pytest.raises(SegmentVersionError, match=r"version 3 is not known .* reads versions 1, 2; install"):
        SegmentReader.open(path)


def test_a_loader_that_knows_versions_1_to_3_refuses_a_ring_segment_saying_to_upgrade(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shm_dir / "ring.seg"
    with SegmentWriter.create(path, ring_layout(), heartbeat=False):
        pass
    monkeypatch.setattr(validate_module, "LAYOUT_VERSIONS", (1, 2, 3))  # would read past the ring's end
    with pytest.raises(
        SegmentVersionError, match=r"version 4 is not known .* reads versions 1, 2, 3; install"
    ):
        SegmentReader.open(path)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (96, struct.pack("<I", 0), "memory mode 0 is not 1 .release. or 2 .ring."),
        (96, struct.pack("<I", 7), "memory mode 7"),
        (100, struct.pack("<I", 1), "reserved header bytes"),
        (
            104,
            struct.pack("<Q", 8192),
            "ring size 8192 must be a positive multiple of 4096 in ring mode, else 0",
        ),
        (120, b"\x01", "reserved header bytes"),
    ],
)
def test_a_hostile_version_3_header_is_refused(
    shm_dir: Path, offset: int, value: bytes, message: str
) -> None:
    path = shm_dir / "hostile.seg"
    with SegmentWriter.create(path, release_layout(), heartbeat=False):
        pass
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(value)
    with pytest.raises(SegmentLayoutError, match=message):
        SegmentReader.open(path)


def test_a_version_1_header_with_memory_fields_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "v1.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False):
        pass
    with path.open("r+b") as f:
        f.seek(96)
        f.write(struct.pack("<I", 2))
    with pytest.raises(SegmentLayoutError, match="reserved header bytes"):
        SegmentReader.open(path)


def test_a_ring_size_needs_the_ring_mode_and_the_ring_mode_a_size() -> None:
    with pytest.raises(SegmentLayoutError, match="exactly when the memory mode is ring"):
        plan_layout([], memory_mode=MemoryMode.RING)
    with pytest.raises(SegmentLayoutError, match="exactly when the memory mode is ring"):
        plan_layout([], memory_mode=MemoryMode.RELEASE, ring_size=4096)


# --- the consumer table ---------------------------------------------------------------------------------


def test_consumers_register_mark_and_leave_and_the_writer_sees_it(shm_dir: Path) -> None:
    path = shm_dir / "table.seg"
    with SegmentWriter.create(path, ring_layout(), load_id=LOAD_ID, heartbeat=False):
        view = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=False)
        one = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="rank0")
        two = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="rank1")
        one.mark([1])
        entries = view.entries()
        assert [(e.slot, e.label, e.pid, e.consumed) for e in entries] == [
            (0, "rank0", os.getpid(), 1),
            (1, "rank1", os.getpid(), 0),
        ]
        assert list(view.consumed_bits(0)) == [0b10] and list(view.consumed_bits(1)) == [0]
        one.leave()
        assert [(e.label, e.active) for e in view.entries()] == [("rank0", False), ("rank1", True)]
        three = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="late")
        assert three.slot == 0 and list(view.consumed_bits(0)) == [0], "a reclaimed entry starts empty"
        two.leave()
        three.leave()
        view.close()


def test_an_entry_whose_heartbeat_expired_is_claimed_again(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shm_dir / "expired.seg"
    with SegmentWriter.create(path, ring_layout(), load_id=LOAD_ID, heartbeat=False):
        monkeypatch.setattr(consumers_module, "CAPACITY", 1)
        consumers_module.create_table(path, load_id=LOAD_ID, tensor_count=2, capacity=1)
        dead = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="dead")
        with pytest.raises(SegmentError, match=r"all 1 consumer entries .* are taken by live consumers"):
            ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register()
        dead._stop.set()  # the process died: no more heartbeats
        stale = time.time_ns() - int((consumers_module.EXPIRY + 1) * 1e9)
        dead.table._write(dead._at + 16, "<Q", stale)
        fresh = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="new")
        assert fresh.slot == 0
        fresh.leave()


def test_a_consumer_table_of_another_load_or_none_at_all_is_a_clear_error(shm_dir: Path) -> None:
    path = shm_dir / "other.seg"
    with SegmentWriter.create(path, ring_layout(), load_id=LOAD_ID, heartbeat=False):
        with pytest.raises(SegmentLayoutError, match=r"belongs to another load .* attach again"):
            ConsumerTable.open(path, load_id=LOAD_ID + 2, tensor_count=2, write=True)
        table_path(path).unlink()
        with pytest.raises(SegmentLayoutError, match=r"consumer table .* is missing"):
            attach(path, timeout=1, notify=False)


def test_the_writers_view_survives_a_scribbled_header_that_a_consumer_refuses(shm_dir: Path) -> None:
    path = shm_dir / "scribbled.seg"
    with SegmentWriter.create(path, ring_layout(), load_id=LOAD_ID, heartbeat=False):
        one = ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True).register(label="rank0")
        one.mark([1])
        # Any container of the pod may overwrite the header after the segment is published: the writer,
        # which knows the geometry it created, must still read the entries rather than fail the load.
        with open(table_path(path), "r+b") as scribbler:
            scribbler.write(b"\xff" * 64)
        with pytest.raises(SegmentLayoutError, match="not a version-1 modelload consumer table"):
            ConsumerTable.open(path, load_id=LOAD_ID, tensor_count=2, write=True)
        view = ConsumerTable.for_writer(path, tensor_count=2)
        assert [(e.slot, e.label, e.consumed) for e in view.entries()] == [(0, "rank0", 1)]
        assert list(view.consumed_bits(0)) == [0b10]
        one.leave()
        view.close()


# --- releasing ------------------------------------------------------------------------------------------


def _filled(path: Path, sizes: list[int], *, leads: list[int] | None = None) -> SegmentWriter:
    specs = [
        TensorSpec(f"t{i}", by_name("uint8"), (n,), lead=(leads or [0] * len(sizes))[i])
        for i, n in enumerate(sizes)
    ]
    layout = plan_layout(specs, memory_mode=MemoryMode.RELEASE)
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    for i, n in enumerate(sizes):
        writer.slot(i)[:] = bytes([i + 1]) * n
        writer.mark_ready(i)
    return writer


def test_released_pages_go_back_and_a_shared_page_waits_for_both_neighbours(shm_dir: Path) -> None:
    path = shm_dir / "punch.seg"
    # t1's lead (a record header's room) sits in the last page of t0: that page is shared.
    writer = _filled(path, [3 * 4096 + 100, 5 * 4096, 4096], leads=[0, 200, 0])
    releaser = Releaser(writer.fileno(), writer.layout, leads=[0, 200, 0])
    before = os.stat(path).st_blocks * 512
    assert releaser.release(0) == 3 * 4096, "the shared last page stays while t1 holds it"
    assert releaser.release(0) == 0, "a released tensor is released once"
    assert releaser.release(1) == 6 * 4096, "t1's pages and the page it shared with t0"
    assert before - os.stat(path).st_blocks * 512 == 9 * 4096
    with SegmentReader.open(path) as reader:
        assert [reader.state(i) for i in range(3)] == [TensorState.RELEASED] * 2 + [TensorState.READY]
        assert bytes(reader.view(2)) == b"\x03" * 4096, "the neighbour's bytes are untouched"
        with pytest.raises(TensorReleasedError, match=r"'t0' was released.*--memory-mode full"):
            reader.wait([0], timeout=1)
    releaser.close()
    writer.close()


def test_a_late_reader_gets_a_clear_error_and_a_consumer_s_copy_is_whole(shm_dir: Path) -> None:
    path = shm_dir / "late.seg"
    writer = _filled(path, [8192, 8192])
    model = attach(path, timeout=2, notify=False)
    assert model.memory_mode == "release"
    copy = model.numpy("t0").copy()
    model.consumed("t0")
    releaser = Releaser(writer.fileno(), writer.layout)
    releaser.release(0)
    assert (copy == 1).all()
    late = attach(path, timeout=2, notify=False, register=False)
    with pytest.raises(TensorReleasedError, match=r"every consumer .* had copied it"):
        late.numpy("t0")
    with pytest.raises(TensorReleasedError):
        late.numpy("t0", wait=False)
    assert np.array_equal(late.numpy("t1"), np.full(8192, 2, np.uint8))
    with pytest.raises(TensorReleasedError, match="'t1'"):  # unregistered: t1 released under the copy
        releaser.release(1)
        late.consumed("t1")
    late.close()
    model.close()
    releaser.close()
    writer.close()


def test_the_releasers_pages_and_shared_pages_are_each_tensors_record_on_the_volumes_pages(
    shm_dir: Path,
) -> None:
    # Tensors of many sizes and leads (some empty, some sharing pages with both neighbours, some several
    # pages long; the last ten given no lead), against each tensor's record taken one by one, for 4 KiB pages
    # and for 64 KiB ones (the releaser reads the page size from the layout).
    rng = np.random.default_rng(11)
    sizes = rng.choice([0, 1, 100, 4000, 4096, 9000, 70_000], size=400).tolist()
    leads = rng.choice([0, 0, 64, 300, 5000], size=400).tolist()
    specs = [
        TensorSpec(f"t{i}", by_name("uint8"), (n,), lead=lead)
        for i, (n, lead) in enumerate(zip(sizes, leads, strict=True))
    ]
    layout = plan_layout(specs, memory_mode=MemoryMode.RELEASE)
    given = [*leads[:390], *[0] * 10]
    with SegmentWriter.create(shm_dir / "spans.seg", layout, heartbeat=False) as writer:
        for page in (4096, 65536):
            releaser = Releaser(
                writer.fileno(), dataclasses.replace(layout, page_size=page), leads=leads[:390]
            )
            spans = [
                page_span(*Record.in_slot(s, header=given[s.index]).footprint, page) for s in layout.slots
            ]
            touches: Counter[int] = Counter()
            for start, stop in spans:
                if stop > start:
                    touches.update({start, stop - 1})
            assert releaser.spans == spans
            assert releaser._shared == {p: n for p, n in touches.items() if n > 1} and releaser._shared
            releaser.close()
