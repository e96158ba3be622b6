"""The streaming engine: a model's bytes from a source into a shared-memory segment, with parallel readers.

One run is one load:

1. open the model: one weight file, or a directory (an S3 prefix, an HTTP(S) base URL, a local directory)
   whose weight files (every shard) all go into the one segment; stat every weight file, and reuse a
   COMPLETE segment already at the path when it holds these very objects (a restarted sidecar does not
   load again);
2. for a directory, copy its small files (config, tokenizer) into the model directory beside the segment,
   before the segment is published, so an app that attaches finds them;
3. read each weight file's index with one small range, plan the segment (a slot per tensor, across files)
   and the range chunks, publish the segment's header and manifest at once (an app can attach now);
4. N reader threads take chunks in load order and land them straight in the segment: ``os.splice`` from the
   socket or file into the segment's file on 4 KiB pages where the source supports it (no user-space copy,
   no page faults in this process), ``readinto`` a slice of the mapping on huge pages and otherwise
   (:mod:`modelload.sidecar.load.landing` chooses);
5. the thread that lands a tensor's last chunk decrypts it in place, checks its hash when asked, and
   publishes it READY;
6. every tensor in, and the weight files still the ones the load started with (a fresh look-up of their
   validators and a re-read sample of every landed range, :mod:`modelload.sidecar.load.integrity`): the
   segment is COMPLETE. Any permanent failure marks it FAILED with the reason, so attached readers get an
   error instead of waiting. :meth:`Engine.stop` (SIGTERM) stops the readers at
   their next chunk and marks a loading segment FAILED too: the segment is always consistent.

Retries, resume after a broken stream, ETag checks and stall timeouts happen in the sources layer
(:func:`~modelload.sidecar.sources.read_range`); the engine counts them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import (
    HashMismatchError,
    MissingKeyError,
    ModelloadError,
    NotEncryptedError,
    SegmentError,
)
from modelload.loader.formats import ModelIndex
from modelload.loader.formats import tensorizer as tz
from modelload.loader.segment import (
    MODEL_DIR_KEY,
    SegmentReader,
    SegmentWriter,
    TensorFinisher,
    WriterState,
    run_in_order,
)
from modelload.loader.segment.collector import LongLived
from modelload.sidecar.load import integrity, proof
from modelload.sidecar.load.digests import FileDigests
from modelload.sidecar.load.landing import choose_landing
from modelload.sidecar.load.meter import ChunkMeter
from modelload.sidecar.load.modeldir import write_model_dir
from modelload.sidecar.load.settings import LoadSettings
from modelload.sidecar.memory import MemoryManager, plan_memory
from modelload.sidecar.planner import Chunk, LoadPlan, plan_load
from modelload.sidecar.progress import LoadObserver
from modelload.sidecar.sources import (
    OpenedModel,
    RetryEvent,
    RetryPolicy,
    Source,
    SourceSettings,
    display_url,
    metered,
    open_model,
    read_range,
    read_range_into_fd,
    read_range_pieces,
    read_range_pieces_into_fd,
)

__all__ = ["Engine", "LoadStopped", "error_kind"]

log = logging.getLogger(__name__)


class LoadStopped(ModelloadError):
    """The load was stopped (SIGTERM) before it finished; the segment is marked FAILED."""

    kind = "stopped"


class PeerHook(Protocol):
    """Other sidecars as sources (``modelload.sidecar.peers.hook.Peers``): everything the engine asks of
    them."""

    @property
    def verified_by_peers(self) -> Collection[int]:
        """Tensors whose bytes came from peers and matched the CRC-32 the peers listed for them: checked
        already, so neither re-sampled from the origin before publishing nor at the end of the load."""

    def begin(
        self, *, model: OpenedModel, plan: LoadPlan, writer: SegmentWriter, segment: Path, share: bool = True
    ) -> LoadPlan:
        """Once the segment exists: may wrap ``model.sources`` to ask peers first, and returns the plan to
        load (the same chunks, perhaps reordered). ``share`` false: this load will not keep its tensors."""

    def finish(self, tensor: int) -> int | None:
        """Check tensor ``tensor``, whose bytes are all in, before it is published (bytes from a peer that
        fail are read again from the origin). Returns the CRC-32 of the tensor's slot when the check
        computed exactly that (the engine records it instead of computing it again), else None."""


@dataclass(frozen=True)
class _LoadContext:
    """What one load's readers share with the engine that runs them, handed over explicitly."""

    settings: LoadSettings
    observer: LoadObserver
    stop: threading.Event
    """Set by :meth:`Engine.stop`: the readers stop at their next chunk."""
    retry: RetryPolicy
    on_retry: Callable[[RetryEvent], None]
    peers: PeerHook | None


