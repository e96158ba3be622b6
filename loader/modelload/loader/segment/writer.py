"""Create a segment and fill it: the writer's side of SPEC.md.

One process writes a segment; its threads may fill slots concurrently (each slot by one thread at a time)
and mark them ready in any order. The writer publishes the header and manifest before any tensor data, by
creating the file under a temporary name and renaming it into place, so a reader never sees half a header.

Pages are reserved up front with ``posix_fallocate``: on tmpfs a write through a mapping into a full volume
is a SIGBUS that kills the process, while a failed reservation is an ordinary error we can report. A writer
that lands its data through the file descriptor instead (``os.splice``, where a full volume is ENOSPC)
still reserves the pages nothing will ever write: the header, manifest and state table, and the part of a
slot the source has no bytes for (a meta tensor), which readers fault in.

The checks before a segment is created (its folder, a writable volume with room for it, an unfinished
segment removed to make room) and the reservation of its pages are :mod:`.room`'s; marking a LOADING
segment at the name FAILED when the new one replaces it is :func:`.previous.supersede`.

A ring segment (layout version 4) holds only ``ring_size`` bytes of data after its tables, and a tensor's
bytes wrap around the ring's end. The writer maps the ring a second time right after the file
(:mod:`._ring`), so :meth:`SegmentWriter.slot` and :meth:`SegmentWriter.region` still give one contiguous
view; landing through the descriptor takes :meth:`SegmentWriter.file_ranges`, one or two pieces of the file.

On huge pages (:mod:`.pages`) the layout is planned for the volume's page size (``plan_layout(page_size=)``),
so the file is whole pages, which hugetlbfs requires. A hugetlbfs file is filled only through the mapping:
its pages are reserved by ``posix_fallocate`` (or by the shared mapping itself, which the kernel refuses
with ENOMEM when the pool has too few free pages: both are a :class:`SegmentSpaceError` here, never a
SIGBUS later).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import mmap
import os
import secrets
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import SegmentError
from modelload.loader.segment import _memory, _ring, room
from modelload.loader.segment.consumers import create_table
from modelload.loader.segment.layout import (
    ENTRY_CRC32,
    ENTRY_FLAGS,
    ENTRY_READY_NS,
    ERROR_CAPACITY,
    HEADER_LENGTH,
    OFF_BYTES_READY,
    OFF_ERROR,
    OFF_ERROR_LENGTH,
    OFF_FINISHED_NS,
    OFF_HEARTBEAT_NS,
    OFF_TENSORS_READY,
    OFF_WRITER_PID,
    OFF_WRITER_STATE,
    STATE_ENTRY_LENGTH,
    Layout,
    MemoryMode,
    TensorFlags,
    TensorState,
    WriterState,
    entry_offset,
    error_bytes,
)
from modelload.loader.segment.lock import WriterLock
from modelload.loader.segment.pages import Volume, check_page_size
from modelload.loader.segment.previous import supersede
from modelload.loader.segment.volume import full_volume

__all__ = ["SegmentWriter"]

log = logging.getLogger(__name__)

SEGMENT_MODE = 0o640
"""Owner read-write, group read, nobody else: the segment holds decrypted weights. Readers need only read
access; in a pod they share the group (the operator adds it to the pod's supplementalGroups, or the pod's
fsGroup owns the volume), on a host run ``attach()`` as the writer's user or group."""
HEARTBEAT_INTERVAL = 2.0
"""Seconds between heartbeats of a LOADING writer; SPEC.md asks for at most 5."""


