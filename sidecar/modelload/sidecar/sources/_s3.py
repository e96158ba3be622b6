"""S3 and S3-compatible stores: botocore resolves credentials, region and endpoint and signs; we move bytes.

botocore's own client reads bodies through urllib3, which copies every chunk (0.9 GiB/s here against 2.5-3.3
for ``http.client`` reading into the caller's buffer). So botocore does what it is best at, once per source
or per request, and nothing else:

- a ``botocore.session.Session`` resolves the endpoint (``endpoint_url`` setting, ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT_URL``, the shared config's ``services`` section, else AWS's regional endpoint), the region
  and the CA bundle (``AWS_CA_BUNDLE``), when the source is opened (no network);
- its credential chain (env, shared files, web identity / IRSA, container credentials, instance metadata)
  runs on the first request; ``get_frozen_credentials()`` per request returns refreshed temporary
  credentials when they are about to expire;
- ``S3SigV4Auth`` signs each GET (with ``X-Amz-Security-Token`` for session credentials).

The request itself goes through :class:`HttpObject`: persistent per-thread connections, range checks,
If-Match, resume. ``unsigned`` sends no Authorization header at all (public buckets).
"""

from __future__ import annotations

import gc
import http.client
import logging
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import quote, urlsplit

from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceUriError,
)

from ._base import InterruptedReadError, ObjectInfo
from ._body import read_document
from ._checksums import StoreChecksum
from ._connections import ConnectionPool, Origin
from ._http import HttpObject, Target, _Exchange
from ._s3_errors import s3_error
from ._settings import S3Addressing, S3Settings, SourceSettings
from ._splice import HAVE_SPLICE
from ._store import check_listing_size

__all__ = ["S3Location", "S3Source", "import_botocore", "list_s3_prefix", "open_s3", "plan_s3_location"]

_log = logging.getLogger("modelload.sidecar.sources")
_BUCKET_DNS = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
_AWS_HOST = re.compile(r"(^|\.)amazonaws\.com(\.cn)?$")
# Connection-level failures while fetching credentials (STS, instance metadata) are worth a retry; every
# other credential failure means the chain found nothing usable.
_TRANSIENT_CREDENTIAL_ERRORS = frozenset(
    {"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"}
)


def import_botocore() -> Any:
    """botocore with the submodules used here, imported on first use: only S3 sources pay for it (~0.2 s).
    The sidecar imports it as it starts when its source is on S3 (``S3Store.prepare``)."""
    import botocore.auth
    import botocore.awsrequest
    import botocore.config
    import botocore.exceptions
    import botocore.session
    import botocore.utils

    _quiet_signer_debug_logs()
    return botocore


def _drop_debug(record: logging.LogRecord) -> bool:
    return record.levelno > logging.DEBUG


def _quiet_signer_debug_logs() -> None:
    """Drop botocore.auth's DEBUG records: they print the canonical request, session token included.

    A sidecar run with debug logging would otherwise write temporary credentials into the pod's logs.
    Installed once, on the ``botocore.auth`` logger only; its warnings and errors still pass.
    """
    signer_log = logging.getLogger("botocore.auth")
    if _drop_debug not in signer_log.filters:
        signer_log.addFilter(_drop_debug)


@dataclass(frozen=True)
class S3Location:
    """Where requests for one object go: the origin, the request path, and the addressing used."""

    origin: Origin
    path: str
    addressing: S3Addressing

    @property
    def url(self) -> str:
        return f"{self.origin.scheme}://{self.origin.netloc}{self.path}"


def is_aws_endpoint(endpoint_url: str) -> bool:
    """Whether an endpoint is AWS's own (virtual-hosted addressing is safe there)."""
    host = urlsplit(endpoint_url).hostname or ""
    return bool(_AWS_HOST.search(host))


