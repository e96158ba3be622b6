"""Host memory that follows the consumer: memory modes ``full``, ``release`` and ``ring``.

A GPU server copies each tensor to the GPU and never reads the host copy again, yet in mode ``full`` the pod
keeps every page of the model in its memory-backed volume (charged to the pod) for its whole life. The two
other modes give pages back:

- ``release``: once every registered consumer has consumed a tensor (its copy is done: the loader records
  it in the consumer table beside the segment), the tensor is marked RELEASED and its pages are punched out
  of the tmpfs file. The volume still needs room for the whole model (a slow consumer lets it fill up), but
  it empties as the app copies.
- ``ring``: the segment's data region is a ring of ``ring_size`` bytes (layout version 4): the byte at
  manifest offset ``x`` lives at ``data_offset + (x - data_offset) mod ring_size``, and readers map the ring
  twice back to back so every tensor is still one view. Before landing a chunk the sidecar waits until the
  ring bytes it covers hold no tensor that is landed (or landing) and not yet released (:mod:`.ring`). The
  ring's pages are taken once, when the segment is created, and reused lap after lap: nothing is freed and
  allocated again per tensor, which is what made a sparse full-size ring slower than mode full. Once every
  tensor is released the ring is punched out, so the volume empties as in release mode.

Chunks are admitted strictly in load order. That makes the ring deadlock-free as long as every tensor fits
in it (checked when the load is planned): the oldest tensor still landing only waits for room that tensors
before it hold, and those are complete, so consumers can copy and release them. A consumer that never
releases (or no consumer at all) makes the load wait; ``/status`` and the metrics show the wait and which
consumer it waits for, and ``wait_timeout`` turns a wait that long into a failure naming them.

Peers (sidecars serving each other): a sidecar in mode ``full`` serves every READY tensor; in ``release`` and
``ring`` the engine turns peers off for the load (a ring reuses a tensor's bytes once it is copied), so peers
of a GPU fleet are the ``full``-mode sidecars.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from modelload.loader.errors import ConfigError, MemoryWaitError
from modelload.loader.segment import ALIGNMENT, MemoryMode, SegmentWriter, TensorState
from modelload.loader.segment.consumers import ConsumerEntry, ConsumerTable
from modelload.loader.segment.geometry import Ring
from modelload.loader.segment.layout import align
from modelload.loader.segment.release import Releaser, punch_hole, resident_bytes
from modelload.sidecar.memory.ring import RingSpace
from modelload.sidecar.memory.settings import MemorySettings
from modelload.sidecar.planner import Chunk, LoadPlan

__all__ = ["MemoryManager", "plan_memory"]

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.01
"""Seconds between reads of the consumer table."""
POLL_WAITING = 0.001
"""... while a reader waits for room in the ring: the load is stalled until the next release is seen."""
STATUS_INTERVAL = 1.0
"""Seconds between status reports while nothing changes (so a wait's duration shows as it grows)."""


def plan_memory(plan: LoadPlan, settings: MemorySettings) -> LoadPlan:
    """Mark ``plan``'s segment with the memory mode, and refuse a ring too small for a tensor."""
    if settings.mode == "full":
        return plan
    ring_size = 0
    if settings.mode == "ring":
        ring = Ring(plan.layout.data_offset, settings.ring_size)
        needs = ring.taken_each(*plan.footprints())  # a column: a model may have 100,000 tensors
        largest = int(needs.argmax()) if len(needs) else None  # the first of the largest
        if largest is not None and needs[largest] > settings.ring_size:
            need = int(needs[largest])
            name = plan.layout.slots[largest].name
            raise ConfigError(
                f"tensor {name!r} needs {need} bytes ({need / 2**20:.1f} MiB) in the ring, more than the "
                f"ring size of {settings.ring_size} bytes: set --ring-size (ModelLoad spec.memory.ringSize) "
                f"to at least {-(-need // 2**20)}MiB"
            )
        # A ring larger than the model's data would only hold pages nothing uses. Whole pages of the volume:
        # on huge pages the ring is mapped twice at page boundaries (segment/_ring.py).
        page = plan.layout.page_size
        ring_size = min(align(settings.ring_size, page), max(align(plan.layout.data_length, page), page))
    layout = replace(plan.layout, memory_mode=settings.layout_mode, ring_size=ring_size)
    return replace(plan, layout=layout)


class MemoryManager:
    """Releases consumed tensors and, in ring mode, admits chunks only into ring bytes that were released.

    One thread polls the consumer table; the readers call :meth:`admit` before landing each chunk. The ring's
    pages were all taken when the segment was created (so a full volume fails then, never as a SIGBUS
    later), and are reused rather than freed: in ring mode nothing is punched until every tensor is released.
    """

    def __init__(
        self,
        settings: MemorySettings,
        *,
        writer: SegmentWriter,
        plan: LoadPlan,
        stop: threading.Event,
        report: Callable[[dict[str, Any]], None] | None = None,
        hold: Callable[[], np.ndarray | None] | None = None,
    ) -> None:
        self.settings = settings
        self._hold = hold
        """Per tensor, whether it may be released yet (the load's digest check has hashed its bytes)."""
        self.plan = plan
        self._stop = stop
        self._report = report
        layout = plan.layout
        self._table = ConsumerTable.for_writer(writer.path, tensor_count=len(layout.slots))
        leads = plan.headers.tolist()
        self._ring = layout.ring_size if layout.memory_mode == MemoryMode.RING else 0
        self._releaser = Releaser(writer.fileno(), layout, leads=leads, punch=not self._ring)
        self._space = RingSpace(layout.ring or Ring(layout.data_offset, ALIGNMENT))
        self._cond = threading.Condition()
        self._next_grant = 0
        self._released = np.zeros(len(layout.slots), dtype=bool)
        self._released_bytes = 0
        self._waiting_since: float | None = None
        self._blocker: int | None = None
        """The tensor whose ring bytes the oldest waiting chunk needs (None: no wait, or a wait for order)."""
        self._wait_total = 0.0
        self._holders: list[dict[str, Any]] = []
        self._consumers: list[ConsumerEntry] = []
        self._seen: set[tuple[int, int]] = set()
        """Every registration seen, by (entry, time registered): the count ``consumers`` waits for."""
        self._last_report = 0.0
        self._resident = 0
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._poll, name="memory-manager", daemon=True)
        self._thread.start()

    # --- the readers' side ----------------------------------------------------------------------------------

    def admit(self, seq: int, chunk: Chunk) -> bool:
        """Wait until chunk number ``seq`` (in load order) fits in the ring; False when the load stops.

        Raises :class:`MemoryWaitError` when the wait outlasts ``wait_timeout``.
        """
        if not self._ring:
            return not self._stop.is_set()
        claims = self._claims(chunk)
        with self._cond:
            while seq != self._next_grant or self._holder(claims) is not None:
                if self._stop.is_set():
                    if seq == self._next_grant:
                        self._end_wait()  # nothing waits any more: /status and the metrics say so
                    return False
                if seq == self._next_grant:
                    self._blocker = self._holder(claims)
                    waited = self._start_wait()
                    limit = self.settings.wait_timeout
                    if limit is not None and waited > limit:
                        error = MemoryWaitError(
                            f"ring mode waited {waited:.0f} s for room to land tensor "
                            f"{self.plan.layout.slots[chunk.tensor].name!r}: {self._describe_holders()}"
                        )
                        self._end_wait()  # the load fails: it waits no more (the total keeps the wait)
                        raise error
                self._cond.wait(0.05)
            self._end_wait()
            for tensor, offset, length in claims:
                self._space.take(tensor, offset, length)
            self._next_grant += 1
            self._cond.notify_all()
        return True

    def _holder(self, claims: list[tuple[int, int, int]]) -> int | None:
        for _, offset, length in claims:
            holder = self._space.holder(offset, length)
            if holder is not None:
                return holder
        return None

    def _claims(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        """``(tensor, segment offset, length)`` of the bytes each piece of ``chunk`` takes in the ring: its
        own, and for the piece that lands a tensor's last data byte, the rest of the slot too (a meta
        tensor's zeros, which the engine writes)."""
        pieces = self.plan.pieces
        claims = []
        for at in chunk.pieces:
            tensor, offset = int(pieces.tensor[at]), int(pieces.dst[at])
            stop = offset + int(pieces.length[at])
            record = self.plan.record(tensor)
            if stop >= record.data_end:
                stop = max(stop, record.end)
            claims.append((tensor, offset, stop - offset))
        return claims

    def _start_wait(self) -> float:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        return now - self._waiting_since

    def _end_wait(self) -> None:
        self._blocker = None
        if self._waiting_since is not None:
            self._wait_total += time.monotonic() - self._waiting_since
            self._waiting_since = None

    # --- the release thread ---------------------------------------------------------------------------------

    def _poll(self) -> None:
        try:
            while not self._stop.is_set() and not self._released.all():
                changed = self._release_consumed()
                if changed and self._ring and self._released.all():  # the last lap is done: empty the ring
                    layout = self.plan.layout
                    punch_hole(self._releaser.fileno(), layout.data_offset, layout.ring_size)
                self._resident = resident_bytes(self._releaser.fileno())
                now = time.monotonic()
                if changed or now - self._last_report >= STATUS_INTERVAL:
                    self._last_report = now
                    if self._report is not None:
                        self._report(self.status())
                time.sleep(POLL_WAITING if self._waiting_since is not None else POLL_INTERVAL)
            self._resident = resident_bytes(self._releaser.fileno())
            if self._report is not None:
                self._report(self.status())
        except BaseException as exc:  # a failed punch: the readers see it through the stop event
            log.error("memory manager failed: %s", exc)
            self._failure = exc
            self._stop.set()
        finally:
            self._releaser.close()
            self._table.close()

    def _release_consumed(self) -> bool:
        now_ns = time.time_ns()
        entries = self._table.entries()
        self._seen.update((e.slot, e.registered_ns) for e in entries)
        live = [e for e in entries if e.active and e.age(now_ns) <= self.settings.expiry]
        self._consumers = live
        states = self._releaser.states
        ready = states == TensorState.READY
        if len(self._seen) < self.settings.consumers:
            self._holders = []
            return False
        # Consumers that left or whose heartbeat expired need nothing more: only the live ones hold tensors.
        count = len(self._released)
        consumed = np.ones(count, dtype=bool)
        for entry in live:
            bits = np.unpackbits(self._table.consumed_bits(entry.slot), bitorder="little", count=count)
            consumed &= bits.astype(bool)
        releasable = consumed & ready & ~self._released
        held = self._hold() if self._hold is not None else None
        if held is not None:
            releasable &= held
        todo = np.flatnonzero(releasable)
        for index in todo:
            punched = self._releaser.release(int(index))
            self._released_bytes += punched if not self._ring else int(self.plan.layout.table.nbytes[index])
            self._released[index] = True
        # Who holds the tensor whose bytes the ring waits for (else the oldest one held): what /status shows.
        held = np.flatnonzero(ready & ~self._released & ~consumed)
        blocker = self._blocker
        if blocker is not None and not self._released[blocker]:
            self._holders = self._who_holds(blocker, live) if ready[blocker] else []
        else:
            self._holders = self._who_holds(int(held[0]), live) if len(held) else []
        if self._ring and len(todo):
            with self._cond:  # RELEASED is stored: the bytes may now take newer tensors
                for index in todo:
                    self._space.free(int(index))
                self._cond.notify_all()
        return bool(len(todo))

    def _who_holds(self, index: int, live: list[ConsumerEntry]) -> list[dict[str, Any]]:
        holders = []
        for entry in live:
            bits = self._table.consumed_bits(entry.slot)
            if not bits[index // 8] & (1 << (index % 8)):
                holders.append(
                    {
                        "consumer": entry.label,
                        "pid": entry.pid,
                        "tensor": self.plan.layout.slots[index].name,
                        "consumed": entry.consumed,
                        "heartbeat_age_s": round(entry.age(), 1),
                    }
                )
        return holders

    def _describe_holders(self) -> str:
        if len(self._seen) < self.settings.consumers:
            return (
                f"{len(self._seen)} consumer(s) attached, {self.settings.consumers} needed before "
                "anything is released: is the app running and attached (modelload.loader.attach())?"
            )
        if not self._holders:
            blocker = self._blocker
            if blocker is not None:
                name = self.plan.layout.slots[blocker].name
                return f"tensor {name!r}, whose ring bytes it needs, is still landing"
            return "tensors landed are not yet ready"
        who = ", ".join(
            f"{h['consumer']} (pid {h['pid']}) has not consumed {h['tensor']!r}" for h in self._holders
        )
        return f"{who}; the app must copy tensors and mark them consumed (Model.consumed)"

    # --- reporting ------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The memory section of ``/status``."""
        with self._cond:
            waiting = self._waiting_since is not None
            waited = time.monotonic() - self._waiting_since if self._waiting_since is not None else 0.0
            used = self._space.used
        return {
            "mode": self.settings.mode,
            "ring_size": self._ring or None,
            "ring_used_bytes": used if self._ring else None,
            "resident_bytes": self._resident,
            "released_tensors": int(self._released.sum()),
            "released_bytes": self._released_bytes,
            "consumers": [
                {
                    "consumer": e.label,
                    "pid": e.pid,
                    "consumed": e.consumed,
                    "heartbeat_age_s": round(e.age(), 1),
                }
                for e in self._consumers
            ],
            "waiting": waiting,
            "waiting_s": round(waited, 3),
            "wait_seconds_total": round(self._wait_total + waited, 3),
            "waiting_for": self._describe_holders() if waiting else None,
        }

    def failure(self) -> BaseException | None:
        return self._failure
