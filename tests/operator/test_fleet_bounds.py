"""The fleet poller against stats servers that lie: what a pod's answer can do to the operator is bounded.

Each server is a real HTTP server on loopback (aiohttp's) posing as a pod's sidecar; most hold the peer token
and prove their answers, so what is under test is what the operator does with a proven answer that is still
wrong: nested a hundred thousand deep, figures of 2^200, a redirect, a body of megabytes. Others hold another
token or none. Every one must end as one pod "not reporting", with a reason, and nothing raised.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from modelload.loader.peerwire import DIGEST_HEADER, PROOF_HEADER, Answer, PeerKey, digest_header
from modelload.loader.wiring import PEER_STATS_PATH
from modelload.operator.fleet import TIMEOUT, fetch
from modelload.operator.pods import PodLoad

TOKEN = "the-modelloads-peer-token-0123456789"
HONEST = {"origin_bytes": 7, "peer_bytes": 5, "uploaded_bytes": 5, "mismatches": 0}


def _proven(
    request: web.Request, body: bytes, *, key: PeerKey | None = None, status: int = 200
) -> web.Response:
    nonce = request.headers.get("Authorization", "").partition("nonce=")[2].partition(",")[0]
    digest = hashlib.sha256(body).hexdigest()
    proof = (key or PeerKey(TOKEN)).prove(nonce, Answer(status, PEER_STATS_PATH), digest)
    headers = {DIGEST_HEADER: digest_header(digest), PROOF_HEADER: proof, "Content-Type": "application/json"}
    return web.Response(status=status, body=body, headers=headers)


def _stats(doc: Any) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return _proven(request, json.dumps(doc).encode())

    return handler


async def _deep(request: web.Request) -> web.StreamResponse:
    return _proven(request, b"[" * 30000 + b"]" * 30000)


async def _huge(request: web.Request) -> web.StreamResponse:
    return _proven(request, json.dumps({**HONEST, "padding": "x" * (4 << 20)}).encode())


async def _chunked_huge(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={PROOF_HEADER: "0" * 64})
    await response.prepare(request)
    for _ in range(64):
        await response.write(b" " * 65536)
    return response


async def _redirect(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/honest" + PEER_STATS_PATH)


async def _no_token(request: web.Request) -> web.StreamResponse:
    return _proven(request, json.dumps(HONEST).encode(), key=PeerKey("not-the-token"))


async def _unproven(request: web.Request) -> web.StreamResponse:
    return web.json_response(HONEST)


async def _relayed_proof(request: web.Request) -> web.StreamResponse:
    """A real proof of honest figures, sent with other figures."""
    response = _proven(request, json.dumps(HONEST).encode())
    response.body = json.dumps({**HONEST, "origin_bytes": 10**15}).encode()
    return response


MODES: dict[str, Any] = {
    "honest": _stats(HONEST),
    "deep": _deep,
    "huge_number": _stats({**HONEST, "origin_bytes": 2**200}),
    "negative": _stats({**HONEST, "mismatches": -1}),
    "boolean": _stats({**HONEST, "mismatches": True}),
    "float": _stats({**HONEST, "peer_bytes": 1e300}),
    "not_an_object": _stats([1, 2, 3]),
    "huge": _huge,
    "chunked_huge": _chunked_huge,
    "redirect": _redirect,
    "no_token": _no_token,
    "unproven": _unproven,
    "relayed_proof": _relayed_proof,
}


@pytest.fixture
async def servers() -> AsyncIterator[str]:
    """One aiohttp server with a path prefix per mode; yields its ``host:port``."""
    app = web.Application()
    for mode, handler in MODES.items():
        app.router.add_get(f"/{mode}{PEER_STATS_PATH}", handler)
    app.router.add_get(PEER_STATS_PATH, MODES["honest"])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _ask(address: str, mode: str) -> Any:
    timeout = aiohttp.ClientTimeout(total=TIMEOUT)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        where = address if mode == "honest" else f"{address}/{mode}"  # the mode's prefix, then the stats path
        load = PodLoad(state="ready", peers=True, pod=mode, address=where)
        return await fetch(session, load, TOKEN, timeout=TIMEOUT)


async def test_an_honest_proven_answer_is_summed(servers: str) -> None:
    answer = await _ask(servers, "honest")
    assert answer.figures == HONEST and answer.error is None


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("deep", "not a peer's stats"),
        ("huge_number", "not a peer's stats"),
        ("negative", "not a peer's stats"),
        ("boolean", "not a peer's stats"),
        ("float", "not a peer's stats"),
        ("not_an_object", "not a peer's stats"),
        ("huge", "over 65536 bytes"),
        ("chunked_huge", "without proving"),
        ("redirect", "answered HTTP 302"),
        ("no_token", "without proving the peer token"),
        ("unproven", "without proving the peer token"),
        ("relayed_proof", "without proving the peer token"),
    ],
)
async def test_a_lying_stats_answer_is_a_pod_not_reporting_never_an_error(
    servers: str, mode: str, why: str
) -> None:
    answer = await _ask(servers, mode)
    assert answer.figures is None
    assert why in (answer.error or ""), answer.error
