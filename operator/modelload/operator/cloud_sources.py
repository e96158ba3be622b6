"""What a gs:// or az:// ModelLoad adds: its Secret's keys, read and checked, and the sidecar's wiring.

Each cloud has its own key names in ``spec.credentialsSecretRef``
(:class:`~.spec_sections.CredentialsSecretRef`):

======  =====================================================  =============================================
scheme  keys read (defaults)                                   in the sidecar
======  =====================================================  =============================================
gs://   ``key.json``: a service-account key                    a file mounted in the sidecar only, named by
                                                               ``GOOGLE_APPLICATION_CREDENTIALS``
az://   ``AZURE_STORAGE_CONNECTION_STRING``,                   the same variables, from the Secret
        ``AZURE_STORAGE_SAS_TOKEN``, ``AZURE_STORAGE_KEY``      (``secretKeyRef``, each optional)
        (the first present is used)
======  =====================================================  =============================================

Without a Secret, each cloud's workload identity applies, in the sidecar as in the operator: GKE Workload
Identity (the pod's ServiceAccount annotated ``iam.gke.io/gcp-service-account``), Entra Workload ID (the
ServiceAccount annotated ``azure.workload.identity/client-id`` and the pod labelled
``azure.workload.identity/use: "true"``). docs/operator.md shows both.

The operator's own identity (its workload identity, or credentials in its environment) serves every
namespace, so it goes only to the cloud's own endpoints (:func:`own_identity_reaches`): with a ModelLoad's
``s3.endpoint``, ``gcs.endpoint`` or ``azure.endpoint`` elsewhere, and no Secret, the operator reads
anonymously (S3 unsigned), and a refusal says to give the read a Secret. Otherwise any ModelLoad's author
could take the operator's token, its AWS session token and signature, account-key signature or SAS token to
a server of their own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from modelload.operator.conditions import named
from modelload.operator.schema import ModelLoadSpec
from modelload.operator.spec_sections import CredentialsSecretRef
from modelload.sidecar.sources import AzureCredentials

__all__ = [
    "GCS_DIR",
    "GCS_VOLUME",
    "CloudCredentials",
    "GcsKey",
    "cloud_env",
    "cloud_mounts",
    "cloud_volumes",
    "own_identity_reaches",
    "read_cloud_credentials",
    "scheme_of",
]

GCS_VOLUME = "modelload-gcs-key"
GCS_DIR = "/var/run/secrets/modelload/gcs"


class GcsKey(str):
    """A service-account key's JSON text; ``repr`` never shows it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "GcsKey(<hidden>)"


CloudCredentials = GcsKey | AzureCredentials


class CloudSecretError(Exception):
    """A cloud Secret without the keys its scheme needs (``reason`` is the condition's reason)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def scheme_of(source: str) -> str:
    return source.split("://", 1)[0].lower() if "://" in source else "file"


AWS_DOMAINS = (".amazonaws.com", ".amazonaws.com.cn")
"""AWS's S3 hosts: regional, FIPS, dual-stack, access points, and the China regions'."""
GOOGLE_DOMAINS = (".googleapis.com",)
"""Google's API hosts: storage.googleapis.com, regional and Private Service Connect endpoints
(``storage-NAME.p.googleapis.com``)."""
AZURE_BLOB_DOMAINS = (
    ".blob.core.windows.net",
    ".blob.core.usgovcloudapi.net",
    ".blob.core.chinacloudapi.cn",
    ".blob.storage.azure.net",
)
"""Azure's blob endpoints: the public, government and China clouds, and DNS-zone endpoints (a private
endpoint keeps the account's public name)."""


def endpoint_of(spec: ModelLoadSpec) -> str | None:
    """The s3://, gs:// or az:// endpoint a ModelLoad names, or None (the cloud's own)."""
    scheme = scheme_of(spec.source)
    if scheme == "s3" and spec.s3 is not None:
        return spec.s3.endpoint or None
    if scheme == "gs" and spec.gcs is not None:
        return spec.gcs.endpoint or None
    if scheme == "az" and spec.azure is not None:
        return spec.azure.endpoint or None
    return None


def own_identity_reaches(spec: ModelLoadSpec) -> bool:
    """Whether the operator may send its own identity where ``spec`` points: the cloud's own endpoint, or
    one of its HTTPS hosts (see the module docstring)."""
    endpoint = endpoint_of(spec)
    if endpoint is None:
        return True
    parts = urlsplit(endpoint)
    host = (parts.hostname or "").lower().rstrip(".")
    scheme = scheme_of(spec.source)
    if scheme == "s3":
        return parts.scheme == "https" and host.endswith(AWS_DOMAINS)
    domains = GOOGLE_DOMAINS if scheme == "gs" else AZURE_BLOB_DOMAINS
    return parts.scheme == "https" and host.endswith(domains)


