"""A server that trickles the body of a small answer does not hold the load: the look-up that brings a
model's index or a small file, an API answer (the Hub's, a registry's manifest), a GCS metadata document and
an error page are all bounded by the same rate floor as a range, and end in a transient error that says the
body came too slowly.

The socket's stall timeout bounds each wait for a byte, not the whole read: before, a server that sent one
byte every fifth of a second held each of these reads forever (a 512 KiB index at 5 bytes a second is a
day), and the sidecar's status said only "loading".
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import TransientSourceError
from modelload.sidecar.sources import (
    GcsSettings,
    HttpSettings,
    RetryPolicy,
    SourceSettings,
    list_directory,
    open_source,
    read_range,
    stat_with_prefix,
)
from modelload.sidecar.sources._proxy import ProxySettings
from modelload.sidecar.sources._service import fetch_document
from tests.sources.conftest import payload

SIZE = 100_000
SLOW = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0, min_rate=64 << 10, slow_window=0.5),
    retry=RetryPolicy(attempts=2, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=5.0),
)
DEADLINE = 30.0
"""How long a bounded read may take here: the floor gives up within a second per try; a read that is still
going after this is held by the trickle."""


class Trickler:
    """Answers every request with ``head`` and then one byte of its body every fifth of a second, until
    closed: never silent long enough for the stall timeout, never done. With ``body``, that body instead,
    ``piece`` bytes every ``interval`` seconds."""

    def __init__(
        self,
        head: Callable[[str], bytes],
        body: bytes | None = None,
        piece: int = 1,
        interval: float = 0.2,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._head = head
        self._tls = tls
        self._body, self._piece, self._interval = body, piece, interval
        self.requests = 0
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        scheme = "https" if tls is not None else "http"
        self.base = f"{scheme}://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self._tls is not None:
            try:
                client = self._tls.wrap_socket(client, server_side=True)
            except OSError:
                client.close()
                return
        with client:
            request = b""
            while b"\r\n\r\n" not in request:
                data = client.recv(65536)
                if not data:
                    return
                request += data
            self.requests += 1
            try:
                client.sendall(self._head(request.decode("latin-1").split(" ", 2)[1]))
                at = 0
                while not self._stop.wait(self._interval):
                    if self._body is None:
                        client.sendall(b"x")
                        continue
                    client.sendall(self._body[at : at + self._piece])
                    at += self._piece
                    if at >= len(self._body):
                        return
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()


@pytest.fixture
def trickler() -> Iterator[Callable[..., Trickler]]:
    servers: list[Trickler] = []

    def start(head: Callable[[str], bytes], **body: Any) -> Trickler:
        servers.append(Trickler(head, **body))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _ends(call: Callable[[], object], server: Trickler) -> BaseException:
    """What ``call`` raises; a failure when it is still going after :data:`DEADLINE` (the server is closed
    first, so that the held read ends and the source can be closed)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(DEADLINE)
    if thread.is_alive():
        server.close()
        pytest.fail(f"the read is still held by the trickling body after {time.monotonic() - started:.0f} s")
    assert outcome and outcome[0] is not None, "a body that never came was taken as whole"
    return outcome[0]


def _partial(path: str) -> bytes:
    del path
    return (
        f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes 0-{SIZE - 1}/{SIZE}\r\n"
        f'Content-Length: {SIZE}\r\nETag: "v1"\r\n\r\n'
    ).encode()


def _ok_json(path: str) -> bytes:
    del path
    return f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {SIZE}\r\n\r\n".encode()


def test_a_trickling_index_or_small_file_ends_the_look_up_saying_it_came_too_slowly(trickler) -> None:  # type: ignore[no-untyped-def]
    server = trickler(_partial)
    with open_source(f"{server.base}/model.safetensors", SLOW) as source:
        error = _ends(lambda: stat_with_prefix(source, SIZE, policy=SLOW.retry), server)
    assert isinstance(error, TransientSourceError)
    assert "below the minimum" in str(error)


def test_a_trickling_api_answer_or_manifest_ends_saying_it_came_too_slowly(trickler) -> None:  # type: ignore[no-untyped-def]
    server = trickler(_ok_json)

    def fetch() -> object:
        return fetch_document(
            f"{server.base}/api/models/org/model/revision/main",
            display="hf://org/model",
            what="revision info",
            http=SLOW.http,
            retry=SLOW.retry,
            auth=None,
            explain=lambda status, reason, headers, body, at: AssertionError(status),
            limit=16 << 20,
        )

    error = _ends(fetch, server)
    assert isinstance(error, TransientSourceError)
    assert "below the minimum" in str(error)


def test_a_trickling_gcs_metadata_document_ends_saying_it_came_too_slowly(trickler) -> None:  # type: ignore[no-untyped-def]
    server = trickler(_ok_json)
    settings = SourceSettings(
        http=SLOW.http, retry=SLOW.retry, gcs=GcsSettings(endpoint_url=server.base, anonymous=True)
    )
    with open_source("gs://models/model.safetensors", settings) as source:
        error = _ends(lambda: stat_with_prefix(source, SIZE, policy=SLOW.retry), server)
    assert isinstance(error, TransientSourceError)
    assert "below the minimum" in str(error)


def test_a_trickling_error_page_still_ends_in_the_error_its_status_means(trickler) -> None:  # type: ignore[no-untyped-def]
    def refused(path: str) -> bytes:
        del path
        return b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/html\r\nContent-Length: 4000\r\n\r\n"

    server = trickler(refused)
    with open_source(f"{server.base}/model.safetensors", SLOW) as source:
        error = _ends(lambda: stat_with_prefix(source, SIZE, policy=SLOW.retry), server)
    assert "refused access (HTTP 403 Forbidden)" in str(error)


