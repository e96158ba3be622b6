"""One writer per segment: the lock file beside a segment, and what readers learn from it.

A segment path has at most one writer at a time (a sidecar, or ``modelload stage``). The writer holds an
exclusive ``flock`` on ``<segment>.lock`` for as long as it may write (a sidecar: its whole life), and
writes who it is into the file: its pid and host, its program, its status URL, and the ``load_id`` of the
segment it is writing. A second writer is refused at once with a message naming the first.

The lock also tells readers something the heartbeat says only after a minute: a LOADING segment whose
load_id the lock file names, while nobody holds the lock, has lost its writer (killed, or crashed), and a
reader can fail at once instead of waiting for the heartbeat to go stale (SPEC.md, "Writers and loads").

The file is opened with ``O_NOFOLLOW`` and must be a regular file: the volume is shared with the app's
containers, and a link planted there must not make the writer write elsewhere. It is never removed (a lock
file that is removed and re-created can be held by two processes at once); a writer that ends leaves it,
unlocked, for the next. Its content is small JSON, at most :data:`MAX_LOCK_BYTES` bytes, and readers
parse it defensively: a bad file only costs them the early answer.

On hugetlbfs (``segment.pages``) a file takes no ``write()``, only whole huge pages through a mapping, and
a page of the pod's pool for a few bytes of JSON would be a page the operator's sizing does not count. There
the lock file stays empty: it still admits one writer (``flock`` is the file system's own), a second is
refused without the first's name, and a reader takes an empty lock file that nobody holds, beside a LOADING
segment, as its writer gone (a writer holds the lock for as long as its segment is LOADING).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from modelload.loader.errors import ConfigError, SegmentError
from modelload.loader.segment.pages import volume_of

__all__ = [
    "MAX_LOCK_BYTES",
    "SegmentBusyError",
    "WriterInfo",
    "WriterLock",
    "holder",
    "lock_path",
    "writer_gone",
]

MAX_LOCK_BYTES = 4096
"""The lock file's content is at most this many bytes; a reader reads no further."""
LOCK_MODE = 0o644
"""Readable by every container of the pod (readers probe the lock); writable by the writer only."""
_ACQUIRE_PATIENCE = 0.5
"""Seconds a writer keeps trying: a reader's probe holds a shared lock for a few microseconds."""


def lock_path(segment: Path) -> Path:
    """``<segment>.lock``, beside the segment."""
    return segment.with_name(segment.name + ".lock")


class SegmentBusyError(ConfigError):
    """Another writer holds the segment's lock: two writers would overwrite each other's load."""

    def __init__(self, message: str, *, holder: WriterInfo | None) -> None:
        self.holder = holder
        super().__init__(message)


@dataclass(frozen=True)
class WriterInfo:
    """Who holds (or last held) a segment's lock, as its lock file says."""

    pid: int
    host: str
    program: str
    started: float
    """Unix time the writer took the lock."""
    status_url: str | None = None
    load_id: int | None = None
    """The load_id of the segment the writer is writing, once it created one."""

    def describe(self) -> str:
        """``modelload sidecar (pid 12, host pod-a, status http://127.0.0.1:8479)``."""
        if not self.pid:  # an empty lock file (hugetlbfs): nothing names the writer
            return self.program
        parts = [f"pid {self.pid}", f"host {self.host}"]
        if self.status_url:
            parts.append(f"status {self.status_url}")
        return f"{self.program} ({', '.join(parts)})"

    def encode(self) -> bytes:
        document: dict[str, Any] = {
            "pid": self.pid,
            "host": self.host,
            "program": self.program,
            "started": round(self.started, 3),
            "status_url": self.status_url,
            "load_id": f"{self.load_id:016x}" if self.load_id is not None else None,
        }
        return json.dumps(document, separators=(",", ":"), sort_keys=True).encode()[:MAX_LOCK_BYTES]

    @classmethod
    def decode(cls, data: bytes) -> WriterInfo | None:
        """The info in a lock file's bytes; None when they are not a lock file's (readers then ignore it)."""
        try:
            doc = json.loads(data.decode("utf-8"))
            load_id = doc.get("load_id")
            status_url = doc.get("status_url")
            info = cls(
                pid=int(doc["pid"]),
                host=str(doc["host"])[:256],
                program=str(doc["program"])[:64],
                started=float(doc["started"]),
                status_url=str(status_url)[:512] if isinstance(status_url, str) else None,
                load_id=int(load_id, 16) if isinstance(load_id, str) else None,
            )
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
            return None
        return info