def read_cloud_credentials(
    spec: ModelLoadSpec, data: Mapping[str, bytes], *, secret: str
) -> CloudCredentials | None:
    """The credentials a gs:// or az:// ModelLoad's Secret holds; None for other schemes. Raises
    :class:`CloudSecretError` naming the keys expected (never a value)."""
    ref = spec.credentials_secret_ref
    if ref is None:
        return None
    scheme = scheme_of(spec.source)
    if scheme == "gs":
        return _gcs_key(ref, data, secret)
    if scheme == "az":
        return _azure(ref, data, secret)
    return None


def _text(value: bytes, secret: str, key: str) -> str:
    try:
        return value.decode().strip()
    except UnicodeDecodeError:
        raise CloudSecretError("BadCredentials", f"the Secret {secret!r} key {key!r} is not text") from None


def _gcs_key(ref: CredentialsSecretRef, data: Mapping[str, bytes], secret: str) -> GcsKey:
    key = ref.service_account_key_key
    if key not in data:
        raise CloudSecretError(
            "SecretKeyMissing",
            f"the Secret {secret!r} has no key {key!r} (a gs:// source's service-account key); it has: "
            f"{named(data)}. Create it with kubectl create secret generic {secret} "
            f"--from-file={key}=KEY.json, set credentialsSecretRef.serviceAccountKeyKey, or drop the Secret "
            "and use GKE Workload Identity",
        )
    text = _text(data[key], secret, key)
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if not isinstance(info, dict) or info.get("type") != "service_account":
        raise CloudSecretError(
            "BadCredentials",
            f"the Secret {secret!r} key {key!r} is not a service-account key (a JSON file of type "
            "service_account, as `gcloud iam service-accounts keys create` writes)",
        )
    return GcsKey(text)


def _azure(ref: CredentialsSecretRef, data: Mapping[str, bytes], secret: str) -> AzureCredentials:
    keys = (ref.connection_string_key, ref.sas_token_key, ref.account_key_key)
    for key, field in zip(keys, ("connection_string", "sas_token", "account_key"), strict=True):
        if key in data and data[key].strip():
            return AzureCredentials(**{field: _text(data[key], secret, key)})
    raise CloudSecretError(
        "SecretKeyMissing",
        f"the Secret {secret!r} has none of the keys {', '.join(repr(k) for k in keys)} (an az:// source's "
        f"connection string, SAS token or account key); it has: {named(data)}. "
        "Create one, or drop the Secret and use Entra Workload ID",
    )


# --- the sidecar's wiring -----------------------------------------------------------------------------


def _secret_env(name: str, secret: str, key: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}


def cloud_env(spec: ModelLoadSpec) -> list[dict[str, Any]]:
    """The sidecar's variables for a gs:// or az:// source: the endpoint, and where its credentials are."""
    scheme, ref = scheme_of(spec.source), spec.credentials_secret_ref
    env: list[dict[str, Any]] = []
    if scheme == "gs":
        if spec.gcs is not None and spec.gcs.endpoint:
            env.append({"name": "MODELLOAD_GCS_ENDPOINT", "value": spec.gcs.endpoint})
        if ref is not None:
            path = f"{GCS_DIR}/{ref.service_account_key_key}"
            env.append({"name": "GOOGLE_APPLICATION_CREDENTIALS", "value": path})
    elif scheme == "az":
        if spec.azure is not None and spec.azure.endpoint:
            env.append({"name": "MODELLOAD_AZURE_ENDPOINT", "value": spec.azure.endpoint})
        if ref is not None:
            env += [
                _secret_env("AZURE_STORAGE_CONNECTION_STRING", ref.name, ref.connection_string_key),
                _secret_env("AZURE_STORAGE_SAS_TOKEN", ref.name, ref.sas_token_key),
                _secret_env("AZURE_STORAGE_KEY", ref.name, ref.account_key_key),
            ]
    return env


def cloud_volumes(spec: ModelLoadSpec, *, mode: int) -> list[dict[str, Any]]:
    """The GCS key's Secret volume (the one key), for a gs:// source with a Secret."""
    ref = spec.credentials_secret_ref
    if ref is None or scheme_of(spec.source) != "gs":
        return []
    key = ref.service_account_key_key
    items = [{"key": key, "path": key}]
    return [{"name": GCS_VOLUME, "secret": {"secretName": ref.name, "items": items, "defaultMode": mode}}]


def cloud_mounts(spec: ModelLoadSpec) -> list[dict[str, Any]]:
    """Where the sidecar (only) mounts the GCS key."""
    if spec.credentials_secret_ref is None or scheme_of(spec.source) != "gs":
        return []
    return [{"name": GCS_VOLUME, "mountPath": GCS_DIR, "readOnly": True}]
