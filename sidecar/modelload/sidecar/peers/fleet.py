"""The peers of one load: who they are, what each holds, and how much each may cost this load.

:class:`Fleet` finds the peers (a static list of URLs, and/or a DNS name that resolves to every pod of the
ModelLoad: a headless Service with ``publishNotReadyAddresses``, so loading pods count) and polls each one's
manifest while this sidecar loads, each peer on its own schedule so a slow one delays nobody's news. It keeps
only peers that prove the token and hold the same version of every weight file (same ETag and size as the
origin told this sidecar); a peer of another version is ignored.

**What a peer may cost.** A peer is trusted with no more than a bounded wait, per peer and in total:

- a peer whose answer is wrong in any way (no proof, bytes unlike its digest or its checksum, a malformed or
  oversized manifest, a redirect, another ETag, a short answer) is dropped for the rest of the load at once;
- one that stalls a transfer (``stall_timeout`` without a byte) or sends under the rate floor is dropped
  when that transfer gives up, unless its other transfers delivered at the floor's rate meanwhile: one stream
  of an honest peer whose link is congested can sit seconds in TCP's retransmission backoff, and its chunk
  is then simply asked again on a fresh connection;
- one that errs (a reset, a 5xx, a 404 for what it listed) is left alone for a while, and dropped at its
  third failure;
- one that answers busy (429) for longer than ``stall_timeout`` without serving anything is dropped;
- an owner this sidecar waits on that completes no tensor for ``stall_timeout`` (plus the time an honest
  owner takes to read the awaited tensor, at this sidecar's own origin rate) after most of the fleet did
  (a squatter whose progress grows but who never holds anything) stops being waited on: its tensors go to
  the next owner, possibly this sidecar. A member that answers no manifest for ``stall_timeout`` (killed,
  frozen) stops counting sooner.

And in total: once the peers dropped or given up on have cost this load ``wait_budget`` seconds, it waits
on no busy holder and no owner that lags the fleet any more, and asks only peers whose tensors already
passed its check; the rest comes from the origin.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from modelload.loader.errors import PeerAnswerError
from modelload.loader.peerwire import PeerKey
from modelload.sidecar.peers.client import NotListening, PeerFile, get_document
from modelload.sidecar.peers.manifest import Manifest, manifest_limit, parse_manifest
from modelload.sidecar.peers.ranges import owner, rank
from modelload.sidecar.peers.server import MANIFEST_PATH
from modelload.sidecar.peers.settings import PeerSettings
from modelload.sidecar.sources import HttpSettings, ObjectInfo

__all__ = ["Fleet", "Peer"]

log = logging.getLogger(__name__)

POLL = 0.2
"""Seconds between manifest polls of a peer while loading: how soon a tensor a peer finished is seen here."""
MANIFEST_TIMEOUT = 1.0
"""Seconds a peer has to send its whole manifest."""
STRIKES = 3
"""Failed transfers (resets, errors) after which a peer is dropped for the load."""
RETRIES = 16
"""Transfers that broke or stalled while the peer delivered others, after which it is dropped all the same
(a peer that serves some askers to keep its place and holds the others)."""
MIN_PEER_RATE = 64 * 1024
"""Bytes per second a transfer from a peer must keep up, over ``stall_timeout`` windows: low, since a holder's
uplink is shared by every asker (a holder on a 40 Mbit/s link serving 8 readers gives each about 600 KiB/s),
yet far above a peer that trickles to keep its askers."""


@dataclass
class Peer:
    """What this sidecar knows of one peer address, from its last manifest and its transfers."""

    url: str
    id: str | None = None
    phase: str = "unknown"
    ready: tuple[bool, ...] = ()
    crc: tuple[int, ...] = ()
    ready_count: int = 0
    seen_at: float = field(default_factory=time.monotonic)
    answered: bool = False
    """It answered once, well or not: it is up (the start's settle waits for the others)."""
    same_version: bool | None = None
    excluded: str | None = None
    demoted: str | None = None
    """Why it is no longer waited on as an owner (it may still serve what it holds)."""
    cool_until: float = 0.0
    strikes: int = 0
    retries: int = 0
    verified: bool = False
    """A tensor it served this sidecar matched the CRC-32 it listed: still asked once the wait budget is
    spent."""
    busy_since: float | None = None
    passed_by: set[str] = field(default_factory=set)
    """Members (this sidecar as ``""``) that completed a tensor since this peer last did."""
    behind_since: float | None = None
    """When most of the other members had completed a tensor since this peer last did."""
    polling: bool = False
    delivered: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    """(when, bytes) of the transfers it completed lately, proven."""
    files: dict[int, PeerFile] = field(default_factory=dict)

    def usable(self, now: float) -> bool:
        return self.excluded is None and self.same_version is not False and now >= self.cool_until


class Fleet:
    """The peers of one load, refreshed in the background while the load runs."""

    def __init__(self, settings: PeerSettings, *, self_id: str, key: PeerKey) -> None:
        self.settings = settings
        self.self_id = self_id
        self.key = key
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._peers: dict[str, Peer] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pollers = ThreadPoolExecutor(max_workers=16, thread_name_prefix="modelload-peer-poll")
        self._infos: Sequence[ObjectInfo] = ()
        self._tensors = 0
        self.salt = ""
        self.wasted = 0.0
        """Seconds of waiting that peers which were then dropped or given up on cost this load."""
        self.http = HttpSettings(
            connect_timeout=min(2.0, settings.stall_timeout),
            stall_timeout=settings.stall_timeout,
            min_rate=MIN_PEER_RATE,
            slow_window=settings.stall_timeout,
            max_redirects=0,
        )
        self.on_exclude: Callable[[Peer, str], None] = lambda peer, why: None

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self, *, infos: Sequence[ObjectInfo], tensors: int, salt: str) -> None:
        """Learn the peers before the first chunk: poll until every address answered once (or refused to
        prove itself, or timed out) or ``settle`` passed. An address where nothing listens yet is a member
        still starting: that is what the settle waits for."""
        self._infos, self._tensors, self.salt = tuple(infos), tensors, salt
        deadline = time.monotonic() + self.settings.settle
        while True:
            self._poll_all(wait=True)
            with self._lock:
                pending = [p for p in self._peers.values() if not p.answered]
            if not pending or time.monotonic() >= deadline:
                break
            self._stop.wait(POLL)
        self._thread = threading.Thread(target=self._poll, name="modelload-peer-poll", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and wake every waiter (the load ended, or the sidecar stops)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        self._pollers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            files = [f for peer in self._peers.values() for f in peer.files.values()]
        for file in files:
            file.close()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def spent(self) -> bool:
        """Whether peers already cost this load its whole wait budget."""
        return self.wasted >= self.settings.wait_budget

    def _poll(self) -> None:
        while not self._stop.wait(POLL):
            try:
                self._poll_all(wait=False)
            except RuntimeError:  # the pollers were shut down: the load ended
                return

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

    def _poll_all(self, *, wait: bool) -> None:
        """Ask every peer still of interest for its manifest, each at most once at a time."""
        urls = self.addresses()
        with self._lock:
            for url in urls:
                self._peers.setdefault(url, Peer(url))
            due = [
                p
                for p in self._peers.values()
                if p.excluded is None and not p.polling and (p.phase != "complete" or p.id is None)
            ]
            for peer in due:
                peer.polling = True
        futures = [self._pollers.submit(self._refresh, peer) for peer in due]
        if wait:
            for future in futures:
                future.result()

    def _refresh(self, peer: Peer) -> None:
        limit = manifest_limit(files=len(self._infos), tensors=self._tensors)
        try:
            body = get_document(peer.url, MANIFEST_PATH, self.key, max_bytes=limit, timeout=MANIFEST_TIMEOUT)
            manifest = parse_manifest(body, infos=self._infos, tensors=self._tensors)
        except NotListening as exc:
            log.debug("peer %s is not listening (yet): %s", peer.url, exc)
            self._done_polling(peer)
        except (PeerAnswerError, ValueError) as exc:
            self._unusable(peer, str(exc))
        except OSError as exc:  # a timeout, a reset, another status: try again at the next poll
            log.debug("no manifest from peer %s: %s", peer.url, exc)
            self._done_polling(peer, answered=isinstance(exc, TimeoutError))
        except Exception as exc:  # anything else a hostile answer provokes: the peer's fault, not the load's
            self._unusable(peer, f"it broke the client ({type(exc).__name__})")
        else:
            with self._changed:
                peer.polling, peer.answered = False, True
                self._update(peer, manifest, time.monotonic())
                self._changed.notify_all()

    def _unusable(self, peer: Peer, why: str) -> None:
        with self._changed:
            peer.polling, peer.answered = False, True
            self._exclude(peer, f"its manifest cannot be used: {why}")
            self._changed.notify_all()

    def _done_polling(self, peer: Peer, *, answered: bool = False) -> None:
        with self._lock:
            peer.polling = False
            peer.answered = peer.answered or answered

    def _update(self, peer: Peer, manifest: Manifest, now: float) -> None:
        if peer.id is not None and manifest.id != peer.id:  # restarted at the same address: a new load
            log.info("peer %s restarted (id %s, was %s)", peer.url, manifest.id, peer.id)
            peer.ready, peer.crc, peer.ready_count, peer.strikes = (), (), 0, 0
            peer.demoted, peer.behind_since, peer.same_version = None, None, None
            peer.passed_by.clear()
        peer.id, peer.seen_at, peer.phase = manifest.id, now, manifest.phase
        if manifest.id == self.self_id:
            peer.excluded = "this sidecar itself"
            return
        if not manifest.planned:
            return  # still starting: a member, with nothing to serve
        same = [(info.etag, info.size) for info in self._infos] == list(manifest.files)
        if not same:
            if peer.same_version is not False:
                log.info("ignoring peer %s: it holds another version of the model", peer.url)
            peer.same_version = False
            return
        peer.same_version = True
        count = sum(manifest.ready)
        if count < peer.ready_count:
            self._exclude(peer, "its manifest took back tensors it listed as held")
            return
        peer.ready, peer.crc = manifest.ready, manifest.crc32
        if count > peer.ready_count:
            peer.ready_count = count
            self._progressed(peer, now)

    def progressed(self) -> None:
        """This sidecar completed a tensor: the fleet moved on (see :meth:`waiting_on`)."""
        with self._lock:
            self._progressed(None, time.monotonic())

    def _progressed(self, mover: Peer | None, now: float) -> None:
        """``mover`` (None: this sidecar) completed a tensor: every other peer is that much behind, and once
        most members passed one (this sidecar counted), its lag starts to count (:meth:`waiting_on`)."""
        members = [p for p in self._peers.values() if p.id and p.excluded is None]
        quorum = (len(members) + 1) // 2  # of the others: the members but the one behind, and this sidecar
        name = "" if mover is None else mover.url
        for peer in members:
            if peer is mover:
                peer.passed_by.clear()
                peer.behind_since = None
                continue
            peer.passed_by.add(name)
            if peer.behind_since is None and len(peer.passed_by) >= max(quorum, 1):
                peer.behind_since = now

    # --- choosing ----------------------------------------------------------------------------------------

    def holders(self, tensor: int) -> list[Peer]:
        """Usable peers holding ``tensor`` READY, best first for this tensor (rendezvous weight); once the
        wait budget is spent, only verified peers."""
        now = time.monotonic()
        spent = self.spent
        with self._lock:
            found = [
                p
                for p in self._peers.values()
                if p.usable(now)
                and p.same_version
                and p.id
                and len(p.ready) > tensor
                and p.ready[tensor]
                and (p.verified or not spent)
            ]
        return sorted(found, key=lambda p: rank(tensor, p.id or "", salt=self.salt), reverse=True)

    def checked(self, verdicts: dict[str, bool]) -> None:
        """A tensor was checked whole: each peer (by URL) that sent bytes of it passed or is dropped."""
        with self._lock:
            for url, good in verdicts.items():
                peer = self._peers.get(url)
                if peer is None:
                    continue
                if good:
                    peer.verified = True
                else:
                    self._exclude(peer, "its bytes failed verification")

    def owner(self, tensor: int) -> Peer | None:
        """The loading peer that reads ``tensor`` from the origin, or None when that is this sidecar.

        A member answers its manifest (within ``stall_timeout``: a killed or frozen peer stops counting) and
        was not given up on as an owner (:meth:`waiting_on`). Once the wait budget is spent, only members
        that keep pace with the fleet (none behind it) are waited on."""
        now = time.monotonic()
        limit = self.settings.stall_timeout
        spent = self.spent
        with self._lock:
            members = {
                p.id: p
                for p in self._peers.values()
                if p.id
                and p.usable(now)
                and p.demoted is None
                and p.phase in ("starting", "loading")
                and now - p.seen_at < limit
                and not (spent and p.behind_since is not None)
            }
        chosen = owner(tensor, [self.self_id, *members], salt=self.salt)
        return members.get(chosen or "")

    def waiting_on(self, peer: Peer, *, expected: float) -> None:
        """A reader waits for ``peer`` to hold a tensor it owns, which an honest owner reads in about
        ``expected`` seconds. Give up on it as an owner once it completed nothing for ``stall_timeout`` plus
        that, counted from when most of the other members (this sidecar included) completed a tensor since
        it last did: a slow origin delays every owner alike, a squatter only itself, and a majority keeps one
        fast member from making every other one look late."""
        with self._lock:
            behind = peer.behind_since
            if peer.demoted is not None or behind is None:
                return
            waited = time.monotonic() - behind
            if waited <= self.settings.stall_timeout + expected:
                return
            peer.demoted = f"it completed no tensor in {waited:.1f} s while the rest of the fleet did"
            self._charge(waited)
        log.warning("no longer waiting on peer %s as an owner: %s", peer.url, peer.demoted)

    def wait(self, timeout: float) -> None:
        """Sleep until the next manifest poll (or ``timeout``)."""
        with self._changed:
            if not self._stop.is_set():
                self._changed.wait(timeout)

    def file(self, peer: Peer, index: int) -> PeerFile:
        with self._lock:
            source = peer.files.get(index)
            if source is None:
                source = PeerFile(peer.url, index, self.http, self._infos[index], self.key)
                peer.files[index] = source
            return source

    # --- how a peer did ----------------------------------------------------------------------------------

    def served(self, peer: Peer, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            peer.strikes, peer.busy_since = 0, None
            peer.delivered.append((now, nbytes))
            while peer.delivered and peer.delivered[0][0] < now - self.http.slow_window:
                peer.delivered.popleft()

    def moving(self, peer: Peer) -> bool:
        """Whether a transfer of ``peer`` that broke or stalled may be asked again of it at once: it completed
        others at the rate floor over the last rate window (one congested or broken stream, not a peer that
        keeps its askers), and has not had :data:`RETRIES` of those this load."""
        window = self.http.slow_window
        since = time.monotonic() - window
        with self._lock:
            recent = sum(n for at, n in peer.delivered if at >= since)
            if recent < MIN_PEER_RATE * window or peer.excluded is not None:
                return False
            peer.retries += 1
            if peer.retries > RETRIES:
                self._exclude(peer, f"{peer.retries} transfers broke or stalled while it served others")
                return False
            return True

    def busy(self, peer: Peer) -> None:
        """``peer`` answered 429: drop it once it has done nothing else for ``stall_timeout``."""
        now = time.monotonic()
        with self._lock:
            if peer.busy_since is None:
                peer.busy_since = now
                return
            waited = now - peer.busy_since
            if waited > self.settings.stall_timeout and peer.excluded is None:
                self._charge(waited)
                self._exclude(peer, f"it answered only busy (429) for {waited:.1f} s")

    def failed(self, peer: Peer, why: str) -> None:
        """A transfer from ``peer`` failed in a way an honest peer's can (a reset, an error status)."""
        with self._lock:
            peer.strikes += 1
            if peer.strikes >= STRIKES:
                self._exclude(peer, f"{peer.strikes} failed transfers, the last: {why}")
                return
            peer.cool_until = time.monotonic() + self.settings.stall_timeout
        log.info("peer %s failed a transfer (%s); trying others for a while", peer.url, why)

    def drop(self, peer: Peer, why: str, *, cost: float = 0.0) -> None:
        """``peer`` lied, or kept a transfer waiting ``cost`` seconds for nothing: drop it for the load."""
        with self._lock:
            if peer.excluded is None:
                self._charge(cost)
                self._exclude(peer, why)

    def exclude_url(self, url: str, why: str) -> None:
        with self._lock:
            peer = self._peers.get(url)
            if peer is not None:
                self._exclude(peer, why)

    def _charge(self, seconds: float) -> None:
        was_spent = self.spent
        self.wasted += seconds
        if self.spent and not was_spent:
            log.warning(
                "peers have cost this load %.1f s of waiting (--peer-wait-budget %g s): from now on it waits"
                " on no busy peer and no owner that lags, and asks only peers whose tensors passed",
                self.wasted, self.settings.wait_budget,
            )  # fmt: skip

    def _exclude(self, peer: Peer, why: str) -> None:
        """Drop ``peer`` for the rest of the load (call with the lock held)."""
        if peer.excluded is None:
            peer.excluded = why
            log.warning("excluding peer %s for the rest of this load: %s", peer.url, why)
            self.on_exclude(peer, why)

    def serving(self) -> int:
        """How many peers of the same version answered the last poll (for status)."""
        with self._lock:
            return sum(1 for p in self._peers.values() if p.same_version and p.excluded is None)
