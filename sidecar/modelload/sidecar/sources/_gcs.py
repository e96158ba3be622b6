"""Google Cloud Storage (``gs://BUCKET/OBJECT``): google-auth gives the token, our own reads move bytes.

google-auth does what it is made for, once per model (a directory's shards share it): Application Default
Credentials (``GOOGLE_APPLICATION_CREDENTIALS`` naming a service-account key or a workload identity
federation configuration, the GKE metadata server for Workload Identity, gcloud's user credentials), or the
JSON a ModelLoad's Secret holds; it refreshes the token before it expires. Everything else is this module:

- the object's metadata (one JSON GET: size, generation, CRC32C and MD5) pins the load to one *generation*;
- every range is a GET of ``alt=media&generation=G&ifGenerationMatch=G`` on this thread's persistent
  connection (:class:`~._http.HttpObject`: straight into the caller's buffer, or spliced into the segment's
  file over plain HTTP), and its ``X-Goog-Generation`` is checked: a replaced object fails the read with
  SourceChangedError, whatever an emulator does with the preconditions;
- a prefix is listed with ``objects.list`` (``delimiter=/``: the top level only).

``STORAGE_EMULATOR_HOST`` is honoured as Google's clients do: without an explicit endpoint, requests go there,
without credentials.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceError,
    SourceUriError,
)

from ._base import InterruptedReadError, ObjectInfo
from ._body import read_document
from ._checksums import StoreChecksum
from ._cloud_errors import gcs_error, scrub
from ._connections import ConnectionPool, Origin
from ._http import HttpObject, Target, _Exchange
from ._responses import display_url, json_body
from ._settings import GcsSettings, SourceSettings
from ._splice import HAVE_SPLICE
from ._store import Directory, ListedFile, Opener, Store, check_listing_size, shared_opener

__all__ = ["GcsSource", "GcsSpelling", "GcsStore", "list_gcs_prefix", "open_gcs", "parse_gs_uri"]

_log = logging.getLogger("modelload.sidecar.sources")
READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
GOOGLE_TOKEN_URI = "https://oauth2.googleapis.com/token"  # noqa: S105 - a URL
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
EMULATOR_ENV = "STORAGE_EMULATOR_HOST"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,220}[a-z0-9]$")
_PATH = ":path"  # an internal header: the request path of a metadata or listing request (never sent)
_JSON_MAX = 16 << 20
_PAGES_MAX = 64


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/object`` as ``(bucket, object)``; an object may be empty for a bucket's top level."""
    rest = uri[len("gs://") :] if uri[:5].lower() == "gs://" else uri
    bucket, _, name = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise SourceUriError(
            f"a GCS source is gs://BUCKET/OBJECT (or gs://BUCKET/PREFIX/; the bucket: 3-222 lower-case"
            f" letters, digits, dots, dashes and underscores), got {uri!r}"
        )
    return bucket, name


def _google() -> Any:
    """google-auth, imported on first use: only GCS sources pay for it (the ``gcs`` extra)."""
    try:
        import google.auth
        import google.auth.credentials
        import google.auth.exceptions
        import google.auth.transport.requests
    except ImportError as exc:
        raise ConfigError(
            "gs:// sources need google-auth: install modelload[gcs] (the sidecar image has it)"
        ) from exc
    return google


@dataclass
class _Access:
    """What one GCS setting resolved to, shared by the files of one model."""

    origin: Origin
    prefix: str
    credentials: Any
    identity: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    request: Any = None

    def authorization(self, display: str) -> dict[str, str]:
        """This request's Authorization header: google-auth refreshes the token when it is about to expire."""
        if self.credentials is None:
            return {}
        google = _google()
        headers: dict[str, str] = {}
        try:
            with self.lock:
                if self.request is None:
                    self.request = google.auth.transport.requests.Request()
                self.credentials.before_request(self.request, "GET", f"{self.origin.scheme}://x/", headers)
        except google.auth.exceptions.TransportError as exc:
            raise InterruptedReadError(
                f"{display}: fetching a Google access token for {self.identity} failed"
                f" ({type(exc).__name__}); will retry",
                uri=display,
            ) from exc
        except google.auth.exceptions.GoogleAuthError as exc:
            if getattr(exc, "retryable", False):
                raise InterruptedReadError(
                    f"{display}: the token service asked to retry for {self.identity}", uri=display
                ) from exc
            raise SourceAccessDeniedError(
                f"{display}: no Google access token could be obtained for {self.identity}"
                f" ({type(exc).__name__}: {scrub(str(exc))}): check the service-account key or the workload"
                " identity binding (the Kubernetes ServiceAccount's iam.gke.io/gcp-service-account annotation"
                " and the Google service account's roles/iam.workloadIdentityUser)",
                uri=display,
            ) from exc
        return {k: v for k, v in headers.items() if k.lower() == "authorization"}