def _tls_server(folder: Path) -> tuple[ssl.SSLContext, str]:
    """A server's TLS context for 127.0.0.1, and the CA bundle that trusts it."""
    from tests.conftest import require
    from tests.support.tls import find_openssl, self_signed_certificate

    require(find_openssl() is not None, "openssl is not installed")
    cert, key = self_signed_certificate(folder)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, str(cert)


def _whole(size: int) -> Callable[[str], bytes]:
    def head(path: str) -> bytes:
        del path
        return f'HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nETag: "v1"\r\n\r\n'.encode()

    return head


FALLBACK = SourceSettings(
    http=HttpSettings(
        connect_timeout=2.0, stall_timeout=2.0, min_rate=64 << 10, slow_window=0.25, range_fallback=True
    ),
    retry=SLOW.retry,
)


def test_a_server_that_ignores_range_and_trickles_ends_the_single_stream_read(trickler) -> None:  # type: ignore[no-untyped-def]
    """The single-stream fallback drops the bytes before the range it wants; that skip had only the stall
    timeout, so a trickle held it forever."""
    server = trickler(_whole(SIZE))
    with open_source(f"{server.base}/model.bin", FALLBACK) as source:
        error = _ends(
            lambda: read_range(source, 50_000, memoryview(bytearray(100)), policy=SLOW.retry), server
        )
    assert isinstance(error, TransientSourceError)
    assert "below the minimum" in str(error)


def test_a_long_skip_of_the_single_stream_fallback_is_not_taken_for_a_slow_range(trickler, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The rate floor measured the range from the start of the response, skip included: once dropping the
    bytes before it took longer than a window (over HTTPS, a range a few dozen MiB into the object), the
    range counted as slow after its first receive, every time: each receive cost a new request and a new
    skip, and a model of a few GiB never ended."""
    context, ca = _tls_server(tmp_path)
    data = payload(3 << 20, seed=4)
    server = trickler(_whole(len(data)), body=data, piece=64 << 10, interval=0.01, tls=context)
    settings = SourceSettings(http=replace(FALLBACK.http, ca_bundle=ca), retry=SLOW.retry)
    with open_source(f"{server.base}/model.bin", settings) as source:
        buf = bytearray(512 << 10)
        read_range(source, 2 << 20, memoryview(buf), policy=SLOW.retry)
    assert bytes(buf) == data[2 << 20 : (2 << 20) + len(buf)]
    assert server.requests == 2, "the look-up, then the range in one request"


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_a_response_head_that_trickles_ends_saying_it_came_too_slowly(trickler, tmp_path, tls: bool) -> None:  # type: ignore[no-untyped-def]
    """http.client reads a status line and headers for as long as bytes come (a hundred lines of up to 64 KiB
    each): a header sent a byte every fifth of a second held the look-up for hours."""
    context, settings = None, SLOW
    if tls:
        context, ca = _tls_server(tmp_path)
        settings = SourceSettings(http=replace(SLOW.http, ca_bundle=ca), retry=SLOW.retry)
    server = trickler(lambda path: b"HTTP/1.1 206 Partial Content\r\nX-Slow: ", tls=context)
    with open_source(f"{server.base}/model.safetensors", settings) as source:
        error = _ends(lambda: stat_with_prefix(source, SIZE, policy=SLOW.retry), server)
    assert isinstance(error, TransientSourceError)
    assert "status line and headers did not come within" in str(error)


def test_a_proxy_whose_answer_to_connect_trickles_ends_saying_so(trickler) -> None:  # type: ignore[no-untyped-def]
    """An HTTPS origin through a proxy: http.client reads the proxy's answer to CONNECT line by line, for as
    long as bytes come."""
    server = trickler(lambda path: b"HTTP/1.1 200 Connection established\r\nX-Slow: ")
    port = int(server.base.rsplit(":", 1)[1])
    proxied = SourceSettings(
        http=replace(SLOW.http, proxy=ProxySettings(https=("127.0.0.1", port))), retry=SLOW.retry
    )
    with open_source("https://models.example/model.safetensors", proxied) as source:
        error = _ends(lambda: stat_with_prefix(source, SIZE, policy=SLOW.retry), server)
    assert isinstance(error, TransientSourceError)
    assert "proxy's answer" in str(error)


def test_a_token_service_whose_answer_trickles_ends_the_identity_token_grant(trickler) -> None:  # type: ignore[no-untyped-def]
    """A Docker config's identity token is exchanged by a POST of its own, whose answer's head was read for as
    long as bytes came."""
    from tests.sources.test_oci_hostile import _Recorder, _settings

    realm = trickler(lambda path: b"HTTP/1.1 200 OK\r\nX-Slow: ")
    challenge = f'Bearer realm="{realm.base}/token",service="registry"'
    registry = _Recorder(lambda request: (401, [("WWW-Authenticate", challenge)], b"{}"))
    try:
        host = f"127.0.0.1:{registry.port}"
        config = _settings(host, auths={host: {"identitytoken": "refresh-me-EXAMPLE"}}, slow_window=0.5)
        error = _ends(lambda: list_directory(f"oci://{host}/m:v1", config), realm)
    finally:
        registry.close()
    assert isinstance(error, TransientSourceError)
    assert "status line and headers did not come within" in str(error)
