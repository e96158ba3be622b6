"""The one protocol every source implements, and what they share.

A source is one object (a file, a URL, an S3 key) read by byte ranges. The engine calls :meth:`read_into`
from many threads at once, each with a slice of the shared-memory segment as the buffer; the operator calls
:meth:`read_bytes` a few times to read a model's index. Everything else (retries, resume, planning) lives
above this protocol, so a new backend is one small class.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

from modelload.loader.errors import TransientSourceError, TruncatedError

from ._checksums import StoreChecksum

__all__ = [
    "SMALLEST_WINDOW",
    "WINDOW",
    "WINDOWS",
    "InterruptedReadError",
    "ObjectInfo",
    "RangeSink",
    "Source",
    "SourceBase",
    "byte_view",
    "check_range",
    "file_version",
    "views_after",
    "window",
    "window_size",
]

RangeSink = Callable[[memoryview, int], None]
"""Takes a range's bytes as they arrive, in order: ``sink(data, at)``, ``at`` being where ``data`` starts in
the range. ``data`` lives only for the call (its buffer is reused for the next bytes)."""

WINDOW = 1 << 20
"""The most bytes a source hands a :data:`RangeSink` at a time (:meth:`SourceBase.read_into_sink`): big enough
that a window is a few system calls, small enough that every reader thread can keep its own."""
WINDOWS = 8 << 20
"""The most bytes the windows of one load's readers hold together (:func:`window_size`)."""
SMALLEST_WINDOW = 256 << 10
"""The least a window shrinks to: below it, a body is received as it comes, not in batches
(``_low_water.SHORTEST``)."""

_windows = threading.local()


def window_size(readers: int) -> int:
    """The window of each of ``readers`` threads: :data:`WINDOW` while they all fit in :data:`WINDOWS`
    (8 readers), less for more readers, down to :data:`SMALLEST_WINDOW`; whole pages.

    Each reader keeps its window for the load: 16 readers of 1 MiB held 16 MiB, about an eighth of a
    sidecar's memory with 100,000 tensors. Measured here (100,000 tensors in 160 shards from the S3-like
    origin, 16 readers, old and new alternating, 4 rounds, load average 5.0-6.7), 512 KiB windows took the
    peak RSS besides the segment from 127-129 to 119-120 MiB for the same CPU (2.41-2.62 CPU-s a load
    before, 2.39-2.57 after). Smaller windows cost CPU where bytes come at once: from nginx on loopback
    with 8 readers, 512 KiB windows cost 0.1-0.2 CPU-s more a load than 1 MiB, which 8 readers keep."""
    share = WINDOWS // max(1, readers) // 4096 * 4096
    return max(SMALLEST_WINDOW, min(WINDOW, share))


def window(size: int = WINDOW) -> memoryview:
    """This thread's reusable buffer of ``size`` bytes, for bytes on their way to a sink (made again when
    the size asked for changes)."""
    view: memoryview | None = getattr(_windows, "view", None)
    if view is None or len(view) != size:
        _windows.view = view = None  # the old buffer goes before the new one is made
        view = _windows.view = memoryview(bytearray(size))
    return view


@dataclass(frozen=True)
class ObjectInfo:
    """What a source knows about its object, from the first request.

    ``size`` in bytes. ``etag`` is the server's entity tag, quotes included (``'"abc"'``), or a synthetic
    one for files; ``last_modified`` the server's Last-Modified header, when sent. Either is used to notice
    that the object changed during the load. ``accepts_ranges`` is False when the server answered a
    range request with the whole object: such a source can only be read from its start, in one stream.
    ``checksums`` are the ones the store keeps of this version of the whole object
    (:class:`~._checksums.StoreChecksum`), best first; empty when it keeps none or did not say.
    """

    size: int
    etag: str | None = None
    last_modified: str | None = None
    accepts_ranges: bool = True
    checksums: Sequence[StoreChecksum] = ()
    version: str | None = None
    """The origin's own name for this content when it has one besides the ETag (a GCS generation, a Hub
    commit, an OCI digest); see :func:`file_version`."""


def file_version(info: ObjectInfo) -> str | None:
    """The version of an object a load records (SPEC.md, "Writers and loads"): the source's own
    ``version``, else its ETag; None when it has neither (a server that sends only Last-Modified, whose
    one-second resolution cannot tell two uploads apart): such a load is never taken for another."""
    return info.version if info.version is not None else info.etag


