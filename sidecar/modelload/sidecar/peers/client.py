"""Asking a peer: signed requests, and answers used only once they prove the token and their bytes.

:class:`PeerFile` reads ranges of one weight file from one peer with the origin's hot path (a persistent
connection per reader, the body spliced into the segment), adding what a peer owes that an origin does not:
each request is signed with a fresh nonce (:mod:`modelload.loader.peerwire`), the answer's proof is checked
on its headers before a byte of the body lands, and the landed bytes' SHA-256 is compared with the digest
the proof covers before the read returns. A peer never redirects: a 3xx is an error.

:func:`get_document` is the same for the small JSON answers (the manifest, the stats): signed, capped in size
and time, proven, and only then handed to the caller's schema.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import threading
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from modelload.loader.errors import ModelloadError, PeerAnswerError
from modelload.loader.peerwire import DIGEST_HEADER, PROOF_HEADER, Answer, PeerKey, Request, parse_digest
from modelload.sidecar.sources import Exchange, HttpSettings, HttpSource, ObjectInfo, Target

__all__ = ["NotListening", "PeerFile", "get_document", "sha256_range"]

_PIECE = 1 << 20


class PeerFile(HttpSource):
    """Weight file ``index`` at the peer ``base`` (``http://host:port``), of the origin's size and ETag.

    ``settings`` should allow no redirect and set no headers: the signature is the only credential."""

    def __init__(self, base: str, index: int, settings: HttpSettings, info: ObjectInfo, key: PeerKey) -> None:
        super().__init__(f"{base}/peer/v1/files/{index}", settings)
        self._key = key
        self._info = ObjectInfo(size=info.size, etag=info.etag)  # the origin's: never asked of the peer
        self._local = threading.local()

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        target = super()._target(method, headers)
        authority = target.origin.netloc  # sent as the Host header, and signed: good at this address only
        asked = Request(method, target.path, authority, headers.get("Range"), headers.get("If-Match"))
        signed = self._key.sign(asked)
        self._local.nonce, self._local.path, self._local.digest = signed.nonce, target.path, None
        sent = {**target.headers, "Host": authority, "Authorization": signed.authorization}
        return Target(target.origin, target.path, sent)

    def _check_answer(self, exchange: Exchange, info: ObjectInfo, offset: int, length: int) -> bool | None:
        whole = super()._check_answer(exchange, info, offset, length)
        if exchange.status != 206:
            raise PeerAnswerError(f"{self.display_uri} answered {exchange.status} to a range request")
        digest = parse_digest(exchange.header(DIGEST_HEADER))
        path = getattr(self._local, "path", "")
        answer = Answer(206, path, exchange.header("Content-Range"), exchange.header("ETag"))
        nonce = getattr(self._local, "nonce", "")
        if digest is None or not self._key.proven(exchange.header(PROOF_HEADER), nonce, answer, digest):
            raise PeerAnswerError(f"{self.display_uri} answered without proving the peer token")
        self._local.digest = digest
        return whole

    def _error(self, exchange: Exchange, body: bytes) -> ModelloadError:
        if exchange.status in _REFUSALS:
            return PeerAnswerError(_REFUSALS[exchange.status](self.display_uri))
        return super()._error(exchange, body)

    def read_into(self, offset: int, buf: memoryview) -> None:
        super().read_into(offset, buf)
        self._check_digest(hashlib.sha256(buf).hexdigest())

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        super().read_into_fd(offset, length, fd, fd_offset)
        self._check_digest(sha256_range(fd, fd_offset, length))

    def _check_digest(self, landed: str) -> None:
        if landed != getattr(self._local, "digest", None):
            raise PeerAnswerError(f"{self.display_uri} sent bytes that differ from the digest it proved")


def sha256_range(fd: int, offset: int, length: int) -> str:
    """The SHA-256 (hex) of ``length`` bytes of the file ``fd`` at ``offset``, read in pieces (hashlib
    releases the GIL on each), for what a peer sent (here) and what a peer serves (the server)."""
    digest = hashlib.sha256()
    buffer = bytearray(min(_PIECE, length) or 1)
    view = memoryview(buffer)
    done = 0
    while done < length:
        n = os.preadv(fd, [view[: min(len(buffer), length - done)]], offset + done)
        if n <= 0:
            raise OSError(f"the file ends before byte {offset + length}")
        digest.update(view[:n])
        done += n
    return digest.hexdigest()


_REFUSALS: dict[int, Callable[[str], str]] = {
    401: lambda where: (
        f"{where} refused this sidecar's signature (HTTP 401): it holds another peer token, or speaks another"
        " version of the peer protocol"
    ),
    421: lambda where: (
        f"{where} passed the request on (HTTP 421) to a peer that it is not: a relay, or an address"
        " translation on the way; peers are asked at their own pod addresses"
    ),
}
"""What a peer's refusal of a request says, by status (the range requests' and the documents' alike)."""


class NotListening(OSError):
    """Nothing accepts connections at the peer's address (yet): a member that is still starting."""


def get_document(base: str, path: str, key: PeerKey, *, max_bytes: int, timeout: float) -> bytes:
    """The body of a peer's proven 200 answer to ``GET path``, at most ``max_bytes``, within ``timeout``.

    Raises :class:`NotListening` when the connection is refused, OSError for a peer that does not answer in
    time (or answers a status other than 200, 401 and a redirect), and PeerAnswerError for an answer that
    cannot be from an honest peer: a redirect, a refusal of our signature, a body too big, or a missing or
    wrong proof."""
    parts = urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=timeout)
    deadline = time.monotonic() + timeout
    signed = key.sign(Request("GET", path, parts.netloc))
    try:
        try:
            conn.connect()
        except ConnectionRefusedError as exc:
            raise NotListening(str(exc)) from None
        conn.request("GET", path, headers={"Host": parts.netloc, "Authorization": signed.authorization})
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise PeerAnswerError(f"{base} redirected {path} (HTTP {response.status}): peers never do")
        if response.status in _REFUSALS:
            raise PeerAnswerError(_REFUSALS[response.status](base))
        if response.status != 200:
            raise OSError(f"{base} answered {path} with HTTP {response.status}")
        declared = response.length
        if declared is not None and declared > max_bytes:
            raise PeerAnswerError(f"{base} sent a {path} of {declared} bytes (at most {max_bytes})")
        body = bytearray()
        while len(body) <= max_bytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{base} took over {timeout:g} s to send {path}")
            piece = response.read1(min(65536, max_bytes + 1 - len(body)))
            if not piece:
                break
            body += piece
        if len(body) > max_bytes:
            raise PeerAnswerError(f"{base} sent a {path} over {max_bytes} bytes")
        digest = hashlib.sha256(body).hexdigest()
        claimed = parse_digest(response.getheader(DIGEST_HEADER))
        proof = response.getheader(PROOF_HEADER)
        if claimed != digest or not key.proven(proof, signed.nonce, Answer(200, path), digest):
            raise PeerAnswerError(f"{base} answered {path} without proving the peer token")
        return bytes(body)
    except http.client.HTTPException as exc:
        raise OSError(f"{base} broke the HTTP protocol ({type(exc).__name__})") from None
    finally:
        conn.close()
