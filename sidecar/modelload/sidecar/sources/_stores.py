"""The built-in stores: local files, HTTP(S) servers and S3.

How each finds a directory's files:

- a local directory is listed (top level only), and a symbolic link that leaves it refuses the load
  (:mod:`modelload.loader.localdir`);
- an S3 prefix is listed with ListObjectsV2 (top level only: ``delimiter=/``), unless the caller names the
  files (then only ``s3:GetObject`` is needed);
- an HTTP(S) base has no listing: unless the caller names the files, the well-known names of a Hugging Face
  directory are probed (``model.safetensors.index.json``, ``model.safetensors``, ``model.tensors``, the
  config and tokenizer files); a probe that finds nothing (404) is simply absent, and any other answer
  (401, 403, 500 after retries) is an error.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlsplit

from modelload.loader.errors import ConfigError, SourceNotFoundError, SourceUriError
from modelload.loader.formats import SAFETENSORS_INDEX, WELL_KNOWN_SMALL_FILES
from modelload.loader.localdir import list_local_directory

from ._base import Source
from ._file import open_file
from ._responses import display_url
from ._retry import stat_source
from ._s3 import import_botocore, list_s3_prefix, open_s3, parse_s3_uri
from ._settings import SourceSettings
from ._store import Directory, Opener, Store, join_uri, shared_opener
from ._url import HttpSource, open_http

__all__ = ["FactoryStore", "FileStore", "HttpStore", "S3Store", "local_path"]

_PROBED = (SAFETENSORS_INDEX, "model.safetensors", "model.tensors", *WELL_KNOWN_SMALL_FILES)


def local_path(uri: str) -> Path | None:
    """The path a ``file://`` URI or a plain path names; None for any other scheme."""
    if uri.startswith("file://"):
        return Path(unquote(urlsplit(uri).path))
    if "://" in uri:
        return None
    return Path(uri)


_HUB_HOSTS = frozenset({"huggingface.co", "www.huggingface.co", "hf.co"})
_HUB_PAGES = re.compile(r"^/(?P<repo>[^/]+/[^/]+?)/?(?:/(?P<kind>tree|blob)/(?P<rev>[^/]+)(?P<path>/.*)?)?$")


def hub_uri_of_page(url: str) -> str | None:
    """The ``hf://`` URI a Hugging Face web page's URL (a repository, its ``tree`` or a ``blob``, as the
    browser's address bar shows them) means; None for any other URL, the Hub's ``resolve`` file URLs
    included, which are files and load over HTTPS."""
    parts = urlsplit(url)
    if (parts.hostname or "").lower() not in _HUB_HOSTS:
        return None
    match = _HUB_PAGES.match(parts.path)
    if match is None or match["repo"].split("/")[0] in ("api", "datasets", "spaces", "docs"):
        return None
    if match["kind"] is None:
        return f"hf://{match['repo']}"
    path = (match["path"] or "").strip("/")
    if match["kind"] == "tree":
        return f"hf://{match['repo']}@{match['rev']}" + (f"/{path}/" if path else "")
    return f"hf://{match['repo']}@{match['rev']}/{path}"


class FileStore(Store):
    """``file://`` URIs and plain paths: a file, or a local directory of them."""

    schemes = ("file",)

    def open(self, uri: str, settings: SourceSettings) -> Source:
        return open_file(uri, settings)

    def is_directory(self, uri: str) -> bool:
        path = local_path(uri)
        return path is not None and path.is_dir()

    def check(self, uri: str) -> None:
        """Any path is a path; a missing file is the load's error, with the path."""

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        path = local_path(uri) or Path(uri)
        try:
            sizes: dict[str, int | None] = dict(list_local_directory(path))  # links out of it refused
        except FileNotFoundError:
            raise SourceNotFoundError(f"{path} does not exist", uri=str(path)) from None
        except OSError as exc:
            raise ConfigError(f"{path} cannot be listed: {exc.strerror}") from None
        directory = Directory.of_sizes(str(path), str(path).rstrip("/") + "/", sizes)
        return directory.only(files) if files else directory


