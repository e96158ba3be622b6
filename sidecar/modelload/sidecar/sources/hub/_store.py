"""``hf://ORG/NAME[@REVISION][/PATH]``: a model repository on the Hugging Face Hub as a store.

The revision (``main`` by default, a branch, a tag or a commit) is resolved once, when the model is listed,
to the commit it names; every file is then read through its resolve URL *at that commit*, so a branch that
moves during the load cannot mix two versions. The folder (the repository's top, or ``PATH/``) is listed with
the Hub's tree API: sizes, and the checksums the Hub publishes (the SHA-256 of each LFS file, the git blob id
of the others), which the load proves the landed bytes against. ``hf://ORG/NAME@REV/FILE`` names one file.

A listing at a commit never changes, so the store keeps the last few: a file opened by the URI the listing
gave it finds its size and checksum there without asking again.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

from modelload.loader.errors import SourceNotFoundError

from .._base import Source
from .._http import _Exchange
from .._published_digest import PublishedDigest
from .._service import ServiceFile
from .._settings import SourceSettings
from .._store import Directory, ListedFile, Opener, Store
from ._api import COMMIT, HubClient, HubRef, explain, parse_hub_uri

__all__ = ["HubFile", "HubStore"]

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")
_REMEMBERED = 32


class HubFile(ServiceFile):
    """One file of a repository at a commit, read by ranges from its resolve URL (and the redirect target).

    Without a listed checksum, the Hub's first answer gives one: ``X-Linked-Etag`` is an LFS file's SHA-256,
    a plain file's ``ETag`` its git blob id.
    """

    def __init__(
        self,
        ref: HubRef,
        client: HubClient,
        *,
        listed: ListedFile | None,
        settings: SourceSettings,
    ) -> None:
        self.ref = ref
        display = ref.uri
        checksum = None
        if listed is not None and listed.size is not None:
            for algorithm, expected in listed.checksums.items():
                checksum = PublishedDigest(algorithm, expected, display, listed.size, where=display)
        super().__init__(
            client.resolve_url(ref, ref.revision),
            display=display,
            settings=settings.http,
            auth=client.access,
            explain=explain(client.access, ref, uri=display),
            size=listed.size if listed is not None else None,
            checksum=checksum,
        )
        self._headers: dict[str, str] = {}

    def _answered(self, exchange: _Exchange) -> None:
        if exchange.origin == self._service and not self._headers:
            names = ("X-Linked-Etag", "X-Linked-Size", "ETag", "X-Repo-Commit")
            self._headers = {name: value for name in names if (value := exchange.header(name))}

    def checksum(self) -> PublishedDigest | None:
        if self._checksum is not None:
            return self._checksum
        size = self.stat().size
        linked = self._headers.get("X-Linked-Etag", "").strip('"').removeprefix("W/").strip('"').lower()
        if _SHA256.match(linked):
            return PublishedDigest("sha256", linked, self.display_uri, size, where=self.display_uri)
        etag = self._headers.get("ETag", "").removeprefix("W/").strip('"').lower()
        if not linked and _GIT_OID.match(etag):
            return PublishedDigest("git-sha1", etag, self.display_uri, size, where=self.display_uri)
        return None


class HubStore(Store):
    """The Hugging Face Hub (``HF_ENDPOINT`` for a mirror) as the store of ``hf://`` URIs."""

    schemes = ("hf",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._listings: OrderedDict[tuple[str, str, str, str], dict[str, ListedFile]] = OrderedDict()

    def is_directory(self, uri: str) -> bool:
        path = parse_hub_uri(uri).path
        return not path or path.endswith("/")

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        ref = parse_hub_uri(uri)
        client = HubClient(settings)
        commit = client.commit(ref)
        folder = ref.path.strip("/")
        entries = client.folder(ref, commit)
        self._remember((client.access.endpoint, ref.repo, commit, folder), entries)
        base = HubRef(ref.repo, commit, f"{folder}/" if folder else "").uri
        shown = HubRef(ref.repo, ref.revision, f"{folder}/" if folder else "").uri
        directory = Directory(base, shown, entries)
        return directory.only(files) if files else directory

    def open(self, uri: str, settings: SourceSettings) -> Source:
        return self._open(uri, settings, HubClient(settings))

    def opener(self, settings: SourceSettings) -> Opener:
        """The files of one model share one client (one endpoint, one token)."""
        client = HubClient(settings)
        return lambda uri: self._open(uri, settings, client)

    def _open(self, uri: str, settings: SourceSettings, client: HubClient) -> Source:
        ref = parse_hub_uri(uri)
        if not ref.path or ref.path.endswith("/"):
            raise SourceNotFoundError(f"{uri} names a folder, not a file", uri=uri)
        commit = client.commit(ref)  # no request for a commit: pinned already
        ref = ref.with_revision(commit)
        folder, _, name = ref.path.rpartition("/")
        with self._lock:
            entries = self._listings.get((client.access.endpoint, ref.repo, commit, folder))
        listed = entries.get(name) if entries is not None else None
        if entries is not None and listed is None:
            raise SourceNotFoundError(f"{uri} is not in its folder's listing at commit {commit}", uri=uri)
        return HubFile(ref, client, listed=listed, settings=settings)

    def _remember(self, key: tuple[str, str, str, str], entries: dict[str, ListedFile]) -> None:
        if not COMMIT.match(key[2]):
            return
        with self._lock:
            self._listings[key] = entries
            self._listings.move_to_end(key)
            while len(self._listings) > _REMEMBERED:
                self._listings.popitem(last=False)
