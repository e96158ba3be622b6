"""Credentials never reach an error message (and from there logs, /status, the failure marker, the ModelLoad's
status): not through text a hostile server or gateway controls (a reason phrase, a malformed status line, an
S3 ``<Code>`` or request id, a GCS reason), nor through a configuration value that holds one (a proxy URL's
password, a source's query string)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceError,
    SourceUriError,
)
from modelload.sidecar.sources import (
    HttpSettings,
    InterruptedReadError,
    SourceSettings,
    open_source,
    parse_headers,
    proxy_from_environ,
)
from modelload.sidecar.sources._cloud_errors import gcs_error
from modelload.sidecar.sources._responses import error_for_status, redact_uri
from modelload.sidecar.sources._s3_errors import s3_error
from modelload.sidecar.sources._settings import S3Credentials, S3Settings
from modelload.sidecar.sources.hub._api import parse_hub_uri
from modelload.sidecar.sources.oci._reference import parse_oci_uri

from .conftest import FAST_RETRY

TOKEN = "s3cr3t-TOKEN-0123456789abcdef"
SETTINGS = SourceSettings(
    http=HttpSettings(
        connect_timeout=2.0,
        stall_timeout=1.0,
        headers=parse_headers(f"Authorization: Bearer {TOKEN}", where="t"),
    ),
    retry=FAST_RETRY,
)


class RawServer:
    """Answers every request with ``answer(path, request head)``, bytes as they are: a server that writes
    what it likes into its status line. Counts the requests it read."""

    def __init__(self, answer: Callable[[str, str], bytes]) -> None:
        self.answer = answer
        self.requests: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with client:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = client.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                if not head:
                    continue
                text = head.decode("latin-1")
                path = text.split(" ", 2)[1]
                self.requests.append(path)
                client.sendall(self.answer(path, text))

    def close(self) -> None:
        self._listener.close()
        self._thread.join(timeout=5)


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[str, str], bytes]], RawServer]]:
    servers: list[RawServer] = []

    def start(answer: Callable[[str, str], bytes]) -> RawServer:
        servers.append(RawServer(answer))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _echo(status: int) -> Callable[[str, str], bytes]:
    def answer(path: str, head: str) -> bytes:
        auth = next(line for line in head.split("\r\n") if line.lower().startswith("authorization:"))
        said = auth.partition(":")[2].strip()
        return f"HTTP/1.1 {status} Denied for {said}\r\nContent-Length: 0\r\n\r\n".encode()

    return answer


@pytest.mark.parametrize("status", [401, 403, 404, 418, 503])
def test_a_reason_phrase_that_echoes_the_token_is_not_shown(raw_server, status: int) -> None:  # type: ignore[no-untyped-def]
    server = raw_server(_echo(status))
    with pytest.raises(SourceError) as caught, open_source(f"{server.base}/m.bin", SETTINGS) as source:
        source.stat()
    assert server.requests, "the server was asked"
    assert TOKEN not in str(caught.value)
    assert "Denied for" not in str(caught.value)
    assert f"HTTP {status}" in str(caught.value)


def test_the_standard_phrase_stands_for_the_servers() -> None:
    error = error_for_status(403, f"Denied for Bearer {TOKEN}", {}, uri="https://h/m")
    assert isinstance(error, SourceAccessDeniedError)
    assert "HTTP 403 Forbidden" in str(error) and TOKEN not in str(error)
    assert "answered HTTP 499, which" in str(error_for_status(499, TOKEN, {}, uri="https://h/m"))


def test_a_malformed_status_line_is_named_without_its_text(raw_server) -> None:  # type: ignore[no-untyped-def]
    server = raw_server(lambda path, head: f"HTTP/1.1 XYZ Bearer {TOKEN}\r\n\r\n".encode())
    with (
        pytest.raises(InterruptedReadError) as caught,
        open_source(f"{server.base}/m.bin", SETTINGS) as source,
    ):
        source.stat()
    assert TOKEN not in str(caught.value)
    assert "status line is malformed" in str(caught.value)


@pytest.mark.parametrize(
    "location",
    ["/a b?X-Amz-Signature=SECRETSIG", "/caf\u00e9.bin?X-Amz-Signature=SECRETSIG"],
    ids=["space", "latin-1"],
)
def test_a_redirect_to_a_path_with_a_space_fails_once_without_its_signature(
    raw_server: Callable[[Callable[[str, str], bytes]], RawServer], location: str
) -> None:
    """And a path outside ASCII (a Location header is latin-1 to http.client): it failed the request with a
    UnicodeEncodeError whose arguments hold the whole request line, signature included, an internal error and
    a traceback in the log for a server's bad redirect."""

    def answer(path: str, head: str) -> bytes:
        return f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode("latin-1")

    server = raw_server(answer)
    with pytest.raises(SourceError) as caught, open_source(f"{server.base}/m.bin", SETTINGS) as source:
        source.stat()
    assert not isinstance(caught.value, InterruptedReadError), "a URL HTTP cannot send is not worth a retry"
    assert server.requests == ["/m.bin"]
    assert "SECRETSIG" not in str(caught.value)
    assert "percent-encode" in str(caught.value)


