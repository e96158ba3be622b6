"""A scriptable HTTP proxy on loopback that breaks requests on purpose, between a client and nginx or moto.

It forwards each request to the upstream server over its own keep-alive connection and sends the answer
back, unless a *fault* applies to that request. Faults:

- :class:`Reset` ``(after=N)``: send the head and N body bytes, then reset the connection (RST).
- :class:`Truncate` ``(after=N)``: send the head (with the full Content-Length) and N bytes, then close
  cleanly: a short body.
- :class:`Stall` ``(after=N, seconds=T)``: send N bytes, go quiet for T seconds, then send the rest (a
  client with a shorter timeout gives up first).
- :class:`Trickle` ``(after=N, piece=P, interval=T)``: send N bytes, then P bytes every T seconds: never
  silent long enough for a stall timeout, far too slow to finish.
- :class:`Respond` ``(status, body, headers)``: answer without asking the upstream, for example
  :func:`slow_down` (503 SlowDown with Retry-After), :func:`server_error` (500), or :func:`s3_error` with
  any S3 code (ExpiredToken, AccessDenied...).
- :class:`IgnoreRange`: drop the Range header on the way up, so the upstream answers 200 with everything.
- :class:`ReplaceObject` ``(etag)``: as if the object was re-uploaded: a request with If-Match gets 412,
  one without gets the response with its ETag replaced.
- :class:`RewriteETag` ``(etag)``: a server that ignores If-Match: drop it on the way up and replace the
  response's ETag.
- :class:`FlipBit` ``(at=N)``: pass the answer through with one bit of its body's byte N flipped (a
  corruption in transit that TCP's checksum missed): for the stores' checksums. A queued flip skips answers
  shorter than N+1 bytes, or to ranges starting before ``from_offset`` (look-ups, index reads), and
  applies to the next one that fits.

Which request gets which fault (first match wins): :meth:`FaultProxy.push` queues faults consumed one per
matching request, in order; :meth:`FaultProxy.always` adds a standing rule; :meth:`FaultProxy.randomly`
picks faults with a probability from a seeded generator. Matching is by method (GET by default) and a path
substring.

Everything is recorded: ``requests`` (connection number, method, path, headers, the fault applied) and
``connections`` (accepted so far), so tests can assert that retries happened, what they asked for
(``proxy.ranges()``), and that connections were reused::

    proxy = FaultProxy(nginx.port)                  # or the moto_s3 / fault_proxy fixtures
    source = open_source(proxy.url("model.bin"))
    source.stat()
    proxy.push(Reset(after=100_000))                # the next GET breaks after 100 kB
    read_range(source, 0, view, policy=...)
    assert proxy.ranges()[-1][0] > 0                # the retry asked only for the missing tail

The proxy keeps the client's Host header, so S3 signatures made for the proxy's address verify upstream.
Bodies are buffered whole: use small objects.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import random
import re
import socket
import struct
import termios
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import BinaryIO

from tests.support.waiting import wait_for

__all__ = [
    "Fault",
    "FaultProxy",
    "FlipBit",
    "IgnoreRange",
    "Recorded",
    "ReplaceObject",
    "Reset",
    "Respond",
    "RewriteETag",
    "Stall",
    "Trickle",
    "Truncate",
    "s3_error",
    "server_error",
    "slow_down",
]


@dataclass(frozen=True)
class Reset:
    after: int = 0


@dataclass(frozen=True)
class Truncate:
    after: int = 0


@dataclass(frozen=True)
class Stall:
    after: int = 0
    seconds: float = 1.0


@dataclass(frozen=True)
class Trickle:
    after: int = 0
    piece: int = 16
    interval: float = 0.05


@dataclass(frozen=True)
class Respond:
    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class IgnoreRange:
    pass


@dataclass(frozen=True)
class ReplaceObject:
    etag: str = '"replaced-object"'


@dataclass(frozen=True)
class RewriteETag:
    etag: str = '"rewritten-etag"'


@dataclass(frozen=True)
class FlipBit:
    at: int = 0
    from_offset: int = 0


Fault = Reset | Truncate | Stall | Trickle | Respond | IgnoreRange | ReplaceObject | RewriteETag | FlipBit


def s3_error(status: int, code: str, *, message: str = "", retry_after: float | None = None) -> Respond:
    """An S3-style XML error response."""
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message or code}</Message>"
        "<RequestId>FAULTPROXY</RequestId></Error>"
    ).encode()
    headers: list[tuple[str, str]] = [("Content-Type", "application/xml"), ("x-amz-request-id", "FAULTPROXY")]
    if retry_after is not None:
        headers.append(("Retry-After", f"{retry_after:g}"))
    return Respond(status, body, tuple(headers))


def slow_down(retry_after: float = 1) -> Respond:
    """S3's throttling answer: 503 SlowDown with a Retry-After."""
    return s3_error(503, "SlowDown", message="Please reduce your request rate.", retry_after=retry_after)


