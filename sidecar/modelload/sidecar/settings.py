"""The sidecar's settings: every flag and ``MODELLOAD_*`` variable, parsed once at the edge into typed values.

docs/contracts.md lists the flags; each has one environment variable, and a flag given on the command line
wins over its variable (the operator sets variables; a person debugging a pod adds flags). Each setting is
declared once, as a field of the dataclass of the part that uses it (:class:`LoadSettings` in
``load/settings.py``, ``MemorySettings`` in ``memory/settings.py``, :class:`PeerSettings` in
``peers/settings.py``, the sources' ``S3Settings`` and ``HttpSettings``, and :class:`ApiSettings`,
:class:`NotifySettings` below): its default, its docs and the rule its value follows. This module composes
them into :class:`SidecarSettings` and holds :data:`OPTIONS`, one row per flag: the field it fills (``dest``),
its variable, its help line and its grammar. The ``--help`` line takes the range and the default from the
field (:func:`~modelload.loader.options.add_arguments`), and the field's rule checks a value from a flag as it
checks one from code (:class:`~modelload.loader.options.Given`). The engine, the API and the notifier receive
typed, valid settings and never read the environment. A wrong value is a :class:`ConfigError` that names the
flag or variable it came from and what is expected.

S3 endpoint, region and credentials: the sources layer hands them to botocore's own chain
(``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``, profiles, IRSA...), so these
settings carry only the explicit overrides (``--s3-endpoint``, ``--s3-region`` and their ``MODELLOAD_S3_*``
variables) and leave the rest to botocore, as users of the AWS tools expect. One exception: botocore (1.44)
does not read ``AWS_REGION``, which the AWS CLI v2, the newer SDKs and EKS (IRSA, Pod Identity) use, and
which docs/contracts.md names; so ``AWS_REGION`` is read here, after ``--s3-region``/``MODELLOAD_S3_REGION``
and before botocore's own ``AWS_DEFAULT_REGION`` (the CLI v2's order).

Secrets never show here: the key and password are files whose paths are settings, read by the engine; the
header file (``--header-file``, a private HTTP(S) server's token) is read here, so a malformed one fails
before the load, into an object whose ``repr`` shows header names only; a source URI is shown without user
info or query string (presigned URLs carry signatures there).

>>> settings = parse_settings(["--source", "s3://models/llama.safetensors", "--readers", "16"], environ={})
>>> settings.engine.readers, settings.engine.chunk_size, settings.notify.endpoint
(16, 33554432, 'ipc:///run/modelload/model.seg.notify.sock')
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from modelload.loader import options, wiring
from modelload.loader.errors import ConfigError
from modelload.loader.options import (
    Given,
    Option,
    parse_bool,
    parse_int,
    parse_list,
    parse_seconds,
    parse_text,
    parse_word,
)
from modelload.loader.rules import HTTP_URL, Between, OneOf, Prefixed, check_fields, rule
from modelload.loader.sizes import format_size, parse_size
from modelload.sidecar.load import DEFAULT_SEGMENT, MAX_CHUNK, MIN_CHUNK, LoadSettings, ModelFormat
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.peers import PeerSettings
from modelload.sidecar.sources import (
    AzureSettings,
    GcsSettings,
    HttpSettings,
    HubSettings,
    RegistrySettings,
    S3Settings,
    SourceSettings,
    auths_from_docker_config,
    display_url,
    proxy_from_environ,
    read_header_file,
    read_token_file,
)

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_SEGMENT",
    "ENVIRONMENT",
    "OPTIONS",
    "ApiSettings",
    "LoadSettings",
    "ModelFormat",
    "NotifySettings",
    "PeerSettings",
    "SidecarSettings",
    "add_arguments",
    "default_notify_endpoint",
    "parse_bool",
    "parse_settings",
]

LogLevel = Literal["debug", "info", "warning", "error"]

DEFAULT_PORT = wiring.STATUS_PORT
NOTIFY_OFF = ("none", "off", "false", "")
_NOTIFY_SCHEMES = ("ipc://", "tcp://", "inproc://")
AWS_REGION_ENV = "AWS_REGION"  # botocore reads AWS_DEFAULT_REGION only
HF_TOKEN_ENV = "HF_TOKEN"  # noqa: S105 - the Hub's own variables, read as its client reads them
HF_ENDPOINT_ENV = "HF_ENDPOINT"


# --- the settings ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiSettings:
    """Where the status API listens."""

    host: str = "0.0.0.0"  # noqa: S104 - probes come from the kubelet, outside the pod's loopback
    """The bind address. Default ``0.0.0.0``: the kubelet's probes come from the node, not from the pod's
    loopback. Use ``127.0.0.1`` outside a pod."""

    port: int = field(default=DEFAULT_PORT, metadata=rule(Between(0, 65535)))
    """The TCP port. Default 8479 (``modelload.loader.wiring``). 0 picks a free port (for tests; it is
    logged)."""

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError(
                "the status API host is empty: give an address such as 0.0.0.0 or 127.0.0.1", setting="host"
            )
        check_fields(self)


@dataclass(frozen=True)
class NotifySettings:
    """Where ready notifications are published (a pyzmq PUB socket)."""

    endpoint: str | None = field(
        metadata=rule(
            Prefixed(_NOTIFY_SCHEMES, "ipc://PATH, tcp://HOST:PORT or none for the notify endpoint")
        )
    )
    """``ipc:///path``, ``tcp://host:port`` or ``inproc://name``; ``None`` publishes nothing (loaders then
    poll the segment). The sidecar's default is :func:`default_notify_endpoint`, ``ipc://<segment>.notify.sock``
    (``model.seg.notify.sock`` beside ``model.seg``): in the shared volume, so the app container can
    connect, and one per segment, so two sidecars sharing a folder never share a socket. The endpoint is also
    recorded in the segment's metadata."""

    send_hwm: int = field(default=100_000, metadata=rule(Between(1, what="the send queue")))
    """Messages queued per subscriber before new ones are dropped. Default 100,000, more than a model's
    tensor count in practice. Dropping is safe: the segment's state table is the truth and a subscriber
    re-reads it on its next poll."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class SidecarSettings:
    """All of the sidecar's settings, grouped by the component that uses them."""

    engine: LoadSettings
    sources: SourceSettings
    api: ApiSettings = field(default_factory=ApiSettings)
    notify: NotifySettings = field(default_factory=lambda: NotifySettings(endpoint=None))
    log_level: LogLevel = field(default="info", metadata=rule(OneOf(get_args(LogLevel))))
    """The level of modelload's own loggers. Default ``info``: start, manifest, finish, failure and retries
    show in ``kubectl logs``; ``debug`` adds every tensor."""
    peers: PeerSettings = field(default_factory=PeerSettings)

    def __post_init__(self) -> None:
        check_fields(self)


