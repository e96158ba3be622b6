"""Serving a sidecar's verified bytes to the other sidecars of the same model, on a port of its own.

Endpoints (every request signed with the model's peer token, :mod:`modelload.loader.peerwire`, else 401; and
signed for this server's own address, the one the connection came in on, else 421)::

    GET /peer/v1/manifest       what this sidecar holds (:mod:`.manifest`)
    GET /peer/v1/files/<i>      a Range of weight file i, as the origin would answer it (206, Content-Range,
                                the origin's ETag; If-Match honoured with 412), only when the range lies
                                inside one READY tensor's record (404 otherwise); 429 when busy
    GET /peer/v1/stats          this sidecar's peer counters (bytes from peers and from the origin, uploads)

Every 200 and 206 proves itself to the asker: the SHA-256 of its body and a MAC over it, the range and the
asker's nonce. A range's digest is taken once (from the segment, whose READY bytes never change in mode
full) and kept for the next asker of the same range.

A port of its own (not the status API's) because uploads are long transfers: they must not queue behind or
in front of the kubelet's probes. One thread runs an event loop for every connection, so an idle or
hostile connection costs a file descriptor and a few KiB, never a thread; bodies go with ``sendfile`` from
the segment's file descriptor to the socket (no user-space copy). Nothing an asker does can hold the port:

- connections: at most ``connections`` open, ``per_address`` from one address; more are closed as they come;
- a connection without a complete request for ``idle_timeout`` seconds (a new one, or one kept alive) is
  closed, and so is one whose request head exceeds ``header_bytes``;
- uploads: at most ``max_uploads`` at once (429 at once beyond: the asker goes to another peer or the
  origin); an upload that sends nothing for ``idle_timeout`` or falls under ``min_rate`` (an asker that stops
  reading) is cut, freeing its slot.

A dropped connection is one debug line (who, why) and a counter in the stats, never a traceback.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Protocol, cast

from modelload.loader.errors import ConfigError
from modelload.loader.peerwire import (
    DIGEST_HEADER,
    PROOF_HEADER,
    Answer,
    PeerKey,
    ReplayGuard,
    Request,
    digest_header,
    normal_address,
    split_authority,
)
from modelload.loader.wiring import PEER_STATS_PATH
from modelload.sidecar.peers.client import sha256_range

__all__ = ["MANIFEST_PATH", "PeerServer", "Servable", "ServerLimits", "Slice"]

log = logging.getLogger(__name__)

MANIFEST_PATH = "/peer/v1/manifest"
_FILE = re.compile(r"^/peer/v1/files/(\d{1,6})$")
_RANGE = re.compile(r"^bytes=(\d{1,19})-(\d{1,19})$")
_REQUEST_LINE = re.compile(rb"^([A-Z]{1,16}) (/[\x21-\x7e]{0,4096}) HTTP/1\.([01])$")
_HEADER_LINE = re.compile(rb"^([!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}):[ \t]*(.*?)[ \t]*$")
_SINGLE = ("authorization", "range", "if-match", "host", "content-length")
_PIECE = 1 << 20
"""Bytes per ``sendfile`` call of an upload: the unit of the idle timeout and rate checks."""
_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 seconds: close() resets the connection and drops what was not sent."""
_DIGESTS = 4096
"""Range digests kept (one per chunk a fleet asks for: every asker cuts the same chunks)."""
_NAMES = 64
"""Host names whose addresses are kept (a static peer list may name peers rather than give addresses)."""
_NAME_TTL = 30.0
"""Seconds a host name's addresses are kept."""
_RESOLVE_TIMEOUT = 2.0


@dataclass(frozen=True)
class Slice:
    """Bytes to send: from the segment's file descriptor, at ``offset``, ``length`` of them."""

    fd: int
    offset: int
    length: int


class Servable(Protocol):
    """What the server serves: the load's state, as :class:`~modelload.sidecar.peers.hook.Peers` keeps it."""

    def manifest(self) -> dict[str, Any]: ...

    def stats(self) -> dict[str, Any]: ...

    def file_info(self, file: int) -> tuple[str, int] | None:
        """The weight file's ``(ETag, size)``, or None when there is no such file (or nothing yet)."""

    def locate(self, file: int, offset: int, length: int) -> Slice | None:
        """Where a READY range is in the segment, or None when it is not servable (yet)."""

    def uploaded(self, nbytes: int) -> None: ...


