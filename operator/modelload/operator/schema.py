"""The ModelLoad resource, declared once: its spec and status as dataclasses that are also its CRD schema.

``python -m modelload.operator.crd --write`` renders these classes into the CustomResourceDefinition (in
``manifests/crd/`` and the chart); the operator and the webhook parse a resource's ``spec`` with
:func:`parse_spec`, which applies the same defaults and rules. Change a field here, regenerate, and the
check in ``make check`` keeps the YAML honest.

A ModelLoad names one model file and says how pods get it::

    apiVersion: modelload.dev/v1alpha1
    kind: ModelLoad
    metadata: {name: llama-8b, namespace: serving}
    spec:
      source: s3://models/llama-8b.tensors
      credentialsSecretRef: {name: s3-reader}
      s3: {endpoint: "https://minio.storage:9000", addressing: path}

Pods opt in with the label ``modelload.dev/model: llama-8b``.
"""

# ruff: noqa: RUF009 - prop() returns a dataclasses.field carrying the schema rules
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modelload.loader.errors import ConfigError, SourceUriError
from modelload.loader.sizes import parse_size
from modelload.operator._dataschema import Quantity, dump, openapi, parse, prop
from modelload.operator.quantity import parse_bytes

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "MODEL_LABEL",
    "PLURAL",
    "VERSION",
    "Condition",
    "AzureOptions",
    "CredentialsSecretRef",
    "GcsOptions",
    "FleetStatus",
    "HeadersSecretRef",
    "HubOptions",
    "HubTokenSecretRef",
    "KeySecretRef",
    "MemoryOptions",
    "ModelLoadSpec",
    "ModelLoadStatus",
    "PasswordSecretRef",
    "PodsStatus",
    "RegistryCredentialsSecretRef",
    "RegistryOptions",
    "S3Options",
    "SidecarOptions",
    "SidecarResources",
    "parse_spec",
    "spec_schema",
    "status_schema",
]

GROUP = "modelload.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ModelLoad"
PLURAL = "modelloads"
SINGULAR = "modelload"
SHORT_NAMES = ("ml",)
MODEL_LABEL = "modelload.dev/model"
"""The label a pod carries to ask for a model; its value is the ModelLoad's name (or its podLabelValue)."""

