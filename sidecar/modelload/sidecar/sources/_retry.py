"""Retrying a range read: exponential backoff with jitter, ``Retry-After``, and resume where a stream broke.

Sources raise; this module decides whether to try again. Only :class:`TransientSourceError` is retried:
not found, denied, changed and range-unsupported are permanent and propagate at once. When a transient
error says how many bytes landed (:class:`InterruptedReadError`), the next request asks only for the rest,
so a connection reset 30 MiB into a 32 MiB range costs 2 MiB, not 32.

Each retry is reported to ``on_retry`` (the engine counts them for ``/status`` and ``/metrics``) and logged
with the source's display URI, never its credentials.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from modelload.loader.errors import ModelloadError, TransientSourceError

from ._base import (
    WINDOW,
    InterruptedReadError,
    ObjectInfo,
    RangeSink,
    Source,
    SourceBase,
    byte_view,
    views_after,
)
from ._settings import RetryPolicy

__all__ = [
    "RetryCancelled",
    "RetryEvent",
    "read_bytes",
    "read_range",
    "read_range_into_fd",
    "read_range_into_sink",
    "read_range_pieces",
    "read_range_pieces_into_fd",
    "retrying",
    "stat_source",
    "stat_with_prefix",
]

_log = logging.getLogger("modelload.sidecar.sources")


class RetryCancelled(ModelloadError):
    """The policy's ``stop`` event was set while waiting to retry: the caller is shutting down."""

    kind = "stopped"


def _pause(policy: RetryPolicy, delay: float, uri: str) -> None:
    if policy.stop is None:
        time.sleep(delay)
    elif policy.stop.wait(delay):
        raise RetryCancelled(f"stopped while waiting to retry {uri}")


@dataclass(frozen=True)
class RetryEvent:
    """One retry about to happen: after ``delay`` seconds, from absolute offset ``resume_at``.

    ``retry`` counts retries of this range so far (1 for the first), ``landed`` the bytes the failed try
    delivered, ``remaining`` the bytes still to read.
    """

    uri: str
    retry: int
    delay: float
    error: TransientSourceError
    resume_at: int
    landed: int
    remaining: int


RetryCallback = Callable[[RetryEvent], None]
_T = TypeVar("_T")


def read_range(
    source: Source,
    offset: int,
    buf: memoryview,
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
) -> None:
    """Fill ``buf`` with the source's bytes at ``offset``, retrying transient errors under ``policy``.

    Example::

        buf = memoryview(segment_mmap)[dst : dst + length]
        read_range(source, src_offset, buf, policy=settings.retry, on_retry=metrics.count_retry)

    Raises the permanent SourceError branches at once, and TransientSourceError (an InterruptedReadError
    whose ``landed`` says how much of ``buf`` is filled) when the policy's attempts or deadline run out.
    """

    view = byte_view(buf)

    def step(done: int) -> None:
        source.read_into(offset + done, view[done:])

    _retrying(source.display_uri, offset, len(view), step, policy, on_retry)


def read_bytes(
    source: Source,
    offset: int,
    length: int,
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
) -> bytes:
    """``source.read_bytes(offset, length)`` under the same retries as every range (:func:`read_range`): the
    small reads of a file's header and index, where one reset or 503 must not fail the load for good."""
    buf = bytearray(length)
    read_range(source, offset, memoryview(buf), policy=policy, on_retry=on_retry)
    return bytes(buf)


def read_range_into_fd(
    source: Source,
    offset: int,
    length: int,
    fd: int,
    fd_offset: int,
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
) -> None:
    """Like :func:`read_range`, landing the bytes in file ``fd`` at ``fd_offset`` (``source.supports_fd``)."""

    def step(done: int) -> None:
        source.read_into_fd(offset + done, length - done, fd, fd_offset + done)

    _retrying(source.display_uri, offset, length, step, policy, on_retry)


