"""Fixtures of the sidecar tests: the shared servers and in-process sidecars (tests/support)."""

from __future__ import annotations

from tests.support.fixtures import aws_env, moto_proxy, moto_s3, nginx, nginx_proxy
from tests.support.sidecars import sidecars

__all__ = ["aws_env", "moto_proxy", "moto_s3", "nginx", "nginx_proxy", "sidecars"]
