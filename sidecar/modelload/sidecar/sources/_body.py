"""Reading one response body into a buffer or a file, counting every byte that landed.

``http.client`` parses the status line and headers; the body is then read from the socket directly: first
the few bytes the response's buffered reader already pulled in with the headers, then ``recv_into`` on the
socket (into the caller's memoryview) or ``os.splice`` (into the caller's file). Reading in our own loop is
what lets an interrupted transfer say exactly how many bytes arrived, so a retry asks only for the rest;
``BufferedReader.readinto`` would lose that count when the connection breaks mid-call.

Chunked bodies (never used by S3 or nginx for files, possible behind other servers) go through
``HTTPResponse.readinto``, which decodes the chunks.
"""

from __future__ import annotations

import http.client
import io
import socket
from collections.abc import Callable, Sequence

from ._base import RangeSink, views_after
from ._low_water import LowWater
from ._splice import (
    HAVE_SPLICE,
    Progress,
    RateFloor,
    landing_watcher,
    pwrite_all,
    receive_spliced,
    splice_socket,
)

__all__ = ["Body", "read_document"]

# The buffer of the reader http.client parses headers with (socket.makefile("rb") uses this size).
_READER_BUFFER = io.DEFAULT_BUFFER_SIZE
_BOUNCE_SIZE = 1 << 20
_IOV_MAX = 1024
"""The most buffers one ``recvmsg_into`` takes (Linux's IOV_MAX)."""
_DOCUMENT_STEP = 64 << 10


def read_document(response: http.client.HTTPResponse, limit: int, floor: RateFloor | None) -> bytes:
    """Up to ``limit`` bytes of a small body (a model's index with the look-up, a small file, an API answer,
    a listing page, an error page): all of it when it is shorter.

    ``HTTPResponse.read`` waits for as long as bytes keep coming: the socket's timeout bounds each wait, not
    the whole read, so a server that trickles a byte every few seconds would hold it (and the load) forever.
    Here ``floor`` bounds the whole, as it does a range: a body slower than it raises SlowTransferError,
    which the caller's retries treat as any stalled transfer. Raises EOFError when the server closes the
    connection before the Content-Length it announced (``read`` would return the short body as if whole).
    """
    parts: list[bytes] = []
    got = 0
    while got < limit:
        data = response.read1(min(limit - got, _DOCUMENT_STEP))
        if not data:
            if response.length:  # announced, never sent
                raise EOFError("the server closed the connection before the body was complete")
            break
        parts.append(data)
        got += len(data)
        if floor is not None:
            floor.check(got)
    return b"".join(parts)


