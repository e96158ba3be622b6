"""Typed settings of the sources layer, built once at the edge (CLI, operator) and passed down.

Nothing in this package reads ``os.environ`` for its own settings. The one deliberate exception is the S3
source, which hands credentials, region, endpoint and CA bundle resolution to botocore's own chain (env vars,
shared config files, web identity / IRSA, container credentials, instance metadata): that is where users
expect those settings to come from, and it is documented on :class:`S3Settings`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from modelload.loader.errors import ConfigError
from modelload.loader.rules import OneOf, Prefixed, check_fields, rule

from ._headers import RequestHeaders
from ._proxy import ProxySettings

__all__ = [
    "AzureCredentials",
    "AzureSettings",
    "DEFAULT_HUB_ENDPOINT",
    "GcsSettings",
    "HttpSettings",
    "HubSettings",
    "RegistrySettings",
    "RetryPolicy",
    "S3Addressing",
    "S3Credentials",
    "S3Settings",
    "SourceSettings",
]

S3Addressing = Literal["auto", "path", "virtual"]


def _require_positive(name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class HttpSettings:
    """How the HTTP(S) and S3 sources talk to servers.

    ``connect_timeout``: seconds to open a TCP (and TLS) connection; a refused or slow connect is retried by
    the retry policy. Default 10 s.

    ``stall_timeout``: seconds without a single byte, after which a request counts as stalled and fails as
    a transient error (a resumable one when part of the body arrived). It is the socket timeout, so it
    bounds each wait, not the whole transfer. Default 30 s: long enough for a slow object store's first
    byte, short enough that a stuck reader does not hold the load for minutes.

    ``min_rate`` / ``slow_window``: the slowest a range may come, in bytes per second, measured over windows
    of ``slow_window`` seconds. A range slower than that (one bad connection, a server trickling a few bytes a
    second, which the stall timeout never catches) is given up on its connection and resumed, from the byte
    where it stopped, on a fresh one; the retry policy's deadline bounds a server that is slow every time.
    Defaults 64 KiB/s over 30 s: far below any working link's share per reader, so a healthy slow link is
    not churned. ``min_rate`` 0 turns the check off.

    ``ca_bundle``: a PEM file of CA certificates for HTTPS, for private CAs. ``None`` uses the system store
    (for S3: botocore's ``AWS_CA_BUNDLE`` / ``ca_bundle`` setting when set).

    ``verify_tls``: check the server's certificate and host name. Turn off only for testing.

    ``range_fallback``: when a server ignores Range requests (it answers 200 with the whole object), read the
    wanted bytes from the single stream instead of failing with RangeNotSupportedError. Such an object can
    only be loaded by one reader, from its start; reads at later offsets download and discard the bytes
    before them. Off by default: a silent 8x slowdown is worse than a clear error. A warning is logged.

    ``max_redirects``: how many HTTP redirects (301, 302, 303, 307, 308) to follow, for hubs that redirect
    to a CDN. 0 turns redirects into errors.

    ``headers``: extra headers for a private server (a bearer token, an API key), from a header file or a
    Secret (:func:`~modelload.sidecar.sources.parse_headers`). The plain HTTP(S) source sends them on every
    request to the source URL's origin (scheme, host and port), retries and same-origin redirects included,
    and never to another origin: a redirect to a CDN is followed without them, as a signed redirect URL
    expects. The S3 source ignores them (it signs its own requests). ``repr`` shows the names only.
    """

    connect_timeout: float = 10.0
    stall_timeout: float = 30.0
    min_rate: float = 64 * 1024
    slow_window: float = 30.0
    ca_bundle: str | None = None
    verify_tls: bool = True
    range_fallback: bool = False
    max_redirects: int = 5
    headers: RequestHeaders | None = None
    proxy: ProxySettings | None = None
    """Send origin requests through an HTTP proxy (Dragonfly's dfdaemon, a caching proxy): see ``_proxy``."""

    def __post_init__(self) -> None:
        _require_positive("connect_timeout", self.connect_timeout)
        _require_positive("stall_timeout", self.stall_timeout)
        _require_positive("slow_window", self.slow_window)
        if not (self.min_rate >= 0 and math.isfinite(self.min_rate)):
            raise ConfigError(
                f"min_rate must be 0 or a positive number of bytes per second, got {self.min_rate!r}"
            )
        if self.max_redirects < 0:
            raise ConfigError(f"max_redirects must be 0 or more, got {self.max_redirects}")


@dataclass(frozen=True)
class RetryPolicy:
    """How :func:`read_range` retries transient source errors.

    ``attempts``: tries per range counted without progress: a failure that landed some bytes (a broken
    stream that is then resumed) does not use one up, so a long range over a flaky link still completes,
    while a server that keeps failing before the first byte is given up on after this many tries.
    Default 8 (about a minute of backoff with the defaults below).

    ``initial_backoff`` / ``max_backoff``: the first delay in seconds, doubled after each failed try up to
    the maximum. A server's ``Retry-After`` raises the delay to what it asked for (still bounded by
    ``deadline``).

    ``jitter``: the fraction of each delay that is randomised (0 = none, 1 = anywhere from 0 to the delay),
    so that N readers that failed together do not come back together.

    ``deadline``: seconds after which a range is given up on, whatever ``attempts`` says. ``None`` means no
    overall limit.

    ``stop``: an event that cuts the wait before a retry short (the engine's stop, set on SIGTERM): the read
    then raises :class:`~modelload.sidecar.sources.RetryCancelled` at once instead of sleeping out a
    backoff of up to ``max_backoff`` seconds. ``None``: waits are not interruptible.
    """

    attempts: int = 8
    initial_backoff: float = 0.2
    max_backoff: float = 15.0
    jitter: float = 0.5
    deadline: float | None = 600.0
    stop: threading.Event | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"retry attempts must be at least 1, got {self.attempts}")
        if self.initial_backoff < 0 or self.max_backoff < self.initial_backoff:
            raise ConfigError(
                f"retry backoff needs 0 <= initial ({self.initial_backoff}) <= max ({self.max_backoff})"
            )
        if not 0.0 <= self.jitter <= 1.0:
            raise ConfigError(f"retry jitter must be between 0 and 1, got {self.jitter}")
        if self.deadline is not None:
            _require_positive("retry deadline", self.deadline)

    def backoff(self, failures: int) -> float:
        """The delay after ``failures`` consecutive failures (1 for the first), before jitter."""
        return min(self.max_backoff, self.initial_backoff * (2.0 ** max(0, failures - 1)))


@dataclass(frozen=True)
class S3Credentials:
    """An access key pair (and session token, for temporary credentials) given explicitly, as the operator
    does with a ModelLoad's Secret. The secret parts are left out of ``repr``, and so of logs and errors."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.access_key_id or not self.secret_access_key:
            raise ConfigError("S3 credentials need both an access key id and a secret access key")


@dataclass(frozen=True)
class S3Settings:
    """Where and how to reach S3 or an S3-compatible store.

    ``endpoint_url``: an S3-compatible endpoint (``http(s)://host[:port]``, MinIO, Ceph, R2, CoreWeave...).
    ``None`` lets botocore decide: ``AWS_ENDPOINT_URL_S3``, then ``AWS_ENDPOINT_URL``, then the shared
    config's ``services`` section, then AWS's regional endpoint.

    ``region``: the signing region. ``None`` lets botocore decide (``AWS_DEFAULT_REGION``, the profile's
    ``region``), falling back to us-east-1. botocore does not read ``AWS_REGION``: the CLI maps it (and
    ``MODELLOAD_S3_REGION``) to this field.

    ``addressing``: ``path`` puts the bucket in the path (``endpoint/bucket/key``), ``virtual`` in the host
    name (``bucket.endpoint/key``). ``auto`` uses virtual for AWS endpoints with DNS-safe bucket names
    without dots, and path for everything else (custom endpoints rarely have wildcard DNS; dotted names
    break TLS wildcard certificates).

    ``unsigned``: send requests without an Authorization header, for public buckets; no credentials are
    looked up.

    ``credentials``: explicit keys (:class:`S3Credentials`) instead of botocore's chain, for a caller that
    holds them (the operator, from a Secret) and must not mix them with its own identity.

    Without ``credentials``, they come from botocore's chain (``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the shared files, web identity
    (IRSA), container credentials (EKS Pod Identity), instance metadata), and are refreshed when they expire.
    """

    endpoint_url: str | None = field(
        default=None, metadata=rule(Prefixed(("http://", "https://"), "an http:// or https:// URL"))
    )
    region: str | None = None
    addressing: S3Addressing = field(default="auto", metadata=rule(OneOf(get_args(S3Addressing))))
    unsigned: bool = False
    credentials: S3Credentials | None = None

    def __post_init__(self) -> None:
        if self.unsigned and self.credentials is not None:
            raise ConfigError("S3 access is either unsigned or with credentials, not both")
        check_fields(self)


DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


@dataclass(frozen=True)
class HubSettings:
    """How ``hf://`` sources reach the Hugging Face Hub (or a mirror of its API).

    ``endpoint``: the Hub's base URL, ``https://huggingface.co`` by default; a mirror or a private Hub sets it
    (the sidecar reads ``HF_ENDPOINT``, as the Hub's own client does).

    ``token``: a user access token for private and gated repositories (``HF_TOKEN``, or the file a ModelLoad's
    token Secret is mounted at). It is sent to ``endpoint``'s origin only: a download the Hub redirects to
    its CDN or storage bridge is followed without it. Never shown by ``repr``.
    """

    endpoint: str = field(
        default=DEFAULT_HUB_ENDPOINT,
        metadata=rule(Prefixed(("http://", "https://"), "an http:// or https:// URL for the Hub")),
    )
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.token is not None and (not self.token or any(c.isspace() for c in self.token)):
            raise ConfigError(
                "the Hugging Face token is empty or holds a space: give one token", setting="token"
            )
        check_fields(self)


@dataclass(frozen=True)
class RegistrySettings:
    """How ``oci://`` sources reach OCI registries.

    ``auths``: the ``auths`` section of a Docker config (``~/.docker/config.json``, or a
    ``kubernetes.io/dockerconfigjson`` Secret, the one a pod's ``imagePullSecrets`` names): per registry host,
    ``{"auth": base64("user:password")}`` or ``{"username", "password"}`` or ``{"identitytoken"}``. A
    registry without an entry is pulled anonymously. Never shown by ``repr``.

    ``plain_http``: registry hosts (``host`` or ``host:port``) reached over plain HTTP instead of HTTPS, for
    an in-cluster registry without TLS; ``*`` means every registry. Credentials are still sent to them.
    """

    auths: Mapping[str, Mapping[str, str]] = field(default_factory=dict, repr=False)
    plain_http: tuple[str, ...] = ()

    def uses_plain_http(self, host: str) -> bool:
        """Whether ``host`` (as written in the reference, with its port) is reached over plain HTTP."""
        return "*" in self.plain_http or host.lower() in (h.lower() for h in self.plain_http)


@dataclass(frozen=True)
class GcsSettings:
    """Where and how to reach Google Cloud Storage (``gs://``).

    ``endpoint_url``: the JSON API's base URL (``http(s)://host[:port]``). ``None``: ``STORAGE_EMULATOR_HOST``
    when it is set (as Google's own clients do; an emulator is then read without credentials), else
    ``https://storage.googleapis.com``.

    ``credentials_json``: a service-account key or a workload identity federation (``external_account``)
    configuration, the JSON text itself, instead of Application Default Credentials: the operator's copy
    of a ModelLoad's Secret (never in ``repr``); only a service-account key is accepted there. ``None``:
    google-auth's Application Default Credentials (``GOOGLE_APPLICATION_CREDENTIALS``, the GKE metadata
    server for Workload Identity, gcloud's user credentials), refreshed by google-auth.

    ``anonymous``: send no credentials (public objects).
    """

    endpoint_url: str | None = field(
        default=None, metadata=rule(Prefixed(("http://", "https://"), "an http:// or https:// URL"))
    )
    credentials_json: str | None = field(default=None, repr=False)
    anonymous: bool = False

    def __post_init__(self) -> None:
        if self.anonymous and self.credentials_json is not None:
            raise ConfigError("GCS access is either anonymous or with a credentials file, not both")
        check_fields(self)


@dataclass(frozen=True)
class AzureCredentials:
    """Azure Blob credentials given explicitly (the operator's copy of a ModelLoad's Secret): a connection
    string, a SAS token or an account key. None of them appears in ``repr``."""

    connection_string: str | None = field(default=None, repr=False)
    sas_token: str | None = field(default=None, repr=False)
    account_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        given = [v for v in (self.connection_string, self.sas_token, self.account_key) if v]
        if len(given) != 1:
            raise ConfigError(
                "Azure credentials are one of a connection string, a SAS token or an account key"
                f" ({len(given)} given)"
            )


@dataclass(frozen=True)
class AzureSettings:
    """Where and how to reach Azure Blob Storage (``az://ACCOUNT/CONTAINER/PATH``).

    ``endpoint_url``: the account's blob endpoint (``https://ACCOUNT.blob.core.windows.net``, or an
    emulator's ``http://127.0.0.1:10000/devstoreaccount1``). ``None``: the connection string's
    ``BlobEndpoint`` (or the one its protocol, account and suffix make), else
    ``https://ACCOUNT.blob.core.windows.net``.

    ``credentials``: explicit credentials (:class:`AzureCredentials`). ``None``: the environment, as
    Azure's tools read it: ``AZURE_STORAGE_CONNECTION_STRING``, then ``AZURE_STORAGE_SAS_TOKEN``, then
    ``AZURE_STORAGE_KEY``, else azure-identity's ``DefaultAzureCredential`` (Entra Workload ID from the
    federated token file the AKS webhook injects, a service principal's ``AZURE_CLIENT_SECRET``, managed
    identity), whose tokens azure-identity refreshes.

    ``anonymous``: send no credentials (a container with public read access).
    """

    endpoint_url: str | None = field(
        default=None, metadata=rule(Prefixed(("http://", "https://"), "an http:// or https:// URL"))
    )
    credentials: AzureCredentials | None = None
    anonymous: bool = False

    def __post_init__(self) -> None:
        if self.anonymous and self.credentials is not None:
            raise ConfigError("Azure Blob access is either anonymous or with credentials, not both")
        check_fields(self)


@dataclass(frozen=True)
class SourceSettings:
    """Everything :func:`open_source` and :func:`read_range` need, grouped by concern."""

    http: HttpSettings = field(default_factory=HttpSettings)
    s3: S3Settings = field(default_factory=S3Settings)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    gcs: GcsSettings = field(default_factory=GcsSettings)
    azure: AzureSettings = field(default_factory=AzureSettings)
    hub: HubSettings = field(default_factory=HubSettings)
    registry: RegistrySettings = field(default_factory=RegistrySettings)