def plan_s3_location(bucket: str, key: str, *, endpoint_url: str, addressing: S3Addressing) -> S3Location:
    """Build the request URL of ``s3://bucket/key`` at ``endpoint_url``.

    ``auto`` picks virtual-hosted addressing (``bucket.host/key``) for AWS endpoints and DNS-safe bucket
    names without dots, and path addressing (``host/bucket/key``) otherwise: custom endpoints rarely have
    wildcard DNS, and dotted names break TLS wildcard certificates.
    """
    parts = urlsplit(endpoint_url)
    try:
        origin = Origin.parse(parts.scheme, parts.hostname, parts.port)
    except ValueError as exc:
        raise ConfigError(f"not a usable S3 endpoint: {endpoint_url!r} ({exc})") from exc
    if addressing == "auto":
        dns_safe = bool(_BUCKET_DNS.match(bucket)) and "." not in bucket
        addressing = "virtual" if dns_safe and is_aws_endpoint(endpoint_url) else "path"
    prefix = parts.path.rstrip("/")
    quoted_key = quote(key, safe="/~")
    if addressing == "virtual":
        return S3Location(
            Origin(origin.scheme, f"{bucket}.{origin.host}", origin.port), f"{prefix}/{quoted_key}", "virtual"
        )
    return S3Location(origin, f"{prefix}/{quote(bucket, safe='')}/{quoted_key}", "path")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/key`` as ``(bucket, key)``; a ConfigError when either is missing."""
    rest = uri.removeprefix("s3://")
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise SourceUriError(f"an S3 source is s3://BUCKET/KEY, got {uri!r}")
    return bucket, key


@dataclass
class _Access:
    """What botocore resolved for one S3 setting: shared by the sources of one model's files, so a directory
    of shards resolves its endpoint once and runs the credential chain once."""

    session: Any
    endpoint_url: str
    region: str
    ca_bundle: str | None
    credentials: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def _resolve_access(s3: S3Settings, display: str) -> _Access:
    botocore = import_botocore()
    try:
        session = botocore.session.Session()
        if s3.credentials is not None:  # explicit keys replace the whole chain, never mix with it
            given = s3.credentials
            session.set_credentials(given.access_key_id, given.secret_access_key, given.session_token)
        endpoint_url, region = _endpoint(botocore, s3, session)
        return _Access(
            session=session,
            endpoint_url=endpoint_url,
            region=region,
            ca_bundle=session.get_config_variable("ca_bundle"),
        )
    except (botocore.exceptions.BotoCoreError, ValueError) as exc:
        raise ConfigError(f"cannot set up S3 access for {display}: {type(exc).__name__}: {exc}") from exc


def _endpoint(botocore: Any, s3: S3Settings, session: Any) -> tuple[str, str]:
    """The endpoint URL and signing region for ``s3``.

    An endpoint given in the settings (MinIO, Ceph, R2, any S3-compatible store) is the URL botocore would
    use as it is, and the region is the one given, else the session's (``AWS_DEFAULT_REGION``, the
    profile's), else us-east-1, as botocore's client would sign with: no client is made. Making one only to
    read those back cost about 0.07 CPU-s and 14 MiB that stayed resident after it was dropped (the S3
    service model and endpoint rules it loads), in every sidecar reading such a store.

    Without one, botocore resolves them (``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, the shared
    config's ``services`` section, else AWS's regional endpoint) by a client of a session of its own,
    dropped at once, so that the session kept for the credentials never holds the service model. That
    session's objects form cycles, and the sidecar opens a model with the collector held off
    (``segment.collector``), so they are collected here: the youngest generation only, where everything made
    since the collector last ran is."""
    if s3.endpoint_url is not None:
        url, utils = s3.endpoint_url, botocore.utils
        if not utils.is_valid_endpoint_url(url) and not utils.is_valid_ipv6_endpoint_url(url):
            raise ValueError(f"Invalid endpoint: {url}")  # botocore's own check, as its client makes it
        region = s3.region or session.get_config_variable("region") or "us-east-1"
        return url, str(region)
    client = botocore.session.Session().create_client(
        "s3",
        region_name=s3.region,
        endpoint_url=s3.endpoint_url,
        config=botocore.config.Config(signature_version=botocore.UNSIGNED),
    )
    resolved = str(client.meta.endpoint_url), str(client.meta.region_name or "us-east-1")
    del client
    gc.collect(0)
    return resolved


class S3Source(HttpObject):
    """One S3 object, read by signed range GETs over persistent ``http.client`` connections."""

    pins_version = True
    """Its validator changes with every write: no sampled re-reads are needed (``load/integrity.py``)."""

    def __init__(
        self,
        bucket: str,
        key: str,
        settings: SourceSettings,
        *,
        access: _Access | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        display = f"s3://{bucket}/{key}"
        s3 = settings.s3
        self._bucket, self._key, self._unsigned = bucket, key, s3.unsigned
        self._settings_all = settings
        self._access = access if access is not None else _resolve_access(s3, display)
        self._endpoint_url = self._access.endpoint_url
        self._region: str = self._access.region
        self._session = self._access.session
        self._location = plan_s3_location(
            bucket, key, endpoint_url=self._endpoint_url, addressing=s3.addressing
        )
        super().__init__(display, settings.http, ca_bundle=self._access.ca_bundle, pool=pool)
        self.supports_fd = HAVE_SPLICE and not self._location.origin.is_tls

    def sibling(self, key: str, *, pool: ConnectionPool) -> S3Source:
        """Another object of the same bucket, sharing this source's endpoint and credentials, and the
        connections of ``pool`` (see :func:`~._store.shared_opener`)."""
        return S3Source(self._bucket, key, self._settings_all, access=self._access, pool=pool)

    @property
    def location(self) -> S3Location:
        """The endpoint, path and addressing style in use."""
        return self._location

    @property
    def region(self) -> str:
        """The signing region."""
        return self._region

    def _target(self, method: str, headers: Mapping[str, str]) -> Target:
        location = self._location
        headers = {**headers, "Host": location.origin.netloc}
        if self._unsigned:
            return Target(location.origin, location.path, headers)
        botocore = import_botocore()
        frozen = self._frozen_credentials()
        request = botocore.awsrequest.AWSRequest(method=method, url=location.url, headers=headers)
        botocore.auth.S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        return Target(location.origin, location.path, dict(request.headers.items()))

    def _frozen_credentials(self) -> Any:
        """This request's credentials: resolved through botocore's chain once, refreshed by botocore."""
        exceptions = import_botocore().exceptions
        access = self._access
        try:
            with access.lock:
                if access.credentials is None:
                    access.credentials = self._session.get_credentials()
                credentials = access.credentials
            if credentials is None:
                raise SourceAccessDeniedError(
                    f"{self.display_uri}: no AWS credentials found (looked in AWS_ACCESS_KEY_ID /"
                    " AWS_SECRET_ACCESS_KEY, the shared credentials and config files, web identity (IRSA),"
                    " container credentials and instance metadata): mount the credentials Secret or bind a"
                    " role, or use unsigned access for a public bucket",
                    uri=self.display_uri,
                )
            return credentials.get_frozen_credentials()
        except (exceptions.BotoCoreError, exceptions.ClientError) as exc:
            raise self._credential_error(exc) from exc

    def _credential_error(self, exc: Exception) -> ModelloadError:
        name = type(exc).__name__
        provider = getattr(exc, "kwargs", {}).get("provider")
        source = f" from the {provider} provider" if provider else ""
        if name in _TRANSIENT_CREDENTIAL_ERRORS:
            return InterruptedReadError(
                f"{self.display_uri}: fetching AWS credentials{source} failed ({name}); will retry",
                uri=self.display_uri,
            )
        return SourceAccessDeniedError(
            f"{self.display_uri}: AWS credentials could not be obtained{source} ({name}): check the"
            " credentials Secret, AWS_PROFILE, the role binding (IRSA / pod identity) and its token file",
            uri=self.display_uri,
        )

    def _error(self, exchange: _Exchange, body: bytes) -> ModelloadError:
        return s3_error(
            exchange.status,
            exchange.response.headers,
            body,
            bucket=self._bucket,
            key=self._key,
            unsigned=self._unsigned,
            secrets=self._signed_with(),
        )

    def _signed_with(self) -> tuple[str, ...] | None:
        """The credentials requests are signed with, as botocore last gave them (none before the first
        signed request, and none for unsigned access): what an error message must not echo. None when
        they cannot be had now (a refresh that fails): then the message echoes nothing of the answer."""
        credentials = None if self._unsigned else self._access.credentials
        if credentials is None:
            return ()
        try:
            frozen = credentials.get_frozen_credentials()
        except Exception:  # the refresh's own failure is reported by the next request, not here
            return None
        return tuple(str(value) for value in (frozen.access_key, frozen.secret_key, frozen.token) if value)

    def __repr__(self) -> str:
        return f"S3Source({self.display_uri!r}, endpoint={self._location.origin.netloc!r})"

    def _stat(self) -> ObjectInfo:
        info = super()._stat()
        return replace(info, checksums=self._checksums(info))

    def _stat_prefix(self, length: int) -> tuple[ObjectInfo, bytes | None]:
        info, head = self._range_stat(length)
        return replace(info, checksums=self._checksums(info)), head

    def _checksums(self, info: ObjectInfo) -> tuple[StoreChecksum, ...]:
        """The checksums S3 keeps of this version (HEAD with ``x-amz-checksum-mode: ENABLED``, which
        s3:GetObject allows); for a multipart upload's composite, the parts from GetObjectAttributes."""
        headers = {"x-amz-checksum-mode": "ENABLED", **self._pin(info)}
        try:
            exchange = self._open("HEAD", headers, accept=frozenset({200}))
            exchange.response.read()
        except SourceError as exc:
            if exc.transient:
                raise
            _log.info(
                "%s: the store's checksums could not be read (%s)", self.display_uri, type(exc).__name__
            )
            return ()
        kind = (exchange.header("x-amz-checksum-type") or "").upper()
        multipart = bool(re.search(r'-\d+"?$', info.etag or ""))
        found = []
        for algorithm in _S3_CHECKSUMS:
            text = exchange.header(f"x-amz-checksum-{algorithm}")
            if not text:
                continue
            value = text.split("-")[0]
            composite = kind == "COMPOSITE" or (
                multipart and kind != "FULL_OBJECT" and algorithm != "crc64nvme"
            )
            parts: tuple[tuple[int, bytes], ...] = ()
            if composite:
                parts = _S3Attributes(self).parts(algorithm)
                if not parts:
                    _log.info(
                        "%s: a composite %s checksum without the parts' list (GetObjectAttributes): unused",
                        self.display_uri,
                        algorithm,
                    )
                    continue
                total = sum(size for size, _ in parts)
                if total != info.size:
                    raise SourceChangedError(
                        f"{self.display_uri}: the parts GetObjectAttributes lists add up to {total} bytes,"
                        f" and the object is {info.size}: it changed while it was being read, or the"
                        " endpoint answers for another object; restart the load",
                        uri=self.display_uri,
                    )
            checksum = StoreChecksum.from_base64(algorithm, value, parts=parts)
            if checksum is not None:
                found.append(checksum)
        return tuple(found)


