"""The peer protocol's proofs: how sidecars of one model (and the operator) show each other they hold the
model's peer token without ever sending it, and how an answer proves it came from a holder.

Every sidecar of a peered ModelLoad, and the operator that reads their stats, holds the same random token
(the ModelLoad's peer Secret). It never goes on the wire. Two keys are derived from it with HMAC-SHA256, one
to sign requests and one to prove answers, so a request's MAC can never pass as an answer's::

    ask key    = HMAC-SHA256(token, "modelload-peer-v2 ask")
    answer key = HMAC-SHA256(token, "modelload-peer-v2 answer")

**A request** carries ``Authorization: ModelloadPeer2 ts=<Unix ms>,nonce=<32 hex>,mac=<64 hex>``, the MAC
taken with the ask key over the method, the request target, the ``Host`` header (the address the asker
meant to reach), the ``Range`` and ``If-Match`` headers (empty when absent), the timestamp and the nonce, one
per line. A server accepts it when the MAC matches (compared in constant time), the timestamp is within
:data:`MAX_SKEW` of its own clock, the nonce was not seen before in that window (:class:`ReplayGuard`), and
the ``Host`` names the server itself: the address the connection came in on (the peer server checks that,
:func:`split_authority` here). A request signed for one address is therefore no good at any other: a process
without the token that got itself asked (a pod that took a departed peer's address, a relay in the middle)
cannot pass the asker's requests on to a real peer and read the weights from its answers.

**An answer** of 200 or 206 carries ``X-Modelload-Digest: sha256=<hex>``, the SHA-256 of its body, and
``X-Modelload-Proof: <hex>``, the MAC taken with the answer key over the asker's nonce, the status, the
request target, the ``Content-Range`` and ``ETag`` (empty when absent) and that digest. The asker checks
the proof on the headers (before a byte of the body is used), then the body's digest once it has it all. A
process without the token can therefore neither answer a fresh nonce nor relay a real peer's answer with
other bytes: it learns nothing it could reuse (each MAC is of one request and one address) and serves nothing
that passes.

A holder of the token is inside the trust boundary: it can serve wrong bytes with a matching digest, and a
checksum of its own choosing in its manifest. docs/peers.md says what closes that (digests from the origin).

The answers' JSON documents (a manifest, stats) are parsed with :func:`load_json`, which bounds their size
and nesting before the parser sees them. The standard library and numpy only: the sidecar and the operator
both import this, like :mod:`modelload.loader.wiring`.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import ipaddress
import json
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DIGEST_HEADER",
    "MAX_SKEW",
    "PROOF_HEADER",
    "SCHEME",
    "Answer",
    "PeerKey",
    "ReplayGuard",
    "Request",
    "Signed",
    "digest_header",
    "json_depth",
    "load_json",
    "normal_address",
    "parse_digest",
    "split_authority",
]

SCHEME = "ModelloadPeer2"
"""The ``Authorization`` scheme of a signed request."""
DIGEST_HEADER = "X-Modelload-Digest"
PROOF_HEADER = "X-Modelload-Proof"
MAX_SKEW = 30.0
"""Seconds a request's timestamp may differ from the server's clock (pods' clocks are NTP-synced; 30 s
tolerates a node that drifted), and so how long a server must remember a nonce."""
_VERSION = b"modelload-peer-v2"
_EARLIER_SCHEMES = ("ModelloadPeer1 ",)
"""Schemes of earlier protocol versions, refused with a message that names the version, not the token."""
_AUTHORIZATION = re.compile(
    rf"^{SCHEME} ts=(?P<ts>[0-9]{{1,16}}),nonce=(?P<nonce>[0-9a-f]{{32}}),mac=(?P<mac>[0-9a-f]{{64}})$"
)
_DIGEST = re.compile(r"^sha256=([0-9a-f]{64})$")
_AUTHORITY = re.compile(
    r"^(?:\[(?P<v6>[0-9A-Fa-f:.]{2,45}(?:%[0-9A-Za-z_.-]{1,32})?)\]|(?P<name>[0-9A-Za-z_.-]{1,253}))"
    r"(?::(?P<port>[0-9]{1,5}))?$"
)
"""A ``Host`` header: a bracketed IPv6 address (a zone allowed) or a name/IPv4 address, then maybe a port."""


@dataclass(frozen=True)
class Request:
    """What a request's MAC covers. ``authority`` is the ``Host`` header: ``host:port`` of the peer the
    asker means to reach (``[v6]:port`` for an IPv6 address; no port for 80)."""

    method: str
    target: str
    authority: str
    range: str | None = None
    if_match: str | None = None


@dataclass(frozen=True)
class Answer:
    """What an answer's proof covers (besides the asker's nonce and the body's digest)."""

    status: int
    target: str
    content_range: str | None = None
    etag: str | None = None


