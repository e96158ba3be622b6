"""Asking a real sidecar's peer port as a peer would: signed requests, proven answers (loader/peerwire.py).

For tests and benchmarks that read a sidecar's stats or manifest, or probe what its server refuses.
"""

from __future__ import annotations

import hashlib
import http.client
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from modelload.loader.peerwire import DIGEST_HEADER, PROOF_HEADER, Answer, PeerKey, Request, parse_digest

__all__ = ["PeerAnswer", "peer_get", "peer_stats"]


@dataclass
class PeerAnswer:
    status: int
    headers: dict[str, str]
    body: bytes
    proven: bool
    """The answer carries a valid proof for this request's nonce, and its body the digest it proves."""

    def json(self) -> Any:
        return json.loads(self.body)


def peer_get(
    base: str,
    path: str,
    token: str | None,
    *,
    headers: dict[str, str] | None = None,
    timeout: float = 5.0,
    source: str | None = None,
) -> PeerAnswer:
    """``GET path`` at the peer ``base`` (``http://host:port``), signed with ``token`` (None: unsigned);
    ``headers`` are sent too (a Range, a Host, or an Authorization of the test's own making). The request is
    signed for the Host it is sent with: ``base``'s ``host:port`` unless ``headers`` name another."""
    parts = urlsplit(base)
    sent = {"Host": parts.netloc, **(headers or {})}
    nonce = ""
    if token is not None and "Authorization" not in sent:
        asked = Request("GET", path, sent["Host"], sent.get("Range"), sent.get("If-Match"))
        signed = PeerKey(token).sign(asked)
        sent["Authorization"], nonce = signed.authorization, signed.nonce
    bind = (source, 0) if source else None
    host, port = parts.hostname or "", parts.port or 80
    conn = http.client.HTTPConnection(host, port, timeout=timeout, source_address=bind)
    try:
        conn.request("GET", path, headers=sent)
        response = conn.getresponse()
        body = response.read()
        got = {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()
    proven = False
    if token is not None and nonce:
        digest = hashlib.sha256(body).hexdigest()
        answer = Answer(response.status, path, got.get("content-range"), got.get("etag"))
        proven = parse_digest(got.get(DIGEST_HEADER.lower())) == digest and PeerKey(token).proven(
            got.get(PROOF_HEADER.lower()), nonce, answer, digest
        )
    return PeerAnswer(response.status, got, body, proven)


def peer_stats(base: str, token: str, *, timeout: float = 5.0) -> dict[str, int]:
    """A sidecar's ``/peer/v1/stats``, checked to be proven."""
    answer = peer_get(base, "/peer/v1/stats", token, timeout=timeout)
    if answer.status != 200 or not answer.proven:
        raise AssertionError(f"{base} answered its stats with {answer.status} (proven: {answer.proven})")
    doc: dict[str, int] = answer.json()
    return doc
