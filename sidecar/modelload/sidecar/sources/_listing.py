"""A model directory at a source: what files it has, and the URI of each.

A source URI names a directory when it is a local directory, an ``s3://bucket/prefix/`` or an
``http(s)://.../`` base URL (both ending in ``/``). How its files are found:

- a local directory is listed (top level only);
- an S3 prefix is listed with ListObjectsV2 (top level only: ``delimiter=/``), unless the caller names the
  files (then only ``s3:GetObject`` is needed);
- an HTTP(S) base has no listing: unless the caller names the files, the well-known names of a Hugging Face
  directory are probed (``model.safetensors.index.json``, ``model.safetensors``, ``model.tensors``, the
  config and tokenizer files); a probe that finds nothing (404) is simply absent, and any other answer
  (401, 403, 500 after retries) is an error.

Which of the files are weights is decided by :func:`modelload.loader.formats.select_model_files`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from modelload.loader.errors import ConfigError, ModelloadError, SourceNotFoundError, SourceUriError
from modelload.loader.formats import SAFETENSORS_INDEX, WELL_KNOWN_SMALL_FILES
from modelload.loader.localdir import list_local_directory

from ._registry import open_source
from ._responses import display_url
from ._retry import stat_source
from ._s3 import list_s3_prefix
from ._settings import RetryPolicy, SourceSettings

__all__ = ["Directory", "directory_hint", "is_directory", "list_directory"]

_PROBED = (SAFETENSORS_INDEX, "model.safetensors", "model.tensors", *WELL_KNOWN_SMALL_FILES)
_ONE_TRY = RetryPolicy(attempts=1, initial_backoff=0.0, max_backoff=0.0, deadline=10.0)
"""A hint's probes are not retried: a failed load waits for no courtesy."""


@dataclass(frozen=True)
class Directory:
    """A model directory's files, by name relative to it."""

    uri: str
    """The directory's URI, ending in ``/`` (a local path for a local directory)."""
    display: str
    """The URI for messages, without credentials or query strings."""
    sizes: Mapping[str, int | None]
    """Every file found, with its size where the listing gave one."""
    listed: bool = True
    """False for an HTTP(S) directory, whose files were probed by name: the shards its index names are
    then taken on the index's word (a missing one fails when it is read)."""

    def with_files(self, names: Sequence[str]) -> Directory:
        """This directory, also holding ``names`` (of unknown size)."""
        return Directory(self.uri, self.display, {**dict.fromkeys(names), **self.sizes}, self.listed)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.sizes))

    def file_uri(self, name: str) -> str:
        """The URI of file ``name`` in this directory."""
        if "://" not in self.uri:
            return str(Path(self.uri) / name)
        return _join(self.uri, name)


def _join(base: str, name: str) -> str:
    """A file's URL under a directory URL ending in ``/`` (the name percent-encoded as a path segment)."""
    return base + quote(name, safe="~@!$&'()*+,;=:")


def _local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):
        return Path(unquote(urlsplit(uri).path))
    if "://" in uri:
        return None
    return Path(uri)


def is_directory(uri: str) -> bool:
    """Whether ``uri`` names a model directory rather than one file (see the module's rules)."""
    local = _local_path(uri)
    if local is not None:
        return local.is_dir()
    if uri.startswith("s3://"):
        return uri.endswith("/") or "/" not in uri.removeprefix("s3://")
    return uri.startswith(("http://", "https://")) and urlsplit(uri).path.endswith("/")


def list_directory(uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
    """List the model directory at ``uri``; ``files`` names its files instead (required for HTTP(S)
    directories that do not follow the Hugging Face names)."""
    local = _local_path(uri)
    if local is not None:
        return _list_local(local, files)
    if uri.startswith("s3://"):
        base = uri if uri.endswith("/") else uri + "/"
        if files:  # named: no listing, so no s3:ListBucket permission is needed
            return Directory(base, base, dict.fromkeys(files))
        return Directory(base, base, dict(list_s3_prefix(base, settings)))
    if uri.startswith(("http://", "https://")):
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
        found = _probe(uri, names, settings, required=bool(files))
        return Directory(uri, display_url(uri), found, listed=bool(files))
    raise ConfigError(f"{display_url(uri)} is not a directory this loader can list (file, s3, http, https)")


def _list_local(path: Path, files: Sequence[str]) -> Directory:
    try:
        entries = list_local_directory(path)
    except FileNotFoundError:
        raise SourceNotFoundError(f"{path} does not exist", uri=str(path)) from None
    except OSError as exc:
        raise ConfigError(f"{path} cannot be listed: {exc.strerror}") from None
    sizes: dict[str, int | None] = dict(entries)
    if files:
        sizes = _only(files, sizes, str(path))
    return Directory(str(path), str(path).rstrip("/") + "/", sizes)


def _only(files: Sequence[str], sizes: dict[str, int | None], where: str) -> dict[str, int | None]:
    missing = [f for f in files if f not in sizes]
    if missing:
        raise SourceNotFoundError(f"{where} has no file named {', '.join(missing[:3])}", uri=where)
    return {f: sizes[f] for f in files}


def _probe(
    base: str, names: Sequence[str], settings: SourceSettings, *, required: bool
) -> dict[str, int | None]:
    """Stat ``names`` under an HTTP(S) base in parallel; absent ones are left out unless ``required``."""

    def stat(name: str) -> tuple[str, int | None]:
        uri = _join(base, name)
        source = open_source(uri, settings)
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


def directory_hint(uri: str, settings: SourceSettings) -> str | None:
    """What to say when ``uri``, read as one file, does not exist but names a model directory: an S3 prefix
    ``key/`` that holds files, or an HTTP(S) base whose usual files answer. None when it does not look like
    one (or the look fails: the hint is a courtesy, the not-found error stands)."""
    if uri.endswith("/") or _local_path(uri) is not None:
        return None
    base = uri + "/"
    try:
        if uri.startswith("s3://"):
            names = sorted(list_s3_prefix(base, settings))
        elif uri.startswith(("http://", "https://")) and not urlsplit(uri).query:
            probe = SourceSettings(http=settings.http, s3=settings.s3, retry=_ONE_TRY)
            names = sorted(
                _probe(base, (SAFETENSORS_INDEX, "config.json", "model.safetensors"), probe, required=False)
            )
        else:
            return None
    except ModelloadError:
        return None
    if not names:
        return None
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    shown_base = display_url(base)
    return f"but {shown_base} is a directory holding {shown}: end the source with '/' to load the model in it"
