"""One load's reader threads: chunks from the sources into the segment, the tensors they complete published.

:class:`~modelload.sidecar.load.engine.Engine` plans a load, creates its segment and then hands the rest to
:class:`Readers`: N threads of the shared pool (:func:`~modelload.loader.segment.run_in_order`) take chunks in
load order. A chunk is one range of one weight file covering neighbouring tensors; it lands with one request,
each piece at its tensor's slot. Through the segment's file descriptor, big pieces from a socket are spliced
(no copy through this process), and many small ones, or a local file's, go through a reused buffer, a
``pwritev`` a window (:mod:`~modelload.sidecar.load.scatter`); through the mapping (huge pages, HTTPS, a
ring), scattering reads land them (``preadv``, ``recvmsg_into``). The tensors a chunk completes are
finished together (:class:`TensorFinisher`: decrypted, their hashes checked, a sample of their range re-read
when nothing else proves their file) and published with one event. A file proven by its store's checksum or
by the digest its origin publishes holds its tensors back until the whole file is proven
(:mod:`modelload.sidecar.load.proof`, :mod:`modelload.sidecar.load.digests`).

The engine keeps what outlives the readers: the segment's identity, the writer lock, stop and failure.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, overload

import numpy as np
import numpy.typing as npt

from modelload.loader.errors import HashMismatchError
from modelload.loader.formats import tensorizer as tz
from modelload.loader.formats.tensorizer.hashes import crc32_combine
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorFinisher, run_in_order
from modelload.sidecar.load import integrity, proof
from modelload.sidecar.load.digests import FileDigests
from modelload.sidecar.load.hot_crcs import HOT_PIECE, LandedCrcs
from modelload.sidecar.load.meter import ChunkMeter
from modelload.sidecar.load.scatter import Neighbours
from modelload.sidecar.load.settings import LoadSettings
from modelload.sidecar.memory import MemoryManager
from modelload.sidecar.planner import Chunk, LoadPlan
from modelload.sidecar.progress import LoadObserver
from modelload.sidecar.sources import (
    OpenedModel,
    RetryEvent,
    RetryPolicy,
    Source,
    metered,
    read_range,
    read_range_into_fd,
    read_range_into_sink,
    read_range_pieces,
    read_range_pieces_into_fd,
    watch_landing,
    window_size,
)

__all__ = ["SPLICE_PIECE", "LoadContext", "PeerHook", "Readers"]

log = logging.getLogger(__name__)


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
class LoadContext:
    """What one load's readers share with the engine that runs them, handed over explicitly."""

    settings: LoadSettings
    observer: LoadObserver
    stop: threading.Event
    """Set by :meth:`Engine.stop`: the readers stop at their next chunk."""
    retry: RetryPolicy
    on_retry: Callable[[RetryEvent], None]
    peers: PeerHook | None


SPLICE_PIECE = 1 << 20
"""The smallest mean piece a chunk splices through the file descriptor: below it, the two system calls a
piece costs to splice outweigh one copy through a buffer and a ``pwritev`` a window."""


