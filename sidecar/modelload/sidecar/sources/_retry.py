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
from collections.abc import Callable
from dataclasses import dataclass

from modelload.loader.errors import TransientSourceError

from ._base import InterruptedReadError, Source
from ._settings import RetryPolicy

__all__ = ["RetryEvent", "read_range", "read_range_into_fd"]

_log = logging.getLogger("modelload.sidecar.sources")


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

    def step(done: int) -> None:
        source.read_into(offset + done, buf[done:])

    _retrying(source.display_uri, offset, len(buf), step, policy, on_retry)


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


def _retrying(
    uri: str,
    offset: int,
    length: int,
    step: Callable[[int], None],
    policy: RetryPolicy,
    on_retry: RetryCallback | None,
) -> None:
    started = time.monotonic()
    done = 0
    failures = 0  # consecutive failures that landed nothing
    retries = 0
    while True:
        try:
            step(done)
            return
        except TransientSourceError as exc:
            landed = exc.landed if isinstance(exc, InterruptedReadError) else 0
            landed = max(0, min(landed, length - done))
            done += landed
            failures = 0 if landed else failures + 1
            if done >= length:  # the failure came after the last byte (for example while closing)
                return
            delay = _delay(policy, max(failures, 1), exc.retry_after)
            elapsed = time.monotonic() - started
            out_of_time = policy.deadline is not None and elapsed + delay > policy.deadline
            if failures >= policy.attempts or out_of_time:
                why = (
                    f"{failures} tries without progress"
                    if failures >= policy.attempts
                    else f"{elapsed:.1f} s"
                )
                raise InterruptedReadError(
                    f"gave up reading bytes [{offset}, {offset + length}) of {uri} after {why}"
                    f" ({retries} retries, {done} bytes read): {exc}",
                    uri=uri,
                    landed=done,
                ) from exc
            retries += 1
            event = RetryEvent(uri, retries, delay, exc, offset + done, landed, length - done)
            _log.warning(
                "retrying %s at offset %d in %.2f s (retry %d, %d bytes left): %s",
                uri,
                offset + done,
                delay,
                retries,
                length - done,
                exc,
            )
            if on_retry is not None:
                on_retry(event)
            time.sleep(delay)


def _delay(policy: RetryPolicy, failures: int, retry_after: float | None) -> float:
    """Backoff for this failure, with jitter, never below what the server asked for."""
    base = policy.backoff(failures)
    jittered = base * (1.0 - policy.jitter * random.random())
    return max(jittered, retry_after or 0.0)
