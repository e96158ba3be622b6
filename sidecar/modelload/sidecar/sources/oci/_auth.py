"""Registry credentials: a Docker config's ``auths``, and the registry token flow.

A registry answers an unauthenticated request with ``401`` and a challenge:

- ``WWW-Authenticate: Bearer realm="https://auth.example/token",service="registry.example",scope="repository:m:pull"``:
  the client asks the realm for a token (``GET realm?service=...&scope=...``, with HTTP Basic credentials
  when it has some, anonymously otherwise; with a Docker config's ``identitytoken``, an OAuth2
  ``refresh_token`` grant by ``POST``) and sends ``Authorization: Bearer <token>`` from then on; a token that
  expires mid-load is renewed on the next ``401``;
- ``WWW-Authenticate: Basic realm=...``: the credentials go as HTTP Basic on every request.

Credentials come from the ``auths`` of a Docker config: the ``kubernetes.io/dockerconfigjson`` Secret a pod's
``imagePullSecrets`` names, or ``~/.docker/config.json`` for the command line. They are sent to the registry
(and to the token realm it names, as the protocol requires), never to the storage a blob download is
redirected to; never over plain HTTP to a realm unless the registry itself is reached over plain HTTP.
"""

from __future__ import annotations

import base64
import http.client
import re
import threading
from collections.abc import Mapping
from email.message import Message
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from modelload.loader.errors import ConfigError, ModelloadError, SourceAccessDeniedError, SourceError

from .._body import read_document
from .._connections import ConnectionPool, Origin
from .._deadline import Deadline
from .._responses import error_for_status, json_body
from .._service import fetch_document, origin_of
from .._settings import HttpSettings, RetryPolicy
from .._splice import RateFloor
from .._transport_errors import translate_transport_error
from ._reference import OciRef

__all__ = ["RegistryAuth", "auths_from_docker_config", "load_docker_config", "login_advice"]

_PARAM = re.compile(r'([A-Za-z]+)="([^"]*)"')
_TOKEN_LIMIT = 1 << 20
_TOKEN = re.compile(r"^[\x21-\x7e]+$")
"""A token as HTTP can carry it in a header: visible ASCII, no space (a JWT, an opaque base64 string)."""


def auths_from_docker_config(data: bytes | str, *, where: str) -> dict[str, dict[str, str]]:
    """The ``auths`` of a Docker config (``.dockerconfigjson``, or ``.dockercfg``'s older flat shape).

    Raises ConfigError naming ``where`` (never a value) when it is not such a document.
    """
    try:
        document = json_body(data)
    except ValueError:
        raise ConfigError(f'{where} is not JSON: it must hold a Docker config ({{"auths": ...}})') from None
    if not isinstance(document, dict):
        raise ConfigError(f"{where} is not a Docker config: expected a JSON object")
    auths = document.get("auths", document if "auths" not in document and document else {})
    if not isinstance(auths, dict):
        raise ConfigError(f"{where}: 'auths' is not an object of registries")
    found: dict[str, dict[str, str]] = {}
    for host, entry in auths.items():
        if not isinstance(entry, dict):
            continue
        found[_host_key(host)] = {k: v for k, v in entry.items() if isinstance(v, str)}
    return found