def _identity(credentials: Any) -> str:
    """Who the credentials are, for messages: a service account's e-mail where known."""
    email = getattr(credentials, "service_account_email", None)
    kind = type(credentials).__module__
    if isinstance(email, str) and email and email != "default":
        return f"the service account {email}"
    if "compute_engine" in kind:
        return "the service account of the GKE (or GCE) metadata server"
    if "external_account" in kind or "identity_pool" in kind:
        audience = getattr(credentials, "_audience", None) or ""
        return f"the workload identity federation principal{' of ' + audience if audience else ''}"
    if "credentials" in kind and hasattr(credentials, "refresh_token"):
        return "gcloud's user credentials"
    return "the Application Default Credentials"


def _endpoint(gcs: GcsSettings) -> tuple[str, bool]:
    """The JSON API's base URL, and whether it is an emulator named by STORAGE_EMULATOR_HOST."""
    if gcs.endpoint_url:
        return gcs.endpoint_url, False
    emulator = os.environ.get(EMULATOR_ENV, "").strip()
    if emulator:
        return (emulator if "://" in emulator else f"http://{emulator}"), True
    return DEFAULT_ENDPOINT, False


def resolve_access(gcs: GcsSettings, display: str) -> _Access:
    """The endpoint and credentials of ``gcs``: google-auth's ADC, an explicit JSON, or none."""
    url, emulator = _endpoint(gcs)
    parts = urlsplit(url)
    try:
        origin = Origin.parse(parts.scheme, parts.hostname, parts.port)
    except ValueError as exc:
        raise ConfigError(f"not a usable GCS endpoint: {url!r} ({exc})") from exc
    prefix = parts.path.rstrip("/")
    if gcs.anonymous or (emulator and gcs.credentials_json is None):
        return _Access(origin, prefix, None, "anonymous access")
    google = _google()
    try:
        # Loaded without scopes, then scoped: with scopes, google-auth would also look the project up (a
        # Resource Manager call a loader needs neither the answer nor the permission for).
        if gcs.credentials_json is not None:
            credentials = _service_account(google, json.loads(gcs.credentials_json), display)
        else:
            credentials, _ = google.auth.default()
        credentials = google.auth.credentials.with_scopes_if_required(credentials, [READ_SCOPE])
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(
            f"{display}: the Google credentials are not valid JSON: give a service-account key or a workload"
            " identity federation configuration file"
        ) from None
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise SourceAccessDeniedError(
            f"{display}: no Google credentials found ({scrub(str(exc))}): in a pod, bind its Kubernetes"
            " ServiceAccount to a Google service account (GKE Workload Identity), or reference a key in"
            " credentialsSecretRef; elsewhere, point GOOGLE_APPLICATION_CREDENTIALS at a service-account key"
            " or run gcloud auth application-default login",
            uri=display,
        ) from exc
    return _Access(origin, prefix, credentials, _identity(credentials))


def _service_account(google: Any, info: Any, display: str) -> Any:
    """A service-account key given as JSON (a Secret's). Only that type: a federation configuration names
    files and URLs to fetch, which a Secret's author must not make another pod (the operator) read; and only
    with Google's own token service as its ``token_uri``, for the same reason."""
    import google.oauth2.service_account

    if not isinstance(info, dict) or info.get("type") != "service_account":
        kind = info.get("type") if isinstance(info, dict) else None
        raise ConfigError(
            f"{display}: the Google credentials given are of type {kind!r}; a Secret holds a service-account"
            " key (type service_account). Workload identity federation and GKE Workload Identity need"
            " no Secret:"
            " the pod's ServiceAccount (and GOOGLE_APPLICATION_CREDENTIALS in the pod) gives them"
        )
    token_uri = info.get("token_uri")
    if token_uri is not None and not _google_token_service(token_uri):
        raise ConfigError(
            f"{display}: the service-account key's token_uri is {display_url(str(token_uri))}; a key given"
            f" in a Secret must name Google's token service ({GOOGLE_TOKEN_URI}, as keys Google issues"
            " do): the signed assertion would be posted, and its answer shown, wherever the key points"
        )
    return google.oauth2.service_account.Credentials.from_service_account_info(info)


def _google_token_service(uri: object) -> bool:
    """Whether ``uri`` is Google's OAuth token service (or one of its regional or private endpoints)."""
    if not isinstance(uri, str):
        return False
    parts = urlsplit(uri)
    host = (parts.hostname or "").lower()
    return parts.scheme == "https" and (host.endswith(".googleapis.com") or host == "accounts.google.com")


