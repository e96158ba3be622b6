"""Every fault of the proxy between the HTTP source and nginx: retried and resumed, or failed at once.

A resumed read must be byte-exact and its retry must ask only for the bytes that had not arrived.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from modelload.loader.errors import (
    RangeNotSupportedError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceNotFoundError,
)
from modelload.sidecar.sources import (
    InterruptedReadError,
    RetryEvent,
    RetryPolicy,
    Source,
    open_source,
    read_range,
    read_range_into_fd,
)
from tests.support.fault_proxy import (
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
from tests.support.nginx import NginxServer

from .conftest import FAST_RETRY, FAST_SETTINGS, payload

DATA = payload(1_500_000, seed=3)
OFFSET, LENGTH = 200_000, 1_000_000
LAST = OFFSET + LENGTH - 1


@pytest.fixture
def source(nginx: NginxServer, nginx_proxy: FaultProxy) -> Source:
    nginx.put("faults/model.bin", DATA)
    src = open_source(nginx_proxy.url("faults/model.bin"), FAST_SETTINGS)
    src.stat()  # faults below hit range reads, not the probe
    return src


def _read(source: Source, policy: RetryPolicy = FAST_RETRY) -> tuple[bytes, list[RetryEvent]]:
    events: list[RetryEvent] = []
    buf = bytearray(LENGTH)
    read_range(source, OFFSET, memoryview(buf), policy=policy, on_retry=events.append)
    return bytes(buf), events


@pytest.mark.parametrize(
    "fault",
    [Truncate(after=300_000), Stall(after=100_000, seconds=1.0)],
    ids=["short-body", "stall"],
)
def test_a_broken_body_resumes_exactly_at_the_missing_tail(
    source: Source, nginx_proxy: FaultProxy, fault: object
) -> None:
    nginx_proxy.push(fault)  # type: ignore[arg-type]
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    after = fault.after  # type: ignore[attr-defined]
    assert nginx_proxy.ranges()[-2:] == [(OFFSET, LAST), (OFFSET + after, LAST)]
    assert [(e.landed, e.resume_at) for e in events] == [(after, OFFSET + after)]


def test_a_reset_connection_resumes_from_what_arrived(source: Source, nginx_proxy: FaultProxy) -> None:
    nginx_proxy.push(Reset(after=400_000))
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    first, retry = nginx_proxy.ranges()[-2:]
    assert first == (OFFSET, LAST)
    assert OFFSET < retry[0] <= OFFSET + 400_000 and retry[1] == LAST  # bytes racing the RST may be lost
    assert events[0].resume_at == retry[0]


def test_a_reset_before_any_byte_retries_the_whole_range(source: Source, nginx_proxy: FaultProxy) -> None:
    nginx_proxy.push(Reset(after=0), Reset(after=0))
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    assert nginx_proxy.ranges()[-3:] == [(OFFSET, LAST)] * 3
    assert len(events) == 2


def test_slow_down_waits_at_least_retry_after(source: Source, nginx_proxy: FaultProxy) -> None:
    nginx_proxy.push(slow_down(retry_after=0.3))
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    assert events[0].delay >= 0.3
    assert events[0].error.retry_after == 0.3
    assert nginx_proxy.ranges()[-2:] == [(OFFSET, LAST)] * 2


def test_server_errors_are_retried(source: Source, nginx_proxy: FaultProxy) -> None:
    nginx_proxy.push(server_error(), Respond(502), Respond(504))
    data, events = _read(source)
    assert data == DATA[OFFSET : OFFSET + LENGTH]
    assert len(events) == 3


def test_a_server_that_keeps_failing_is_given_up_on(source: Source, nginx_proxy: FaultProxy) -> None:
    nginx_proxy.always(server_error())
    with pytest.raises(InterruptedReadError, match="gave up"):
        _read(source)
    assert len(nginx_proxy.ranges()) == 1 + FAST_RETRY.attempts  # the probe, then each attempt


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (IgnoreRange(), RangeNotSupportedError),
        (ReplaceObject(), SourceChangedError),
        (RewriteETag(), SourceChangedError),
        (Respond(404), SourceNotFoundError),
        (Respond(403), SourceAccessDeniedError),
        (s3_error(403, "AccessDenied"), SourceAccessDeniedError),
    ],
    ids=["ignore-range", "replaced", "etag-changed", "404", "403", "403-xml"],
)
def test_permanent_faults_fail_fast_without_retries(
    source: Source, nginx_proxy: FaultProxy, fault: object, error: type[Exception]
) -> None:
    nginx_proxy.push(fault)  # type: ignore[arg-type]
    before = len(nginx_proxy.requests)
    events: list[RetryEvent] = []
    with pytest.raises(error):
        read_range(source, OFFSET, memoryview(bytearray(LENGTH)), policy=FAST_RETRY, on_retry=events.append)
    assert len(nginx_proxy.requests) == before + 1
    assert events == []


def test_if_match_is_sent_once_the_etag_is_known(source: Source, nginx_proxy: FaultProxy) -> None:
    source.read_bytes(0, 10)
    probe, read = nginx_proxy.requests[-2:]
    assert "if-match" not in probe.headers
    assert read.headers["if-match"] == source.stat().etag


def test_splice_resumes_into_the_file_at_the_right_offset(
    source: Source, nginx_proxy: FaultProxy, shm_dir: Path
) -> None:
    nginx_proxy.push(Truncate(after=250_000), Reset(after=100_000), slow_down(retry_after=0))
    with (shm_dir / "model.seg").open("w+b") as handle:
        read_range_into_fd(source, OFFSET, LENGTH, handle.fileno(), 4096, policy=FAST_RETRY)
        handle.seek(4096)
        assert handle.read() == DATA[OFFSET : OFFSET + LENGTH]
    assert nginx_proxy.ranges()[2][0] == OFFSET + 250_000


def test_random_faults_from_eight_threads_still_give_exact_bytes(
    source: Source, nginx_proxy: FaultProxy
) -> None:
    faults = [Reset(after=20_000), Truncate(after=30_000), slow_down(retry_after=0), server_error()]
    nginx_proxy.randomly(faults, probability=0.3, seed=7)
    policy = RetryPolicy(attempts=10, initial_backoff=0.001, max_backoff=0.01, jitter=0.5, deadline=20.0)
    out = bytearray(len(DATA))
    chunk = 50_000
    retries: list[RetryEvent] = []

    def read(offset: int) -> None:
        view = memoryview(out)[offset : offset + chunk]
        read_range(source, offset, view, policy=policy, on_retry=retries.append)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(read, range(0, len(DATA), chunk)))
    assert out == DATA
    # A reset or truncation after N bytes of a retry that needs N bytes or fewer breaks nothing.
    breaking = [
        r
        for r in nginx_proxy.requests
        if isinstance(r.fault, Respond)
        or (
            isinstance(r.fault, (Reset, Truncate)) and r.range and r.range[1] - r.range[0] + 1 > r.fault.after
        )
    ]
    assert breaking and len(retries) == len(breaking)
