"""gs:// and az:// ModelLoads: the CRD and the parsers agree, each cloud's Secret keys are read and checked,
the sidecar is wired with them (and nothing of S3's), and the operator's own index read uses them."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonpatch
import jsonschema
import pytest

from modelload.loader.errors import ConfigError, SourceUriError
from modelload.operator.cloud_sources import (
    GCS_DIR,
    CloudSecretError,
    GcsKey,
    read_cloud_credentials,
)
from modelload.operator.injection import SIDECAR_NAME, build_patch
from modelload.operator.model_source import read_summary
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import SPEC_RULES, parse_spec, spec_schema
from modelload.operator.settings import InjectedSidecar
from modelload.sidecar.sources import AzureCredentials, open_source
from tests.operator.conftest import NAMESPACE
from tests.operator.test_private_http import _cel
from tests.operator.test_webhook import pod
from tests.sidecar import models
from tests.support.cloud_emulators import Azurite
from tests.support.fixtures import azurite, cloud_env

__all__ = ["azurite", "cloud_env"]

KEY = '{"type": "service_account", "client_email": "loader@p.iam.gserviceaccount.com", "private_key": "x"}'

URIS = [
    ("gs://models/llama/model.safetensors", True),
    ("gs://models/llama/", True),
    ("gs://my.bucket_name/m.bin", True),
    ("gs://UPPER/m.bin", False),
    ("gs://ab", False),
    ("az://acct01/models/llama/model.safetensors", True),
    ("az://acct01/models/", True),
    ("az://acct01/$root/m.bin", True),
    ("az://Acct/models/m.bin", False),
    ("az://acct01/Models/m.bin", False),
    ("az://acct01/mo--dels/m.bin", False),
    ("az://ab/models/m.bin", False),
]


@pytest.mark.parametrize(("uri", "valid"), URIS)
def test_the_crds_source_pattern_and_the_sources_parsers_agree(
    uri: str, valid: bool, cloud_env: None
) -> None:
    pattern = spec_schema()["properties"]["source"]["pattern"]
    assert bool(re.match(pattern, uri)) == valid
    try:
        open_source(uri).close() if not uri.endswith("/") else None
        parsed = True
    except SourceUriError:
        parsed = False
    except Exception:  # no credentials here: a URI that got past parsing
        parsed = True
    if not uri.endswith("/"):
        assert parsed == valid
    with pytest.raises(ConfigError) if not valid else _nothing():
        parse_spec({"source": uri})


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "gs://models/m.bin", "gcs": {"endpoint": "http://127.0.0.1:4443"}},
        {"source": "s3://models/m.bin", "gcs": {"endpoint": "http://127.0.0.1:4443"}},
        {"source": "az://acct01/models/m.bin", "azure": {"endpoint": "http://127.0.0.1:10000/acct01"}},
        {"source": "gs://models/m.bin", "azure": {"endpoint": "http://127.0.0.1:10000/acct01"}},
        {"source": "az://acct01/models/m.bin", "credentialsSecretRef": {"name": "azure-reader"}},
    ],
)
def test_the_crds_cel_rules_refuse_what_the_parser_refuses(spec: dict[str, Any]) -> None:
    try:
        parse_spec(spec)
        parser_accepts = True
    except ConfigError:
        parser_accepts = False
    assert all(_cel(rule, spec) for rule, _ in SPEC_RULES) == parser_accepts
    jsonschema.validate(spec, spec_schema())


# --- the Secret ---


def test_a_gcs_secret_gives_its_service_account_key() -> None:
    spec = parse_spec({"source": "gs://models/m.bin", "credentialsSecretRef": {"name": "gcs-reader"}})
    key = read_cloud_credentials(spec, {"key.json": KEY.encode()}, secret="gcs-reader")
    assert isinstance(key, GcsKey) and str(key) == KEY and "private_key" not in repr(key)


@pytest.mark.parametrize(
    ("data", "reason", "says"),
    [
        ({"other": b"x"}, "SecretKeyMissing", "has no key 'key.json'"),
        ({"key.json": b"not json"}, "BadCredentials", "not a service-account key"),
        (
            {"key.json": b'{"type": "external_account", "token_url": "http://x"}'},
            "BadCredentials",
            "service_account",
        ),
    ],
)
def test_a_gcs_secret_without_a_service_account_key_is_a_clear_condition(
    data: dict[str, bytes], reason: str, says: str
) -> None:
    spec = parse_spec({"source": "gs://models/m.bin", "credentialsSecretRef": {"name": "gcs-reader"}})
    with pytest.raises(CloudSecretError, match=says) as caught:
        read_cloud_credentials(spec, data, secret="gcs-reader")
    assert caught.value.reason == reason


def test_an_azure_secret_gives_the_first_of_its_keys_present_and_names_them_when_none_is() -> None:
    spec = parse_spec(
        {"source": "az://acct01/models/m.bin", "credentialsSecretRef": {"name": "az", "sasTokenKey": "sas"}}
    )
    found = read_cloud_credentials(spec, {"sas": b"sv=2023&sig=abc", "AZURE_STORAGE_KEY": b"k"}, secret="az")
    assert isinstance(found, AzureCredentials) and found.sas_token == "sv=2023&sig=abc"
    with pytest.raises(
        CloudSecretError, match="'AZURE_STORAGE_CONNECTION_STRING', 'sas', 'AZURE_STORAGE_KEY'"
    ):
        read_cloud_credentials(spec, {"unrelated": b"x"}, secret="az")


# --- the pod ---


def injected(spec: dict[str, Any]) -> dict[str, Any]:
    model = ResolvedModel(name="m", namespace=NAMESPACE, spec=parse_spec(spec), bytes=1 << 30, tensors=10)
    original = pod("m")
    ops = build_patch(pod=original, model=model, sidecar=InjectedSidecar(), native=True)
    return jsonpatch.apply_patch(copy.deepcopy(original), ops)


def _sidecar(patched: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in patched["spec"]["initContainers"] if c["name"] == SIDECAR_NAME)


def test_a_gcs_key_is_a_file_in_the_sidecar_only_named_by_google_application_credentials() -> None:
    patched = injected(
        {
            "source": "gs://models/m.bin",
            "credentialsSecretRef": {"name": "gcs-reader"},
            "gcs": {"endpoint": "https://gcs.internal"},
        }
    )
    sidecar = _sidecar(patched)
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == f"{GCS_DIR}/key.json"
    assert env["MODELLOAD_GCS_ENDPOINT"] == "https://gcs.internal"
    assert not any(name.startswith("AWS_") for name in env)
    volume = next(
        v for v in patched["spec"]["volumes"] if v.get("secret", {}).get("secretName") == "gcs-reader"
    )
    assert volume["secret"]["items"] == [{"key": "key.json", "path": "key.json"}]
    for container in patched["spec"]["containers"]:
        assert all(m["name"] != volume["name"] for m in container.get("volumeMounts", []))


def test_azure_keys_reach_the_sidecar_as_optional_secret_references() -> None:
    sidecar = _sidecar(
        injected({"source": "az://acct01/models/m.bin", "credentialsSecretRef": {"name": "az"}})
    )
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in sidecar["env"] if "valueFrom" in e}
    assert refs == {
        name: {"name": "az", "key": name, "optional": True}
        for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_KEY")
    }


def test_workload_identity_needs_no_secret_and_injects_no_credentials() -> None:
    sidecar = _sidecar(injected({"source": "gs://models/m.bin"}))
    assert not any(e["name"].startswith(("AWS_", "AZURE_", "GOOGLE_")) for e in sidecar["env"])


# --- the operator's own read ---


def test_the_operators_index_read_uses_the_azure_secret(azurite: Azurite, cloud_env: None) -> None:
    tensors = models.state_dict(layers=2, width=64)
    uri = azurite.put("operator-read", "m.safetensors", models.safetensors_bytes(tensors))
    spec = parse_spec({"source": uri, "azure": {"endpoint": azurite.endpoint}})
    summary = read_summary(
        spec, credentials=None, cloud=AzureCredentials(connection_string=azurite.connection_string)
    )
    assert (summary.format, summary.tensors) == ("safetensors", len(tensors))
