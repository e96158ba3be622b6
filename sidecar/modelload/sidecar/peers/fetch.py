"""Taking chunks from peers: who the peers are, what each holds, and a source that asks them first.

:class:`Fleet` finds the peers (a static list of URLs, and/or a DNS name that resolves to every pod of the
ModelLoad: a headless Service with ``publishNotReadyAddresses``, so loading pods count) and polls each one's
manifest while this sidecar loads. It keeps only peers that hold the same version of every weight file (same
ETag and size as the origin told this sidecar); a peer of another version is ignored.

:class:`PeerSource` wraps the origin source of one weight file. For a chunk of tensor T it asks, in order:

1. the peers that hold T READY, ranked by rendezvous weight for T (so askers spread over holders, and one
   holder is not asked by everyone); a busy peer (429) or a failing one passes the chunk to the next; a
   transfer that breaks resumes from where it broke, at the next peer or the origin;
2. when nobody holds T: T's owner among the members still loading (this sidecar included, rendezvous
   hashing); the owner reads T from the origin, the others wait for it to hold T and take it from there;
   a waiter gives up on an owner that makes no progress for ``stall_timeout`` (killed, stalled) and the
   next owner, possibly itself, takes over. This is the single-flight: sidecars that start together read
   each tensor from the origin once.

Every tensor taken from a peer is checked before it is published (:meth:`Peers.finish`).
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from modelload.loader.errors import ModelloadError, SourceChangedError
from modelload.sidecar.peers.ranges import RangeMap, owner, rank
from modelload.sidecar.peers.server import unbitmap
from modelload.sidecar.peers.settings import PeerSettings
from modelload.sidecar.sources import (
    HttpSettings,
    HttpSource,
    InterruptedReadError,
    ObjectInfo,
    RequestHeaders,
    Source,
)

__all__ = ["Fleet", "PeerSource"]

log = logging.getLogger(__name__)

POLL = 0.2
"""Seconds between manifest polls while loading: how soon a tensor a peer finished is seen here."""
_BUSY_PAUSE = 0.02
PROGRESS_FACTOR = 6


class _PeerFile(HttpSource):
    """A weight file at a peer, read with the origin's validators (If-Match the origin's ETag)."""

    def __init__(self, url: str, settings: HttpSettings, info: ObjectInfo) -> None:
        super().__init__(url, settings)
        self._info = ObjectInfo(size=info.size, etag=info.etag)


@dataclass
class Peer:
    """What this sidecar knows of one peer, from its last manifest."""

    url: str
    id: str | None = None
    phase: str = "unknown"
    ready: list[bool] = field(default_factory=list)
    crc: list[int] = field(default_factory=list)
    bytes_done: int = -1
    progressed_at: float = field(default_factory=time.monotonic)
    seen_at: float = field(default_factory=time.monotonic)
    same_version: bool | None = None
    excluded: str | None = None
    cool_until: float = 0.0
    files: dict[int, _PeerFile] = field(default_factory=dict)

    def usable(self, now: float) -> bool:
        return self.excluded is None and self.same_version is not False and now >= self.cool_until


class Fleet:
    """The peers of one load, refreshed in the background while the load runs."""

    def __init__(self, settings: PeerSettings, *, self_id: str) -> None:
        self.settings = settings
        self.self_id = self_id
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._peers: dict[str, Peer] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._infos: Sequence[ObjectInfo] = ()
        self._tensors = 0
        self.salt = ""
        self.http = HttpSettings(
            connect_timeout=2.0,
            stall_timeout=settings.stall_timeout,
            max_redirects=0,
            headers=RequestHeaders((("Authorization", f"Bearer {settings.token}"),)),
        )
        self.on_exclude: Callable[[Peer, str], None] = lambda peer, why: None

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self, *, infos: Sequence[ObjectInfo], tensors: int, salt: str) -> None:
        """Learn the peers before the first chunk: poll until every address answered or ``settle`` passed."""
        self._infos, self._tensors, self.salt = tuple(infos), tensors, salt
        deadline = time.monotonic() + self.settings.settle
        while True:
            self.refresh()
            with self._lock:
                pending = [p for p in self._peers.values() if p.id is None]
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(POLL)
        self._thread = threading.Thread(target=self._poll, name="modelload-peer-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and wake every waiter (the load ended, or the sidecar stops)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        with self._lock:
            files = [f for peer in self._peers.values() for f in peer.files.values()]
        for file in files:
            file.close()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _poll(self) -> None:
        while not self._stop.wait(POLL):
            try:
                self.refresh()
            except Exception:  # a poll must never end the thread: the next one may work
                log.exception("polling the peers failed")

    # --- discovery and manifests -------------------------------------------------------------------------

    def addresses(self) -> list[str]:
        """Every peer URL: the static list, and the DNS name's addresses with the peer port."""
        urls = [url.rstrip("/") for url in self.settings.urls]
        if self.settings.dns:
            try:
                found = socket.getaddrinfo(self.settings.dns, self.settings.port, type=socket.SOCK_STREAM)
            except socket.gaierror as exc:
                log.debug("cannot resolve the peers' name %s: %s", self.settings.dns, exc)
                found = []
            for *_, address in found:
                host = str(address[0])
                host = f"[{host}]" if ":" in host else host
                urls.append(f"http://{host}:{self.settings.port}")
        return list(dict.fromkeys(urls))

    def refresh(self) -> None:
        """Fetch every known peer's manifest (in parallel) and update what each holds."""
        urls = self.addresses()
        with self._lock:
            for url in urls:
                self._peers.setdefault(url, Peer(url))
            peers = [p for p in self._peers.values() if p.excluded is None and p.id != self.self_id]
            peers = [p for p in peers if p.phase != "complete" or p.id is None]
        if not peers:
            return
        with ThreadPoolExecutor(max_workers=min(8, len(peers)), thread_name_prefix="peer-manifest") as pool:
            answers = list(pool.map(self._manifest, peers))
        now = time.monotonic()
        with self._changed:
            for peer, doc in zip(peers, answers, strict=True):
                if doc is not None:
                    self._update(peer, doc, now)
            self._changed.notify_all()

    def _manifest(self, peer: Peer) -> dict[str, object] | None:
        parts = urlsplit(peer.url)
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=1.0)
        try:
            auth = {"Authorization": f"Bearer {self.settings.token}"}
            conn.request("GET", "/peer/v1/manifest", headers=auth)
            response = conn.getresponse()
            body = response.read(1 << 24)
            if response.status != 200:
                log.debug("peer %s answered its manifest with HTTP %d", peer.url, response.status)
                return None
            doc = json.loads(body)
            return doc if isinstance(doc, dict) else None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.debug("no manifest from peer %s: %s", peer.url, exc)
            return None
        finally:
            conn.close()

    def _update(self, peer: Peer, doc: dict[str, object], now: float) -> None:
        peer_id = doc.get("id")
        if not isinstance(peer_id, str):
            return
        peer.id, peer.seen_at = peer_id, now
        if peer_id == self.self_id:
            peer.excluded = "this sidecar itself"
            return
        phase = str(doc.get("phase", "unknown"))
        done = doc.get("bytes_done")
        done = done if isinstance(done, int) else 0
        if phase != peer.phase or done != peer.bytes_done:
            peer.progressed_at = now
        peer.phase, peer.bytes_done = phase, done
        files = doc.get("files")
        if not isinstance(files, list):
            return  # still starting: a member, with nothing to serve
        same = len(files) == len(self._infos) and all(
            isinstance(f, dict) and f.get("etag") == info.etag and f.get("size") == info.size
            for f, info in zip(files, self._infos, strict=False)
        )
        if not same:
            if peer.same_version is not False:
                log.info("ignoring peer %s: it holds another version of the model", peer.url)
            peer.same_version = False
            return
        peer.same_version = True
        try:
            ready = unbitmap(str(doc.get("ready", "")), self._tensors)
            crc = doc.get("crc32")
            if not isinstance(crc, list) or len(crc) != self._tensors:
                raise ValueError("a CRC list of the wrong length")
        except ValueError as exc:
            self._exclude(peer, f"a malformed manifest ({exc})")
            return
        peer.ready, peer.crc = ready, [int(c) for c in crc]

    # --- choosing ----------------------------------------------------------------------------------------

    def holders(self, tensor: int) -> list[Peer]:
        """Usable peers holding ``tensor`` READY, best first for this tensor (rendezvous weight)."""
        now = time.monotonic()
        with self._lock:
            found = [
                p
                for p in self._peers.values()
                if p.usable(now) and p.same_version and p.id and len(p.ready) > tensor and p.ready[tensor]
            ]
        return sorted(found, key=lambda p: rank(tensor, p.id or "", salt=self.salt), reverse=True)

    def owner(self, tensor: int) -> Peer | None:
        """The loading peer that reads ``tensor`` from the origin, or None when that is this sidecar.

        A member answers its manifest (within ``stall_timeout``: a killed or frozen peer stops counting) and
        makes progress: some chunk landed within ``PROGRESS_FACTOR`` stall timeouts (a chunk from a slow
        origin shared by many sidecars can take several seconds)."""
        now = time.monotonic()
        limit = self.settings.stall_timeout
        with self._lock:
            members = {
                p.id: p
                for p in self._peers.values()
                if p.id
                and p.usable(now)
                and p.phase in ("starting", "loading")
                and now - p.seen_at < limit
                and now - p.progressed_at < PROGRESS_FACTOR * limit
            }
        chosen = owner(tensor, [self.self_id, *members], salt=self.salt)
        return members.get(chosen or "")

    def wait(self, timeout: float) -> None:
        """Sleep until the next manifest poll (or ``timeout``)."""
        with self._changed:
            if not self._stop.is_set():
                self._changed.wait(timeout)

    def file(self, peer: Peer, index: int) -> _PeerFile:
        with self._lock:
            source = peer.files.get(index)
            if source is None:
                url = f"{peer.url}/peer/v1/files/{index}"
                source = peer.files[index] = _PeerFile(url, self.http, self._infos[index])
            return source

    def cool(self, peer: Peer, why: str) -> None:
        """Leave a peer alone for a while after a broken or stalled transfer."""
        pause = self.settings.stall_timeout
        log.info("peer %s failed a transfer (%s); trying others for %.0f s", peer.url, why, pause)
        with self._lock:
            peer.cool_until = time.monotonic() + self.settings.stall_timeout

    def exclude(self, peer_id: str, why: str) -> None:
        with self._lock:
            found = [p for p in self._peers.values() if p.id == peer_id]
        for peer in found:
            self._exclude(peer, why)

    def _exclude(self, peer: Peer, why: str) -> None:
        if peer.excluded is None:
            peer.excluded = why
            log.warning("excluding peer %s for the rest of this load: %s", peer.url, why)
            self.on_exclude(peer, why)

    def serving(self) -> int:
        """How many peers of the same version answered the last poll (for status)."""
        with self._lock:
            return sum(1 for p in self._peers.values() if p.same_version and p.excluded is None)