# --- flags and variables -----------------------------------------------------------------------------------


def _path(text: str) -> Path:
    return Path(text.strip()).absolute()


def _optional_text(text: str) -> str | None:
    return text.strip() or None


def _whole_seconds(text: str) -> float:
    return float(parse_int(text))


def _urls(text: str) -> tuple[str, ...]:
    urls = parse_list(text)
    for url in urls:
        problem = HTTP_URL.problem(url)
        if problem is not None:
            raise ConfigError(problem)
    return urls


def _token_file(text: str) -> str:
    """The peer token, read now so a missing or empty file fails before the load; never shown."""
    path = _path(text)
    try:
        token = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the peer token file {path} ({type(exc).__name__})") from None
    if not token or any(c.isspace() for c in token) or len(token) > 4096:
        raise ConfigError(f"the peer token file {path} must hold one token (at most 4096 characters)")
    return token


def _hub_token(text: str) -> str:
    """The Hugging Face token, read now so a missing or malformed file fails before the load; never shown."""
    return read_token_file(_path(text), what="Hugging Face token")


def _registry_auths(text: str) -> dict[str, dict[str, str]]:
    """The ``auths`` of a Docker config file (a dockerconfigjson Secret's), read now; never shown."""
    path = _path(text)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"the registry credentials file {path} cannot be read ({exc.strerror or type(exc).__name__}): "
            "mount the dockerconfigjson Secret there"
        ) from None
    return auths_from_docker_config(data, where=f"the registry credentials file {path}")


def _endpoint(text: str) -> str | None:
    """A pyzmq endpoint, or None for 'none' (notifications off: loaders poll the segment)."""
    value = text.strip()
    return None if value.lower() in NOTIFY_OFF else value


