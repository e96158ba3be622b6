"""``oci://REGISTRY/REPOSITORY:TAG`` or ``@sha256:DIGEST``: a model artifact in an OCI registry as a store.

Listing an artifact resolves its tag once to the manifest's digest and names that digest from then on: the
files of the load are the blobs that one manifest lists, so a tag moved during the load cannot mix versions.
Each layer becomes files of the model directory (see :mod:`._media` for the conventions recognised):

- a raw layer is one file, named by its ``org.cncf.model.filepath`` (or ``org.opencontainers.image.title``)
  annotation, read by range from its blob;
- an uncompressed tar layer holds files at offsets found with a few small range reads (:mod:`._tar`), each
  read by range at its offset inside the blob;
- a compressed layer that holds weights or their configuration is refused, with how to push a rangeable one;
  documentation, code and datasets are skipped.

Every file knows the digest of its blob (:meth:`checksum`), which the load proves the landed bytes against.
A manifest at a digest never changes, so the store keeps the last few artifacts it listed: opening a file by
the URI its listing gave (``oci://REGISTRY/REPOSITORY@sha256:.../NAME``) asks the registry nothing more.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from modelload.loader.errors import ConfigError, SourceError, SourceNotFoundError

from .._base import ObjectInfo, Source, SourceBase, check_range
from .._published_digest import PublishedDigest
from .._retry import read_range
from .._service import ServiceFile
from .._settings import SourceSettings
from .._store import Directory, ListedFile, Opener, Store
from ._client import RegistryClient
from ._media import ANNOTATION_FILEPATH, ANNOTATION_TITLE, classify
from ._reference import DIGEST, OciRef, parse_oci_uri
from ._tar import BLOCK, looks_like_tar, tar_members

__all__ = ["OciStore"]

_Members = list[tuple[str, int, int]]

_REMEMBERED = 32


@dataclass(frozen=True)
class _File:
    """Where one file of an artifact lives: a blob, and the file's window in it."""

    blob: str
    blob_size: int
    offset: int
    size: int


@dataclass(frozen=True)
class _Artifact:
    digest: str
    files: dict[str, _File]


class _Member(SourceBase):
    """A file inside a tar layer: a window of its blob, read by range at the file's offset."""

    pins_version = True  # a blob is named by its digest

    def __init__(self, blob: ServiceFile, offset: int, size: int, *, display: str) -> None:
        super().__init__(display)
        self._blob = blob
        self._offset = offset
        self._size = size
        self.supports_fd = blob.supports_fd

    def _stat(self) -> ObjectInfo:
        info = self._blob.stat()
        check_range(self._offset, self._size, info.size, uri=self.display_uri)
        return ObjectInfo(self._size, info.etag, info.last_modified, info.accepts_ranges)

    def restat(self) -> ObjectInfo:
        info = self._blob.restat()
        return ObjectInfo(self._size, info.etag, info.last_modified, info.accepts_ranges)

    def read_into(self, offset: int, buf: memoryview) -> None:
        self._checked_range(offset, len(memoryview(buf).cast("B")))
        self._blob.read_into(self._offset + offset, buf)

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        self._checked_range(offset, length)
        self._blob.read_into_fd(self._offset + offset, length, fd, fd_offset)

    def checksum(self) -> PublishedDigest | None:
        whole = self._blob.checksum()
        if whole is None:
            return None
        return PublishedDigest(
            whole.algorithm,
            whole.expected,
            whole.object_id,
            whole.object_size,
            offset=self._offset,
            where=whole.where,
            object_source=self._blob,
        )

    def close(self) -> None:
        self._blob.close()


