"""The consumer table beside a segment of layout 3 or 4: who reads the model, which tensors each copied.

In memory modes release and ring (SPEC.md, layouts 3 and 4) the writer gives a tensor's pages back once
every registered consumer has consumed it. Consumers must therefore write somewhere: they register, beat a
heartbeat and set one bit per tensor they have copied. That bookkeeping lives in a small file of its own,
``<segment>.consumers``, not in the segment, for two reasons:

- the segment stays read-only to readers (SPEC.md reader rule 7): a reader cannot corrupt tensor bytes or
  the state table by mistake, and the loader keeps its read-only, copy-on-write mappings;
- the writer can make the table writable by every container of the pod (mode 0666: containers often run
  under different user ids) without making the model's bytes writable too.

Each consumer owns one entry and is its entry's only writer; claiming an entry is serialised with ``flock``
on the table. The writer only reads the table. Torn reads are harmless: an entry counts only once its state
word says ACTIVE, and a bit once set is never cleared while the entry lives.

**The table is not trusted.** Any container of the pod can write it, so a forged entry, a forged bit or a
truncated file must never make a consumer use wrong bytes, nor crash anyone:

- a consumer vouches for a tensor only from its own memory (:meth:`Registration.vouched`): the tensors it
  marked itself, each after its copy passed the check against the writer's state table (READY after the
  copy: SPEC.md, consumer table rule 5). A bit someone else set in its entry makes the writer release the
  tensor early, and the consumer's next copy of it then fails with TensorReleasedError instead of being
  taken for data; the state table is the writer's own (the segment is not writable by consumers);
- the writer never maps the table: it reads it with ``pread``, so a file truncated under it reads as free
  entries instead of killing the sidecar with SIGBUS; consumers write with ``pwrite`` too, except beside a
  segment on hugetlbfs, which takes no ``write()``: there they write through a mapping, and a truncated
  table can stop them (SIGBUS), never make them read wrong bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import SegmentError, SegmentLayoutError
from modelload.loader.segment._regular import open_regular
from modelload.loader.segment.pages import mapped_length, round_up, volume_of

__all__ = [
    "CAPACITY",
    "EXPIRY",
    "HEARTBEAT_INTERVAL",
    "ConsumerEntry",
    "ConsumerTable",
    "Registration",
    "create_table",
    "table_path",
]

MAGIC = b"MODELCON"
TABLE_VERSION = 1
HEADER_LENGTH = 4096
ENTRY_HEADER = 64
LABEL_LENGTH = 32
CAPACITY = 64
"""Consumers one segment can have at once (tensor-parallel workers of one pod are a handful)."""
HEARTBEAT_INTERVAL = 2.0
"""Seconds between a consumer's heartbeats."""
EXPIRY = 30.0
"""Seconds without a heartbeat after which a consumer counts as gone (its entry may be claimed again)."""

FREE, ACTIVE, LEFT = 0, 1, 2
_HEADER = struct.Struct(
    "<8sIIQQII"
)  # magic, version, capacity, load_id, tensor_count, entry_length, reserved
_ENTRY = struct.Struct("<IIQQQ32s")  # state, pid, registered_ns, heartbeat_ns, consumed, label


def table_path(segment: str | os.PathLike[str]) -> Path:
    """Where the consumer table of ``segment`` lives: beside it, with ``.consumers`` appended."""
    path = Path(segment)
    return path.with_name(path.name + ".consumers")


