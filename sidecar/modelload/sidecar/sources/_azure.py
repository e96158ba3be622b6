"""Azure Blob Storage (``az://ACCOUNT/CONTAINER/PATH``): Azure's libraries authorise, our reads move bytes.

The URI names the storage account, the container and the blob (or a prefix ending in ``/``, a directory).
Other spellings the ecosystem uses (``abfs[s]://container@account.dfs.core.windows.net/path``,
``wasb[s]://...``) are refused with the ``az://`` form they mean. Requests go to the account's blob endpoint
(``https://ACCOUNT.blob.core.windows.net``, a connection string's ``BlobEndpoint``, or
``AzureSettings.endpoint_url``), authorised as :mod:`._azure_auth` decides.

- the blob's properties (a HEAD: size, ETag, Content-MD5) pin the load to one ETag;
- every range is a GET with ``x-ms-range`` and ``If-Match`` on this thread's persistent connection
  (:class:`~._http.HttpObject`): a replaced blob answers 412 and fails the read with SourceChangedError;
- a prefix is listed with List Blobs (``delimiter=/``: the top level only).
"""

from __future__ import annotations

import http.client
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from modelload.loader.errors import ConfigError, ModelloadError, SourceError, SourceUriError

from ._azure_auth import AzureAuth, resolve_auth
from ._base import ObjectInfo
from ._body import read_document
from ._checksums import StoreChecksum
from ._cloud_errors import azure_error
from ._connections import ConnectionPool, Origin
from ._http import HttpObject, Target, _Exchange
from ._settings import SourceSettings
from ._splice import HAVE_SPLICE
from ._store import Directory, ListedFile, Opener, Store, check_listing_size, shared_opener

__all__ = [
    "AzureBlobSource",
    "AzureStore",
    "OtherAzureSchemes",
    "list_azure_prefix",
    "open_azure",
    "parse_az_uri",
    "refuse_other_azure_uri",
]

_ACCOUNT = re.compile(r"^[a-z0-9]{3,24}$")
_CONTAINER = re.compile(r"^(\$root|[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9])$")
_LIST_MAX = 16 << 20
_PAGES_MAX = 64
_QUERY = ":query"  # an internal header: the query string of a listing request (never sent)
FORM = "az://ACCOUNT/CONTAINER/PATH"


def parse_az_uri(uri: str) -> tuple[str, str, str]:
    """``az://account/container/path`` as ``(account, container, path)``; the path may be empty or end in
    ``/`` for a directory."""
    rest = uri[len("az://") :]
    account, _, tail = rest.partition("/")
    container, _, path = tail.partition("/")
    if not _ACCOUNT.match(account):
        raise SourceUriError(
            f"an Azure Blob source is {FORM} (the account: 3-24 lower-case letters and digits), got {uri!r}"
        )
    if not _CONTAINER.match(container):
        raise SourceUriError(
            f"an Azure Blob source is {FORM} (the container: 3-63 lower-case letters, digits and single"
            f" dashes), got {uri!r}"
        )
    return account, container, path


def refuse_other_azure_uri(uri: str) -> str:
    """The ``az://`` form of an ``abfs[s]://`` or ``wasb[s]://`` URI, as a SourceUriError's message."""
    parts = urlsplit(uri)
    container = parts.username or "CONTAINER"
    account = (parts.hostname or "ACCOUNT").split(".")[0]
    path = parts.path.lstrip("/") or "PATH"
    return (
        f"{parts.scheme}:// URIs are not read here: name the blob as {FORM}, for this one"
        f" az://{account}/{container}/{path}"
    )