class WriterLock:
    """The exclusive lock of one segment path, held until :meth:`release` (or the process ends).

    >>> lock = WriterLock.acquire(Path("/dev/shm/model.seg"), program="modelload stage")  # doctest: +SKIP
    """

    def __init__(self, segment: Path, fd: int, info: WriterInfo) -> None:
        self.segment = segment
        self.path = lock_path(segment)
        self._fd = fd
        self.info = info
        self._described = not _mapping_only(fd)
        """Whether the file takes the description (not on hugetlbfs: see the module)."""

    @classmethod
    def acquire(cls, segment: Path, *, program: str, status_url: str | None = None) -> WriterLock:
        """Take the lock of ``segment``; :class:`SegmentBusyError` naming the holder when another has it."""
        segment = segment.absolute()
        path = lock_path(segment)
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        with contextlib.suppress(OSError):  # readers of another user probe it: whatever the umask
            os.fchmod(fd, LOCK_MODE)
        try:
            deadline = time.monotonic() + _ACQUIRE_PATIENCE
            while not _try_lock(fd, fcntl.LOCK_EX):
                if time.monotonic() >= deadline:
                    holder = _read_info(fd)
                    who = holder.describe() if holder is not None else "another process"
                    raise SegmentBusyError(
                        f"the segment {segment} already has a writer: {who}. One segment takes one writer:"
                        " stop that one first, or give this one its own segment path (--segment/"
                        "MODELLOAD_SEGMENT)",
                        holder=holder,
                    )
                time.sleep(0.01)
            info = WriterInfo(
                pid=os.getpid(), host=socket.gethostname(), program=program, started=time.time(),
                status_url=status_url,
            )  # fmt: skip
            lock = cls(segment, fd, info)
            lock._write()
        except BaseException:
            os.close(fd)
            raise
        return lock

    def update(self, *, status_url: str | None = None, load_id: int | None = None) -> None:
        """Record the writer's status URL, or the load_id of the segment it is about to publish."""
        changes: dict[str, Any] = {}
        if status_url is not None:
            changes["status_url"] = status_url
        if load_id is not None:
            changes["load_id"] = load_id
        self.info = replace(self.info, **changes)
        self._write()

    def _write(self) -> None:
        if self._fd < 0:
            raise SegmentError(f"the lock of {self.segment} was released")
        if not self._described:
            return
        data = self.info.encode()
        try:
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
        except OSError as exc:  # a full volume: the lock still holds; only the description is short
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise

    def release(self) -> None:
        """Let go of the lock (the file stays, for the next writer). Idempotent."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> WriterLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<WriterLock {self.path} {'held' if self._fd >= 0 else 'released'}>"


def writer_gone(segment: Path, load_id: int) -> WriterInfo | None:
    """The last writer's info when the lock file names ``load_id`` and no process holds the lock (the
    writer of that load died); None when a writer holds it, the file names another load, or there is no
    readable lock file (an older writer: the heartbeat decides)."""
    try:
        fd = _open(lock_path(segment), os.O_RDONLY)
    except (SegmentError, OSError):
        return None
    try:
        info = _read_info(fd)
        if info is None:
            info = _undescribed(fd)  # on hugetlbfs: a lock file that names no load, nor can
            if info is None:
                return None
        elif info.load_id != load_id:
            return None
        if not _try_lock(fd, fcntl.LOCK_SH):
            return None  # held: the writer lives
        fcntl.flock(fd, fcntl.LOCK_UN)
        return info
    finally:
        os.close(fd)


def holder(segment: Path) -> WriterInfo | None:
    """Who holds the lock of ``segment`` now; None when nobody does (or there is no lock file)."""
    try:
        fd = _open(lock_path(segment), os.O_RDONLY)
    except (SegmentError, OSError):
        return None
    try:
        if _try_lock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return _read_info(fd)
    finally:
        os.close(fd)


def _open(path: Path, flags: int) -> int:
    """Open the lock file without following a link, and only if it is a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, LOCK_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SegmentError(
                f"{path} is a symbolic link; a segment's lock file must be a plain file: remove the link"
            ) from None
        if flags & os.O_CREAT and exc.errno == errno.EROFS:
            raise SegmentError(
                f"cannot create a segment in {path.parent}: it is on a read-only file system; mount the"
                " volume read-write there, or choose another folder (--segment/MODELLOAD_SEGMENT)"
            ) from None
        if flags & os.O_CREAT:
            raise SegmentError(
                f"cannot create the lock file {path}: {exc.strerror or exc}; mount the volume read-write, or"
                " choose a folder this user can write (--segment/MODELLOAD_SEGMENT)"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SegmentError(f"{path} is not a plain file; a segment's lock file must be one: remove it")
    with contextlib.suppress(OSError):
        os.set_blocking(fd, True)
    return fd


def _mapping_only(fd: int) -> bool:
    try:
        return volume_of(fd).mapping_only
    except OSError:
        return False


_UNDESCRIBED = WriterInfo(pid=0, host="", program="unnamed: its lock file is on hugetlbfs", started=0.0)


def _undescribed(fd: int) -> WriterInfo | None:
    """:data:`_UNDESCRIBED` for the empty lock file of a segment on hugetlbfs, which names no writer and
    no load (see the module); None for any other file that holds no description."""
    try:
        empty = os.fstat(fd).st_size == 0
    except OSError:
        return None
    return _UNDESCRIBED if empty and _mapping_only(fd) else None


def _try_lock(fd: int, operation: int) -> bool:
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    return True


def _read_info(fd: int) -> WriterInfo | None:
    try:
        data = os.pread(fd, MAX_LOCK_BYTES, 0)
    except OSError:
        return None
    return WriterInfo.decode(data)