class OciStore(Store):
    """OCI registries (the distribution API) as the store of ``oci://`` URIs."""

    schemes = ("oci",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._artifacts: OrderedDict[tuple[str, str, str], _Artifact] = OrderedDict()

    def is_directory(self, uri: str) -> bool:
        path = parse_oci_uri(uri).path
        return not path or path.endswith("/")

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        ref = parse_oci_uri(uri)
        if ref.path:
            raise ConfigError(f"{uri}: an artifact is loaded whole; drop the path after the digest")
        client = RegistryClient(ref, settings)
        artifact = self._artifact(client, ref)
        pinned = ref.pinned(artifact.digest)
        entries = {
            name: ListedFile(
                size=f.size,
                uri=pinned.file(name).uri,
                version=artifact.digest,
                checksums=_whole(f),
            )
            for name, f in artifact.files.items()
        }  # fmt: skip
        directory = Directory(pinned.uri + "/", ref.display + "/", entries)
        return directory.only(files) if files else directory

    def open(self, uri: str, settings: SourceSettings) -> Source:
        ref = parse_oci_uri(uri)
        return self._open(ref, RegistryClient(ref, settings))

    def opener(self, settings: SourceSettings) -> Opener:
        """The files of one model share one client per repository (one token flow)."""
        clients: dict[tuple[str, str], RegistryClient] = {}
        lock = threading.Lock()

        def open_one(uri: str) -> Source:
            ref = parse_oci_uri(uri)
            with lock:
                client = clients.get((ref.registry, ref.repository))
                if client is None:
                    client = clients[(ref.registry, ref.repository)] = RegistryClient(ref, settings)
            return self._open(ref, client)

        return open_one

    def _open(self, ref: OciRef, client: RegistryClient) -> Source:
        if not ref.path or ref.path.endswith("/"):
            raise ConfigError(
                f"{ref.display} names an artifact, not one of its files: load it as a directory"
            )
        artifact = self._artifact(client, ref)
        found = artifact.files.get(ref.path)
        shown = ref.pinned(artifact.digest).display if ref.tag else ref.uri
        if found is None:
            raise SourceNotFoundError(
                f"{shown}: the artifact {artifact.digest} has no file {ref.path!r}", uri=shown
            )
        blob = client.blob(found.blob, found.blob_size, display=shown)
        if found.offset == 0 and found.size == found.blob_size:
            return blob
        return _Member(blob, found.offset, found.size, display=shown)

    # --- the artifact ----------------------------------------------------------------------------------

    def _artifact(self, client: RegistryClient, ref: OciRef) -> _Artifact:
        key_base = (ref.registry, ref.repository)
        if ref.digest is not None:
            with self._lock:
                known = self._artifacts.get((*key_base, ref.digest))
            if known is not None:
                return known
        digest, manifest = client.manifest()
        artifact = _Artifact(digest, self._files(client, ref.pinned(digest), manifest))
        with self._lock:
            self._artifacts[(*key_base, digest)] = artifact
            self._artifacts.move_to_end((*key_base, digest))
            while len(self._artifacts) > _REMEMBERED:
                self._artifacts.popitem(last=False)
        return artifact

    def _files(self, client: RegistryClient, ref: OciRef, manifest: dict[str, Any]) -> dict[str, _File]:
        files: dict[str, _File] = {}
        for number, layer in enumerate(manifest["layers"]):
            digest, size, media = _descriptor(layer, number, ref)
            annotations = layer.get("annotations") or {}
            path = str(annotations.get(ANNOTATION_FILEPATH) or annotations.get(ANNOTATION_TITLE) or "")
            kind = classify(media)
            where = f"{ref.display} layer {number} ({media}{', ' + path if path else ''})"
            if kind.shape == "compressed":
                if kind.needed:
                    raise ConfigError(
                        f"{where} is compressed, and a compressed layer cannot be read by range: push the "
                        "model with uncompressed layers, one per file (modelload push DIR oci://...; or oras "
                        "push with FILE:application/vnd.cncf.model.weight.v1.raw; or kit pack "
                        "--compression none)"
                    )
                continue
            if kind.shape == "tar" or kind.sniff:
                members = self._tar(client, ref, digest, size, sniff=kind.sniff, where=where)
                if members is not None:
                    for name, offset, length in members:
                        _add(files, name, _File(digest, size, offset, length), where=where)
                    continue
            if not path:
                if kind.needed:
                    raise SourceError(
                        f"{where} names no file (no {ANNOTATION_FILEPATH} or {ANNOTATION_TITLE} annotation)",
                        uri=ref.display,
                    )
                continue
            _add(files, path.strip("/").removeprefix("./"), _File(digest, size, 0, size), where=where)
        return files

    def _tar(
        self, client: RegistryClient, ref: OciRef, digest: str, size: int, *, sniff: bool, where: str
    ) -> _Members | None:
        """The files of a tar layer; None for a "tar" that is a plain file (``sniff``)."""
        blob = client.blob(digest, size, display=where)
        policy = client.settings.retry

        def read(offset: int, length: int) -> bytes:
            buf = bytearray(length)
            read_range(blob, offset, memoryview(buf), policy=policy)
            return bytes(buf)

        try:
            if sniff and (size < BLOCK or not looks_like_tar(read(0, BLOCK))):
                return None
            return [(m.name, m.offset, m.size) for m in tar_members(read, size, where=where) if m.name]
        finally:
            blob.close()


def _whole(found: _File) -> dict[str, str]:
    """The checksums of a file that is a whole blob: its digest; none for a window of a tar."""
    if found.offset == 0 and found.size == found.blob_size:
        return {"sha256": found.blob.removeprefix("sha256:")}
    return {}


def _descriptor(layer: object, number: int, ref: OciRef) -> tuple[str, int, str]:
    if not isinstance(layer, dict):
        raise SourceError(f"{ref.display}: layer {number} is not a descriptor", uri=ref.display)
    digest, size, media = layer.get("digest"), layer.get("size"), layer.get("mediaType")
    if not isinstance(digest, str) or not DIGEST.match(digest):
        raise SourceError(
            f"{ref.display}: layer {number} has digest {digest!r}; only sha256 digests are read",
            uri=ref.display,
        )
    if not isinstance(size, int) or size < 0 or not isinstance(media, str):
        raise SourceError(f"{ref.display}: layer {number} has no size or media type", uri=ref.display)
    return digest, size, media


def _add(files: dict[str, _File], name: str, found: _File, *, where: str) -> None:
    if not name or any(part in ("", ".", "..") for part in name.split("/")):
        raise SourceError(f"{where}: a file path {name!r} is empty or holds '.' or '..'", uri=where)
    if name in files:
        raise SourceError(f"{where}: two layers hold a file named {name!r}", uri=where)
    files[name] = found
