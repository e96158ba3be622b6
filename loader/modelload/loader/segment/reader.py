"""Map a segment and wait for its tensors: the reader's side of SPEC.md.

A reader checks the header and manifest against every rule before it maps the data, then maps two regions:
the header and state table shared and read-only (so the writer's progress shows), and the data region
copy-on-write (so numpy and torch get writable arrays, and an in-place change stays in this process). Several
processes may read one segment at once; a reader never writes to it.

A ring segment (layout version 4, memory mode ring) is mapped differently: its data region is a ring the
writer reuses, mapped twice back to back, shared and read-only (:mod:`._ring`). A private copy of a page
would hide the newer tensors the writer lands there later, so arrays over a ring are read-only.

A segment on hugetlbfs (``segment.pages``) is mapped shared and read-only too, from a page boundary: a
private mapping of a hugetlbfs file reserves a page of the pool for every page it might copy on write,
which a pool sized for the model does not have (the mapping fails with ENOMEM), and a write into such a
page would take a page no one accounted for. Its arrays are read-only, as a ring's.

Waiting polls the state table. A caller that has a faster way to learn of progress (the loader's pyzmq
subscription) passes it as ``waiter``, which blocks until something happens or its timeout passes; the state
table stays the truth either way, so a missed message costs at most one wait.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import (
    LoadFailedError,
    LoadTimeoutError,
    SegmentError,
    SegmentLayoutError,
    SegmentVersionError,
    SidecarUnavailableError,
    TensorReleasedError,
)
from modelload.loader.segment import _memory, _ring
from modelload.loader.segment._regular import open_regular
from modelload.loader.segment.collector import paused_collector
from modelload.loader.segment.geometry import Ring
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
    OFF_LOAD_ID,
    OFF_TENSORS_READY,
    OFF_WRITER_PID,
    OFF_WRITER_STATE,
    STATE_ENTRY_LENGTH,
    Header,
    MemoryMode,
    Slot,
    TensorFlags,
    TensorState,
    WriterState,
    entry_offset,
)
from modelload.loader.segment.lock import writer_gone
from modelload.loader.segment.pages import SMALL_PAGE, Volume, mapped_length, volume_of
from modelload.loader.segment.validate import parse_header, parse_manifest

__all__ = ["SegmentReader", "Waiter"]

Waiter = Callable[[float], None]
"""Block for at most the given seconds, returning early when the writer may have made progress."""

STALE_AFTER = 60.0
"""Seconds without a heartbeat after which a LOADING writer is taken for dead (SPEC.md reader rule 5)."""

LOCK_PROBE_INTERVAL = 0.25
"""Seconds between looks at the writer's lock while a LOADING segment is waited for."""

_POLL_MIN, _POLL_MAX = 0.0005, 0.02
_RESCAN = 0.25


class _Pacer:
    """The pauses between two looks at the segment, up to a deadline: the caller's ``waiter`` (a
    notification subscription) for at most 50 ms, or else a sleep doubling from :data:`_POLL_MIN` to
    :data:`_POLL_MAX`."""

    __slots__ = ("_deadline", "_pause", "_waiter")

    def __init__(self, timeout: float | None, waiter: Waiter | None) -> None:
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._waiter = waiter
        self._pause = _POLL_MIN

    def wait(self) -> bool:
        """Pause once; False, at once, when the deadline has passed (the caller raises its timeout)."""
        remaining = None if self._deadline is None else self._deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return False
        if self._waiter is not None:
            self._waiter(0.05 if remaining is None else min(0.05, remaining))
        else:
            time.sleep(self._pause if remaining is None else min(self._pause, remaining))
            self._pause = min(self._pause * 2, _POLL_MAX)
        return True