class GcsSource(HttpObject):
    """One GCS object, pinned to the generation its first look-up saw."""

    pins_version = True
    """Its validator changes with every write: no sampled re-reads are needed (``load/integrity.py``)."""

    def __init__(
        self,
        bucket: str,
        name: str,
        settings: SourceSettings,
        *,
        access: _Access | None = None,
        listing: bool = False,
        pool: ConnectionPool | None = None,
    ) -> None:
        """``listing``: this source only lists ``name`` (a prefix, empty for the bucket's top level).
        ``pool``: a sibling's connections, to share."""
        if not name and not listing:
            raise SourceUriError(f"a GCS source is gs://BUCKET/OBJECT, got gs://{bucket}/")
        display = f"gs://{bucket}/{name}"
        self._bucket, self._name = bucket, name
        self._settings_all = settings
        self._access = access if access is not None else resolve_access(settings.gcs, display)
        super().__init__(display, settings.http, pool=pool)
        self.supports_fd = HAVE_SPLICE and not self._access.origin.is_tls
        self._object_path = (
            f"{self._access.prefix}/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}"
        )

    def sibling(self, name: str, *, pool: ConnectionPool) -> GcsSource:
        """Another object of the same bucket, sharing the endpoint and credentials, and the connections of
        ``pool`` (see :func:`~._store.shared_opener`)."""
        return GcsSource(self._bucket, name, self._settings_all, access=self._access, pool=pool)

    @property
    def identity(self) -> str:
        return self._access.identity

    def _generation(self) -> str | None:
        info = self._info
        return info.etag.strip('"') if info is not None and info.etag else None

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        sent = dict(headers)
        path = sent.pop(_PATH, None)
        if path is None:
            generation = self._generation()
            pin = f"&generation={generation}&ifGenerationMatch={generation}" if generation else ""
            path = f"{self._object_path}?alt=media{pin}"
        sent.update(self._access.authorization(self.display_uri))
        return Target(self._access.origin, path, sent)

    def _pin(self, info: ObjectInfo) -> dict[str, str]:
        return {}  # the generation is in the query string

    def _change(self, exchange: _Exchange, info: ObjectInfo) -> str | None:
        served = exchange.header("X-Goog-Generation")
        pinned = (info.etag or "").strip('"')
        if served and pinned and served != pinned:
            return f"generation {pinned} -> {served}"
        return None

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        return gcs_error(
            exchange.status,
            exchange.response.headers,
            body,
            bucket=self._bucket,
            name=self._name,
            identity=self._access.identity,
            pinned=self._generation(),
        )

    def _json(self, path: str) -> Any:
        """GET a small JSON document (metadata, a listing page)."""
        exchange = self._open("GET", {_PATH: path}, accept=frozenset({200}))
        try:
            body = read_document(exchange.response, _JSON_MAX + 1, self.floor())
        except (OSError, EOFError, http.client.HTTPException) as exc:
            raise self._translate(exc) from exc
        finally:
            self._pool.discard(exchange.origin, exchange.conn)
        if len(body) > _JSON_MAX:
            raise SourceError(f"{self.display_uri}: an answer over {_JSON_MAX} bytes", uri=self.display_uri)
        try:
            return json_body(body)
        except ValueError:
            raise SourceError(
                f"{self.display_uri}: the store's answer is not JSON", uri=self.display_uri
            ) from None

    def _stat(self) -> ObjectInfo:
        meta = self._json(self._object_path)
        uri = self.display_uri
        try:
            size, generation = int(meta["size"]), str(int(meta["generation"]))
        except (KeyError, TypeError, ValueError):
            size = -1
        if size < 0:
            raise SourceError(f"{uri}: the object's metadata has no size or generation", uri=uri) from None
        if str(meta.get("contentEncoding", "")).lower() == "gzip":
            raise ConfigError(
                f"{uri} is stored with Content-Encoding gzip: GCS decompresses it as it serves it, so its"
                " bytes cannot be read by ranges; upload the model without gzip encoding"
            )
        return ObjectInfo(size=size, etag=f'"{generation}"', checksums=gcs_checksums(meta))

    def __repr__(self) -> str:
        return f"GcsSource({self.display_uri!r}, endpoint={self._access.origin.netloc!r})"


