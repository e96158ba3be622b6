"""The operator's settings: typed, grouped, read once at the edge (flags and ``MODELLOAD_OPERATOR_*``).

Every knob is one row of :data:`OPTIONS`: the field it fills, its flag, its environment variable and its
parser; its default and why are on the dataclasses below, once (``--help`` shows the field's default). The
rows are the loader's :class:`~modelload.loader.options.Option`, read as the sidecar reads its own (a flag
wins over the variable, an empty variable is unset, a bad value is a ConfigError naming the flag or
variable). The Helm chart sets the variables, and nothing below this module reads the environment.

:class:`InjectedSidecar` is the sidecar as the webhook writes it into pods (image, mode, port, group); the
sidecar's own settings, which it reads from the variables the webhook sets, are
``modelload.sidecar.settings.SidecarSettings``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from modelload.loader import options
from modelload.loader._logjson import parse_log_format
from modelload.loader.errors import ConfigError
from modelload.loader.options import Given, Option, parse_list, parse_text
from modelload.loader.wiring import STATUS_PORT
from modelload.operator.quantity import format_mib, parse_bytes
from modelload.operator.sizing import SizingDefaults
from modelload.sidecar.sources import Network, parse_networks

__all__ = [
    "OPTIONS",
    "OperatorSettings",
    "RetrySettings",
    "InjectedSidecar",
    "WebhookSettings",
    "add_arguments",
    "from_args",
]

SidecarMode = Literal["auto", "native", "regular"]
TlsMode = Literal["self-signed", "files"]
LogFormat = Literal["text", "json"]
DEFAULT_SIDECAR_IMAGE = "ghcr.io/modelload/sidecar:0.1.0"


@dataclass(frozen=True)
class InjectedSidecar:
    """The sidecar container the webhook injects into a pod, when its ModelLoad does not say otherwise."""

    image: str = DEFAULT_SIDECAR_IMAGE
    image_pull_policy: str = "IfNotPresent"
    mode: SidecarMode = "auto"
    """native: an init container with restartPolicy Always (Kubernetes 1.29+ with the SidecarContainers gate,
    on by default from 1.29). regular: a container that never exits. auto: native when the API server
    reports 1.29 or later; set native/regular when nodes lag the control plane or the gate is off."""
    port: int = STATUS_PORT
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
    sidecar: InjectedSidecar = field(default_factory=InjectedSidecar)
    retry: RetrySettings = field(default_factory=RetrySettings)
    fleet_interval: float = 20.0
    """Seconds between two readings of a peered model's pod stats (status.fleet; one GET per serving pod),
    and of the reasons of the pods whose sidecar is running and not ready (one GET each: Events on the pod,
    the ModelLoad's Degraded condition)."""
    source_networks: tuple[Network, ...] = ()
    """Networks, besides public addresses, the operator may read ModelLoad sources from (it reads each
    model's index). Default none: a source at a loopback, link-local (cloud metadata), private or other
    non-public address is refused as BadSource, so a ModelLoad cannot make the operator probe the cluster.
    An in-cluster S3 store or artifact server needs its network here (the chart's ``sourceNetworks``, for
    example ``10.0.0.0/8``); the address is checked at every connection, redirects included."""


def _choice(*allowed: str) -> Callable[[str], str]:
    """One of ``allowed``, exactly: Kubernetes' enums (``IfNotPresent``) are case-sensitive."""

    def convert(text: str) -> str:
        if text not in allowed:
            raise ConfigError(f"{text!r} is not one of {', '.join(allowed)}")
        return text

    return convert


def _number(convert: Callable[[str], Any], what: str, valid: Callable[[Any], bool], bounds: str) -> Any:
    """A parser of the numbers ``convert`` reads and ``valid`` accepts; messages say ``what``, ``bounds``."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError as exc:
            raise ConfigError(f"{text!r} is not {what}") from exc
        if not valid(value):
            raise ConfigError(f"{value} is not {bounds}")
        return value

    return parse


_port: Callable[[str], int] = _number(
    int, "a port number", lambda v: 0 < v < 65536, "a port number (1-65535)"
)
_group: Callable[[str], int] = _number(
    int, "a group id", lambda v: 0 <= v < 2**31, "a group id (0 to 2147483647; 0 turns the group off)"
)
_seconds: Callable[[str], float] = _number(
    float, "a number of seconds", lambda v: 0 < v < 86400, "a sensible number of seconds (0 to 86400)"
)


def _port_or_off(text: str) -> int:
    return 0 if text.strip() == "0" else _port(text)


OPTIONS: tuple[Option, ...] = (
    Option(
        "namespace",
        "--namespace",
        "MODELLOAD_OPERATOR_NAMESPACE",
        "the operator's own namespace",
        parse=parse_text,
    ),
    Option(
        "watch_namespaces",
        "--watch-namespaces",
        "MODELLOAD_OPERATOR_WATCH_NAMESPACES",
        "comma-separated namespaces to serve",
        parse=parse_list,
        unset="the whole cluster",
    ),
    Option(
        "liveness_port", "--liveness-port", "MODELLOAD_OPERATOR_LIVENESS_PORT", "kopf's /healthz", parse=_port
    ),
    Option(
        "metrics_port",
        "--metrics-port",
        "MODELLOAD_OPERATOR_METRICS_PORT",
        "Prometheus /metrics port, 0: off",
        parse=_port_or_off,
    ),
    Option(
        "log_level", "--log-level", "MODELLOAD_OPERATOR_LOG_LEVEL", "DEBUG, INFO, WARNING", parse=str.upper
    ),
    Option(
        "log_format",
        "--log-format",
        "MODELLOAD_OPERATOR_LOG_FORMAT",
        "text, or json: one JSON object per line",
        parse=parse_log_format,
    ),
    Option("webhook.port", "--webhook-port", "MODELLOAD_OPERATOR_WEBHOOK_PORT", "HTTPS port", parse=_port),
    Option(
        "webhook.host", "--webhook-host", "MODELLOAD_OPERATOR_WEBHOOK_HOST", "bind address", parse=parse_text
    ),
    Option(
        "webhook.tls",
        "--webhook-tls",
        "MODELLOAD_OPERATOR_WEBHOOK_TLS",
        "self-signed (the operator manages a CA) or files (cert-manager mounts them)",
        parse=_choice("self-signed", "files"),
    ),
    Option(
        "webhook.cert_dir", "--cert-dir", "MODELLOAD_OPERATOR_CERT_DIR", "tls.crt/tls.key folder", parse=Path
    ),
    Option(
        "webhook.service",
        "--webhook-service",
        "MODELLOAD_OPERATOR_WEBHOOK_SERVICE",
        "Service",
        parse=parse_text,
    ),
    Option(
        "webhook.configuration",
        "--webhook-configuration",
        "MODELLOAD_OPERATOR_WEBHOOK_CONFIGURATION",
        "MutatingWebhookConfiguration whose caBundle the operator sets (self-signed mode)",
        parse=parse_text,
    ),
    Option(
        "webhook.tls_secret",
        "--tls-secret",
        "MODELLOAD_OPERATOR_TLS_SECRET",
        "CA+cert Secret",
        parse=parse_text,
    ),
    Option(
        "sidecar.image",
        "--sidecar-image",
        "MODELLOAD_OPERATOR_SIDECAR_IMAGE",
        "sidecar image",
        parse=parse_text,
    ),
    Option(
        "sidecar.image_pull_policy",
        "--sidecar-pull-policy",
        "MODELLOAD_OPERATOR_SIDECAR_PULL_POLICY",
        "sidecar imagePullPolicy",
        parse=_choice("Always", "IfNotPresent", "Never"),
    ),
    Option(
        "sidecar.mode",
        "--sidecar-mode",
        "MODELLOAD_OPERATOR_SIDECAR_MODE",
        "native sidecar (1.29+), regular container, or auto from the API server's version",
        parse=_choice("auto", "native", "regular"),
    ),
    Option(
        "sidecar.log_format",
        "--sidecar-log-format",
        "MODELLOAD_OPERATOR_SIDECAR_LOG_FORMAT",
        "the injected sidecars' log format: text or json",
        parse=parse_log_format,
    ),
    Option(
        "sidecar.segment_group",
        "--segment-group",
        "MODELLOAD_OPERATOR_SEGMENT_GROUP",
        "group that may read a pod's segment when the pod has no fsGroup, 0: none",
        parse=_group,
    ),
    Option(
        "sidecar.sizing.working_set_bytes",
        "--sidecar-working-set",
        "MODELLOAD_OPERATOR_SIDECAR_WORKING_SET",
        "sidecar memory beyond the model, a quantity",
        parse=parse_bytes,
        show=format_mib,
    ),
    Option(
        "retry.first_delay",
        "--retry-first-delay",
        "MODELLOAD_OPERATOR_RETRY_FIRST_DELAY",
        "seconds before re-trying a ModelLoad that could not be resolved, doubled each time",
        parse=_seconds,
    ),
    Option(
        "retry.max_delay",
        "--retry-max-delay",
        "MODELLOAD_OPERATOR_RETRY_MAX_DELAY",
        "the longest wait between tries",
        parse=_seconds,
    ),
    Option(
        "sidecar.sizing.cpu_request",
        "--sidecar-cpu-request",
        "MODELLOAD_OPERATOR_SIDECAR_CPU_REQUEST",
        "sidecar CPU request, a quantity",
        parse=parse_text,
    ),
    Option(
        "source_networks",
        "--source-networks",
        "MODELLOAD_OPERATOR_SOURCE_NETWORKS",
        "comma-separated networks (CIDR) besides public addresses that ModelLoad sources may be read from"
        " (default none: loopback, link-local and private addresses are refused)",
        parse=parse_networks,
    ),
    Option(
        "fleet_interval",
        "--fleet-interval",
        "MODELLOAD_OPERATOR_FLEET_INTERVAL",
        "seconds between readings of peered models' pod stats into status.fleet",
        parse=_seconds,
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per option; each defaults to nothing so :func:`from_args` can fall back to the environment."""
    options.add_arguments(parser, OPTIONS, settings=OperatorSettings)


def from_args(args: argparse.Namespace | None, environ: Mapping[str, str]) -> OperatorSettings:
    """Settings from flags, then ``MODELLOAD_OPERATOR_*`` variables, then the defaults above."""
    given = Given(OPTIONS, vars(args) if args is not None else {}, environ)
    sizing = given.build(SizingDefaults, "sidecar.sizing")
    retry = given.build(RetrySettings, "retry")
    if retry.max_delay < retry.first_delay:
        raise ConfigError(
            f"the retry max delay {retry.max_delay} is below the first delay {retry.first_delay}"
        )
    return given.build(
        OperatorSettings,
        webhook=given.build(WebhookSettings, "webhook"),
        sidecar=given.build(InjectedSidecar, "sidecar", sizing=sizing),
        retry=retry,
    )
