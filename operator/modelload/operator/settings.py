"""The operator's settings: typed, grouped, read once at the edge (flags and ``MODELLOAD_OPERATOR_*``).

Every knob is one row of :data:`OPTIONS`: its flag, its environment variable, its default and why. The CLI
builds its parser from the table (a flag wins over the variable), the Helm chart sets the variables, and
nothing below this module reads the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from modelload.loader.errors import ConfigError
from modelload.operator.quantity import parse_bytes
from modelload.operator.sizing import SizingDefaults

__all__ = [
    "OPTIONS",
    "OperatorSettings",
    "RetrySettings",
    "SidecarSettings",
    "WebhookSettings",
    "add_arguments",
    "from_args",
]

SidecarMode = Literal["auto", "native", "regular"]
TlsMode = Literal["self-signed", "files"]
LogFormat = Literal["text", "json"]
DEFAULT_SIDECAR_IMAGE = "ghcr.io/modelload/sidecar:0.1.0"


@dataclass(frozen=True)
class SidecarSettings:
    """What the webhook injects when a ModelLoad does not say otherwise."""

    image: str = DEFAULT_SIDECAR_IMAGE
    image_pull_policy: str = "IfNotPresent"
    mode: SidecarMode = "auto"
    """native: an init container with restartPolicy Always (Kubernetes 1.29+ with the SidecarContainers gate,
    on by default from 1.29). regular: a container that never exits. auto: native when the API server
    reports 1.29 or later; set native/regular when nodes lag the control plane or the gate is off."""
    port: int = 8479
    segment_group: int = 8479
    """The group a pod without an fsGroup gets as a supplemental group, and the sidecar runs as, so the app
    can read the 0640 segment. 0: add none (the pod's fsGroup, or running the app as the sidecar's group, is
    then the way in). Pick a group your namespaces' pod security (an OpenShift SCC) allows."""
    log_format: LogFormat = "text"
    """The sidecars' log format (their MODELLOAD_LOG_FORMAT): text, or json for a log pipeline."""
    sizing: SizingDefaults = field(default_factory=SizingDefaults)


@dataclass(frozen=True)
class WebhookSettings:
    """Where the admission webhook listens and how its TLS is provided."""

    host: str = "0.0.0.0"  # noqa: S104 - the API server reaches the pod through its Service
    port: int = 9443
    path: str = "/mutate-pods"
    tls: TlsMode = "self-signed"
    """self-signed: the operator keeps a CA and serving certificate in ``tls_secret`` and patches the CA into
    the MutatingWebhookConfiguration. files: cert-manager (or you) mounts tls.crt/tls.key in ``cert_dir``
    and injects the CA itself; the operator only serves and reloads the files when they change."""
    cert_dir: Path = Path("/tmp/modelload-webhook")  # noqa: S108 - an emptyDir under a read-only root
    service: str = "modelload-webhook"
    configuration: str = "modelload"
    tls_secret: str = "modelload-webhook-tls"  # noqa: S105 - a Secret name


