"""The sidecar's settings: every flag and ``MODELLOAD_*`` variable, parsed once at the edge into typed values.

docs/contracts.md lists the flags; each has one environment variable, and a flag given on the command line
wins over its variable (the operator sets variables; a person debugging a pod adds flags). Values are parsed
and checked here, and only here: the engine, the API and the notifier receive typed, valid settings and never
read the environment. A wrong value is a :class:`ConfigError` that names the flag or variable it came from and
what is expected.

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
from typing import TYPE_CHECKING, Literal, cast, get_args

from modelload.loader import options, wiring
from modelload.loader.errors import ConfigError
from modelload.loader.options import (
    Option,
    parse_bool,
    parse_choice,
    parse_int,
    parse_list,
    parse_seconds,
    parse_text,
)
from modelload.loader.sizes import parse_size
from modelload.sidecar.load import (
    DEFAULT_SEGMENT,
    MAX_CHUNK,
    MAX_READERS,
    MIN_CHUNK,
    LoadSettings,
    ModelFormat,
)
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.peers import DEFAULT_PEER_PORT, PeerSettings
from modelload.sidecar.sources import (
    HttpSettings,
    RetryPolicy,
    S3Settings,
    SourceSettings,
    display_url,
    proxy_from_environ,
    read_header_file,
)

if TYPE_CHECKING:
    from modelload.sidecar.memory import Mode
    from modelload.sidecar.sources import S3Addressing

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_SEGMENT",
    "ApiSettings",
    "LoadSettings",
    "ModelFormat",
    "NotifySettings",
    "PeerSettings",
    "SidecarSettings",
    "add_arguments",
    "check_secret_files",
    "default_notify_endpoint",
    "parse_settings",
]

LogLevel = Literal["debug", "info", "warning", "error"]

MiB = 1 << 20
DEFAULT_PORT = wiring.STATUS_PORT
NOTIFY_OFF = ("none", "off", "false", "")
_NOTIFY_SCHEMES = ("ipc://", "tcp://", "inproc://")
AWS_REGION_ENV = "AWS_REGION"  # botocore reads AWS_DEFAULT_REGION only


# --- the settings ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiSettings:
    """Where the status API listens.

    ``host``: the bind address. Default ``0.0.0.0``: the kubelet's probes come from the node, not from the
    pod's loopback. Use ``127.0.0.1`` outside a pod.

    ``port``: the TCP port, 0 to 65535. Default 8479. 0 picks a free port (for tests; it is logged).
    """

    host: str = "0.0.0.0"  # noqa: S104 - probes come from the kubelet, outside the pod's loopback
    port: int = DEFAULT_PORT

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("the status API host is empty: give an address such as 0.0.0.0 or 127.0.0.1")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"the status API port must be between 0 and 65535, got {self.port}")


@dataclass(frozen=True)
class NotifySettings:
    """Where ready notifications are published (a pyzmq PUB socket).

    ``endpoint``: ``ipc:///path``, ``tcp://host:port`` or ``inproc://name``; ``None`` publishes nothing
    (loaders then poll the segment). Default ``ipc://<segment>.notify.sock`` (``model.seg.notify.sock``
    beside ``model.seg``), in the shared volume, so the app container can connect, and one per segment, so
    two sidecars sharing a folder never share a socket. The endpoint is also recorded in the segment's
    metadata.

    ``send_hwm``: messages queued per subscriber before new ones are dropped. Default 100,000, more than a
    model's tensor count in practice. Dropping is safe: the segment's state table is the truth and a
    subscriber re-reads it on its next poll.
    """

    endpoint: str | None
    send_hwm: int = 100_000

    def __post_init__(self) -> None:
        if self.endpoint is not None and not self.endpoint.startswith(_NOTIFY_SCHEMES):
            raise ConfigError(
                f"the notify endpoint must start with ipc://, tcp:// or inproc:// (or be 'none'),"
                f" got {self.endpoint!r}"
            )
        if self.send_hwm < 1:
            raise ConfigError(f"the notify send queue must hold at least 1 message, got {self.send_hwm}")


@dataclass(frozen=True)
class SidecarSettings:
    """All of the sidecar's settings, grouped by the component that uses them.

    ``log_level``: the level of modelload's own loggers. Default ``info``: start, manifest, finish,
    failure and retries show in ``kubectl logs``; ``debug`` adds every tensor.
    """

    engine: LoadSettings
    sources: SourceSettings
    api: ApiSettings = field(default_factory=ApiSettings)
    notify: NotifySettings = field(default_factory=lambda: NotifySettings(endpoint=None))
    log_level: LogLevel = "info"
    peers: PeerSettings = field(default_factory=PeerSettings)


# --- flags and variables -----------------------------------------------------------------------------------


_OPTIONS = (
    Option(
        "source", "--source", "MODELLOAD_SOURCE",
        "model URI: s3://bucket/key, http(s)://..., file:///path or a path (required)", "URI",
    ),
    Option("segment", "--segment", wiring.SEGMENT_ENV, f"segment file (default {DEFAULT_SEGMENT})", "PATH"),
    Option(
        "model_dir", "--model-dir", wiring.MODEL_DIR_ENV,
        "where a directory model's config and tokenizer go (default: model/ beside the segment)", "PATH",
    ),
    Option(
        "files", "--files", "MODELLOAD_FILES",
        "a directory's files, comma-separated, for an HTTP(S) directory with no model.safetensors.index.json",
        "NAME,...",
    ),
    Option(
        "format", "--format", "MODELLOAD_FORMAT", "model format (default auto: from the first bytes)",
        choices=get_args(ModelFormat),
    ),
    Option("readers", "--readers", "MODELLOAD_READERS", "parallel range readers, 1-256 (default 8)", "N"),
    Option(
        "chunk_size", "--chunk-size", "MODELLOAD_CHUNK_SIZE",
        "bytes per range request, 1MiB-1GiB (default 32MiB)", "SIZE",
    ),
    Option(
        "verify", "--verify", "MODELLOAD_VERIFY", "check tensors against the file's hashes (default on)",
        boolean=True,
    ),
    Option("key_file", "--key-file", "MODELLOAD_KEY_FILE", "file holding the raw 32-byte key", "FILE"),
    Option(
        "password_file", "--password-file", "MODELLOAD_PASSWORD_FILE",
        "file holding the password of an Argon2id-derived key", "FILE",
    ),
    Option(
        "range_fallback", "--range-fallback", "MODELLOAD_RANGE_FALLBACK",
        "read an HTTP(S) server that ignores Range from one stream (one reader; default off)", boolean=True,
    ),
    Option(
        "header_file", "--header-file", "MODELLOAD_HEADER_FILE",
        "file holding a bearer token, or 'Name: value' header lines, for a private HTTP(S) source", "FILE",
    ),
    Option(
        "priority", "--priority", "MODELLOAD_PRIORITY",
        "comma-separated tensor names or prefixes to load first (default: file order)", "NAMES",
    ),
    Option(
        "port", "--port", "MODELLOAD_PORT", f"status API port (default {DEFAULT_PORT}; 0: any)", "PORT",
    ),
    Option(
        "host", "--host", "MODELLOAD_HOST",
        "status API bind address (default 0.0.0.0: probes come from the kubelet)", "HOST",
    ),
    Option(
        "notify", "--notify", wiring.NOTIFY_ENV,
        "pyzmq PUB endpoint, or 'none' (default ipc://<segment>.notify.sock)", "ENDPOINT",
    ),
    Option(
        "s3_endpoint", "--s3-endpoint", "MODELLOAD_S3_ENDPOINT",
        "S3-compatible endpoint URL (default: botocore's: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)",
        "URL",
    ),
    Option(
        "s3_region", "--s3-region", "MODELLOAD_S3_REGION",
        "S3 region (default: botocore's chain: AWS_REGION, AWS_DEFAULT_REGION, the profile)", "REGION",
    ),
    Option(
        "s3_addressing", "--s3-addressing", "MODELLOAD_S3_ADDRESSING", "S3 addressing style (default auto)",
        choices=("auto", "path", "virtual"),
    ),
    Option(
        "s3_unsigned", "--s3-unsigned", "MODELLOAD_S3_UNSIGNED",
        "anonymous S3 requests, for public buckets (default off)", boolean=True,
    ),
    Option(
        "memory_mode", "--memory-mode", "MODELLOAD_MEMORY_MODE",
        "full keeps the model; release frees each tensor once every consumer copied it; ring holds at most"
        " --ring-size (default full)", choices=("full", "release", "ring"),
    ),
    Option(
        "ring_size", "--ring-size", "MODELLOAD_RING_SIZE", "ring mode's bound on tensor bytes held", "SIZE",
    ),
    Option(
        "memory_wait_timeout", "--memory-wait-timeout", "MODELLOAD_MEMORY_WAIT_TIMEOUT",
        "seconds ring mode may wait for consumers to free room before failing (default: no limit)", "SECONDS",
    ),
    Option(
        "consumers", "--consumers", "MODELLOAD_CONSUMERS",
        "consumers that must attach before anything is released (default 1)", "N",
    ),
    Option(
        "proxy", "--proxy", "MODELLOAD_PROXY",
        "HTTP proxy for origin reads, such as Dragonfly's dfdaemon (default: HTTP(S)_PROXY and NO_PROXY)",
        "URL",
    ),
    Option(
        "peers", "--peers", "MODELLOAD_PEERS",
        "other sidecars of this model to take chunks from, comma-separated base URLs (default none)",
        "URL,...",
    ),
    Option(
        "peer_dns", "--peer-dns", "MODELLOAD_PEER_DNS",
        "a DNS name resolving to the peers (a headless Service), each at --peer-port", "NAME",
    ),
    Option(
        "peer_port", "--peer-port", "MODELLOAD_PEER_PORT",
        f"port serving this sidecar's bytes to peers (default {DEFAULT_PEER_PORT})", "PORT",
    ),
    Option(
        "peer_token_file", "--peer-token-file", "MODELLOAD_PEER_TOKEN_FILE",
        "file holding the token peers share (required with peers)", "FILE",
    ),
    Option(
        "peer_uploads", "--peer-uploads", "MODELLOAD_PEER_UPLOADS",
        "uploads to peers at once before answering busy (default 8)", "N",
    ),
    Option(
        "peer_stall_timeout", "--peer-stall-timeout", "MODELLOAD_PEER_STALL_TIMEOUT",
        "seconds a silent peer keeps a chunk before it moves elsewhere (default 10)", "SECONDS",
    ),
    Option(
        "log_level", "--log-level", "MODELLOAD_LOG_LEVEL", "modelload's log level (default info)",
        choices=get_args(LogLevel),
    ),
)  # fmt: skip
ENVIRONMENT = (*(option.env for option in _OPTIONS), AWS_REGION_ENV)
"""Every variable the sidecar reads, for documentation and for the operator's tests."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every sidecar flag to ``parser``; a flag left out stays ``None`` and falls back to its variable."""
    options.add_arguments(parser, _OPTIONS)


