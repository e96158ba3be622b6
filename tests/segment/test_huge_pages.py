"""Segments on huge pages: hugetlbfs (2 MiB pages from the kernel's pool) and a tmpfs mounted ``huge=always``.

Every test mounts the real file systems (``tests/support/hugepages.py``: root sets ``nr_hugepages`` and
mounts them; without root they skip, and fail under ``make test``). hugetlbfs is the strict one: whole-page
file sizes, page-aligned mapping offsets, no ``write()``, and a private mapping that reserves pool pages.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import attach
from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError, LoadFailedError, SegmentError, SegmentSpaceError
from modelload.loader.segment import (
    MemoryMode,
    SegmentReader,
    SegmentWriter,
    TensorSpec,
    TensorState,
    WriterState,
    plan_layout,
)
from modelload.loader.segment._ring import map_ring
from modelload.loader.segment.consumers import ConsumerTable, table_path
from modelload.loader.segment.layout import Layout
from modelload.loader.segment.lock import SegmentBusyError, WriterLock, lock_path
from modelload.loader.segment.modeldir import write_model_dir
from modelload.loader.segment.pages import (
    SMALL_PAGE,
    available_bytes,
    prefers_mapping,
    volume_of,
)
from modelload.loader.segment.release import Releaser, resident_bytes
from tests.segment.helpers import expected_bytes
from tests.support.hugepages import (
    HUGE_PAGE,
    Unavailable,
    free_pages,
    huge_tmpfs,
    huge_tmpfs_volume,
    hugetlbfs,
    hugetlbfs_volume,
    mounted,
)

__all__ = ["huge_tmpfs", "huge_tmpfs_volume", "hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

MiB = 1 << 20


def _layout(sizes: list[int], *, page: int = HUGE_PAGE, **kwargs: object) -> Layout:
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    return plan_layout(specs, page_size=page, **kwargs)  # type: ignore[arg-type]


def _write(writer: SegmentWriter, seed: int) -> None:
    for slot in writer.layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(seed, slot.index, slot.nbytes)
        writer.mark_ready(slot.index)


# --- what kind of volume ------------------------------------------------------------------------------------


def test_the_volume_kind_comes_from_statfs_and_the_tmpfs_mount_options(
    hugetlbfs: Path, huge_tmpfs: Path, shm_dir: Path, tmp_path: Path
) -> None:
    assert volume_of(hugetlbfs).kind == "hugetlbfs" and volume_of(hugetlbfs).page_size == HUGE_PAGE
    assert volume_of(huge_tmpfs).kind == "tmpfs-huge" and volume_of(huge_tmpfs).page_size == HUGE_PAGE
    shm = volume_of(shm_dir)
    assert shm.kind == "small" and shm.page_size == SMALL_PAGE
    for huge in ("within_size", "advise", "never"):
        try:
            with mounted("tmpfs", tmp_path / huge, f"size=4m,huge={huge}") as folder:
                expected = "tmpfs-huge" if huge == "within_size" else "small"
                assert volume_of(folder).kind == expected, f"huge={huge}"
                fd = os.open(folder, os.O_RDONLY)
                try:
                    assert volume_of(fd).kind == expected, "an open descriptor is judged the same way"
                finally:
                    os.close(fd)
        except Unavailable as exc:
            pytest.fail(f"the huge_tmpfs fixture mounted, this mount should too: {exc}")
    assert prefers_mapping(volume_of(hugetlbfs)) and prefers_mapping(volume_of(huge_tmpfs))
    assert not prefers_mapping(shm), "4 KiB pages land cheaper through splice (benchmarks/landing.py)"


def test_a_hugetlbfs_mounted_without_a_size_has_the_pool_s_free_pages_as_room(hugetlbfs: Path) -> None:
    assert os.statvfs(hugetlbfs).f_blocks == 0, "mounted as the kubelet mounts it: no size, no blocks"
    assert available_bytes(hugetlbfs) == free_pages() * HUGE_PAGE


# --- the layout on huge pages -------------------------------------------------------------------------------


def test_a_layout_for_huge_pages_starts_its_data_on_a_page_and_is_whole_pages() -> None:
    layout = _layout([100, 3 * MiB + 5])
    assert layout.data_offset == HUGE_PAGE
    assert layout.segment_length % HUGE_PAGE == 0
    assert layout.segment_length >= layout.slots[-1].offset + layout.slots[-1].nbytes
    ring = _layout([100, MiB], memory_mode=MemoryMode.RING, ring_size=3 * MiB)
    assert ring.ring_size == 2 * HUGE_PAGE and ring.data_offset % HUGE_PAGE == 0
    small = _layout([100], page=SMALL_PAGE)
    assert small.data_offset == 3 * 4096 and small.segment_length == 4 * 4096, "4 KiB layouts are unchanged"


# --- hugetlbfs ----------------------------------------------------------------------------------------------


def test_a_segment_on_hugetlbfs_is_written_through_its_mapping_and_read_byte_exact(hugetlbfs: Path) -> None:
    path = hugetlbfs / "model.seg"
    layout = _layout([5000, 3 * MiB + 17, 4096])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        assert writer.volume.kind == "hugetlbfs"
        assert os.stat(path).st_size == layout.segment_length and layout.segment_length % HUGE_PAGE == 0
        _write(writer, seed=3)
        writer.mark_complete()
    free = free_pages()
    with SegmentReader.open(path) as reader:
        assert reader.writer_state == WriterState.COMPLETE
        assert free_pages() == free, "the reader's mapping is shared: it reserves no page of the pool"
        for slot in layout.slots:
            assert bytes(reader.view(slot.index)) == expected_bytes(3, slot.index, slot.nbytes)
        array = np.frombuffer(reader.view(1), dtype=np.uint8)
        assert not array.flags.writeable, "a write would need a private copy of a whole pool page"
    with attach(path, timeout=5, notify=False) as model:
        assert model.numpy("t1").tobytes() == expected_bytes(3, 1, 3 * MiB + 17)


def test_a_private_mapping_of_hugetlbfs_would_have_needed_the_pool_twice(hugetlbfs: Path) -> None:
    """Why the reader maps hugetlbfs shared: the kernel reserves a private mapping's pages up front."""
    path = hugetlbfs / "model.seg"
    layout = _layout([(free_pages() - 2) * HUGE_PAGE])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        with pytest.raises(OSError) as refused:
            mmap.mmap(writer.fileno(), layout.segment_length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        assert refused.value.errno == errno.ENOMEM
        with SegmentReader.open(path) as reader:
            assert reader.state(0) == TensorState.PENDING


def test_hugetlbfs_refuses_a_layout_planned_for_small_pages_saying_which_page_size(hugetlbfs: Path) -> None:
    with pytest.raises(SegmentError, match=r"hugetlbfs \(2 MiB pages\).*page_size=2097152"):
        SegmentWriter.create(hugetlbfs / "model.seg", _layout([100], page=SMALL_PAGE), heartbeat=False)
    assert list(hugetlbfs.iterdir()) == [], "nothing is left behind"


def test_a_segment_larger_than_the_pool_is_refused_before_anything_is_published(hugetlbfs: Path) -> None:
    layout = _layout([(free_pages() + 1) * HUGE_PAGE])
    with pytest.raises(SegmentSpaceError, match=r"hugetlbfs.*nr_hugepages"):
        SegmentWriter.create(hugetlbfs / "model.seg", layout, heartbeat=False)
    assert list(hugetlbfs.iterdir()) == []


def test_a_mount_with_a_size_bounds_the_segment(hugetlbfs_volume: Path, tmp_path: Path) -> None:
    with mounted("hugetlbfs", tmp_path / "small", "pagesize=2M,size=4M") as folder:
        assert available_bytes(folder) == 2 * HUGE_PAGE
        with pytest.raises(SegmentSpaceError, match="needs"):
            SegmentWriter.create(folder / "model.seg", _layout([3 * MiB]), heartbeat=False)
        with SegmentWriter.create(folder / "model.seg", _layout([MiB]), heartbeat=False) as writer:
            assert writer.layout.segment_length == 2 * HUGE_PAGE


def test_release_mode_on_hugetlbfs_gives_back_whole_pages_once_every_tensor_on_them_is_released(
    hugetlbfs: Path,
) -> None:
    path = hugetlbfs / "model.seg"
    # t0 and t1 share the first data page; t2 has two pages of its own and ends on a third, shared with t3.
    layout = _layout([MiB, MiB, 5 * MiB, 100], memory_mode=MemoryMode.RELEASE)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        _write(writer, seed=5)
        releaser = Releaser(writer.fileno(), layout)
        full = resident_bytes(writer.fileno())
        assert full == layout.segment_length
        assert releaser.release(0) == 0, "t1 still holds the page t0 shares with it"
        assert releaser.release(1) == HUGE_PAGE
        assert releaser.release(2) == 2 * HUGE_PAGE, "t3 still holds the page t2 ends on"
        assert resident_bytes(writer.fileno()) == full - 3 * HUGE_PAGE
        with SegmentReader.open(path) as reader:
            assert bytes(reader.view(3)) == expected_bytes(5, 3, 100), "t3's bytes were not touched"
        assert releaser.release(3) == HUGE_PAGE
        releaser.close()


def test_a_consumer_table_beside_a_hugetlbfs_segment_is_whole_pages_and_works(hugetlbfs: Path) -> None:
    path = hugetlbfs / "model.seg"
    layout = _layout([100, 200], memory_mode=MemoryMode.RELEASE)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        assert os.stat(table_path(path)).st_size == HUGE_PAGE
        with attach(path, timeout=5, notify=False) as model:
            _write(writer, seed=1)
            model.consumed("t0")
            table = ConsumerTable.open(path, load_id=writer.load_id, tensor_count=2, write=False)
            (entry,) = table.entries()
            assert entry.consumed == 1 and entry.pid == os.getpid()
            table.close()


def test_every_mapping_of_a_hugetlbfs_segment_goes_so_a_deleted_one_gives_the_pool_its_pages_back(
    hugetlbfs: Path,
) -> None:
    """Python's mmap.close() leaves a hugetlbfs mapping in place when its length is not whole pages (the
    kernel refuses the partial unmap and Python ignores it): every mapping must be whole pages."""
    free = free_pages()
    path = hugetlbfs / "model.seg"
    layout = _layout([MiB + 5, 3 * MiB], memory_mode=MemoryMode.RELEASE)
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    releaser = Releaser(writer.fileno(), layout)
    with attach(path, timeout=5, notify=False) as model:
        _write(writer, seed=6)
        writer.mark_complete()
        assert model.numpy("t0").tobytes() == expected_bytes(6, 0, MiB + 5)
    SegmentWriter.create(path, layout, heartbeat=False).close()  # supersedes the first: maps its header
    releaser.close()
    writer.close()
    for leftover in hugetlbfs.iterdir():
        leftover.unlink()
    maps = [line for line in Path("/proc/self/maps").read_text().splitlines() if str(hugetlbfs) in line]
    assert maps == [], "every mapping of the segment and its table is gone"
    assert free_pages() == free, "the deleted segment's pages went back to the pool"


def test_a_ring_on_hugetlbfs_is_mapped_twice_at_page_boundaries_and_wraps_whole(hugetlbfs: Path) -> None:
    path = hugetlbfs / "ring.seg"
    ring = 2 * HUGE_PAGE
    layout = _layout([3 * MiB, 3 * MiB, MiB + 5], memory_mode=MemoryMode.RING, ring_size=ring)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        assert os.stat(path).st_size == layout.data_offset + ring
        releaser = Releaser(writer.fileno(), layout, punch=False)
        reader = SegmentReader.open(path)
        wrapped = 0
        for slot in layout.slots:
            wrapped += len(writer.file_ranges(slot.offset, slot.nbytes)) == 2
            writer.slot(slot.index)[:] = expected_bytes(8, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
            assert bytes(reader.view(slot.index)) == expected_bytes(8, slot.index, slot.nbytes)
            releaser.release(slot.index)
        assert wrapped, "a tensor must run past the ring's end for this test to mean anything"
        reader.close()
        releaser.close()


def test_a_ring_planned_for_small_pages_is_refused_on_hugetlbfs_with_the_reason(hugetlbfs: Path) -> None:
    path = hugetlbfs / "ring.seg"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, 2 * HUGE_PAGE)
        with pytest.raises(SegmentError, match="page boundaries of the volume"):
            map_ring(fd, start=0, ring_offset=4096, ring_size=HUGE_PAGE, writable=True, page_size=HUGE_PAGE)
        view = map_ring(
            fd, start=0, ring_offset=HUGE_PAGE, ring_size=HUGE_PAGE, writable=True, page_size=HUGE_PAGE
        )
        view[HUGE_PAGE : HUGE_PAGE + 4] = b"ring"
        assert bytes(view[2 * HUGE_PAGE : 2 * HUGE_PAGE + 4]) == b"ring", "the second mapping shows the first"
        view.release()
    finally:
        os.close(fd)


def test_a_model_directory_on_hugetlbfs_is_refused_with_where_to_put_it(hugetlbfs: Path) -> None:
    with pytest.raises(ConfigError, match=r"hugetlbfs.*--model-dir"):
        write_model_dir(hugetlbfs / "model", ["config.json"], lambda name: b"{}")


def test_write_really_is_refused_by_hugetlbfs(hugetlbfs: Path) -> None:
    """The kernel fact the mapping-only design rests on; if a kernel ever allows write(), this says so."""
    fd = os.open(hugetlbfs / "probe", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, HUGE_PAGE)
        with pytest.raises(OSError) as refused:
            os.pwrite(fd, b"x", 0)
        assert refused.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            os.ftruncate(fd, HUGE_PAGE + 4096)
    finally:
        os.close(fd)


# --- huge tmpfs ---------------------------------------------------------------------------------------------


def test_the_writer_lock_on_hugetlbfs_admits_one_writer_and_tells_readers_when_it_is_gone(
    hugetlbfs: Path,
) -> None:
    # hugetlbfs takes no write(): the lock file stays empty (no page of the pool), and still does its work.
    segment = hugetlbfs / "model.seg"
    free = free_pages()
    lock = WriterLock.acquire(segment, program="modelload sidecar")
    lock.update(status_url="http://127.0.0.1:8479", load_id=7)
    assert lock_path(segment).stat().st_size == 0 and free_pages() == free
    with pytest.raises(SegmentBusyError, match="already has a writer: another process"):
        WriterLock.acquire(segment, program="modelload stage")
    writer = SegmentWriter.create(segment, _layout([5000]), heartbeat=False, lock=lock)
    reader = SegmentReader.open(segment)
    try:
        reader.check()  # the writer holds the lock: alive
        lock.release()  # as when the process dies
        reader._next_lock_probe = 0.0
        with pytest.raises(LoadFailedError, match=r"unnamed: its lock file is on hugetlbfs.*is gone"):
            reader.check()
    finally:
        reader.close()
        writer.close()
    WriterLock.acquire(segment, program="modelload stage").release()  # free again


def test_a_segment_on_a_huge_tmpfs_is_mapped_in_huge_pages(huge_tmpfs: Path) -> None:
    path = huge_tmpfs / "model.seg"
    layout = _layout([8 * MiB])
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        _write(writer, seed=2)
        writer.mark_complete()
        assert _pmd_mapped(path) >= 4 * HUGE_PAGE, "the writer's mapping holds the data in 2 MiB pages"
    with SegmentReader.open(path) as reader:
        assert bytes(reader.view(0)) == expected_bytes(2, 0, 8 * MiB)
        assert np.frombuffer(reader.view(0), dtype=np.uint8).flags.writeable, "tmpfs keeps copy-on-write"


def _pmd_mapped(path: Path) -> int:
    """Bytes of ``path`` this process maps with one entry per 2 MiB page (``ShmemPmdMapped`` in smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = fields[-1] == str(path)
        elif inside and fields and fields[0] == "ShmemPmdMapped:":
            total += int(fields[1]) * 1024
    return total
