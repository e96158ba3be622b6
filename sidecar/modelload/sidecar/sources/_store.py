"""What every kind of origin provides, in one shape: a :class:`Store` per URI scheme.

A store knows three things about the URIs of its scheme:

- whether a URI names one file or a model directory (:meth:`Store.is_directory`);
- what a directory holds (:meth:`Store.list`): each file's name and, where the origin says so, its size, the
  version listed (an ETag, a generation, a commit, a digest) and the checksums the origin keeps for it, as
  :class:`ListedFile` rows of a :class:`Directory`;
- how to read one file by byte ranges (:meth:`Store.open`, a :class:`~._base.Source`), and how to open many
  files of one model sharing their set-up (:meth:`Store.opener`: one credential chain, one endpoint
  resolution for every shard).

Everything above this protocol (the index reads, the plan, retries, the engine) is the same for every store,
so a new origin is one module that implements it and one line in :mod:`._registry`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import quote

from modelload.loader.errors import ConfigError, SourceNotFoundError

from ._base import Source
from ._connections import ConnectionPool
from ._responses import display_url
from ._settings import SourceSettings

__all__ = [
    "LISTED_FILES_MAX",
    "Directory",
    "ListedFile",
    "Opener",
    "Store",
    "check_listing_size",
    "join_uri",
    "shared_opener",
]

S = TypeVar("S", bound=Source)


class PooledSource(Source, Protocol):
    """A source whose connections can be shared with its siblings' (an HTTP-based store's)."""

    @property
    def pool(self) -> ConnectionPool: ...


P = TypeVar("P", bound=PooledSource)

Opener = Callable[[str], Source]
"""Opens one file of a model by its URI (as :meth:`Directory.file_uri` gives it)."""

LISTED_FILES_MAX = 100_000
"""The most files a model directory's listing may hold (its top level: deeper files are not listed). A
checkpoint has hundreds; every listed file costs the sidecar memory (a few hundred bytes with its checksums),
so a listing that goes on, page after page of distinct files (a bucket's root, or a mirror that lies), is cut
off here rather than when the process runs out of memory."""


def check_listing_size(count: int, uri: str) -> None:
    """Refuse a listing that already holds more than :data:`LISTED_FILES_MAX` files; called after each
    page, so no more than one page past the limit is ever held."""
    if count > LISTED_FILES_MAX:
        raise ConfigError(
            f"{display_url(uri)} lists more than {LISTED_FILES_MAX} files at its top level: a model directory"
            " holds far fewer; name the model's own folder (or, for an origin that should hold only the"
            " model, check what it serves)"
        )


@dataclass(frozen=True)
class ListedFile:
    """One file of a model directory, as its origin listed it."""

    size: int | None = None
    """Bytes, when the listing said (an HTTP(S) base probed by name does not list sizes of named files)."""
    uri: str | None = None
    """Where the file is read, when it is not the directory's URI joined with its name (a registry blob, a
    pinned revision's URL); read through the same store."""
    version: str | None = None
    """The version the listing saw (an ETag, a generation, a commit or a digest), when it gave one."""
    checksums: Mapping[str, str] = field(default_factory=dict)
    """The origin's own checksums of the whole file, by algorithm (``sha256`` hex, ``crc32c`` base64...)."""


@dataclass(frozen=True)
class Directory:
    """A model directory's files, by name relative to it."""

    uri: str
    """The directory's URI, ending in ``/`` (a local path for a local directory)."""
    display: str
    """The URI for messages, without credentials or query strings."""
    files: Mapping[str, ListedFile]
    """Every file found."""
    listed: bool = True
    """False for a directory whose files were probed by name (an HTTP(S) base): the shards its index names
    are then taken on the index's word (a missing one fails when it is read)."""

    @classmethod
    def of_sizes(
        cls, uri: str, display: str, sizes: Mapping[str, int | None], *, listed: bool = True
    ) -> Directory:
        """A directory whose listing gave only names and sizes."""
        return cls(uri, display, {name: ListedFile(size) for name, size in sizes.items()}, listed)

    @property
    def sizes(self) -> Mapping[str, int | None]:
        """Every file's size, where the listing gave one."""
        return {name: entry.size for name, entry in self.files.items()}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self.files))

    def with_files(self, names: Sequence[str]) -> Directory:
        """This directory, also holding ``names`` (of unknown size)."""
        added = {name: ListedFile() for name in names if name not in self.files}
        return Directory(self.uri, self.display, {**added, **self.files}, self.listed)

    def only(self, names: Sequence[str]) -> Directory:
        """This directory narrowed to ``names``, each of which it must hold."""
        missing = [name for name in names if name not in self.files]
        if missing:
            raise SourceNotFoundError(
                f"{self.display} has no file named {', '.join(missing[:3])}", uri=self.display
            )
        return Directory(self.uri, self.display, {name: self.files[name] for name in names}, self.listed)

    def file_uri(self, name: str) -> str:
        """The URI of file ``name`` in this directory."""
        entry = self.files.get(name)
        if entry is not None and entry.uri is not None:
            return entry.uri
        if "://" not in self.uri:
            return str(Path(self.uri) / name)
        return join_uri(self.uri, name)


