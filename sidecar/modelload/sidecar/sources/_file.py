"""A local file (``file:///path`` or a plain path): positional reads into the caller's buffer.

``os.preadv`` reads straight into the memoryview and takes the offset, so one descriptor serves every thread
with no seek and no lock. Each read compares the file's size and modification time with the first stat,
before and after it, so an in-place rewrite during a load is reported as a change rather than mixed into the
segment.
"""

from __future__ import annotations

import errno
import os
import stat as stat_module
from collections.abc import Sequence
from urllib.parse import unquote, urlsplit

from modelload.loader.errors import (
    ConfigError,
    SegmentSpaceError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    SourceUriError,
)

from ._base import WINDOW, InterruptedReadError, ObjectInfo, RangeSink, SourceBase, byte_view, views_after
from ._base import window as thread_window
from ._settings import SourceSettings
from ._splice import HAVE_SPLICE, Progress, splice_file

__all__ = ["FileSource", "open_file"]

_IOV_MAX = 1024
"""The most buffers one ``preadv`` takes (Linux's IOV_MAX)."""


class FileSource(SourceBase):
    """A regular file, opened read-only at construction (so a missing file fails at once)."""

    supports_fd = HAVE_SPLICE
    every_read_validated = True  # size and mtime are compared before and after every read
    lands_best_through_a_window = True  # see SourceBase
    local = True  # see SourceBase

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self._path = path
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _translate(exc, path, "open") from exc
        mode = os.fstat(self._fd).st_mode
        if not stat_module.S_ISREG(mode):
            os.close(self._fd)
            raise ConfigError(f"{path} is not a regular file: point the source at the model file itself")

    def _fingerprint(self) -> tuple[int, int]:
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime_ns

    def _stat(self) -> ObjectInfo:
        size, mtime_ns = self._fingerprint()
        return ObjectInfo(size=size, etag=f'"{mtime_ns:x}-{size:x}"', accepts_ranges=True)

    def _check_unchanged(self, info: ObjectInfo) -> None:
        size, mtime_ns = self._fingerprint()
        etag = f'"{mtime_ns:x}-{size:x}"'
        if etag != info.etag:
            raise SourceChangedError(
                f"{self._path} changed while it was being read (its size or mtime differ from the"
                " first look); restart the load once the file is complete",
                uri=self._path,
            )

    def read_bytes(self, offset: int, length: int) -> bytes:
        """One ``pread`` into a new ``bytes``, size and mtime checked around it. The default's zeroed buffer
        and its copy cost three passes and two sets of fresh pages: for the 512 KiB first read of each of
        a mixture of experts' 160 shards that was 0.15 CPU-s of a 0.4 s index read."""
        info = self._checked_range(offset, length)
        self._check_unchanged(info)
        try:
            data = os.pread(self._fd, length, offset)
        except OSError as exc:
            raise _translate(exc, self._path, "read", landed=0) from exc
        if len(data) < length:  # only at the end of a regular file: it shrank, said precisely there
            return super().read_bytes(offset, length)
        self._check_unchanged(info)
        return data

    def read_into(self, offset: int, buf: memoryview) -> None:
        self.read_into_pieces(offset, [buf])

    def read_into_pieces(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """``preadv`` straight into ``bufs`` in turn (one range, several places), with the file's size and
        mtime checked before and after: bytes read between two equal looks are the version the load
        started with, so a file needs no sample re-read (``integrity.needs_samples``)."""
        views = [byte_view(buf) for buf in bufs]
        length = sum(len(view) for view in views)
        info = self._checked_range(offset, length)
        self._check_unchanged(info)
        progress = Progress()
        while (done := progress.done) < length:
            try:
                got = os.preadv(self._fd, views_after(views, done)[:_IOV_MAX], offset + done)
            except OSError as exc:
                raise _translate(exc, self._path, "read", landed=done) from exc
            if got == 0:
                self._check_unchanged(info)
                raise SourceChangedError(
                    f"{self._path} ended at {offset + done} bytes, before the {info.size} it had at first",
                    uri=self._path,
                )
            progress.done += got
        self._check_unchanged(info)

    def read_into_sink(self, offset: int, length: int, sink: RangeSink, *, window: int = WINDOW) -> None:
        """``pread`` the range a :func:`window` of ``window`` bytes at a time, each handed to ``sink``, with
        the file's size and mtime checked before and after (see :meth:`read_into_pieces`). A read that fails
        hands over what came first, so a retry resumes at the byte where it failed."""
        info = self._checked_range(offset, length)
        self._check_unchanged(info)
        buf, progress = thread_window(window), Progress()
        while (done := progress.done) < length:
            view = buf[: min(len(buf), length - done)]
            filled = 0
            while filled < len(view):
                try:
                    got = os.preadv(self._fd, [view[filled:]], offset + done + filled)
                except OSError as exc:
                    if filled:
                        sink(view[:filled], done)
                    raise _translate(exc, self._path, "read", landed=done + filled) from exc
                if got == 0:
                    self._check_unchanged(info)
                    raise SourceChangedError(
                        f"{self._path} ended at {offset + done + filled} bytes, before the {info.size} it had"
                        " at first",
                        uri=self._path,
                    )
                filled += got
            sink(view, done)
            progress.done += len(view)
        self._check_unchanged(info)

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        self.read_into_fd_pieces(offset, fd, [(fd_offset, length)])

    def read_into_fd_pieces(self, offset: int, fd: int, pieces: Sequence[tuple[int, int]]) -> None:
        """Splice each ``(fd_offset, length)`` piece of the range into file ``fd`` in turn, size and mtime
        checked before and after (see :meth:`read_into_pieces`)."""
        info = self._checked_range(offset, sum(length for _, length in pieces))
        self._check_unchanged(info)
        landed = 0
        for fd_offset, length in pieces:
            progress = Progress()
            try:
                splice_file(self._fd, offset + landed, length, fd, fd_offset, progress=progress)
            except EOFError as exc:
                raise SourceChangedError(
                    f"{self._path} ended before offset {offset + landed + length}: it shrank during the load",
                    uri=self._path,
                ) from exc
            except SegmentSpaceError:
                raise
            except OSError as exc:
                raise _translate(exc, self._path, "read", landed=landed + progress.done) from exc
            landed += length
        self._check_unchanged(info)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _translate(exc: OSError, path: str, action: str, *, landed: int = 0) -> SourceError:
    """Map an OSError of ``action`` on ``path`` to the branch of the error tree that says what to do."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return SourceNotFoundError(f"no file at {path}: check the path and the volume mount", uri=path)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return SourceAccessDeniedError(
            f"cannot {action} {path}: permission denied; check the file's mode and the container's user",
            uri=path,
        )
    if exc.errno == errno.EISDIR:
        return SourceNotFoundError(f"{path} is a directory: point the source at the model file", uri=path)
    return InterruptedReadError(f"cannot {action} {path}: {reason}", uri=path, landed=landed)


def open_file(uri: str, settings: SourceSettings) -> FileSource:
    """The registry's factory for ``file://`` URIs and plain paths."""
    if uri.startswith("file:"):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"file URIs name a local path (file:///path), got host {parts.netloc!r} in {uri}"
            )
        path = unquote(parts.path)
    else:
        path = uri
    if not path:
        raise SourceUriError("the source path is empty")
    return FileSource(path)
