"""Taking chunks from peers: a source that asks them first, and the ledger of what came from where.

:class:`PeerSource` wraps the origin source of one weight file. For a chunk of tensor T it asks, in order:

1. the peers that hold T READY, ranked by rendezvous weight for T (so askers spread over holders, and one
   holder is not asked by everyone); a busy peer (429) or a failing one passes the chunk to the next. A
   chunk from a peer counts only whole and proven (:class:`~modelload.sidecar.peers.client.PeerFile`): a
   transfer that breaks leaves nothing usable, and the chunk is asked again elsewhere;
2. when nobody holds T: T's owner among the members still loading (this sidecar included, rendezvous
   hashing); the owner reads T from the origin, the others wait for it to hold T and take it from there.
   This is the single-flight: sidecars that start together read each tensor from the origin once.

How long any of that may wait is the fleet's to bound (:mod:`.fleet`): per peer, and in total. Every tensor
taken from a peer is checked again, whole, before it is published (:meth:`Peers.finish`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from modelload.loader.errors import (
    ModelloadError,
    PeerAnswerError,
    SegmentSpaceError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)
from modelload.sidecar.peers.fleet import POLL, Fleet, Peer
from modelload.sidecar.peers.ranges import RangeMap
from modelload.sidecar.sources import InterruptedReadError, ObjectInfo, Source

__all__ = ["Ledger", "PeerSource"]

log = logging.getLogger(__name__)

_BUSY_PAUSE = 0.02
_MIN_RATE = 1 << 20
"""The origin rate assumed before this sidecar has read anything from it (bytes per second)."""

Land = Callable[[Source, int, int, int], None]
"""Land ``length`` bytes at ``offset`` of a source into the caller's buffer at ``start``: (source, offset,
start, length)."""


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

    def _read(self, offset: int, length: int, land: Land) -> None:
        fleet = self._fleet
        span = None if fleet.stopped else self._ranges.span(self._file, offset, length)
        if span is not None and self._from_peers(span.tensor, offset, length, land):
            return
        self._from_origin(offset, length, land)

    def _from_peers(self, tensor: int, offset: int, length: int, land: Land) -> bool:
        """Land the chunk from a peer, waiting for holders or an owner as long as the fleet allows; False
        when it must come from the origin."""
        fleet = self._fleet
        while not fleet.stopped:
            holders = fleet.holders(tensor)
            busy = False
            for peer in holders:
                outcome = self._from_peer(peer, tensor, offset, length, land)
                if outcome == "ok":
                    return True
                busy = busy or outcome == "busy"
            if busy:
                if fleet.spent:
                    return False
                time.sleep(_BUSY_PAUSE)  # holders exist and are all busy: wait for one, not the origin
                continue
            if holders:
                continue  # each failed, and is now cooled or dropped: the next pass sees the others
            owner = fleet.owner(tensor)
            if owner is None:
                return False
            fleet.waiting_on(owner, expected=self._ranges.plan.record(tensor).nbytes / self._ledger.rate())
            self._ledger.waited()
            fleet.wait(POLL)
        return False

    def _from_peer(self, peer: Peer, tensor: int, offset: int, length: int, land: Land) -> str:
        """Land the whole chunk from ``peer``: ``ok``, ``busy`` (429), ``retry`` (a congested stream of a peer
        that delivers) or ``failed`` (told to the fleet)."""
        fleet = self._fleet
        source = fleet.file(peer, self._file)
        started = time.monotonic()
        try:
            land(source, offset, 0, length)
        except InterruptedReadError as exc:
            if exc.retry_after is not None and exc.landed == 0:
                fleet.busy(peer)
                return "busy"
            if fleet.moving(peer):
                return "retry"  # one broken or congested stream of a peer that delivers: ask again, afresh
            if isinstance(exc.__cause__, TimeoutError):  # silent, or under the rate floor
                fleet.drop(peer, f"a transfer stalled or crawled ({exc})", cost=time.monotonic() - started)
            else:
                fleet.failed(peer, str(exc))
            return "failed"
        except SourceNotFoundError as exc:  # not READY there after all (404)
            fleet.failed(peer, f"it could not serve a range it listed ({exc})")
            return "failed"
        except (PeerAnswerError, SourceChangedError, SourceAccessDeniedError, SourceError) as exc:
            fleet.drop(peer, str(exc))
            return "failed"
        except SegmentSpaceError:
            raise  # no room for the chunk: the origin would meet the same, and the load must say so
        except ModelloadError as exc:
            fleet.drop(peer, f"an unusable answer ({exc})")
            return "failed"
        except Exception as exc:  # anything else a hostile answer provokes: the peer's fault, not the load's
            fleet.drop(peer, f"an answer that broke the client ({type(exc).__name__})")
            return "failed"
        fleet.served(peer, length)
        self._ledger.took(tensor, peer, length)
        return "ok"

    def _from_origin(self, offset: int, length: int, land: Land) -> None:
        started = time.monotonic()
        try:
            land(self.origin, offset, 0, length)
        except InterruptedReadError as exc:
            self._ledger.origin(exc.landed, since=started)
            raise
        self._ledger.origin(length, since=started)


class Ledger:
    """Counters of one sidecar's peer traffic, and which peers each tensor's bytes came from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.origin_bytes = 0
        self._origin_span: tuple[float, float] | None = None
        self.peer_bytes = 0
        self.uploaded_bytes = 0
        self.mismatches = 0
        self.excluded = 0
        self.waits = 0
        self.claims: dict[int, dict[str, int]] = {}
        """tensor -> {peer URL: the CRC-32 that peer listed for the tensor}"""

    def took(self, tensor: int, peer: Peer, nbytes: int) -> None:
        crc = peer.crc[tensor] if tensor < len(peer.crc) else -1
        with self._lock:
            self.peer_bytes += nbytes
            self.claims.setdefault(tensor, {})[peer.url] = crc

    def origin(self, nbytes: int, *, since: float | None = None) -> None:
        """``nbytes`` read from the origin, by a read that started at ``since`` (monotonic) and ends now."""
        with self._lock:
            self.origin_bytes += nbytes
            if since is not None:
                first, _ = self._origin_span or (since, since)
                self._origin_span = (min(first, since), time.monotonic())

    def rate(self) -> float:
        """This sidecar's origin rate so far, all readers together, bytes per second: how fast an owner
        reads one tensor (a floor before the first read)."""
        with self._lock:
            if self._origin_span is None or self._origin_span[1] <= self._origin_span[0]:
                return _MIN_RATE
            first, last = self._origin_span
            return max(self.origin_bytes / (last - first), 64 * 1024)

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
