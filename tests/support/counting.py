"""Cost measured in operations rather than seconds: names that count the comparisons made with them, for
tests that pin how a look-up scales (a count is the same on a busy machine; a clock is not)."""

from __future__ import annotations

from typing import Any

__all__ = ["CountingName"]


class CountingName(str):
    """A tensor name that counts, in :attr:`calls` (shared by every instance), the equality, ordering and
    prefix tests made with it."""

    calls = 0

    def __eq__(self, other: object) -> bool:
        CountingName.calls += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__

    def __lt__(self, other: str) -> bool:
        CountingName.calls += 1
        return str.__lt__(self, other)

    def startswith(self, *args: Any) -> bool:  # type: ignore[override]
        CountingName.calls += 1
        return str.startswith(self, *args)
