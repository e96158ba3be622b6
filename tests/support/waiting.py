"""Waiting in tests: on something observable (a state, a status field, a log line), with a deadline.

A test never sleeps and then asserts: on a shared machine the sleep is either too short (a flake) or too long
(a slow suite). It waits for the event it needs with :func:`wait_for`, which returns as soon as the event is
seen and fails, naming what it waited for and what it saw last, when the deadline passes. The deadline only
bounds a broken run; a passing one never reaches it, so deadlines are generous.

:func:`wait_for_async` is the same for ``async`` tests (the operator's, on kopf's event loop): it yields to
the loop between looks instead of blocking it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["wait_for", "wait_for_async"]

T = TypeVar("T")

INTERVAL = 0.01
"""Seconds between looks: short, since a look is cheap and every test waits on one."""


class _Waiting(Generic[T]):
    """One wait: looks at ``predicate`` until it holds, or fails once the deadline passes."""

    def __init__(
        self, predicate: Callable[[], T], timeout: float, what: str, ignoring: tuple[type[BaseException], ...]
    ) -> None:
        self.predicate, self.timeout, self.what, self.ignoring = predicate, timeout, what, ignoring
        self.value: T | None = None
        self._deadline = time.monotonic() + timeout

    def done(self) -> bool:
        """Look once: True when the predicate held (its result is :attr:`value`); AssertionError when
        it still does not and the deadline has passed."""
        try:
            value = self.predicate()
        except self.ignoring as exc:  # not there yet (a server still starting, a file still being written)
            last: object = exc
        else:
            if value:
                self.value = value
                return True
            last = value
        if time.monotonic() >= self._deadline:
            seen = repr(last)
            seen = seen if len(seen) <= 500 else seen[:500] + "..."
            raise AssertionError(
                f"timed out after {self.timeout:g} s waiting for {self.what} (last seen: {seen})"
            )
        return False


def wait_for(
    predicate: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = INTERVAL,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something true, and return that.

    ``what`` says what is awaited ("the sidecar ready"), for the AssertionError raised once ``timeout``
    seconds pass. An exception of a type in ``ignoring`` counts as "not yet"; any other propagates at once.
    """
    waiting = _Waiting(predicate, timeout, what, ignoring)
    while not waiting.done():
        time.sleep(interval)
    return waiting.value  # type: ignore[return-value]  # done() stored a true result


async def wait_for_async(
    predicate: Callable[[], T],
    *,
    timeout: float,
    what: str,
    interval: float = INTERVAL,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """:func:`wait_for` for a coroutine: the event loop runs between looks."""
    waiting = _Waiting(predicate, timeout, what, ignoring)
    while not waiting.done():
        await asyncio.sleep(interval)
    return waiting.value  # type: ignore[return-value]  # done() stored a true result