def gcs_checksums(meta: Mapping[str, Any]) -> tuple[StoreChecksum, ...]:
    """The checksums GCS keeps of an object: CRC32C always, MD5 unless it was composed."""
    found = []
    for algorithm, key in (("crc32c", "crc32c"), ("md5", "md5Hash")):
        text = meta.get(key)
        checksum = StoreChecksum.from_base64(algorithm, text) if isinstance(text, str) else None
        if checksum is not None:
            found.append(checksum)
    return tuple(found)


def list_gcs_prefix(uri: str, settings: SourceSettings) -> dict[str, ListedFile]:
    """The objects directly under ``gs://bucket/prefix/`` (no deeper), with sizes, generations, checksums."""
    bucket, prefix = parse_gs_uri(uri)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    lister = GcsSource(bucket, prefix, settings, listing=True)  # named gs://bucket/prefix/ in its errors
    base = f"{lister._access.prefix}/storage/v1/b/{quote(bucket, safe='')}/o"
    found: dict[str, ListedFile] = {}
    token: str | None = None
    seen: set[str] = set()
    try:
        for _ in range(_PAGES_MAX):
            query = f"prefix={quote(prefix, safe='')}&delimiter=%2F"
            if token:
                query += f"&pageToken={quote(token, safe='')}"
            page = lister._json(f"{base}?{query}")
            items = page.get("items", []) if isinstance(page, dict) else None
            if not isinstance(items, list):
                raise SourceError(f"{uri}: the listing is not a page of objects", uri=uri)
            for item in items:
                listed = _listed(item, prefix, uri=uri)
                if listed is not None:
                    found[listed[0]] = listed[1]
            check_listing_size(len(found), uri)
            token = page.get("nextPageToken")
            if not token:
                break
            if not isinstance(token, str) or token in seen:
                raise SourceError(f"{uri}: the listing's next page token is not new (a loop)", uri=uri)
            seen.add(token)
        else:
            raise ConfigError(f"{uri} lists more than {_PAGES_MAX} pages of objects: is it a model?")
    finally:
        lister.close()
    return found


def _listed(item: Any, prefix: str, *, uri: str) -> tuple[str, ListedFile] | None:
    """One object of a listing page, by its name under ``prefix``; None for the prefix itself or another
    one's object. An entry of another shape, or a size that is not a count of bytes, is a SourceError (a
    negative size would count against the small files' limit)."""
    name, size = (item.get("name"), item.get("size", "0")) if isinstance(item, dict) else (None, None)
    if not isinstance(name, str) or not isinstance(size, str | int) or not str(size).isdigit():
        raise SourceError(
            f"{uri}: the listing holds an entry without a name and a size: {item!r:.80}", uri=uri
        )
    if not name.startswith(prefix) or name == prefix:
        return None
    checksums = {c.algorithm: base64.b64encode(c.value).decode("ascii") for c in gcs_checksums(item)}
    version = str(item.get("generation", "")) or None
    return name[len(prefix) :], ListedFile(size=int(size), version=version, checksums=checksums)


def open_gcs(uri: str, settings: SourceSettings) -> GcsSource:
    """The registry's factory for ``gs://bucket/object``."""
    bucket, name = parse_gs_uri(uri)
    return GcsSource(bucket, name, settings)


class GcsStore(Store):
    """``gs://BUCKET/OBJECT``, and ``gs://BUCKET/PREFIX/`` (or a bare bucket) as a directory."""

    schemes = ("gs",)

    def open(self, uri: str, settings: SourceSettings) -> GcsSource:
        return open_gcs(uri, settings)

    def is_directory(self, uri: str) -> bool:
        _, name = parse_gs_uri(uri)
        return not name or name.endswith("/")

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        base = uri if uri.endswith("/") else uri + "/"
        if files:  # named: no listing, so storage.objects.get is the only permission needed
            return Directory.of_sizes(base, base, dict.fromkeys(files))
        return Directory(base, base, list_gcs_prefix(base, settings))

    def opener(self, settings: SourceSettings) -> Opener:
        """The objects of one model share one credential set-up (google-auth's ADC look-up and token) and
        their connections."""
        return shared_opener(
            lambda uri: open_gcs(uri, settings),
            lambda first, uri, pool: first.sibling(parse_gs_uri(uri)[1], pool=pool),
        )


class GcsSpelling(Store):
    """``gcs://``: refused with the ``gs://`` URI it means."""

    schemes = ("gcs",)
    listed = False

    def open(self, uri: str, settings: SourceSettings) -> GcsSource:
        raise SourceUriError(f"GCS objects are named gs://BUCKET/OBJECT: did you mean gs://{uri[6:]}?")

    def is_directory(self, uri: str) -> bool:
        raise SourceUriError(f"GCS objects are named gs://BUCKET/OBJECT: did you mean gs://{uri[6:]}?")
