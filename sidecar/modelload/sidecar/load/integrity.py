"""Evidence that a loaded segment holds one version of the model, and the checksums recorded as it fills.

Every range request carries the object's validator (``If-Match`` and an ETag comparison; for files, size
and mtime before and after every read), so a replacement the origin signals stops the load at once. Not
every origin signals one: nginx's ETag is the mtime in seconds and the size, so a same-size file replaced
within a second (or copied with its mtime kept) keeps its ETag, and some servers send no validator at all.
Each tensor is then self-consistent (a tensorizer hash passes) while the model mixes two versions. On such
origins every landed range (a chunk: neighbouring tensors, or a piece of a big one) has one *sample*: the
last :data:`SAMPLE_BYTES` of its last piece (or, where those bytes were decrypted in place, that piece's
record header, which carries the tensor's MACs). Samples are re-read from the origin and compared with the
segment:

1. before the tensors a range completes are published (:func:`check_chunks`): that range's sample, and for
   a tensor cut across several ranges, the samples of all of them, so a tensor assembled across a
   replacement is never handed to an app;
2. before the segment is published COMPLETE (:func:`check_unchanged`): a fresh (uncached) look-up of every
   weight file (size and validators as at the start), then every range's sample again, one pass per file.

Origins whose validator is derived from the content (S3's ETag is the object's MD5, or the MD5 of its parts)
and local files (size and mtime are compared before and after every read) need no samples: their own
validators prove the bytes. A mismatch is a :class:`SourceChangedError`: the load fails, never COMPLETE.
What is left (docs/sidecar.md): a replacement that keeps the size and validator and changes no sampled byte
of a range landed before it.

:func:`crc32` is the checksum each tensor's state entry records when it is published, so ``modelload
inspect --verify`` can check a segment later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from modelload.loader.errors import SourceChangedError, TransientSourceError
from modelload.loader.formats.tensorizer.hashes import crc32
from modelload.loader.segment import SegmentWriter
from modelload.sidecar.planner import Chunk, LoadPlan
from modelload.sidecar.sources import (
    FileSource,
    ObjectInfo,
    OpenedModel,
    RetryEvent,
    RetryPolicy,
    Source,
    read_range,
    stat_source,
)

__all__ = [
    "SAMPLE_BYTES",
    "check_chunks",
    "check_unchanged",
    "chunk_sample",
    "crc32",
    "needs_samples",
    "unlanded_ranges",
    "validator_strength",
]

log = logging.getLogger(__name__)

SAMPLE_BYTES = 4096
"""Bytes re-read at the end of each landed chunk: one page, one small request."""


def validator_strength(info: ObjectInfo) -> str:
    """``strong`` (an ETag), ``weak`` (a weak ETag or only Last-Modified) or ``none``."""
    if info.etag and not info.etag.startswith("W/"):
        return "strong"
    if info.etag or info.last_modified:
        return "weak"
    return "none"


def unlanded_ranges(plan: LoadPlan) -> list[tuple[int, int]]:
    """``(offset, length)`` of the slot bytes no chunk writes (a meta tensor's zeros): reserved up front,
    since a reader faulting them in on a full volume would die of SIGBUS."""
    # Columns, compared in one operation: a mixture of experts has 100,000 tensors and no meta tensor.
    short = np.flatnonzero(plan.layout.table.nbytes > plan.index.table.data_lengths)
    return [plan.record(tensor).unlanded for tensor in short.tolist()]


@dataclass(frozen=True)
class _Sample:
    file: int
    src_offset: int
    dst_offset: int
    length: int


def _origin(source: Source) -> Source:
    """The origin behind a peer-aware source: samples must come from the origin, or a peer's copy would be
    compared with itself."""
    return getattr(source, "origin", source)


def needs_samples(model: OpenedModel, file: int) -> bool:
    """Whether sampled bytes of ``file`` are worth re-reading: not where the store's validator changes with
    every write (S3's ETag follows the content, a GCS generation or an Azure ETag every upload), nor for a
    local file (its size and mtime are checked around every read), and not from a server without Range
    support (it would send the whole object per sample)."""
    origin = _origin(model.sources[file])
    pinned = getattr(origin, "pins_version", False) or isinstance(origin, FileSource)
    return not pinned and model.infos[file].accepts_ranges


def chunk_sample(plan: LoadPlan, chunk: Chunk) -> _Sample | None:
    """The sample that stands for ``chunk`` (see the module's docstring); None when it has none (a piece of
    an encrypted tensor without its header: decrypted bytes cannot be compared with the origin's)."""
    pieces = plan.pieces
    for at in reversed(chunk.pieces):
        length, data = int(pieces.length[at]), int(pieces.data[at])
        src, dst = int(pieces.src[at]), int(pieces.dst[at])
        encrypted = plan.index.tensors[int(pieces.tensor[at])].encrypted
        if data and not encrypted:  # the piece's last bytes, as they came (with header bytes when short)
            tail = min(SAMPLE_BYTES, length)
            return _Sample(chunk.file, src + length - tail, dst + length - tail, tail)
        if length > data:  # a record header, which lands as it came even when its data is decrypted
            return _Sample(chunk.file, src, dst, length - data)
    return None


def _compare(model: OpenedModel, writer: SegmentWriter, sample: _Sample, policy: RetryPolicy,
             on_retry: Callable[[RetryEvent], None] | None) -> None:  # fmt: skip
    buf = bytearray(sample.length)
    source = _origin(model.sources[sample.file])
    read_range(source, sample.src_offset, memoryview(buf), policy=policy, on_retry=on_retry)
    if writer.region(sample.dst_offset, sample.length) != buf:
        raise _changed(model.display(sample.file), sample)


def check_chunks(
    model: OpenedModel,
    plan: LoadPlan,
    writer: SegmentWriter,
    chunks: Sequence[Chunk],
    *,
    policy: RetryPolicy,
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> None:
    """Before the tensors landed in ``chunks`` are published: re-read each chunk's sample and compare it
    with the segment (the caller passes the chunks of files proven by samples). Raises
    :class:`SourceChangedError`."""
    for chunk in chunks:
        sample = chunk_sample(plan, chunk)
        if sample is not None:
            _compare(model, writer, sample, policy, on_retry)


def _changed(uri: str, sample: _Sample) -> SourceChangedError:
    return SourceChangedError(
        f"{uri} was replaced during the load without a change of its validator (ETag or Last-Modified): "
        f"bytes [{sample.src_offset}, {sample.src_offset + sample.length}) now differ from the ones loaded, "
        "so the segment would mix two versions and is not published complete; restart the load once the "
        "model is stable, and publish new versions under new names",
        uri=uri,
    )


def check_unchanged(
    model: OpenedModel,
    plan: LoadPlan,
    writer: SegmentWriter,
    *,
    policy: RetryPolicy,
    readers: int,
    on_retry: Callable[[RetryEvent], None] | None = None,
    sample: bool = True,
    skip: Collection[int] = (),
    proven: Collection[int] = (),
) -> int:
    """Raise :class:`SourceChangedError` when a weight file is no longer the one the segment was loaded
    from (see the module's docstring); return how many samples were compared.

    ``sample=False`` re-checks the validators only: in the release and ring memory modes the pages of
    consumed tensors are gone by the end of the load, so there is nothing left to compare them with.
    ``skip`` names tensors checked otherwise (bytes from peers, matched against the checksums they listed
    for the same ETag): a chunk holding only such tensors is not sampled again; ``proven`` names files whose
    bytes the store's checksum proved (:mod:`.proof`), which need no samples at all.
    """
    for source, info in zip(model.sources, model.infos, strict=True):
        if getattr(source, "every_read_validated", False):
            continue  # each read was checked against these validators: a look-up now proves nothing more
        fresh = stat_source(source, policy=policy, on_retry=on_retry, fresh=True)
        if (fresh.size, fresh.etag, fresh.last_modified) != (info.size, info.etag, info.last_modified):
            raise SourceChangedError(
                f"{source.display_uri} changed during the load (size {info.size} -> {fresh.size}, ETag "
                f"{info.etag} -> {fresh.etag}, Last-Modified {info.last_modified} -> {fresh.last_modified}); "
                "the segment is not published complete: restart the load once the model is stable",
                uri=source.display_uri,
            )
    if not sample:
        return 0
    by_file: dict[int, list[_Sample]] = {}
    sampled = [needs_samples(model, f) and f not in proven for f in range(len(model.sources))]
    skipped = set(skip)
    for chunk in plan.chunks:
        if not sampled[chunk.file] or (skipped and set(plan.tensors_of(chunk).tolist()) <= skipped):
            continue
        found = chunk_sample(plan, chunk)
        if found is not None:
            by_file.setdefault(chunk.file, []).append(found)
    count = sum(map(len, by_file.values()))
    log.info("re-reading %d samples of the landed ranges to check the model did not change", count)

    def one_file(samples: list[_Sample]) -> None:
        """One multi-range request for all of a file's samples where its server answers them so; one
        request a sample otherwise."""
        source = _origin(model.sources[samples[0].file])
        several = getattr(source, "read_ranges", None)
        if several is not None and len(samples) > 1:
            try:
                got = several([(s.src_offset, s.length) for s in samples])
            except TransientSourceError:
                got = None  # the samples one by one, each with its retries
            if got is not None:
                for found, data in zip(samples, got, strict=True):
                    if writer.region(found.dst_offset, found.length) != data:
                        raise _changed(model.display(found.file), found)
                return
        for found in samples:
            _compare(model, writer, found, policy, on_retry)

    workers = max(1, min(readers, len(by_file)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recheck") as pool:
        list(pool.map(one_file, by_file.values()))  # one pass per file; the first mismatch raises here
    return count
