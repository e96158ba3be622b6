"""Serving a sidecar's verified bytes to the other sidecars of the same model, on a port of its own.

Endpoints (every one needs ``Authorization: Bearer <the ModelLoad's peer token>``, else 401)::

    GET /peer/v1/manifest       what this sidecar holds: its id, the model's weight files (ETag, size), the
                                phase, bytes done, a bitmap of READY tensors and each one's CRC-32
    GET /peer/v1/files/<i>      a Range of weight file i, as the origin would answer it (206, Content-Range,
                                the origin's ETag; If-Match honoured with 412), only when the range lies
                                inside one READY tensor's record (404 otherwise); 429 when busy
    GET /peer/v1/stats          this sidecar's peer counters (bytes from peers and from the origin, uploads)

A port of its own (not the status API's) because uploads are long blocking transfers: they must not queue
behind or in front of the kubelet's probes, and ``os.sendfile`` from the segment's file descriptor to the
socket sends the bytes without a user-space copy, which a thread per connection does simply. Uploads are
bounded (``max_uploads`` at once): a busy sidecar answers 429 at once so the asker goes to another peer or the
origin rather than queueing here.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import os
import re
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from modelload.loader.errors import ConfigError
from modelload.loader.wiring import PEER_STATS_PATH

__all__ = ["PeerServer", "Servable"]

log = logging.getLogger(__name__)

_FILE = re.compile(r"^/peer/v1/files/(\d{1,6})$")
_RANGE = re.compile(r"^bytes=(\d{1,20})-(\d{1,20})$")


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


class PeerServer:
    """A threaded HTTP server on ``host:port`` serving ``state`` to holders of ``token``."""

    def __init__(self, state: Servable, *, token: str, host: str, port: int, max_uploads: int) -> None:
        self._state = state
        self._token = f"Bearer {token}".encode()
        self._uploads = threading.BoundedSemaphore(max_uploads)
        handler = type("_Handler", (_Handler,), {"server_state": self})
        try:
            self._httpd = _Server((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"the peer server cannot listen on {host}:{port} ({exc.strerror or exc}); choose another"
                " --peer-port/MODELLOAD_PEER_PORT"
            ) from None
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="modelload-peers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # --- used by the handler -------------------------------------------------------------------------------

    def authorized(self, header: str | None) -> bool:
        return header is not None and hmac.compare_digest(header.encode(), self._token)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class _Handler(BaseHTTPRequestHandler):
    server_state: PeerServer
    protocol_version = "HTTP/1.1"
    server_version = "modelload-peer/1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("peer request: " + format, *args)

    def do_GET(self) -> None:
        server = self.server_state
        if not server.authorized(self.headers.get("Authorization")):
            self._reply(401, {"error": "a peer token is needed (Authorization: Bearer ...)"})
            return
        path = self.path.split("?", 1)[0]
        if path == "/peer/v1/manifest":
            self._reply(200, server._state.manifest())
        elif path == PEER_STATS_PATH:
            self._reply(200, server._state.stats())
        elif (match := _FILE.match(path)) is not None:
            self._range(int(match.group(1)))
        else:
            self._reply(404, {"error": f"no such endpoint: {path}"})

    def _range(self, file: int) -> None:
        server = self.server_state
        info = server._state.file_info(file)
        if info is None:
            self._reply(404, {"error": "no such weight file here (yet)"})
            return
        etag, size = info
        wanted = self.headers.get("If-Match")
        if wanted is not None and wanted.strip() != etag:
            self._reply(412, {"error": "this sidecar holds another version of the file"})
            return
        match = _RANGE.match(self.headers.get("Range", "").strip())
        if match is None:
            self._reply(416, {"error": "a single Range bytes=a-b is needed"})
            return
        first, last = int(match.group(1)), int(match.group(2))
        if last < first or last >= size:
            self._reply(416, {"error": "the range is outside the file"})
            return
        where = server._state.locate(file, first, last - first + 1)
        if where is None:
            self._reply(404, {"error": "this range is not READY here"})
            return
        if not server._uploads.acquire(blocking=False):
            self._reply(429, {"error": "too many uploads at once; ask another peer"}, retry_after="0")
            return
        try:
            self.send_response(206)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(where.length))
            self.send_header("Content-Range", f"bytes {first}-{last}/{size}")
            self.send_header("ETag", etag)
            self.end_headers()
            self.wfile.flush()
            sent = _sendfile(self.connection, where)
            server._state.uploaded(sent)
        except OSError as exc:  # the asker went away (killed, or moved on after a stall)
            log.debug("an upload ended early: %s", exc)
            self.close_connection = True
        finally:
            server._uploads.release()

    def _reply(self, status: int, body: dict[str, Any], *, retry_after: str | None = None) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry_after is not None:
            self.send_header("Retry-After", retry_after)
        self.end_headers()
        self.wfile.write(data)


def _sendfile(sock: socket.socket, where: Slice) -> int:
    """Send ``where``'s bytes from the segment file to the socket without a user-space copy."""
    sent = 0
    while sent < where.length:
        n = os.sendfile(sock.fileno(), where.fd, where.offset + sent, where.length - sent)
        if n == 0:
            raise OSError("the segment file ended early")
        sent += n
    return sent


def bitmap(ready: list[bool]) -> str:
    """READY flags as base64 of a little-endian bitmap (tensor i is bit i % 8 of byte i // 8)."""
    out = bytearray((len(ready) + 7) // 8)
    for i, flag in enumerate(ready):
        if flag:
            out[i // 8] |= 1 << (i % 8)
    return base64.b64encode(bytes(out)).decode("ascii")


def unbitmap(text: str, count: int) -> list[bool]:
    """The inverse of :func:`bitmap`; raises ValueError for a bitmap of the wrong length."""
    data = base64.b64decode(text.encode("ascii"), validate=True)
    if len(data) != (count + 7) // 8:
        raise ValueError(f"a bitmap of {len(data)} bytes for {count} tensors")
    return [bool(data[i // 8] >> (i % 8) & 1) for i in range(count)]