def _path(text: str) -> Path:
    return Path(text.strip()).absolute()


def _chunk_size(text: str) -> int:
    value = parse_size(text)
    if not MIN_CHUNK <= value <= MAX_CHUNK:
        raise ConfigError(f"expected a size from 1MiB to 1GiB, got {text!r} ({value} bytes)")
    return value


def _ring_size(text: str) -> int:
    value = parse_size(text)
    if value < MIN_CHUNK:
        raise ConfigError(f"a ring must be at least 1MiB (and hold the largest tensor), got {text!r}")
    return value


def _url(text: str) -> str:
    value = text.strip()
    if not value.startswith(("http://", "https://")):
        raise ConfigError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def _urls(text: str) -> tuple[str, ...]:
    return tuple(_url(url) for url in parse_list(text))


def check_secret_files(engine: LoadSettings) -> None:
    """ConfigError, naming the flag and variable, when the key or password file cannot be read or is not a
    key: run at the sidecar's start, so a Secret that is not mounted (or holds a passphrase where a raw key
    belongs) stops it with exit status 2 instead of failing the load later as an internal error. Only the
    paths stay in the settings: the engine reads the key when it needs it."""
    from modelload.loader.formats.tensorizer import DecryptionKey

    if engine.key_file is not None:
        try:
            DecryptionKey.from_file(engine.key_file)
        except OSError as exc:
            raise ConfigError(_unreadable("key", engine.key_file, exc), setting=KEY_SETTING) from None
        except ConfigError as exc:
            raise ConfigError(str(exc), setting=KEY_SETTING) from None
    if engine.password_file is not None:
        try:
            empty = not engine.password_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                _unreadable("password", engine.password_file, exc), setting=PASSWORD_SETTING
            ) from None
        if empty:
            raise ConfigError(f"the password file {engine.password_file} is empty", setting=PASSWORD_SETTING)