class SegmentWriter:
    """The writing side of one segment. Create it with :meth:`create`.

    >>> from modelload.loader.dtypes import by_name
    >>> from modelload.loader.segment.layout import TensorSpec, plan_layout
    >>> layout = plan_layout([TensorSpec("w", by_name("uint8"), (3,))])
    >>> with SegmentWriter.create(tmp / "model.seg", layout) as writer:  # doctest: +SKIP
    ...     writer.slot(0)[:] = b"abc"
    ...     writer.mark_ready(0)
    ...     writer.mark_complete()
    """

    def __init__(
        self,
        path: Path,
        layout: Layout,
        fd: int,
        mm: mmap.mmap | memoryview,
        load_id: int,
        volume: Volume | None = None,
    ) -> None:
        self.path = path
        self.layout = layout
        self.volume = volume or Volume("small")
        """The kind of memory under the segment: on hugetlbfs only the mapping can write it."""
        self.load_id = load_id
        self._fd = fd
        self._mm = mm
        self._ring = layout.ring
        self._view = memoryview(mm)
        self._u32 = np.frombuffer(mm, dtype="<u4")
        self._u64 = np.frombuffer(mm, dtype="<u8")
        self._lock = threading.Lock()
        self._ready = 0
        self._bytes_ready = 0
        self._closed = False
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # --- creation ---------------------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        layout: Layout,
        *,
        reserve: bool = True,
        load_id: int | None = None,
        created_ns: int | None = None,
        heartbeat: bool = True,
        reserve_ranges: Sequence[tuple[int, int]] = (),
        lock: WriterLock | None = None,
    ) -> SegmentWriter:
        """Create, size and publish a segment for ``layout`` at ``path``, ready for tensor data.

        ``reserve`` allocates every page now (``posix_fallocate``), so a full volume fails here with
        :class:`SegmentSpaceError`; without it, call :meth:`reserve` after publishing, before writing
        through a slot view (on tmpfs a write into a full volume through a mapping is a SIGBUS). A LOADING
        segment already at ``path`` is marked FAILED (superseded)
        before the new one replaces it, so processes still attached to it stop waiting; when the volume
        cannot hold both, a segment that is not COMPLETE is removed before the new one is created.

        ``reserve_ranges`` (``(offset, length)`` pairs) are reserved before publishing even without
        ``reserve``, as are the header, manifest and state table: the parts no data transfer will write.

        ``lock``, the segment's :class:`~modelload.loader.segment.lock.WriterLock` held by the caller, is
        told the new load_id before the segment is published, so a reader can tell from the lock whether
        this load's writer still lives (SPEC.md, "Writers and loads").
        """
        target = Path(path)
        load_id = load_id or (secrets.randbits(64) | 1)
        created_ns = created_ns or time.time_ns()
        room.check_writable(target.parent)
        volume = check_page_size(target.parent, layout.page_size)
        room.make_room(target, layout.segment_length, load_id)
        room.check_space(target.parent, layout)
        temp = target.with_name(f".{target.name}.{load_id:016x}.tmp")
        try:
            fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, SEGMENT_MODE)
        except OSError as exc:  # a read-only volume, a folder of another user: say so, no traceback
            raise SegmentError(
                f"cannot create a segment in {target.parent}: {exc.strerror or exc}; mount the volume"
                " read-write there, or choose a folder this user can write (--segment/MODELLOAD_SEGMENT)"
            ) from None
        try:
            os.fchmod(fd, SEGMENT_MODE)  # exactly this mode, whatever the umask
            os.ftruncate(fd, layout.segment_length)
            if reserve and layout.segment_length:
                room.reserve_pages(fd, layout.segment_length, target)
            elif layout.segment_length:
                for offset, length in ((0, layout.data_offset), *reserve_ranges):
                    if length > 0:
                        room.reserve_pages(fd, length, target, offset=offset)
            mm: mmap.mmap | memoryview
            mm = _map(fd, layout, target)
            writer = cls(target, layout, fd, mm, load_id, volume)
            writer._write_prologue(created_ns)
            # The consumer table first: a version-3 or -4 reader (memory mode release or ring) looks for it.
            if layout.memory_mode != MemoryMode.FULL:
                create_table(target, load_id=load_id, tensor_count=len(layout.slots))
            if lock is not None:
                lock.update(load_id=load_id)
            supersede(target, f"superseded by a new load ({load_id:016x}); attach again")
            temp.rename(target)
        except BaseException:
            with contextlib.suppress(OSError):
                temp.unlink()
            os.close(fd)
            raise
        if heartbeat:
            writer._start_heartbeat()
        return writer

    def reserve(self) -> None:
        """Allocate every page of the segment now; :class:`SegmentSpaceError` when the volume is full."""
        if self.layout.segment_length:
            room.reserve_pages(self._fd, self.layout.segment_length, self.path)

    def reserve_range(self, offset: int, length: int) -> None:
        """Allocate the pages of segment bytes ``[offset, offset + length)`` now, before writing them through
        a view (:class:`SegmentSpaceError` when the volume is full, instead of a SIGBUS)."""
        for file_offset, count in self.file_ranges(offset, length):
            room.reserve_pages(self._fd, count, self.path, offset=file_offset)

    def _write_prologue(self, created_ns: int) -> None:
        # The manifest straight into the file (never whole in memory), then the header with its CRC; the
        # file is published by its rename, so the order inside it does not matter to readers.
        length = self.layout.manifest_length
        checksum = self.layout.write_manifest(self._view[HEADER_LENGTH : HEADER_LENGTH + length])
        header = self.layout.header(load_id=self.load_id, created_ns=created_ns, manifest_crc32=checksum)
        packed = header.pack()
        self._view[: len(packed)] = packed
        struct.pack_into("<I", self._view, OFF_WRITER_PID, os.getpid() & 0xFFFFFFFF)
        struct.pack_into("<Q", self._view, OFF_HEARTBEAT_NS, time.time_ns())
        # The state table is zero (PENDING) from ftruncate. LOADING last: the file is then complete.
        self._u32[OFF_WRITER_STATE // 4] = WriterState.LOADING

    # --- filling --------------------------------------------------------------------------------------------

    def fileno(self) -> int:
        """The segment's file descriptor, for ``os.pwrite``/``os.splice`` into the file offsets that
        :meth:`file_ranges` gives (in ring mode they are not the manifest's offsets)."""
        return self._fd

    def slot(self, index: int) -> memoryview:
        """A writable view of slot ``index``'s bytes. Fill it completely, then :meth:`mark_ready`."""
        table = self.layout.table
        return self._at(int(table.offsets[index]), int(table.nbytes[index]))

    def slots(self, indices: Sequence[int]) -> list[memoryview]:
        """:meth:`slot` of each of ``indices``, at a fraction of the cost of one call each."""
        if self.layout.memory_mode == MemoryMode.RING:
            return [self.slot(index) for index in indices]
        table, view = self.layout.table, self._view
        picked = np.asarray(indices, dtype=np.intp)
        starts = table.offsets[picked].tolist()
        return [view[a:b] for a, b in zip(starts, (table.offsets[picked] + table.nbytes[picked]).tolist(),
                                          strict=True)]  # fmt: skip

    def regions(self, offsets: Sequence[int], lengths: Sequence[int]) -> list[memoryview]:
        """:meth:`region` of each ``(offset, length)``, bounds checked once for all of them."""
        layout = self.layout
        if layout.memory_mode == MemoryMode.RING or not offsets:
            return [self.region(o, n) for o, n in zip(offsets, lengths, strict=True)]
        low, high = min(offsets), max(o + n for o, n in zip(offsets, lengths, strict=True))
        if low < layout.state_offset or high > layout.data_offset + layout.data_length:
            raise IndexError(f"bytes [{low}, {high}) are outside the writable part of the segment")
        view = self._view
        return [view[o : o + n] for o, n in zip(offsets, lengths, strict=True)]

    def region(self, offset: int, length: int) -> memoryview:
        """A writable view of bytes ``[offset, offset + length)`` of the segment: a slot, or padding used as
        scratch (SPEC.md allows it), such as the room a slot's lead leaves before it."""
        layout = self.layout
        if offset < layout.state_offset or offset + length > layout.data_offset + layout.data_length:
            raise IndexError(
                f"bytes [{offset}, {offset + length}) are outside the writable part of the segment"
            )
        return self._at(offset, length)

    def file_ranges(self, offset: int, length: int) -> list[tuple[int, int]]:
        """``(file offset, length)`` of the pieces of the file that hold segment bytes ``[offset, offset +
        length)``, in order: the range itself, except where a ring wraps (two pieces)."""
        return [(offset, length)] if self._ring is None else self._ring.file_ranges(offset, length)

    def _at(self, offset: int, length: int) -> memoryview:
        if self._ring is not None:  # one piece of the file, or on through the ring's second mapping
            offset = self._ring.file_ranges(offset, length)[0][0]
        return self._view[offset : offset + length]

    def state(self, index: int) -> TensorState:
        return TensorState(int(self._u32[self._state_word(index)]))

    def mark_ready(
        self,
        index: int,
        *,
        verified: bool = False,
        decrypted: bool = False,
        crc32: int | None = None,
    ) -> None:
        """Publish tensor ``index``: every byte of its slot must be in. A tensor is published once."""
        table = self.layout.table
        flags = TensorFlags.NONE
        flags |= TensorFlags.VERIFIED if verified else TensorFlags.NONE
        flags |= TensorFlags.DECRYPTED if decrypted else TensorFlags.NONE
        flags |= TensorFlags.CRC32 if crc32 is not None else TensorFlags.NONE
        word = self._state_word(index)
        with self._lock:
            self._check_open()
            if self._u32[word] != TensorState.PENDING:
                raise SegmentError(
                    f"tensor {table.names[index]!r} was already marked {self.state(index).name}"
                )
            entry = word * 4
            self._u64[(entry + ENTRY_READY_NS) // 8] = time.time_ns()
            self._u32[(entry + ENTRY_FLAGS) // 4] = int(flags)
            self._u32[(entry + ENTRY_CRC32) // 4] = (crc32 or 0) & 0xFFFFFFFF
            # SPEC.md, writer rule 2: the slot's bytes, then the entry, then the state word last.
            _memory.release_fence()
            self._u32[word] = TensorState.READY
            self._ready += 1
            self._bytes_ready += int(table.nbytes[index])
            self._u64[OFF_TENSORS_READY // 8] = self._ready
            self._u64[OFF_BYTES_READY // 8] = self._bytes_ready

    def mark_ready_many(
        self,
        indices: Sequence[int] | npt.NDArray[np.integer],
        *,
        crc32: Sequence[int] | npt.NDArray[np.integer] | None = None,
        verified: Sequence[bool] | None = None,
        decrypted: Sequence[bool] | None = None,
    ) -> None:
        """:meth:`mark_ready` for many tensors at once (the tensors of one landed range), in a few array
        operations over the state table: their bytes first, then their entries, then their state words.
        ``crc32``, ``verified`` and ``decrypted`` are per tensor, in the order of ``indices``."""
        picked = np.asarray(indices, dtype=np.intp)
        if not len(picked):
            return
        count = len(self.layout.slots)
        if picked.min() < 0 or picked.max() >= count:
            raise IndexError(f"tensor indices out of range 0..{count - 1}")
        flags = np.zeros(len(picked), dtype=np.uint32)
        for values, flag in ((verified, TensorFlags.VERIFIED), (decrypted, TensorFlags.DECRYPTED)):
            if values is not None:
                flags |= np.asarray(values, dtype=bool).astype(np.uint32) * np.uint32(flag)
        crcs = np.zeros(len(picked), dtype=np.uint32)
        if crc32 is not None:
            flags |= np.uint32(TensorFlags.CRC32)
            crcs[:] = np.asarray(crc32, dtype=np.int64) & 0xFFFFFFFF
        words = (self.layout.state_offset // 4) + picked * (STATE_ENTRY_LENGTH // 4)
        nbytes = int(self._slot_nbytes[picked].sum())
        with self._lock:
            self._check_open()
            marked = picked[self._u32[words] != TensorState.PENDING]
            if len(marked):
                index = int(marked[0])
                raise SegmentError(
                    f"tensor {self.layout.slots[index].name!r} was already marked {self.state(index).name}"
                )
            ordered = np.sort(picked)  # not np.unique: its first call imports numpy.ma, 35 ms inside a load
            if (ordered[1:] == ordered[:-1]).any():
                raise SegmentError("a tensor is listed twice among those to mark ready")
            self._u64[(words * 4 + ENTRY_READY_NS) // 8] = time.time_ns()
            self._u32[words + ENTRY_FLAGS // 4] = flags
            self._u32[words + ENTRY_CRC32 // 4] = crcs
            # SPEC.md, writer rule 2: the slots' bytes, then the entries, then the state words last.
            _memory.release_fence()
            self._u32[words] = TensorState.READY
            self._ready += len(picked)
            self._bytes_ready += nbytes
            self._u64[OFF_TENSORS_READY // 8] = self._ready
            self._u64[OFF_BYTES_READY // 8] = self._bytes_ready

    @functools.cached_property
    def _slot_nbytes(self) -> npt.NDArray[np.int64]:
        return self.layout.table.nbytes

    def mark_tensor_failed(self, index: int) -> None:
        """Mark one tensor FAILED, so a reader waiting for it stops. Follow with :meth:`mark_failed`."""
        with self._lock:
            self._check_open()
            self._u32[self._state_word(index)] = TensorState.FAILED

    def mark_complete(self) -> None:
        """Declare the load complete. Every tensor must be READY, and the load not already marked FAILED
        (a stop from another thread): a segment never leaves FAILED."""
        with self._lock:
            self._check_open()
            if self.writer_state == WriterState.FAILED:
                raise SegmentError(
                    f"cannot complete {self.path}: the load was marked failed ({self._error()})"
                )
            if self._ready != len(self.layout.slots):
                missing = [s.name for s in self.layout.slots if self.state(s.index) != TensorState.READY]
                raise SegmentError(f"cannot complete: {len(missing)} tensors are not ready ({missing[:5]})")
            self._finish(WriterState.COMPLETE)

    def mark_failed(self, reason: str) -> None:
        """Declare the load failed with ``reason`` (truncated to 1024 bytes of UTF-8). Final."""
        encoded = error_bytes(reason)
        with self._lock:
            self._check_open()
            if self.writer_state in (WriterState.COMPLETE, WriterState.FAILED):
                return
            self._view[OFF_ERROR : OFF_ERROR + ERROR_CAPACITY] = bytes(ERROR_CAPACITY)
            self._view[OFF_ERROR : OFF_ERROR + len(encoded)] = encoded
            self._u32[OFF_ERROR_LENGTH // 4] = len(encoded)
            self._finish(WriterState.FAILED)

    def _error(self) -> str:
        length = int(self._u32[OFF_ERROR_LENGTH // 4])
        return bytes(self._view[OFF_ERROR : OFF_ERROR + length]).decode("utf-8", "replace")

    @property
    def writer_state(self) -> WriterState:
        return WriterState(int(self._u32[OFF_WRITER_STATE // 4]))

    @property
    def tensors_ready(self) -> int:
        return self._ready

    @property
    def bytes_ready(self) -> int:
        return self._bytes_ready

    def _finish(self, state: WriterState) -> None:
        self._u64[OFF_FINISHED_NS // 8] = time.time_ns()
        _memory.release_fence()
        self._u32[OFF_WRITER_STATE // 4] = state
        self._stop.set()

    def _state_word(self, index: int) -> int:
        if not 0 <= index < len(self.layout.slots):
            raise IndexError(f"tensor index {index} out of range 0..{len(self.layout.slots) - 1}")
        return entry_offset(self.layout.state_offset, index) // 4

    def _check_open(self) -> None:
        if self._closed:
            raise SegmentError(f"segment writer for {self.path} is closed")

    # --- heartbeat and closing --------------------------------------------------------------------------

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_INTERVAL):
                with self._lock:
                    if self._closed:
                        return
                    self._u64[OFF_HEARTBEAT_NS // 8] = time.time_ns()

        self._heartbeat = threading.Thread(target=beat, name="segment-heartbeat", daemon=True)
        self._heartbeat.start()

    def close(self) -> None:
        """Unmap and close. The file stays for its readers; a LOADING segment stays LOADING."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            del self._u32, self._u64
            self._view.release()
            # Views from slot() that a caller still holds keep the mapping alive; it goes with the last one.
            if isinstance(self._mm, mmap.mmap):
                with contextlib.suppress(BufferError):
                    self._mm.close()
            del self._mm
            os.close(self._fd)

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        ready = f"{self._ready}/{len(self.layout.slots)}"
        return f"<SegmentWriter {self.path} load_id={self.load_id:016x} ready={ready}>"


def _map(fd: int, layout: Layout, target: Path) -> mmap.mmap | memoryview:
    """Map the new segment shared and writable (a ring twice over). On hugetlbfs the kernel reserves the
    mapping's pages from its pool now, and refuses with ENOMEM when too few are free."""
    try:
        if layout.memory_mode == MemoryMode.RING:
            return _ring.map_ring(
                fd, start=0, ring_offset=layout.data_offset, ring_size=layout.ring_size, writable=True,
                page_size=layout.page_size,
            )  # fmt: skip
        return mmap.mmap(fd, layout.segment_length, flags=mmap.MAP_SHARED)
    except OSError as exc:
        full = full_volume(
            exc,
            f"cannot map the {layout.segment_length}-byte segment at {target}: too few free huge pages",
            advice="raise the node's huge pages (nr_hugepages) or the pod's hugepages limit "
            "(spec.memory.hugePages)",
            codes=frozenset({errno.ENOMEM}),
        )
        if full is None:
            raise
        raise full from exc
