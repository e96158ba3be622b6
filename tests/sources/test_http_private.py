"""A private HTTP server behind a bearer token (nginx on loopback): the token goes on every request to the
source's origin, retries and same-origin redirects included, never to another origin, and never into an
error message."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from modelload.loader.errors import ConfigError, SourceAccessDeniedError
from modelload.sidecar.sources import (
    HttpSettings,
    HttpSource,
    SourceSettings,
    open_source,
    parse_headers,
    read_range,
)
from tests.support.fault_proxy import FaultProxy, Reset, Respond, Truncate
from tests.support.nginx import TOKEN, NginxServer

from .conftest import FAST_RETRY, payload

DATA = payload(1_500_003, seed=31)
CHUNK = 200_000
NAME = "private-src/model.bin"


def settings(text: str | None) -> SourceSettings:
    headers = parse_headers(text, where="the test's headers") if text is not None else None
    return SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=0.5, headers=headers), retry=FAST_RETRY
    )


@pytest.fixture(scope="module", autouse=True)
def _model(nginx: NginxServer) -> None:
    nginx.put(NAME, DATA)


def read_all(source: HttpSource, *, threads: int = 4) -> bytes:
    out = bytearray(len(DATA))

    def read(offset: int) -> None:
        read_range(source, offset, memoryview(out)[offset : offset + CHUNK], policy=FAST_RETRY)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(0, len(DATA), CHUNK)))
    return bytes(out)


def test_the_right_token_reads_every_range_byte_exact(nginx: NginxServer) -> None:
    with open_source(nginx.private_url(NAME), settings(TOKEN)) as source:
        assert isinstance(source, HttpSource)
        assert source.stat().size == len(DATA)
        assert read_all(source) == DATA


def test_header_lines_work_as_well_as_a_bare_token(nginx: NginxServer) -> None:
    text = f"# the artifact server\nAuthorization: Bearer {TOKEN}\nX-Client: modelload-tests\n"
    with open_source(nginx.private_url(NAME), settings(text)) as source:
        assert read_all(source, threads=2) == DATA


def test_a_wrong_token_is_refused_naming_the_url_and_what_to_check_never_a_token(nginx: NginxServer) -> None:
    wrong = TOKEN.replace("EXAMPLE", "REVOKED")
    with (
        open_source(nginx.private_url(NAME), settings(wrong)) as source,
        pytest.raises(SourceAccessDeniedError) as caught,
    ):
        source.stat()
    message = str(caught.value)
    assert nginx.private_url(NAME) in message
    assert "HTTP 401" in message and "refused the configured token" in message
    assert "Secret" in message and "scope" in message
    for text in (message, repr(caught.value), str(caught.value.__cause__)):
        assert wrong not in text and TOKEN not in text


def test_no_token_at_all_says_how_to_give_one(nginx: NginxServer) -> None:
    with (
        open_source(nginx.private_url(NAME), settings(None)) as source,
        pytest.raises(SourceAccessDeniedError, match="no token was sent: give one with the ModelLoad's"),
    ):
        source.stat()


def test_every_request_carries_the_token_retries_included(nginx_proxy: FaultProxy) -> None:
    url = nginx_proxy.url(f"private/{NAME}")
    with open_source(url, settings(TOKEN)) as source:
        source.stat()
        nginx_proxy.push(Reset(after=50_000), Truncate(after=10_000))
        assert read_all(source) == DATA
    requests = nginx_proxy.requests
    assert sum(r.fault is not None for r in requests) == 2  # the two faults were served, then retried
    assert len(requests) >= 1 + len(range(0, len(DATA), CHUNK)) + 2
    assert {r.headers.get("authorization") for r in requests} == {f"Bearer {TOKEN}"}


def test_a_same_origin_redirect_keeps_the_token(nginx_proxy: FaultProxy) -> None:
    nginx_proxy.push(Respond(302, headers=(("Location", f"/private/{NAME}"),)))
    with open_source(nginx_proxy.url("private/old-name.bin"), settings(TOKEN)) as source:
        assert read_all(source) == DATA
    paths = {r.path for r in nginx_proxy.requests}
    assert paths == {"/private/old-name.bin", f"/private/{NAME}"}
    assert {r.headers.get("authorization") for r in nginx_proxy.requests} == {f"Bearer {TOKEN}"}


def test_a_redirect_to_another_origin_is_followed_without_the_token(
    nginx: NginxServer, nginx_proxy: FaultProxy
) -> None:
    with FaultProxy(nginx.port) as cdn:  # another port: another origin, as a hub's CDN is
        nginx_proxy.push(Respond(302, headers=(("Location", cdn.url(f"{NAME}?X-Signature=abc")),)))
        with open_source(nginx_proxy.url(f"private/{NAME}"), settings(TOKEN)) as source:
            assert read_all(source) == DATA
        assert len(nginx_proxy.requests) == 1  # the hub saw the first request only, with the token
        assert nginx_proxy.requests[0].headers.get("authorization") == f"Bearer {TOKEN}"
        assert len(cdn.requests) > 1
        assert all("authorization" not in r.headers for r in cdn.requests)
        assert all("X-Signature=abc" in r.path for r in cdn.requests)  # the signed URL is kept


def test_another_origin_that_wants_the_token_fails_saying_it_is_never_forwarded(
    nginx: NginxServer, nginx_proxy: FaultProxy
) -> None:
    with FaultProxy(nginx.port) as other:
        # always: a refused redirect target is asked for again from the source URL, once
        nginx_proxy.always(Respond(302, headers=(("Location", other.url(f"private/{NAME}")),)))
        with (
            open_source(nginx_proxy.url(f"private/{NAME}"), settings(TOKEN)) as source,
            pytest.raises(SourceAccessDeniedError) as caught,
        ):
            source.stat()
        assert all("authorization" not in r.headers for r in other.requests)
    message = str(caught.value)
    assert f"redirected to http://127.0.0.1:{other.port}, which refused access (HTTP 401" in message
    assert "never to another host" in message
    assert TOKEN not in message


def test_a_password_in_the_url_and_an_authorization_header_are_refused_together(nginx: NginxServer) -> None:
    url = nginx.private_url(NAME).replace("http://", "http://loader:pw-hidden@")
    with pytest.raises(ConfigError, match="give the credentials one way") as caught:
        open_source(url, settings(TOKEN))
    assert "pw-hidden" not in str(caught.value) and TOKEN not in str(caught.value)


def test_the_token_is_not_sent_to_an_s3_endpoint(nginx: NginxServer) -> None:
    """The S3 source signs its own requests: headers for a private HTTP server are not its business."""
    pytest.importorskip("botocore")
    from modelload.sidecar.sources import S3Settings

    with FaultProxy(nginx.port) as s3:
        base = settings(TOKEN)
        s3_settings = SourceSettings(
            http=base.http,
            s3=S3Settings(endpoint_url=s3.endpoint, addressing="path", unsigned=True),
            retry=FAST_RETRY,
        )
        with open_source(f"s3://{nginx.bucket}/{NAME}", s3_settings) as source:
            assert source.read_bytes(0, 1000) == DATA[:1000]
        assert s3.requests and all("authorization" not in r.headers for r in s3.requests)


def test_a_refused_url_password_is_named_as_such(nginx: NginxServer) -> None:
    url = nginx.private_url(NAME).replace("http://", "http://loader:pw-hidden@")
    with open_source(url, settings(None)) as source, pytest.raises(SourceAccessDeniedError) as caught:
        source.stat()
    assert "refused the URL's user and password (HTTP 401" in str(caught.value)
    assert "pw-hidden" not in str(caught.value)


def test_the_token_works_over_https(nginx: NginxServer) -> None:
    if nginx.ca_cert is None:
        pytest.skip("openssl is not installed: no HTTPS server")
    base = settings(TOKEN)
    tls = SourceSettings(http=replace(base.http, ca_bundle=str(nginx.ca_cert)), retry=FAST_RETRY)
    with open_source(nginx.https_url(f"private/{NAME}"), tls) as source:
        assert not source.supports_fd  # HTTPS lands through the mapping, not splice: the other body path
        assert read_all(source) == DATA
    with (
        open_source(
            nginx.https_url(f"private/{NAME}"), replace(tls, http=replace(tls.http, headers=None))
        ) as bare,
        pytest.raises(SourceAccessDeniedError, match="no token was sent"),
    ):
        bare.stat()
