"""Layout version 4: a ring segment's data region is a ring that tensors reuse, mapped twice back to back.

Each test writes real files in /dev/shm and reads them with the real reader, so the double mapping, the
modular offsets and the wrap are exercised as a sidecar and an app use them. The golden header and the
older loader's refusal are in ``test_memory_modes.py``.
"""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader import attach
from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentLayoutError, TensorReleasedError
from modelload.loader.segment import (
    MemoryMode,
    SegmentReader,
    SegmentWriter,
    TensorSpec,
    TensorState,
    plan_layout,
)
from modelload.loader.segment.layout import Layout
from modelload.loader.segment.release import Releaser
from tests.segment.helpers import expected_bytes

RING = 4 * 4096


def _layout(sizes: list[int], ring: int = RING) -> Layout:
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    return plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=ring)


def _maps(path: Path) -> int:
    return sum(str(path) in line for line in Path("/proc/self/maps").read_text().splitlines())


def test_tensors_land_lap_after_lap_and_every_view_is_whole_across_the_wrap(shm_dir: Path) -> None:
    path = shm_dir / "ring.seg"
    # Ring positions: t0 [0, 10000), t1 [12288, 16384) + [0, 4904), t2 [8192, 16384) + [0, 3808), t3 ...
    layout = _layout([10000, 9000, 12000, 3000, 16384])
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    assert os.stat(path).st_size == layout.data_offset + RING, "the file is the tables and the ring only"
    early = SegmentReader.open(path)  # attached before anything landed: must see every lap
    releaser = Releaser(writer.fileno(), layout, punch=False)
    wrapped = 0
    for slot in layout.slots:
        data = expected_bytes(7, slot.index, slot.nbytes)
        pieces = writer.file_ranges(slot.offset, slot.nbytes)
        wrapped += len(pieces) == 2
        if slot.index % 2:  # through the descriptor, as splice and pwrite land chunks
            done = 0
            for file_offset, length in pieces:
                os.pwrite(writer.fileno(), data[done : done + length], file_offset)
                done += length
        else:  # through the writer's mapping, as readinto lands them
            writer.slot(slot.index)[:] = data
        writer.mark_ready(slot.index)
        late = SegmentReader.open(path)
        for reader in (early, late):
            assert bytes(reader.view(slot.index)) == data, f"{slot.name} through the ring"
        late.close()
        releaser.release(slot.index)  # the next tensor may reuse its bytes
    assert wrapped >= 2, "the test must wrap tensors around the ring's end"
    assert [early.state(i) for i in range(len(layout.slots))] == [TensorState.RELEASED] * len(layout.slots)
    early.close()
    releaser.close()
    writer.close()


def test_a_reader_s_arrays_over_a_ring_are_read_only_and_the_mapping_goes_with_the_last(
    shm_dir: Path,
) -> None:
    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        writer.slot(0)[:] = b"\x05" * 10000
        writer.mark_ready(0)
        reader = SegmentReader.open(path)
        array = np.frombuffer(reader.view(0), dtype=np.uint8)
        assert not array.flags.writeable, "a private copy of a ring page would hide newer tensors"
        with pytest.raises(ValueError, match="read-only"):
            array[0] = 1
        reader.close()
        assert _maps(path) >= 2 and (array == 5).all(), "an array handed out keeps its mapping"
        del array
        writer.close()
    assert _maps(path) == 0, "no mapping of the ring is left"


def test_a_writer_refuses_a_range_longer_than_the_ring() -> None:
    with pytest.raises(SegmentLayoutError, match="do not fit in the ring"):
        _layout([RING + 1])