@dataclass(frozen=True)
class ServerLimits:
    """What any one asker may take of the peer port (see the module docstring)."""

    connections: int = 256
    per_address: int = 64
    """An honest asker opens one connection per reader and one for manifests."""
    idle_timeout: float = 10.0
    header_bytes: int = 16384
    min_rate: float = 16 << 10
    """Bytes per second an upload must keep up over ``rate_window``: low, as this port's uplink is shared by
    every upload at once and one stream of a congested link can sit seconds in TCP's retransmission backoff,
    yet a reader that takes a few KiB a second to keep its slot is cut."""
    rate_window: float = 5.0


@dataclass
class _Head:
    """A request's line and headers (names lower-cased), as parsed from the wire."""

    method: str
    target: str
    keep_alive: bool
    headers: dict[str, str] = field(default_factory=dict)


class _BadRequest(Exception):
    """A request head this server refuses (400), with why."""


class PeerServer:
    """Serves ``state`` on ``host:port`` to askers that prove ``key``'s token (see the module docstring)."""

    def __init__(
        self,
        state: Servable,
        *,
        key: PeerKey,
        host: str,
        port: int,
        max_uploads: int,
        limits: ServerLimits | None = None,
    ) -> None:
        self._state = state
        self._key = key
        self._guard = ReplayGuard()
        self._max_uploads = max_uploads
        self.limits = limits or ServerLimits()
        self._uploads = 0
        self._open: collections.Counter[str] = collections.Counter()
        self._writers: set[asyncio.StreamWriter] = set()
        self._digests: collections.OrderedDict[tuple[int, int, int], str] = collections.OrderedDict()
        self._names: collections.OrderedDict[str, tuple[float, frozenset[str]]] = collections.OrderedDict()
        self._hasher = ThreadPoolExecutor(max_workers=2, thread_name_prefix="modelload-peer-digest")
        self.dropped: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self._sock = _listen(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelload-peers", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started.wait(10)

    def stop(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stopping.set)
        if self._thread.is_alive():
            self._thread.join(10)
        self._sock.close()
        self._hasher.shutdown(wait=False, cancel_futures=True)

    def counters(self) -> dict[str, int]:
        """The port's own figures, for ``/peer/v1/stats``."""
        return {"dropped_connections": sum(self.dropped.values()), "refused_requests": self.refused}

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # the port stops serving; the load goes on from the origin and peers
            log.error("the peer server stopped: %s", exc)
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_loop_error)
        self._stopping = asyncio.Event()
        server = await asyncio.start_server(self._connection, sock=self._sock, limit=self.limits.header_bytes)
        self._started.set()
        async with server:
            await self._stopping.wait()
            for writer in list(self._writers):
                writer.transport.abort()

    # --- connections -------------------------------------------------------------------------------------

    def _drop(self, address: str, why: str) -> None:
        self.dropped[why] += 1
        log.debug("peer port: dropped a connection from %s (%s)", address, why)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = str(peer[0]) if peer else "?"
        limits = self.limits
        if len(self._writers) >= limits.connections or self._open[address] >= limits.per_address:
            self._drop(address, "over the connection cap")
            writer.transport.abort()
            return
        self._writers.add(writer)
        self._open[address] += 1
        dropped = True
        try:
            await self._serve(reader, writer, address)
            dropped = False
        except _BadRequest as exc:
            self._drop(address, f"bad request: {exc}")
            with contextlib.suppress(OSError, TimeoutError):
                await self._reply(writer, 400, {"error": str(exc)})
        except TimeoutError:
            self._drop(address, "idle or too slow")
        except (ConnectionError, OSError) as exc:
            self._drop(address, f"{type(exc).__name__}")
        finally:
            self._writers.discard(writer)
            self._open[address] -= 1
            if not self._open[address]:
                del self._open[address]
            if dropped:  # a reset, not a close: unsent bytes must not keep the asker's buffers in the kernel
                with contextlib.suppress(OSError):
                    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str) -> None:
        """Answer the connection's requests one by one until it closes, idles or errs."""
        while True:
            try:
                async with asyncio.timeout(self.limits.idle_timeout):
                    raw = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    self._drop(address, "closed mid-request")
                return
            except asyncio.LimitOverrunError:
                raise _BadRequest(f"a request head over {self.limits.header_bytes} bytes") from None
            head = _parse(raw)
            if not await self._answer(head, writer) or not head.keep_alive:
                return

    # --- requests ----------------------------------------------------------------------------------------

    async def _answer(self, head: _Head, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection must close after it."""
        headers = head.headers
        authority = headers.get("host", "")
        asked = Request(head.method, head.target, authority, headers.get("range"), headers.get("if-match"))
        try:
            nonce = self._key.check(headers.get("authorization"), asked, self._guard)
        except PermissionError as exc:
            self.refused += 1
            log.debug("peer port: refused a request for %s: %s", head.target, exc)
            await self._reply(writer, 401, {"error": str(exc)})
            return False
        misdirected = await self._misdirected(authority, writer)
        if misdirected is not None:
            self.refused += 1
            log.debug("peer port: refused a request for %s: %s", head.target, misdirected)
            await self._reply(writer, 421, {"error": misdirected})
            return False
        path = head.target.split("?", 1)[0]
        if head.method != "GET":
            await self._reply(writer, 405, {"error": "only GET is served here"})
        elif path == MANIFEST_PATH:
            await self._reply(writer, 200, self._state.manifest(), proof=(nonce, head.target))
        elif path == PEER_STATS_PATH:
            stats = {**self._state.stats(), **self.counters()}
            await self._reply(writer, 200, stats, proof=(nonce, head.target))
        elif (match := _FILE.match(path)) is not None:
            return await self._range(int(match.group(1)), head, nonce, writer)
        else:
            await self._reply(writer, 404, {"error": f"no such endpoint: {path}"})
        return True

    async def _misdirected(self, authority: str, writer: asyncio.StreamWriter) -> str | None:
        """Why a request whose signature covers ``authority`` (its Host header) is not for this server, or
        None when ``authority`` names the address and port the connection came in on.

        Checked only once the signature holds, so only a holder of the token can make this server look a
        name up. A request signed for another address reached it through something in between: a process
        the asker took for a peer (say, one that took a departed peer's address) passing the request on to
        read the answer, or an address translation (a Service's cluster IP). Neither may be served."""
        local = writer.get_extra_info("sockname")
        here = normal_address(str(local[0])) if local else None
        parsed = split_authority(authority)
        if here is None or parsed is None:
            return f"the request's Host header {authority!r} does not name an address this peer can check"
        host, port = parsed
        if port == local[1] and (host == here or here in await self._addresses_of(host)):
            return None
        at = f"[{here}]:{local[1]}" if ":" in here else f"{here}:{local[1]}"
        return (
            f"the request was signed for {authority} and came in at {at}: something passed it on (a relay, or"
            " an address translation such as a Service's cluster IP); ask each peer at its own pod address"
        )

    async def _addresses_of(self, host: str) -> frozenset[str]:
        """The IP addresses ``host`` resolves to (none when it does not resolve in time), kept a while."""
        if normal_address(host) is not None:
            return frozenset()  # an address is only itself: compared before this is asked
        now = time.monotonic()
        kept = self._names.get(host)
        if kept is not None and kept[0] > now:
            return kept[1]
        try:
            async with asyncio.timeout(_RESOLVE_TIMEOUT):
                found = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            addresses = frozenset(filter(None, (normal_address(str(info[4][0])) for info in found)))
        except (OSError, TimeoutError, UnicodeError):
            addresses = frozenset()
        self._names[host] = (now + _NAME_TTL, addresses)
        self._names.move_to_end(host)
        while len(self._names) > _NAMES:
            self._names.popitem(last=False)
        return addresses

    async def _range(self, file: int, head: _Head, nonce: str, writer: asyncio.StreamWriter) -> bool:
        info = self._state.file_info(file)
        if info is None:
            await self._reply(writer, 404, {"error": "no such weight file here (yet)"})
            return True
        etag, size = info
        wanted = head.headers.get("if-match")
        if wanted is not None and wanted != etag:
            await self._reply(writer, 412, {"error": "this sidecar holds another version of the file"})
            return True
        match = _RANGE.match(head.headers.get("range", ""))
        if match is None:
            await self._reply(writer, 416, {"error": "a single Range bytes=a-b is needed"})
            return True
        first, last = int(match.group(1)), int(match.group(2))
        if last < first or last >= size:
            await self._reply(writer, 416, {"error": "the range is outside the file"})
            return True
        where = self._state.locate(file, first, last - first + 1)
        if where is None:
            await self._reply(writer, 404, {"error": "this range is not READY here"})
            return True
        if self._uploads >= self._max_uploads:
            await self._reply(writer, 429, {"error": "too many uploads at once; ask another peer"}, busy=True)
            return True
        self._uploads += 1
        try:
            digest = await self._digest((file, first, last), where)
            content_range = f"bytes {first}-{last}/{size}"
            proof = self._key.prove(nonce, Answer(206, head.target, content_range, etag), digest)
            headers = {
                "Content-Type": "application/octet-stream",
                "Content-Length": str(where.length),
                "Content-Range": content_range,
                "ETag": etag,
                DIGEST_HEADER: digest_header(digest),
                PROOF_HEADER: proof,
            }
            writer.write(_head(206, headers))
            await self._send_file(writer, where)
            self._state.uploaded(where.length)
        finally:
            self._uploads -= 1
        return True

    async def _digest(self, key: tuple[int, int, int], where: Slice) -> str:
        """The SHA-256 of a READY range, taken once (in a thread: hashing a chunk takes milliseconds)."""
        found = self._digests.get(key)
        if found is None:
            loop = asyncio.get_running_loop()
            hashed = loop.run_in_executor(self._hasher, sha256_range, where.fd, where.offset, where.length)
            found = await hashed
            self._digests[key] = found
            while len(self._digests) > _DIGESTS:
                self._digests.popitem(last=False)
        self._digests.move_to_end(key)
        return found

    async def _send_file(self, writer: asyncio.StreamWriter, where: Slice) -> None:
        """``sendfile`` the slice in pieces, each within the idle timeout, the whole above the rate floor."""
        loop = asyncio.get_running_loop()
        limits = self.limits
        source = cast(IO[bytes], _Descriptor(where.fd))  # all sendfile asks of a file
        async with asyncio.timeout(limits.idle_timeout):
            await writer.drain()  # the head
        sent, mark_sent, mark = 0, 0, time.monotonic()
        while sent < where.length:
            piece = min(_PIECE, where.length - sent)
            async with asyncio.timeout(limits.idle_timeout):
                sent += await loop.sendfile(
                    writer.transport, source, where.offset + sent, piece, fallback=False
                )
            now = time.monotonic()
            if now - mark >= limits.rate_window:
                if (sent - mark_sent) / (now - mark) < limits.min_rate:
                    raise TimeoutError("the asker reads under the upload rate floor")
                mark, mark_sent = now, sent

    async def _reply(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        doc: dict[str, Any],
        *,
        proof: tuple[str, str] | None = None,
        busy: bool = False,
    ) -> None:
        body = json.dumps(doc, separators=(",", ":")).encode()
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body))}
        if proof is not None:
            nonce, target = proof
            digest = hashlib.sha256(body).hexdigest()
            headers[DIGEST_HEADER] = digest_header(digest)
            headers[PROOF_HEADER] = self._key.prove(nonce, Answer(status, target), digest)
        if busy:
            headers["Retry-After"] = "0"
        writer.write(_head(status, headers) + body)
        async with asyncio.timeout(self.limits.idle_timeout):
            await writer.drain()


