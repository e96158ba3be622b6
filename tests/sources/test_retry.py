"""read_range retries transient errors, resumes where a stream broke, and stops on permanent ones."""

from __future__ import annotations

import pytest

from modelload.loader.errors import (
    RangeNotSupportedError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceNotFoundError,
    TransientSourceError,
)
from modelload.sidecar.sources import (
    InterruptedReadError,
    ObjectInfo,
    RetryEvent,
    RetryPolicy,
    read_range,
    stat_source,
)
from tests.support.memory_source import Interrupt, MemorySource

from .conftest import payload

FAST = RetryPolicy(attempts=3, initial_backoff=0.001, max_backoff=0.002, jitter=0.0, deadline=5.0)
DATA = payload(1000)


def _read(
    source: MemorySource, offset: int, length: int, policy: RetryPolicy = FAST
) -> tuple[bytes, list[RetryEvent]]:
    events: list[RetryEvent] = []
    buf = bytearray(length)
    read_range(source, offset, memoryview(buf), policy=policy, on_retry=events.append)
    return bytes(buf), events


def test_a_clean_read_makes_one_call_and_no_retries() -> None:
    source = MemorySource(DATA)
    data, events = _read(source, 100, 400)
    assert data == DATA[100:500]
    assert source.calls == [(100, 400)]
    assert events == []


def test_a_broken_stream_resumes_at_the_first_missing_byte() -> None:
    source = MemorySource(DATA, faults=[Interrupt(landed=150), Interrupt(landed=50)])
    data, events = _read(source, 100, 400)
    assert data == DATA[100:500]
    assert source.calls == [(100, 400), (250, 250), (300, 200)]
    assert [(e.retry, e.resume_at, e.landed, e.remaining) for e in events] == [
        (1, 250, 150, 250),
        (2, 300, 50, 200),
    ]


def test_failures_that_land_nothing_use_up_the_attempts() -> None:
    source = MemorySource(DATA, faults=[Interrupt(), Interrupt(), Interrupt(), Interrupt()])
    with pytest.raises(InterruptedReadError, match="3 tries without progress") as caught:
        _read(source, 0, 10)
    assert len(source.calls) == 3
    assert caught.value.landed == 0
    assert isinstance(caught.value.__cause__, TransientSourceError)


def test_progress_resets_the_attempt_count() -> None:
    faults = [
        Interrupt(),
        Interrupt(),
        Interrupt(landed=1),
        Interrupt(),
        Interrupt(),
        Interrupt(landed=1),
        None,
    ]
    source = MemorySource(DATA, faults=faults)
    data, events = _read(source, 0, 10)
    assert data == DATA[:10]
    assert len(events) == 6


def test_the_given_up_error_says_how_much_landed() -> None:
    source = MemorySource(DATA, faults=[Interrupt(landed=4)] + [Interrupt()] * 5)
    with pytest.raises(InterruptedReadError) as caught:
        _read(source, 0, 10)
    assert caught.value.landed == 4


@pytest.mark.parametrize(
    "error",
    [
        SourceNotFoundError("gone"),
        SourceAccessDeniedError("denied"),
        SourceChangedError("changed"),
        RangeNotSupportedError("no ranges"),
    ],
)
def test_permanent_errors_fail_at_once_without_retries(error: Exception) -> None:
    source = MemorySource(DATA, faults=[error])
    events: list[RetryEvent] = []
    with pytest.raises(type(error)):
        read_range(source, 0, memoryview(bytearray(10)), policy=FAST, on_retry=events.append)
    assert len(source.calls) == 1
    assert events == []


def test_a_plain_transient_error_without_a_count_retries_from_the_start() -> None:
    source = MemorySource(DATA, faults=[TransientSourceError("blip")])
    data, events = _read(source, 5, 10)
    assert data == DATA[5:15]
    assert source.calls == [(5, 10), (5, 10)]
    assert events[0].landed == 0


