"""A file served by a service that authenticates and may hand the download to another host.

The Hugging Face Hub answers a file's resolve URL with a redirect to its CDN or storage bridge, and a
registry answers a blob GET with a redirect to object storage; both want a token on their own requests, and
the redirect target wants none (its URL is signed). :class:`ServiceFile` is an :class:`~._http.HttpObject`
(persistent per-thread connections, ranges read straight into the caller's buffer or spliced into a file,
resume, ETag pinning) that adds, for such services:

- the credentials (:class:`ServiceAuth`) go to the service's own origin only, never to a redirect target;
- a ``401`` from the service with a challenge (``WWW-Authenticate``) asks :meth:`ServiceAuth.renew` for
  fresh credentials once (a registry's first request, or its token expiring mid-load) and retries;
- a ``401``/``403`` from the redirect target (a signed URL that expired during a long load) sends the next
  request back to the service once, for a fresh redirect;
- the service's error answers are explained by the store (``explain``): a gated repository, a missing
  revision, a denied pull, each with what to do.
"""

from __future__ import annotations

import http.client
import logging
import threading
from collections.abc import Callable, Mapping
from email.message import Message
from typing import Protocol
from urllib.parse import urljoin, urlsplit

from modelload.loader.errors import ConfigError, ModelloadError, SourceChangedError, SourceError

from ._base import ObjectInfo
from ._body import read_document
from ._connections import Origin
from ._http import _REDIRECTS, HttpObject, Target, _Exchange
from ._published_digest import PublishedDigest
from ._responses import display_url, error_for_status
from ._retry import retrying
from ._settings import HttpSettings, RetryPolicy
from ._splice import HAVE_SPLICE

__all__ = ["Explain", "ServiceAuth", "ServiceFile", "fetch_document", "origin_of"]

_log = logging.getLogger("modelload.sidecar.sources")

Explain = Callable[[int, str, Message, bytes, bool], ModelloadError]
"""``(status, reason, headers, body, at_service) -> error``: a store's reading of an error answer."""


class ServiceAuth(Protocol):
    """Credentials for one service's origin."""

    @property
    def origin(self) -> Origin:
        """The origin the credentials are for: nothing is sent anywhere else."""
        ...

    def headers(self) -> Mapping[str, str]:
        """The headers to send to :attr:`origin` now (none for anonymous access)."""
        ...

    def renew(self, challenge: str | None) -> bool:
        """After a ``401`` with ``challenge`` (its ``WWW-Authenticate``): get fresh credentials, and say
        whether a retry is worth it."""
        ...


def origin_of(url: str) -> Origin:
    """The origin of an ``http(s)://`` URL; a ConfigError for anything else."""
    parts = urlsplit(url)
    try:
        return Origin.parse(parts.scheme, parts.hostname, parts.port)
    except ValueError as exc:
        raise ConfigError(f"not a usable HTTP(S) URL: {display_url(url)} ({exc})") from exc


def _path(url: str) -> str:
    parts = urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