OPTIONS: tuple[Option, ...] = (
    Option(
        "engine.source", "--source", "MODELLOAD_SOURCE",
        "model URI: s3://bucket/key, gs://bucket/object, az://account/container/blob, http(s)://...,"
        " hf://ORG/NAME[@REV], oci://REGISTRY/REPO:TAG, file:///path or a path (a prefix ending in / is a"
        " directory)", "URI", parse=parse_text,
    ),
    Option("engine.segment", "--segment", wiring.SEGMENT_ENV, "segment file", "PATH", parse=_path),
    Option(
        "engine.model_dir", "--model-dir", wiring.MODEL_DIR_ENV,
        "where a directory model's config and tokenizer go", "PATH", parse=_path,
        unset="model/ beside the segment",
    ),
    Option(
        "engine.files", "--files", "MODELLOAD_FILES",
        "a directory's files, comma-separated, for an HTTP(S) directory with no model.safetensors.index.json",
        "NAME,...", parse=parse_list,
    ),
    Option(
        "engine.format", "--format", "MODELLOAD_FORMAT", "model format; auto tells from the first bytes",
        parse=parse_word,
    ),
    Option(
        "engine.readers", "--readers", "MODELLOAD_READERS", "parallel range readers", "N", parse=parse_int,
    ),
    Option(
        "engine.chunk_size", "--chunk-size", "MODELLOAD_CHUNK_SIZE", "bytes per range request", "SIZE",
        parse=parse_size, rule=Between(MIN_CHUNK, MAX_CHUNK, what="a size", show=format_size),
    ),
    Option(
        "engine.verify", "--verify", "MODELLOAD_VERIFY", "check tensors against the file's hashes",
        boolean=True, parse=parse_bool,
    ),
    Option(
        "engine.key_file", "--key-file", "MODELLOAD_KEY_FILE", "file holding the raw 32-byte key", "FILE",
        parse=_path,
    ),
    Option(
        "engine.password_file", "--password-file", "MODELLOAD_PASSWORD_FILE",
        "file holding the password of an Argon2id-derived key", "FILE", parse=_path,
    ),
    Option(
        "sources.http.range_fallback", "--range-fallback", "MODELLOAD_RANGE_FALLBACK",
        "read an HTTP(S) server that ignores Range from one stream, with one reader", boolean=True,
        parse=parse_bool,
    ),
    Option(
        "sources.http.headers", "--header-file", "MODELLOAD_HEADER_FILE",
        "file holding a bearer token, or 'Name: value' header lines, for a private HTTP(S) source", "FILE",
        parse=_path,
    ),
    Option(
        "sources.hub.token", "--hf-token-file", "MODELLOAD_HF_TOKEN_FILE",
        "file holding a Hugging Face token, for private and gated hf:// repositories", "FILE",
        parse=_hub_token, unset="HF_TOKEN",
    ),
    Option(
        "sources.hub.endpoint", "--hf-endpoint", "MODELLOAD_HF_ENDPOINT",
        "the Hugging Face Hub or a mirror of it, for hf:// sources", "URL", parse=parse_text,
        unset="HF_ENDPOINT, else https://huggingface.co",
    ),
    Option(
        "sources.registry.auths", "--registry-auth-file", "MODELLOAD_REGISTRY_AUTH_FILE",
        "a Docker config (a dockerconfigjson Secret's file) with credentials for oci:// registries", "FILE",
        parse=_registry_auths, unset="anonymous pulls",
    ),
    Option(
        "sources.registry.plain_http", "--registry-plain-http", "MODELLOAD_REGISTRY_PLAIN_HTTP",
        "oci:// registries (host:port, comma-separated, or *) reached over plain HTTP", "HOSTS",
        parse=parse_list, unset="none: HTTPS",
    ),
    Option(
        "engine.priority", "--priority", "MODELLOAD_PRIORITY",
        "comma-separated tensor names or prefixes to load first", "NAMES", parse=parse_list,
        unset="file order",
    ),
    Option(
        "api.port", "--port", "MODELLOAD_PORT", "status API port, 0 picks a free one", "PORT",
        parse=parse_int,
    ),
    Option(
        "api.host", "--host", "MODELLOAD_HOST",
        "status API bind address, where the kubelet's probes reach it", "HOST", parse=parse_text,
    ),
    Option(
        "notify.endpoint", "--notify", wiring.NOTIFY_ENV, "pyzmq PUB endpoint, or 'none'", "ENDPOINT",
        parse=_endpoint, unset="ipc://<segment>.notify.sock",
    ),
    Option(
        "sources.s3.endpoint_url", "--s3-endpoint", "MODELLOAD_S3_ENDPOINT", "S3-compatible endpoint URL",
        "URL", parse=parse_text, unset="botocore's: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS",
    ),
    Option(
        "sources.s3.region", "--s3-region", "MODELLOAD_S3_REGION", "S3 region", "REGION",
        parse=_optional_text, unset="botocore's chain: AWS_REGION, AWS_DEFAULT_REGION, the profile",
    ),
    Option(
        "sources.s3.addressing", "--s3-addressing", "MODELLOAD_S3_ADDRESSING", "S3 addressing style",
        parse=parse_word,
    ),
    Option(
        "sources.s3.unsigned", "--s3-unsigned", "MODELLOAD_S3_UNSIGNED",
        "anonymous S3 requests, for public buckets", boolean=True, parse=parse_bool,
    ),
    Option(
        "sources.gcs.endpoint_url", "--gcs-endpoint", "MODELLOAD_GCS_ENDPOINT", "GCS JSON API endpoint URL",
        "URL", parse=parse_text, unset="STORAGE_EMULATOR_HOST, else Google's",
    ),
    Option(
        "sources.azure.endpoint_url", "--azure-endpoint", "MODELLOAD_AZURE_ENDPOINT", "Azure blob endpoint",
        "URL", parse=parse_text, unset="a connection string's, else https://ACCOUNT.blob.core.windows.net",
    ),
    Option(
        "engine.landing", "--landing", "MODELLOAD_LANDING",
        "how bytes reach the segment: auto (splice on 4 KiB pages, the segment's mapping on huge pages),"
        " splice or mapping", parse=parse_word,
    ),
    Option(
        "engine.slots", "--slots", "MODELLOAD_SLOTS",
        "where tensor slots start: auto (packed where pages would add over 8 MiB and 1 percent of"
        " padding), packed (as the files hold them; layout version 5) or paged (a page each; versions 1-2,"
        " which older loaders read)",
        parse=parse_word,
    ),
    Option(
        "engine.memory.mode", "--memory-mode", "MODELLOAD_MEMORY_MODE",
        "full keeps the model; release frees each tensor once every consumer copied it; ring holds at most"
        " --ring-size", parse=parse_word,
    ),
    Option(
        "engine.memory.ring_size", "--ring-size", "MODELLOAD_RING_SIZE",
        "ring mode's bound on tensor bytes held", "SIZE", parse=parse_size,
        rule=Between(MIN_CHUNK, what="a ring", show=format_size),
        unset="none, set it with --memory-mode ring",
    ),
    Option(
        "engine.memory.wait_timeout", "--memory-wait-timeout", "MODELLOAD_MEMORY_WAIT_TIMEOUT",
        "seconds ring mode may wait for consumers to free room before failing", "SECONDS",
        parse=parse_seconds, unset="no limit",
    ),
    Option(
        "engine.memory.consumers", "--consumers", "MODELLOAD_CONSUMERS",
        "consumers that must attach before anything is released", "N", parse=parse_int,
    ),
    Option(
        "sources.http.proxy", "--proxy", "MODELLOAD_PROXY",
        "HTTP proxy for origin reads, such as Dragonfly's dfdaemon", "URL", parse=_optional_text,
        unset="HTTP(S)_PROXY and NO_PROXY",
    ),
    Option(
        "peers.urls", "--peers", "MODELLOAD_PEERS",
        "other sidecars of this model to take chunks from, comma-separated base URLs", "URL,...", parse=_urls,
    ),
    Option(
        "peers.dns", "--peer-dns", "MODELLOAD_PEER_DNS",
        "a DNS name resolving to the peers (a headless Service), each at --peer-port", "NAME",
        parse=_optional_text,
    ),
    Option(
        "peers.port", "--peer-port", "MODELLOAD_PEER_PORT", "port serving this sidecar's bytes to peers",
        "PORT", parse=parse_int,
    ),
    Option(
        "peers.token", "--peer-token-file", "MODELLOAD_PEER_TOKEN_FILE",
        "file holding the token peers share (required with peers)", "FILE", parse=_token_file,
    ),
    Option(
        "peers.max_uploads", "--peer-uploads", "MODELLOAD_PEER_UPLOADS",
        "uploads to peers at once before answering busy", "N", parse=parse_int,
    ),
    Option(
        "peers.stall_timeout", "--peer-stall-timeout", "MODELLOAD_PEER_STALL_TIMEOUT",
        "seconds one peer may keep the load waiting for nothing before it is dropped", "SECONDS",
        parse=_whole_seconds,
    ),
    Option(
        "peers.wait_budget", "--peer-wait-budget", "MODELLOAD_PEER_WAIT_BUDGET",
        "seconds dropped peers may cost a load in all before it waits on no busy or lagging one", "SECONDS",
        parse=_whole_seconds,
    ),
    Option("log_level", "--log-level", "MODELLOAD_LOG_LEVEL", "modelload's log level", parse=parse_word),
)  # fmt: skip
"""One row per flag, in the order of docs/contracts.md's table; ``dest`` is the field under
:class:`SidecarSettings` that the value fills."""