def test_a_source_with_a_space_names_it_by_its_display_form(raw_server) -> None:  # type: ignore[no-untyped-def]
    server = raw_server(_echo(500))
    uri = f"{server.base}/my model.bin?sv=2022&sig=SECRETSIG"
    with pytest.raises(SourceError) as caught, open_source(uri, SETTINGS) as source:
        source.stat()
    assert not isinstance(caught.value, InterruptedReadError)
    assert server.requests == []
    assert "SECRETSIG" not in str(caught.value)
    assert "/my model.bin?…" in str(caught.value)


def _s3_body(code: str) -> bytes:
    return f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()


@pytest.mark.parametrize(
    "code",
    [
        "FwoGZXIvYXdzEXAMPLESESSIONTOKENxyz0123456789",
        "IQoJb3JpZ2luX2VjEJr//////////wEaCXVzLWVhc3QtMSJHMEUCIQ==",
        "AWS4-HMAC-SHA256 Credential=AKIAEXAMPLE/20260101/us-east-1/s3/aws4_request",
    ],
)
def test_an_s3_code_or_request_id_that_is_not_shaped_like_one_is_left_out(code: str) -> None:
    signature = "Signature=" + "ab12" * 16
    headers = {"x-amz-request-id": f"AWS4-HMAC-SHA256 Credential=AKIA/x, {signature}"}
    error = s3_error(403, headers, _s3_body(code), bucket="b", key="k", unsigned=False)
    assert isinstance(error, SourceAccessDeniedError)
    assert code not in str(error) and signature not in str(error)
    assert str(error).endswith("(HTTP 403)")


def test_s3_codes_and_request_ids_of_the_documented_shapes_are_shown() -> None:
    for code in ("AccessDenied", "XAmzContentSHA256Mismatch", "XMinioServerNotInitialized"):
        error = s3_error(
            400, {"x-amz-request-id": "4442587FB7D0A2F9"}, _s3_body(code), bucket="b", key="k", unsigned=False
        )
        assert f"{code}, request id 4442587FB7D0A2F9" in str(error)


ALNUM_SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEYq"
"""A secret access key without '/' or '+' (about one in four is): letters and digits, so shaped like an S3
code, and like a request id."""


@pytest.mark.parametrize("echoed", [ALNUM_SECRET, ALNUM_SECRET[5:25], "AKIAIOSFODNN7EXAMPLE"])
def test_an_s3_endpoint_that_echoes_a_credential_as_its_code_and_request_id_gets_neither_shown(
    raw_server,
    echoed: str,  # type: ignore[no-untyped-def]
) -> None:
    """A real signed read from an S3-compatible endpoint that answers 403 with (a part of) the credentials
    it was signed with as its ``<Code>`` and ``x-amz-request-id``."""

    def answer(path: str, head: str) -> bytes:
        body = _s3_body(echoed)
        return (
            f"HTTP/1.1 403 Forbidden\r\nx-amz-request-id: {echoed}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    server = raw_server(answer)
    settings = SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=1.0),
        retry=FAST_RETRY,
        s3=S3Settings(
            endpoint_url=server.base,
            region="us-east-1",
            addressing="path",
            credentials=S3Credentials("AKIAIOSFODNN7EXAMPLE", ALNUM_SECRET),
        ),
    )
    with (
        pytest.raises(SourceAccessDeniedError) as caught,
        open_source("s3://bucket/m.safetensors", settings) as source,
    ):
        source.stat()
    text = str(caught.value)
    assert server.requests, "the request never reached the endpoint"
    assert echoed not in text and ALNUM_SECRET[:8] not in text
    assert text.endswith("(HTTP 403)"), text