SOURCE_PATTERN = (
    r"^(s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]/\S+"
    r"|gs://[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]/\S*"
    r"|az://[a-z0-9]{3,24}/(\$root|[a-z0-9](-?[a-z0-9])*)/\S*"
    r"|https?://[^\s/@?#]+/\S*"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._\-]*/[A-Za-z0-9][A-Za-z0-9._\-]*(@[^\s/?#]+)?(/[^\s?#]*)?"
    r"|oci://[^\s/@?#]+/[a-z0-9][^\s?#]*"
    r"|file:///\S+)$"
)
"""s3://bucket/key, gs://bucket/object, az://account/container/blob (a prefix ending in / for a directory),
http(s)://host/path (no user:password@: credentials belong in a Secret), hf://ORG/NAME[@REVISION][/PATH],
oci://REGISTRY/REPOSITORY[:TAG][@DIGEST], file:///path. The sources layer's parsers accept the same forms
(tests/operator/test_cloud_sources.py and test_hub_and_registry_sources.py check both agree)."""
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
SECRET_KEY = r"^[-._a-zA-Z0-9]+$"  # noqa: S105 - the pattern of a Secret key name
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
CHUNK_SIZE = r"^[1-9][0-9]*(B|[KMG]i|[KMG]iB)?$"
"""Bytes, or binary units as ``ringSize`` and every Kubernetes quantity write them (``32Mi``); the older
``32MiB`` is still read."""
MIN_CHUNK = 1 << 20  # the sidecar's own bounds: 1MiB to 1GiB
MAX_CHUNK = 1 << 30


# --- spec --------------------------------------------------------------------------------------------------


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


@dataclass(frozen=True)
class ModelLoadSpec:
    """Where a model's weights live, how to read them, and which pods get them."""

    source: str = prop(
        doc="The model: a weight file (s3://bucket/key, gs://bucket/object, az://account/container/blob, "
        "http(s)://host/path or file:///path) or a model directory of shards with its config and tokenizer "
        "(an S3, GCS or Azure prefix or an HTTP(S) base URL ending in /, a Hugging Face repository "
        "hf://ORG/NAME[@REVISION], an OCI artifact oci://REGISTRY/REPOSITORY:TAG or @sha256:DIGEST, or a "
        "local directory). file:// is read by the operator from its own filesystem, and by the sidecar from "
        "its own.",
        pattern=SOURCE_PATTERN,
        max_length=2048,
        error=SourceUriError,
        hint="s3://bucket/key (bucket: 3-63 lower-case letters, digits, dots, dashes), gs://bucket/object, "
        "az://account/container/blob (account: 3-24 lower-case letters and digits), http(s)://host/path "
        "without user:password@ (credentials belong in a Secret), hf://ORG/NAME[@REVISION], "
        "oci://REGISTRY/REPOSITORY:TAG, or file:///path",
    )
    format: str = prop(
        doc="File format; auto detects tensorizer or safetensors from the first bytes.",
        default="auto",
        enum=("auto", "tensorizer", "safetensors"),
    )
    credentials_secret_ref: CredentialsSecretRef | None = prop(
        doc="The store's credentials (S3 keys, a GCS service-account key, an Azure connection string, SAS "
        "token or account key). Leave empty to use the pod's identity (IRSA, GKE Workload Identity, Entra "
        "Workload ID) or a public bucket. An http(s):// source takes headersSecretRef instead.",
        default=None,
    )
    headers_secret_ref: HeadersSecretRef | None = prop(
        doc="A bearer token or header lines for a private http(s):// source (an artifact server, a hub's "
        "gated model), sent to the source's own host only and mounted as a file in the sidecar only.",
        default=None,
    )
    decryption_key_secret_ref: KeySecretRef | None = prop(
        doc="The raw 32-byte key of an encrypted file, mounted as a file in the sidecar only.", default=None
    )
    password_secret_ref: PasswordSecretRef | None = prop(
        doc="A password for an encrypted file's derived key, mounted as a file in the sidecar only.",
        default=None,
    )
    s3: S3Options | None = prop(doc="S3 endpoint, region and addressing.", default=None)
    gcs: GcsOptions | None = prop(doc="gs:// only: the GCS endpoint.", default=None)
    azure: AzureOptions | None = prop(doc="az:// only: the blob endpoint.", default=None)
    hub: HubOptions | None = prop(
        doc="Hugging Face Hub endpoint and token, for an hf:// source.", default=None
    )
    registry: RegistryOptions | None = prop(
        doc="Registry credentials and transport, for an oci:// source.", default=None
    )
    readers: int = prop(doc="Parallel range readers in the sidecar.", default=8, minimum=1, maximum=256)
    chunk_size: str = prop(
        doc="Bytes per range request, 1Mi to 1Gi: a number with an optional Ki, Mi or Gi suffix, as ringSize "
        "(KiB, MiB and GiB are read too).",
        default="32Mi",
        pattern=CHUNK_SIZE,
        hint="a number of bytes with an optional Ki, Mi or Gi suffix, e.g. 32Mi",
    )
    verify_hashes: bool = prop(doc="Check the file's own hashes while loading.", default=True)
    priority: list[str] = prop(
        doc="Tensor names or name prefixes to load first, in this order; the rest follow in file order.",
        default=[],
        max_items=4096,
        item_pattern=r"^[^,]+$",
        hint="a tensor name or prefix without commas",
        item_max_length=1024,
    )
    files: list[str] = prop(
        doc="A directory's file names, for an HTTP(S) directory that has neither "
        "model.safetensors.index.json nor model.safetensors (a web server cannot be listed). Empty: list it.",
        default=[],
        max_items=4096,
        item_pattern=r"^[^,/\\]+$",
        hint="a plain file name, without commas or slashes",
        item_max_length=255,
    )
    pod_label_value: str | None = prop(
        doc="The value of the modelload.dev/model label that selects pods for this model. Default: the "
        "ModelLoad's name.",
        default=None,
        pattern=LABEL_VALUE,
        max_length=63,
    )
    containers: list[str] = prop(
        doc="Containers that get the model's volume and environment. Empty: every container. A pod's "
        "annotation modelload.dev/containers (comma-separated) takes precedence.",
        default=[],
        max_items=64,
        item_pattern=DNS_LABEL,
        hint="a container name (lower-case letters, digits and dashes)",
        item_max_length=63,
    )
    sidecar: SidecarOptions | None = prop(doc="Sidecar image and resource overrides.", default=None)
    volume_size_limit: Quantity | None = prop(
        doc="sizeLimit of the memory-backed volume. Default: the model's bytes plus alignment and headroom "
        "(ring mode: the ring plus headroom). A value below what the model needs is refused.",
        default=None,
    )
    memory: MemoryOptions | None = prop(
        doc="Memory mode: keep the model (full, the default), release what the app copied, or a ring.",
        default=None,
    )
    peers: bool = prop(
        doc="Let this model's sidecars serve each other: each takes chunks from pods that hold them and "
        "reads the origin only for the rest. The operator creates a headless Service and a token Secret "
        "named <name>-peers. Encrypted models always read the origin.",
        default=False,
    )


_HTTP_SOURCE = "(self.source.startsWith('http://') || self.source.startsWith('https://'))"
_HUB_OR_REGISTRY = "(self.source.startsWith('hf://') || self.source.startsWith('oci://'))"
CREDENTIALS_ON_HUB = (
    "credentialsSecretRef holds S3 keys: an hf:// source takes hub.tokenSecretRef, an oci:// source "
    "registry.credentialsSecretRef (a dockerconfigjson Secret)"
)
HUB_OFF_HF = "hub is for hf:// sources"
REGISTRY_OFF_OCI = "registry is for oci:// sources"
CREDENTIALS_ON_HTTP = (
    "credentialsSecretRef holds S3 keys and an http(s):// source does not use them: put the token (or header "
    "lines) in a Secret and reference it with headersSecretRef"
)
HEADERS_OFF_HTTP = (
    "headersSecretRef is for http(s):// sources: an s3:// source takes credentialsSecretRef, a file:// "
    "source needs none"
)
SPEC_RULES: tuple[tuple[str, str], ...] = (
    (
        "!(has(self.decryptionKeySecretRef) && has(self.passwordSecretRef))",
        "set decryptionKeySecretRef or passwordSecretRef, not both",
    ),
    (f"!(has(self.credentialsSecretRef) && {_HTTP_SOURCE})", CREDENTIALS_ON_HTTP),
    (f"!has(self.headersSecretRef) || {_HTTP_SOURCE}", HEADERS_OFF_HTTP),
    ("!has(self.gcs) || self.source.startsWith('gs://')", "gcs options are for gs:// sources"),
    ("!has(self.azure) || self.source.startsWith('az://')", "azure options are for az:// sources"),
    (f"!(has(self.credentialsSecretRef) && {_HUB_OR_REGISTRY})", CREDENTIALS_ON_HUB),
    ("!has(self.hub) || self.source.startsWith('hf://')", HUB_OFF_HF),
    ("!has(self.registry) || self.source.startsWith('oci://')", REGISTRY_OFF_OCI),
    (
        "!has(self.memory) || "
        "(has(self.memory.mode) && self.memory.mode == 'ring') == has(self.memory.ringSize)",
        "memory.ringSize is set exactly when memory.mode is ring",
    ),
)
MIN_RING = 1 << 20


def parse_spec(data: Any) -> ModelLoadSpec:
    """A ModelLoad's ``spec`` as a typed object, with defaults applied and every rule checked.

    Raises :class:`~modelload.loader.errors.ConfigError` naming the field and what is wrong.
    """
    spec = parse(ModelLoadSpec, data, path="spec")
    chunk = parse_size(spec.chunk_size)
    if not MIN_CHUNK <= chunk <= MAX_CHUNK:
        raise ConfigError(f"spec.chunkSize: {spec.chunk_size} is outside 1MiB to 1GiB (the sidecar's bounds)")
    if spec.decryption_key_secret_ref is not None and spec.password_secret_ref is not None:
        raise ConfigError("spec: set decryptionKeySecretRef or passwordSecretRef, not both")
    http = spec.source.startswith(("http://", "https://"))
    if http and spec.credentials_secret_ref is not None:
        raise ConfigError(f"spec.credentialsSecretRef: {CREDENTIALS_ON_HTTP}")
    if not http and spec.headers_secret_ref is not None:
        raise ConfigError(f"spec.headersSecretRef: {HEADERS_OFF_HTTP}")
    if spec.gcs is not None and not spec.source.startswith("gs://"):
        raise ConfigError("spec.gcs: gcs options are for gs:// sources")
    if spec.azure is not None and not spec.source.startswith("az://"):
        raise ConfigError("spec.azure: azure options are for az:// sources")
    _check_hub_or_registry(spec)
    memory = spec.memory
    if memory is not None:
        if (memory.mode == "ring") != (memory.ring_size is not None):
            raise ConfigError("spec.memory: set ringSize with mode ring (and only then), e.g. ringSize: 2Gi")
        if memory.ring_size is not None and parse_bytes(memory.ring_size) < MIN_RING:
            raise ConfigError(
                f"spec.memory.ringSize: {memory.ring_size} is below 1Mi; it must hold the largest tensor"
            )
    return spec


def _check_hub_or_registry(spec: ModelLoadSpec) -> None:
    """The hf:// and oci:// rules, and their URIs parsed by the sidecar's own parsers (what the pattern
    cannot say: a tag's characters, a digest's length, a revision's encoding)."""
    from modelload.sidecar.sources import parse_hub_uri, parse_oci_uri

    hub, oci = spec.source.startswith("hf://"), spec.source.startswith("oci://")
    if (hub or oci) and spec.credentials_secret_ref is not None:
        raise ConfigError(f"spec.credentialsSecretRef: {CREDENTIALS_ON_HUB}")
    if spec.hub is not None and not hub:
        raise ConfigError(f"spec.hub: {HUB_OFF_HF}")
    if spec.registry is not None and not oci:
        raise ConfigError(f"spec.registry: {REGISTRY_OFF_OCI}")
    try:
        if hub:
            parse_hub_uri(spec.source)
        if oci:
            parse_oci_uri(spec.source)
    except SourceUriError as exc:
        raise SourceUriError(str(exc), setting="spec.source") from None


def spec_schema() -> dict[str, Any]:
    schema = openapi(ModelLoadSpec)
    schema["x-kubernetes-validations"] = [{"rule": rule, "message": msg} for rule, msg in SPEC_RULES]
    return schema


# --- status ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """One observation about the resource, in the Kubernetes convention (metav1.Condition)."""

    type: str = prop(
        doc="Ready (the model's index was read), PodsReady (every injected pod loaded it) or PodsScheduled "
        "(False while injected pods wait for a node that can take them)."
    )
    status: str = prop(doc="True, False or Unknown.", enum=("True", "False", "Unknown"))
    reason: str = prop(doc="A CamelCase reason: Resolved, BadSource, SecretNotFound, SourceUnreadable...")
    last_transition_time: str = prop(doc="When the status last changed.", format="date-time")
    message: str = prop(doc="What happened and what to do, for people.", default="", max_length=32768)
    observed_generation: int | None = prop(doc="The generation this condition describes.", default=None)


@dataclass(frozen=True)
class PodsStatus:
    """The pods that asked for this model, as their sidecars report through the pods' own status."""

    injected: int = prop(doc="Pods carrying the sidecar and not terminating.", default=0, minimum=0)
    serving: int = prop(
        doc="With spec.peers: pods whose sidecar runs and serves what it holds to the other pods (loading "
        "ones included).",
        default=0,
        minimum=0,
    )
    loading: int = prop(
        doc="Pods whose sidecar runs and has not loaded every tensor yet.", default=0, minimum=0
    )
    ready: int = prop(doc="Pods whose sidecar reports every tensor in.", default=0, minimum=0)
    failed: int = prop(
        doc="Pods whose sidecar crashed, cannot start, or whose pod failed.", default=0, minimum=0
    )
    unschedulable: int = prop(
        doc="Pending pods no node can take (for example none with enough free huge pages); the "
        "PodsScheduled condition says why.",
        default=0,
        minimum=0,
    )
    last_load_seconds: float | None = prop(
        doc="Seconds from sidecar start to pod Ready for the most recent pod that got ready.", default=None
    )
    median_load_seconds: float | None = prop(doc="Median of that time over the ready pods.", default=None)
    last_throughput_bytes_per_second: int | None = prop(
        doc="Model bytes divided by lastLoadSeconds.", default=None
    )


@dataclass(frozen=True)
class FleetStatus:
    """With spec.peers: what the serving pods' sidecars moved, summed over the pods serving now."""

    pods: int = prop(doc="Serving pods with an IP that the operator asked for their peer stats.", minimum=0)
    reporting: int = prop(
        doc="Of those, the pods that answered (the others: unreachable, too slow, or refusing the token).",
        minimum=0,
    )
    origin_bytes: int = prop(doc="Tensor bytes the reporting pods read from the origin.", minimum=0)
    peer_bytes: int = prop(doc="Tensor bytes the reporting pods took from peers.", minimum=0)
    served_bytes: int = prop(doc="Bytes the reporting pods served to peers.", minimum=0)
    mismatches: int = prop(
        doc="Tensors from peers that failed verification and were read again from the origin.", minimum=0
    )
    updated: str = prop(
        doc="When these figures last changed (the operator asks every fleet interval and writes on change). "
        "They are the live fleet's: a pod that left stops counting, a restarted sidecar starts at zero.",
        format="date-time",
    )


@dataclass(frozen=True)
class ModelLoadStatus:
    """What the operator found out about the model and the pods that use it."""

    phase: str | None = prop(
        doc="Pending (not read yet), Ready (index read: pods are admitted), Retrying (a transient error, "
        "retried with backoff) or Failed (fix the spec, the Secret or the file).",
        default=None,
        enum=("Pending", "Ready", "Retrying", "Failed"),
    )
    observed_generation: int | None = prop(doc="The spec generation the status describes.", default=None)
    conditions: list[Condition] | None = prop(doc="Ready, PodsReady and PodsScheduled.", default=None)
    format: str | None = prop(doc="The detected format.", default=None, enum=("tensorizer", "safetensors"))
    format_version: int | None = prop(doc="The format's data version.", default=None)
    tensors: int | None = prop(doc="Number of tensors.", default=None, minimum=0)
    bytes: int | None = prop(doc="Bytes of all tensors in memory.", default=None, minimum=0)
    size: str | None = prop(doc="bytes, for people (e.g. 15.0 GiB).", default=None)
    file_bytes: int | None = prop(
        doc="Size of the model's weight files at the source.", default=None, minimum=0
    )
    files: int | None = prop(
        doc="Number of weight files (1 for a single file, the shards of a directory).",
        default=None,
        minimum=0,
    )
    encrypted: bool | None = prop(doc="Whether the file's tensors are encrypted.", default=None)
    segment_bytes: int | None = prop(
        doc="An upper bound of what the sidecar writes in the pod's volume: the segment (data, alignment, "
        "manifest) and, for a directory, its small files.",
        default=None,
        minimum=0,
    )
    volume_size_limit: str | None = prop(
        doc="The sizeLimit the webhook gives the pods' volume.", default=None
    )
    resolved_at: str | None = prop(doc="When the index was last read.", default=None, format="date-time")
    pods: PodsStatus | None = prop(doc="The pods that asked for this model.", default=None)
    fleet: FleetStatus | None = prop(
        doc="With spec.peers: the serving pods' origin bytes against peer bytes.", default=None
    )


def status_schema() -> dict[str, Any]:
    return openapi(ModelLoadStatus)


def dump_status(status: ModelLoadStatus) -> dict[str, Any]:
    """The status as a JSON merge patch body (unset fields are left as they are)."""
    out: dict[str, Any] = dump(status)
    return out
