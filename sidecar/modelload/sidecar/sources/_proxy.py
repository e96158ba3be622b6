"""Origin reads through an HTTP proxy (``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY``, or ``--proxy``).

A cluster that runs Dragonfly (or any caching proxy) can route the sidecar's origin reads through its
``dfdaemon``: plain ``http://`` requests go to the proxy in absolute form (``GET http://host/path``), so the
proxy sees and can cache each range; ``https://`` requests go through a ``CONNECT`` tunnel, end-to-end TLS
to the origin (a proxy that should cache HTTPS must terminate TLS itself, which is its own configuration).
``NO_PROXY`` lists hosts that are reached directly: exact names or IPs, domain suffixes (``.svc`` or
``svc``), ``*`` for all. Peers never go through the proxy: they are the pods' own network.

The variables are read at the edge (the sidecar's settings, the operator) into :class:`ProxySettings`; this
package never reads the environment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from modelload.loader.errors import ConfigError

from ._responses import redact_uri

__all__ = ["ProxySettings", "proxy_from_environ"]


@dataclass(frozen=True)
class ProxySettings:
    """Where origin requests go: ``http`` for ``http://`` origins, ``https`` for ``https://`` ones (each a
    ``(host, port)`` or None for direct), except the hosts in ``no_proxy``."""

    http: tuple[str, int] | None = None
    https: tuple[str, int] | None = None
    no_proxy: tuple[str, ...] = ()

    def for_origin(self, scheme: str, host: str) -> tuple[str, int] | None:
        """The proxy for an origin, or None to connect directly."""
        proxy = self.https if scheme == "https" else self.http
        if proxy is None or self.bypassed(host):
            return None
        return proxy

    def bypassed(self, host: str) -> bool:
        host = host.lower().strip("[]")
        for entry in self.no_proxy:
            if entry == "*":
                return True
            suffix = entry if entry.startswith(".") else "." + entry
            if host == entry.lstrip(".") or host.endswith(suffix):
                return True
        return False


def _address(url: str, *, name: str) -> tuple[str, int]:
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(
            f"{name}: expected a plain-HTTP proxy URL such as http://dfdaemon.dragonfly:4001,"
            f" got {redact_uri(url)!r}"
        )
    if parts.username or parts.password:
        raise ConfigError(
            f"{name}: credentials in the proxy URL are not supported; use a proxy inside the cluster"
        )
    return parts.hostname, parts.port or 80


def proxy_from_environ(environ: Mapping[str, str], *, override: str | None = None) -> ProxySettings | None:
    """The proxy settings from ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` (either case, lower case first
    as curl reads them), or ``override`` (``--proxy``) for both schemes; None when no proxy is set."""

    def get(name: str) -> str | None:
        value = environ.get(name.lower()) or environ.get(name.upper())
        return value.strip() if value and value.strip() else None

    http: tuple[str, int] | None
    https: tuple[str, int] | None
    if override is not None:
        http = https = _address(override, name="--proxy/MODELLOAD_PROXY")
    else:
        plain, secure = get("http_proxy"), get("https_proxy")
        http = _address(plain, name="HTTP_PROXY") if plain else None
        https = _address(secure, name="HTTPS_PROXY") if secure else None
    if http is None and https is None:
        return None
    no_proxy = tuple(e.strip().lower() for e in (get("no_proxy") or "").split(",") if e.strip())
    return ProxySettings(http=http, https=https, no_proxy=no_proxy)
