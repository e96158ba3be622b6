"""Fixtures of the sidecar tests: the shared servers and in-process sidecars (tests/support)."""

from __future__ import annotations

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
from tests.support.sidecars import sidecars

__all__ = [
    "aws_env",
    "hub",
    "moto_proxy",
    "moto_s3",
    "nginx",
    "nginx_proxy",
    "registry",
    "s3_registry",
    "sidecars",
    "token_registry",
]