class PeerSource:
    """One weight file: its chunks from peers when they can serve them, from the origin otherwise."""

    def __init__(self, origin: Source, *, file: int, fleet: Fleet, ranges: RangeMap, ledger: Ledger) -> None:
        self.origin = origin
        self._file = file
        self._fleet = fleet
        self._ranges = ranges
        self._ledger = ledger

    @property
    def display_uri(self) -> str:
        return self.origin.display_uri

    @property
    def supports_fd(self) -> bool:
        return self.origin.supports_fd

    def stat(self) -> ObjectInfo:
        return self.origin.stat()

    def restat(self) -> ObjectInfo:
        """The origin's fresh look-up (the end-of-load check that the object did not change)."""
        restat = getattr(self.origin, "restat", None)
        return restat() if restat is not None else self.origin.stat()

    def read_bytes(self, offset: int, length: int) -> bytes:
        return self.origin.read_bytes(offset, length)

    def close(self) -> None:
        self.origin.close()

    def read_into(self, offset: int, buf: memoryview) -> None:
        self._read(offset, len(buf), lambda src, at, start, n: src.read_into(at, buf[start : start + n]))

    def read_into_fd(self, offset: int, length: int, fd: int, fd_offset: int) -> None:
        self._read(offset, length, lambda src, at, start, n: src.read_into_fd(at, n, fd, fd_offset + start))

    def _read(self, offset: int, length: int, land: Callable[[Source, int, int, int], None]) -> None:
        fleet, ledger = self._fleet, self._ledger
        span = None if fleet.stopped else self._ranges.span(self._file, offset, length)
        if span is None:
            self._from_origin(offset, 0, length, land)
            return
        tensor, done = span.tensor, 0
        busy_since: float | None = None
        while done < length:
            holders = fleet.holders(tensor)
            busy = False
            for peer in holders:
                got, outcome = self._from_peer(peer, offset, done, length, land)
                if got:
                    ledger.took(tensor, peer, got)
                    done += got
                if done >= length:
                    return
                busy = busy or outcome == "busy"
            if busy and not fleet.stopped:
                # Holders exist and are all busy: wait for one rather than read the origin again.
                busy_since = busy_since or time.monotonic()
                if time.monotonic() - busy_since < fleet.settings.stall_timeout:
                    time.sleep(_BUSY_PAUSE)
                    continue
            if holders and not busy:
                continue  # a holder failed: the next pass sees it cooled or excluded
            if fleet.stopped or fleet.owner(tensor) is None:
                self._from_origin(offset, done, length, land)
                return
            ledger.waited()
            fleet.wait(POLL)

    def _from_peer(
        self, peer: Peer, offset: int, done: int, length: int, land: Callable[[Source, int, int, int], None]
    ) -> tuple[int, str]:
        """Bytes landed from ``peer`` and how it went: ``ok``, ``busy``, ``failed``."""
        source = self._fleet.file(peer, self._file)
        try:
            land(source, offset + done, done, length - done)
        except InterruptedReadError as exc:
            if exc.retry_after is not None and exc.landed == 0:
                return 0, "busy"
            self._fleet.cool(peer, str(exc))
            return exc.landed, "failed"
        except SourceChangedError as exc:
            self._fleet.exclude(peer.id or "", f"another version ({exc})")
            return 0, "failed"
        except ModelloadError as exc:  # not READY there after all (404): the next poll will tell
            log.debug("peer %s could not serve a range: %s", peer.url, exc)
            self._fleet.cool(peer, "it could not serve a range it listed")
            return 0, "failed"
        return length - done, "ok"

    def _from_origin(
        self, offset: int, done: int, length: int, land: Callable[[Source, int, int, int], None]
    ) -> None:
        try:
            land(self.origin, offset + done, done, length - done)
        except InterruptedReadError as exc:
            self._ledger.origin(exc.landed)
            raise InterruptedReadError(
                str(exc), uri=exc.uri, landed=done + exc.landed, retry_after=exc.retry_after
            ) from exc
        self._ledger.origin(length - done)