_S3_CHECKSUMS = ("crc64nvme", "crc32c", "crc32", "sha256", "sha1")


class _S3Attributes(S3Source):
    """GetObjectAttributes of one object (``?attributes``): the sizes and checksums of its parts."""

    def __init__(self, source: S3Source) -> None:
        super().__init__(source._bucket, source._key, source._settings_all, access=source._access)
        self._location = replace(self._location, path=self._location.path + "?attributes")

    def parts(self, algorithm: str) -> tuple[tuple[int, bytes], ...]:
        headers = {"x-amz-object-attributes": "ObjectParts", "x-amz-max-parts": "10000"}
        try:
            exchange = self._open("GET", headers, accept=frozenset({200}))
            body = read_document(exchange.response, _LIST_PAGE_MAX, self.floor())
        except (SourceError, OSError, EOFError, http.client.HTTPException):
            return ()
        finally:
            self.close()
        import xml.etree.ElementTree as ET  # our own request's answer

        try:
            root = ET.fromstring(body)  # noqa: S314 - expat refuses entity expansion bombs
        except ET.ParseError:
            return ()
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        tag = {"crc32": "CRC32", "crc32c": "CRC32C", "sha1": "SHA1", "sha256": "SHA256"}.get(algorithm)
        parts = []
        for part in root.iter(f"{ns}Part"):
            number, size = part.findtext(f"{ns}PartNumber"), part.findtext(f"{ns}Size")
            text = part.findtext(f"{ns}Checksum{tag}") if tag else None
            checksum = StoreChecksum.from_base64(algorithm, text) if text else None
            if not (number and number.isdigit() and size and size.isdigit()) or checksum is None:
                return ()
            parts.append((int(number), int(size), checksum.value))
        truncated = (root.findtext(f"{ns}ObjectParts/{ns}IsTruncated") or "").strip() == "true"
        if truncated or not parts:
            return ()
        return tuple((size, value) for _, size, value in sorted(parts))


