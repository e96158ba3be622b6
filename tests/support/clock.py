"""A clock a test moves by hand, for the components that take ``clock=`` (monotonic seconds).

Rates, intervals and ETAs then follow the test's script exactly and at once: a test of "at most once a
second" advances the clock by a second instead of sleeping through one, and cannot flake on a busy machine.
"""

from __future__ import annotations

__all__ = ["FakeClock"]


class FakeClock:
    """Monotonic seconds that only move when :meth:`advance` says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
