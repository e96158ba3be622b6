"""Sidecars as each other's sources: what the engine and the sidecar process see of peer-to-peer loading.

:class:`Peers` is one sidecar's side of it. It is

- the engine's hook (:meth:`begin` wraps each weight file's origin source in a
  :class:`~modelload.sidecar.peers.fetch.PeerSource` and orders the chunks; :meth:`finish` checks a tensor
  before it is published);
- a load observer (it learns which tensors are READY and how far the load is, for its manifest);
- what the :class:`~modelload.sidecar.peers.server.PeerServer` serves.

Trust. Only a holder of the ModelLoad's peer token is a peer, and it proves that on every answer without
the token ever crossing the wire (:mod:`modelload.loader.peerwire`); each chunk from a peer is checked
against the SHA-256 its answer proves before it counts. Every tensor with bytes from a peer is then checked
against the CRC-32 of its whole record (record header and data) that the peer lists for it, which the first
sidecar that read the tensor from the origin computed there and every later holder re-checked. A mismatch
drops the peer's bytes, reads the tensor again from the origin, excludes that peer for the rest of the load
and counts it. Tensorizer tensors are in addition checked against their stored hashes, as always. A holder
of the token is trusted to report the checksums of what it read from the origin (see docs/peers.md).

Encrypted models do not use peers: their tensors are decrypted in place in the segment, so what a sidecar
holds is plaintext that the origin never served, and serving it would hand decrypted weights to anything with
the peer token. Such a load reads from the origin as before and serves nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from modelload.loader.formats.tensorizer.hashes import crc32
from modelload.loader.peerwire import PeerKey
from modelload.loader.segment import SegmentWriter
from modelload.sidecar.peers.fetch import Ledger, PeerSource
from modelload.sidecar.peers.fleet import Fleet, Peer
from modelload.sidecar.peers.manifest import bitmap
from modelload.sidecar.peers.ranges import RangeMap
from modelload.sidecar.peers.server import PeerServer, Slice
from modelload.sidecar.peers.settings import PeerSettings
from modelload.sidecar.planner import Chunk, LoadPlan
from modelload.sidecar.sources import OpenedModel, RetryPolicy, Source, read_range

__all__ = ["Peers"]

log = logging.getLogger(__name__)


class Peers:
    """One sidecar's peer-to-peer side: serve what it holds, take what others hold."""

    def __init__(
        self,
        settings: PeerSettings,
        *,
        host: str = "0.0.0.0",  # noqa: S104 - the askers are other pods
        retry: RetryPolicy | None = None,
    ) -> None:
        self.settings = settings
        self.id = secrets.token_hex(8)
        self.ledger = Ledger()
        key = PeerKey(settings.token)
        self.fleet = Fleet(settings, self_id=self.id, key=key)
        self.fleet.on_exclude = self._excluded
        self._retry = retry or RetryPolicy()
        self._lock = threading.Lock()
        self._ranges: RangeMap | None = None
        self._files: list[tuple[str, int]] = []
        self._ready: list[bool] = []
        self._crc: list[int] = []
        self.verified_by_peers: set[int] = set()
        """Tensors whose bytes came from peers and matched the CRC-32 they listed."""
        self._phase = "starting"
        self._bytes_done = 0
        self._fd: int | None = None
        self._origins: list[Source] = []
        self._sources: list[Source] = []
        """The peer-aware sources that wrap ``_origins`` (what the engine reads through)."""
        self._chunks: tuple[tuple[Chunk, ...], ...] = ()
        self._writer: SegmentWriter | None = None
        self.server = PeerServer(
            self, key=key, host=host, port=settings.port, max_uploads=settings.max_uploads
        )

    # --- the process -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.server.start()
        log.info("serving peers on port %d (id %s)", self.server.port, self.id)

    def close(self) -> None:
        self.fleet.stop()
        self.server.stop()
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # --- the engine's hooks ------------------------------------------------------------------------------

    def begin(
        self, *, model: OpenedModel, plan: LoadPlan, writer: SegmentWriter, segment: Path, share: bool = True
    ) -> LoadPlan:
        """Wrap ``model``'s sources to ask peers first and return the plan to load, own tensors first.

        Called once the segment exists. Encrypted models, objects without an ETag, and loads that will not
        keep their tensors (``share`` false: a memory mode that releases pages) load from the origin as
        before and serve nothing (see the module docstring)."""
        index = plan.index
        if not share or index.encrypted or any(info.etag is None for info in model.infos):
            if not share:
                why = "this load releases tensors once consumed (memory mode), so it could not serve them"
            elif index.encrypted:
                why = "the model is encrypted"
            else:
                why = "a weight file has no ETag to match by"
            log.info("peers are off for this load: %s", why)
            with self._lock:
                self._phase = "unshared"
            return plan
        plan = plan.per_tensor()  # a peer serves ranges inside one tensor's record (ranges.py)
        ranges = RangeMap(plan)
        fd = os.open(segment, os.O_RDONLY)
        with self._lock:
            self._ranges, self._fd, self._writer = ranges, fd, writer
            self._files = [(info.etag or "", info.size) for info in model.infos]
            self._ready = [False] * len(index.tensors)
            self._crc = [0] * len(index.tensors)
            self._origins = list(model.sources)
            self._phase = "loading"
        self._chunks = plan.chunks_by_tensor
        self.fleet.start(infos=model.infos, tensors=len(index.tensors), salt=model.fingerprint or "")
        self._sources = [
            PeerSource(origin, file=i, fleet=self.fleet, ranges=ranges, ledger=self.ledger)
            for i, origin in enumerate(model.sources)
        ]
        model.sources[:] = self._sources
        return plan.reordered(self._own_first(plan))

    def _own_first(self, plan: LoadPlan) -> tuple[Chunk, ...]:
        """Chunks of the tensors this sidecar would read from the origin first, then the rest, each in load
        order: the fleet's origin readers then work in parallel from the start, and what others read is
        mostly in by the time it is asked for."""
        fleet = self.fleet
        own: list[Chunk] = []
        other: list[Chunk] = []
        for chunk in plan.chunks:
            mine = not fleet.holders(chunk.tensor) and fleet.owner(chunk.tensor) is None
            (own if mine else other).append(chunk)
        return (*own, *other)

    def finish(self, tensor: int) -> int | None:
        """Check a tensor whose bytes are all in; when a peer's bytes are wrong, read it again: from the
        other peers (the one that sent them is dropped), and should those fail the check too, from the
        origin.

        The CRC-32 of the whole record (header and data) is what the manifest lists for other peers. Where
        the record is exactly the slot (safetensors), it is also the slot's checksum, which is returned for
        the segment's state table; otherwise None."""
        ranges, writer = self._ranges, self._writer
        if ranges is None or writer is None:
            return None
        record = ranges.plan.record(tensor)
        region = writer.region(*record.landed)
        crc = crc32(region)
        claims = self.ledger.claim(tensor)
        if claims and not self._passed(tensor, claims, crc):
            for sources in (self._sources, self._origins):
                self._reland(tensor, sources)
                crc = crc32(region)
                again = self.ledger.claim(tensor)
                if not again or self._passed(tensor, again, crc):
                    break
        with self._lock:
            self._crc[tensor] = crc
        return crc if record.header == 0 and record.data == record.nbytes else None

    def _passed(self, tensor: int, claims: dict[str, int], crc: int) -> bool:
        """Whether every peer that sent bytes of ``tensor`` listed its CRC-32 as landed; drops the others."""
        self.fleet.checked({url: listed == crc for url, listed in claims.items()})
        if all(listed == crc for listed in claims.values()):
            with self._lock:
                self.verified_by_peers.add(tensor)
            return True
        self.ledger.mismatched()
        log.warning(
            "tensor %d from peers failed verification (CRC-32 %08x, listed %s): reading it again from other"
            " peers or the origin",
            tensor, crc, ", ".join(f"{c & 0xFFFFFFFF:08x}" for c in claims.values()),
        )  # fmt: skip
        return False

    def _reland(self, tensor: int, sources: list[Source]) -> None:
        """Land ``tensor``'s chunks again from ``sources`` (the peer-aware ones, or the origin's)."""
        writer = self._writer
        assert writer is not None
        for chunk in self._chunks[tensor]:
            view = writer.region(chunk.dst_offset, chunk.length)
            read_range(sources[chunk.file], chunk.src_offset, view, policy=self._retry)
            if sources is self._origins:
                self.ledger.origin(chunk.length)

    def register_metrics(self, registry: Any) -> None:
        """Expose the ledger on the sidecar's ``/metrics`` (read at each scrape, nothing on the hot path)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        ledger = self.ledger

        class _Collector:
            def collect(self) -> Any:
                figures = ledger.as_dict()
                for name, key, text in (
                    ("modelload_peer_origin_bytes", "origin_bytes", "Tensor bytes read from the origin"),
                    ("modelload_peer_received_bytes", "peer_bytes", "Tensor bytes taken from peers"),
                    ("modelload_peer_uploaded_bytes", "uploaded_bytes", "Bytes served to peers"),
                    (
                        "modelload_peer_mismatches",
                        "mismatches",
                        "Tensors from peers that failed verification",
                    ),
                ):
                    yield CounterMetricFamily(name, text, value=figures[key])
                yield GaugeMetricFamily(
                    "modelload_peer_excluded_peers",
                    "Peers excluded from this load",
                    value=figures["excluded_peers"],
                )

            def describe(self) -> Any:
                return []

        registry.register(_Collector())

    def _excluded(self, peer: Peer, why: str) -> None:
        self.ledger.excluded_peer()

    # --- observer: what this sidecar holds ---------------------------------------------------------------

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self.tensors_published(indices=[index], names=[name], nbytes=[nbytes])

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        with self._lock:
            ready = self._ready
            for index in indices:
                if index < len(ready):
                    ready[index] = True
        self.fleet.progressed()

    def bytes_loaded(self, count: int) -> None:
        with self._lock:
            self._bytes_done += count

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        with self._lock:
            if self._phase == "loading":
                self._phase = "complete"
        self.fleet.stop()

    def load_failed(self, *, kind: str, reason: str) -> None:
        with self._lock:
            if self._phase in ("starting", "loading"):
                self._phase = "failed"
        self.fleet.stop()

    # --- what the server serves --------------------------------------------------------------------------

    def manifest(self) -> dict[str, Any]:
        with self._lock:
            doc: dict[str, Any] = {"id": self.id, "phase": self._phase, "bytes_done": self._bytes_done}
            if self._ranges is not None:
                doc["files"] = [{"etag": etag, "size": size} for etag, size in self._files]
                doc["ready"] = bitmap(self._ready)
                doc["crc32"] = [c if r else 0 for c, r in zip(self._crc, self._ready, strict=True)]
        return doc

    def stats(self) -> dict[str, Any]:
        with self._lock:
            phase = self._phase
        return {"id": self.id, "phase": phase, "peers": self.fleet.serving(), **self.ledger.as_dict()}

    def file_info(self, file: int) -> tuple[str, int] | None:
        with self._lock:
            return self._files[file] if 0 <= file < len(self._files) else None

    def locate(self, file: int, offset: int, length: int) -> Slice | None:
        with self._lock:
            ranges, fd = self._ranges, self._fd
            if ranges is None or fd is None:
                return None
            span = ranges.span(file, offset, length)
            if span is None or not self._ready[span.tensor]:
                return None
        return Slice(fd=fd, offset=span.segment_offset, length=length)

    def uploaded(self, nbytes: int) -> None:
        self.ledger.uploaded(nbytes)