class InterruptedReadError(TransientSourceError):
    """A transient failure of :meth:`Source.read_into` that says how far it got.

    ``landed`` bytes at the start of the buffer are valid; a retry only needs the rest. Every transient
    error a built-in source raises from ``read_into`` is of this class (``landed`` is 0 when nothing
    arrived). It extends the error tree without changing it: callers that catch TransientSourceError
    still catch it.
    """

    def __init__(
        self, message: str, *, uri: str | None = None, landed: int = 0, retry_after: float | None = None
    ) -> None:
        self.landed = landed
        super().__init__(message, uri=uri, retry_after=retry_after)


@runtime_checkable
class Source(Protocol):
    """A byte-addressable object. Implementations are thread-safe."""

    @property
    def display_uri(self) -> str:
        """The object's URI for messages and logs: never credentials, signatures or query strings."""
        ...

    @property
    def supports_fd(self) -> bool:
        """Whether :meth:`read_into_fd` can land bytes in a file without passing through user space."""
        ...

    def stat(self) -> ObjectInfo:
        """The object's size and validators; the first call asks the source, later calls are cached."""
        ...

    def read_into(self, offset: int, buf: memoryview) -> None:
        """Fill all of ``buf`` with the bytes at ``[offset, offset + len(buf))``, or raise.

        Raises :class:`InterruptedReadError` (``landed`` set) for transient failures, and the permanent
        branches of SourceError otherwise. A range past the end raises TruncatedError before any request.
        """
        ...

    def read_bytes(self, offset: int, length: int) -> bytes:
        """The bytes at ``[offset, offset + length)``, for small reads such as a file's header."""
        ...

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        """Like :meth:`read_into`, but write the bytes into file ``fd`` at ``fd_offset`` (pwrite-style).

        Only when :attr:`supports_fd` is true. ``landed`` on an interruption counts bytes written.
        """
        ...

    def close(self) -> None:
        """Release connections and file descriptors. Reads after close are an error."""
        ...