ENVIRONMENT = (*(option.env for option in OPTIONS), AWS_REGION_ENV, HF_TOKEN_ENV, HF_ENDPOINT_ENV)
"""Every variable the sidecar reads, for documentation and for the operator's tests."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every sidecar flag to ``parser``; a flag left out stays ``None`` and falls back to its variable."""
    options.add_arguments(parser, OPTIONS, settings=SidecarSettings)


def default_notify_endpoint(segment: Path) -> str:
    """``ipc://<segment>.notify.sock``: one socket per segment, so two sidecars whose segments share a
    folder never bind (and, stopping, remove) the same socket file."""
    return f"ipc://{segment.parent}/{segment.name}.notify.sock"


def parse_settings(
    argv: Sequence[str] | argparse.Namespace | Mapping[str, object], environ: Mapping[str, str]
) -> SidecarSettings:
    """Build the settings from flags (an argv list, parsed args, or a mapping of dests) and ``environ``.

    Raises ConfigError naming the flag or variable of the first bad value.
    """
    given = Given(OPTIONS, _flags(argv), environ)
    segment = given.get("engine.segment", DEFAULT_SEGMENT)
    notify = given.build(NotifySettings, "notify", defaults={"endpoint": default_notify_endpoint(segment)})
    memory = given.build(MemorySettings, "engine.memory")
    engine = given.build(
        LoadSettings, "engine", defaults={"source": ""}, notify=notify.endpoint, memory=memory
    )
    return given.build(
        SidecarSettings,
        engine=engine,
        sources=_source_settings(given, environ, source=engine.source),
        api=given.build(ApiSettings, "api"),
        notify=notify,
        peers=given.build(PeerSettings, "peers"),
    )


