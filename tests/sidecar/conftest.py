"""Fixtures of the sidecar tests: the shared servers (tests/support), and small models in both formats."""

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
    sidecars,
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
    "sidecars",
    "token_registry",
]
