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
4. N reader threads (:mod:`modelload.sidecar.load.readers`) take chunks, each a range of neighbouring
   tensors, in load order and land them straight in the segment: ``os.splice`` from the socket or file into
   the segment's file on 4 KiB pages where the source supports it and the pieces are big (no user-space
   copy, no page faults in this process), scattering reads into the mapping on huge pages and otherwise
   (:mod:`modelload.sidecar.load.landing` chooses);
5. the thread that lands a chunk decrypts the tensors it completes in place, checks their hashes when
   asked, and publishes them READY together;
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
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from modelload.loader.errors import ModelloadError, SegmentError
from modelload.loader.formats import ModelIndex
from modelload.loader.segment import MODEL_DIR_KEY, SegmentWriter
from modelload.loader.segment.collector import LongLived
from modelload.loader.segment.failure import leave_failed, remove_failure
from modelload.loader.segment.identity import LoadIdentity
from modelload.loader.segment.lock import WriterLock
from modelload.loader.segment.modeldir import remove_model_dir
from modelload.loader.segment.previous import Previous, set_aside
from modelload.sidecar.load import integrity, proof
from modelload.sidecar.load.digests import FileDigests
from modelload.sidecar.load.keys import check_key, read_key
from modelload.sidecar.load.landing import choose_landing
from modelload.sidecar.load.modeldir import write_model_dir
from modelload.sidecar.load.readers import LoadContext, PeerHook, Readers
from modelload.sidecar.load.reuse import load_identity, reuse
from modelload.sidecar.load.settings import LoadSettings
from modelload.sidecar.memory import MemoryManager, plan_memory
from modelload.sidecar.planner import LoadPlan, plan_load
from modelload.sidecar.progress import LoadObserver
from modelload.sidecar.sources import OpenedModel, RetryEvent, SourceSettings, display_url, open_model

__all__ = ["Engine", "LoadStopped", "PeerHook", "error_kind"]

log = logging.getLogger(__name__)


STOPPED = "the sidecar was stopped before the load finished"
"""The reason a stopped load's segment records."""


class LoadStopped(ModelloadError):
    """The load was stopped (SIGTERM) before it finished; the segment is marked FAILED."""

    kind = "stopped"


