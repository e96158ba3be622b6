"""Response headers and S3 error bodies are read into the right error branch, with what to check."""

from __future__ import annotations

import email.utils

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from modelload.sidecar.sources import InterruptedReadError
from modelload.sidecar.sources._responses import (
    display_url,
    error_for_status,
    parse_content_range,
    parse_retry_after,
    same_etag,
)
from modelload.sidecar.sources._s3_errors import error_code, s3_error


def _xml(code: str) -> bytes:
    return f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>".encode()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bytes 0-0/10", (0, 0, 10)),
        ("bytes 5-9/*", (5, 9, None)),
        ("bytes */0", (None, None, 0)),
        ("BYTES 1-2/3", (1, 2, 3)),
        ("items 1-2/3", (None, None, None)),
        (None, (None, None, None)),
    ],
)
def test_content_range_is_parsed_or_left_unknown(value: str | None, expected: tuple[object, ...]) -> None:
    assert parse_content_range(value) == expected


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    assert parse_retry_after("soon") is None
    assert parse_retry_after("-1") is None
    assert parse_retry_after(None) is None
    now = 1_700_000_000.0
    assert parse_retry_after(email.utils.formatdate(now + 7, usegmt=True), now=now) == pytest.approx(7, abs=1)


def test_weak_and_strong_etags_of_one_version_compare_equal() -> None:
    assert same_etag('W/"a"', '"a"')
    assert not same_etag('"a"', '"b"')
    assert same_etag(None, '"b"')


def test_display_urls_drop_user_info_and_query_strings() -> None:
    shown = display_url(
        "https://user:hunter2@example.com:8443/m.bin?X-Amz-Signature=abc&X-Amz-Security-Token=t"
    )
    assert shown == "https://example.com:8443/m.bin?…"
    assert "hunter2" not in shown and "abc" not in shown


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, SourceNotFoundError),
        (410, SourceNotFoundError),
        (401, SourceAccessDeniedError),
        (403, SourceAccessDeniedError),
        (412, SourceChangedError),
        (416, SourceChangedError),
        (429, InterruptedReadError),
        (500, InterruptedReadError),
        (503, InterruptedReadError),
        (400, SourceError),
    ],
)
def test_http_statuses_map_to_what_the_caller_does_next(status: int, error: type[Exception]) -> None:
    result = error_for_status(status, "Reason", {"Retry-After": "2"}, uri="http://h/m")
    assert type(result) is error
    assert "http://h/m" in str(result)


def test_a_transient_status_carries_the_servers_retry_after() -> None:
    result = error_for_status(503, "Slow Down", {"Retry-After": "4"}, uri="http://h/m")
    assert isinstance(result, InterruptedReadError)
    assert result.retry_after == 4.0
    assert result.landed == 0


def test_the_s3_error_code_is_read_from_the_xml_body() -> None:
    assert error_code(_xml("NoSuchKey")) == "NoSuchKey"
    assert error_code(b"<html>oops</html>") is None


@pytest.mark.parametrize(
    ("status", "code", "error", "words"),
    [
        (404, "NoSuchKey", SourceNotFoundError, "no object 'dir/m.bin' in bucket 'models'"),
        (404, "NoSuchBucket", SourceNotFoundError, "bucket 'models' does not exist"),
        (404, None, SourceNotFoundError, "bucket 'models'"),
        (403, "AccessDenied", SourceAccessDeniedError, "s3:GetObject on arn:aws:s3:::models/dir/m.bin"),
        (403, "InvalidAccessKeyId", SourceAccessDeniedError, "AWS_ACCESS_KEY_ID"),
        (403, "SignatureDoesNotMatch", SourceAccessDeniedError, "AWS_SECRET_ACCESS_KEY"),
        (400, "ExpiredToken", SourceAccessDeniedError, "expired"),
        (400, "InvalidToken", SourceAccessDeniedError, "AWS_SESSION_TOKEN"),
        (403, "RequestTimeTooSkewed", SourceAccessDeniedError, "clock"),
        (412, "PreconditionFailed", SourceChangedError, "changed"),
        (416, "InvalidRange", SourceChangedError, "changed"),
        (503, "SlowDown", InterruptedReadError, "SlowDown"),
        (500, "InternalError", InterruptedReadError, "InternalError"),
        (400, "RequestTimeout", InterruptedReadError, "RequestTimeout"),
        (301, "PermanentRedirect", ConfigError, "region"),
        (400, "InvalidArgument", SourceError, "InvalidArgument"),
    ],
)
def test_s3_errors_name_the_bucket_key_and_what_to_check(
    status: int, code: str | None, error: type[Exception], words: str
) -> None:
    body = _xml(code) if code else b""
    result = s3_error(
        status, {"x-amz-request-id": "RID1"}, body, bucket="models", key="dir/m.bin", unsigned=False
    )
    assert type(result) is error
    assert words in str(result)
    if error is not ConfigError:
        assert "s3://models/dir/m.bin" in str(result)


def test_a_refused_anonymous_request_says_the_object_is_not_public() -> None:
    result = s3_error(403, {}, _xml("AccessDenied"), bucket="b", key="k", unsigned=True)
    assert isinstance(result, SourceAccessDeniedError)
    assert "not public" in str(result)


def test_a_wrong_region_names_the_buckets_region() -> None:
    result = s3_error(
        301,
        {"x-amz-bucket-region": "eu-west-3"},
        _xml("PermanentRedirect"),
        bucket="b",
        key="k",
        unsigned=False,
    )
    assert isinstance(result, ConfigError)
    assert "eu-west-3" in str(result)


def test_s3_messages_leave_out_the_servers_own_text() -> None:
    body = b"<Error><Code>SignatureDoesNotMatch</Code><AWSAccessKeyId>AKIASECRETISH</AWSAccessKeyId></Error>"
    result = s3_error(403, {}, body, bucket="b", key="k", unsigned=False)
    assert "AKIASECRETISH" not in str(result)
