"""Where the operator's index read may send a cloud credential: an attacker's look at the s3://, gs:// and
az:// reads the operator makes on a ModelLoad author's behalf.

The operator serves every namespace, and reads an s3://, gs:// or az:// model with a ModelLoad's Secret or,
without one, with its own identity. A ModelLoad's author chooses ``spec.s3.endpoint``, ``spec.gcs.endpoint``
or ``spec.azure.endpoint``; if the operator's own AWS session token and signature, Google token, account-key
signature or SAS went there, any author could take the operator's cloud identity (good for every bucket it
reads, in every namespace) to a server of their own. These tests put the author's endpoint in front of the
real servers (a fault proxy that records what it is sent) and give the operator a real identity of its own:
AWS keys with a session token, the GKE metadata server's token, or an Azure connection string and SAS token
in its environment.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from modelload.loader.errors import ConfigError, SourceAccessDeniedError
from modelload.operator.cloud_sources import own_identity_reaches
from modelload.operator.model_source import read_summary
from modelload.operator.schema import parse_spec
from modelload.sidecar.sources import parse_networks
from tests.operator.conftest import LOOPBACK
from tests.sidecar import models
from tests.support.cloud_emulators import Azurite, FakeGcs
from tests.support.fault_proxy import FaultProxy
from tests.support.fixtures import aws_env, azurite, cloud_env, fake_gcs, moto_s3
from tests.support.moto_s3 import Credentials, MotoS3Server
from tests.support.token_endpoints import TokenEndpoints

__all__ = ["aws_env", "azurite", "cloud_env", "fake_gcs", "moto_s3"]

LOOPBACK_NETWORKS = parse_networks(
    LOOPBACK
)  # the emulators listen on loopback, which a ModelLoad may not name

MODEL = models.safetensors_bytes(models.state_dict(layers=1, width=32))


@pytest.fixture
def metadata_server(cloud_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[TokenEndpoints]:
    """The operator runs on GKE with Workload Identity: google-auth gets its token from the metadata
    server (a stand-in on loopback)."""
    server = TokenEndpoints(federated_token="unused-" + "x" * 40)
    host = server.url.removeprefix("http://")
    monkeypatch.setenv("GCE_METADATA_HOST", host)
    monkeypatch.setenv("GCE_METADATA_IP", host)
    # google-auth reads GCE_METADATA_HOST once, when it is first imported: an earlier test's value would stay.
    monkeypatch.setattr("google.auth.compute_engine._metadata._GCE_METADATA_HOST", host)
    monkeypatch.delenv("NO_GCE_CHECK")
    yield server
    server.close()


def test_the_operators_own_aws_identity_never_goes_to_a_modelloads_s3_endpoint(
    moto_s3: MotoS3Server, aws_env: Credentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    session_token = "IQoJb3JpZ2luX2VjOPERATOR" + "t" * 40  # as IRSA's web identity leaves in the chain
    monkeypatch.setenv("AWS_SESSION_TOKEN", session_token)
    uri = moto_s3.put("reach", "model.safetensors", MODEL, public=True)
    with FaultProxy(moto_s3.port) as author:
        spec = parse_spec({"source": uri, "s3": {"endpoint": author.endpoint}})
        summary = read_summary(spec, credentials=None, networks=LOOPBACK_NETWORKS)
        sent = [
            (r.headers.get("authorization"), r.headers.get("x-amz-security-token")) for r in author.requests
        ]
    assert summary.format == "safetensors"
    assert sent and sent == [(None, None)] * len(sent), "unsigned: neither a signature nor the session token"


def test_the_operators_own_google_token_never_goes_to_a_modelloads_endpoint(
    fake_gcs: FakeGcs, metadata_server: TokenEndpoints
) -> None:
    uri = fake_gcs.put("reach", "model.safetensors", MODEL)
    with FaultProxy(fake_gcs.port) as author:
        spec = parse_spec({"source": uri, "gcs": {"endpoint": author.endpoint}})
        summary = read_summary(
            spec, credentials=None, networks=LOOPBACK_NETWORKS
        )  # the emulator serves anonymous reads
        sent = [r.headers.get("authorization") for r in author.requests]
    assert summary.format == "safetensors"
    assert sent and sent == [None] * len(sent)
    assert metadata_server.issued == [], "no token was even fetched for that endpoint"


def test_a_refused_anonymous_read_at_a_modelloads_endpoint_says_why_no_identity_was_sent(
    fake_gcs: FakeGcs, metadata_server: TokenEndpoints
) -> None:
    uri = fake_gcs.put("reach", "denied.safetensors", MODEL)
    refusal = {"error": {"code": 401, "message": "Anonymous caller does not have storage.objects.get access"}}
    from tests.support.fault_proxy import Respond

    with FaultProxy(fake_gcs.port) as author:
        author.always(Respond(401, json.dumps(refusal).encode(), (("Content-Type", "application/json"),)))
        spec = parse_spec({"source": uri, "gcs": {"endpoint": author.endpoint}})
        with pytest.raises(SourceAccessDeniedError, match=r"own identity.*credentialsSecretRef"):
            read_summary(spec, credentials=None, networks=LOOPBACK_NETWORKS)


@pytest.mark.parametrize(
    ("variable", "leak"),
    [("AZURE_STORAGE_CONNECTION_STRING", "authorization"), ("AZURE_STORAGE_SAS_TOKEN", "sig=")],
)
def test_the_operators_own_azure_key_or_sas_never_goes_to_a_modelloads_endpoint(
    azurite: Azurite, cloud_env: None, monkeypatch: pytest.MonkeyPatch, variable: str, leak: str
) -> None:
    uri = azurite.put("reach", "model.safetensors", MODEL)
    own = azurite.connection_string if variable.endswith("STRING") else azurite.sas("reach")
    monkeypatch.setenv(variable, own)
    with FaultProxy(azurite.port) as author:
        endpoint = f"{author.endpoint}/{azurite.account}"
        spec = parse_spec({"source": uri, "azure": {"endpoint": endpoint}})
        with pytest.raises(SourceAccessDeniedError, match=r"own identity.*credentialsSecretRef"):
            read_summary(spec, credentials=None, networks=LOOPBACK_NETWORKS)
        seen: list[Any] = [(r.path, r.headers.get("authorization")) for r in author.requests]
    assert seen, "the read reached the endpoint"
    assert all(authorization is None and "sig=" not in path for path, authorization in seen), leak


@pytest.mark.parametrize(
    ("source", "endpoint", "reaches"),
    [
        ("gs://bkt/m.bin", None, True),
        ("gs://bkt/m.bin", "https://storage.googleapis.com", True),
        ("gs://bkt/m.bin", "https://storage-myendpoint.p.googleapis.com", True),
        ("gs://bkt/m.bin", "http://storage.googleapis.com", False),
        ("gs://bkt/m.bin", "https://storage.googleapis.com.evil.example", False),
        ("gs://bkt/m.bin", "https://gcs.internal:8443", False),
        ("az://acct01/models/m.bin", None, True),
        ("az://acct01/models/m.bin", "https://acct01.blob.core.windows.net", True),
        ("az://acct01/models/m.bin", "https://acct01.blob.core.usgovcloudapi.net", True),
        ("az://acct01/models/m.bin", "https://acct01.z12.blob.storage.azure.net", True),
        ("az://acct01/models/m.bin", "https://blob.core.windows.net.evil.example", False),
        ("az://acct01/models/m.bin", "http://acct01.blob.core.windows.net", False),
        ("az://acct01/models/m.bin", "http://127.0.0.1:10000/devstoreaccount1", False),
        ("s3://bkt/m.bin", None, True),
        ("s3://bkt/m.bin", "https://s3.eu-west-3.amazonaws.com", True),
        ("s3://bkt/m.bin", "https://s3-fips.us-gov-west-1.amazonaws.com", True),
        ("s3://bkt/m.bin", "https://s3.cn-north-1.amazonaws.com.cn", True),
        ("s3://bkt/m.bin", "http://s3.eu-west-3.amazonaws.com", False),
        ("s3://bkt/m.bin", "https://s3.amazonaws.com.evil.example", False),
        ("s3://bkt/m.bin", "https://minio.internal:9000", False),
    ],
)
def test_the_operators_own_identity_reaches_only_the_clouds_own_endpoints(
    source: str, endpoint: str | None, reaches: bool
) -> None:
    key = {"gs": "gcs", "s3": "s3"}.get(source[:2], "azure")
    spec = parse_spec({"source": source, **({key: {"endpoint": endpoint}} if endpoint else {})})
    assert own_identity_reaches(spec) is reaches


def test_a_service_account_key_that_names_its_own_token_service_is_refused_before_any_request(
    fake_gcs: FakeGcs, cloud_env: None
) -> None:
    """A Secret's key names the URL google-auth posts its signed assertion to (``token_uri``): a key written
    by a ModelLoad's author could make the operator post to any address it reaches (the metadata server,
    an in-cluster Service) and echo the answer into the ModelLoad's status. Only Google's token service is
    accepted, as a federation configuration (which names URLs too) is refused."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from modelload.operator.cloud_sources import GcsKey

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .decode()
    )
    with FaultProxy(fake_gcs.port) as inside:
        key = {
            "type": "service_account",
            "client_email": "loader@p.iam.gserviceaccount.com",
            "private_key": pem,
            "token_uri": f"{inside.endpoint}/computeMetadata/v1/instance/service-accounts/default/token",
        }
        source = fake_gcs.put("reach", "k.safetensors", MODEL)
        spec = parse_spec({"source": source, "gcs": {"endpoint": fake_gcs.endpoint}})
        with pytest.raises(ConfigError, match=r"token_uri.*oauth2\.googleapis\.com"):
            read_summary(spec, credentials=None, cloud=GcsKey(json.dumps(key)), networks=LOOPBACK_NETWORKS)
        assert inside.requests == []
