"""Fixtures of the sidecar tests: the shared servers (tests/support), and small models in both formats."""

from __future__ import annotations

from tests.support.fixtures import aws_env, moto_proxy, moto_s3, nginx, nginx_proxy, sidecars

__all__ = ["aws_env", "moto_proxy", "moto_s3", "nginx", "nginx_proxy", "sidecars"]