class ServiceFile(HttpObject):
    """One file at a service URL (a resolve URL, a blob URL), read by ranges; see the module docstring.

    The URL names one version of the file (a Hub commit's resolve URL, a blob digest): ``pins_version``.

    ``size``: the size the service listed, checked against what the download reports. ``checksum``: the
    digest the service publishes for the object (:meth:`checksum`).
    """

    pins_version = True

    def __init__(
        self,
        url: str,
        *,
        display: str,
        settings: HttpSettings,
        auth: ServiceAuth | None = None,
        explain: Explain | None = None,
        size: int | None = None,
        checksum: PublishedDigest | None = None,
        plain_http_advice: str | None = None,
    ) -> None:
        super().__init__(display, settings)
        self._plain_advice = plain_http_advice
        origin = origin_of(url)
        self._service = auth.origin if auth is not None else origin
        self._start = (origin, _path(url))
        self._location = self._start
        self._lock = threading.Lock()
        self._auth = auth
        self._explain = explain
        self._listed_size = size
        self._checksum = checksum
        self.supports_fd = HAVE_SPLICE and not origin.is_tls

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.display_uri!r})"

    def checksum(self) -> PublishedDigest | None:
        """The digest the service publishes for this file's object, when known."""
        return self._checksum

    def _plain_http_advice(self, origin: Origin) -> str:
        return self._plain_advice or super()._plain_http_advice(origin)

    # --- where requests go ------------------------------------------------------------------------------

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        origin, path = self._location
        if self._auth is not None and origin == self._service:
            headers = {**headers, **self._auth.headers()}
        return Target(origin, path, headers)

    def _follow(self, location: str, current: Origin) -> bool:
        """Point later requests at a redirect's ``location``; False when it is not an HTTP(S) URL."""
        url = urljoin(f"{current.scheme}://{current.netloc}/", location)
        try:
            origin = origin_of(url)
        except ConfigError:
            return False
        if origin.is_tls != self._start[0].is_tls or not self.supports_fd:
            self.supports_fd = False  # TLS anywhere on the way: the bytes pass through user space
        with self._lock:
            self._location = (origin, _path(url))
        if origin != self._service:
            _log.debug("%s is served from %s (no credentials sent there)", self.display_uri, display_url(url))
        return True

    def _answered(self, exchange: _Exchange) -> None:
        """A hook for every answer (redirects included): subclasses read service headers here."""

    # --- requests ---------------------------------------------------------------------------------------

    def _open(self, method: str, headers: Mapping[str, str], *, accept: frozenset[int]) -> _Exchange:
        hops = 0
        renewed = rewound = False
        while True:
            exchange = self._send(method, self._target(method, headers))
            self._answered(exchange)
            status = exchange.status
            if status in accept:
                return exchange
            location = exchange.header("Location")
            body = self._small_body(exchange)
            at_service = exchange.origin == self._service
            redirect = status in _REDIRECTS and location and hops < self._settings.max_redirects
            if redirect and self._follow(location or "", exchange.origin):
                hops += 1
                continue
            if status == 401 and at_service and not renewed and self._auth is not None:
                renewed = True
                if self._auth.renew(exchange.header("WWW-Authenticate")):
                    continue
            if status in (401, 403) and not at_service and not rewound:
                # A signed redirect URL expired during a long load: ask the service for a fresh one.
                rewound, hops = True, 0
                with self._lock:
                    self._location = self._start
                continue
            raise self._error(exchange, body)

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        at_service = exchange.origin == self._service
        response = exchange.response
        if self._explain is not None:
            return self._explain(exchange.status, response.reason, response.headers, body, at_service)
        return error_for_status(exchange.status, response.reason, response.headers, uri=self.display_uri)

    def _stat(self) -> ObjectInfo:
        info = super()._stat()
        if self._listed_size is not None and info.size != self._listed_size:
            raise SourceChangedError(
                f"{self.display_uri} is {info.size} bytes where its listing said {self._listed_size}: the "
                "service serves something else than it listed",
                uri=self.display_uri,
            )
        return info

    def get_document(self, *, limit: int, headers: Mapping[str, str] | None = None) -> tuple[bytes, Message]:
        """The whole body of a small document (an API answer, a manifest), at most ``limit`` bytes."""
        exchange = self._open("GET", dict(headers or {}), accept=frozenset({200}))
        try:
            body = read_document(exchange.response, limit + 1, self.floor())
        except (OSError, EOFError, http.client.HTTPException) as exc:
            raise self._translate(exc) from exc
        finally:
            self._pool.discard(exchange.origin, exchange.conn)
        if len(body) > limit:
            raise SourceError(
                f"{self.display_uri} answered more than {limit} bytes where a small document was expected",
                uri=self.display_uri,
            )
        return body, exchange.response.headers


def fetch_document(
    url: str,
    *,
    display: str,
    what: str,
    http: HttpSettings,
    retry: RetryPolicy,
    auth: ServiceAuth | None,
    explain: Explain,
    limit: int,
    headers: Mapping[str, str] | None = None,
    plain_http_advice: str | None = None,
) -> tuple[bytes, Message]:
    """One small document from a service (an API answer, a manifest, a token), with the service's
    credentials and error reading, transient failures retried under ``retry``."""
    service = ServiceFile(
        url, display=display, settings=http, auth=auth, explain=explain, plain_http_advice=plain_http_advice
    )
    try:
        return retrying(
            lambda: service.get_document(limit=limit, headers=headers),
            policy=retry,
            what=f"{what} of {display}",
        )
    finally:
        service.close()
