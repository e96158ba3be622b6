"""Range reads over HTTP(S): the hot path shared by every store on the HTTP path (a plain URL, S3, GCS, Azure,
the Hub and registries).

Each read is one ``GET`` with ``Range: bytes=a-b`` on this thread's persistent connection. The answer must be
``206`` with exactly the asked ``Content-Range`` and ``Content-Length`` and, once the object's ETag is known,
the same ETag (``If-Match`` asks the server to refuse with 412 when the object was replaced; the comparison
catches servers that ignore ``If-Match``). The body goes straight from the socket into the caller's buffer
(``recv_into``) or file (``os.splice``), see ``_body.py``.

Every failure becomes a branch of ``modelload.loader.errors`` here, never later: a transient one carries
how many bytes landed (:class:`InterruptedReadError`), so the retry layer resumes where the stream broke
(the socket and TLS errors are translated in ``_transport_errors.py``, status codes in ``_responses.py``).
A plain ``http(s)://`` URL is :class:`~._url.HttpSource`, this class pointed at one URL.
"""

from __future__ import annotations

import http.client
import logging
import socket
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin

from modelload.loader.errors import ModelloadError, RangeNotSupportedError, SourceChangedError, SourceError

from ._base import WINDOW, ObjectInfo, RangeSink, SourceBase, byte_view, check_range
from ._base import window as thread_window
from ._body import Body, read_document
from ._connections import ConnectionPool, Origin, socket_of
from ._deadline import Deadline
from ._responses import error_for_status, parse_byteranges, parse_content_range, same_etag
from ._settings import HttpSettings
from ._splice import Progress, RateFloor
from ._transport_errors import translate_transport_error

__all__ = ["Exchange", "HttpObject", "Target"]

_log = logging.getLogger("modelload.sidecar.sources")
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_ERROR_BODY_MAX = 65536
# A failure of these kinds before any response byte, on a connection that served earlier requests, most
# likely means the server closed it while idle: retried once, at once, on a fresh connection.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


@dataclass(frozen=True)
class Target:
    """Where one request goes: the origin, the path with query as sent, and the headers to send."""

    origin: Origin
    path: str
    headers: Mapping[str, str]


@dataclass
class _Exchange:
    origin: Origin
    conn: http.client.HTTPConnection
    sock: socket.socket
    response: http.client.HTTPResponse

    @property
    def status(self) -> int:
        return self.response.status

    def header(self, name: str) -> str | None:
        return self.response.getheader(name)


Exchange = _Exchange
"""One request and its answer, as a subclass's :meth:`HttpObject._check_answer` sees it."""