KEY_SETTING = "--key-file/MODELLOAD_KEY_FILE"
PASSWORD_SETTING = "--password-file/MODELLOAD_PASSWORD_FILE"  # noqa: S105 - a setting's name


def _unreadable(what: str, path: Path, exc: OSError) -> str:
    reason = "it does not exist" if isinstance(exc, FileNotFoundError) else exc.strerror or type(exc).__name__
    return (
        f"cannot read the {what} file {path}: {reason}; mount the Secret that holds it there (a ModelLoad's"
        f" {'decryptionKeySecretRef' if what == 'key' else 'passwordSecretRef'}) or fix the path"
    )


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


def _endpoint(text: str) -> str | None:
    """A pyzmq endpoint, or None for 'none' (notifications off: loaders poll the segment)."""
    value = text.strip()
    if value.lower() in NOTIFY_OFF:
        return None
    if not value.startswith(_NOTIFY_SCHEMES):
        raise ConfigError(f"expected ipc://PATH, tcp://HOST:PORT or none, got {value!r}")
    return value


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
    lookup = options.Lookup(_OPTIONS, _flags(argv), environ)
    engine, notify = _load_settings(lookup)
    host = lookup.get("host", parse_text, "0.0.0.0")  # noqa: S104 - probes come from the kubelet
    api = ApiSettings(host=host, port=lookup.get("port", parse_int(0, 65535), DEFAULT_PORT))
    sources = _source_settings(lookup, environ, source=engine.source)
    log_level = cast("LogLevel", lookup.get("log_level", parse_choice(get_args(LogLevel)), "info"))
    peers = _peer_settings(lookup)
    return SidecarSettings(engine, sources, api, notify, log_level, peers)  # distinct types: mypy checks


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


