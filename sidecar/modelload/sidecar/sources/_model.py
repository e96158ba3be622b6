"""Open a model at a source URI, one weight file or a directory of them, and read its index.

The sidecar streams what this returns, and the operator sizes a pod's volume from it, so both see the same
files, the same tensors and the same errors. For a directory (see :mod:`._listing`), every weight file is
opened as a source of its own (each checks its own ETag on every range), their indexes are read in
parallel with one small read or two each, and merged into one index in which each tensor remembers its
file; the small files (config, tokenizer) are listed with their sizes, checked against their bounds, and
fetched with :func:`fetch_small_file`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from modelload.loader.errors import TruncatedError
from modelload.loader.formats import (
    SAFETENSORS_INDEX,
    SMALL_FILE_LIMIT,
    ModelIndex,
    check_small_files,
    merge_indexes,
    read_index,
    select_model_files,
    weight_shards,
)

from ._base import ObjectInfo, Source
from ._checksum import checksum_of, verify_bytes
from ._listing import Directory, is_directory, list_directory
from ._registry import open_source, store_for
from ._retry import RetryEvent, read_range, stat_source
from ._settings import SourceSettings
from ._store import Opener

__all__ = ["OpenedModel", "fetch_small_file", "open_model"]

_WORKERS = 8


@dataclass
class OpenedModel:
    """A model's weight sources (open: close them with :meth:`close`), their validators, and small files."""

    uri: str
    """The model's URI for messages and metadata: a file's, or the directory's (ending in ``/``)."""
    sources: list[Source]
    """One per weight file, in the order of ``index.files`` (a single source for a single file)."""
    infos: list[ObjectInfo]
    format: Literal["auto", "tensorizer", "safetensors"]
    weights: tuple[str, ...] = ()
    """A directory's weight files, by name; empty for a single file."""
    directory: Directory | None = None
    small: dict[str, int] = field(default_factory=dict)
    """The small files to copy into the model directory, with their sizes."""
    opener: Opener | None = None
    """How this model's files are opened (sharing their store's set-up); None: :func:`open_source`."""
    _index: ModelIndex | None = None
    _kept: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    """The bytes each weight file's index was read from, by file: what a digest check hashes for them."""

    @property
    def size(self) -> int:
        """Bytes of all weight files."""
        return sum(info.size for info in self.infos)

    @property
    def small_bytes(self) -> int:
        return sum(self.small.values())

    @property
    def fingerprint(self) -> str | None:
        """A validator of every weight file at once (names, ETags, sizes); None when a file has no ETag."""
        if any(info.etag is None for info in self.infos):
            return None
        if self.directory is None:
            return self.infos[0].etag
        digest = hashlib.sha256()
        for name, info in zip(self.weights, self.infos, strict=True):
            digest.update(f"{name}\0{info.etag}\0{info.size}\n".encode())
        return f'"dir-{digest.hexdigest()[:32]}"'

    @property
    def index(self) -> ModelIndex:
        """The model's index (every weight file's, merged): read on first use, with one or two small reads
        per weight file, in parallel."""
        if self._index is None:
            workers = min(_WORKERS, len(self.sources))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="index") as pool:
                indexes = list(pool.map(self._read_index, range(len(self.sources)), self.sources, self.infos))
            if self.directory is None:
                self._index = indexes[0]
            else:
                named = list(zip(self.weights, indexes, strict=True))
                self._index = merge_indexes(named, where=self.directory.display)
        return self._index

    def _read_index(self, file: int, source: Source, info: ObjectInfo) -> ModelIndex:
        uri = source.display_uri
        kept = self._kept.setdefault(file, [])

        def read(offset: int, length: int) -> bytes:
            data = source.read_bytes(offset, length)
            kept.append((offset, data))
            return data

        index = read_index(read, format=self.format, source=uri, size=info.size)
        if index.data_end > info.size:
            raise TruncatedError(
                f"the index needs {index.data_end} bytes and the object has {info.size}: it is truncated",
                source=uri,
            )
        return index

    def kept_bytes(self, file: int, offset: int, length: int) -> bytes | None:
        """Bytes ``[offset, offset + length)`` of weight file ``file`` as its index read them, when it did."""
        out = bytearray(length)
        covered = 0  # bytes of [offset, offset + covered) assembled so far
        for start, data in sorted(self._kept.get(file, ()), key=lambda read: read[0]):
            at = offset + covered
            if start <= at < start + len(data):
                take = min(start + len(data), offset + length) - at
                out[covered : covered + take] = data[at - start : at - start + take]
                covered += take
        return bytes(out) if covered == length else None

    def display(self, file: int) -> str:
        """The URI of weight file ``file``, for messages."""
        return self.sources[file].display_uri

    def close(self) -> None:
        for source in self.sources:
            source.close()


