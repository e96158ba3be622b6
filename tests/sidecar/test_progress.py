"""The engine's event fan-out: observers get the events they implement, and only real events exist."""

from __future__ import annotations

import pytest


def test_a_misspelled_event_is_an_error_not_a_call_that_reaches_nobody() -> None:
    from modelload.sidecar.progress import EVENTS, LoadTracker, Observers

    seen: list[int] = []

    class Counter:
        def bytes_loaded(self, count: int) -> None:
            seen.append(count)

    fan = Observers(Counter(), LoadTracker())
    fan.bytes_loaded(5)
    assert seen == [5]
    with pytest.raises(AttributeError, match="is not a load event"):
        fan.byte_loaded(5)  # type: ignore[attr-defined]
    assert "tensor_ready" in EVENTS and "memory_changed" in EVENTS