class Engine:
    """Loads one model into one segment. Call :meth:`run` (blocking) once; :meth:`stop` from any thread."""

    def __init__(
        self,
        settings: LoadSettings,
        *,
        sources: SourceSettings,
        observer: LoadObserver,
        peers: PeerHook | None = None,
    ) -> None:
        self.settings = settings
        self._peers = peers
        self._observer = observer
        self._stop = threading.Event()
        # A stop (SIGTERM) also cuts short a retry's backoff, so stopping never waits out a retry's sleep.
        self._sources = replace(sources, retry=replace(sources.retry, stop=self._stop))
        self._writer: SegmentWriter | None = None

    def stop(self) -> None:
        """Stop the readers at their next chunk; a segment still loading is marked FAILED."""
        self._stop.set()

    # --- the load -----------------------------------------------------------------------------------------

    def run(self) -> None:
        """Load the model. Raises the ModelloadError that failed it, or :class:`LoadStopped`."""
        settings = self.settings
        self._observer.load_started(source=display_url(settings.source), segment=str(settings.segment))
        try:
            # The index, layout and plan are made with the collector off and frozen before the readers
            # start: its passes then walk only the readers' short-lived objects (collector.LongLived).
            with LongLived() as kept:
                model = open_model(
                    settings.source,
                    self._sources,
                    format=settings.format,
                    files=settings.files,
                    on_retry=self._retried,
                )
                try:
                    self._load_from(model, kept)
                finally:
                    model.close()
        except ModelloadError as exc:
            self._fail(exc)
            raise
        except Exception as exc:
            self._fail(exc)
            raise ModelloadError(f"the load failed unexpectedly: {exc}") from exc
        finally:
            if self._writer is not None:
                self._writer.close()

    @property
    def model_dir(self) -> Path:
        """Where a directory's small files go."""
        return self.settings.model_dir or self.settings.segment.parent / "model"

    def _load_from(self, model: OpenedModel, kept: LongLived) -> None:
        settings, observer = self.settings, self._observer
        started = time.monotonic()
        uri = model.uri
        model_dir = None
        _warn_without_validator(model)
        if model.directory is not None:
            model_dir = write_model_dir(model, self.model_dir, self._sources, on_retry=self._retried)
        if self._reuse(uri, model.fingerprint, model.size):
            return
        index = model.index
        key = self._key(index, uri)
        landing = choose_landing(settings.landing, settings.segment, model.sources)
        proofs = _decide_proofs(model, settings, encrypted=index.encrypted)
        metadata = _metadata(uri, model.fingerprint, model.size, settings.notify, model_dir)
        proofs_text = json.dumps({p.uri: p.label for p in proofs}, sort_keys=True)
        metadata = {**metadata, **_pinned_version(model), PROOFS_KEY: proofs_text}
        plan = self._plan(index, metadata, page_size=landing.page_size)
        use_fd = landing.through_fd
        # Through the file descriptor nothing writes a meta tensor's slot: reserve it before publishing.
        unlanded = integrity.unlanded_ranges(plan) if use_fd else []
        # A ring's pages are taken once, now, and reused lap after lap (a full volume fails here).
        ring = settings.memory.mode == "ring"
        self._writer = writer = SegmentWriter.create(
            settings.segment, plan.layout, reserve=ring, reserve_ranges=unlanded
        )
        checking: list[FileDigests] = []  # set below, before any tensor is ready to release
        memory = None
        if settings.memory.mode != "full":
            memory = MemoryManager(
                settings.memory,
                writer=writer,
                plan=plan,
                stop=self._stop,
                report=observer.memory_changed,
                hold=lambda: checking[0].releasable() if checking else None,
            )
        observer.manifest_published(
            model_format=index.format, tensors=len(index), nbytes=index.nbytes, notify=settings.notify
        )
        for each in proofs:
            observer.file_proof(file=each.uri, proof=each.label, state=each.state)
        if self._peers is not None:  # shared only in full mode: released pages cannot be served
            share = settings.memory.mode == "full"
            plan = self._peers.begin(
                model=model, plan=plan, writer=writer, segment=settings.segment, share=share
            )
        if not use_fd and settings.memory.mode != "ring":  # (ring mode takes each chunk's pages as it lands)
            # Landing through the mapping: a full tmpfs would be a SIGBUS, so take every page now. Through the
            # file descriptor a full volume is an ordinary ENOSPC, and reserving would cost a pass of zeroing
            # (0.15 s per 2 GiB here) for pages the data overwrites anyway.
            writer.reserve()
        digests = self._digests(model, plan, writer)  # on the plan the readers follow (peers reorder it)
        checking.extend([digests] if digests is not None else [])
        kept.built()
        _Load(
            self._context(), model, plan, writer, key, use_fd=use_fd, memory=memory, proofs=proofs,
            digests=digests,
        ).run()  # fmt: skip
        if digests is not None and (digests.failure is not None or not self._stop.is_set()):
            self._finish_digests(digests, proofs)
        if self._stop.is_set():
            raise LoadStopped("stopped before the load finished")
        integrity.check_unchanged(
            model,
            plan,
            writer,
            policy=self._sources.retry,
            readers=settings.readers,
            on_retry=self._retried,
            sample=settings.memory.mode == "full",
            skip=self._peers.verified_by_peers if self._peers is not None else (),
            proven=[p.file for p in proofs if p.method != "samples"],
        )
        for each in proofs:
            if each.method in _UNPROVEN_STATE:
                observer.file_proof(file=each.uri, proof=each.label, state=_UNPROVEN_STATE[each.method])
        writer.mark_complete()
        observer.load_finished(seconds=time.monotonic() - started, nbytes=index.nbytes)

    def _plan(self, index: ModelIndex, metadata: dict[str, str], *, page_size: int) -> LoadPlan:
        """The segment's layout and the chunks: a few objects per tensor that live as long as the load (made
        while :meth:`run` holds the collector off)."""
        settings = self.settings
        plan = plan_load(
            index,
            chunk_size=settings.chunk_size,
            priority=settings.priority,
            metadata=metadata,
            span_limit=settings.memory.ring_size or None,  # ring mode: a chunk always fits in the ring
            page_size=page_size,
        )
        return plan_memory(plan, settings.memory)

    def _context(self) -> _LoadContext:
        return _LoadContext(
            settings=self.settings,
            observer=self._observer,
            stop=self._stop,
            retry=self._sources.retry,
            on_retry=self._retried,
            peers=self._peers,
        )

    def _finish_digests(self, digests: FileDigests, proofs: list[proof.FileProof]) -> None:
        """Wait for every ``digest`` proof (raises the first mismatch) and say each file is proven."""
        try:
            digests.finish()
        except BaseException:
            for each in proofs:
                if each.method == "digest":
                    self._observer.file_proof(file=each.uri, proof=each.label, state="failed")
            raise
        for each in proofs:
            if each.method == "digest":
                each.state = "proven"
                self._observer.file_proof(file=each.uri, proof=each.label, state="proven")

    def _digests(self, model: OpenedModel, plan: LoadPlan, writer: SegmentWriter) -> FileDigests | None:
        """The hashing of each weight file against its origin's digest (``hf://``, ``oci://``), started."""
        settings = self.settings
        if settings.memory.mode == "ring" and settings.priority:
            log.warning(
                "ring mode with a priority order: the origin's file digests are not checked (a whole-file "
                "hash "
                "follows file order, which the ring would have to hold back); drop --priority to check them"
            )
            return None
        digests = FileDigests(
            model, plan, writer, policy=self._sources.retry, stop=self._stop, on_retry=self._retried
        )
        if not digests.active:
            return None
        digests.start(threads=max(1, settings.readers // 4))
        return digests

    def _fail(self, exc: BaseException) -> None:
        kind = error_kind(exc)
        reason = str(exc) if kind != "stopped" else "the sidecar was stopped before the load finished"
        if self._writer is not None:
            with contextlib.suppress(SegmentError):  # a closed writer: the failure came at creation
                self._writer.mark_failed(reason)
        self._observer.load_failed(kind=kind, reason=reason)

    def _retried(self, event: RetryEvent) -> None:
        self._observer.retried(kind=retry_kind(event), message=str(event.error))

    def _reuse(self, uri: str, etag: str | None, size: int) -> bool:
        """Reuse a COMPLETE segment of this same object (URI, ETag and size), as after a sidecar restart.

        In every memory mode: the app attached before the restart has copied (and consumed) what it
        released, and does not attach again, so loading anew in ``release`` or ``ring`` mode would wait for
        a consumer that never comes (a ring stalls, and the pod stops being ready). A segment written in
        another memory mode is loaded again.
        """
        path = self.settings.segment
        if etag is None or not path.exists():
            return False
        try:
            with SegmentReader.open(path) as old:
                meta = old.metadata
                same = (meta.get("source"), meta.get("source_etag"), meta.get("source_size")) == (
                    uri,
                    etag,
                    str(size),
                )
                if not same or old.writer_state != WriterState.COMPLETE:
                    return False
                if old.memory_mode.name.lower() != self.settings.memory.mode:
                    log.info(
                        "not reusing the segment at %s: it was written in memory mode %s",
                        path,
                        old.memory_mode.name.lower(),
                    )
                    return False
                nbytes = sum(s.nbytes for s in old.slots)
                self._observer.manifest_published(
                    model_format=meta.get("format", "unknown"),
                    tensors=len(old.slots),
                    nbytes=nbytes,
                    notify=meta.get("notify"),
                )
                sizes = [slot.nbytes for slot in old.slots]
                self._observer.bytes_loaded(sum(sizes))
                self._observer.tensors_published(
                    indices=list(range(len(sizes))), names=[slot.name for slot in old.slots], nbytes=sizes
                )
        except ModelloadError as exc:
            log.info("not reusing the segment at %s: %s", path, exc)
            return False
        self._observer.load_finished(seconds=0.0, nbytes=nbytes)
        log.info("reusing the complete segment at %s (same object, ETag %s)", path, etag)
        return True

    def _key(self, index: ModelIndex, uri: str) -> tz.DecryptionKey | None:
        settings = self.settings
        if settings.key_file is not None:
            key = tz.DecryptionKey.from_file(settings.key_file)
        elif settings.password_file is not None:
            key = tz.DecryptionKey.from_password_file(settings.password_file)
        else:
            key = None
        if key is not None and not index.encrypted:
            raise NotEncryptedError(f"{uri} is not encrypted, but a decryption key was given; drop the key")
        if key is None and index.encrypted:
            raise MissingKeyError(
                f"{uri} is encrypted and no key was given: pass --key-file or --password-file "
                "(a ModelLoad's decryptionKeySecretRef)"
            )
        return key


SPLICE_PIECE = 1 << 20
"""The smallest mean piece a chunk lands through the file descriptor: below it, the two system calls a
piece costs to splice outweigh the page faults a read into the mapping takes."""


class _Load:
    """One load's readers and their shared state: the next chunk, and the chunks each tensor waits for."""

    def __init__(
        self,
        context: _LoadContext,
        model: OpenedModel,
        plan: LoadPlan,
        writer: SegmentWriter,
        key: tz.DecryptionKey | None,
        *,
        use_fd: bool,
        memory: MemoryManager | None = None,
        proofs: list[proof.FileProof] | None = None,
        digests: FileDigests | None = None,
    ) -> None:
        self.context = context
        self.memory = memory
        self.digests = digests
        self.sources: list[Source] = model.sources
        self.model = model
        self.plan = plan
        self.writer = writer
        self.settings = context.settings
        self.observer = context.observer
        self.stop = context.stop
        self._lock = threading.Lock()
        self._remaining = plan.chunk_counts.copy()
        self._spread = _chunks_of_cut_tensors(plan)
        proofs = proofs or []
        self.prover = proof.Prover(proofs, plan, model.sources, [info.size for info in model.infos])
        self._proofs = proofs
        # Ranges of files without a checksum are re-sampled before their tensors are published
        # (integrity.check_chunks), unless the store's checksum or validator proves their file.
        self._sampled = {p.file for p in proofs if p.method == "samples"}
        # A file proven by the store's checksum keeps its tensors back until it is proven (in memory modes
        # that can hold them, and unless the file's own hashes prove each tensor as it lands).
        own_hashes = plan.index.format == "tensorizer" and context.settings.verify
        hold = context.settings.memory.mode != "ring" and not own_hashes
        self._held: dict[int, list[npt.NDArray[np.int32]]] = {
            p.file: [] for p in proofs if hold and self.prover.proves(p.file)
        }
        self.finisher = TensorFinisher(
            writer, key=key, encrypted=plan.index.encrypted, verify=context.settings.verify
        )
        self._use_fd = use_fd

    def run(self) -> None:
        order = self.plan.order
        empty = order[self._remaining[order] == 0]  # nothing to fetch: an empty tensor
        if len(empty):
            self._publish(empty, None)
        for each in self._proofs:
            if self.prover.no_chunks(each.file):
                self._prove(each.file)
        chunks = len(self.plan.chunks)
        run_in_order(chunks, self._read, threads=self.settings.readers, stop=self.stop, name="reader")
        self.finisher.settle()  # the only encrypted tensor, and it failed: nothing proves the key

    def _read(self, seq: int) -> None:
        """Land chunk ``seq`` (a reader thread of the shared pool); publish the tensors it completes."""
        chunk = self.plan.chunks[seq]
        if self.memory is not None and not self.memory.admit(seq, chunk):
            return  # stopped while waiting for room in the ring
        meter = ChunkMeter(self.observer.bytes_loaded, data=chunk.data_bytes, length=chunk.length)
        with metered(meter):  # progress moves as bytes land, not only per chunk
            self._land(chunk)
        meter.finish()
        if self.digests is not None:
            self.digests.landed(seq)
        file_done = self.prover.landed(chunk, self.writer.region)
        tensors = self.plan.tensors_of(chunk)
        with self._lock:
            self._remaining[tensors] -= 1
            complete = tensors[self._remaining[tensors] == 0]
            held = self._held.get(chunk.file)
            if len(complete) and held is not None:
                held.append(complete)
        if len(complete) and held is None:
            self._publish(complete, seq)
        if file_done:
            self._prove(chunk.file)

    def _land(self, chunk: Chunk) -> None:
        """Through the file descriptor (``os.splice``: no copy through this process, no page faults in it)
        where the landing goes that way and the chunk's pieces are big; through the mapping otherwise: a
        range of a thousand small tensors lands with a few scattering reads (``preadv``, ``recvmsg_into``)
        rather than two splices per tensor, its pages taken first (a full volume is then an error, not a
        SIGBUS)."""
        if self._use_fd and chunk.length >= SPLICE_PIECE * chunk.count:
            self._land_fd(chunk)
            return
        if self._use_fd:  # the segment's pages are taken as the descriptor writes them: take these now
            last = chunk.first + chunk.count - 1
            end = int(self.plan.pieces.dst[last] + self.plan.pieces.length[last])
            self.writer.reserve_range(chunk.dst_offset, end - chunk.dst_offset)
        self._land_view(chunk)

    def _prove(self, file: int) -> None:
        """Check a complete file against the store's checksum (once more, from the origin, when none of its
        tensors is out yet), then publish the tensors it held back."""
        policy = self.context.retry
        each = self._proofs[file]
        try:
            self.prover.prove(file, self.writer.region, policy=policy)
        except HashMismatchError as exc:
            if file not in self._held:
                self.observer.file_proof(file=each.uri, proof=each.label, state="failed")
                raise
            log.warning("%s; reading the file again", exc)
            self.observer.retried(kind="checksum", message=str(exc))
            for chunk in self.prover.reset(file):
                self._land(chunk)
                self.prover.landed(chunk, self.writer.region)
            try:
                self.prover.prove(file, self.writer.region, policy=policy)
            except HashMismatchError:
                self.observer.file_proof(file=each.uri, proof=each.label, state="failed")
                raise
        self.observer.file_proof(file=each.uri, proof=each.label, state="proven")
        with self._lock:
            held = self._held.pop(file, [])
        if held:
            self._publish(np.concatenate(held), None)

    def _land_fd(self, chunk: Chunk) -> None:
        pieces = self.plan.pieces
        # Each piece is one piece of the file, or two where a ring segment's ring wraps.
        targets = [
            target
            for at in chunk.pieces
            for target in self.writer.file_ranges(int(pieces.dst[at]), int(pieces.length[at]))
        ]
        source, context = self.sources[chunk.file], self.context
        if len(targets) == 1:
            file_offset, length = targets[0]
            read_range_into_fd(source, chunk.src_offset, length, self.writer.fileno(), file_offset,
                               policy=context.retry, on_retry=context.on_retry)  # fmt: skip
            return
        read_range_pieces_into_fd(source, chunk.src_offset, self.writer.fileno(), targets,
                                  policy=context.retry, on_retry=context.on_retry)  # fmt: skip

    def _land_view(self, chunk: Chunk) -> None:
        source, context = self.sources[chunk.file], self.context
        if chunk.count == 1:
            view = self.writer.region(chunk.dst_offset, chunk.length)
            read_range(source, chunk.src_offset, view, policy=context.retry, on_retry=context.on_retry)
            return
        pieces, span = self.plan.pieces, slice(chunk.first, chunk.first + chunk.count)
        views = self.writer.regions(pieces.dst[span].tolist(), pieces.length[span].tolist())
        read_range_pieces(source, chunk.src_offset, views, policy=context.retry, on_retry=context.on_retry)

    def _publish(self, tensors: npt.NDArray[np.int32], seq: int | None) -> None:
        """Finish tensors whose bytes are all in (the ones chunk ``seq`` completed, or the empty ones, or a
        proven file's held ones), with the shared :class:`TensorFinisher`, then tell."""
        plan, peers = self.plan, self.context.peers
        chosen = tensors.tolist()
        # Bytes from a peer are checked (and re-read from the origin if bad), which may give the CRC-32.
        crcs = [peers.finish(tensor) for tensor in chosen] if peers is not None else None
        entries = list(map(plan.index.tensors.__getitem__, chosen))
        headers = None
        if plan.index.format == "tensorizer":  # the record's header landed in the slot's lead
            headers = [self.writer.region(*plan.record(t).header_span) for t in chosen]
            crcs = None  # finishing a record may change its slot's bytes (decryption)
        from_peers = peers.verified_by_peers if peers is not None else ()

        def check(verified: bool) -> None:
            if verified or seq is None or (from_peers and all(t in from_peers for t in chosen)):
                return
            spread = [c for t in chosen for c in self._spread.get(t, ())]
            chunks = [plan.chunks[c] for c in sorted({seq, *spread}) if plan.chunks[c].file in self._sampled]
            context = self.context
            integrity.check_chunks(
                self.model, plan, self.writer, chunks, policy=context.retry, on_retry=context.on_retry
            )

        uri = self.model.display(entries[0].file)
        done = self.finisher.finish_many(
            chosen, entries=entries, headers=headers, source=uri, check=check, crcs=crcs
        )
        if done:
            slots = plan.layout.slots
            self.observer.tensors_published(
                indices=done, names=[slots[t].name for t in done], nbytes=[slots[t].nbytes for t in done]
            )


def _chunks_of_cut_tensors(plan: LoadPlan) -> dict[int, list[int]]:
    """The chunks of each tensor that is cut across several (a tensor larger than a chunk), by load order:
    publishing it re-checks them all."""
    pieces = plan.pieces
    cut = np.flatnonzero(plan.chunk_counts[pieces.tensor] > 1)
    spread: dict[int, list[int]] = {}
    for tensor, chunk in zip(pieces.tensor[cut].tolist(), pieces.chunk[cut].tolist(), strict=True):
        spread.setdefault(tensor, []).append(chunk)
    return spread


def _warn_without_validator(model: OpenedModel) -> None:
    """Say loudly when a weight file's origin gives no strong validator: a replacement mid-load is then
    caught only by the end-of-load re-check of sampled bytes (docs/sidecar.md, "Consistency")."""
    for source, info in zip(model.sources, model.infos, strict=True):
        strength = integrity.validator_strength(info)
        if strength != "strong":
            log.warning(
                "%s has %s validator (no strong ETag): a replacement during the load can only be detected "
                "by the end-of-load re-check of sampled bytes; publish new model versions under new names",
                source.display_uri,
                "a weak" if strength == "weak" else "no",
            )


PROOFS_KEY = "proofs"
"""The segment metadata key recording, per weight file, what its bytes were proven against (JSON)."""
_UNPROVEN_STATE = {"samples": "sampled", "validator": "pinned"}


def _decide_proofs(model: OpenedModel, settings: LoadSettings, *, encrypted: bool) -> list[proof.FileProof]:
    """The one place a load decides each file's proof (:func:`proof.decide`), given what sampling needs."""
    return proof.decide(
        model,
        memory_mode=settings.memory.mode,
        encrypted=encrypted,
        needs_samples=lambda file: integrity.needs_samples(model, file),
    )


def _metadata(
    uri: str, etag: str | None, size: int, notify: str | None, model_dir: Path | None
) -> dict[str, str]:
    try:
        writer = f"modelload-sidecar {version('modelload')}"
    except PackageNotFoundError:
        writer = "modelload-sidecar"
    meta = {"source": uri, "source_size": str(size), "writer": writer}
    if etag is not None:
        meta["source_etag"] = etag
    if notify is not None:
        meta["notify"] = notify
    if model_dir is not None:
        meta[MODEL_DIR_KEY] = str(model_dir)
    return meta


def _pinned_version(model: OpenedModel) -> dict[str, str]:
    """``source_version``: the one version every weight file was listed at (a Hub commit, an OCI manifest
    digest), when the origin pins one: what the segment was loaded from, whatever the branch or tag says
    now."""
    if model.directory is None:
        return {}
    versions = {
        model.directory.files[name].version for name in model.weights if name in model.directory.files
    }
    version = versions.pop() if len(versions) == 1 else None
    return {"source_version": version} if version else {}


def error_kind(exc: BaseException) -> str:
    """A short label for a failure, for metrics and logs: what the operator should look at. The error
    tree's own ``kind`` (:mod:`modelload.loader.errors`); ``internal`` for anything outside it."""
    return exc.kind if isinstance(exc, ModelloadError) else "internal"


def retry_kind(event: RetryEvent) -> str:
    """Why a range was retried: ``throttled`` (the server asked us to wait), ``timeout``, ``connection``,
    or ``server`` (an error status)."""
    if event.error.retry_after is not None:
        return "throttled"
    cause = event.error.__cause__
    if isinstance(cause, TimeoutError):
        return "timeout"
    if isinstance(cause, OSError):
        return "connection"
    return "server"
