"""The ModelLoad spec parser applies the schema's defaults and rules, and says which field is wrong."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.crd import build_crd
from modelload.operator.schema import parse_spec


def crd_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_a_minimal_spec_gets_every_default() -> None:
    spec = parse_spec({"source": "s3://models/llama.tensors"})
    assert spec.format == "auto"
    assert spec.readers == 8
    assert spec.chunk_size == "32Mi"
    assert spec.verify_hashes is True
    assert spec.priority == []
    assert spec.containers == []
    assert spec.credentials_secret_ref is None
    assert spec.s3 is None


def test_nested_defaults_apply_when_the_parent_is_given() -> None:
    spec = parse_spec({"source": "s3://models/m.safetensors", "credentialsSecretRef": {"name": "creds"}})
    ref = spec.credentials_secret_ref
    assert ref is not None
    assert (ref.access_key_id_key, ref.secret_access_key_key, ref.session_token_key) == (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    )


def test_the_crd_schema_declares_the_same_defaults_the_parser_applies() -> None:
    schema = crd_schema()["properties"]
    assert schema["readers"]["default"] == parse_spec({"source": "s3://bkt/k"}).readers
    assert schema["chunkSize"]["default"] == "32Mi"
    assert schema["verifyHashes"]["default"] is True
    assert schema["credentialsSecretRef"]["properties"]["accessKeyIdKey"]["default"] == "AWS_ACCESS_KEY_ID"
    assert schema["credentialsSecretRef"]["required"] == ["name"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"source": "ftp://host/model"}, "spec.source"),
        ({"source": "https://user:pw@host/model"}, "spec.source"),
        ({"source": "s3://B/key"}, "spec.source"),
        ({"source": "s3://bucket/k", "format": "gguf"}, "spec.format"),
        ({"source": "s3://bucket/k", "readers": 0}, "spec.readers"),
        ({"source": "s3://bucket/k", "readers": "8"}, "spec.readers"),
        ({"source": "s3://bucket/k", "chunkSize": "32MB"}, "spec.chunkSize"),
        (
            {"source": "s3://bucket/k", "chunkSize": "512KiB"},
            "spec.chunkSize: 512KiB is outside 1MiB to 1GiB",
        ),
        ({"source": "s3://bucket/k", "s3": {"addressing": "dns"}}, "spec.s3.addressing"),
        ({"source": "s3://bucket/k", "priority": ["a,b"]}, r"spec.priority\[0\]"),
        ({"source": "s3://bucket/k", "containers": ["Server"]}, r"spec.containers\[0\]"),
        ({"source": "s3://bucket/k", "volumeSizeLimit": "lots"}, "spec.volumeSizeLimit"),
        ({"source": "s3://bucket/k", "sorce": "x"}, "unknown field"),
        ({"format": "auto"}, "spec.source is required"),
        (
            {"source": "s3://bucket/k", "credentialsSecretRef": {}},
            "spec.credentialsSecretRef.name is required",
        ),
    ],
)
def test_a_bad_field_is_named_in_the_error(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_spec(spec)


def test_a_key_and_a_password_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="not both"):
        parse_spec(
            {
                "source": "s3://bucket/k",
                "decryptionKeySecretRef": {"name": "k"},
                "passwordSecretRef": {"name": "p"},
            }
        )


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "s3://models/llama-3.tensors"},
        {"source": "https://huggingface.co/org/model/resolve/main/model.safetensors"},
        {"source": "file:///models/tiny.safetensors", "format": "safetensors"},
        {
            "source": "s3://my.bucket/a/b.tensors",
            "s3": {"endpoint": "http://minio.storage:9000", "addressing": "path", "unsigned": True},
            "sidecar": {"resources": {"requests": {"cpu": 2, "memory": "40Gi"}}},
            "volumeSizeLimit": 21474836480,
            "priority": ["model.embed_tokens", "model.layers.0."],
        },
    ],
)
def test_specs_the_parser_accepts_validate_against_the_crd_schema(spec: dict[str, Any]) -> None:
    parse_spec(spec)
    jsonschema.validate(spec, crd_schema())


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "ftp://host/model"},
        {"source": "s3://bucket/k", "readers": 1000},
        {"source": "s3://bucket/k", "format": "pickle"},
        {"source": "s3://bucket/k", "sidecar": {"resources": {"limits": {"memory": "a lot"}}}},
    ],
)
def test_specs_the_parser_refuses_fail_the_crd_schema_too(spec: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        parse_spec(spec)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(spec, crd_schema())


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"source": "https://models.example.com:99999/llama.safetensors"}, "spec.source"),
        ({"source": "https://models.example.com:https/llama.safetensors"}, "spec.source"),
        ({"source": "https://[::1/llama.safetensors"}, "spec.source"),
        ({"source": "https://models.example.com:99999/llama.safetensors?sig=S3CR3T"}, "spec.source"),
        ({"source": "https://models..example.com/llama.safetensors"}, "spec.source"),
        ({"source": f"https://{'a' * 64}.example.com/llama.safetensors"}, "spec.source"),
        ({"source": "oci://ghcr.io:99999/org/llama:v1"}, "spec.source"),
        ({"source": "s3://models/llama.tensors", "s3": {"endpoint": "http://[minio"}}, "spec.s3.endpoint"),
        ({"source": "az://acct/models/llama", "azure": {"endpoint": "https://[::1"}}, "spec.azure.endpoint"),
        ({"source": "hf://org/llama", "hub": {"endpoint": "https://hub.internal:0x50"}}, "spec.hub.endpoint"),
    ],
)
def test_a_url_the_pattern_lets_through_but_no_reader_can_parse_is_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    # These used to raise urllib's ValueError or the IDNA codec's UnicodeError in the middle of the read: a
    # kopf traceback retried every minute, the ModelLoad without a condition, the webhook's answer a 500.
    with pytest.raises(ConfigError, match=f"^{field}: .*not a usable URL") as refused:
        parse_spec(spec)
    assert "S3CR3T" not in str(refused.value)


@pytest.mark.parametrize(
    "spec",
    [
        {"memory": {"mode": "ring", "ringSize": "1e99999999"}},
        {"volumeSizeLimit": "1e999999999"},
        {"sidecar": {"resources": {"limits": {"memory": "9e99999999"}}}},
    ],
)
def test_a_quantity_too_large_for_any_node_is_a_spec_error_not_an_overflow(spec: dict[str, Any]) -> None:
    from modelload.operator.sizing import SizingDefaults, plan_sizing

    with pytest.raises(ConfigError, match="above"):
        parsed = parse_spec({"source": "s3://models/llama.tensors", **spec})
        plan_sizing(model_bytes=1 << 30, tensors=10, spec=parsed, defaults=SizingDefaults())


SAS_URL = "https://acct.blob.core.windows.net/?sv=2022-11-02&sig=S3CR3T"
"""The Azure portal's "Blob service SAS URL", pasted as the endpoint."""


@pytest.mark.parametrize(
    ("section", "source", "endpoint"),
    [
        ("azure", "az://acct/models/llama/", SAS_URL),
        ("gcs", "gs://models/llama/", "https://gcs.internal/?access_token=S3CR3T"),
        ("s3", "s3://models/llama/", "https://minio.internal/?X-Amz-Signature=S3CR3T"),
    ],
)
def test_an_endpoint_carrying_a_query_string_is_refused_without_repeating_it(
    section: str, source: str, endpoint: str
) -> None:
    # An endpoint reaches the sidecar as a plain variable: a signature in it would sit in clear in every pod.
    spec = {"source": source, section: {"endpoint": endpoint}}
    with pytest.raises(ConfigError, match=f"^spec.{section}.endpoint: .*query string.*Secret") as refused:
        parse_spec(spec)
    assert "S3CR3T" not in str(refused.value)