def read_range_pieces(
    source: Source,
    offset: int,
    bufs: Sequence[memoryview],
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
) -> None:
    """Like :func:`read_range` for one range landed in several buffers in turn (a chunk of neighbouring
    tensors, each in its own slot): one request, and a retry resumes at the byte where the stream broke,
    in whichever buffer that is."""
    views = [byte_view(buf) for buf in bufs]
    scatter = getattr(source, "read_into_pieces", None)

    def step(done: int) -> None:
        rest = views_after(views, done)
        if scatter is not None:
            scatter(offset + done, rest)
        else:  # a source of another shape: one read into a buffer of its own, then copied
            SourceBase.read_into_pieces(source, offset + done, rest)  # type: ignore[arg-type]

    _retrying(source.display_uri, offset, sum(len(v) for v in views), step, policy, on_retry)


def read_range_pieces_into_fd(
    source: Source,
    offset: int,
    fd: int,
    pieces: Sequence[tuple[int, int]],
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
) -> None:
    """Like :func:`read_range_into_fd` for one range written as the ``(fd_offset, length)`` pieces in turn."""
    scatter = getattr(source, "read_into_fd_pieces", None)

    def step(done: int) -> None:
        rest = _after_pieces(pieces, done)
        if scatter is not None:
            scatter(offset + done, fd, rest)
        else:
            SourceBase.read_into_fd_pieces(source, offset + done, fd, rest)  # type: ignore[arg-type]

    _retrying(source.display_uri, offset, sum(n for _, n in pieces), step, policy, on_retry)


def read_range_into_sink(
    source: Source,
    offset: int,
    length: int,
    sink: RangeSink,
    *,
    policy: RetryPolicy,
    on_retry: RetryCallback | None = None,
    window: int = WINDOW,
) -> None:
    """Like :func:`read_range`, handing the bytes to ``sink`` as they arrive (``sink(data, at)``, ``at``
    counted from ``offset`` whatever the retries), at most ``window`` bytes at a time (see
    :func:`~._base.window_size`): one request, and a retry resumes at the first byte the sink has not had."""
    through = getattr(source, "read_into_sink", None)

    def step(done: int) -> None:
        def shifted(data: memoryview, at: int) -> None:
            sink(data, done + at)

        if through is not None:
            through(offset + done, length - done, shifted, window=window)
        else:  # a source of another shape: one read into a buffer of its own
            SourceBase.read_into_sink(source, offset + done, length - done, shifted)  # type: ignore[arg-type]

    _retrying(source.display_uri, offset, length, step, policy, on_retry)


def _after_pieces(pieces: Sequence[tuple[int, int]], done: int) -> list[tuple[int, int]]:
    rest: list[tuple[int, int]] = []
    for at, length in pieces:
        if done >= length:
            done -= length
            continue
        rest.append((at + done, length - done))
        done = 0
    return rest