class Body:
    """The remaining body of one response. Methods raise EOFError (the server closed early),
    TimeoutError (a stall; SlowTransferError for bytes slower than ``floor``) or OSError; ``Progress``
    objects passed in say how far they got."""

    def __init__(
        self,
        response: http.client.HTTPResponse,
        sock: socket.socket,
        *,
        stall_timeout: float,
        floor: RateFloor | None = None,
    ) -> None:
        self._floor = floor
        self._response = response
        self._sock = sock
        self._stall_timeout = stall_timeout
        self._buffer_drained = False
        self._chunked = bool(response.chunked)
        # Long bodies from a plain socket are received in batches (TLS and chunked bodies as they come).
        self._low = None if self._chunked or hasattr(sock, "cipher") else LowWater(sock, stall_timeout)
        self._splice_windows = HAVE_SPLICE and self._low is not None
        self._watcher = landing_watcher()  # told of each part of the caller's memory filled, in order

    def readinto(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (which must not extend past the body) and return the count."""
        if self._chunked:
            try:
                got = self._response.readinto(view)
            except http.client.IncompleteRead as exc:
                raise EOFError("the chunked body ended early") from exc
        elif not self._buffer_drained:
            prefix = self._take_buffered(len(view))
            got = len(prefix)
            view[:got] = prefix
        else:
            got = self._recv_into(view)
        if got == 0:
            raise EOFError("the server closed the connection before the body was complete")
        return got

    def fill(self, view: memoryview, progress: Progress) -> None:
        """Fill all of ``view``; ``progress.done`` counts the bytes already in it."""
        length, low = len(view), self._low
        while progress.done < length:
            if low is not None and self._buffer_drained:
                low.expect(length - progress.done)
            done = progress.done
            got = self.readinto(view[done:])
            progress.done = done + got
            if self._watcher is not None:
                self._watcher(view[done : done + got])
            if self._floor is not None:
                self._floor.check(progress.done)

    def fill_pieces(self, views: Sequence[memoryview], progress: Progress) -> None:
        """Fill ``views`` in turn (one range landed in several places); ``progress.done`` counts the bytes
        of the whole range already in. From a plain socket one ``recvmsg_into`` fills as many pieces as the
        socket holds bytes for (a range of a thousand small tensors is not a thousand system calls)."""
        scatter = not self._chunked and not hasattr(self._sock, "cipher")
        rest = views_after(views, progress.done)
        left, low, watcher = sum(map(len, rest)), self._low, self._watcher
        at = 0  # rest[at] is the first view not yet full
        while at < len(rest):
            if low is not None and self._buffer_drained:
                low.expect(left)
            if scatter and self._buffer_drained:
                got = self._recvmsg_into(rest[at : at + _IOV_MAX])
                if got == 0:
                    raise EOFError("the server closed the connection before the body was complete")
            else:
                got = self.readinto(rest[at])
            progress.done += got
            left -= got
            while got:  # step past what landed: whole views, then into the one it stopped in
                size = len(rest[at])
                if got < size:
                    if watcher is not None:
                        watcher(rest[at][:got])
                    rest[at] = rest[at][got:]
                    break
                if watcher is not None:
                    watcher(rest[at])
                got -= size
                at += 1
            if self._floor is not None:
                self._floor.check(progress.done)

    def stream(self, buf: memoryview, count: int, sink: RangeSink, progress: Progress) -> None:
        """Hand ``count`` body bytes to ``sink``, ``buf`` (reused) full at a time; ``progress.done`` counts
        the bytes the sink has had. When the stream breaks, the sink first gets what had come into ``buf``,
        so a retry resumes at the byte where it broke. Like :meth:`fill`, it waits for a batch of the
        window at a time (the socket's low-water mark), not for every packet."""
        low = self._low
        while (done := progress.done) < count:
            view = buf[: min(len(buf), count - done)]
            filled = 0
            try:
                while filled < len(view):
                    if low is not None and self._buffer_drained:
                        low.expect(len(view) - filled)
                    filled += self._receive_window(view[filled:])
                    if self._floor is not None:
                        self._floor.check(done + filled)
            except BaseException:
                if filled:
                    sink(view[:filled], done)
                    progress.done = done + filled
                raise
            sink(view, done)
            progress.done = done + len(view)

    def splice_pieces(self, fd: int, pieces: Sequence[tuple[int, int]], progress: Progress) -> None:
        """Write the body into file ``fd`` as the ``(fd_offset, length)`` pieces in turn; ``progress.done``
        counts the bytes of the whole range already in."""
        before = 0
        for fd_offset, length in pieces:
            if progress.done < before + length:
                # splice_into counts from the start of its own range: shift the piece back by what the
                # pieces before it took, so one Progress counts the whole response.
                self.splice_into(fd, fd_offset - before, before + length, progress)
            before += length

    def skip(self, count: int) -> None:
        """Read and drop ``count`` bytes (single-stream fallback for servers that ignore Range), as slowly as
        the floor allows; the floor's measure then starts again for the bytes that land, which a long skip
        must not count as slow (they were not asked for yet)."""
        scratch = memoryview(bytearray(min(count, _BOUNCE_SIZE)))
        floor = self._floor
        skipped = 0
        while skipped < count:
            skipped += self.readinto(scratch[: min(count - skipped, len(scratch))])
            if floor is not None:
                floor.check(skipped)
        if floor is not None:
            floor.restart()

    def splice_into(self, fd: int, fd_offset: int, count: int, progress: Progress) -> None:
        """Write ``count`` body bytes into file ``fd`` at ``fd_offset``; ``progress.done`` counts them.

        Spliced from the socket when it is a plain TCP socket; TLS and chunked bodies bounce through a
        1 MiB buffer and ``os.pwrite``.
        """
        if self._chunked or not HAVE_SPLICE or hasattr(self._sock, "cipher"):
            self._bounce_into(fd, fd_offset, count, progress)
            return
        while not self._buffer_drained and progress.done < count:
            prefix = self._take_buffered(count - progress.done)
            if not prefix:
                raise EOFError("the server closed the connection before the body was complete")
            pwrite_all(fd, memoryview(prefix), fd_offset + progress.done, progress)
        rest = count - progress.done
        if rest:
            splice_socket(
                self._sock.fileno(),
                rest,
                fd,
                fd_offset + progress.done,
                stall_timeout=self._stall_timeout,
                progress=progress,
                floor=self._floor,
                batch=self._low,
            )

    def _recv_into(self, view: memoryview) -> int:
        """``recv_into`` from the socket, through the waits of a raised low-water mark."""
        return self._through_waits(lambda: self._sock.recv_into(view, len(view)))

    def _receive_window(self, view: memoryview) -> int:
        """:meth:`readinto` for a window on its way to a sink: from a plain TCP socket by way of a pipe
        (:func:`~._splice.receive_spliced`), which costs less than ``recv_into`` for a window's size.
        (Not for a long range into a mapping: a receive there takes a whole batch at once, a splice
        at most the pipe's 1 MiB, and it measured 0.16 CPU-s per GiB dearer.)"""
        if not self._splice_windows or not self._buffer_drained:
            return self.readinto(view)
        got = self._through_waits(lambda: receive_spliced(self._sock, view))
        if got == 0:
            raise EOFError("the server closed the connection before the body was complete")
        return got

    def _recvmsg_into(self, views: Sequence[memoryview]) -> int:
        """``recvmsg_into`` (one receive scattered over ``views``), through the same waits."""
        return self._through_waits(lambda: int(self._sock.recvmsg_into(views)[0]))

    def _through_waits(self, receive: Callable[[], int]) -> int:
        """``receive()``, again after each wait of a raised low-water mark that ended without bytes
        (``_low_water``: the socket's timeout then says only that the mark was not reached)."""
        while True:
            try:
                return receive()
            except TimeoutError:
                if self._low is None or not self._low.waited():
                    raise

    def _take_buffered(self, limit: int) -> bytes:
        """The next body bytes that the response's buffered reader pulled in with the headers.

        ``read1`` returns buffered bytes without touching the socket (or does one socket read when the
        buffer is empty). A call that asks for the whole buffer size, or gets fewer bytes than it asked
        for, leaves the buffer empty: from then on the socket is read directly.
        """
        fp = self._response.fp
        if fp is None:
            self._buffer_drained = True
            return b""
        want = min(limit, _READER_BUFFER)
        data: bytes = fp.read1(want)
        if want == _READER_BUFFER or len(data) < want:
            self._buffer_drained = True
        return data

    def _bounce_into(self, fd: int, fd_offset: int, count: int, progress: Progress) -> None:
        scratch = memoryview(bytearray(min(count, _BOUNCE_SIZE)))
        while progress.done < count:
            got = self.readinto(scratch[: min(count - progress.done, len(scratch))])
            pwrite_all(fd, scratch[:got], fd_offset + progress.done, progress)
            if self._floor is not None:
                self._floor.check(progress.done)

    def finish(self) -> None:
        """Mark the response consumed, so its connection can carry the next request."""
        if self._low is not None:
            self._low.reset()
        self._response.close()