class Engine:
    """Loads one model into one segment. Call :meth:`run` (blocking) once; :meth:`stop` from any thread."""

    def __init__(
        self,
        settings: LoadSettings,
        *,
        sources: SourceSettings,
        observer: LoadObserver,
        peers: PeerHook | None = None,
        lock: WriterLock | None = None,
        retry_transient: bool = False,
    ) -> None:
        """``lock`` is the segment's writer lock when the caller holds it (the sidecar, for its whole
        life); without it the engine takes the lock for the run. ``retry_transient`` says the caller
        retries the whole load after a transient failure: the engine then reports none (the caller says
        it retries) and leaves no failure marker, only the FAILED segment's reason for attached readers."""
        self.settings = settings
        self._peers = peers
        self._observer = observer
        self._stop = threading.Event()
        # A stop (SIGTERM) also cuts short a retry's backoff, so stopping never waits out a retry's sleep.
        self._sources = replace(sources, retry=replace(sources.retry, stop=self._stop))
        self._writer: SegmentWriter | None = None
        self._writer_lock = threading.Lock()
        self._lock = lock
        self._retry_transient = retry_transient
        self._previous: Previous | None = None
        self._model_dir: Path | None = None

    def stop(self) -> None:
        """Mark a segment still loading FAILED ("stopped") at once, then stop the readers at their next
        chunk: a reader blocked on a slow source cannot hold the mark back (SPEC.md, "Writers and loads")."""
        with self._writer_lock:
            self._stop.set()
            writer = self._writer
        if writer is not None:
            with contextlib.suppress(SegmentError):  # closed: the load already ended
                writer.mark_failed(STOPPED)

    # --- the load -----------------------------------------------------------------------------------------

    def run(self) -> None:
        """Load the model. Raises the ModelloadError that failed it, or :class:`LoadStopped`."""
        settings = self.settings
        self._observer.load_started(source=display_url(settings.source), segment=str(settings.segment))
        own_lock = None
        try:
            if self._lock is None:
                self._lock = own_lock = WriterLock.acquire(settings.segment, program="modelload engine")
            # Out of sight until this load knows whether the segment an earlier one left is this very load;
            # an earlier failure's marker goes too (SPEC.md writer rule 7).
            self._previous = set_aside(settings.segment)
            remove_failure(settings.segment)
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
            if own_lock is not None:
                own_lock.release()

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
        key = read_key(settings)
        identity = load_identity(model, settings, key)
        if model.directory is not None:
            model_dir = self._model_dir = write_model_dir(
                model, self.model_dir, self._sources, on_retry=self._retried
            )
        previous, self._previous = self._previous, None
        if reuse(previous, identity, key, observer):
            return
        index = model.index
        check_key(index, uri, key)
        landing = choose_landing(settings.landing, settings.segment, model.sources)
        proofs = _decide_proofs(model, settings, encrypted=index.encrypted)
        metadata = _metadata(uri, model.fingerprint, model.size, settings.notify, model_dir, identity)
        proofs_text = json.dumps({p.uri: p.label for p in proofs}, sort_keys=True)
        metadata = {**metadata, **_pinned_version(model), PROOFS_KEY: proofs_text}
        plan = self._plan(index, metadata, page_size=landing.page_size)
        use_fd = landing.through_fd
        # Through the file descriptor nothing writes a meta tensor's slot: reserve it before publishing.
        unlanded = integrity.unlanded_ranges(plan) if use_fd else []
        # A ring's pages are taken once, now, and reused lap after lap (a full volume fails here).
        ring = settings.memory.mode == "ring"
        writer = SegmentWriter.create(
            settings.segment, plan.layout, reserve=ring, reserve_ranges=unlanded, lock=self._lock
        )
        self._take_writer(writer)
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
        Readers(
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
        if self._stop.is_set():
            raise LoadStopped("stopped before the load finished")
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
            readers=settings.readers,
            packed=settings.packed,
        )
        return plan_memory(plan, settings.memory)

    def _context(self) -> LoadContext:
        return LoadContext(
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

    def _take_writer(self, writer: SegmentWriter) -> None:
        """From now on a stop marks ``writer``'s segment (SIGTERM: mark first, then stop); stopped already,
        the load ends here."""
        with self._writer_lock:
            self._writer = writer
            stopped = self._stop.is_set()
        if stopped:
            raise LoadStopped("stopped before the load finished")

    def _fail(self, exc: BaseException) -> None:
        """Leave the failure as readers must find it (:func:`~modelload.loader.segment.failure.leave_failed`:
        the segment marked FAILED, then removed, the reason in the marker), free what this load wrote, and
        report it unless the caller retries the whole load."""
        kind = error_kind(exc)
        final = not (self._retry_transient and getattr(exc, "transient", False))
        reason = str(exc) if kind != "stopped" else STOPPED
        if not final:
            reason = f"{reason}; the sidecar retries the whole load: attach again"
        with self._writer_lock:
            writer = self._writer
        if kind == "stopped":  # the pod is going away, or a restart loads again: readers just stop waiting
            if writer is not None:
                with contextlib.suppress(SegmentError):
                    writer.mark_failed(reason)
        elif final or writer is not None:  # retrying: no marker, an app attaching meanwhile waits for it
            problem = leave_failed(self.settings.segment, f"{reason} ({kind})", writer=writer, marker=final)
            if problem is not None:
                log.error("%s", problem)
        if self._model_dir is not None:
            remove_model_dir(self._model_dir)
        if self._previous is not None and final and kind != "stopped":
            self._previous.discard()  # a transient failure or a stop keeps it: the next load may reuse it
        if final:
            self._observer.load_failed(kind=kind, reason=reason)

    def _retried(self, event: RetryEvent) -> None:
        self._observer.retried(kind=retry_kind(event), message=str(event.error))


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
    uri: str,
    etag: str | None,
    size: int,
    notify: str | None,
    model_dir: Path | None,
    identity: LoadIdentity,
) -> dict[str, str]:
    try:
        writer = f"modelload-sidecar {version('modelload')}"
    except PackageNotFoundError:
        writer = "modelload-sidecar"
    meta = {"source": uri, "source_size": str(size), "writer": writer, **identity.metadata()}
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