class _Budget:
    """The retry bookkeeping of one operation: consecutive failures without progress, retries, time."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.started = time.monotonic()
        self.failures = 0
        self.retries = 0

    def delay_after(self, exc: TransientSourceError, *, progressed: bool) -> float | None:
        """The delay before the next try, or None when the policy says to give up."""
        self.failures = 0 if progressed else self.failures + 1
        delay = _delay(self.policy, max(self.failures, 1), exc.retry_after)
        deadline = self.policy.deadline
        if self.failures >= self.policy.attempts or (
            deadline is not None and self.elapsed() + delay > deadline
        ):
            return None
        self.retries += 1
        return delay

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def why(self) -> str:
        if self.failures >= self.policy.attempts:
            return f"{self.failures} tries without progress"
        return f"{self.elapsed():.1f} s"


def _retrying(
    uri: str,
    offset: int,
    length: int,
    step: Callable[[int], None],
    policy: RetryPolicy,
    on_retry: RetryCallback | None,
) -> None:
    budget = _Budget(policy)
    done = 0
    while True:
        try:
            step(done)
            return
        except TransientSourceError as exc:
            landed = exc.landed if isinstance(exc, InterruptedReadError) else 0
            landed = max(0, min(landed, length - done))
            done += landed
            if done >= length:  # the failure came after the last byte (for example while closing)
                return
            delay = budget.delay_after(exc, progressed=landed > 0)
            if delay is None:
                raise InterruptedReadError(
                    f"gave up reading bytes [{offset}, {offset + length}) of {uri} after {budget.why()}"
                    f" ({budget.retries} retries, {done} bytes read): {exc}",
                    uri=uri,
                    landed=done,
                ) from exc
            event = RetryEvent(uri, budget.retries, delay, exc, offset + done, landed, length - done)
            _log.warning(
                "retrying %s at offset %d in %.2f s (retry %d, %d bytes left): %s",
                uri,
                offset + done,
                delay,
                budget.retries,
                length - done,
                exc,
            )
            if on_retry is not None:
                on_retry(event)
            _pause(policy, delay, uri)


def stat_with_prefix(
    source: Source, length: int, *, policy: RetryPolicy, on_retry: RetryCallback | None = None
) -> tuple[ObjectInfo, bytes]:
    """The source's size and validators and its first ``length`` bytes, retrying transient errors under
    ``policy``: one request where the source answers both at once (``SourceBase.stat_with_prefix``)."""
    combined = getattr(source, "stat_with_prefix", None)
    if combined is None:  # a source of another shape: look it up, then read
        info = stat_source(source, policy=policy, on_retry=on_retry)
        head = bytearray(min(length, info.size))
        read_range(source, 0, memoryview(head), policy=policy, on_retry=on_retry)
        return info, bytes(head)
    found: tuple[ObjectInfo, bytes] = _looking_up(source, lambda: combined(length), policy, on_retry)
    return found


def stat_source(
    source: Source, *, policy: RetryPolicy, on_retry: RetryCallback | None = None, fresh: bool = False
) -> ObjectInfo:
    """``source.stat()``, retrying transient errors under ``policy`` (the first request of a load).

    A throttled or briefly unreachable store at start-up then costs a retry, not the load. Permanent errors
    (not found, denied) propagate at once. ``fresh`` bypasses the cached answer (``restat``): the end-of-load
    look-up that checks the object did not change, which a single 500 must not fail either.
    """
    restat = getattr(source, "restat", None)
    look = restat if fresh and restat is not None else source.stat
    info: ObjectInfo = _looking_up(source, look, policy, on_retry)
    return info


def _looking_up(
    source: Source, look: Callable[[], Any], policy: RetryPolicy, on_retry: RetryCallback | None
) -> Any:
    """``look()``, a look-up of ``source``, retried under ``policy`` while it fails transiently."""
    budget = _Budget(policy)
    while True:
        try:
            return look()
        except TransientSourceError as exc:
            delay = budget.delay_after(exc, progressed=False)
            if delay is None:
                raise InterruptedReadError(
                    f"gave up looking up {source.display_uri} after {budget.why()}"
                    f" ({budget.retries} retries): {exc}",
                    uri=source.display_uri,
                ) from exc
            _log.warning(
                "retrying the look-up of %s in %.2f s (retry %d): %s",
                source.display_uri,
                delay,
                budget.retries,
                exc,
            )
            if on_retry is not None:
                on_retry(RetryEvent(source.display_uri, budget.retries, delay, exc, 0, 0, 0))
            _pause(policy, delay, source.display_uri)


def _delay(policy: RetryPolicy, failures: int, retry_after: float | None) -> float:
    """Backoff for this failure, with jitter, never below what the server asked for."""
    base = policy.backoff(failures)
    jittered = base * (1.0 - policy.jitter * random.random())
    return max(jittered, retry_after or 0.0)


def retrying(call: Callable[[], _T], *, policy: RetryPolicy, what: str) -> _T:
    """``call()``, retrying transient source errors under ``policy``: a listing, a manifest, a token. ``what``
    names the request in the log line and in the error that gives up."""
    budget = _Budget(policy)
    while True:
        try:
            return call()
        except TransientSourceError as exc:
            delay = budget.delay_after(exc, progressed=False)
            if delay is None:
                raise InterruptedReadError(
                    f"gave up on the {what} after {budget.why()} ({budget.retries} retries): {exc}",
                    uri=exc.uri,
                ) from exc
            _log.warning("retrying the %s in %.2f s (retry %d): %s", what, delay, budget.retries, exc)
            _pause(policy, delay, what)
