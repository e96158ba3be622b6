"""Every weight file proved against the digest its origin publishes, over the bytes that landed.

The Hugging Face Hub publishes each LFS file's SHA-256 and an OCI registry names each blob by its digest
(:class:`~modelload.sidecar.sources.PublishedDigest`). A whole-object hash needs the bytes in order, while the
readers land chunks in any order; so one hashing thread per object follows the landed bytes in object order
as they arrive, reading them back from the segment (where they already are: nothing is read from the origin
twice). The few bytes a load does not land (a safetensors header, a tar header, a neighbour in a tar layer)
come from the bytes the index read kept, or from one small range read. The hash of an object is done
moments after its last chunk lands, so a load costs about one extra pass over memory (SHA-256 with the CPU's
SHA extensions: see docs/sidecar.md for the measured cost per GiB), taken by threads beside the readers.

A mismatch fails the load with :class:`~modelload.loader.errors.HashMismatchError`: the segment is never
COMPLETE, so the pod never turns ready on those bytes. Where the memory mode can hold a file's tensors back
(not ``ring``), the readers publish a file's tensors only once its digest matched (:meth:`when_proven`), so
no app and no peer ever sees a byte of a file that does not match; in ``ring`` mode they stream as they land
(the ring cannot hold a whole file) and a tensor's pages are not given back before its bytes are hashed.

Encrypted tensorizer files are decrypted in place as their tensors are published, so their landed bytes are
not the origin's: their tensors are proved by the file's own MACs instead, and the digest is not checked.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from modelload.loader.segment import SegmentWriter
from modelload.sidecar.planner import LoadPlan
from modelload.sidecar.sources import (
    OpenedModel,
    PublishedDigest,
    RetryEvent,
    RetryPolicy,
    Source,
    checksum_of,
    new_hasher,
    read_range,
)

__all__ = ["FileDigests"]

log = logging.getLogger(__name__)

_GAP_BLOCK = 8 << 20


@dataclass(frozen=True)
class _Piece:
    """Bytes ``[start, start + length)`` of an object: a landed chunk (``chunk`` >= 0) or a gap."""

    start: int
    length: int
    chunk: int = -1
    dst_offset: int = 0
    file: int = -1
    """For a gap inside a weight file: which one (its kept index bytes may hold the gap)."""
    file_offset: int = 0


@dataclass
class _Object:
    checksum: PublishedDigest
    pieces: list[_Piece]
    gap_source: Source
    files: tuple[int, ...]
    """The weight files the object holds (an OCI layer may hold several)."""


class FileDigests:
    """Hashes the objects of ``model``'s weight files as their chunks land (see the module docstring)."""

    def __init__(
        self,
        model: OpenedModel,
        plan: LoadPlan,
        writer: SegmentWriter,
        *,
        policy: RetryPolicy,
        stop: threading.Event,
        on_retry: Callable[[RetryEvent], None] | None = None,
    ) -> None:
        self._model = model
        self._plan = plan
        self._writer = writer
        self._policy = policy
        self._stop = stop
        self._on_retry = on_retry
        self._cond = threading.Condition()
        self._landed = np.zeros(len(plan.chunks), dtype=bool)
        self._hashed_chunks = np.zeros(len(plan.index.tensors), dtype=np.int64)
        self._hashed = np.zeros(len(plan.index.tensors), dtype=bool)
        self._failure: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._on_proven: Callable[[Sequence[int]], None] | None = None
        self._proven: list[int] = []
        self.objects = self._objects()
        self.checked: list[str] = []
        hashed_chunks = np.zeros(len(plan.chunks), dtype=bool)
        hashed_chunks[[p.chunk for o in self.objects for p in o.pieces if p.chunk >= 0]] = True
        checked = np.zeros(len(self._hashed), dtype=bool)
        checked[plan.pieces.tensor[hashed_chunks[plan.pieces.chunk]]] = True
        self._hashed[~checked] = True

    @property
    def active(self) -> bool:
        return bool(self.objects)

    @property
    def files(self) -> frozenset[int]:
        """The weight files a digest proves."""
        return frozenset(file for item in self.objects for file in item.files)

    def when_proven(self, callback: Callable[[Sequence[int]], None]) -> list[int]:
        """Call ``callback(files)`` from a hashing thread as each object's digest matches; returns the files
        proven before the call (the caller deals with those itself)."""
        with self._cond:
            self._on_proven = callback
            return list(self._proven)

    def _objects(self) -> list[_Object]:
        model, plan = self._model, self._plan
        found: dict[str, tuple[PublishedDigest, list[tuple[int, PublishedDigest]]]] = {}
        for file, source in enumerate(model.sources):
            checksum = checksum_of(source)
            if checksum is None:
                continue
            if plan.index.encrypted:
                log.info(
                    "%s is encrypted: its tensors are proved by their MACs, not its digest",
                    source.display_uri,
                )
                continue
            found.setdefault(checksum.object_id, (checksum, []))[1].append((file, checksum))
        by_file: dict[int, list[int]] = {}
        for seq, chunk in enumerate(plan.chunks):
            by_file.setdefault(chunk.file, []).append(seq)
        objects = []
        for checksum, files in found.values():
            pieces: list[_Piece] = []
            for file, own in files:
                for seq in by_file.get(file, ()):
                    chunk = plan.chunks[seq]
                    start = own.offset + chunk.src_offset
                    pieces.append(_Piece(start, chunk.length, seq, chunk.dst_offset, file, chunk.src_offset))
            pieces.sort(key=lambda p: p.start)
            pieces = _with_gaps(pieces, checksum, files, model)
            source = checksum.object_source or model.sources[files[0][0]]
            owned = tuple(file for file, _ in files)
            objects.append(_Object(checksum, pieces, getattr(source, "origin", source), owned))
        return objects

    # --- the readers' side ------------------------------------------------------------------------------

    def landed(self, seq: int) -> None:
        """Chunk ``seq`` is in the segment: the hashing thread of its object may go on."""
        if not self.objects:
            return
        with self._cond:
            self._landed[seq] = True
            self._cond.notify_all()

    def releasable(self) -> np.ndarray:
        """Per tensor, whether its bytes were hashed (or need no hash): only those may be released."""
        with self._cond:
            return self._hashed.copy()

    # --- hashing ----------------------------------------------------------------------------------------

    def start(self, *, threads: int) -> None:
        """Start hashing (at most ``threads`` objects at a time, in the objects' order)."""
        if not self.objects:
            return
        todo = list(range(len(self.objects)))
        lock = threading.Lock()

        def work() -> None:
            while True:
                with lock:
                    if not todo:
                        return
                    number = todo.pop(0)
                try:
                    self._hash(self.objects[number])
                except BaseException as exc:
                    with self._cond:
                        self._failure = self._failure or exc
                        self._cond.notify_all()
                    self._stop.set()
                    return

        for number in range(max(1, min(threads, len(self.objects)))):
            thread = threading.Thread(target=work, name=f"digest-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _hash(self, item: _Object) -> None:
        checksum = item.checksum
        hasher = new_hasher(checksum.algorithm, checksum.object_size)
        for piece in item.pieces:
            if piece.chunk < 0:
                hasher.update(self._gap(item, piece))
                continue
            if not self._wait(piece.chunk):
                return  # the load stopped
            self._update(hasher, piece)
            self._mark(piece.chunk)
        actual = hasher.hexdigest()
        if actual != checksum.expected:
            raise checksum.mismatch(actual)
        log.info("%s matches its %s digest", checksum.where, checksum.algorithm)
        with self._cond:
            self.checked.append(checksum.where)
            self._proven.extend(item.files)
            callback = self._on_proven
        if callback is not None:
            callback(item.files)

    def _wait(self, seq: int) -> bool:
        with self._cond:
            while not self._landed[seq]:
                if self._stop.is_set():
                    return False
                self._cond.wait(0.1)
        return True

    def _update(self, hasher: Any, piece: _Piece) -> None:
        """Hash a landed chunk's bytes, in the order the object holds them: its pieces, each at its slot."""
        plan = self._plan
        chunk = plan.chunks[piece.chunk]
        if chunk.count == 1:
            hasher.update(self._writer.region(piece.dst_offset, piece.length))
            return
        span = slice(chunk.first, chunk.first + chunk.count)
        for dst, length in zip(
            plan.pieces.dst[span].tolist(), plan.pieces.length[span].tolist(), strict=True
        ):
            hasher.update(self._writer.region(dst, length))

    def _mark(self, seq: int) -> None:
        plan = self._plan
        tensors = plan.tensors_of(plan.chunks[seq])
        with self._cond:
            self._hashed_chunks[tensors] += 1
            done = tensors[self._hashed_chunks[tensors] >= plan.chunk_counts[tensors]]
            self._hashed[done] = True

    def _gap(self, item: _Object, piece: _Piece) -> bytes:
        kept = (
            self._model.kept_bytes(piece.file, piece.file_offset, piece.length) if piece.file >= 0 else None
        )
        if kept is not None:
            return kept
        out = bytearray(piece.length)
        view = memoryview(out)
        for at in range(0, piece.length, _GAP_BLOCK):
            part = view[at : at + _GAP_BLOCK]
            read_range(item.gap_source, piece.start + at, part, policy=self._policy, on_retry=self._on_retry)
        return bytes(out)

    def finish(self) -> list[str]:
        """Wait for every object's hash; raise the first mismatch or failure. Returns the objects checked."""
        for thread in self._threads:
            while thread.is_alive():
                thread.join(0.1)
                if self._failure is not None:
                    break
        if self._failure is not None:
            raise self._failure
        return list(self.checked)

    @property
    def failure(self) -> BaseException | None:
        return self._failure


def _with_gaps(
    landed: Sequence[_Piece],
    checksum: PublishedDigest,
    files: Sequence[tuple[int, PublishedDigest]],
    model: OpenedModel,
) -> list[_Piece]:
    """``landed`` with the gaps between them (and before and after) filled, as pieces of the object."""
    spans = [(own.offset, own.offset + model.infos[file].size, file) for file, own in files]
    pieces: list[_Piece] = []
    at = 0
    for piece in [*landed, _Piece(checksum.object_size, 0)]:
        if piece.start < at:
            raise ValueError(f"{checksum.where}: two chunks overlap at byte {piece.start}")
        while at < piece.start:
            file, begin, end = next(((f, b, e) for b, e, f in spans if b <= at < e), (-1, at, piece.start))
            stop = min(piece.start, end) if file >= 0 else _next_span(spans, at, piece.start)
            pieces.append(_Piece(at, stop - at, file=file, file_offset=at - begin if file >= 0 else 0))
            at = stop
        if piece.length:
            pieces.append(piece)
        at = piece.start + piece.length
    return pieces


def _next_span(spans: Sequence[tuple[int, int, int]], at: int, limit: int) -> int:
    """Where the next weight file starts after ``at`` (so a gap stops there), else ``limit``."""
    starts = [begin for begin, _, _ in spans if at < begin < limit]
    return min(starts) if starts else limit
