"""Model sources: read byte ranges of a file, an HTTP(S) URL, an S3, GCS or Azure Blob object into a buffer.

This layer stands alone: it imports the error tree of ``modelload.loader`` and the standard library, and
botocore lazily inside the S3 source. The operator imports it to read a model's index; the engine to stream.

Open a source from a URI, read ranges from many threads, retry through :func:`read_range`::

    from modelload.sidecar.sources import SourceSettings, open_source, read_range

    settings = SourceSettings()  # built from flags and env at the edge
    with open_source("s3://models/llama.tensors", settings) as source:
        size = source.stat().size
        header = source.read_bytes(0, 4096)           # small reads (an index)
        view = memoryview(segment)[4096 : 4096 + 32 << 20]
        read_range(source, 0, view, policy=settings.retry)   # the hot path: straight into the buffer

Sources are thread-safe; each thread gets its own persistent connection. Plain ``http://`` sources (and S3
over plain HTTP, and files) also land bytes in a file without user-space copies
(:meth:`Source.read_into_fd`, when ``supports_fd``). Errors are branches of ``modelload.loader.errors``:
SourceNotFoundError, SourceAccessDeniedError, SourceChangedError, RangeNotSupportedError are permanent;
TransientSourceError (here always :class:`InterruptedReadError`, with ``landed`` and ``retry_after``) is
what :func:`read_range` retries.

Private HTTP(S) servers: :func:`read_header_file` / :func:`parse_headers` turn a bearer token or header lines
into :class:`RequestHeaders` for ``HttpSettings(headers=...)``, sent to the source's own origin only.
"""

from __future__ import annotations

from . import hub, oci
from ._addresses import AddressPolicy, Network, parse_networks
from ._base import (
    InterruptedReadError,
    ObjectInfo,
    RangeSink,
    Source,
    SourceBase,
    check_range,
    file_version,
    window_size,
)
from ._checksums import (
    COMPOSABLE,
    STREAMED,
    StoreChecksum,
    crc,
    crc_available,
    crc_combine,
    crc_width,
    new_hash,
)
from ._file import FileSource
from ._headers import RequestHeaders, parse_headers, read_header_file, read_token_file
from ._http import Exchange, Target
from ._listing import Directory, is_directory, list_directory
from ._model import OpenedModel, fetch_small_file, open_model
from ._proxy import ProxySettings, proxy_from_environ
from ._published_digest import PublishedDigest, checksum_of, new_hasher, verify_bytes
from ._registry import (
    SourceFactory,
    check_source_uri,
    open_source,
    prepare_source,
    register_source,
    register_store,
    registered_schemes,
    store_for,
)
from ._responses import display_url
from ._retry import (
    RetryCancelled,
    RetryEvent,
    read_bytes,
    read_range,
    read_range_into_fd,
    read_range_into_sink,
    read_range_pieces,
    read_range_pieces_into_fd,
    stat_source,
    stat_with_prefix,
)
from ._s3 import S3Location, S3Source, plan_s3_location
from ._settings import (
    DEFAULT_HUB_ENDPOINT,
    AzureCredentials,
    AzureSettings,
    GcsSettings,
    HttpSettings,
    HubSettings,
    RegistrySettings,
    RetryPolicy,
    S3Addressing,
    S3Credentials,
    S3Settings,
    SourceSettings,
)
from ._splice import metered, watch_landing
from ._store import ListedFile, Opener, Store, join_uri
from ._url import HttpSource
from .hub import parse_hub_uri
from .oci import auths_from_docker_config, parse_oci_uri

__all__ = [
    "AddressPolicy",
    "AzureCredentials",
    "AzureSettings",
    "COMPOSABLE",
    "DEFAULT_HUB_ENDPOINT",
    "Directory",
    "Exchange",
    "FileSource",
    "GcsSettings",
    "HttpSettings",
    "HttpSource",
    "HubSettings",
    "InterruptedReadError",
    "ListedFile",
    "Network",
    "ObjectInfo",
    "OpenedModel",
    "Opener",
    "ProxySettings",
    "PublishedDigest",
    "RangeSink",
    "RegistrySettings",
    "RequestHeaders",
    "RetryCancelled",
    "RetryEvent",
    "RetryPolicy",
    "S3Addressing",
    "S3Credentials",
    "S3Location",
    "S3Settings",
    "S3Source",
    "STREAMED",
    "Source",
    "SourceBase",
    "SourceFactory",
    "SourceSettings",
    "Store",
    "StoreChecksum",
    "Target",
    "auths_from_docker_config",
    "check_range",
    "check_source_uri",
    "checksum_of",
    "crc",
    "crc_available",
    "crc_combine",
    "crc_width",
    "display_url",
    "fetch_small_file",
    "file_version",
    "hub",
    "is_directory",
    "join_uri",
    "list_directory",
    "metered",
    "new_hash",
    "new_hasher",
    "oci",
    "open_model",
    "open_source",
    "parse_headers",
    "parse_hub_uri",
    "parse_networks",
    "parse_oci_uri",
    "plan_s3_location",
    "prepare_source",
    "proxy_from_environ",
    "read_bytes",
    "read_header_file",
    "read_range",
    "read_range_into_fd",
    "read_range_into_sink",
    "read_range_pieces",
    "read_range_pieces_into_fd",
    "read_token_file",
    "register_source",
    "register_store",
    "registered_schemes",
    "stat_source",
    "stat_with_prefix",
    "store_for",
    "verify_bytes",
    "watch_landing",
    "window_size",
]