class Readers:
    """One load's readers and their shared state: the next chunk, and the chunks each tensor waits for."""

    def __init__(
        self,
        context: LoadContext,
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
        proofs = proofs or []
        self.prover = proof.Prover(proofs, plan, model.sources, [info.size for info in model.infos])
        self._proofs = proofs
        # Ranges of files without a checksum are re-sampled before their tensors are published
        # (integrity.check_chunks), unless the store's checksum or validator proves their file.
        self._sampled = {p.file for p in proofs if p.method == "samples"}
        # A file proven by the store's checksum keeps its tensors back until it is proven (in memory modes
        # that can hold them, and unless the file's own hashes prove each tensor as it lands).
        # So does a file proven by the digest its origin publishes (hf://, oci://), until its digest matched.
        own_hashes = plan.index.format == "tensorizer" and context.settings.verify
        hold = context.settings.memory.mode != "ring" and not own_hashes
        held = {p.file for p in proofs if self.prover.proves(p.file)}
        if digests is not None:
            held |= digests.files
        self._held: dict[int, list[npt.NDArray[np.int32]]] = {file: [] for file in held} if hold else {}
        self.finisher = TensorFinisher(
            writer, key=key, encrypted=plan.index.encrypted, verify=context.settings.verify
        )
        self._use_fd = use_fd
        # A ring's bytes wrap around its end: its small pieces keep the mapping's scattering reads.
        ring = writer.layout.memory_mode == MemoryMode.RING
        self._neighbours = Neighbours(plan) if use_fd and not ring else None
        # The CRC-32 taken as bytes land is recorded unless a peer's bytes are checked after landing or a
        # tensorizer record's slot changes when it is finished (see _publish).
        self._crc_landing = context.peers is None and plan.index.format != "tensorizer"
        # A tensor cut across chunks: its pieces (publishing it re-checks all their chunks), and each piece's
        # CRC-32 as it landed, combined once the tensor is all in.
        self._cut = _pieces_of_cut_tensors(plan)
        self._piece_crcs: dict[int, int] = {}
        # Where landing a range through a buffer, its CRC-32s taken there, costs less than splicing it and
        # reading the slots again for their CRC-32s (a local file): big pieces go that way too.
        windows = self._neighbours is not None and self._crc_landing
        self._through_window = [
            windows and getattr(source, "lands_best_through_a_window", False) for source in self.sources
        ]
        if digests is not None and hold:
            self._release(digests.when_proven(self._release))

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
            crcs = self._land(chunk)
        meter.finish()
        if self.digests is not None:
            self.digests.landed(seq)
        file_done = self.prover.landed(chunk, self.writer.region)
        tensors = self.plan.tensors_of(chunk)
        with self._lock:
            if crcs is not None and self._cut:
                for at in np.flatnonzero(self.plan.chunk_counts[tensors] > 1).tolist():
                    self._piece_crcs[chunk.first + at] = int(crcs[at])
            self._remaining[tensors] -= 1
            finished = self._remaining[tensors] == 0
            complete = tensors[finished]
            held = self._held.get(chunk.file)
            if len(complete) and held is not None:
                held.append(complete)
        if len(complete) and held is None:
            self._publish(complete, seq, None if crcs is None else self._combined(complete, crcs[finished]))
        if file_done:
            self._prove(chunk.file)

    def _combined(self, tensors: npt.NDArray[np.int32], crcs: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``crcs`` (per tensor of ``tensors``, the CRC-32 of its piece in the chunk that completed it) with
        each tensor cut across chunks given the CRC-32 of all its pieces, made from each piece's as it landed,
        or -1 where a piece's was not taken (the finisher then reads the slot)."""
        cut = np.flatnonzero(self.plan.chunk_counts[tensors] > 1)
        if not len(cut):
            return crcs
        crcs = crcs.copy()
        lengths = self.plan.pieces.length
        with self._lock:
            for at in cut.tolist():
                pieces = self._cut.get(int(tensors[at]), [])
                parts = [self._piece_crcs.pop(piece, -1) for piece in pieces]
                whole = parts[0] if parts else -1
                for piece, part in zip(pieces[1:], parts[1:], strict=True):
                    whole = -1 if whole < 0 or part < 0 else crc32_combine(whole, part, int(lengths[piece]))
                crcs[at] = whole
        return crcs

    def _land(self, chunk: Chunk) -> npt.NDArray[np.int64] | None:
        """Land ``chunk``; returns, per tensor of the chunk (:meth:`LoadPlan.tensors_of`), the CRC-32 of
        its piece's bytes where the landing took it on the way (-1 where not), or None where it took none.

        Through the file descriptor where the landing goes that way: spliced when the chunk's pieces are big
        (no copy through this process, no page faults in it), through a reused buffer and a ``pwritev`` a
        window when they are many and small (:mod:`.scatter`; two splices per tensor would cost more), or
        when the source is a local file (its ``lands_best_through_a_window``: the CRC-32s taken from the
        buffer spare a second pass over the slots).
        Through the mapping otherwise: a range of a thousand small tensors lands with a few scattering reads
        (``preadv``, ``recvmsg_into``), in a ring its pages taken first (a full volume is then an error,
        not a SIGBUS)."""
        big = chunk.length >= SPLICE_PIECE * chunk.count
        if self._use_fd and big and not self._through_window[chunk.file]:
            self._land_fd(chunk)
            return None
        if self._neighbours is not None:
            return self._land_scattered(chunk, self._neighbours)
        if self._use_fd:  # the segment's pages are taken as the descriptor writes them: take these now
            last = chunk.first + chunk.count - 1
            end = int(self.plan.pieces.dst[last] + self.plan.pieces.length[last])
            self.writer.reserve_range(chunk.dst_offset, end - chunk.dst_offset)
        return self._land_view(chunk)

    def _land_scattered(self, chunk: Chunk, neighbours: Neighbours) -> npt.NDArray[np.int64]:
        source, context = self.sources[chunk.file], self.context
        sink, window = neighbours.sink(chunk, self.writer.fileno()), window_size(self.settings.readers)
        read_range_into_sink(source, chunk.src_offset, chunk.length, sink,
                             policy=context.retry, on_retry=context.on_retry, window=window)  # fmt: skip
        return sink.crc_column()

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

    def _release(self, files: Sequence[int]) -> None:
        """Publish the tensors held back for ``files``, proven by their digests (a hashing thread)."""
        with self._lock:
            held = [part for file in files for part in self._held.pop(file, [])]
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

    def _land_view(self, chunk: Chunk) -> npt.NDArray[np.int64] | None:
        """Land ``chunk`` through the mapping; where its pieces are big, with each tensor's CRC-32 taken as
        its bytes land (:mod:`.hot_crcs`)."""
        source, plan = self.sources[chunk.file], self.plan
        pieces, span = plan.pieces, slice(chunk.first, chunk.first + chunk.count)
        if chunk.count == 1:
            views = [self.writer.region(chunk.dst_offset, chunk.length)]
        else:
            views = self.writer.regions(pieces.dst[span].tolist(), pieces.length[span].tolist())
        held = chunk.file in self._held  # published later, with the CRCs taken then
        if not self._crc_landing or held or chunk.length < HOT_PIECE * chunk.count:
            self._read_views(source, chunk, views)
            return None
        # A piece's CRC is taken as it lands only where the piece is all of its tensor: a cut tensor's slot
        # is read back once it is all in. A receive brings a TLS record (16 KiB) at most, and a CRC per
        # record of every piece of a 1 GiB model of 256 MiB tensors over HTTPS cost more than reading the
        # slots back (2.43 against 2.08 CPU-s, 4 rounds, load 4-9).
        whole = (plan.chunk_counts[pieces.tensor[span]] == 1) & (pieces.data[span] == pieces.length[span])
        if not whole.any():
            self._read_views(source, chunk, views)
            return None
        crcs = LandedCrcs(views, whole.tolist())
        with watch_landing(crcs):
            self._read_views(source, chunk, views)
        return crcs.crc_column()

    def _read_views(self, source: Source, chunk: Chunk, views: list[memoryview]) -> None:
        policy, on_retry = self.context.retry, self.context.on_retry
        if len(views) == 1:
            read_range(source, chunk.src_offset, views[0], policy=policy, on_retry=on_retry)
        else:
            read_range_pieces(source, chunk.src_offset, views, policy=policy, on_retry=on_retry)

    def _publish(
        self, tensors: npt.NDArray[np.int32], seq: int | None, landed: npt.NDArray[np.int64] | None = None
    ) -> None:
        """Finish tensors whose bytes are all in (the ones chunk ``seq`` completed, or the empty ones, or a
        proven file's held ones), with the shared :class:`TensorFinisher`, then tell. ``landed``: per tensor,
        the CRC-32 the landing took of its bytes on the way, -1 where it took none.

        The tensors of a range are handled as columns: a range of a thousand small tensors costs a few
        array operations here, not an object per tensor."""
        plan, peers = self.plan, self.context.peers
        table = plan.index.table
        crcs: npt.NDArray[np.int64] | None = None
        if peers is not None:
            # Bytes from a peer are checked (and re-read from the origin if bad), which may give the CRC-32;
            # the landing's would be of the bytes before that check.
            crcs = np.array([-1 if c is None else c for c in map(peers.finish, tensors.tolist())], np.int64)
        elif landed is not None:
            # The landing's CRC is the slot's only where the slot holds exactly the tensor's bytes (the
            # landings give -1 otherwise; checked here again).
            exact = plan.layout.table.nbytes[tensors] == table.data_lengths[tensors]
            crcs = np.where(exact, landed, -1)
        headers = None
        if plan.index.format == "tensorizer":  # the record's header landed in the slot's lead
            headers = [self.writer.region(*plan.record(t).header_span) for t in tensors.tolist()]
            crcs = None  # finishing a record may change its slot's bytes (decryption)
        from_peers = peers.verified_by_peers if peers is not None else ()

        def check(verified: bool) -> None:
            if verified or seq is None or (from_peers and all(t in from_peers for t in tensors.tolist())):
                return
            if plan.chunks[seq].file not in self._sampled:
                return  # (a chunk's tensors are all of its file: so are the chunks of any cut among them)
            cut = tensors[plan.chunk_counts[tensors] > 1].tolist()  # few: the range's first and last at most
            spread = [int(plan.pieces.chunk[piece]) for t in cut for piece in self._cut.get(t, ())]
            chunks = [plan.chunks[c] for c in sorted({seq, *spread})]
            context = self.context
            integrity.check_chunks(
                self.model, plan, self.writer, chunks, policy=context.retry, on_retry=context.on_retry
            )

        uri = self.model.display(int(table.files[tensors[0]]))
        done = self.finisher.finish_many(
            tensors, entries=table, headers=headers, source=uri, check=check, crcs=crcs
        )
        if len(done):
            slots = plan.layout.table
            indices = done.tolist()
            self.observer.tensors_published(
                indices=indices, names=_Picked(slots.names, indices), nbytes=slots.nbytes[done].tolist()
            )


class _Picked(Sequence[str]):
    """The names of tensors ``indices``, each made only if an observer asks for it: the status, the metrics
    and the notifications count a range's tensors, and 100,000 names made per load for them cost more than
    the counting."""

    __slots__ = ("_indices", "_names")

    def __init__(self, names: Sequence[str], indices: list[int]) -> None:
        self._names, self._indices = names, indices

    def __len__(self) -> int:
        return len(self._indices)

    def __iter__(self) -> Iterator[str]:
        return map(self._names.__getitem__, self._indices)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self._names[t] for t in self._indices[i]]
        return self._names[self._indices[i]]


def _pieces_of_cut_tensors(plan: LoadPlan) -> dict[int, list[int]]:
    """The pieces of each tensor that is cut across several chunks (a tensor larger than a chunk), in file
    order: its CRC-32 is made from theirs, and publishing it re-checks all their chunks."""
    pieces = plan.pieces
    cut = np.flatnonzero(plan.chunk_counts[pieces.tensor] > 1)
    cut = cut[np.lexsort((pieces.src[cut], pieces.tensor[cut]))]
    grouped: dict[int, list[int]] = {}
    for tensor, piece in zip(pieces.tensor[cut].tolist(), cut.tolist(), strict=True):
        grouped.setdefault(tensor, []).append(piece)
    return grouped
