"""Fixtures of the loader tests: in-process sidecars (tests/support), for the mistakes a sidecar reports."""

from __future__ import annotations

from tests.support.sidecars import sidecars

__all__ = ["sidecars"]