class _ScriptedTime:
    """The retry module's clock and sleep, moved only by the sleeps it asks for: what it waits and when it
    gives up follow from its policy alone, whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


@pytest.fixture
def scripted_time(monkeypatch: pytest.MonkeyPatch) -> _ScriptedTime:
    clock = _ScriptedTime()
    monkeypatch.setattr("modelload.sidecar.sources._retry.time", clock)
    return clock


def test_retry_after_sets_the_minimum_delay(scripted_time: _ScriptedTime) -> None:
    source = MemorySource(DATA, faults=[Interrupt(retry_after=0.2)])
    _, events = _read(source, 0, 10)
    assert events[0].delay == pytest.approx(0.2)
    assert scripted_time.slept == [events[0].delay]  # waited for it, before the second try


def test_backoff_grows_and_jitter_only_shortens_it() -> None:
    policy = RetryPolicy(attempts=5, initial_backoff=0.004, max_backoff=0.016, jitter=0.5, deadline=5.0)
    source = MemorySource(DATA, faults=[Interrupt()] * 4)
    _, events = _read(source, 0, 10, policy)
    caps = [0.004, 0.008, 0.016, 0.016]
    for event, cap in zip(events, caps, strict=True):
        assert cap * 0.5 <= event.delay <= cap


def test_the_deadline_stops_retries_before_a_delay_would_pass_it(scripted_time: _ScriptedTime) -> None:
    policy = RetryPolicy(attempts=100, initial_backoff=0.05, max_backoff=0.05, jitter=0.0, deadline=0.12)
    source = MemorySource(DATA, faults=[Interrupt()] * 100)
    with pytest.raises(InterruptedReadError, match="gave up"):
        _read(source, 0, 10, policy)
    assert scripted_time.slept == [0.05, 0.05]  # a third 0.05 s would end past 0.12 s
    assert len(source.calls) == 3


def test_a_retry_after_beyond_the_deadline_gives_up_at_once(scripted_time: _ScriptedTime) -> None:
    policy = RetryPolicy(attempts=5, initial_backoff=0.001, max_backoff=0.01, deadline=1.0)
    source = MemorySource(DATA, faults=[Interrupt(retry_after=30)])
    with pytest.raises(InterruptedReadError):
        _read(source, 0, 10, policy)
    assert scripted_time.slept == [] and len(source.calls) == 1


def test_zero_length_ranges_succeed_without_retries() -> None:
    source = MemorySource(DATA)
    data, events = _read(source, 1000, 0)
    assert data == b""
    assert events == []


class _FlakyStat(MemorySource):
    """A memory source whose first look-ups fail transiently."""

    def __init__(self, failures: list[Exception]) -> None:
        super().__init__(DATA)
        self.stat_failures = failures
        self.stat_calls = 0

    def _stat(self) -> ObjectInfo:
        self.stat_calls += 1
        if self.stat_failures:
            raise self.stat_failures.pop(0)
        return super()._stat()


def test_stat_source_retries_a_throttled_first_look_up() -> None:
    source = _FlakyStat([InterruptedReadError("503", retry_after=0.01), InterruptedReadError("reset")])
    events: list[RetryEvent] = []
    info = stat_source(source, policy=FAST, on_retry=events.append)
    assert info.size == len(DATA)
    assert source.stat_calls == 3
    assert [e.retry for e in events] == [1, 2]
    assert events[0].delay >= 0.01


def test_stat_source_gives_up_and_never_retries_permanent_errors() -> None:
    with pytest.raises(InterruptedReadError, match="gave up looking up"):
        stat_source(_FlakyStat([InterruptedReadError("x")] * 5), policy=FAST)
    denied = _FlakyStat([SourceAccessDeniedError("no")])
    with pytest.raises(SourceAccessDeniedError):
        stat_source(denied, policy=FAST)
    assert denied.stat_calls == 1