def load_docker_config(path: Path) -> dict[str, dict[str, str]]:
    """The ``auths`` of the Docker config at ``path``; none when the file does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"the Docker config {path} cannot be read: {exc.strerror}") from None
    return auths_from_docker_config(data, where=f"the Docker config {path}")


def login_advice(registry: str) -> str:
    """How a push gets credentials for ``registry``."""
    return (
        f"log in (docker login {registry}, or oras login {registry}: both write ~/.docker/config.json) or "
        "name a Docker config with --docker-config FILE"
    )


def _host_key(host: str) -> str:
    """A Docker config key as a bare ``host[:port]`` (keys may be URLs: ``https://index.docker.io/v1/``)."""
    if "://" in host:
        host = urlsplit(host).netloc
    return host.rstrip("/").lower()


def parse_challenge(value: str | None) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate`` as its scheme (lower case) and parameters."""
    if not value:
        return "", {}
    scheme, _, rest = value.strip().partition(" ")
    return scheme.lower(), {key.lower(): val for key, val in _PARAM.findall(rest)}


class _Fixed:
    """Headers for one origin (the token realm's request)."""

    def __init__(self, origin: Origin, headers: Mapping[str, str]) -> None:
        self._origin = origin
        self._headers = dict(headers)

    @property
    def origin(self) -> Origin:
        return self._origin

    def headers(self) -> Mapping[str, str]:
        return self._headers

    def renew(self, challenge: str | None) -> bool:
        return False


class RegistryAuth:
    """Credentials for one repository of one registry (:class:`~.._service.ServiceAuth`)."""

    def __init__(
        self,
        ref: OciRef,
        *,
        base_url: str,
        auths: Mapping[str, Mapping[str, str]],
        http: HttpSettings,
        retry: RetryPolicy,
        actions: str = "pull",
        credentials_from: str | None = None,
    ) -> None:
        """``credentials_from``: where ``auths`` came from, for messages (a push's Docker config file);
        None for a pull, whose credentials are a dockerconfigjson Secret's or the sidecar's file."""
        self._ref = ref
        self.pushing = "push" in actions.split(",")
        self.credentials_from = credentials_from or "the dockerconfigjson Secret (or Docker config)"
        self._origin = origin_of(base_url)
        self._http = http
        self._retry = retry
        self._actions = actions
        self._lock = threading.Lock()
        self._header: dict[str, str] = {}
        entry = auths.get(ref.registry) or {}
        self._basic = self._basic_credentials(entry)
        self._identity = entry.get("identitytoken") or None
        self.has_credentials = bool(self._basic or self._identity)

    @property
    def origin(self) -> Origin:
        return self._origin

    def __repr__(self) -> str:
        return (
            f"RegistryAuth({self._ref.registry!r}, credentials={'set' if self.has_credentials else 'none'})"
        )

    def _basic_credentials(self, entry: Mapping[str, str]) -> str | None:
        if entry.get("auth"):
            try:
                decoded = base64.b64decode(entry["auth"], validate=True).decode()
            except (ValueError, UnicodeDecodeError):
                raise ConfigError(
                    f"the Docker config's entry for {self._ref.registry} has an 'auth' that is not base64 of "
                    "user:password"
                ) from None
            if ":" not in decoded:
                raise ConfigError(
                    f"the Docker config's entry for {self._ref.registry} has an 'auth' without a ':' between "
                    "the user and the password"
                )
            return entry["auth"]
        if entry.get("username") and entry.get("password"):
            return base64.b64encode(f"{entry['username']}:{entry['password']}".encode()).decode()
        return None

    def headers(self) -> Mapping[str, str]:
        with self._lock:
            return dict(self._header)

    def renew(self, challenge: str | None) -> bool:
        scheme, params = parse_challenge(challenge)
        if scheme == "basic":
            if self._basic is None:
                return False
            with self._lock:
                self._header = {"Authorization": f"Basic {self._basic}"}
            return True
        if scheme != "bearer" or "realm" not in params:
            return False
        token = self._token(params)
        with self._lock:
            self._header = {"Authorization": f"Bearer {token}"}
        return True

    def _token(self, params: Mapping[str, str]) -> str:
        realm = params["realm"]
        where = f"the token service of {self._ref.registry}"
        realm_origin = origin_of(realm)
        if self.has_credentials and not realm_origin.is_tls and self._origin.is_tls:
            raise SourceAccessDeniedError(
                f"{self._ref.display}: the registry names a token service over plain HTTP "
                f"({realm_origin.netloc})"
                " while it is itself reached over HTTPS: credentials are not sent there",
                uri=self._ref.display,
            )
        scope = f"repository:{self._ref.repository}:{self._actions}"
        query = {"service": params.get("service", ""), "scope": scope}
        headers: dict[str, str] = {}
        if self._basic is not None and self._identity is None:
            headers["Authorization"] = f"Basic {self._basic}"
        url = (
            realm + ("&" if urlsplit(realm).query else "?") + urlencode({k: v for k, v in query.items() if v})
        )
        realm_auth = _Fixed(realm_origin, headers)
        if self._identity is not None:
            body = self._refresh_grant(url, query)
        else:
            body, _ = fetch_document(
                url,
                display=where,
                what="token",
                http=self._http,
                retry=self._retry,
                auth=realm_auth,
                explain=self._token_error,
                limit=_TOKEN_LIMIT,
            )
        try:
            answer = json_body(body)
        except ValueError:
            answer = None
        token = (answer.get("token") or answer.get("access_token")) if isinstance(answer, dict) else None
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise SourceError(f"{where} answered no usable token", uri=self._ref.display)
        return token

    def _refresh_grant(self, url: str, query: Mapping[str, str]) -> bytes:
        """An identity token (``docker login`` to some registries stores one) is exchanged by POST, on a
        connection of the same pool as every other request (its CA bundle, proxy and address rules)."""
        assert self._identity is not None
        form = urlencode(
            {
                **query,
                "grant_type": "refresh_token",
                "refresh_token": self._identity,
                "client_id": "modelload",
            }
        ).encode()
        origin, path = origin_of(url), urlsplit(url).path or "/"
        pool = ConnectionPool(self._http)
        try:
            conn, _ = pool.acquire(origin)
            head = Deadline(lambda: conn.sock, self._http.stall_timeout + self._http.slow_window)
            with head:
                conn.request(
                    "POST", pool.request_path(origin, path), body=form,
                    headers={"Content-Type": "application/x-www-form-urlencoded"},
                )  # fmt: skip
                response = conn.getresponse()
            if head.fired:
                raise head.error("the token service's status line and headers")
            floor = RateFloor(self._http.min_rate, self._http.slow_window)
            body = read_document(response, _TOKEN_LIMIT, floor)
        except (OSError, EOFError, http.client.HTTPException) as exc:
            # by what broke, never its text: a status line or a URL it quotes is the service's to fill
            raise translate_transport_error(
                exc,
                uri=f"the token service of {self._ref.registry}",
                settings=self._http,
                plain_http_advice=lambda origin: (
                    "the registry names its token service with https:// and the service answers in plain"
                    " HTTP: the registry's token configuration is wrong"
                ),
            ) from None
        finally:
            pool.close()
        if response.status != 200:
            raise self._token_error(response.status, response.reason, response.headers, body, True)
        return body

    def _token_error(
        self, status: int, reason: str, headers: Message, body: bytes, at_service: bool
    ) -> ModelloadError:
        shown = self._ref.display
        if status in (401, 403):
            if self.has_credentials:
                return SourceAccessDeniedError(
                    f"{shown}: the registry's token service refused the credentials for {self._ref.registry} "
                    f"(HTTP {status}): check the user and password (or token) in {self.credentials_from}",
                    uri=shown,
                )
            if self.pushing:
                return SourceAccessDeniedError(
                    f"{shown}: the registry's token service refused an anonymous push (HTTP {status}): "
                    + login_advice(self._ref.registry),
                    uri=shown,
                )
            return SourceAccessDeniedError(
                f"{shown}: the registry's token service refused an anonymous pull (HTTP {status}): give "
                "credentials with a dockerconfigjson Secret (the ModelLoad's registry credentialsSecretRef, "
                "the "
                "same Secret as a pod's imagePullSecrets)",
                uri=shown,
            )
        return error_for_status(status, reason, headers, uri=f"the token service of {self._ref.registry}")