def test_several_processes_copy_a_ring_model_byte_exact_and_a_released_tensor_is_an_error(
    shm_dir: Path,
) -> None:
    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000, 12000, 3000])
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    one = attach(path, timeout=5, notify=False)
    two = attach(path, timeout=5, notify=False)
    assert one.memory_mode == "ring"
    releaser = Releaser(writer.fileno(), layout, punch=False)
    late = attach(path, timeout=5, notify=False, register=False)
    for slot in layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(9, slot.index, slot.nbytes)
        writer.mark_ready(slot.index)
        for model in (one, two):
            assert model.numpy(slot.name).tobytes() == expected_bytes(9, slot.index, slot.nbytes)
            model.consumed(slot.name)
        copy = late.numpy(slot.name).copy()  # not a consumer: the ring does not wait for it
        releaser.release(slot.index)
        with pytest.raises(TensorReleasedError, match=f"'{slot.name}'"):
            late.consumed(slot.name)  # its copy raced the release: it learns so, and discards it
        assert copy.tobytes() == expected_bytes(9, slot.index, slot.nbytes)
    with pytest.raises(TensorReleasedError, match="'t0' was released"):
        one.numpy("t0")  # its bytes now hold t2's and t3's: the loader never hands them out
    for model in (one, two, late):
        model.close()
    releaser.close()
    writer.close()


