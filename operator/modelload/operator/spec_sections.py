"""The ModelLoad spec's sub-sections: the Secrets it references, each store's options, the sidecar's
overrides and the memory mode.

Each is a frozen dataclass whose fields carry their CRD rules (:func:`~modelload.operator._dataschema.prop`);
:class:`~modelload.operator.schema.ModelLoadSpec` composes them, and the CRD and :func:`~modelload.operator.
schema.parse_spec` are derived from them with the rest of the spec. They live apart from the spec itself so
that the resource's top level (its fields, the rules across them, the parser) reads on one page; the rules
that tie a section to a source's scheme (``gcs`` only for ``gs://``...) stay with the spec.
"""

# ruff: noqa: RUF009 - prop() returns a dataclasses.field carrying the schema rules
from __future__ import annotations

from dataclasses import dataclass

from modelload.operator._dataschema import Quantity, prop

__all__ = [
    "AzureOptions",
    "CredentialsSecretRef",
    "GcsOptions",
    "HeadersSecretRef",
    "HubOptions",
    "HubTokenSecretRef",
    "KeySecretRef",
    "MemoryOptions",
    "PasswordSecretRef",
    "RegistryCredentialsSecretRef",
    "RegistryOptions",
    "S3Options",
    "SidecarOptions",
    "SidecarResources",
]

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"  # noqa: S105 - the pattern of a Secret key name


@dataclass(frozen=True)
class CredentialsSecretRef:
    """A Secret in the ModelLoad's namespace holding the store's credentials, under each cloud's key names:
    S3 keys for s3://, a service-account key (JSON) for gs://, a connection string, SAS token or account
    key for az://. Workload identity (IRSA, GKE Workload Identity, Entra Workload ID) needs no Secret.

    The operator reads it to fetch the model's index; the sidecar gets its keys as environment variables
    (secretKeyRef) or, for a GCS key, as a file mounted in the sidecar only, so the values never enter the
    pod spec, the status or an Event.
    """

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    access_key_id_key: str = prop(
        doc="Key of the access key id in the Secret.", default="AWS_ACCESS_KEY_ID", pattern=SECRET_KEY
    )
    secret_access_key_key: str = prop(
        doc="Key of the secret access key in the Secret.", default="AWS_SECRET_ACCESS_KEY", pattern=SECRET_KEY
    )
    session_token_key: str = prop(
        doc="Key of the optional session token in the Secret (used when present).",
        default="AWS_SESSION_TOKEN",
        pattern=SECRET_KEY,
    )
    service_account_key_key: str = prop(
        doc="gs://: key of the service-account key (the JSON file) in the Secret.",
        default="key.json",
        pattern=SECRET_KEY,
    )
    connection_string_key: str = prop(
        doc="az://: key of a storage connection string in the Secret (the first of the three present is "
        "used).",
        default="AZURE_STORAGE_CONNECTION_STRING",
        pattern=SECRET_KEY,
    )
    sas_token_key: str = prop(
        doc="az://: key of a SAS token in the Secret.", default="AZURE_STORAGE_SAS_TOKEN", pattern=SECRET_KEY
    )
    account_key_key: str = prop(
        doc="az://: key of the storage account key in the Secret.",
        default="AZURE_STORAGE_KEY",
        pattern=SECRET_KEY,
    )


@dataclass(frozen=True)
class HeadersSecretRef:
    """A Secret key holding a bearer token, or HTTP header lines, for a private http(s):// source.

    One line without a colon is a token, sent as ``Authorization: Bearer <token>``; anything else is header
    lines, ``Name: value`` each. The operator sends them when it reads the model's index; the sidecar gets
    the key as a file (mounted in the sidecar only). Both send them to the source's own origin only.
    """

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = prop(
        doc="Key in the Secret holding the token or the header lines.", default="token", pattern=SECRET_KEY
    )


@dataclass(frozen=True)
class KeySecretRef:
    """A Secret key holding the raw 32-byte decryption key of an encrypted model file."""

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = prop(doc="Key in the Secret holding the 32 raw bytes.", default="key", pattern=SECRET_KEY)


@dataclass(frozen=True)
class PasswordSecretRef:
    """A Secret key holding the password an encrypted model file's key is derived from (Argon2id)."""

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = prop(doc="Key in the Secret holding the password.", default="password", pattern=SECRET_KEY)


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store; every field is optional and AWS's defaults apply."""

    endpoint: str | None = prop(
        doc="Endpoint URL of an S3-compatible store (MinIO, Ceph, R2...). Empty means AWS.",
        default=None,
        pattern=r"^https?://[^\s@/]+(/\S*)?$",
    )
    region: str | None = prop(
        doc="Region; empty uses botocore's chain.", default=None, pattern=r"^[a-z0-9-]+$"
    )
    addressing: str = prop(
        doc="Bucket addressing style: auto, path (bucket in the path) or virtual (bucket in the host).",
        default="auto",
        enum=("auto", "path", "virtual"),
    )
    unsigned: bool = prop(doc="Anonymous access to a public bucket: no credentials are sent.", default=False)


@dataclass(frozen=True)
class HubTokenSecretRef:
    """A Secret key holding a Hugging Face user access token, for private and gated ``hf://`` repositories.

    The operator reads it to list the repository; the webhook mounts the key as a file in the sidecar only.
    """

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = prop(doc="Key in the Secret holding the token.", default="token", pattern=SECRET_KEY)