@dataclass(frozen=True)
class RetrySettings:
    """How soon a ModelLoad that could not be resolved is tried again (see modelload.operator.resolve)."""

    first_delay: float = 5.0
    """Seconds before the first retry; doubled after each failed one."""
    max_delay: float = 120.0
    """The longest wait between tries. It also bounds how long a fixed spec waits for a pending retry."""


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str = "modelload-system"
    """The operator's own namespace: its Service, its TLS Secret."""
    watch_namespaces: tuple[str, ...] = ()
    """Namespaces whose ModelLoads and pods are served; empty serves the whole cluster."""
    liveness_port: int = 8080
    metrics_port: int = 0
    """Prometheus metrics (admissions, refusals by reason, resolve latency) on this port; 0: none."""
    log_level: str = "INFO"
    log_format: LogFormat = "text"
    """text: one human line per record. json: one JSON object per line, for a log pipeline."""
    webhook: WebhookSettings = field(default_factory=WebhookSettings)
    sidecar: SidecarSettings = field(default_factory=SidecarSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    fleet_interval: float = 20.0
    """Seconds between two readings of a peered model's pod stats (status.fleet); one GET per serving pod."""


@dataclass(frozen=True)
class Option:
    flag: str
    env: str
    path: tuple[str, ...]
    convert: Callable[[str], Any]
    help: str


def _choice(*allowed: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in allowed:
            raise ConfigError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return convert


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a port number") from exc
    if not 0 < port < 65536:
        raise ConfigError(f"{port} is not a port number (1-65535)")
    return port


def _port_or_off(text: str) -> int:
    return 0 if text.strip() == "0" else _port(text)


def _group(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a group id") from exc
    if not 0 <= value < 2**31:
        raise ConfigError(f"{value} is not a group id (0 to 2147483647; 0 turns the group off)")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise ConfigError(f"{text!r} is not a number of seconds") from exc
    if not 0 < value < 86400:
        raise ConfigError(f"{value} is not a sensible number of seconds (0 to 86400)")
    return value


def _namespaces(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


OPTIONS: tuple[Option, ...] = (
    Option(
        "--namespace", "MODELLOAD_OPERATOR_NAMESPACE", ("namespace",), str, "the operator's own namespace"
    ),
    Option(
        "--watch-namespaces",
        "MODELLOAD_OPERATOR_WATCH_NAMESPACES",
        ("watch_namespaces",),
        _namespaces,
        "comma-separated namespaces to serve (default: the whole cluster)",
    ),
    Option(
        "--liveness-port", "MODELLOAD_OPERATOR_LIVENESS_PORT", ("liveness_port",), _port, "kopf's /healthz"
    ),
    Option(
        "--metrics-port",
        "MODELLOAD_OPERATOR_METRICS_PORT",
        ("metrics_port",),
        _port_or_off,
        "Prometheus /metrics port (default 0: off)",
    ),
    Option("--log-level", "MODELLOAD_OPERATOR_LOG_LEVEL", ("log_level",), str.upper, "DEBUG, INFO, WARNING"),
    Option(
        "--log-format",
        "MODELLOAD_OPERATOR_LOG_FORMAT",
        ("log_format",),
        _choice("text", "json"),
        "text (default) or json: one JSON object per line",
    ),
    Option("--webhook-port", "MODELLOAD_OPERATOR_WEBHOOK_PORT", ("webhook", "port"), _port, "HTTPS port"),
    Option("--webhook-host", "MODELLOAD_OPERATOR_WEBHOOK_HOST", ("webhook", "host"), str, "bind address"),
    Option(
        "--webhook-tls",
        "MODELLOAD_OPERATOR_WEBHOOK_TLS",
        ("webhook", "tls"),
        _choice("self-signed", "files"),
        "self-signed (the operator manages a CA) or files (cert-manager mounts them)",
    ),
    Option(
        "--cert-dir", "MODELLOAD_OPERATOR_CERT_DIR", ("webhook", "cert_dir"), Path, "tls.crt/tls.key folder"
    ),
    Option("--webhook-service", "MODELLOAD_OPERATOR_WEBHOOK_SERVICE", ("webhook", "service"), str, "Service"),
    Option(
        "--webhook-configuration",
        "MODELLOAD_OPERATOR_WEBHOOK_CONFIGURATION",
        ("webhook", "configuration"),
        str,
        "MutatingWebhookConfiguration whose caBundle the operator sets (self-signed mode)",
    ),
    Option("--tls-secret", "MODELLOAD_OPERATOR_TLS_SECRET", ("webhook", "tls_secret"), str, "CA+cert Secret"),
    Option("--sidecar-image", "MODELLOAD_OPERATOR_SIDECAR_IMAGE", ("sidecar", "image"), str, "sidecar image"),
    Option(
        "--sidecar-pull-policy",
        "MODELLOAD_OPERATOR_SIDECAR_PULL_POLICY",
        ("sidecar", "image_pull_policy"),
        _choice("Always", "IfNotPresent", "Never"),
        "sidecar imagePullPolicy",
    ),
    Option(
        "--sidecar-mode",
        "MODELLOAD_OPERATOR_SIDECAR_MODE",
        ("sidecar", "mode"),
        _choice("auto", "native", "regular"),
        "native sidecar (1.29+), regular container, or auto from the API server's version",
    ),
    Option(
        "--sidecar-log-format",
        "MODELLOAD_OPERATOR_SIDECAR_LOG_FORMAT",
        ("sidecar", "log_format"),
        _choice("text", "json"),
        "the injected sidecars' log format: text (default) or json",
    ),
    Option(
        "--segment-group",
        "MODELLOAD_OPERATOR_SEGMENT_GROUP",
        ("sidecar", "segment_group"),
        _group,
        "group that may read a pod's segment when the pod has no fsGroup (default 8479; 0: none)",
    ),
    Option(
        "--sidecar-working-set",
        "MODELLOAD_OPERATOR_SIDECAR_WORKING_SET",
        ("sidecar", "sizing", "working_set_bytes"),
        parse_bytes,
        "sidecar memory beyond the model (e.g. 512Mi)",
    ),
    Option(
        "--retry-first-delay",
        "MODELLOAD_OPERATOR_RETRY_FIRST_DELAY",
        ("retry", "first_delay"),
        _seconds,
        "seconds before re-trying a ModelLoad that could not be resolved (doubled each time)",
    ),
    Option(
        "--retry-max-delay",
        "MODELLOAD_OPERATOR_RETRY_MAX_DELAY",
        ("retry", "max_delay"),
        _seconds,
        "the longest wait between tries",
    ),
    Option(
        "--sidecar-cpu-request",
        "MODELLOAD_OPERATOR_SIDECAR_CPU_REQUEST",
        ("sidecar", "sizing", "cpu_request"),
        str,
        "sidecar CPU request (e.g. 500m)",
    ),
    Option(
        "--fleet-interval",
        "MODELLOAD_OPERATOR_FLEET_INTERVAL",
        ("fleet_interval",),
        _seconds,
        "seconds between readings of peered models' pod stats into status.fleet (default 20)",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option; each defaults to nothing so :func:`from_args` can fall back to the environment."""
    for option in OPTIONS:
        parser.add_argument(
            option.flag,
            dest=_dest(option),
            default=None,
            metavar=option.flag[2:].upper().replace("-", "_"),
            help=f"{option.help} [{option.env}]",
        )


def _dest(option: Option) -> str:
    return "opt_" + "_".join(option.path)


def from_args(args: argparse.Namespace | None, environ: Mapping[str, str]) -> OperatorSettings:
    """Settings from flags, then ``MODELLOAD_OPERATOR_*`` variables, then the defaults above."""
    values: dict[tuple[str, ...], Any] = {}
    for option in OPTIONS:
        raw = getattr(args, _dest(option), None) if args is not None else None
        source = option.flag
        if raw is None:
            raw = environ.get(option.env)
            source = option.env
        if raw is None or raw == "":
            continue
        try:
            values[option.path] = option.convert(raw)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
    return _build(values)


def _build(values: Mapping[tuple[str, ...], Any]) -> OperatorSettings:
    def pick(prefix: tuple[str, ...]) -> dict[str, Any]:
        return {path[-1]: v for path, v in values.items() if path[:-1] == prefix}

    sizing = SizingDefaults(**pick(("sidecar", "sizing")))
    sidecar = SidecarSettings(**pick(("sidecar",)), sizing=sizing)
    webhook = WebhookSettings(**pick(("webhook",)))
    retry = RetrySettings(**pick(("retry",)))
    if retry.max_delay < retry.first_delay:
        raise ConfigError(
            f"the retry max delay {retry.max_delay} is below the first delay {retry.first_delay}"
        )
    return OperatorSettings(**pick(()), webhook=webhook, sidecar=sidecar, retry=retry)
