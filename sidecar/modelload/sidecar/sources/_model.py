"""Open a model at a source URI, one weight file or a directory of them, and read its index.

The sidecar streams what this returns, and the operator sizes a pod's volume from it, so both see the same
files, the same tensors and the same errors. For a directory (see :mod:`._listing`), every weight file is
opened as a source of its own (each checks its own ETag on every range), their indexes are read in
parallel with one small read or two each, and merged into one index in which each tensor remembers its
file; the small files (config, tokenizer) are listed with their sizes, checked against their bounds, and
fetched with :func:`fetch_small_file`.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from modelload.loader.errors import SourceNotFoundError, TruncatedError
from modelload.loader.formats import (
    PREFIX_LENGTH,
    SAFETENSORS_INDEX,
    SMALL_FILE_LIMIT,
    ModelIndex,
    check_small_files,
    merge_indexes,
    read_index,
    select_model_files,
    weight_shards,
)
from modelload.loader.formats.safetensors import FIRST_READ_LENGTH

from ._base import ObjectInfo, Source
from ._listing import Directory, directory_hint, is_directory, list_directory
from ._published_digest import PublishedDigest, checksum_of, verify_bytes
from ._registry import open_source, store_for
from ._retry import RetryEvent, read_bytes, stat_with_prefix
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
    fetched: dict[str, bytes] = field(default_factory=dict)
    """Small files already read while opening (the safetensors index), so they are not read again."""
    _indexes: list[ModelIndex] = field(default_factory=list)
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
        """The model's index (every weight file's, merged): read when the model is opened, from the bytes
        its look-up brought (one request a file, a second one only for an index longer than that)."""
        if self._index is None:
            if self.directory is None:
                self._index = self._indexes[0]
            else:
                named = list(zip(self.weights, self._indexes, strict=True))
                self._index = merge_indexes(named, where=self.directory.display)
            self._indexes = []
        return self._index

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
        info, index, kept = _stat_and_index(source, 0, format, settings, on_retry)
    except SourceNotFoundError as exc:
        source.close()
        hint = directory_hint(uri, settings)
        if hint is None:
            raise
        raise SourceNotFoundError(f"{exc}, {hint}", uri=exc.uri) from exc
    except BaseException:
        source.close()
        raise
    return OpenedModel(
        uri=source.display_uri,
        sources=[source],
        infos=[info],
        format=format,
        _indexes=[index],
        _kept={0: kept},
    )


def _stat_and_index(
    source: Source,
    file: int,
    format: Literal["auto", "tensorizer", "safetensors"],  # noqa: A002 - the CLI's word for it
    settings: SourceSettings,
    on_retry: Callable[[RetryEvent], None] | None,
    shapes: dict[tuple[int, ...], tuple[int, ...]] | None = None,
    turns: _Turns | None = None,
    first_read: int = PREFIX_LENGTH,
) -> tuple[ObjectInfo, ModelIndex, list[tuple[int, bytes]]]:
    """Weight file ``file``'s size and validators, its index, read from the bytes the same request brought
    (a second read only for an index longer than ``first_read``), and the index's bytes, kept where
    the source knows a digest of the whole file (``hf://``, ``oci://``): it hashes them, as they are not
    landed (:meth:`OpenedModel.kept_bytes`). ``shapes`` is shared by the files of one model (each distinct
    shape one tuple, see :func:`~modelload.loader.formats.read_index`); so is ``turns``, when the files
    are read on several threads: they read at once and parse in turn. ``first_read``: how many bytes the
    look-up brings (:func:`first_read_length`)."""
    turns = turns or _Turns()
    info, head = stat_with_prefix(source, first_read, policy=settings.retry, on_retry=on_retry)
    more: list[tuple[int, bytes]] = []

    def read(offset: int, length: int) -> bytes:
        if offset + length <= len(head) or len(head) >= info.size:
            return head[offset : offset + length]
        # The rest of a long index is retried as every range of the load is, while another file parses.
        length = min(length, info.size - offset)
        with turns.waiting():
            data = read_bytes(source, offset, length, policy=settings.retry, on_retry=on_retry)
        more.append((offset, data))
        return data

    uri = source.display_uri
    with turns.parsing():
        index = read_index(
            read, format=format, source=uri, size=info.size, file=file, shapes=shapes, first_read=first_read
        )
    if index.data_end > info.size:
        raise TruncatedError(
            f"the index needs {index.data_end} bytes and the object has {info.size}: it is truncated",
            source=uri,
        )
    if checksum_of(source) is None:  # no digest of the whole file will hash them (11 MiB at 160 shards)
        return info, index, []
    # Only the index's own bytes: the rest of the first read is landed as tensors (160 shards x 512 KiB
    # kept whole would be 80 MiB held for the whole load).
    kept = [(0, head[: index.index_length])] + [(o, d[: max(index.index_length - o, 0)]) for o, d in more]
    return info, index, [(o, d) for o, d in kept if d]


def first_read_length(index_json: bytes | None, shards: int) -> int:
    """How many bytes each weight file's look-up brings with it, for its index: :data:`PREFIX_LENGTH`, or
    less for the shards of a safetensors directory whose ``model.safetensors.index.json`` says their
    headers are short.

    A shard's header lists each of its tensors' names with some 70 bytes of dtype, shape and offsets; the
    index lists each name with its shard's file name (some 35 bytes), so twice a shard's share of the index
    holds its header, and a shard with more than that costs one more read. 160 shards of 100,000 tensors
    read 80 MiB with 512 KiB each, for headers of 70 KiB: 0.1 CPU-s of the load's 1.9 over nginx."""
    if index_json is None or shards <= 0:
        return PREFIX_LENGTH
    share = 2 * len(index_json) // shards + (16 << 10)  # (and room for the header's metadata)
    return min(PREFIX_LENGTH, max(FIRST_READ_LENGTH, -(-share // 4096) * 4096))


class _Turns:
    """One parser at a time among the threads that read a model's indexes.

    The reads must overlap (a remote origin answers each after a round trip), but parsing is Python that
    holds the GIL: eight threads parsing at once fought for it (160 headers of 100,000 tensors cost 0.43 to
    0.58 CPU-s where one thread took 0.36). So a thread parses only in its turn, and gives the turn up
    while it reads the rest of a long index."""

    def __init__(self) -> None:
        self._turn = threading.Lock()

    @contextlib.contextmanager
    def parsing(self) -> Iterator[None]:
        with self._turn:
            yield

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Inside :meth:`parsing`: the turn given up, and taken again after."""
        self._turn.release()
        try:
            yield
        finally:
            self._turn.acquire()


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
    shards = None
    if SAFETENSORS_INDEX in directory.sizes and format != "tensorizer":
        index_json = fetch_small_file(
            directory, SAFETENSORS_INDEX, settings, on_retry=on_retry, opener=opener
        )
        if not directory.listed:
            shards = weight_shards(index_json, where=directory.display)
            directory = directory.with_files(shards)
    chosen = select_model_files(
        directory.names, where=where, index_json=index_json, format=format, shards=shards
    )
    small = {name: directory.sizes[name] for name in chosen.small}
    small_sizes = {name: size for name, size in small.items() if size is not None}
    check_small_files(small_sizes, where=where)
    sources: list[Source] = []
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # the shards' tensors share their shapes' tuples
    turns = _Turns()

    safetensors_index = index_json if chosen.format == "safetensors" else None  # (tensorizer files: no)
    first_read = first_read_length(safetensors_index, len(chosen.weights))

    def stat(source: Source, file: int) -> tuple[ObjectInfo, ModelIndex, list[tuple[int, bytes]]]:
        return _stat_and_index(source, file, chosen.format, settings, on_retry, shapes, turns, first_read)

    try:
        for name in chosen.weights:
            sources.append(opener(directory.file_uri(name)))
        if all(getattr(source, "local", False) for source in sources):  # no round trip to overlap
            found = [stat(source, file) for file, source in enumerate(sources)]
        else:
            workers = min(_WORKERS, len(sources))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stat") as pool:
                found = list(pool.map(stat, sources, range(len(sources))))
    except BaseException:
        for source in sources:
            source.close()
        raise
    return OpenedModel(
        uri=directory.display,
        sources=sources,
        infos=[info for info, _, _ in found],
        format=chosen.format,
        weights=chosen.weights,
        directory=directory,
        small=small_sizes,
        opener=opener,
        fetched={SAFETENSORS_INDEX: index_json} if index_json is not None else {},
        _indexes=[index for _, index, _ in found],
        _kept={file: kept for file, (_, _, kept) in enumerate(found)},
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
        # One request: the look-up brings the whole file (a small file is at most SMALL_FILE_LIMIT bytes;
        # a larger one is refused before the rest of it is read).
        info, head = stat_with_prefix(source, SMALL_FILE_LIMIT, policy=settings.retry, on_retry=on_retry)
        check_small_files({name: info.size}, where=directory.display)
        checksum = checksum_of(source)
        if checksum is not None and checksum.covers_file(len(head)):
            verify_bytes(head, checksum)  # the Hub's git blob id or SHA-256, a registry blob's digest
        elif checksum is not None:
            return _proved_in_object(head, checksum, settings, on_retry)
        return head
    finally:
        source.close()


def _proved_in_object(
    head: bytes,
    checksum: PublishedDigest,
    settings: SourceSettings,
    on_retry: Callable[[RetryEvent], None] | None,
) -> bytes:
    """A small file that is a window of a larger object (a file of a tar layer), proved by that object's
    digest: the object is read whole and hashed when it is small itself (a file packed in a tar of its own,
    as ModelPack tools pack each file: the file and 2 KiB of tar), and the file is taken from the bytes
    proved. A larger object holds weights too (a KitOps model layer), whose digest, taken over the whole
    object as the load lands it, proves the object; the file is left to that proof."""
    whole = checksum.object_source
    if whole is None or checksum.object_size > SMALL_FILE_LIMIT:
        return head
    data = read_bytes(whole, 0, checksum.object_size, policy=settings.retry, on_retry=on_retry)
    verify_bytes(data, checksum)
    return data[checksum.offset : checksum.offset + len(head)]