_LIST_PAGE_MAX = 16 << 20
_LIST_PAGES_MAX = 64


class _S3Listing(S3Source):
    """ListObjectsV2 requests for one prefix, signed and sent like the object reads."""

    def __init__(self, bucket: str, prefix: str, settings: SourceSettings) -> None:
        super().__init__(bucket, prefix or "/", settings)
        base = plan_s3_location(
            bucket, "x", endpoint_url=self._endpoint_url, addressing=self._location.addressing
        )
        self._base = S3Location(base.origin, base.path[:-1], base.addressing)
        self._prefix = prefix
        self._display_uri = f"s3://{bucket}/{prefix}"

    def page(self, token: str | None) -> tuple[list[tuple[str, int]], str | None]:
        """One page of ``(key, size)`` directly under the prefix, and the next page's token."""
        query = {"delimiter": "/", "list-type": "2", "prefix": self._prefix}
        if token is not None:
            query["continuation-token"] = token
        encoded = "&".join(f"{quote(k, safe='')}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))
        self._location = S3Location(self._base.origin, f"{self._base.path}?{encoded}", self._base.addressing)
        exchange = self._open("GET", {}, accept=frozenset({200}))
        try:
            body = read_document(exchange.response, _LIST_PAGE_MAX + 1, self.floor())
        except (OSError, EOFError, http.client.HTTPException) as exc:
            raise self._translate(exc) from exc
        finally:
            self._pool.discard(exchange.origin, exchange.conn)
        if len(body) > _LIST_PAGE_MAX:
            raise SourceError(
                f"{self.display_uri}: a listing page over {_LIST_PAGE_MAX} bytes", uri=self._display_uri
            )
        return _parse_listing(body, uri=self.display_uri)


def _parse_listing(body: bytes, *, uri: str) -> tuple[list[tuple[str, int]], str | None]:
    import xml.etree.ElementTree as ET  # the body of our own request to the configured store

    try:
        root = ET.fromstring(body)  # noqa: S314 - expat refuses entity expansion bombs since 2.4.1
    except ET.ParseError as exc:
        raise SourceError(f"{uri}: the listing is not XML ({exc})", uri=uri) from None
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    found = []
    for item in root.iter(f"{ns}Contents"):
        key, size = item.findtext(f"{ns}Key"), item.findtext(f"{ns}Size")
        if key is None or size is None or not size.isdigit():
            raise SourceError(f"{uri}: a listing entry without a key or size", uri=uri)
        found.append((key, int(size)))
    truncated = (root.findtext(f"{ns}IsTruncated") or "").strip() == "true"
    token = root.findtext(f"{ns}NextContinuationToken") if truncated else None
    if truncated and not token:
        raise SourceError(f"{uri}: a truncated listing without a continuation token", uri=uri)
    return found, token


def list_s3_prefix(uri: str, settings: SourceSettings) -> dict[str, int]:
    """The objects directly under an ``s3://bucket/prefix/`` (no deeper), as ``{name: size}``."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ConfigError(f"an S3 directory is s3://BUCKET/PREFIX/, got {uri!r}")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    lister = _S3Listing(bucket, prefix, settings)
    found: dict[str, int] = {}
    token: str | None = None
    seen: set[str] = set()
    try:
        for _ in range(_LIST_PAGES_MAX):
            page, token = lister.page(token)
            found.update((key[len(prefix) :], size) for key, size in page if key.startswith(prefix))
            check_listing_size(len(found), uri)
            if token is None:
                break
            if token in seen:
                raise SourceError(
                    f"{uri}: the listing's continuation token is one already followed (a loop): the endpoint"
                    " pages wrongly",
                    uri=uri,
                )
            seen.add(token)
        else:
            raise ConfigError(f"{uri} lists more than {_LIST_PAGES_MAX} pages of objects: is it a model?")
    finally:
        lister.close()
    found.pop("", None)  # a "directory marker" object named like the prefix itself
    return found


def open_s3(uri: str, settings: SourceSettings) -> S3Source:
    """The registry's factory for ``s3://bucket/key``."""
    bucket, key = parse_s3_uri(uri)
    return S3Source(bucket, key, settings)
