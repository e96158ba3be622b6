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
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

__all__ = ["wait_for", "wait_for_async"]

T = TypeVar("T")

INTERVAL = 0.01
"""Seconds between looks: short, since a look is cheap and every test waits on one."""


class _Waiting:
    """One wait's deadline and what it saw last."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout, self.what = timeout, what
        self.value: Any = None
        self._deadline = time.monotonic() + timeout

    def over(self, seen: object) -> bool:
        """True when ``seen`` (the predicate's result, or the ignored error it raised) ends the wait: the
        result is then :attr:`value`. AssertionError when it does not and the deadline has passed."""
        if seen and not isinstance(seen, BaseException):
            self.value = seen
            return True
        if time.monotonic() >= self._deadline:
            shown = repr(seen)
            shown = shown if len(shown) <= 500 else shown[:500] + "..."
            raise AssertionError(
                f"timed out after {self.timeout:g} s waiting for {self.what} (last seen: {shown})"
            )
        return False


def _look(predicate: Callable[[], object], ignoring: tuple[type[BaseException], ...]) -> object:
    try:
        return predicate()
    except ignoring as exc:  # not there yet (a server still starting, a file still being written)
        return exc


async def _look_async(predicate: Callable[[], object], ignoring: tuple[type[BaseException], ...]) -> object:
    try:
        seen = predicate()
        return await seen if inspect.isawaitable(seen) else seen
    except ignoring as exc:
        return exc


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
    waiting = _Waiting(timeout, what)
    while not waiting.over(_look(predicate, ignoring)):
        time.sleep(interval)
    return cast(T, waiting.value)


async def wait_for_async(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float,
    what: str,
    interval: float = INTERVAL,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """:func:`wait_for` in a coroutine: the event loop runs between looks, and ``predicate`` may be a
    coroutine function."""
    waiting = _Waiting(timeout, what)
    while not waiting.over(await _look_async(predicate, ignoring)):
        await asyncio.sleep(interval)
    return cast(T, waiting.value)