def shared_opener(
    first: Callable[[str], P], sibling: Callable[[P, str, ConnectionPool], P]
) -> Callable[[str], P]:
    """An opener whose first file is opened with ``first`` and every later one as ``sibling(first, uri,
    pool)``: the files of one model share one credential chain and endpoint resolution, and their
    connections (``pool``: the last opened file's; a reader thread then keeps one connection per origin,
    not one per file, and over TLS each connection saved is a handshake). A file opened after all the
    others were closed (a model's index, read and closed first) starts the pool the next ones share
    (:meth:`ConnectionPool.share`)."""
    opened: list[P] = []
    current: list[ConnectionPool] = []
    lock = threading.Lock()

    def open_one(uri: str) -> P:
        with lock:
            if opened:
                source = sibling(opened[0], uri, current[0])
            else:
                source = first(uri)
                opened.append(source)
            current[:] = [source.pool]
            return source

    return open_one


def join_uri(base: str, name: str) -> str:
    """A file's URI under a directory URI ending in ``/`` (the name percent-encoded as a path segment)."""
    return base + quote(name, safe="~@!$&'()*+,;=:")


class Store:
    """The origins of one or more URI schemes. Subclasses implement :meth:`open`, and :meth:`list` when
    their directories can be listed; the defaults suit an origin of single files."""

    schemes: tuple[str, ...] = ()
    """The URI schemes served, lower case, without ``://``."""
    listed: bool = True
    """False for a store that only refuses other spellings with the right one (``abfss://`` -> ``az://``):
    not named among the supported schemes."""

    def open(self, uri: str, settings: SourceSettings) -> Source:
        """One file at ``uri``, read by ranges. No network I/O yet: the first stat or read does it."""
        raise NotImplementedError

    def is_directory(self, uri: str) -> bool:
        """Whether ``uri`` names a model directory rather than one file: by default, a trailing ``/``."""
        return uri.endswith("/")

    def check(self, uri: str) -> None:
        """Raise :class:`~modelload.loader.errors.SourceUriError` when ``uri`` cannot name a file or a
        directory of this store, without any I/O. The sidecar checks its source so at start: a malformed URI
        is a bad setting (exit status 2) rather than a load that fails and is then served as failed. By
        default the store's own parsing, which :meth:`is_directory` does."""
        self.is_directory(uri)

    def prepare(self, uri: str) -> None:
        """Import what reading ``uri`` will need (a cloud SDK the store imports on first use), so the sidecar
        pays for it while it starts, as it pays for its own imports, rather than inside the load. No I/O; an
        import that fails is left for the load to report. By default nothing."""

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        """The files of the directory at ``uri``; ``files`` names them instead of listing, where the store
        allows that (less permission needed, or no listing at all)."""
        raise ConfigError(f"{display_url(uri)} cannot be listed: name one file of the model instead")

    def opener(self, settings: SourceSettings) -> Opener:
        """How the files of one model are opened: by default each on its own."""
        return lambda uri: self.open(uri, settings)