@dataclass(frozen=True)
class HubOptions:
    """How an ``hf://`` source reaches the Hugging Face Hub."""

    endpoint: str | None = prop(
        doc="The Hub, or a mirror of its API (what HF_ENDPOINT names). Empty: https://huggingface.co.",
        default=None,
        pattern=r"^https?://[^\s@/?#]+(/[^\s?#]*)?$",
    )
    token_secret_ref: HubTokenSecretRef | None = prop(
        doc="A token for private and gated repositories, sent to the Hub only (never to its download CDN).",
        default=None,
    )


@dataclass(frozen=True)
class RegistryCredentialsSecretRef:
    """A ``kubernetes.io/dockerconfigjson`` Secret (the kind a pod's ``imagePullSecrets`` names) with
    credentials for the ``oci://`` source's registry. The operator reads it to resolve the artifact; the
    webhook mounts the key as a file in the sidecar only."""

    name: str = prop(doc="Name of the Secret.", pattern=DNS_SUBDOMAIN, max_length=253)
    key: str = prop(
        doc="Key in the Secret holding the Docker config.", default=".dockerconfigjson", pattern=SECRET_KEY
    )


@dataclass(frozen=True)
class RegistryOptions:
    """How an ``oci://`` source reaches its registry."""

    credentials_secret_ref: RegistryCredentialsSecretRef | None = prop(
        doc="Registry credentials (a dockerconfigjson Secret). Empty: anonymous pulls.", default=None
    )
    plain_http: bool = prop(
        doc="Reach the registry over plain HTTP (an in-cluster registry without TLS).", default=False
    )


@dataclass(frozen=True)
class GcsOptions:
    """How to reach Google Cloud Storage; empty uses Google's endpoint."""

    endpoint: str | None = prop(
        doc="JSON API endpoint URL (a private endpoint or an emulator). Empty means Google's.",
        default=None,
        pattern=r"^https?://[^\s@/]+(/\S*)?$",
    )


@dataclass(frozen=True)
class AzureOptions:
    """How to reach Azure Blob Storage; empty uses https://ACCOUNT.blob.core.windows.net."""

    endpoint: str | None = prop(
        doc="The account's blob endpoint URL (a sovereign cloud, a private endpoint, Azurite).",
        default=None,
        pattern=r"^https?://[^\s@/]+(/\S*)?$",
    )


@dataclass(frozen=True)
class SidecarResources:
    """Overrides of the sidecar's computed resources, by resource name (cpu, memory...)."""

    requests: dict[str, Quantity] = prop(doc="Requests that replace the computed ones.", default={})
    limits: dict[str, Quantity] = prop(
        doc="Limits that replace the computed ones. A memory limit must still cover the model (tmpfs pages "
        "are charged to the sidecar that writes them).",
        default={},
    )


@dataclass(frozen=True)
class SidecarOptions:
    """Per-model overrides of the injected loader sidecar."""

    image: str | None = prop(
        doc="Sidecar image; empty uses the operator's default.", default=None, max_length=512
    )
    image_pull_policy: str | None = prop(
        doc="Pull policy of the sidecar image.", default=None, enum=("Always", "IfNotPresent", "Never")
    )
    resources: SidecarResources | None = prop(doc="Resource overrides.", default=None)


@dataclass(frozen=True)
class MemoryOptions:
    """How much host memory a pod keeps for the model: all of it, or only what its app has not copied yet."""

    mode: str = prop(
        doc="full keeps every tensor for the pod's life (CPU apps that use zero-copy views); release gives "
        "each tensor's pages back once every attached process copied it (GPU servers); ring never holds "
        "more than ringSize of the model at once, and sizes the pod's memory from the ring.",
        default="full",
        enum=("full", "release", "ring"),
    )
    ring_size: Quantity | None = prop(
        doc="Ring mode only, and required there: the most tensor bytes held at once (e.g. 2Gi). It must hold "
        "the largest tensor; a few chunks more keep the readers busy while the app copies.",
        default=None,
    )
    wait_timeout_seconds: int | None = prop(
        doc="Ring mode: fail the load when it waits this long for the app to copy tensors and free room. "
        "Empty: wait (the sidecar's /status says for whom).",
        default=None,
        minimum=1,
    )
    consumers: int = prop(
        doc="Processes that must attach before anything is released (tensor-parallel workers).",
        default=1,
        minimum=1,
        maximum=64,
    )
    huge_pages: str | None = prop(
        doc="Put the segment on huge pages of this size (2Mi or 1Gi) from the node's pre-allocated pool: an "
        "emptyDir with medium HugePages-<size> and a hugepages-<size> request and limit on the sidecar, "
        "sized from the model (or the ring). Bytes land faster and at about half the CPU, and the GPU copy "
        "pins them whole. Nodes must pre-allocate them (vm.nr_hugepages, shown in node allocatable); pods "
        "no node can take are reported in the status. Empty: 4 KiB pages (medium Memory).",
        default=None,
        enum=("2Mi", "1Gi"),
    )
    slots: str = prop(
        doc="Where tensors lie in the segment. auto packs a model of thousands of small tensors (a mixture "
        "of experts: pages would pad it by more than 1% and 8 MiB), each tensor right after the one before "
        "it; a loader older than this release cannot read a packed segment. paged keeps every tensor on its "
        "own page, which every loader reads; packed always packs (mode full only).",
        default="auto",
        enum=("auto", "packed", "paged"),
    )
