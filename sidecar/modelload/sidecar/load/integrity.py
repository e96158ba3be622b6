"""Evidence that a loaded segment holds one version of the model, and the checksums recorded as it fills.

Every range request carries the object's validator (``If-Match`` and an ETag comparison; for files, size
and mtime), so a replacement the origin signals stops the load at once. Not every origin signals one: nginx's
ETag is the mtime in seconds and the size, so a same-size file replaced within a second (or copied with its
mtime kept) keeps its ETag, and some servers send no validator at all. Each tensor is then self-consistent
(a tensorizer hash passes) while the model mixes two versions. Before the segment is published COMPLETE,
:func:`check_unchanged` therefore asks again:

1. a fresh (uncached) look-up of every weight file: size and validators as at the start;
2. unless the origin's validator is derived from the content (S3's ETag is the object's MD5, or the MD5 of
   its parts), a re-read of a small sample of every range the load landed, compared byte for byte with what
   is in the segment: each tensorizer record header (it carries the tensor's hashes or MACs, so it stands
   for the whole tensor), and the last :data:`SAMPLE_BYTES` of every plain chunk.

A mismatch is a :class:`SourceChangedError`: the load fails, never COMPLETE. What is left (docs/sidecar.md):
a replacement that keeps the size and validator and changes no sampled byte of a range landed before it.

:func:`crc32` is the checksum each tensor's state entry records when it is published, so ``modelload
inspect --verify`` can check a segment later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from modelload.loader.errors import SourceChangedError
from modelload.loader.formats.tensorizer.hashes import crc32
from modelload.loader.segment import SegmentWriter
from modelload.sidecar.planner import Chunk, LoadPlan
from modelload.sidecar.sources import (
    ObjectInfo,
    OpenedModel,
    RetryEvent,
    RetryPolicy,
    Source,
    read_range,
    stat_source,
)

__all__ = ["SAMPLE_BYTES", "check_unchanged", "crc32", "unlanded_ranges", "validator_strength"]

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
    unlanded = (plan.record(tensor).unlanded for tensor in range(len(plan.layout.slots)))
    return [(offset, length) for offset, length in unlanded if length > 0]


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
    every write (S3's ETag follows the content, a GCS generation or an Azure ETag every upload), and not
    from a server without Range support (it would send the whole object per sample)."""
    origin = _origin(model.sources[file])
    return not getattr(origin, "pins_version", False) and model.infos[file].accepts_ranges


def _samples(plan: LoadPlan, model: OpenedModel, chunks: Sequence[Chunk] | None = None) -> list[_Sample]:
    skip = [not needs_samples(model, file) for file in range(len(model.sources))]
    samples = []
    for chunk in plan.chunks if chunks is None else chunks:
        if skip[chunk.file]:
            continue
        entry = plan.index.tensors[chunk.tensor]
        header = chunk.header_bytes
        if header:  # a tensorizer record header, in the slot's lead: it names the tensor's hashes or MACs
            samples.append(_Sample(chunk.file, chunk.src_offset, chunk.dst_offset, header))
        if chunk.data_bytes and not entry.encrypted:  # encrypted bytes were decrypted in place
            length = min(SAMPLE_BYTES, chunk.data_bytes)
            end = chunk.length - length
            samples.append(_Sample(chunk.file, chunk.src_offset + end, chunk.dst_offset + end, length))
    return samples


def check_tensor(
    model: OpenedModel,
    plan: LoadPlan,
    writer: SegmentWriter,
    chunks: Sequence[Chunk],
    *,
    policy: RetryPolicy,
    on_retry: Callable[[RetryEvent], None] | None = None,
) -> None:
    """Before an unverified tensor (safetensors has no stored hash) is published: re-read the samples of
    its chunks and compare them with the segment, so a tensor assembled across a replacement that kept its
    validator is never handed to an app. Raises :class:`SourceChangedError`."""
    for sample in _samples(plan, model, chunks):
        buf = bytearray(sample.length)
        source = _origin(model.sources[sample.file])
        read_range(source, sample.src_offset, memoryview(buf), policy=policy, on_retry=on_retry)
        if writer.region(sample.dst_offset, sample.length) != buf:
            raise _changed(model.display(sample.file), sample)


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
    for the same ETag), whose samples the origin need not serve again; ``proven`` names files whose bytes
    the store's checksum proved (:mod:`.proof`), which need no samples at all.
    """
    for source, info in zip(model.sources, model.infos, strict=True):
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
    chunks = (
        [c for c in plan.chunks if c.tensor not in skip and c.file not in proven] if skip or proven else None
    )
    samples = _samples(plan, model, chunks)
    log.info("re-reading %d samples of the landed ranges to check the model did not change", len(samples))

    def compare(sample: _Sample) -> _Sample | None:
        buf = bytearray(sample.length)
        source = _origin(model.sources[sample.file])
        read_range(source, sample.src_offset, memoryview(buf), policy=policy, on_retry=on_retry)
        return None if writer.region(sample.dst_offset, sample.length) == buf else sample

    workers = max(1, min(readers, len(samples)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="recheck") as pool:
        for differs in pool.map(compare, samples):
            if differs is not None:
                raise _changed(model.display(differs.file), differs)
    return len(samples)