def open_model(
    uri: str,
    settings: SourceSettings,
    *,
    format: Literal["auto", "tensorizer", "safetensors"] = "auto",  # noqa: A002 - the CLI's word for it
    files: Sequence[str] = (),
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> OpenedModel:
    """Open the model at ``uri`` (a weight file, or a directory: see :func:`is_directory`) and stat its
    weight files; :attr:`OpenedModel.index` reads their indexes.

    ``files`` names a directory's files instead of listing it (an HTTP(S) directory without the usual names).
    """
    if files or is_directory(uri):
        return _open_directory(uri, settings, format=format, files=files, on_retry=on_retry)
    source = open_source(uri, settings)
    try:
        info = stat_source(source, policy=settings.retry, on_retry=on_retry)
    except BaseException:
        source.close()
        raise
    return OpenedModel(uri=source.display_uri, sources=[source], infos=[info], format=format)


def _open_directory(
    uri: str,
    settings: SourceSettings,
    *,
    format: Literal["auto", "tensorizer", "safetensors"],  # noqa: A002 - the CLI's word for it
    files: Sequence[str],
    on_retry: Callable[[RetryEvent], None] | None,
) -> OpenedModel:
    directory = list_directory(uri, settings, files=files)
    where = directory.display
    opener = store_for(directory.uri).opener(settings)
    index_json = None
    if SAFETENSORS_INDEX in directory.sizes and format != "tensorizer":
        index_json = fetch_small_file(
            directory, SAFETENSORS_INDEX, settings, on_retry=on_retry, opener=opener
        )
        if not directory.listed:
            directory = directory.with_files(weight_shards(index_json, where=directory.display))
    chosen = select_model_files(directory.names, where=where, index_json=index_json, format=format)
    small = {name: directory.sizes[name] for name in chosen.small}
    small_sizes = {name: size for name, size in small.items() if size is not None}
    check_small_files(small_sizes, where=where)
    sources: list[Source] = []

    def stat(source: Source) -> ObjectInfo:
        return stat_source(source, policy=settings.retry, on_retry=on_retry)

    try:
        for name in chosen.weights:
            sources.append(opener(directory.file_uri(name)))
        with ThreadPoolExecutor(max_workers=min(_WORKERS, len(sources)), thread_name_prefix="stat") as pool:
            infos = list(pool.map(stat, sources))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return OpenedModel(
        uri=directory.display,
        sources=sources,
        infos=infos,
        format=chosen.format,
        weights=chosen.weights,
        directory=directory,
        small=small_sizes,
        opener=opener,
    )


def fetch_small_file(
    directory: Directory,
    name: str,
    settings: SourceSettings,
    *,
    on_retry: Callable[[RetryEvent], None] | None = None,
    opener: Opener | None = None,
) -> bytes:
    """The whole content of a small file of ``directory``, at most :data:`SMALL_FILE_LIMIT` bytes."""
    uri = directory.file_uri(name)
    source = opener(uri) if opener is not None else open_source(uri, settings)
    try:
        info = stat_source(source, policy=settings.retry, on_retry=on_retry)
        check_small_files({name: info.size}, where=directory.display)
        buf = bytearray(min(info.size, SMALL_FILE_LIMIT))
        read_range(source, 0, memoryview(buf), policy=settings.retry, on_retry=on_retry)
        checksum = checksum_of(source)
        if checksum is not None and checksum.covers_file(len(buf)):
            verify_bytes(bytes(buf), checksum)  # the Hub's git blob id or SHA-256, a registry blob's digest
        return bytes(buf)
    finally:
        source.close()