def test_an_s3_code_that_shares_no_run_with_the_credentials_is_still_shown() -> None:
    secrets = ("AKIAIOSFODNN7EXAMPLE", ALNUM_SECRET)
    error = s3_error(
        403, {"x-amz-request-id": "4442587FB7D0A2F9"}, _s3_body("AccessDenied"),
        bucket="b", key="k", unsigned=False, secrets=secrets,
    )  # fmt: skip
    assert "(HTTP 403, AccessDenied, request id 4442587FB7D0A2F9)" in str(error)
    unknown = s3_error(403, {"x-amz-request-id": "4442587FB7D0A2F9"}, _s3_body("AccessDenied"),
                       bucket="b", key="k", unsigned=False, secrets=None)  # fmt: skip
    assert str(unknown).endswith("(HTTP 403)")


def test_a_gcs_reason_that_is_not_a_word_is_left_out() -> None:
    token = "ya29.a0AfB_byC-EXAMPLE-ACCESS-TOKEN-0123456789abcdefghijklmnop"
    error_json = {"code": 403, "message": "denied", "errors": [{"reason": f"Bearer {token}", "message": "x"}]}
    body = json.dumps({"error": error_json}).encode()
    error = gcs_error(403, {}, body, bucket="b", name="m", identity="sa@p.iam", pinned=None)
    assert token not in str(error) and "Bearer" not in str(error)
    body = b'{"error": {"code": 403, "message": "denied", "errors": [{"reason": "forbidden"}]}}'
    error = gcs_error(403, {}, body, bucket="b", name="m", identity="sa@p.iam", pinned=None)
    assert "(HTTP 403, forbidden: denied)" in str(error)


PASSWORD = "Pr0xyPa55w0rd"


@pytest.mark.parametrize(
    "environ",
    [
        {"HTTPS_PROXY": f"https://alice:{PASSWORD}@proxy.corp:3128"},
        {"HTTP_PROXY": f"socks5://alice:{PASSWORD}@proxy.corp:1080"},
    ],
)
def test_a_refused_proxy_url_is_shown_without_its_password(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        proxy_from_environ(environ)
    assert PASSWORD not in str(caught.value)
    assert "alice:***@proxy.corp" in str(caught.value)


@pytest.mark.parametrize(
    ("uri", "meant"),
    [
        (f"https:/alice:{PASSWORD}@models.corp/m.safetensors", "https://alice:***@models.corp/m.safetensors"),
        (f"https//models.corp/m.safetensors?sig={PASSWORD}", "https://models.corp/m.safetensors?…"),
    ],
)
def test_a_source_typo_is_corrected_without_its_credentials(uri: str, meant: str) -> None:
    with pytest.raises(SourceUriError) as caught:
        open_source(uri)
    assert PASSWORD not in str(caught.value)
    assert f"did you mean {meant}?" in str(caught.value)


@pytest.mark.parametrize(
    ("parse", "uri"),
    [
        (parse_hub_uri, f"hf://org/name?token={PASSWORD}"),
        (parse_oci_uri, f"oci://ghcr.io/org/m:v1?token={PASSWORD}"),
        (parse_oci_uri, f"oci://alice:{PASSWORD}@ghcr.io/org/m:v1"),
    ],
)
def test_a_refused_hub_or_oci_uri_is_shown_without_its_credentials(parse, uri: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SourceUriError) as caught:
        parse(uri)
    assert PASSWORD not in str(caught.value)


def test_redact_uri_keeps_what_helps() -> None:
    assert redact_uri("s3//alice:pw@bucket/key?x=1#f") == "s3//alice:***@bucket/key?…"
    assert redact_uri("http://user@host/m") == "http://user@host/m"
    assert redact_uri("/plain/path") == "/plain/path"