class SourceBase:
    """Shared plumbing: the cached stat, range checks, ``read_bytes`` and the context manager.

    Subclasses implement ``_stat`` (one uncached look-up) and ``read_into``; ``read_into_fd`` when they can.
    """

    supports_fd: bool = False

    def __init__(self, display_uri: str) -> None:
        self._display_uri = display_uri
        self._info: ObjectInfo | None = None
        self._stat_lock = threading.Lock()

    @property
    def display_uri(self) -> str:
        return self._display_uri

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._display_uri!r})"

    def stat(self) -> ObjectInfo:
        info = self._info
        if info is None:
            with self._stat_lock:
                if self._info is None:
                    self._info = self._stat()
                info = self._info
        return info

    def stat_with_prefix(self, length: int) -> tuple[ObjectInfo, bytes]:
        """The object's size and validators, and its first ``length`` bytes (all of it when shorter): one
        request where the source can answer both at once (a ranged GET does), which a model's index and a
        small file need. The first call caches the stat, as :meth:`stat` does."""
        with self._stat_lock:
            if self._info is None:
                info, head = self._stat_prefix(length)
                self._info = info
                if head is not None:
                    return info, head
        info = self.stat()
        return info, self.read_bytes(0, min(length, info.size))

    def _stat_prefix(self, length: int) -> tuple[ObjectInfo, bytes | None]:
        """One uncached look-up that may bring the first ``length`` bytes too (None: it does not)."""
        return self._stat(), None

    lands_best_through_a_window: bool = False
    """Whether a range of big tensors costs less read into a buffer and written with ``pwritev``, each
    tensor's CRC-32 taken from the buffer, than spliced and then read back from the segment for its CRC-32:
    so for a local file (measured: 0.72 against 0.90 CPU-s for 1 GiB in 32 MiB tensors), not for a socket,
    whose splice saves the copy into this process."""

    local: bool = False
    """Whether a read costs no round trip (a local file): a model's files are then looked up one after the
    other, as threads would only take turns for the GIL with nothing to wait for."""

    every_read_validated: bool = False
    """Whether every read so far was checked against the validators of the first look-up (a file's size
    and mtime around it, an HTTP response's ETag): then a fresh look-up at the end of a load proves
    nothing more (:func:`modelload.sidecar.load.integrity.check_unchanged`)."""

    def restat(self) -> ObjectInfo:
        """A fresh look-up of the size and validators, bypassing the cache: the end-of-load check that the
        object is still the one the load started with. The cached :meth:`stat` is left as it was."""
        return self._stat()

    def _stat(self) -> ObjectInfo:
        raise NotImplementedError

    def read_into(self, offset: int, buf: memoryview) -> None:
        raise NotImplementedError

    def read_bytes(self, offset: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(offset, memoryview(out))
        return bytes(out)

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot write into a file descriptor")

    def read_into_pieces(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in turn with the bytes from ``offset`` on: one range, landed in several places (a
        chunk of neighbouring tensors, each in its own slot). ``landed`` on an interruption counts bytes of
        the whole range. This default reads the range once into a buffer of its own and copies from there;
        sources that can scatter a response themselves (HTTP, files) override it."""
        total = sum(len(buf) for buf in bufs)
        bounce = memoryview(bytearray(total))
        try:
            self.read_into(offset, bounce)
        except InterruptedReadError as exc:
            _scatter(bounce[: exc.landed], bufs)
            raise
        _scatter(bounce, bufs)

    def read_into_fd_pieces(self, offset: int, fd: int, pieces: Sequence[tuple[int, int]]) -> None:
        """Like :meth:`read_into_pieces`, writing each ``(fd_offset, length)`` piece into file ``fd``. This
        default reads the range once into a buffer and writes the pieces from there."""
        bounce = memoryview(bytearray(sum(length for _, length in pieces)))
        try:
            self.read_into(offset, bounce)
        except InterruptedReadError as exc:
            _write_pieces(bounce[: exc.landed], fd, pieces)
            raise
        _write_pieces(bounce, fd, pieces)

    def read_into_sink(self, offset: int, length: int, sink: RangeSink, *, window: int = WINDOW) -> None:
        """Hand the ``length`` bytes from ``offset`` to ``sink`` as they arrive, in order, in one request (a
        chunk of many small tensors, written on by the sink in a few system calls). ``landed`` on an
        interruption counts the bytes the sink has had. This default reads the range once into a buffer of
        its own; sources that stream a response override it to pass a :func:`window` of ``window`` bytes at
        a time."""
        bounce = memoryview(bytearray(length))
        try:
            self.read_into(offset, bounce)
        except InterruptedReadError as exc:
            if exc.landed > 0:
                sink(bounce[: exc.landed], 0)
            raise
        sink(bounce, 0)

    def close(self) -> None:
        """Nothing to release by default."""

    def __enter__(self) -> SourceBase:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _checked_range(self, offset: int, length: int) -> ObjectInfo:
        """Stat the object and check the range lies inside it, before any transfer or allocation."""
        info = self.stat()
        check_range(offset, length, info.size, uri=self._display_uri)
        return info


def views_after(views: Sequence[memoryview], done: int) -> list[memoryview]:
    """The parts of ``views`` (taken in turn, as one range) after the range's first ``done`` bytes."""
    if not done:
        return list(views)
    rest = []
    for view in views:
        if done < len(view):
            rest.append(view[done:] if done else view)
        done = max(done - len(view), 0)
    return rest


def _scatter(data: memoryview, bufs: Sequence[memoryview]) -> None:
    """Copy ``data`` into ``bufs`` in turn, as far as it goes."""
    at = 0
    for buf in bufs:
        n = min(len(buf), len(data) - at)
        if n <= 0:
            return
        buf[:n] = data[at : at + n]
        at += n


def _write_pieces(data: memoryview, fd: int, pieces: Sequence[tuple[int, int]]) -> None:
    """Write ``data`` into file ``fd`` as the ``(fd_offset, length)`` pieces in turn, as far as it goes."""
    at = 0
    for fd_offset, length in pieces:
        piece = data[at : at + length]
        if not piece:
            return
        written = 0
        while written < len(piece):
            written += os.pwrite(fd, piece[written:], fd_offset + written)
        at += length


def check_range(offset: int, length: int, size: int, *, uri: str) -> None:
    """Refuse a range that starts below 0 or ends past ``size`` (a truncated file, or a bad index)."""
    if offset < 0 or length < 0:
        raise ValueError(
            f"a range needs a non-negative offset and length, got offset={offset} length={length}"
        )
    if offset + length > size:
        raise TruncatedError(
            f"the range [{offset}, {offset + length}) reaches past the end of the object ({size} bytes)",
            source=uri,
        )


def byte_view(buf: memoryview | bytearray) -> memoryview:
    """``buf`` as a flat view of bytes, so lengths and slices count bytes whatever the buffer's item type.

    Raises TypeError for a read-only or non-contiguous buffer: bytes can only land in writable memory.
    """
    if type(buf) is memoryview and buf.format == "B" and buf.ndim == 1 and not buf.readonly:
        return buf  # the usual case, a slice of the segment: nothing to make (a range of 1,000 tensors)
    view = memoryview(buf)
    if view.readonly:
        raise TypeError("the destination buffer is read-only")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view
