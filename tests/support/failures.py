"""What a failed load must leave behind, checked the way an app meets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelload.loader import attach
from modelload.loader.errors import LoadFailedError

__all__ = ["assert_load_failed"]


def assert_load_failed(segment: Path, *, match: str | None = None) -> str:
    """A failed load left what an app needs and nothing more: no segment holding memory at the name, and
    ``attach()`` raising LoadFailedError with the reason (from the marker beside it). Returns the reason."""
    assert not segment.exists(), "a failed load leaves no segment holding memory"
    with pytest.raises(LoadFailedError, match=match) as failure:
        attach(segment, timeout=5, notify=False)
    return failure.value.reason
