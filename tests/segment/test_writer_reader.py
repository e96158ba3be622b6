"""Writing a segment and reading it back, in one process: the API's behaviour rule by rule."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import (
    LoadFailedError,
    LoadTimeoutError,
    SegmentError,
    SegmentSpaceError,
    SidecarUnavailableError,
)
from modelload.loader.segment import (
    ALIGNMENT,
    SegmentReader,
    SegmentWriter,
    TensorFlags,
    TensorSpec,
    TensorState,
    WriterState,
    plan_layout,
)
from tests.segment.helpers import expected_bytes, small_layout, write_complete
from tests.support.waiting import wait_for


def test_slots_are_page_aligned_and_disjoint_for_every_shape() -> None:
    specs = [
        TensorSpec("scalar", by_name("float32"), ()),
        TensorSpec("empty", by_name("float16"), (0, 7)),
        TensorSpec("page", by_name("uint8"), (4096,)),
        TensorSpec("odd", by_name("int64"), (3, 5, 7)),
        TensorSpec("after-empty", by_name("bfloat16"), (1,)),
    ]
    layout = plan_layout(specs)
    ends = []
    for slot, spec in zip(layout.slots, specs, strict=True):
        assert slot.offset % ALIGNMENT == 0
        assert slot.nbytes == spec.nbytes
        assert slot.offset >= layout.data_offset
        ends.append((slot.offset, slot.offset + slot.nbytes))
    nonempty = sorted(e for e in ends if e[1] > e[0])
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(nonempty))
    assert layout.segment_length >= max(end for _, end in ends)


def test_a_long_manifest_moves_the_state_table_and_data_past_it() -> None:
    specs = [TensorSpec(f"layer.{i}.weight-with-a-long-name", by_name("float16"), (8,)) for i in range(300)]
    layout = plan_layout(specs)
    assert len(layout.manifest) > 4096
    assert layout.state_offset >= 4096 + len(layout.manifest)
    assert layout.data_offset >= layout.state_offset + 32 * len(specs)
    assert layout.slots[0].offset == layout.data_offset


def test_a_lead_leaves_room_before_its_slot_and_nothing_else_moves_into_it() -> None:
    specs = [
        TensorSpec("a", by_name("uint8"), (10,), lead=100),
        TensorSpec("b", by_name("uint8"), (4096,), lead=5000),
        TensorSpec("c", by_name("uint8"), (3,), lead=4096),
    ]
    layout = plan_layout(specs)
    previous_end = layout.state_offset + 32 * len(specs)
    for slot, spec in zip(layout.slots, specs, strict=True):
        assert slot.offset % ALIGNMENT == 0
        assert slot.offset - spec.lead >= previous_end, f"{spec.name}'s lead overlaps what precedes it"
        previous_end = slot.offset + slot.nbytes
    assert layout.data_offset == layout.slots[0].offset
    assert layout.segment_length >= previous_end


def test_duplicate_names_are_refused_when_planning() -> None:
    with pytest.raises(SegmentError, match="appears twice"):
        plan_layout([TensorSpec("w", by_name("uint8"), (1,)), TensorSpec("w", by_name("uint8"), (2,))])


def test_tensors_read_back_byte_exact_with_their_flags(shm_dir: Path) -> None:
    layout = small_layout()
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        writer.slot(0)[:] = expected_bytes(1, 0, 12)
        writer.mark_ready(0, verified=True, decrypted=True, crc32=0xDEADBEEF)
        with SegmentReader.open(path) as reader:
            assert reader.writer_state == WriterState.LOADING
            assert list(reader.ready_mask()) == [True, False]
            assert bytes(reader.view(0)) == expected_bytes(1, 0, 12)
            assert reader.flags(0) == TensorFlags.VERIFIED | TensorFlags.DECRYPTED | TensorFlags.CRC32
            assert reader.crc32(0) == 0xDEADBEEF
            assert reader.crc32(1) is None
            assert reader.state(1) == TensorState.PENDING
            assert reader.tensors_ready == 1
            assert reader.bytes_ready == 12
            assert reader.metadata == {"format": "safetensors"}
            writer.slot(1)[:] = expected_bytes(1, 1, 8)
            writer.mark_ready(1)
            writer.mark_complete()
            reader.wait(timeout=1)
            assert reader.writer_state == WriterState.COMPLETE
            assert reader.finished_ns >= reader.ready_ns(1) > 0


def test_waiting_times_out_naming_the_missing_tensors(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False) as writer:
        writer.slot(0)[:] = bytes(12)
        writer.mark_ready(0)
        with SegmentReader.open(path) as reader:
            reader.wait([0], timeout=0)
            with pytest.raises(LoadTimeoutError, match="'bias'") as caught:
                reader.wait(timeout=0.05)
            assert caught.value.pending == ("bias",)


def test_waiting_for_the_finish_outlasts_the_last_tensor_until_the_load_is_proven(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False) as writer:
        for index in (0, 1):
            writer.mark_ready(index)
        with SegmentReader.open(path) as reader:
            with pytest.raises(LoadTimeoutError, match="still proving its files"):
                reader.wait_finished(timeout=0.05)  # every tensor is in, the files are not proven yet
            finished = threading.Event()

            def wait() -> None:
                reader.wait_finished(timeout=30)
                finished.set()

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            assert not finished.wait(0.05)
            writer.mark_complete()
            waiter.join(timeout=30)
            assert finished.is_set() and reader.writer_state == WriterState.COMPLETE


def test_waiting_for_the_finish_ends_with_the_writers_reason_when_the_load_fails(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    reason = "the origin's digest did not match"
    with (
        SegmentWriter.create(path, small_layout(), heartbeat=False) as writer,
        SegmentReader.open(path) as reader,
    ):
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                reader.wait_finished(timeout=30)
            except LoadFailedError as exc:
                failed.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        writer.mark_failed(reason)
        waiter.join(timeout=30)
        assert [str(e) for e in failed] == [f"the model load failed ({path}): {reason}"]


def test_a_failed_load_wakes_waiters_with_the_writers_reason(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False) as writer:
        with SegmentReader.open(path) as reader:
            writer.mark_tensor_failed(1)
            writer.mark_failed("s3://bucket/model: object changed during the load")
            with pytest.raises(LoadFailedError, match="object changed") as caught:
                reader.wait(timeout=5)
            assert caught.value.reason.startswith("s3://bucket/model")
            assert reader.writer_state == WriterState.FAILED
        writer.mark_failed("a second reason is ignored: failure is final")
        with SegmentReader.open(path) as again:
            assert "object changed" in again.error


def test_a_writer_cannot_publish_twice_or_complete_early(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False) as writer:
        writer.mark_ready(0)
        with pytest.raises(SegmentError, match="already marked READY"):
            writer.mark_ready(0)
        with pytest.raises(SegmentError, match="not ready"):
            writer.mark_complete()


def test_a_silent_writer_is_taken_for_dead(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout(), heartbeat=False), SegmentReader.open(path) as reader:
        reader.stale_after = 0.01  # the wait notices the silence after its first 10 ms
        with pytest.raises(LoadFailedError, match="has not updated the segment"):
            reader.wait(timeout=5)


def test_the_heartbeat_keeps_a_live_writer_fresh(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from modelload.loader.segment import writer as writer_module

    monkeypatch.setattr(writer_module, "HEARTBEAT_INTERVAL", 0.01)
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, small_layout()), SegmentReader.open(path) as reader:
        first = reader.heartbeat_ns
        wait_for(lambda: reader.heartbeat_ns > first, timeout=5, what="the writer's next heartbeat")


def test_a_new_load_supersedes_a_loading_one_and_its_readers_stop_waiting(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    old = SegmentWriter.create(path, small_layout(), heartbeat=False)
    reader = SegmentReader.open(path)
    new = SegmentWriter.create(path, small_layout(), heartbeat=False)
    try:
        with pytest.raises(LoadFailedError, match="superseded"):
            reader.wait(timeout=5)
        with SegmentReader.open(path) as fresh:
            assert fresh.load_id == new.load_id != old.load_id
            assert fresh.writer_state == WriterState.LOADING
    finally:
        reader.close()
        old.close()
        new.close()
    assert sorted(p.name for p in shm_dir.iterdir()) == ["model.seg"], "no temporary file is left behind"


def test_readers_get_private_writable_arrays_that_never_reach_the_segment(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    write_complete(path, small_layout(), seed=3)
    with SegmentReader.open(path) as first, SegmentReader.open(path) as second:
        array = np.frombuffer(first.view(1), dtype="<f4")
        assert array.flags.writeable
        array[:] = 42.0
        assert bytes(second.view(1)) == expected_bytes(3, 1, 8)
        del array


def test_a_volume_without_room_is_refused_before_anything_is_written(shm_dir: Path) -> None:
    huge = plan_layout([TensorSpec("w", by_name("uint8"), (1 << 52,))])
    with pytest.raises(SegmentSpaceError, match="raise the volume's sizeLimit"):
        SegmentWriter.create(shm_dir / "model.seg", huge)
    assert list(shm_dir.iterdir()) == []


def test_a_full_tmpfs_fails_the_reservation_not_a_later_write(
    tiny_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.loader.segment import room

    # Fill most of the volume so the statvfs check passes only for a segment that barely fits.
    (tiny_tmpfs / "ballast").write_bytes(bytes(700 * 1024))
    layout = plan_layout([TensorSpec("w", by_name("uint8"), (200 * 1024,))])
    with SegmentWriter.create(tiny_tmpfs / "a.seg", layout, heartbeat=False):
        pass
    # Without the free-space pre-check (another writer could fill the volume between check and use),
    # posix_fallocate itself must fail cleanly, and no temporary file may remain.
    monkeypatch.setattr(room, "check_space", lambda *_: None)
    with pytest.raises(SegmentSpaceError, match="no room"):
        SegmentWriter.create(tiny_tmpfs / "b.seg", layout, heartbeat=False)
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["a.seg", "ballast"]


def test_a_missing_segment_points_at_the_sidecar(shm_dir: Path) -> None:
    with pytest.raises(SidecarUnavailableError, match="is the modelload sidecar running"):
        SegmentReader.open(shm_dir / "absent.seg")


def test_writer_threads_can_publish_concurrently(shm_dir: Path) -> None:
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (5000 + i,)) for i in range(64)]
    layout = plan_layout(specs)
    path = shm_dir / "model.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:

        def fill(indices: range) -> None:
            for i in indices:
                writer.slot(i)[:] = expected_bytes(9, i, layout.slots[i].nbytes)
                writer.mark_ready(i)

        threads = [threading.Thread(target=fill, args=(range(k, 64, 4),)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        writer.mark_complete()
        assert writer.bytes_ready == layout.nbytes
    with SegmentReader.open(path) as reader:
        reader.wait(timeout=0)
        assert reader.tensors_ready == 64
        assert all(bytes(reader.view(i)) == expected_bytes(9, i, layout.slots[i].nbytes) for i in range(64))