def _flags(argv: Sequence[str] | argparse.Namespace | Mapping[str, object]) -> Mapping[str, object]:
    """The flags given, by dest: ``argv`` parsed when it is a list, as it is otherwise."""
    if isinstance(argv, argparse.Namespace):
        return vars(argv)
    if isinstance(argv, Mapping):
        return argv
    parser = argparse.ArgumentParser(prog="modelload sidecar", exit_on_error=False, allow_abbrev=False)
    add_arguments(parser)
    try:
        namespace, unknown = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        raise ConfigError(str(exc)) from None
    if unknown:
        raise ConfigError(f"unknown arguments: {' '.join(unknown)} (see modelload sidecar --help)")
    return vars(namespace)


def _source_settings(given: Given, environ: Mapping[str, str], *, source: str) -> SourceSettings:
    """How the sources reach S3 and HTTP(S) servers; a header file is checked against ``source``'s scheme."""
    region = given.get("sources.s3.region") or environ.get(AWS_REGION_ENV, "").strip() or None
    s3 = given.build(S3Settings, "sources.s3", region=region)
    # The header file is read now: a bad one is a clear error before the load starts, naming the file and
    # line (never a value). Read once: a load takes minutes, not a token's lifetime.
    header_file = given.get("sources.http.headers")
    origin = given.origin("sources.http.headers")
    headers = None if header_file is None else read_header_file(header_file, origin=origin)
    if headers is not None and not source.startswith(("http://", "https://")):
        raise ConfigError(
            "a header file (--header-file/MODELLOAD_HEADER_FILE) is for http(s):// sources, and the source"
            f" is {display_url(source)}: S3, GCS and Azure take their own credentials"
        )
    proxy = proxy_from_environ(environ, override=given.get("sources.http.proxy"))
    http = given.build(HttpSettings, "sources.http", headers=headers, proxy=proxy)
    gcs = given.build(GcsSettings, "sources.gcs")
    azure = given.build(AzureSettings, "sources.azure")
    # The Hub's own variables come after the flags, as its client reads them.
    hub_fallback = {
        "endpoint": environ.get(HF_ENDPOINT_ENV, "").strip() or None,
        "token": environ.get(HF_TOKEN_ENV, "").strip() or None,
    }
    hub = given.build(HubSettings, "sources.hub", defaults={k: v for k, v in hub_fallback.items() if v})
    registry = given.build(RegistrySettings, "sources.registry")
    return given.build(
        SourceSettings, "sources", http=http, s3=s3, gcs=gcs, azure=azure, hub=hub, registry=registry
    )