@dataclass(frozen=True)
class Signed:
    """A signed request: the ``Authorization`` header to send, and the nonce its answer must prove."""

    authorization: str
    nonce: str


def _lines(*fields: str | bytes) -> bytes:
    return b"\n".join(f if isinstance(f, bytes) else f.encode("utf-8", "surrogateescape") for f in fields)


class PeerKey:
    """The keys derived from one model's peer token. Holds no copy of the token; never shows the keys."""

    __slots__ = ("_answer", "_ask")

    def __init__(self, token: str) -> None:
        secret = token.encode()
        self._ask = hmac.new(secret, _VERSION + b" ask", hashlib.sha256).digest()
        self._answer = hmac.new(secret, _VERSION + b" answer", hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "PeerKey(<hidden>)"

    # --- requests ----------------------------------------------------------------------------------------

    def sign(self, request: Request, *, now: float | None = None, nonce: str | None = None) -> Signed:
        """Sign ``request`` with a fresh nonce (``nonce`` only for tests) and the time (``now``, Unix s)."""
        ts = str(int((time.time() if now is None else now) * 1000))
        nonce = nonce or secrets.token_hex(16)
        mac = self._request_mac(request, ts, nonce)
        return Signed(f"{SCHEME} ts={ts},nonce={nonce},mac={mac}", nonce)

    def _request_mac(self, request: Request, ts: str, nonce: str) -> str:
        text = _lines(
            _VERSION, b"ask", request.method, request.target, request.authority, request.range or "",
            request.if_match or "", ts, nonce,
        )  # fmt: skip
        return hmac.new(self._ask, text, hashlib.sha256).hexdigest()

    def check(self, authorization: str | None, request: Request, guard: ReplayGuard) -> str:
        """The nonce of a request whose ``Authorization`` proves the token, fresh and not replayed.

        Raises :class:`PermissionError` saying what is wrong (for the 401's body and a debug line); the
        message never holds a MAC or key."""
        if not authorization:
            raise PermissionError(f"a signed request is needed (Authorization: {SCHEME} ...)")
        if authorization.lstrip().startswith(_EARLIER_SCHEMES):
            raise PermissionError(
                f"the request is signed in an earlier version of the peer protocol; this peer speaks {SCHEME}"
                " (sidecars of two releases during an upgrade: each loads from the origin meanwhile)"
            )
        match = _AUTHORIZATION.match(authorization.strip())
        if match is None:
            raise PermissionError(f"the Authorization header is not a {SCHEME} signature")
        ts, nonce = match["ts"], match["nonce"]
        if not hmac.compare_digest(self._request_mac(request, ts, nonce), match["mac"]):
            raise PermissionError("the request's signature does not match: the peer token differs")
        guard.admit(nonce, int(ts) / 1000)
        return nonce

    # --- answers -----------------------------------------------------------------------------------------

    def prove(self, nonce: str, answer: Answer, digest: str) -> str:
        """The proof of an answer to the request that carried ``nonce``, whose body has SHA-256 ``digest``."""
        text = _lines(
            _VERSION, b"answer", nonce, str(answer.status), answer.target, answer.content_range or "",
            answer.etag or "", digest,
        )  # fmt: skip
        return hmac.new(self._answer, text, hashlib.sha256).hexdigest()

    def proven(self, proof: str | None, nonce: str, answer: Answer, digest: str) -> bool:
        """Whether ``proof`` is this key's proof of ``answer`` (constant time)."""
        if not proof:
            return False
        return hmac.compare_digest(self.prove(nonce, answer, digest), proof.strip())


def split_authority(authority: str) -> tuple[str, int] | None:
    """The host and port of a ``Host`` header (``host``, ``host:port``, ``[v6]`` or ``[v6]:port``; port 80
    when absent), the host an IP address in its normal form where it is one (an IPv4 address mapped into IPv6
    as the IPv4 one, a zone dropped), or None for anything malformed.

    >>> split_authority("10.0.0.7:8480"), split_authority("[::ffff:10.0.0.7]:8480"), split_authority("pod-a")
    (('10.0.0.7', 8480), ('10.0.0.7', 8480), ('pod-a', 80))
    """
    match = _AUTHORITY.match(authority)
    if match is None:
        return None
    host, port = match["v6"] or match["name"], int(match["port"] or 80)
    if not 0 < port < 65536:
        return None
    if match["v6"] is not None:
        address = normal_address(host)
        return (address, port) if ":" in host and address is not None else None
    return normal_address(host) or host.lower(), port


def normal_address(host: str) -> str | None:
    """``host`` as :mod:`ipaddress` writes it (an IPv4-mapped IPv6 address as IPv4, without a zone), or
    None when it is not an IP address."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def digest_header(digest: str) -> str:
    """The ``X-Modelload-Digest`` value for a body of SHA-256 ``digest`` (hex)."""
    return f"sha256={digest}"


def parse_digest(value: str | None) -> str | None:
    """The hex SHA-256 of an ``X-Modelload-Digest`` header, or None when it is missing or malformed."""
    match = _DIGEST.match((value or "").strip())
    return match.group(1) if match else None


class ReplayGuard:
    """The nonces a server accepted within the clock-skew window, so a captured request is good once.

    Memory is bounded: at most ``capacity`` nonces. When more arrive within the window (only signed
    requests are remembered, so only token holders can fill it), the oldest are forgotten and the window's
    start moves up to the newest timestamp forgotten: a request older than that is refused as possibly
    replayed, so a forgotten nonce can never be used again.
    """

    def __init__(self, *, skew: float = MAX_SKEW, capacity: int = 1 << 16) -> None:
        self.skew = skew
        self.capacity = capacity
        self._seen: set[str] = set()
        self._order: list[tuple[float, str]] = []
        self._floor = float("-inf")
        self._lock = threading.Lock()

    def admit(self, nonce: str, ts: float, *, now: float | None = None) -> None:
        """Remember ``nonce`` (signed at Unix time ``ts``); PermissionError when it may not be used."""
        now = time.time() if now is None else now
        if abs(now - ts) > self.skew:
            raise PermissionError(
                f"the request's time is {now - ts:+.0f} s off this peer's clock (at most {self.skew:g} s"
                " allowed): check the nodes' time sync"
            )
        with self._lock:
            self._forget(now - self.skew)
            if ts <= self._floor:
                raise PermissionError("the request is too old to be checked for replay: sign a new one")
            if nonce in self._seen:
                raise PermissionError("the request was already used (a replay): sign a new one")
            self._seen.add(nonce)
            heapq.heappush(self._order, (ts, nonce))
            while len(self._order) > self.capacity:
                old, gone = heapq.heappop(self._order)
                self._seen.discard(gone)
                self._floor = max(self._floor, old)

    def _forget(self, before: float) -> None:
        while self._order and self._order[0][0] < before:
            _, gone = heapq.heappop(self._order)
            self._seen.discard(gone)

    def __len__(self) -> int:
        return len(self._seen)


# --- bounded JSON ------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?')
"""A JSON string, or an unterminated one up to the end (which the parser then refuses): possessive and never
failing once at a quote, so one pass over the body, whatever it holds."""
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


def json_depth(body: bytes) -> int:
    """How deep ``body``'s arrays and objects nest, counted in C-speed passes (strings taken out, then a
    running sum over the brackets left): never recursive, whatever the input."""
    marks = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    steps = np.frombuffer(marks, dtype=np.uint8)
    delta = np.where((steps == ord("[")) | (steps == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(delta).max(initial=0))


def load_json(body: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """Parse an answer's JSON body after checking it is at most ``max_bytes`` long and nested at most
    ``max_depth`` deep (:func:`json_depth`), so a deeply nested document never reaches the recursive parser.
    Raises ValueError, saying which bound was broken, for anything else: a bad document, ``NaN``, an integer
    of more digits than Python converts."""
    if len(body) > max_bytes:
        raise ValueError(f"a JSON body of {len(body)} bytes (at most {max_bytes})")
    depth = json_depth(body)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} deep (at most {max_depth})")

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a number")

    try:
        return json.loads(body, parse_constant=refuse)
    except (UnicodeDecodeError, RecursionError) as exc:  # neither should pass the checks above
        raise ValueError(f"not a JSON document ({type(exc).__name__})") from None