def entry_length(tensor_count: int) -> int:
    """Bytes of one entry: 64 bytes of fields, then a bitmap of one bit per tensor, padded to 64 bytes."""
    return -(-(ENTRY_HEADER + -(-tensor_count // 8)) // 64) * 64


def table_length(tensor_count: int, capacity: int = CAPACITY) -> int:
    return HEADER_LENGTH + capacity * entry_length(tensor_count)


def create_table(segment: Path, *, load_id: int, tensor_count: int, capacity: int = CAPACITY) -> Path:
    """Create the empty table for a new load of ``segment``, under a temporary name then renamed into place.

    The writer calls this before it publishes the segment, so that a reader that finds a version-3 segment
    also finds its table (with the same load id).

    The header is written through a mapping and the file is whole pages of its volume: beside a segment on
    hugetlbfs (``segment.pages``) the table is on hugetlbfs too, which takes no ``write()`` and no other size.
    """
    final = table_path(segment)
    temp = final.with_name(f".{final.name}.{load_id:016x}.tmp")
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        os.fchmod(fd, 0o666)  # the umask would take write access from the app's containers
        volume = volume_of(fd)
        length = table_length(tensor_count, capacity)
        os.ftruncate(fd, mapped_length(length, volume))
        header = _HEADER.pack(
            MAGIC, TABLE_VERSION, capacity, load_id, tensor_count, entry_length(tensor_count), 0
        )
        with mmap.mmap(fd, mapped_length(HEADER_LENGTH, volume), flags=mmap.MAP_SHARED) as mm:
            mm[: len(header)] = header
        temp.rename(final)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    finally:
        os.close(fd)
    return final


@dataclass(frozen=True)
class ConsumerEntry:
    """One consumer as the table shows it (the writer's view)."""

    slot: int
    pid: int
    label: str
    registered_ns: int
    heartbeat_ns: int
    consumed: int
    """Tensors this consumer has marked consumed (advisory)."""
    active: bool = True
    """False once the consumer left (``Model.close()``): it needs nothing more."""

    def age(self, now_ns: int | None = None) -> float:
        """Seconds since the consumer's last heartbeat."""
        return max(((now_ns or time.time_ns()) - self.heartbeat_ns) / 1e9, 0.0)


class ConsumerTable:
    """One consumer table, checked against the segment it belongs to, read and written by offset."""

    def __init__(
        self, path: Path, fd: int, capacity: int, tensor_count: int, mm: mmap.mmap | None = None
    ) -> None:
        self.path = path
        self._fd = fd
        self._mm = mm
        """A consumer's writable mapping, only where the volume takes no ``write()`` (hugetlbfs)."""
        self.capacity = capacity
        self.tensor_count = tensor_count
        self.entry_length = entry_length(tensor_count)

    @classmethod
    def open(
        cls, segment: str | os.PathLike[str], *, load_id: int, tensor_count: int, write: bool
    ) -> ConsumerTable:
        """Open and check the table of ``segment``; ``write`` for a consumer, read-only for the writer."""
        path = table_path(segment)
        try:
            fd = open_regular(path, os.O_RDWR if write else os.O_RDONLY, what="consumer table")
        except FileNotFoundError:
            raise SegmentLayoutError(
                f"the segment releases consumed tensors (memory mode release or ring) but its consumer table "
                f"{path} is missing; "
                "the sidecar that wrote it died while creating it: restart the pod"
            ) from None
        except PermissionError:
            raise SegmentError(
                f"cannot register as a consumer: {path} is not writable by this process (uid {os.getuid()}); "
                "run the app with write access to the model volume, or attach(register=False) to read only"
            ) from None
        except OSError as exc:
            raise SegmentError(
                f"cannot open the consumer table {path}: {exc.strerror or exc}; mount the model volume"
                " read-write here, or attach(register=False) to read only"
            ) from None
        try:
            size = os.fstat(fd).st_size
            try:
                header = os.pread(fd, HEADER_LENGTH, 0)
            except OSError as exc:
                raise SegmentLayoutError(
                    f"consumer table {path} cannot be read ({exc.strerror or exc}): it is not the table the"
                    " modelload sidecar wrote; restart the pod"
                ) from None
            if len(header) < _HEADER.size or size < HEADER_LENGTH:
                raise SegmentLayoutError(f"consumer table {path} is truncated")
            magic, version, capacity, table_load, count, length, reserved = _HEADER.unpack_from(header)
            if magic != MAGIC or version != TABLE_VERSION or reserved:
                raise SegmentLayoutError(f"{path} is not a version-{TABLE_VERSION} modelload consumer table")
            if table_load != load_id or count != tensor_count:
                raise SegmentLayoutError(
                    f"consumer table {path} belongs to another load ({table_load:016x}, not {load_id:016x}); "
                    "the sidecar replaced the load: attach again"
                )
            expected = table_length(count, capacity)
            volume = volume_of(fd)
            if (
                not 1 <= capacity <= 4096
                or length != entry_length(count)
                or size not in (expected, round_up(expected, volume.page_size))
            ):
                raise SegmentLayoutError(f"consumer table {path} has an impossible geometry")
            mm = None
            if write and volume.mapping_only:
                mm = mmap.mmap(fd, mapped_length(expected, volume), flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, capacity, count, mm)

    @classmethod
    def for_writer(cls, segment: str | os.PathLike[str], *, tensor_count: int) -> ConsumerTable:
        """The writer's read-only view of the table it created for ``segment``: it checks nothing in the file,
        since it knows the geometry (anyone may have scribbled on the header since, or truncated the file,
        and a refusal would let them fail the load), and reads every entry as untrusted."""
        path = table_path(segment)
        fd = open_regular(path, os.O_RDONLY, what="consumer table")  # a FIFO put there must not block it
        return cls(path, fd, CAPACITY, tensor_count)

    def _read(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset``; zeros (free entries) for what a truncated file no longer holds."""
        data = os.pread(self._fd, length, offset)
        return data + bytes(length - len(data))

    # --- the writer's view ----------------------------------------------------------------------------------

    def entries(self) -> list[ConsumerEntry]:
        """Every entry ACTIVE (stale or not: the caller judges heartbeats) or LEFT, read in one pass."""
        table = self._read(HEADER_LENGTH, self.capacity * self.entry_length)
        found = []
        for slot in range(self.capacity):
            at = slot * self.entry_length
            state, pid, registered, heartbeat, consumed, label = _ENTRY.unpack_from(table, at)
            if state in (ACTIVE, LEFT):
                text = label.rstrip(b"\0").decode("utf-8", errors="replace")
                entry = ConsumerEntry(slot, pid, text, registered, heartbeat, consumed, state == ACTIVE)
                found.append(entry)
        return found

    def consumed_bits(self, slot: int) -> npt.NDArray[np.uint8]:
        """The packed bitmap of entry ``slot`` (bit i, least significant first, is tensor i)."""
        data = self._read(self._at(slot) + ENTRY_HEADER, -(-self.tensor_count // 8))
        return np.frombuffer(data, dtype=np.uint8).copy()

    # --- the consumer's side --------------------------------------------------------------------------------

    def register(self, *, label: str | None = None) -> Registration:
        """Claim an entry (a free one, one left, or one whose heartbeat expired) and start its heartbeat."""
        now = time.time_ns()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            for slot in range(self.capacity):
                state, _, _, heartbeat, _, _ = _ENTRY.unpack(self._read(self._at(slot), _ENTRY.size))
                if state != ACTIVE or (now - heartbeat) / 1e9 > EXPIRY:
                    break
            else:
                raise SegmentError(
                    f"all {self.capacity} consumer entries of {self.path} are taken by live consumers; "
                    "detach processes that no longer read the model (Model.close())"
                )
            at = self._at(slot)
            text = (label or f"{socket.gethostname()}/{os.getpid()}").encode()[:LABEL_LENGTH]
            entry = _ENTRY.pack(FREE, os.getpid() & 0xFFFFFFFF, now, now, 0, text)
            self._put(at, entry.ljust(self.entry_length, b"\0"))  # the bitmap zeroed
            self._write(at, "<I", ACTIVE)  # the state word last: the entry is whole now
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return Registration(self, slot, now)

    def _at(self, slot: int) -> int:
        return HEADER_LENGTH + slot * self.entry_length

    def _put(self, offset: int, data: bytes | bytearray) -> None:
        if self._mm is not None:
            self._mm[offset : offset + len(data)] = data
        else:
            os.pwrite(self._fd, data, offset)

    def _write(self, offset: int, fmt: str, value: int) -> None:
        self._put(offset, struct.pack(fmt, value))

    def _read_u64(self, offset: int) -> int:
        value: int = struct.unpack("<Q", self._read(offset, 8))[0]
        return value

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
        os.close(self._fd)


class Registration:
    """This process's entry in a consumer table: mark tensors consumed; a thread keeps the heartbeat.

    What it marked is kept here too: the table is writable by every container of the pod, so only this
    process's own memory says which tensors it vouched for (:meth:`vouched`)."""

    def __init__(self, table: ConsumerTable, slot: int, registered_ns: int) -> None:
        self.table = table
        self.slot = slot
        self.registered_ns = registered_ns
        self._at = table._at(slot)
        self._lock = threading.Lock()
        self._bits = bytearray(-(-table.tensor_count // 8))
        self._count = 0
        self._marked: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="modelload-consumer-heartbeat", daemon=True)
        self._thread.start()

    def mark(self, indices: list[int], *, copied: bool = True) -> None:
        """Record that this consumer is done with tensors ``indices``: its copy is complete and checked, or
        (``copied`` false) it will never copy them, which vouches for nothing."""
        base = self._at + ENTRY_HEADER
        with self._lock:
            if self._stop.is_set() or not self.owns():
                return
            for index in indices:
                byte, bit = index // 8, 1 << (index % 8)
                if copied:
                    self._marked.add(index)
                if not self._bits[byte] & bit:
                    self._bits[byte] |= bit
                    self._count += 1
                    self.table._put(base + byte, self._bits[byte : byte + 1])
            self.table._write(self._at + 24, "<Q", self._count)

    def vouched(self, index: int) -> bool:
        """Whether this consumer itself marked tensor ``index`` consumed while it held its entry: never what
        the table says (anyone may have set the bit there)."""
        with self._lock:
            return index in self._marked

    def has(self, index: int) -> bool:
        """Whether this consumer vouched for tensor ``index`` and still holds its entry."""
        return self.vouched(index) and self.owns()

    def owns(self) -> bool:
        """Whether the entry is still this consumer's. One that stopped beating past the expiry may find its
        entry taken by a newer consumer (rule 1): it must then write nothing there, neither bits the
        newcomer has not earned (the writer would release tensors the newcomer still copies) nor LEFT."""
        return self.table._read_u64(self._at + 8) == self.registered_ns

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL):
            with self._lock:
                if self._stop.is_set() or not self.owns():
                    return
                self.table._write(self._at + 16, "<Q", time.time_ns())

    def leave(self) -> None:
        """Give the entry up: the writer stops waiting for this consumer."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            if self.owns():
                self.table._write(self._at, "<I", LEFT)
        self._thread.join()
        self.table.close()
