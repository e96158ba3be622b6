"""A plain ``http://`` or ``https://`` URL as a source: a file server, a model hub, a presigned URL.

:class:`HttpSource` is the range-read engine of :mod:`._http` pointed at one URL, with what a URL adds: its
user and password, or configured headers, sent to its own origin only; redirects followed and remembered; a
redirect of ``/dir`` to ``/dir/`` told as a directory; 401 and 403 answers that say which credentials were
refused and where. :func:`open_http` is the registry's factory for both schemes.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Mapping
from urllib.parse import unquote, urlsplit

from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceUriError,
)

from ._connections import ConnectionPool, Origin
from ._http import HttpObject, Target, _Exchange
from ._responses import display_url, status_text
from ._settings import HttpSettings, SourceSettings
from ._splice import HAVE_SPLICE

__all__ = ["HttpSource", "open_http"]

_log = logging.getLogger("modelload.sidecar.sources")


class HttpSource(HttpObject):
    """A plain ``http://`` or ``https://`` URL, such as a file server, a model hub or a presigned URL.

    Private servers: credentials in the URL (``https://user:password@host/...``) become a Basic
    Authorization header, and ``settings.headers`` (a bearer token or header lines from a header file or a
    Secret) are added as they are. Both go to the URL's own origin (scheme, host and port) only: on every
    request there, retries and same-origin redirects included, and never to another origin. A redirect to
    another origin (a hub sending a download to its CDN with a signed URL) is followed without them, so a
    token never reaches a host it was not given for; when that host refuses, the error says so.

    Query strings (presigned signatures) are sent but never shown. Redirects are followed up to
    ``max_redirects`` and remembered, so range reads go straight to the final location.
    """

    def __init__(self, url: str, settings: HttpSettings, *, pool: ConnectionPool | None = None) -> None:
        parts = urlsplit(url)
        try:
            origin = Origin.parse(parts.scheme, parts.hostname, parts.port)
        except ValueError as exc:
            raise ConfigError(f"not a usable HTTP(S) URL: {display_url(url)} ({exc})") from exc
        super().__init__(display_url(url), settings, pool=pool)
        self.supports_fd = HAVE_SPLICE and not origin.is_tls
        self._lock = threading.Lock()
        self._origin = origin
        self._start = (origin, _request_path(url))
        self._location = self._start
        self._private: dict[str, str] = dict(settings.headers.items()) if settings.headers else {}
        self._from_url = not self._private  # what is sent, if anything, is the URL's user and password
        if parts.username is not None:
            if settings.headers is not None and settings.headers.has("Authorization"):
                raise ConfigError(
                    f"{self.display_uri}: the URL carries a user and password and the configured headers set "
                    "Authorization too: give the credentials one way"
                )
            user_pass = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._private["Authorization"] = "Basic " + base64.b64encode(user_pass).decode("ascii")

    def _plain_http_advice(self, origin: Origin) -> str:
        if origin == self._origin and self.display_uri.startswith("https://"):
            return f"if it serves plain HTTP, use http://{self.display_uri.removeprefix('https://')}"
        return super()._plain_http_advice(origin)

    def __repr__(self) -> str:
        return f"HttpSource({self.display_uri!r})"

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        origin, path = self._location
        if self._private and origin == self._origin:
            headers = {**headers, **self._private}
        return Target(origin, path, headers)

    def _open(self, method: str, headers: Mapping[str, str], *, accept: frozenset[int]) -> _Exchange:
        """As every HTTP read, and once more from the source URL itself when a place it redirected to (and
        that later reads went straight to) refuses access: a signed redirect URL expires (a CDN's, a release
        download's: minutes), and a long load must not fail for good at the first range after that."""
        try:
            return super()._open(method, headers, accept=accept)
        except SourceAccessDeniedError:
            with self._lock:
                moved, self._location = self._location != self._start, self._start
            if not moved:
                raise
            _log.info("%s: the URL it redirected to was refused; asking the source again", self.display_uri)
            return super()._open(method, headers, accept=accept)

    def _redirect(self, location: str) -> bool:
        parts = urlsplit(location)
        try:
            origin = Origin.parse(parts.scheme, parts.hostname, parts.port)
        except ValueError:
            return False
        with self._lock:
            current, path = self._location
            if current.scheme == "https" and origin.scheme == "http":
                raise SourceError(
                    f"{self.display_uri} redirects to {display_url(location)}, plain HTTP: a file asked for"
                    " over TLS is not read in clear, where anything on the way could change its bytes; serve"
                    " it over https, or name the http:// URL as the source if plain HTTP is meant",
                    uri=self.display_uri,
                )
            if origin == current and _is_directory_redirect(path, _request_path(location)):
                raise SourceUriError(
                    f"{self.display_uri} names a directory (the server redirects to {display_url(location)}):"
                    f" end the source with '/' to load the model in it ({self.display_uri}/)"
                )
            self._location = (origin, _request_path(location))
        if self._private and origin != self._origin:
            _log.info(
                "%s redirects to %s, another origin: its credentials and headers are not sent there",
                self.display_uri,
                display_url(location),
            )
        else:
            _log.info("%s redirects to %s", self.display_uri, display_url(location))
        return True

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        status = exchange.status
        if status not in (401, 403):
            return super()._error(exchange, body)
        uri = self.display_uri
        what = status_text(status)
        if exchange.origin != self._origin:
            where = f"{exchange.origin.scheme}://{exchange.origin.netloc}"
            if self._private:
                advice = (
                    "the source's token and headers go to its own origin only, never to another host; if "
                    f"{where} needs them, load the file from that origin directly; a signed redirect URL may "
                    "also have expired (retry)"
                )
            else:
                advice = "a signed redirect URL may have expired (retry), or the file needs a token"
            return SourceAccessDeniedError(
                f"{uri} redirected to {where}, which refused access ({what}): {advice}", uri=uri
            )
        if self._private and self._from_url:
            return SourceAccessDeniedError(
                f"{uri} refused the URL's user and password ({what}): check them and the server's rules",
                uri=uri,
            )
        if self._private:
            return SourceAccessDeniedError(
                f"{uri} refused the configured token or headers ({what}): check that the Secret (or header "
                "file) holds the right token, that it has not expired or been revoked, and that its scope "
                "grants read access to this file (a gated model's terms accepted, the repository shared)",
                uri=uri,
            )
        return SourceAccessDeniedError(
            f"{uri} refused access ({what}) and no token was sent: give one with the ModelLoad's "
            "headersSecretRef (the sidecar's --header-file); a presigned URL may have expired",
            uri=uri,
        )


def _is_directory_redirect(path: str, target: str) -> bool:
    """A server's redirect of ``/dir`` to ``/dir/``: the URL names a directory, not a file."""
    return "?" not in path and not path.endswith("/") and target == path + "/"


def _request_path(url: str) -> str:
    parts = urlsplit(url)
    path = parts.path or "/"
    return f"{path}?{parts.query}" if parts.query else path


def open_http(uri: str, settings: SourceSettings) -> HttpSource:
    """The registry's factory for ``http://`` and ``https://`` URLs."""
    return HttpSource(uri, settings.http)
