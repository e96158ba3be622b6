"""No credential, session token, Authorization header or presigned signature reaches an error or a log line.

Every fault the proxy can inject is run against an S3 source with session credentials, an HTTP source
whose URL carries a password and a presigned query string, and a private HTTP source whose token and API
key come from a header file; every message raised, every retry event and
every log record is then searched for the secret values.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from modelload.loader.errors import ModelloadError
from modelload.sidecar.sources import (
    HttpSettings,
    RetryEvent,
    RetryPolicy,
    S3Settings,
    Source,
    SourceSettings,
    open_source,
    parse_headers,
    read_range,
)
from tests.support.fault_proxy import (
    Fault,
    FaultProxy,
    IgnoreRange,
    ReplaceObject,
    Reset,
    Respond,
    RewriteETag,
    Stall,
    Truncate,
    s3_error,
    server_error,
    slow_down,
)
from tests.support.moto_s3 import Credentials, MotoS3Server
from tests.support.nginx import TOKEN, NginxServer

from .conftest import payload

DATA = payload(200_000, seed=6)
SECRET_KEY = "wJalrXUtnFEMI-modelload-secret-key-EXAMPLE"
SESSION_TOKEN = "FwoGZXIvYXdzEmodelload-session-token-EXAMPLE"
ACCESS_KEY = "ASIAMODELLOADACCESS1"
PASSWORD = "hunter2-modelload-password"
SIGNATURE = "f00dfacecafe-modelload-signature"
API_KEY = "ak-5e1d-modelload-api-key-EXAMPLE"

FAULTS: list[Fault] = [
    Reset(after=10_000),
    Truncate(after=20_000),
    Stall(after=5_000, seconds=0.8),
    slow_down(retry_after=0),
    server_error(),
    s3_error(400, "ExpiredToken"),
    s3_error(403, "AccessDenied"),
    s3_error(403, "SignatureDoesNotMatch"),
    s3_error(404, "NoSuchKey"),
    Respond(401),
    IgnoreRange(),
    ReplaceObject(),
    RewriteETag(),
]
POLICY = RetryPolicy(attempts=2, initial_backoff=0.001, max_backoff=0.002, jitter=0.0, deadline=5.0)
SETTINGS = HttpSettings(connect_timeout=2, stall_timeout=0.4)


def _exercise(source: Source, proxy: FaultProxy) -> list[str]:
    """Run every fault (twice in a row, so retries give up too) and return every message produced."""
    texts: list[str] = []
    try:
        source.stat()
    except ModelloadError as exc:
        texts.append(str(exc))
    for fault in FAULTS:
        proxy.push(fault, fault)
        events: list[RetryEvent] = []
        try:
            read_range(source, 1000, memoryview(bytearray(100_000)), policy=POLICY, on_retry=events.append)
        except ModelloadError as exc:
            texts.extend([str(exc), repr(exc), str(exc.__cause__)])
        texts.extend(str(event) for event in events)
        proxy.clear()
    texts.append(repr(source))
    texts.append(source.display_uri)
    return texts


def _assert_clean(texts: list[str], caplog: pytest.LogCaptureFixture, secrets: tuple[str, ...]) -> None:
    logged = [record.getMessage() for record in caplog.records] + [caplog.text]
    assert len(texts) > len(FAULTS)  # the faults really produced messages
    for text in texts + logged:
        for secret in secrets:
            assert secret not in text, f"{secret!r} leaked into: {text[:300]}"


def test_s3_errors_and_logs_carry_no_credentials(
    moto_s3: MotoS3Server,
    moto_proxy: FaultProxy,
    aws_env: Credentials,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    uri = moto_s3.put("sources-secrets", "model.bin", DATA)
    for name, value in Credentials(ACCESS_KEY, SECRET_KEY, SESSION_TOKEN).env().items():
        monkeypatch.setenv(name, value)
    caplog.set_level(logging.DEBUG)
    settings = SourceSettings(http=SETTINGS, s3=S3Settings(endpoint_url=moto_proxy.endpoint))
    texts = _exercise(open_source(uri, settings), moto_proxy)
    assert any(r.headers.get("x-amz-security-token") == SESSION_TOKEN for r in moto_proxy.requests)
    _assert_clean(texts, caplog, (SECRET_KEY, SESSION_TOKEN, ACCESS_KEY))


def test_http_errors_and_logs_carry_no_url_credentials_or_signatures(
    nginx: NginxServer, nginx_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    nginx.put("secrets/model.bin", DATA)
    url = nginx_proxy.url(f"secrets/model.bin?X-Amz-Signature={SIGNATURE}&token={SESSION_TOKEN}")
    url = url.replace("http://", f"http://loader:{PASSWORD}@")
    caplog.set_level(logging.DEBUG)
    texts = _exercise(open_source(url, SourceSettings(http=SETTINGS)), nginx_proxy)
    assert any(SIGNATURE in r.path for r in nginx_proxy.requests)
    _assert_clean(texts, caplog, (PASSWORD, SIGNATURE, SESSION_TOKEN, "bG9hZGVy"))


def test_http_errors_and_logs_carry_no_header_file_token(
    nginx: NginxServer, nginx_proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    nginx.put("secrets/private.bin", DATA)
    headers = parse_headers(f"Authorization: Bearer {TOKEN}\nX-Api-Key: {API_KEY}\n", where="the header file")
    settings = SourceSettings(http=replace(SETTINGS, headers=headers))
    caplog.set_level(logging.DEBUG)
    source = open_source(nginx_proxy.url("private/secrets/private.bin"), settings)
    texts = [*_exercise(source, nginx_proxy), repr(settings)]
    sent = {(r.headers.get("authorization"), r.headers.get("x-api-key")) for r in nginx_proxy.requests}
    assert sent == {(f"Bearer {TOKEN}", API_KEY)}  # every request, faulty or retried, carried both
    _assert_clean(texts, caplog, (TOKEN, API_KEY))
