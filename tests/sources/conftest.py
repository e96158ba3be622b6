"""Fixtures of the sources tests: the shared servers, and deterministic payloads."""

from __future__ import annotations

import random

import pytest

from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.support.fixtures import (
    aws_env,
    hub,
    moto_proxy,
    moto_s3,
    nginx,
    nginx_proxy,
    registry,
    s3_registry,
    token_registry,
)

__all__ = [
    "aws_env",
    "hub",
    "moto_proxy",
    "moto_s3",
    "nginx",
    "nginx_proxy",
    "registry",
    "s3_registry",
    "token_registry",
]


def payload(size: int, seed: int = 0) -> bytes:
    """``size`` pseudo-random bytes, the same for the same seed (so a misplaced range never matches)."""
    return random.Random(seed).randbytes(size)


# Fast retries and short stalls keep fault tests well under a second each.
FAST_RETRY = RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=10.0)
FAST_SETTINGS = SourceSettings(http=HttpSettings(connect_timeout=2.0, stall_timeout=0.5), retry=FAST_RETRY)


@pytest.fixture
def fast_settings() -> SourceSettings:
    return FAST_SETTINGS