class AzureBlobSource(HttpObject):
    """One blob, pinned to the ETag its first look-up saw."""

    pins_version = True
    """Its validator changes with every write: no sampled re-reads are needed (``load/integrity.py``)."""

    def __init__(
        self,
        account: str,
        container: str,
        blob: str,
        settings: SourceSettings,
        *,
        auth: AzureAuth | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        """``pool``: a sibling's connections, to share."""
        display = f"az://{account}/{container}/{blob}"
        if not blob:
            raise SourceUriError(f"an Azure Blob source is {FORM}, got {display}")
        self._account, self._container, self._blob = account, container, blob
        self._settings_all = settings
        self._auth = auth if auth is not None else resolve_auth(settings.azure, account)
        endpoint = (
            settings.azure.endpoint_url or self._auth.endpoint or f"https://{account}.blob.core.windows.net"
        )
        parts = urlsplit(endpoint)
        try:
            self._origin = Origin.parse(parts.scheme, parts.hostname, parts.port)
        except ValueError as exc:
            raise ConfigError(f"not a usable Azure Blob endpoint: {endpoint!r} ({exc})") from exc
        self._base = parts.path.rstrip("/")
        super().__init__(display, settings.http, pool=pool)
        self.supports_fd = HAVE_SPLICE and not self._origin.is_tls
        self._blob_path = f"{self._base}/{quote(container, safe='')}/{quote(blob, safe='/~')}"

    def sibling(self, blob: str, *, pool: ConnectionPool) -> AzureBlobSource:
        """Another blob of the same container, sharing the endpoint and credentials, and the connections of
        ``pool`` (see :func:`~._store.shared_opener`)."""
        return AzureBlobSource(
            self._account, self._container, blob, self._settings_all, auth=self._auth, pool=pool
        )

    @property
    def identity(self) -> str:
        return self._auth.identity

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        sent = dict(headers)
        query: Any = sent.pop(_QUERY, None)
        path = self._blob_path if query is None else f"{self._base}/{quote(self._container, safe='')}"
        pairs: list[tuple[str, str]] = [*(query or ()), *self._auth.query()]
        if "Range" in sent:  # x-ms-range is what shared-key signing covers
            sent["x-ms-range"] = sent.pop("Range")
        full = f"{path}?{urlencode(pairs, safe='/:=')}" if pairs else path
        self._auth.sign(
            method, f"{self._origin.scheme}://{self._origin.netloc}{full}", sent, display=self.display_uri
        )
        return Target(self._origin, full, sent)

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        return azure_error(
            exchange.status,
            exchange.response.headers,
            body,
            account=self._account,
            container=self._container,
            blob=self._blob,
            identity=self._auth.identity,
        )

    def _stat(self) -> ObjectInfo:
        exchange = self._open("HEAD", {}, accept=frozenset({200}))
        exchange.response.read()
        uri = self.display_uri
        declared = exchange.header("Content-Length")
        etag = exchange.header("ETag")
        if declared is None or not declared.isdigit() or not etag:
            raise SourceError(f"{uri}: the blob's properties have no size or ETag", uri=uri)
        md5 = exchange.header("Content-MD5")
        checksum = StoreChecksum.from_base64("md5", md5) if md5 else None
        return ObjectInfo(
            size=int(declared),
            etag=etag,
            last_modified=exchange.header("Last-Modified"),
            checksums=(checksum,) if checksum is not None else (),
        )

    def list_page(self, prefix: str, marker: str | None) -> tuple[dict[str, ListedFile], str | None]:
        """One page of the blobs directly under ``prefix``, and the next page's marker."""
        query = [("comp", "list"), ("delimiter", "/"), ("prefix", prefix), ("restype", "container")]
        if marker:
            query.append(("marker", marker))
        exchange = self._open("GET", {_QUERY: query}, accept=frozenset({200}))  # type: ignore[dict-item]
        try:
            body = read_document(exchange.response, _LIST_MAX + 1, self.floor())
        except (OSError, EOFError, http.client.HTTPException) as exc:
            raise self._translate(exc) from exc
        finally:
            self._pool.discard(exchange.origin, exchange.conn)
        if len(body) > _LIST_MAX:
            raise SourceError(
                f"{self.display_uri}: a listing page over {_LIST_MAX} bytes", uri=self.display_uri
            )
        return _parse_listing(body, prefix, uri=self.display_uri)

    def __repr__(self) -> str:
        return f"AzureBlobSource({self.display_uri!r}, endpoint={self._origin.netloc!r})"


def _parse_listing(body: bytes, prefix: str, *, uri: str) -> tuple[dict[str, ListedFile], str | None]:
    try:
        root = ET.fromstring(body)  # noqa: S314 - our own request's answer; expat refuses entity bombs
    except ET.ParseError as exc:
        raise SourceError(f"{uri}: the listing is not XML ({exc})", uri=uri) from None
    found: dict[str, ListedFile] = {}
    for blob in root.iter("Blob"):
        name = blob.findtext("Name") or ""
        size = blob.findtext("Properties/Content-Length") or ""
        if not name.startswith(prefix) or name == prefix or not size.isdigit():
            continue
        md5 = blob.findtext("Properties/Content-MD5")
        checksums = {"md5": md5} if md5 else {}
        found[name[len(prefix) :]] = ListedFile(
            size=int(size), version=blob.findtext("Properties/Etag"), checksums=checksums
        )
    marker = (root.findtext("NextMarker") or "").strip() or None
    return found, marker


def list_azure_prefix(uri: str, settings: SourceSettings) -> dict[str, ListedFile]:
    """The blobs directly under ``az://account/container/prefix/`` (no deeper)."""
    account, container, prefix = parse_az_uri(uri)
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    lister = AzureBlobSource(account, container, prefix or "-", settings)
    lister._display_uri = f"az://{account}/{container}/{prefix}"
    found: dict[str, ListedFile] = {}
    marker: str | None = None
    seen: set[str] = set()
    try:
        for _ in range(_PAGES_MAX):
            page, marker = lister.list_page(prefix, marker)
            found.update(page)
            check_listing_size(len(found), uri)
            if marker is None:
                break
            if marker in seen:
                raise SourceError(
                    f"{uri}: the listing's next marker is one already followed (a loop): the endpoint pages"
                    " wrongly",
                    uri=uri,
                )
            seen.add(marker)
        else:
            raise ConfigError(f"{uri} lists more than {_PAGES_MAX} pages of blobs: is it a model?")
    finally:
        lister.close()
    return found


def open_azure(uri: str, settings: SourceSettings) -> AzureBlobSource:
    """The registry's factory for ``az://account/container/blob``."""
    account, container, blob = parse_az_uri(uri)
    return AzureBlobSource(account, container, blob, settings)


class AzureStore(Store):
    """``az://ACCOUNT/CONTAINER/BLOB``; ``az://ACCOUNT/CONTAINER/PREFIX/`` (or a container) is a directory."""

    schemes = ("az",)

    def open(self, uri: str, settings: SourceSettings) -> AzureBlobSource:
        return open_azure(uri, settings)

    def is_directory(self, uri: str) -> bool:
        _, _, path = parse_az_uri(uri)
        return not path or path.endswith("/")

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        base = uri if uri.endswith("/") else uri + "/"
        parse_az_uri(base)
        if files:  # named: no listing, so the identity needs no list permission
            return Directory.of_sizes(base, base, dict.fromkeys(files))
        return Directory(base, base, list_azure_prefix(base, settings))

    def opener(self, settings: SourceSettings) -> Opener:
        """The blobs of one model share one credential (one token for every shard) and their connections."""
        return shared_opener(
            lambda uri: open_azure(uri, settings),
            lambda first, uri, pool: first.sibling(parse_az_uri(uri)[2], pool=pool),
        )


class OtherAzureSchemes(Store):
    """``abfs[s]://`` and ``wasb[s]://``: refused with the ``az://`` URI they mean."""

    schemes = ("abfs", "abfss", "wasb", "wasbs")
    listed = False

    def open(self, uri: str, settings: SourceSettings) -> AzureBlobSource:
        raise SourceUriError(refuse_other_azure_uri(uri))

    def is_directory(self, uri: str) -> bool:
        raise SourceUriError(refuse_other_azure_uri(uri))