def server_error() -> Respond:
    """A 500 InternalError."""
    return s3_error(500, "InternalError", message="We encountered an internal error. Please try again.")


@dataclass(frozen=True)
class _Match:
    method: str | None
    path: str | None

    def __call__(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (self.path is None or self.path in path)


@dataclass
class Recorded:
    """One request the proxy saw. ``headers`` has lower-case names."""

    connection: int
    method: str
    path: str
    headers: dict[str, str]
    fault: Fault | None = None
    range: tuple[int, int] | None = field(init=False)

    def __post_init__(self) -> None:
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("range", ""))
        self.range = (int(match.group(1)), int(match.group(2))) if match else None


class FaultProxy:
    """See the module docstring. ``port``/``endpoint``/``url()`` address the proxy; :meth:`close` stops it."""

    def __init__(self, upstream_port: int, *, upstream_host: str = "127.0.0.1") -> None:
        self._upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._queue: list[tuple[_Match, Fault]] = []
        self._rules: list[tuple[_Match, Fault]] = []
        self._random: tuple[random.Random, float, Sequence[Fault], _Match] | None = None
        self._clients: set[socket.socket] = set()
        self.requests: list[Recorded] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="fault-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.endpoint}/{path.lstrip('/')}"

    # --- scripting ---------------------------------------------------------------------------------------

    def push(self, *faults: Fault, method: str | None = "GET", path: str | None = None) -> None:
        """Queue faults, each applied to the next request that matches, in order."""
        with self._lock:
            self._queue.extend((_Match(method, path), fault) for fault in faults)

    def always(self, fault: Fault, *, method: str | None = "GET", path: str | None = None) -> None:
        """Apply ``fault`` to every matching request (after the queue), until :meth:`clear`."""
        with self._lock:
            self._rules.append((_Match(method, path), fault))

    def randomly(
        self, faults: Sequence[Fault], *, probability: float, seed: int, method: str | None = "GET"
    ) -> None:
        """Apply one of ``faults`` (seeded choice) to each matching request with ``probability``."""
        with self._lock:
            self._random = (random.Random(seed), probability, tuple(faults), _Match(method, None))

    def clear(self) -> None:
        """Drop every queued fault, rule and random setting (the records stay)."""
        with self._lock:
            self._queue.clear()
            self._rules.clear()
            self._random = None

    def pending(self) -> int:
        """Queued faults not used yet."""
        with self._lock:
            return len(self._queue)

    # --- observing ---------------------------------------------------------------------------------------

    def ranges(self, method: str = "GET") -> list[tuple[int, int]]:
        """The byte ranges asked for, in order, as (first, last) inclusive."""
        with self._lock:
            return [r.range for r in self.requests if r.method == method and r.range is not None]

    def drop_connections(self) -> None:
        """Close every client connection now, as a server does with idle keep-alive connections."""
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            _close_quietly(client)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- serving -----------------------------------------------------------------------------------------

    def _choose(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for index, (match, fault) in enumerate(self._queue):
                if match(method, path):
                    del self._queue[index]
                    return fault
            for match, fault in self._rules:
                if match(method, path):
                    return fault
            if self._random is not None:
                rng, probability, faults, match = self._random
                if match(method, path) and rng.random() < probability:
                    return rng.choice(list(faults))
        return None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                number = self.connections
                self._clients.add(client)
            threading.Thread(target=self._serve, args=(client, number), daemon=True).start()

    def _serve(self, client: socket.socket, number: int) -> None:
        upstream: http.client.HTTPConnection | None = None
        reader = client.makefile("rb")
        try:
            while True:
                request = _read_request(reader)
                if request is None:
                    return
                method, path, headers, body = request
                fault = self._choose(method, path)
                with self._lock:
                    self.requests.append(Recorded(number, method, path, dict(_lower(headers)), fault))
                if isinstance(fault, Respond):
                    _send_response(client, fault.status, "Fault", list(fault.headers), fault.body, method)
                    continue
                if isinstance(fault, ReplaceObject) and _has(headers, "if-match"):
                    failed = s3_error(412, "PreconditionFailed", message="At least one precondition failed")
                    _send_response(
                        client, 412, "Precondition Failed", list(failed.headers), failed.body, method
                    )
                    continue
                upstream, answer = self._forward(upstream, method, path, _outgoing(headers, fault), body)
                status, reason, response_headers, response_body = answer
                if isinstance(fault, FlipBit):
                    response_body = self._flip(fault, method, path, headers, response_body)
                if isinstance(fault, (ReplaceObject, RewriteETag)):
                    response_headers = [
                        (k, fault.etag if k.lower() == "etag" else v) for k, v in response_headers
                    ]
                if not self._send_with_fault(
                    client, fault, status, reason, response_headers, response_body, method
                ):
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._clients.discard(client)
            if upstream is not None:
                upstream.close()
            reader.close()  # the socket's file descriptor stays open while its file object lives
            _close_quietly(client)

    def _forward(
        self,
        upstream: http.client.HTTPConnection | None,
        method: str,
        path: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> tuple[http.client.HTTPConnection, tuple[int, str, list[tuple[str, str]], bytes]]:
        for attempt in range(2):
            if upstream is None:
                upstream = http.client.HTTPConnection(*self._upstream, timeout=30)
            try:
                upstream.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
                for name, value in headers:
                    upstream.putheader(name, value)
                upstream.endheaders(body or None)
                response = upstream.getresponse()
                data = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                upstream.close()
                upstream = None
                if attempt:
                    raise
                continue
            kept = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
            if method != "HEAD":
                kept = [(k, v) for k, v in kept if k.lower() != "content-length"]
                kept.append(("Content-Length", str(len(data))))
            return upstream, (response.status, response.reason, kept, data)
        raise AssertionError("unreachable")

    def _flip(
        self, fault: FlipBit, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> bytes:
        """Flip a bit of byte ``fault.at``; an answer too short for it, or to a range starting before
        ``fault.from_offset`` (a look-up, an index read), passes untouched, and a queued flip waits for the
        next matching answer."""
        lowered = dict(_lower(headers))
        lowered.setdefault("range", lowered.get("x-ms-range", ""))  # Azure's spelling
        asked = Recorded(0, method, path, lowered).range
        if fault.at >= len(body) or (asked[0] if asked else 0) < fault.from_offset:
            with self._lock:
                if not any(f is fault for _, f in self._rules):
                    self._queue.insert(0, (_Match(method, None), fault))
            return body
        flipped = bytearray(body)
        flipped[fault.at] ^= 0x10
        return bytes(flipped)

    @staticmethod
    def _send_with_fault(
        client: socket.socket,
        fault: Fault | None,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        body: bytes,
        method: str,
    ) -> bool:
        """Send the answer, breaking it as the fault says; False when the connection is finished."""
        if not isinstance(fault, (Reset, Truncate, Stall, Trickle)):
            _send_response(client, status, reason, headers, body, method)
            return True
        client.sendall(_head(status, reason, headers) + body[: fault.after])
        if isinstance(fault, Trickle):
            for start in range(fault.after, len(body), fault.piece):
                time.sleep(fault.interval)
                try:
                    client.sendall(body[start : start + fault.piece])
                except OSError:
                    return False  # the client gave up on this connection
            return True
        if isinstance(fault, Stall):
            time.sleep(fault.seconds)
            try:
                client.sendall(body[fault.after :])
            except OSError:
                return False
            return True
        _wait_until_taken(client)  # a reset throws away whatever the client's kernel has not taken yet
        if isinstance(fault, Reset):
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            client.shutdown(socket.SHUT_WR)
        return False


def _wait_until_taken(client: socket.socket, deadline_s: float = 10.0) -> None:
    """Wait until the client's kernel has acknowledged every byte sent to it (the send queue, Linux's
    ``SIOCOUTQ``, is empty), so that a reset loses none of the bytes a fault promises; at most
    ``deadline_s``. A client that stops reading leaves bytes queued, and the fault goes ahead then."""

    def taken() -> bool:
        if client.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return True  # the client reset the connection: what is queued will never be taken
        return struct.unpack("i", fcntl.ioctl(client.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0] == 0

    with contextlib.suppress(AssertionError):  # past the deadline: the fault goes ahead regardless
        wait_for(taken, timeout=deadline_s, what="the client taking the bytes sent")


_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
)


def _lower(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in headers]


def _has(headers: list[tuple[str, str]], name: str) -> bool:
    return any(k.lower() == name for k, _ in headers)


def _outgoing(headers: list[tuple[str, str]], fault: Fault | None) -> list[tuple[str, str]]:
    drop = set(_HOP_BY_HOP)
    if isinstance(fault, IgnoreRange):
        drop.add("range")
    if isinstance(fault, RewriteETag):
        drop.add("if-match")
    return [(k, v) for k, v in headers if k.lower() not in drop]


def _read_request(reader: BinaryIO) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    line = reader.readline(65537)
    if not line:
        return None
    method, path, _version = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers: list[tuple[str, str]] = []
    while True:
        raw = reader.readline(65537)
        if raw in (b"\r\n", b"\n", b""):
            break
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    body = reader.read(length) if length else b""
    return method, path, headers, body


def _head(status: int, reason: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _send_response(
    client: socket.socket, status: int, reason: str, headers: list[tuple[str, str]], body: bytes, method: str
) -> None:
    if not _has(headers, "content-length"):
        headers = [*headers, ("Content-Length", str(len(body)))]
    client.sendall(_head(status, reason, headers) + (b"" if method == "HEAD" else body))


def _close_quietly(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