class HttpStore(Store):
    """``http://`` and ``https://`` URLs; a base URL ending in ``/`` is a directory, probed by name."""

    schemes = ("http", "https")

    def open(self, uri: str, settings: SourceSettings) -> Source:
        return open_http(uri, settings)

    def opener(self, settings: SourceSettings) -> Opener:
        """The files of one model share their connections (a reader thread keeps one per origin, not one
        per file); each sends its own URL, headers and credentials, as :class:`HttpSource` gives them."""
        return shared_opener(
            lambda uri: HttpSource(uri, settings.http),
            lambda _first, uri, pool: HttpSource(uri, settings.http, pool=pool),
        )

    def is_directory(self, uri: str) -> bool:
        return urlsplit(uri).path.endswith("/")

    def check(self, uri: str) -> None:
        """A URL without a host, or a Hugging Face web page (neither a file nor a listable directory)."""
        parts = urlsplit(uri)
        if not parts.hostname:
            raise SourceUriError(f"{display_url(uri)} names no host: http(s)://HOST/PATH")
        meant = hub_uri_of_page(uri)
        if meant is not None:
            raise SourceUriError(
                f"{display_url(uri)} is a Hugging Face web page, not a file: load the repository with "
                f"--source {meant}"
            )

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        if urlsplit(uri).query:
            raise ConfigError(
                f"{display_url(uri)}: a directory URL cannot carry a query string (a presigned URL signs one "
                "object): serve the directory without one, or load one file"
            )
        if files and not uri.endswith("/"):
            raise SourceUriError(
                f"{display_url(uri)}: with a list of files the source is a directory and must end with '/'"
                f" ({display_url(uri)}/); without it the names would be appended to its last segment"
            )
        names = tuple(files) or _PROBED
        found = self._probe(uri, names, settings, required=bool(files))
        return Directory.of_sizes(uri, display_url(uri), found, listed=bool(files))

    def _probe(
        self, base: str, names: Sequence[str], settings: SourceSettings, *, required: bool
    ) -> dict[str, int | None]:
        """Stat ``names`` under a base in parallel; absent ones are left out unless ``required``."""

        def stat(name: str) -> tuple[str, int | None]:
            source = self.open(join_uri(base, name), settings)
            try:
                return name, stat_source(source, policy=settings.retry).size
            except SourceNotFoundError:
                if required:
                    raise
                return name, None
            finally:
                source.close()

        with ThreadPoolExecutor(max_workers=min(8, len(names)), thread_name_prefix="probe") as pool:
            found = list(pool.map(stat, names))
        return {name: size for name, size in found if size is not None}


class S3Store(Store):
    """``s3://BUCKET/KEY``, and ``s3://BUCKET/PREFIX/`` (or a bare bucket) as a directory."""

    schemes = ("s3",)

    def open(self, uri: str, settings: SourceSettings) -> Source:
        return open_s3(uri, settings)

    def is_directory(self, uri: str) -> bool:
        return uri.endswith("/") or "/" not in uri.removeprefix("s3://")

    def check(self, uri: str) -> None:
        if not uri.removeprefix("s3://").partition("/")[0]:
            raise SourceUriError(f"an S3 source is s3://BUCKET/KEY (or s3://BUCKET/PREFIX/), got {uri!r}")

    def prepare(self, uri: str) -> None:
        """botocore's import (about 0.2 CPU-s, seconds of wall time on a busy node)."""
        with contextlib.suppress(ImportError):
            import_botocore()

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        base = uri if uri.endswith("/") else uri + "/"
        if files:  # named: no listing, so no s3:ListBucket permission is needed
            return Directory.of_sizes(base, base, dict.fromkeys(files))
        return Directory.of_sizes(base, base, dict(list_s3_prefix(base, settings)))

    def opener(self, settings: SourceSettings) -> Opener:
        """The files of one model share one endpoint resolution and credential chain (botocore's session
        set-up costs about 0.1 s a file, which a directory of shards would pay per shard), and their
        connections (see :func:`~._store.shared_opener`)."""
        return shared_opener(
            lambda uri: open_s3(uri, settings),
            lambda first, uri, pool: first.sibling(parse_s3_uri(uri)[1], pool=pool),
        )


class FactoryStore(Store):
    """A scheme served by a plain factory of single-file sources (:func:`register_source`)."""

    def __init__(self, scheme: str, factory: Callable[[str, SourceSettings], Source]) -> None:
        self.schemes = (scheme,)
        self._factory = factory

    def open(self, uri: str, settings: SourceSettings) -> Source:
        return self._factory(uri, settings)

    def is_directory(self, uri: str) -> bool:
        return False
