"""A fake peer: a process on a peer port that lies, one way per mode, to the sidecars that list it.

It knows the model as an honest peer would (the origin's ETags and sizes, every tensor's record and CRC-32,
read once from the origin), holds the peer token or not, and misbehaves in one of :data:`MODES`:

===================  =========================================================================================
``wrong_bytes``      lists every tensor with its true CRC-32, serves altered bytes (proving what it sends)
``consistent_lie``   no token: lists the CRC-32s of the altered bytes it serves, so its claims agree
``relay``            no token: passes each request on to an honest peer as it came (Host, signature) and the
                     answer back, with altered bytes; counts the answer bytes it got to read
``reset``            cuts every range off half way (a TCP reset)
``slow``             sends every range at a trickle (a few KiB/s)
``stall``            sends a range's head, then nothing
``short_206``        answers each range with one byte less than asked (a proven 206 of the wrong range)
``absurd_range``     answers each range with a Content-Range of 5,000 digits (more than Python converts)
``wrong_etag``       answers ranges with another version's ETag
``busy``             answers every range 429, forever
``redirect``         answers every range with a redirect to the origin
``malformed``        a manifest whose CRC-32s are strings and nulls and whose bitmap is too short
``huge``             a manifest of 64 MiB
``deep``             a manifest of the right size, nested 2,400 deep (past Python's recursion limit)
``squatter``         says it is loading, its progress growing, and never holds anything
``no_token``         an honest peer in every way but the token
===================  =========================================================================================

Every request's headers are kept (:attr:`FakePeer.seen`), so a test can check the token never reached it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import socket
import socketserver
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelload.loader.peerwire import DIGEST_HEADER, PROOF_HEADER, Answer, PeerKey, digest_header
from modelload.sidecar.peers.manifest import bitmap
from modelload.sidecar.sources import SourceSettings, open_model

__all__ = ["MODES", "FakePeer"]

MODES = (
    "wrong_bytes", "consistent_lie", "relay", "reset", "slow", "stall", "short_206", "absurd_range",
    "wrong_etag", "busy",
    "redirect", "malformed", "huge", "deep", "squatter", "no_token",
)  # fmt: skip
_NO_TOKEN = ("consistent_lie", "relay", "no_token")


def _alter(data: bytes) -> bytes:
    """The bytes a liar serves: every 97th byte flipped (a tensor's values, subtly wrong)."""
    out = bytearray(data)
    for i in range(0, len(out), 97):
        out[i] ^= 0x5A
    return bytes(out)


@dataclass
class _Model:
    path: Path
    etag: str
    size: int
    records: list[tuple[int, int]]
    """Each tensor's (record offset, record length) in the weight file, in the index's order."""
    crcs: list[int] = field(default_factory=list)
    lying_crcs: list[int] = field(default_factory=list)


class FakePeer:
    """A peer in ``mode`` for the model at ``origin_url`` (whose bytes are in the file ``path``)."""

    def __init__(
        self,
        mode: str,
        *,
        origin_url: str,
        path: Path,
        token: str,
        host: str,
        upstream: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"no fake peer mode {mode!r}")
        self.mode = mode
        self.token = token
        self.key = PeerKey(token if mode not in _NO_TOKEN else secrets.token_hex(16))
        self.upstream = upstream
        self.id = secrets.token_hex(8)
        self.seen: list[dict[str, str]] = []
        self.ranges_asked = 0
        self.learned = 0
        """Bytes of the 2xx answers a relay got to read from the peer it passed requests on to."""
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.model = self._learn(origin_url, path)
        self._huge = b'{"id": "' + b"0" * (64 << 20) + b'"}'
        self._deep = b'{"crc32": ' + b"[" * 2400 + b"]" * 2400 + b"}"
        fake = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                fake._connection(self.connection, self.rfile)

        class _Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = _Server((host, 0), _Handler)
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._sockets: list[socket.socket] = []

    @staticmethod
    def _learn(origin_url: str, path: Path) -> _Model:
        model = open_model(origin_url, SourceSettings())
        try:
            info, index = model.infos[0], model.index
            records = [(t.record_offset, t.record_length) for t in index.tensors]
        finally:
            model.close()
        data = path.read_bytes()
        learned = _Model(path, info.etag or "", info.size, records)
        for offset, length in records:
            record = data[offset : offset + length]
            learned.crcs.append(zlib.crc32(record))
            learned.lying_crcs.append(zlib.crc32(_alter(record)))
        return learned

    def __enter__(self) -> FakePeer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for sock in list(self._sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._server.shutdown()
        self._server.server_close()

    def got_token(self) -> bool:
        """Whether any request it received carried the token, in any header."""
        return any(self.token in value for headers in self.seen for value in headers.values())

    # --- serving -----------------------------------------------------------------------------------------

    def _connection(self, sock: socket.socket, rfile: Any) -> None:
        self._sockets.append(sock)
        try:
            while not self._stop.is_set():
                line = rfile.readline(65537)
                if not line:
                    return
                headers: dict[str, str] = {}
                while (text := rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
                    name, _, value = text.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                self.seen.append(headers)
                _, target, _ = line.decode("latin-1").split(" ", 2)
                if not self._answer(sock, target, headers):
                    return
        except (OSError, ValueError):
            return
        finally:
            with contextlib.suppress(ValueError):
                self._sockets.remove(sock)

    def _nonce(self, headers: dict[str, str]) -> str:
        auth = headers.get("authorization", "")
        return auth.partition("nonce=")[2].partition(",")[0]

    def _send(self, sock: socket.socket, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        lines = [f"HTTP/1.1 {status} Fake", *(f"{k}: {v}" for k, v in headers.items())]
        if "Content-Length" not in headers:
            lines.append(f"Content-Length: {len(body)}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        sock.sendall(body)

    def _proof(
        self, status: int, target: str, head: dict[str, str], body: bytes, nonce: str
    ) -> dict[str, str]:
        """``head`` with the digest of ``body`` and a proof of it under this fake's key."""
        digest = hashlib.sha256(body).hexdigest()
        answer = Answer(status, target, head.get("Content-Range"), head.get("ETag"))
        return {
            **head,
            DIGEST_HEADER: digest_header(digest),
            PROOF_HEADER: self.key.prove(nonce, answer, digest),
        }

    def _proven(
        self, sock: socket.socket, status: int, target: str, head: dict[str, str], body: bytes, nonce: str
    ) -> None:
        self._send(sock, status, self._proof(status, target, head, body, nonce), body)

    def _answer(self, sock: socket.socket, target: str, headers: dict[str, str]) -> bool:
        if self.mode == "relay" and self.upstream is not None:
            return self._relay(sock, target, headers)
        nonce = self._nonce(headers)
        if target == "/peer/v1/manifest":
            self._manifest(sock, target, nonce)
            return True
        if target.startswith("/peer/v1/files/"):
            return self._range(sock, target, headers, nonce)
        self._proven(sock, 200, target, {"Content-Type": "application/json"}, b"{}", nonce)
        return True

    def _manifest(self, sock: socket.socket, target: str, nonce: str) -> None:
        model, mode = self.model, self.mode
        count = len(model.records)
        doc: dict[str, Any] = {
            "id": self.id,
            "phase": "complete",
            "bytes_done": model.size,
            "files": [{"etag": model.etag, "size": model.size}],
            "ready": bitmap([True] * count),
            "crc32": model.lying_crcs if mode == "consistent_lie" else model.crcs,
        }
        if mode == "squatter":
            elapsed = time.monotonic() - self._started
            doc.update(phase="loading", ready=bitmap([False] * count), crc32=[0] * count)
            doc["bytes_done"] = min(int(elapsed * 2_000_000), model.size - 1)
        elif mode == "malformed":
            doc["crc32"] = ["deadbeef", None, *model.crcs[2:]]
            doc["ready"] = bitmap([True] * (count // 2))
        body = json.dumps(doc).encode()
        if mode == "huge":
            body = self._huge
        elif mode == "deep":
            body = self._deep
        self._proven(sock, 200, target, {"Content-Type": "application/json"}, body, nonce)

    def _range(self, sock: socket.socket, target: str, headers: dict[str, str], nonce: str) -> bool:
        self.ranges_asked += 1
        mode, model = self.mode, self.model
        first, _, last = headers.get("range", "bytes=0-0").removeprefix("bytes=").partition("-")
        start, end = int(first), int(last)
        if mode == "squatter":
            self._send(sock, 404, {}, b"{}")
            return True
        if mode == "busy":
            self._send(sock, 429, {"Retry-After": "0"}, b"{}")
            return True
        if mode == "redirect":
            self._send(sock, 302, {"Location": "http://127.0.0.1/elsewhere"})
            return True
        with open(model.path, "rb") as file:
            file.seek(start)
            data = file.read(end - start + 1)
        etag = '"another-version"' if mode == "wrong_etag" else model.etag
        if mode in ("wrong_bytes", "consistent_lie"):
            data = _alter(data)
        if mode == "short_206":
            data, end = data[:-1], end - 1
        head = {"Content-Range": f"bytes {start}-{end}/{model.size}", "ETag": etag}
        if mode == "absurd_range":
            head["Content-Range"] = f"bytes {start}-{'9' * 5000}/{model.size}"
        if mode in ("reset", "slow", "stall"):
            proven = self._proof(206, target, head, data, nonce)
            self._send(sock, 206, {**proven, "Content-Length": str(len(data))})
            return self._misbehave(sock, data)
        self._proven(sock, 206, target, head, data, nonce)
        return True

    def _misbehave(self, sock: socket.socket, data: bytes) -> bool:
        if self.mode == "reset":
            sock.sendall(data[: len(data) // 2])
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
            return False
        if self.mode == "stall":
            self._stop.wait()
            return False
        for at in range(0, len(data), 1024):  # slow: 1 KiB every 0.1 s
            if self._stop.wait(0.1):
                return False
            sock.sendall(data[at : at + 1024])
        return True

    def _relay(self, sock: socket.socket, target: str, headers: dict[str, str]) -> bool:
        """Pass the request on to an honest peer as it came (Host and signature too: a relay at the TCP
        level would) and its answer back, bytes altered."""
        assert self.upstream is not None
        passed = ("host", "authorization", "range", "if-match")
        sent = {k.title(): v for k, v in headers.items() if k in passed}
        request = urllib.request.Request(self.upstream + target, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, body, got = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as exc:
            status, body, got = exc.code, exc.read(), dict(exc.headers)
        if 200 <= status < 300:
            self.learned += len(body)
        if target.startswith("/peer/v1/files/") and status == 206:
            self.ranges_asked += 1
            body = _alter(body)
        keep = ("Content-Type", "Content-Range", "ETag", DIGEST_HEADER, PROOF_HEADER)
        self._send(sock, status, {k: v for k, v in got.items() if k in keep}, body)
        return True