class SegmentReader:
    """A read-only attachment to one segment. Open with :meth:`open`."""

    def __init__(
        self,
        path: Path,
        header: Header,
        slots: tuple[Slot, ...],
        metadata: dict[str, str],
        control: mmap.mmap,
        data: mmap.mmap | memoryview | None,
        data_base: int,
        files: tuple[str, ...] = (),
        volume: Volume | None = None,
    ) -> None:
        self.path = path
        self.volume = volume or Volume("small")
        """The kind of memory under the segment (huge pages or not): the GPU copy registers whole pages."""
        self.files = files
        """The model's weight files (layout version 2), indexed by :attr:`Slot.file`; empty for one file."""
        self.header = header
        self.slots = slots
        self.metadata: Mapping[str, str] = metadata
        with paused_collector():
            self.by_name = {s.name: s.index for s in slots}
        self._control = control
        self._data = data
        self._data_base = data_base
        self._data_view = memoryview(data) if data is not None else memoryview(b"")
        self._shared_view: memoryview | None = None
        self._ring = Ring(header.data_offset, header.ring_size) if header.ring else None
        self._u32: npt.NDArray[np.uint32] = np.frombuffer(control, dtype="<u4")
        first = header.state_offset // 4
        self._states = self._u32[
            first : first + len(slots) * (STATE_ENTRY_LENGTH // 4) : STATE_ENTRY_LENGTH // 4
        ]
        self.stale_after = STALE_AFTER
        self._next_lock_probe = 0.0

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> SegmentReader:
        """Check and map the segment at ``path``.

        Raises :class:`SidecarUnavailableError` when there is no file, :class:`SegmentLayoutError` or
        :class:`SegmentVersionError` when it breaks the layout, before mapping anything of the size it
        declares.
        """
        target = Path(path)
        fd = _open_segment(target)
        try:
            size = os.fstat(fd).st_size
            header_bytes = _read(fd, HEADER_LENGTH, 0, target)
            try:
                header = parse_header(header_bytes, file_size=size)
            except (SegmentLayoutError, SegmentVersionError) as exc:
                raise type(exc)(f"{target}: {exc}") from None  # which file, for a path that names another
            if struct.unpack_from("<I", header_bytes, OFF_WRITER_STATE)[0] == WriterState.CREATING:
                raise SegmentLayoutError(
                    f"segment {target} was never published (its writer died creating it)"
                )
            manifest = _read(fd, header.manifest_length, header.manifest_offset, target)
            if len(manifest) != header.manifest_length:
                raise SegmentLayoutError(f"segment {target} is truncated inside its manifest")
            with paused_collector():
                slots, metadata, files = parse_manifest(manifest, header)
                del manifest
            volume = volume_of(fd)
            control_length = min(mapped_length(header.data_offset, volume), size)
            control = mmap.mmap(fd, control_length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            data, base = _map_data(fd, header, volume, size)
        finally:
            os.close(fd)
        return cls(target, header, slots, metadata, control, data, base, files, volume)

    # --- state ----------------------------------------------------------------------------------------------

    @property
    def load_id(self) -> int:
        return self.header.load_id

    @property
    def memory_mode(self) -> MemoryMode:
        """What the writer does with consumed tensors (layout version 3); FULL before."""
        return self.header.memory_mode

    @property
    def writer_state(self) -> WriterState:
        value = int(self._u32[OFF_WRITER_STATE // 4])
        try:
            return WriterState(value)
        except ValueError:
            raise SegmentLayoutError(f"segment {self.path} has an unknown writer state {value}") from None

    @property
    def error(self) -> str:
        """The writer's reason for failing ('' unless FAILED)."""
        length = min(int(self._u32[OFF_ERROR_LENGTH // 4]), ERROR_CAPACITY)
        return bytes(self._control[OFF_ERROR : OFF_ERROR + length]).decode("utf-8", errors="replace")

    @property
    def writer_pid(self) -> int:
        return int(self._u32[OFF_WRITER_PID // 4])

    @property
    def tensors_ready(self) -> int:
        return int(self._u64(OFF_TENSORS_READY))

    @property
    def bytes_ready(self) -> int:
        return int(self._u64(OFF_BYTES_READY))

    @property
    def finished_ns(self) -> int:
        return int(self._u64(OFF_FINISHED_NS))

    @property
    def heartbeat_ns(self) -> int:
        return int(self._u64(OFF_HEARTBEAT_NS))

    def state(self, index: int) -> TensorState:
        value = int(self._states[index])
        try:
            return TensorState(value)
        except ValueError:
            raise SegmentLayoutError(
                f"tensor {self.slots[index].name!r} has an unknown state {value}"
            ) from None

    def flags(self, index: int) -> TensorFlags:
        return TensorFlags(int(self._u32[entry_offset(self.header.state_offset, index, ENTRY_FLAGS) // 4]))

    def crc32(self, index: int) -> int | None:
        """The writer's CRC-32 of the tensor's bytes, when it recorded one."""
        if TensorFlags.CRC32 not in self.flags(index):
            return None
        return int(self._u32[entry_offset(self.header.state_offset, index, ENTRY_CRC32) // 4])

    def ready_ns(self, index: int) -> int:
        return int(self._u64(entry_offset(self.header.state_offset, index, ENTRY_READY_NS)))

    def ready_mask(self, indices: Sequence[int] | None = None) -> npt.NDArray[np.bool_]:
        """Which of ``indices`` (all tensors when None) are READY, read in one pass over the state table."""
        states = self._states if indices is None else self._states[np.asarray(indices, dtype=np.intp)]
        mask: npt.NDArray[np.bool_] = states == TensorState.READY
        _memory.acquire_fence()
        return mask

    def is_ready(self, index: int) -> bool:
        """Whether tensor ``index`` is READY (its bytes may then be read)."""
        if self._states[index] != TensorState.READY:
            return False
        _memory.acquire_fence()
        return True

    def released_among(self, indices: Sequence[int]) -> list[int]:
        """Which of ``indices`` are RELEASED, in one pass over the state table."""
        picked = np.asarray(indices, dtype=np.intp)
        released: list[int] = picked[self._states[picked] == TensorState.RELEASED].tolist()
        return released

    def view(self, index: int) -> memoryview:
        """The bytes of tensor ``index``: meaningful only once it is READY (see :meth:`wait`), and in ring
        mode only until it is RELEASED (the writer then reuses its bytes for newer tensors)."""
        slot = self.slots[index]
        start = self.start(slot)
        return self._data_view[start : start + slot.nbytes]

    def start(self, slot: Slot) -> int:
        """Where ``slot``'s bytes start in :meth:`data` and :meth:`shared_data`."""
        offset = slot.offset if self._ring is None else self._ring.file_offset(slot.offset)
        return offset - self._data_base

    def data(self) -> memoryview:
        """This process's whole mapping of the data region, as bytes (a ring's twice over, back to back): what
        the GPU copy may pin in one piece rather than tensor by tensor."""
        return self._data_view

    def shared_data(self) -> memoryview:
        """The whole data mapping, for making many tensors from it (each at :meth:`start` of its slot) without
        a slice per tensor. Views taken from it keep the mapping alive after :meth:`close`."""
        if self._shared_view is None:
            self._shared_view = self._data_view[:]  # its own exports: close() can still release _data_view
        return self._shared_view

    @functools.cached_property
    def nbytes(self) -> npt.NDArray[np.int64]:
        """Every tensor's bytes, in manifest order."""
        return np.fromiter((s.nbytes for s in self.slots), dtype=np.int64, count=len(self.slots))

    # --- waiting --------------------------------------------------------------------------------------------

    def check_handout(self) -> None:
        """Raise before a READY tensor is handed out when its bytes can no longer be trusted: the writer
        declared the load FAILED (a file that then did not match its proof, or a load given up), or the file
        now holds another load (its ``load_id`` changed: copied over in place, against SPEC.md's rule that a
        new load is a new file). Two reads of the shared header: cheap enough for every hand-out. A writer
        that is merely gone is :meth:`check`'s to report: what it published stays what it published."""
        if self._u64(OFF_LOAD_ID) != self.header.load_id:
            raise LoadFailedError(
                "the segment file now holds another load (its load id changed under this reader: the file"
                " was overwritten in place); attach again",
                path=str(self.path),
            )
        if self.writer_state == WriterState.FAILED:
            raise LoadFailedError(self.error or "no reason recorded", path=str(self.path))

    def check(self) -> None:
        """Raise :class:`LoadFailedError` when the writer failed, is gone (its lock is free: SPEC.md,
        "Writers and loads"), or stopped beating."""
        state = self.writer_state
        if state == WriterState.FAILED:
            raise LoadFailedError(self.error or "no reason recorded", path=str(self.path))
        if state == WriterState.LOADING and time.monotonic() >= self._next_lock_probe:
            self._next_lock_probe = time.monotonic() + LOCK_PROBE_INTERVAL
            gone = writer_gone(self.path, self.load_id)
            if gone is not None and self.writer_state == WriterState.LOADING:
                raise LoadFailedError(
                    f"the writer of this load ({gone.describe()}) is gone: it was killed or crashed before"
                    " finishing; check its logs and restarts (a restarted sidecar loads again)",
                    path=str(self.path),
                )
        if state == WriterState.LOADING and self.stale_after:
            silent = (time.time_ns() - self.heartbeat_ns) / 1e9
            if silent < -self.stale_after:  # from the future: no live writer on this node's clock wrote it
                raise LoadFailedError(
                    f"the writer's last heartbeat is {-silent:.0f} s ahead of this clock; the segment was"
                    " not written by a live sidecar on this node: check the sidecar's logs and restarts",
                    path=str(self.path),
                )
            if silent > self.stale_after:
                raise LoadFailedError(
                    f"the writer (pid {self.writer_pid}) has not updated the segment for {silent:.0f} s; "
                    "it probably died: check the sidecar's logs and restarts",
                    path=str(self.path),
                )

    def wait_any(
        self,
        indices: Iterable[int],
        *,
        timeout: float | None = None,
        waiter: Waiter | None = None,
    ) -> npt.NDArray[np.intp]:
        """Block until at least one tensor in ``indices`` is READY; return every one of them that is.

        Raises :class:`LoadFailedError` when the writer failed (with its reason) or one of the tensors
        failed, and :class:`LoadTimeoutError` naming the missing tensors when ``timeout`` seconds pass first.
        An empty ``indices`` returns at once.
        """
        return self.wait_split(np.fromiter(indices, dtype=np.intp), timeout=timeout, waiter=waiter)[0]

    def wait_split(
        self,
        pending: npt.NDArray[np.intp],
        *,
        timeout: float | None = None,
        waiter: Waiter | None = None,
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
        """:meth:`wait_any` for an array of indices, returning ``(ready, still pending)``: one pass over the
        state table per wake-up, so waiting for 100,000 tensors in batches costs their count, not its
        square. While the writer's count of ready tensors stays the same, the table is looked at again only
        every :data:`_RESCAN` seconds (the count is advisory; the table stays the truth)."""
        pacer = _Pacer(timeout, waiter)
        seen, scanned = -1, 0.0
        while len(pending):
            count, now = self.tensors_ready, time.monotonic()
            if count != seen or now - scanned >= _RESCAN:
                seen, scanned = count, now
                states = self._states[pending]
                ready = states == TensorState.READY
                if ready.any():
                    _memory.acquire_fence()
                    self.check_handout()
                    return pending[ready], pending[~ready]
                self.check()
                self._check_states(pending, states)
            else:
                self.check()
            if not pacer.wait():
                raise self._timed_out(pending, timeout)
        return pending, pending

    def _check_states(self, pending: npt.NDArray[np.intp], states: npt.NDArray[np.uint32]) -> None:
        """Raise for a tensor among ``pending`` that is FAILED, RELEASED or in an unknown state."""
        if (states > TensorState.RELEASED).any():
            self.state(int(pending[states > TensorState.RELEASED][0]))  # raises, naming the tensor
        if (states == TensorState.RELEASED).any():
            raise self.released(int(pending[states == TensorState.RELEASED][0]))
        if (states == TensorState.FAILED).any():
            name = self.slots[int(pending[states == TensorState.FAILED][0])].name
            reason = self.error or "see the sidecar's log"
            raise LoadFailedError(f"tensor {name!r} failed: {reason}", path=str(self.path))

    def wait(
        self,
        indices: Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        waiter: Waiter | None = None,
    ) -> None:
        """Block until every tensor in ``indices`` (all when None) is READY; errors as :meth:`wait_any`."""
        pending = (
            np.arange(len(self.slots), dtype=np.intp) if indices is None else np.fromiter(indices, np.intp)
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(pending):
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            try:
                _, pending = self.wait_split(pending, timeout=remaining, waiter=waiter)
            except LoadTimeoutError:
                raise self._timed_out(pending, timeout) from None

    def wait_finished(self, *, timeout: float | None = None, waiter: Waiter | None = None) -> None:
        """Block until the writer has finished the load: return once it is COMPLETE (every tensor landed and
        every file proven: a store checksum, a published digest or the end-of-load samples), raise
        :class:`LoadFailedError` with its reason when it failed or is gone, :class:`LoadTimeoutError` after
        ``timeout`` seconds. Tensors are published as they land, before their file's end-of-load proof; an
        app that takes the whole model waits here so it never runs on weights the load then refuses."""
        pacer = _Pacer(timeout, waiter)
        while self.writer_state != WriterState.COMPLETE:
            self.check()
            if not pacer.wait():
                ready, total = self.tensors_ready, len(self.slots)
                doing = (
                    "every tensor is ready and the sidecar is still proving its files"
                    if ready >= total
                    else f"{ready}/{total} tensors are ready"
                )
                raise LoadTimeoutError(
                    f"the load is not finished after {timeout or 0:g} s: {doing} (see the sidecar's /status)"
                )

    def released(self, index: int) -> TensorReleasedError | SegmentLayoutError:
        """The error for reading tensor ``index`` after the writer gave its pages back (a layout error in a
        segment of memory mode full, which never gives pages back: SPEC.md, "State table")."""
        name = self.slots[index].name
        if self.memory_mode == MemoryMode.FULL:
            return SegmentLayoutError(
                f"tensor {name!r} of {self.path} is marked RELEASED, a state a segment of memory mode full "
                "never holds: the segment is corrupt or was not written by modelload"
            )
        mode = self.memory_mode.name.lower()
        return TensorReleasedError(
            f"tensor {name!r} was released: every consumer of {self.path} had copied it, and the sidecar "
            f"(memory mode {mode}) gave its pages back. To read tensors again after copying them, run the "
            "sidecar with --memory-mode full (ModelLoad spec.memory.mode: full); to load again, restart the "
            "pod",
            name=name,
        )

    def _timed_out(self, pending: npt.NDArray[np.intp], timeout: float | None) -> LoadTimeoutError:
        names = tuple(self.slots[int(i)].name for i in pending)
        shown = ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "")
        return LoadTimeoutError(
            f"{len(names)} tensors not ready after {timeout or 0:g} s ({shown}); "
            f"{self.tensors_ready}/{len(self.slots)} loaded so far",
            pending=names,
        )

    def _u64(self, offset: int) -> int:
        return int(struct.unpack_from("<Q", self._control, offset)[0])

    # --- closing ----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap what no array still uses. Arrays handed out keep their mapping alive until they are freed."""
        self._data_view.release()
        self._shared_view = None  # tensors made from it hold their own references
        self._states = self._u32 = np.empty(0, dtype="<u4")
        for mm in (self._data, self._control):
            if isinstance(mm, mmap.mmap):
                with contextlib.suppress(BufferError):
                    mm.close()
        self._data = None  # a ring's mapping goes with the last view of it

    def __enter__(self) -> SegmentReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SegmentReader {self.path} tensors={len(self.slots)} state={self.writer_state.name}>"


def _open_segment(target: Path) -> int:
    """The segment file at ``target``, open read-only: only a regular file, and never blocking (a FIFO there
    would block the open, and the attach, for ever, whatever its timeout)."""
    try:
        return open_regular(target, os.O_RDONLY, what="segment")
    except FileNotFoundError:
        raise SidecarUnavailableError(
            f"no segment at {target}: is the modelload sidecar running, and is its volume mounted here?"
        ) from None
    except OSError as exc:
        raise SegmentError(
            f"cannot open the segment {target}: {exc.strerror or exc}; give this process read access to the"
            " model volume (run the app as a user that may read what the sidecar writes)"
        ) from None


def _read(fd: int, length: int, offset: int, target: Path) -> bytes:
    """``length`` bytes of the segment at ``offset``; a file that cannot be read (a link to a file of
    /proc, say) is a layout error naming it, not a bare ``OSError``."""
    try:
        return os.pread(fd, length, offset)
    except OSError as exc:
        raise SegmentLayoutError(
            f"segment {target} cannot be read ({exc.strerror or exc}): it is not a segment the modelload"
            " sidecar wrote; remove it, or point the loader at the sidecar's segment"
        ) from None


def _map_data(
    fd: int, header: Header, volume: Volume, size: int
) -> tuple[mmap.mmap | memoryview | None, int]:
    """Map the data region copy-on-write, from the page boundary at or below data_offset; a ring twice over,
    and any segment on hugetlbfs, shared and read-only."""
    page = _mapping_page(header, volume)
    if header.ring:
        ring = _ring.map_ring(
            fd, start=header.data_offset, ring_offset=header.data_offset, ring_size=header.ring_size,
            writable=False, page_size=page,
        )  # fmt: skip
        return ring, header.data_offset
    if header.data_length == 0:
        return None, header.data_offset
    base = header.data_offset - header.data_offset % max(page, mmap.ALLOCATIONGRANULARITY)
    length = min(mapped_length(header.data_offset + header.data_length - base, volume), size - base)
    if volume.mapping_only:
        data = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, offset=base)
    else:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        data = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=prot, offset=base)
    return data, base


def _mapping_page(header: Header, volume: Volume) -> int:
    """The page the data mapping starts on: hugetlbfs's own (it maps nothing else); on a huge tmpfs its page
    where the writer aligned the data region to it (every address then maps whole huge pages); else 4 KiB."""
    if volume.mapping_only:
        return volume.page_size
    aligned = header.data_offset % volume.page_size == 0 and header.ring_size % volume.page_size == 0
    return volume.page_size if volume.huge and aligned else SMALL_PAGE