class HttpObject(SourceBase):
    """An object read by HTTP range requests. Subclasses say where requests go (:meth:`_target`) and may
    refine how error responses read (:meth:`_error`) and whether redirects are followed
    (:meth:`_redirect`)."""

    def __init__(
        self,
        display_uri: str,
        settings: HttpSettings,
        *,
        ca_bundle: str | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        """``pool``: the connections of a sibling source made with the same ``settings`` and ``ca_bundle``
        (another file of the same model), shared while it is open (see
        :class:`~._connections.ConnectionPool`)."""
        super().__init__(display_uri)
        self._settings = settings
        shared = pool.share() if pool is not None else None
        self._pool = shared if shared is not None else ConnectionPool(settings, ca_bundle=ca_bundle)
        self._closed = False
        self._fallback_warned = False
        self.every_read_validated = True

    @property
    def pool(self) -> ConnectionPool:
        """The connections this source uses (shared with its siblings, see ``pool`` above)."""
        return self._pool

    @property
    def connections_opened(self) -> int:
        """How many connections this source opened (the reader count, when keep-alive works)."""
        return self._pool.connections_opened

    # --- hooks -------------------------------------------------------------------------------------------

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        raise NotImplementedError

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        return error_for_status(
            exchange.status, exchange.response.reason, exchange.response.headers, uri=self.display_uri
        )

    def _redirect(self, location: str) -> bool:
        """Point later requests at ``location`` and return True, or return False to treat it as an error."""
        return False

    def _plain_http_advice(self, origin: Origin) -> str:
        """What to do when ``origin``, reached over TLS, answered in plain HTTP."""
        return f"if it serves plain HTTP, use http://{origin.netloc}/..."

    def _pin(self, info: ObjectInfo) -> dict[str, str]:
        """Headers that make the server refuse a read of another version than ``info`` (``If-Match``)."""
        if info.etag and not info.etag.startswith("W/"):
            return {"If-Match": info.etag}
        return {}

    def _change(self, exchange: _Exchange, info: ObjectInfo) -> str | None:
        """How an answer's validators differ from ``info``'s (the object was replaced), or None."""
        etag = exchange.header("ETag")
        if not same_etag(info.etag, etag):
            return f"ETag {info.etag} -> {etag}"
        modified = exchange.header("Last-Modified")
        if info.etag is None and info.last_modified and modified and modified != info.last_modified:
            return f"Last-Modified {info.last_modified} -> {modified}"
        return None

    # --- requests ----------------------------------------------------------------------------------------

    def _open(self, method: str, headers: Mapping[str, str], *, accept: frozenset[int]) -> _Exchange:
        """Send a request and return the exchange when its status is in ``accept``; raise otherwise."""
        hops = 0
        while True:
            exchange = self._send(method, self._target(method, headers))
            status = exchange.status
            if status in accept:
                return exchange
            location = exchange.header("Location")
            body = self._small_body(exchange)
            if status in _REDIRECTS and location and hops < self._settings.max_redirects:
                current = f"{exchange.origin.scheme}://{exchange.origin.netloc}"
                if self._redirect(urljoin(current + "/", location)):
                    hops += 1
                    continue
            raise self._error(exchange, body)

    def _send(self, method: str, target: Target) -> _Exchange:
        if self._closed:  # its pool may live on for the sibling sources sharing it
            raise RuntimeError("the source is closed")
        for attempt in range(2):
            try:
                conn, reused = self._pool.acquire(target.origin)
            except (OSError, ssl.SSLError, UnicodeError) as exc:
                raise self._translate(exc, connecting=target.origin) from exc
            sock = socket_of(conn)
            settings = self._settings
            # the head may take the stall timeout to start, then comes at once from a healthy server
            head = Deadline(sock, settings.stall_timeout + settings.slow_window)
            try:
                with head:
                    path = self._pool.request_path(target.origin, target.path)
                    conn.request(method, path, headers=dict(target.headers))
                    response = conn.getresponse()
                if head.fired:  # the headers read were cut short
                    raise head.error("the response's status line and headers")
            except (OSError, http.client.HTTPException, UnicodeError) as exc:
                self._pool.discard(target.origin, conn)
                if head.fired:
                    raise self._translate(head.error("the response's status line and headers")) from exc
                if isinstance(exc, _STALE) and reused and attempt == 0:
                    continue
                raise self._translate(exc) from exc
            return _Exchange(target.origin, conn, sock, response)
        raise AssertionError("unreachable")  # pragma: no cover

    def floor(self) -> RateFloor:
        """The slowest a body may come (``min_rate`` over ``slow_window``), for one response."""
        return RateFloor(self._settings.min_rate, self._settings.slow_window)

    def _small_body(self, exchange: _Exchange) -> bytes:
        """Read an error or probe body when it is small, keeping the connection; else drop the connection.
        A body that does not come (it trickles, the connection breaks) is given up: empty."""
        response = exchange.response
        whole = response.length is not None and response.length <= _ERROR_BODY_MAX
        try:
            body = read_document(response, _ERROR_BODY_MAX, self.floor())
        except (OSError, EOFError, http.client.HTTPException):
            body, whole = b"", False
        if whole:
            response.close()
            return body
        self._pool.discard(exchange.origin, exchange.conn)
        return body

    # --- the Source protocol -----------------------------------------------------------------------------

    def _stat(self) -> ObjectInfo:
        return self._range_stat(1)[0]

    def _stat_prefix(self, length: int) -> tuple[ObjectInfo, bytes | None]:
        if type(self)._stat is not HttpObject._stat:  # a store's own look-up (a metadata API): keep it
            return self._stat(), None
        return self._range_stat(length)

    def _range_stat(self, length: int) -> tuple[ObjectInfo, bytes | None]:
        """The look-up as a ranged GET of the first ``length`` bytes: the size, the validators, and the
        bytes (None when the answer is not exactly them)."""
        # A range GET rather than HEAD: presigned URLs are signed for GET only, it tells whether ranges
        # work, S3 answers it with an XML error body that names the problem, and its body is the object's
        # first bytes, which a model's index or a small file needs next.
        exchange = self._open("GET", {"Range": f"bytes=0-{length - 1}"}, accept=frozenset({200, 206, 416}))
        status = exchange.status
        if status != 416:
            self._refuse_encoded(exchange)
        etag, last_modified = exchange.header("ETag"), exchange.header("Last-Modified")
        if status == 200:
            size = exchange.response.length
            self._pool.discard(exchange.origin, exchange.conn)  # the whole object follows: do not read it
            if size is None:
                raise RangeNotSupportedError(
                    f"{self.display_uri}: the server ignores Range requests and does not give the size",
                    uri=self.display_uri,
                )
            return ObjectInfo(
                size=size, etag=etag, last_modified=last_modified, accepts_ranges=size == 0
            ), None
        first, last, total = parse_content_range(exchange.header("Content-Range"))
        head = (
            self._prefix_body(exchange, first, last, length) if status == 206 else self._small_body(exchange)
        )
        if total is None and status == 416:
            # An empty object cannot serve byte 0; not every server says its size in Content-Range then.
            answer = self._open("HEAD", {}, accept=frozenset({200}))
            declared = answer.header("Content-Length")
            total = int(declared) if declared and declared.isdigit() else None
            etag, last_modified = answer.header("ETag"), answer.header("Last-Modified")
            answer.response.close()
        if total is None:
            raise SourceError(
                f"{self.display_uri}: HTTP {status} without a usable Content-Range: the size is unknown",
                uri=self.display_uri,
            )
        info = ObjectInfo(size=total, etag=etag, last_modified=last_modified, accepts_ranges=True)
        return info, (head if status == 206 and len(head) == min(length, total) else None)

    def _prefix_body(self, exchange: _Exchange, first: int | None, last: int | None, length: int) -> bytes:
        """The body of a 206 answering ``bytes=0-(length - 1)``: the object's first bytes; empty (and the
        connection dropped) when it is not exactly what was asked."""
        if first != 0 or last is None or last >= length or exchange.response.length not in (None, last + 1):
            self._small_body(exchange)
            return b""
        try:
            body = read_document(exchange.response, last + 1, self.floor())
            if len(body) != last + 1:
                raise EOFError("the body is shorter than its Content-Range")
            exchange.response.close()
        except (OSError, EOFError, http.client.HTTPException) as exc:
            self._pool.discard(exchange.origin, exchange.conn)
            raise self._translate(exc, total=last + 1) from exc
        return body

    def read_into(self, offset: int, buf: memoryview) -> None:
        buf = byte_view(buf)
        info = self._checked_range(offset, len(buf))
        if not len(buf):
            return
        progress = Progress()
        self._transfer(info, offset, len(buf), progress, lambda body: body.fill(buf, progress))

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        info = self._checked_range(offset, length)
        if not length:
            return
        progress = Progress()
        self._transfer(
            info, offset, length, progress, lambda body: body.splice_into(fd, fd_offset, length, progress)
        )

    def read_into_pieces(self, offset: int, bufs: Sequence[memoryview]) -> None:
        """One ranged GET whose body fills ``bufs`` in turn (see :meth:`SourceBase.read_into_pieces`)."""
        views = [byte_view(buf) for buf in bufs]
        total = sum(len(view) for view in views)
        info = self._checked_range(offset, total)
        if not total:
            return
        progress = Progress()
        self._transfer(info, offset, total, progress, lambda body: body.fill_pieces(views, progress))

    def read_into_fd_pieces(self, offset: int, fd: int, pieces: Sequence[tuple[int, int]]) -> None:
        """One ranged GET whose body is spliced into file ``fd`` as the ``(fd_offset, length)`` pieces."""
        total = sum(length for _, length in pieces)
        info = self._checked_range(offset, total)
        if not total:
            return
        progress = Progress()
        self._transfer(info, offset, total, progress, lambda body: body.splice_pieces(fd, pieces, progress))

    def read_into_sink(self, offset: int, length: int, sink: RangeSink, *, window: int = WINDOW) -> None:
        """One ranged GET whose body is handed to ``sink`` a :func:`window` of ``window`` bytes at a time
        (see :meth:`SourceBase.read_into_sink`)."""
        info = self._checked_range(offset, length)
        if not length:
            return
        progress, buf = Progress(), thread_window(window)
        self._transfer(info, offset, length, progress, lambda body: body.stream(buf, length, sink, progress))

    def read_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """The bytes of several small ``(offset, length)`` ranges in one request (a multi-range GET: the
        end-of-load samples of a file); None when the server does not answer with exactly those ranges
        (it ignores multiple ranges, or merges them): the caller then reads them one by one."""
        info = self.stat()
        for offset, length in ranges:
            check_range(offset, length, info.size, uri=self.display_uri)
        spec = ",".join(f"{offset}-{offset + length - 1}" for offset, length in ranges)
        exchange = self._open(
            "GET", {"Range": f"bytes={spec}", **self._pin(info)}, accept=frozenset({200, 206})
        )
        change = self._change(exchange, info)
        expected = sum(length for _, length in ranges)
        declared = exchange.response.length
        if exchange.status != 206 or (declared is not None and declared > 2 * expected + 256 * len(ranges)):
            self._pool.discard(exchange.origin, exchange.conn)  # the whole object, or far more than asked
            return None
        try:
            body = read_document(exchange.response, 2 * expected + 256 * len(ranges), self.floor())
            exchange.response.close()
        except (OSError, EOFError, http.client.HTTPException) as exc:
            self._pool.discard(exchange.origin, exchange.conn)
            raise self._translate(exc) from exc
        if change is not None:
            raise SourceChangedError(
                f"{self.display_uri} changed while it was being read ({change})", uri=self.display_uri
            )
        parts = parse_byteranges(exchange.header("Content-Type"), body)
        wanted = [(offset, offset + length - 1) for offset, length in ranges]
        if parts is None or any(key not in parts for key in wanted):
            return None
        return [parts[key] for key in wanted]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.close()

    # --- one ranged GET ----------------------------------------------------------------------------------

    def _transfer(
        self, info: ObjectInfo, offset: int, length: int, progress: Progress, land: Callable[[Body], None]
    ) -> None:
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", **self._pin(info)}
        exchange = self._open("GET", headers, accept=frozenset({200, 206}))
        reusable = False
        try:
            settings = self._settings
            body = Body(
                exchange.response, exchange.sock, stall_timeout=settings.stall_timeout, floor=self.floor()
            )
            whole = self._check_answer(exchange, info, offset, length)
            if whole is False:
                body.skip(offset)
            land(body)
            body.finish()
            reusable = whole is not False
        except (OSError, EOFError, http.client.HTTPException) as exc:
            raise self._translate(exc, landed=progress.done, total=length) from exc
        finally:
            if not reusable:
                self._pool.discard(exchange.origin, exchange.conn)

    def _check_answer(self, exchange: _Exchange, info: ObjectInfo, offset: int, length: int) -> bool | None:
        """Check a 200/206 answer matches what was asked and the object is unchanged.

        Returns None for a 206 of exactly the range, True for a 200 that is exactly the (whole-object)
        range, False for a 200 whose first ``offset`` bytes must be skipped (the single-stream fallback).
        """
        uri = self.display_uri
        self._refuse_encoded(exchange)
        if (info.etag and not exchange.header("ETag")) or (
            not info.etag and info.last_modified and not exchange.header("Last-Modified")
        ):
            self.every_read_validated = False  # an answer without the validator: nothing proved it
        change = self._change(exchange, info)
        if change is not None:
            raise SourceChangedError(f"{uri} changed while it was being read ({change})", uri=uri)
        declared = exchange.response.length
        if exchange.status == 206:
            first, last, total = parse_content_range(exchange.header("Content-Range"))
            if total is not None and total != info.size:
                raise SourceChangedError(
                    f"{uri} changed size during the load ({info.size} -> {total} bytes)", uri=uri
                )
            if (first, last) != (offset, offset + length - 1) or declared not in (None, length):
                raise SourceError(
                    f"{uri} answered the range request for bytes {offset}-{offset + length - 1} with"
                    f" Content-Range {exchange.header('Content-Range')!r} and Content-Length {declared}",
                    uri=uri,
                )
            return None
        if declared is not None and declared != info.size:
            raise SourceChangedError(
                f"{uri} changed size during the load ({info.size} -> {declared} bytes)", uri=uri
            )
        if offset == 0 and length == info.size:
            return True
        if not self._settings.range_fallback:
            raise RangeNotSupportedError(
                f"{uri}: the server ignored the Range header (it answered 200 with the whole object), so the"
                " object cannot be read in parallel ranges; serve it from a server with Range support, or"
                " allow the single-stream fallback with --range-fallback / MODELLOAD_RANGE_FALLBACK=true"
                " (and --readers 1: each read starts from the first byte)",
                uri=uri,
            )
        if not self._fallback_warned:
            self._fallback_warned = True
            _log.warning("%s ignores Range requests: reading from the start of a single stream", uri)
        return False

    def _refuse_encoded(self, exchange: _Exchange) -> None:
        """Refuse a body sent with a content coding (an object stored gzip-encoded, as web assets often are):
        its bytes, and any range of them, are the encoded file's, not the file's. The connection is dropped
        with the unread body."""
        coding = (exchange.header("Content-Encoding") or "").strip().lower()
        if not coding or coding == "identity":
            return
        self._pool.discard(exchange.origin, exchange.conn)
        uri = self.display_uri
        raise SourceError(
            f"{uri} is served with Content-Encoding {coding!r}: its bytes (and any range of them) are the"
            " encoded file's, not the file's, so it cannot be loaded as it is; store the file without a"
            " content encoding (upload it again without --content-encoding)",
            uri=uri,
        )

    # --- errors ------------------------------------------------------------------------------------------

    def _translate(
        self, exc: BaseException, *, landed: int = 0, total: int = 0, connecting: Origin | None = None
    ) -> ModelloadError:
        """Map a socket, TLS, HTTP-parsing or file error to the error tree, with the bytes that landed."""
        return translate_transport_error(
            exc,
            uri=self.display_uri,
            settings=self._settings,
            plain_http_advice=self._plain_http_advice,
            landed=landed,
            total=total,
            connecting=connecting,
        )
