"""pytest fixtures for the shared test servers. Import the ones you use into your area's conftest.py::

    from tests.support.fixtures import aws_env, moto_s3, nginx, nginx_proxy  # noqa: F401

- ``nginx`` (session): :class:`~tests.support.nginx.NginxServer` over a fresh folder; ``nginx.put(name,
  data)`` writes a file and returns its URL; ``nginx.norange_url(name)`` ignores Range; the S3 stand-in is
  ``nginx.s3_endpoint`` with bucket ``nginx.bucket`` (path addressing, auth ignored); when openssl is
  installed, ``nginx.https_url(name)`` serves the folder over HTTPS, trusted with ``nginx.ca_cert``.
- ``moto_s3`` (session): :class:`~tests.support.moto_s3.MotoS3Server`; ``moto_s3.put(bucket, key, data)``
  returns ``s3://bucket/key``. Use a bucket name of your own per test module: the server is shared.
- ``aws_env`` (function): an environment where botocore's chain finds only the test credentials (no
  profiles, no config files, no instance metadata, no endpoint variables); returns the
  :class:`~tests.support.moto_s3.Credentials`. Change them with ``monkeypatch.setenv``.
- ``nginx_proxy`` / ``moto_proxy`` (function): a :class:`~tests.support.fault_proxy.FaultProxy` in front
  of the session's nginx or moto, closed after the test.
- ``sidecars`` (function): ``sidecars(settings, **kwargs)`` builds and starts a
  :class:`~modelload.sidecar.process.Sidecar` in this process (``kwargs``: its keyword arguments); every one
  started is stopped after the test.

A missing nginx or moto skips these tests, or fails them under ``MODELLOAD_REQUIRE_SERVERS=1``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import require

from .fault_proxy import FaultProxy
from .moto_s3 import TEST_CREDENTIALS, Credentials, MotoS3Server
from .nginx import NginxServer, find_nginx, start_nginx
from .tls import find_openssl, self_signed_certificate

__all__ = ["aws_env", "moto_proxy", "moto_s3", "nginx", "nginx_proxy", "sidecars"]

# Variables that would let botocore find credentials, regions or endpoints other than the test's.
_AWS_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
)


@pytest.fixture(scope="session")
def nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxServer]:
    require(find_nginx() is not None, "nginx is not installed (apt-get install nginx-light)")
    tls = self_signed_certificate(tmp_path_factory.mktemp("tls")) if find_openssl() else None
    with start_nginx(tmp_path_factory.mktemp("nginx-root"), tls=tls) as server:
        yield server


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    require(importlib.util.find_spec("moto") is not None, "moto[server] is not installed")
    server = MotoS3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> Credentials:
    for name in _AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    missing = os.path.join(tmp_path_factory.getbasetemp(), "no-aws-config")
    monkeypatch.setenv("AWS_CONFIG_FILE", missing)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", missing)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in TEST_CREDENTIALS.env().items():
        monkeypatch.setenv(name, value)
    return TEST_CREDENTIALS


@pytest.fixture
def nginx_proxy(nginx: NginxServer) -> Iterator[FaultProxy]:
    with FaultProxy(nginx.port) as proxy:
        yield proxy


@pytest.fixture
def moto_proxy(moto_s3: MotoS3Server) -> Iterator[FaultProxy]:
    with FaultProxy(moto_s3.port) as proxy:
        yield proxy


@pytest.fixture
def sidecars() -> Iterator[Callable[..., Any]]:
    from modelload.sidecar.process import Sidecar

    started: list[Sidecar] = []

    def start(settings: Any, **kwargs: Any) -> Sidecar:
        sidecar = Sidecar(settings, **kwargs)
        started.append(sidecar)
        sidecar.start()
        return sidecar

    yield start
    for sidecar in started:
        sidecar.stop()