def test_torch_tensors_over_a_ring_come_without_torch_s_writable_buffer_warning(shm_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(4, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
        with attach(path, timeout=5, notify=False) as model, warnings.catch_warnings():
            warnings.simplefilter("error")
            tensor = model.tensor("t1")  # runs past the ring's end
            assert tensor.dtype == torch.uint8 and bytes(tensor.numpy()) == expected_bytes(4, 1, 9000)
            del tensor


# --- hostile ring headers and manifests ----------------------------------------------------------------


def _patch(path: Path, offset: int, value: bytes) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({96: struct.pack("<I", 1)}, "memory mode 1 is not 2 .ring. in a version-4 segment"),
        ({104: struct.pack("<Q", RING + 1)}, "ring size 16385 must be a positive multiple of 4096"),
        ({104: struct.pack("<Q", 0)}, "ring size 0 must be a positive multiple"),
        ({104: struct.pack("<Q", RING // 2)}, "a ring segment is its tables and then its ring"),
        ({72: struct.pack("<Q", 2**63)}, "data length .* is larger than any segment"),
    ],
)
def test_a_hostile_ring_header_is_refused(shm_dir: Path, change: dict[int, bytes], message: str) -> None:
    path = shm_dir / "hostile.seg"
    with SegmentWriter.create(path, _layout([10000, 9000]), heartbeat=False):
        pass
    for offset, value in change.items():
        _patch(path, offset, value)
    with pytest.raises(SegmentLayoutError, match=message):
        SegmentReader.open(path)


def test_a_ring_file_shorter_than_its_tables_and_ring_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "short.seg"
    layout = _layout([10000, 9000])
    with SegmentWriter.create(path, layout, heartbeat=False):
        pass
    short = layout.data_offset + RING - 4096
    os.truncate(path, short)
    with pytest.raises(SegmentLayoutError, match="the file is"):
        SegmentReader.open(path)
    _patch(path, 16, struct.pack("<Q", short))  # the header agrees with the file, not with the ring
    with pytest.raises(SegmentLayoutError, match="a ring segment is its tables and then its ring"):
        SegmentReader.open(path)


def test_a_ring_manifest_with_a_tensor_longer_than_the_ring_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "long.seg"
    layout = _layout([2 * 4096, 4096], ring=2 * 4096)
    with SegmentWriter.create(path, layout, heartbeat=False):
        pass
    os.truncate(path, layout.data_offset + 4096)  # a ring of one page: t0 does not fit
    _patch(path, 16, struct.pack("<Q", layout.data_offset + 4096))
    _patch(path, 104, struct.pack("<Q", 4096))
    with pytest.raises(SegmentLayoutError, match=r"'t0'\): 8192 bytes do not fit in the ring of 4096"):
        SegmentReader.open(path)


def test_a_ring_that_is_not_whole_pages_of_the_host_is_refused_clearly(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.loader.errors import SegmentError
    from modelload.loader.segment import _ring

    path = shm_dir / "pages.seg"
    path.write_bytes(bytes(3 * 4096))
    monkeypatch.setattr(_ring.mmap, "PAGESIZE", 64 << 10)  # an arm64 host of 64 KiB pages
    fd = os.open(path, os.O_RDONLY)
    try:
        # The ring starts on a page of the host, but ends inside one: the second mapping could not follow
        # the first (MAP_FIXED at an unaligned address), which must not read as a lack of address space.
        with pytest.raises(SegmentError, match="pages of 65536 bytes"):
            _ring.map_ring(fd, start=0, ring_offset=0, ring_size=3 * 4096, writable=False)
    finally:
        os.close(fd)


def test_a_gpu_copy_by_a_process_that_did_not_register_is_checked_against_a_release_under_it(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from modelload.loader._api import gpu_copy

    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000])
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    for slot in layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(3, slot.index, slot.nbytes)
        writer.mark_ready(slot.index)
    releaser = Releaser(writer.fileno(), layout, punch=False)

    def racing_copy(
        items: Any,
        device: Any,
        *,
        on_done: Any = None,
        region: Any = None,
        pin_in_place: bool = True,
        data: Any = None,
    ) -> Any:
        """A device copy that the sidecar overtakes: t0 is released and its bytes reused mid-copy."""
        results = []
        for name, host in items:
            if name == "t0":
                releaser.release(0)
                writer.slot(1)[-4096:] = b"\xee" * 4096  # t1 lands on t0's ring bytes
            results.append((name, host.clone()))
            if on_done is not None:
                on_done(name)
        yield from results

    monkeypatch.setattr(gpu_copy, "copy_all", racing_copy)
    model = attach(path, timeout=5, notify=False, register=False)  # the ring never waits for it
    with pytest.raises(TensorReleasedError, match="'t0'"):
        model.state_dict(device="cuda")  # a torn copy must not come back as the weights
    model.close()
    releaser.close()
    writer.close()


def test_a_consumer_whose_entry_was_taken_over_after_it_expired_marks_nothing_in_the_new_one(
    shm_dir: Path,
) -> None:
    from modelload.loader.segment.consumers import ConsumerTable

    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        table = ConsumerTable.open(path, load_id=writer.load_id, tensor_count=2, write=True)
        stalled = table.register(label="stalled")
        # It stops beating for longer than the expiry (a stopped container, a host under pressure) ...
        table._write(table._at(stalled.slot) + 16, "<Q", 1)
        other = ConsumerTable.open(path, load_id=writer.load_id, tensor_count=2, write=True)
        newcomer = other.register(label="newcomer")
        assert newcomer.slot == stalled.slot, "the expired entry is the one a newcomer takes"
        # ... then wakes and marks what it copied: in its own entry, which is the newcomer's now.
        stalled.mark([0])
        assert not newcomer.has(0), "the writer would release t0 while the newcomer still copies it"
        assert not stalled.has(0), "a consumer that lost its entry cannot vouch for a copy any more"
        newcomer.leave()
        stalled.leave()


def test_state_dict_on_the_cpu_of_more_than_the_ring_holds_is_refused_before_it_waits(shm_dir: Path) -> None:
    """Views of every tensor of a model larger than its ring would wait for room that only their own
    consumption frees: refused at once, saying what to do, where it used to wait without end."""
    from modelload.loader import attach
    from modelload.loader.errors import ConfigError

    path = shm_dir / "ring.seg"
    layout = _layout([10000, 9000, 12000])  # 31,000 bytes through a 16 KiB ring
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        writer.slot(0)[:] = expected_bytes(7, 0, 10000)
        writer.mark_ready(0)
        with attach(path, notify=False, register=False, timeout=5) as model:
            with pytest.raises(
                ConfigError, match=r"ring of 16384 bytes.*take 31000.*iter_ready\(\) and consumed"
            ):
                model.state_dict()
            assert bytes(model.numpy("t0")) == expected_bytes(7, 0, 10000)  # what fits is still served
            assert list(model.state_dict(names=["t0"])) == ["t0"]