_REASONS = {
    200: "OK", 206: "Partial Content", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
    405: "Method Not Allowed", 412: "Precondition Failed", 416: "Range Not Satisfiable",
    421: "Misdirected Request", 429: "Too Many Requests",
}  # fmt: skip


def _head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", "Server: modelload-peer/2"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse(raw: bytes) -> _Head:
    """A request head (line, headers) by the strict rules of a GET-only protocol; _BadRequest otherwise."""
    lines = raw[:-4].split(b"\r\n")
    line = _REQUEST_LINE.match(lines[0])
    if line is None:
        raise _BadRequest("a malformed request line")
    if len(lines) > 65:
        raise _BadRequest("more than 64 headers")
    headers: dict[str, str] = {}
    for text in lines[1:]:
        header = _HEADER_LINE.match(text)
        if header is None:
            raise _BadRequest("a malformed header line")
        name, value = header.group(1).decode("ascii").lower(), header.group(2).decode("latin-1")
        if name in headers and name in _SINGLE:
            raise _BadRequest(f"{name} given twice")
        headers[name] = value
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise _BadRequest("a request body (peers send none)")
    close = "close" in headers.get("connection", "").lower()
    return _Head(
        line.group(1).decode(), line.group(2).decode("ascii"), line.group(3) == b"1" and not close, headers
    )


class _Descriptor:
    """The segment's descriptor as ``loop.sendfile`` takes a file (it reads ``fileno`` and sets the position,
    which no one here uses: every read names its offset)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return offset


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)  # a burst the caps then close must not overflow the queue and reset honest askers
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"the peer server cannot listen on {host}:{port} ({exc.strerror or exc}); choose another"
            " --peer-port/MODELLOAD_PEER_PORT"
        ) from None
    return sock


def _loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Whatever the event loop could not hand to a handler (a connection reset while closing): one line."""
    exc = context.get("exception")
    log.debug("peer port: %s%s", context.get("message", "an error"), f" ({exc!r})" if exc else "")
