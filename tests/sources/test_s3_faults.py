"""Faults between the S3 source and moto: retried and resumed, or failed at once with the right error."""

from __future__ import annotations

import pytest

from modelload.loader.errors import (
    RangeNotSupportedError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from modelload.sidecar.sources import (
    HttpSettings,
    RetryEvent,
    S3Settings,
    Source,
    SourceSettings,
    list_directory,
    open_source,
    read_range,
)
from tests.support.fault_proxy import (
    FaultProxy,
    IgnoreRange,
    ReplaceObject,
    Reset,
    Respond,
    Stall,
    Truncate,
    s3_error,
    server_error,
    slow_down,
)
from tests.support.moto_s3 import Credentials, MotoS3Server

from .conftest import FAST_RETRY, payload

BUCKET = "sources-s3-faults"
DATA = payload(400_000, seed=5)
OFFSET, LENGTH = 50_000, 300_000


@pytest.fixture
def source(moto_s3: MotoS3Server, moto_proxy: FaultProxy, aws_env: Credentials) -> Source:
    uri = moto_s3.put(BUCKET, "model.bin", DATA)
    settings = SourceSettings(
        http=HttpSettings(connect_timeout=2, stall_timeout=0.5),
        s3=S3Settings(endpoint_url=moto_proxy.endpoint),
    )
    src = open_source(uri, settings)
    src.stat()
    return src


def _read(source: Source) -> tuple[bytes, list[RetryEvent]]:
    events: list[RetryEvent] = []
    buf = bytearray(LENGTH)
    read_range(source, OFFSET, memoryview(buf), policy=FAST_RETRY, on_retry=events.append)
    return bytes(buf), events


@pytest.mark.parametrize(
    ("fault", "resume_at"),
    [
        (Truncate(after=120_000), OFFSET + 120_000),
        (Stall(after=60_000, seconds=1.0), OFFSET + 60_000),
        (slow_down(retry_after=0.1), OFFSET),
        (server_error(), OFFSET),
        (s3_error(500, "RequestTimeout"), OFFSET),
    ],
    ids=["short-body", "stall", "slow-down", "internal-error", "request-timeout"],
)
def test_transient_faults_are_retried_and_resumed(
    source: Source, moto_proxy: FaultProxy, fault: object, resume_at: int
) -> None:
    moto_proxy.push(fault)  # type: ignore[arg-type]
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    assert moto_proxy.ranges()[-2:] == [(OFFSET, OFFSET + LENGTH - 1), (resume_at, OFFSET + LENGTH - 1)]
    assert len(events) == 1


def test_a_reset_stream_resumes_with_a_freshly_signed_request(source: Source, moto_proxy: FaultProxy) -> None:
    moto_proxy.push(Reset(after=100_000))
    data, _ = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    first, retry = moto_proxy.requests[-2:]
    assert retry.range and OFFSET < retry.range[0] <= OFFSET + 100_000
    assert first.headers["authorization"] != retry.headers["authorization"]  # the signature covers the Range


@pytest.mark.parametrize(
    ("fault", "error", "words"),
    [
        (s3_error(400, "ExpiredToken"), SourceAccessDeniedError, "expired"),
        (s3_error(403, "AccessDenied"), SourceAccessDeniedError, "s3:GetObject"),
        (s3_error(404, "NoSuchKey"), SourceNotFoundError, "no object 'model.bin'"),
        (ReplaceObject(), SourceChangedError, "changed"),
        (IgnoreRange(), RangeNotSupportedError, "Range"),
    ],
    ids=["expired-token", "access-denied", "no-such-key", "replaced", "ignore-range"],
)
def test_permanent_faults_fail_fast_without_retries(
    source: Source, moto_proxy: FaultProxy, fault: object, error: type[Exception], words: str
) -> None:
    moto_proxy.push(fault)  # type: ignore[arg-type]
    before = len(moto_proxy.requests)
    with pytest.raises(error, match=words):
        _read(source)
    assert len(moto_proxy.requests) == before + 1


LOOPING_PAGE = (
    b'<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Contents><Key>loop/a.json</Key>'
    b"<Size>2</Size></Contents><IsTruncated>true</IsTruncated>"
    b"<NextContinuationToken>t1</NextContinuationToken></ListBucketResult>"
)


def test_a_listing_whose_continuation_token_loops_stops_at_the_loop_saying_so(
    moto_s3: MotoS3Server, moto_proxy: FaultProxy, aws_env: Credentials
) -> None:
    """An endpoint answering the same continuation token again was followed to the page limit (64 requests of
    up to 16 MiB), and the error asked whether the prefix was a model."""
    moto_s3.put(BUCKET, "loop/a.json", b"{}")
    settings = SourceSettings(
        http=HttpSettings(connect_timeout=2, stall_timeout=0.5),
        s3=S3Settings(endpoint_url=moto_proxy.endpoint),
    )
    moto_proxy.always(Respond(200, LOOPING_PAGE, (("Content-Type", "application/xml"),)), path="list-type=2")
    with pytest.raises(SourceError, match=r"continuation token is one already followed \(a loop\)"):
        list_directory(f"s3://{BUCKET}/loop/", settings)
    assert len([r for r in moto_proxy.requests if "list-type=2" in r.path]) == 2