class Ledger:
    """Counters of one sidecar's peer traffic, and which peers each tensor's bytes came from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.origin_bytes = 0
        self.peer_bytes = 0
        self.uploaded_bytes = 0
        self.mismatches = 0
        self.excluded = 0
        self.waits = 0
        self.claims: dict[int, dict[str, int]] = {}
        """tensor -> {peer id: the CRC-32 that peer listed for the tensor}"""

    def took(self, tensor: int, peer: Peer, nbytes: int) -> None:
        crc = peer.crc[tensor] if tensor < len(peer.crc) else -1
        with self._lock:
            self.peer_bytes += nbytes
            self.claims.setdefault(tensor, {})[peer.id or peer.url] = crc

    def origin(self, nbytes: int) -> None:
        with self._lock:
            self.origin_bytes += nbytes

    def uploaded(self, nbytes: int) -> None:
        with self._lock:
            self.uploaded_bytes += nbytes

    def waited(self) -> None:
        with self._lock:
            self.waits += 1

    def mismatched(self) -> None:
        """A tensor from peers failed verification."""
        with self._lock:
            self.mismatches += 1

    def excluded_peer(self) -> None:
        with self._lock:
            self.excluded += 1

    def claim(self, tensor: int) -> dict[str, int] | None:
        with self._lock:
            return self.claims.pop(tensor, None)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                "origin_bytes": self.origin_bytes,
                "peer_bytes": self.peer_bytes,
                "uploaded_bytes": self.uploaded_bytes,
                "mismatches": self.mismatches,
                "excluded_peers": self.excluded,
                "waits": self.waits,
            }
