"""The ModelLoad resource, declared once: its names and its spec as dataclasses that are also its CRD schema.

``python -m modelload.operator.crd --write`` renders these classes into the CustomResourceDefinition (in
``manifests/crd/`` and the chart); the operator and the webhook parse a resource's ``spec`` with
:func:`parse_spec`, which applies the same defaults and rules. Change a field here, regenerate, and the
check in ``make check`` keeps the YAML honest. The spec's sub-sections (Secret references, each store's
options, the sidecar and memory options) are in :mod:`modelload.operator.spec_sections`; the status is
:mod:`modelload.operator.status`.

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
from urllib.parse import urlsplit

from modelload.loader.errors import ConfigError, SourceUriError
from modelload.loader.sizes import parse_size
from modelload.operator._dataschema import Quantity, openapi, parse, prop
from modelload.operator.quantity import parse_bytes
from modelload.operator.spec_sections import (
    AzureOptions,
    CredentialsSecretRef,
    GcsOptions,
    HeadersSecretRef,
    HubOptions,
    KeySecretRef,
    MemoryOptions,
    PasswordSecretRef,
    RegistryOptions,
    S3Options,
    SidecarOptions,
)

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "MODEL_LABEL",
    "PLURAL",
    "VERSION",
    "ModelLoadSpec",
    "parse_spec",
    "spec_schema",
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
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
CHUNK_SIZE = r"^[1-9][0-9]*(B|[KMG]i|[KMG]iB)?$"
"""Bytes, or binary units as ``ringSize`` and every Kubernetes quantity write them (``32Mi``); the older
``32MiB`` is still read."""
MIN_CHUNK = 1 << 20  # the sidecar's own bounds: 1MiB to 1GiB
MAX_CHUNK = 1 << 30


# --- spec --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelLoadSpec:
    """Where a model's weights live, how to read them, and which pods get them."""

    source: str = prop(
        doc="The model: a weight file (s3://bucket/key, gs://bucket/object, az://account/container/blob, "
        "http(s)://host/path or file:///path) or a model directory of shards with its config and tokenizer "
        "(an S3, GCS or Azure prefix or an HTTP(S) base URL ending in /, a Hugging Face repository "
        "hf://ORG/NAME[@REVISION], an OCI artifact oci://REGISTRY/REPOSITORY:TAG or @sha256:DIGEST, or a "
        "local directory). file:// names a file in the pods' own filesystem (an image, a volume): the "
        "sidecar reads it there, the operator never reads it, so such a model needs volumeSizeLimit.",
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
        "named <name>-peers (with a digest of the name instead, for a name with a dot, a leading digit or "
        "over 57 characters, which a Service's name cannot be). Encrypted models always read the origin.",
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
    (
        "!has(self.memory) || !has(self.memory.slots) || !has(self.memory.mode) || "
        "self.memory.slots == 'auto' || self.memory.slots == 'paged' || self.memory.mode == 'full'",
        "memory.slots packed is for memory.mode full: release and ring give each tensor's pages back",
    ),
)
MIN_RING = 1 << 20


def parse_spec(data: Any) -> ModelLoadSpec:
    """A ModelLoad's ``spec`` as a typed object, with defaults applied and every rule checked.

    Raises :class:`~modelload.loader.errors.ConfigError` naming the field and what is wrong.
    """
    _check_source_shape(data)
    spec = parse(ModelLoadSpec, data, path="spec")
    if any(ord(c) < 32 or ord(c) == 127 for c in spec.source):
        raise SourceUriError(
            "holds a control character (a NUL byte, a newline): no object is named that way; check how the"
            " source was written or templated",
            setting="spec.source",
        )
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
    _check_urls(spec)
    memory = spec.memory
    if memory is not None:
        if (memory.mode == "ring") != (memory.ring_size is not None):
            raise ConfigError("spec.memory: set ringSize with mode ring (and only then), e.g. ringSize: 2Gi")
        if memory.slots == "packed" and memory.mode != "full":
            raise ConfigError(
                f"spec.memory.slots: packed is for mode full; mode {memory.mode} gives tensors' pages back"
            )
        if memory.ring_size is not None and parse_bytes(memory.ring_size) < MIN_RING:
            raise ConfigError(
                f"spec.memory.ringSize: {memory.ring_size} is below 1Mi; it must hold the largest tensor"
            )
    return spec


def _check_source_shape(data: Any) -> None:
    """A source of a scheme the sidecar reads, in a shape its store cannot read (``hf://org``, ``gs://b``, a
    Hugging Face web page), is refused with that store's own message, which says what to write, rather than
    the pattern's list of every form."""
    source = data.get("source") if isinstance(data, dict) else None
    if not isinstance(source, str) or source.startswith("file://"):
        return
    if source.startswith(("http://", "https://", "oci://")):
        _check_url(source, setting="spec.source", error=SourceUriError)
    from modelload.sidecar.sources import store_for

    try:
        store = store_for(source)
    except SourceUriError:
        return  # a scheme no store serves: the pattern's message lists them
    try:
        store.check(source)
    except SourceUriError as exc:
        raise SourceUriError(exc.detail, setting="spec.source") from None


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


def _check_urls(spec: ModelLoadSpec) -> None:
    """The endpoints, as the readers will split them (the source: :func:`_check_source_shape`). An endpoint
    with a query string (a SAS URL pasted whole, a signature, a token) is refused as a source with one is:
    the endpoint reaches the sidecar as a plain variable, in clear in every pod's spec."""
    for section in ("s3", "gcs", "azure", "hub"):
        endpoint = getattr(getattr(spec, section), "endpoint", None)
        if endpoint is None:
            continue
        setting = f"spec.{section}.endpoint"
        if "?" in endpoint:
            raise ConfigError(
                "carries a query string (a SAS token, a signature or a token?), which would be copied in "
                "clear into every pod's spec: give the endpoint alone, and its credentials in a Secret "
                "(spec.credentialsSecretRef, or spec.hub.tokenSecretRef)",
                setting=setting,
            )
        _check_url(endpoint, setting=setting, error=ConfigError)


def _check_url(url: str, *, setting: str, error: type[ConfigError]) -> None:
    """A port that is no port, a broken IPv6 literal, a host name the IDNA codec refuses (an empty label, one
    over 63 characters) pass the CRD's patterns, and would otherwise raise urllib's or the codec's
    ValueError in the middle of a read: a traceback, not a condition."""
    try:
        parts = urlsplit(url)
        _ = parts.port
        host = parts.hostname or ""
        if host and ":" not in host:  # an IPv6 literal has no labels to encode
            host.encode("idna")
    except ValueError as exc:  # UnicodeError, the IDNA codec's, is a ValueError
        shown = url.split("?", 1)[0]  # a query may hold a signature: never repeated
        raise error(f"{shown!r} is not a usable URL: {exc}", setting=setting) from None


def spec_schema() -> dict[str, Any]:
    schema = openapi(ModelLoadSpec)
    schema["x-kubernetes-validations"] = [{"rule": rule, "message": msg} for rule, msg in SPEC_RULES]
    return schema