def _load_settings(lookup: options.Lookup) -> tuple[LoadSettings, NotifySettings]:
    """The engine's settings, and where it notifies (its default follows the segment's path)."""
    get = lookup.get
    source = get("source", parse_text, "")
    if not source:
        raise ConfigError(
            "no model source: pass --source URI or set MODELLOAD_SOURCE (s3://, http(s)://, file://)"
        )
    segment = get("segment", _path, DEFAULT_SEGMENT)
    key_file = get("key_file", _path, None)
    password_file = get("password_file", _path, None)
    if key_file is not None and password_file is not None:
        raise ConfigError(
            "both a key file (--key-file/MODELLOAD_KEY_FILE) and a password file"
            " (--password-file/MODELLOAD_PASSWORD_FILE) are set: give one"
        )
    default_endpoint: str | None = default_notify_endpoint(segment)
    notify = NotifySettings(endpoint=get("notify", _endpoint, default_endpoint))
    engine = LoadSettings(
        source=source,
        segment=segment,
        format=cast("ModelFormat", get("format", parse_choice(get_args(ModelFormat)), "auto")),
        readers=get("readers", parse_int(1, MAX_READERS), 8),
        chunk_size=get("chunk_size", _chunk_size, 32 * MiB),
        verify=get("verify", parse_bool, True),
        key_file=key_file,
        password_file=password_file,
        priority=get("priority", parse_list, ()),
        model_dir=get("model_dir", _path, None),
        files=get("files", parse_list, ()),
        notify=notify.endpoint,
        memory=MemorySettings(
            mode=cast("Mode", get("memory_mode", parse_choice(("full", "release", "ring")), "full")),
            ring_size=get("ring_size", _ring_size, 0),
            wait_timeout=get("memory_wait_timeout", parse_seconds, None),
            consumers=get("consumers", parse_int(1, 64), 1),
        ),
    )
    return engine, notify


def _source_settings(lookup: options.Lookup, environ: Mapping[str, str], *, source: str) -> SourceSettings:
    """How the sources reach S3 and HTTP(S) servers; a header file is checked against ``source``'s scheme."""
    get = lookup.get
    s3 = S3Settings(
        endpoint_url=get("s3_endpoint", _url, None),
        region=get("s3_region", parse_text, None) or environ.get(AWS_REGION_ENV, "").strip() or None,
        addressing=cast(
            "S3Addressing", get("s3_addressing", parse_choice(("auto", "path", "virtual")), "auto")
        ),
        unsigned=get("s3_unsigned", parse_bool, False),
    )
    # The header file is read now: a bad one is a clear error before the load starts, naming the file and
    # line (never a value). Read once: a load takes minutes, not a token's lifetime.
    header_file = get("header_file", _path, None)
    headers = (
        None if header_file is None else read_header_file(header_file, origin=lookup.origin("header_file"))
    )
    if headers is not None and not source.startswith(("http://", "https://")):
        raise ConfigError(
            "a header file (--header-file/MODELLOAD_HEADER_FILE) is for http(s):// sources, and the source"
            f" is {display_url(source)}: S3 takes AWS credentials, a file needs none"
        )
    proxy = proxy_from_environ(environ, override=get("proxy", parse_text, None) or None)
    http = HttpSettings(headers=headers, proxy=proxy, range_fallback=get("range_fallback", parse_bool, False))
    return SourceSettings(http=http, s3=s3, retry=RetryPolicy())


def _peer_settings(lookup: options.Lookup) -> PeerSettings:
    """Peers, named by URL or by a DNS name; off when neither is given."""
    get = lookup.get
    return PeerSettings(
        urls=get("peers", _urls, ()),
        dns=get("peer_dns", parse_text, None) or None,
        port=get("peer_port", parse_int(0, 65535), DEFAULT_PEER_PORT),
        token=get("peer_token_file", _token_file, ""),
        max_uploads=get("peer_uploads", parse_int(1, 256), 8),
        stall_timeout=float(get("peer_stall_timeout", parse_int(1, 3600), 10)),
    )
