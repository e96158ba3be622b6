"""What the engine tells the rest of the sidecar while it loads: events as they happen, and a status snapshot.

The engine (``modelload.sidecar.load.engine``) calls a :class:`LoadObserver` from its threads; the status API,
the Prometheus metrics and the pyzmq notifications are observers. :class:`LoadTracker` is the observer that
keeps the running totals and answers :meth:`LoadTracker.snapshot` for ``/status``, ``/startupz`` and
``/readyz``. Observers must be quick and must not raise: they run on the readers' hot path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

__all__ = ["LoadObserver", "LoadPhase", "LoadStatus", "LoadTracker", "Observers"]

log = logging.getLogger(__name__)

LoadPhase = Literal["starting", "loading", "complete", "failed", "stopped"]


class LoadObserver(Protocol):
    """Callbacks from the engine. Every method has a default no-op in :class:`Observers`'s fan-out."""

    def load_started(self, *, source: str, segment: str) -> None:
        """The engine starts: nothing is known of the model yet."""

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        """The segment's header and manifest are in place: an app can attach now (the startup probe)."""

    def bytes_loaded(self, count: int) -> None:
        """``count`` more bytes of tensor data landed in the segment."""

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        """Tensor ``index`` is published READY in the segment."""

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        """Tensors ``indices`` (with their ``names`` and ``nbytes``) are published READY together: the
        tensors of one landed range. An observer without this event gets :meth:`tensor_ready` for each."""

    def retried(self, *, kind: str, message: str) -> None:
        """A range request failed transiently and is retried (``kind``: reset, timeout, 5xx, throttled...)."""

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        """Every tensor is READY and the segment is COMPLETE."""

    def load_failed(self, *, kind: str, reason: str) -> None:
        """The load gave up; the segment is marked FAILED with ``reason`` (never holding credentials)."""

    def memory_changed(self, status: dict[str, Any]) -> None:
        """Release or ring mode: resident and released bytes, and what a waiting ring waits for, changed."""

    def file_proof(self, *, file: str, proof: str, state: str) -> None:
        """What proves weight file ``file``'s bytes (``proof``: the store's checksum, samples...), and how far
        it got (``state``: pending, proven, sampled, pinned, failed)."""


EVENTS = frozenset(name for name in vars(LoadObserver) if not name.startswith("_"))
"""The events an observer can receive: :class:`Observers` refuses any other name, so a misspelled event
is an error where it is written instead of a call that silently reaches nobody."""


@dataclass(frozen=True)
class LoadStatus:
    """A consistent snapshot of a load, as ``/status`` reports it (times are Unix seconds)."""

    phase: LoadPhase
    source: str
    segment: str
    format: str | None = None
    tensors_total: int = 0
    tensors_ready: int = 0
    bytes_total: int = 0
    bytes_done: int = 0
    started_at: float | None = None
    manifest_at: float | None = None
    first_tensor_at: float | None = None
    finished_at: float | None = None
    retries: int = 0
    recent_throughput: float | None = None
    """Bytes per second over the last :data:`RATE_WINDOW` seconds of loading; None before it can be told."""
    errors: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    notify: str | None = None
    memory: dict[str, Any] | None = None
    """Memory modes release and ring: what is held, released, and what the load waits for (memory.py)."""
    proofs: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per weight file: what proves its bytes (``proof``) and how far it got (``state``)."""

    @property
    def published(self) -> bool:
        """The manifest is in the segment (the startup check passes)."""
        return self.manifest_at is not None

    @property
    def ready(self) -> bool:
        return self.phase == "complete"

    @property
    def elapsed(self) -> float:
        if self.started_at is None:
            return 0.0
        end = self.finished_at if self.finished_at is not None else time.time()
        return max(end - self.started_at, 0.0)

    @property
    def throughput(self) -> float:
        """Bytes per second since the load started."""
        return self.bytes_done / self.elapsed if self.elapsed else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the recent throughput; None when unknown (nothing landed lately: a slow or stuck
        range), 0 when done. The average since the start would promise "under a second" while the last
        range trickles in for minutes."""
        if self.phase == "complete":
            return 0.0
        if not self.recent_throughput or not self.bytes_total:
            return None
        return (self.bytes_total - self.bytes_done) / self.recent_throughput

    def as_dict(self) -> dict[str, object]:
        return {
            "state": self.phase,
            "phase": self.phase,
            "source": self.source,
            "segment": self.segment,
            "format": self.format,
            "tensors_total": self.tensors_total,
            "tensors_ready": self.tensors_ready,
            "bytes_total": self.bytes_total,
            "bytes_done": self.bytes_done,
            "throughput_bytes_per_s": self.throughput,
            "recent_throughput_bytes_per_s": self.recent_throughput,
            "started_at": self.started_at,
            "manifest_at": self.manifest_at,
            "first_tensor_at": self.first_tensor_at,
            "finished_at": self.finished_at,
            "elapsed_s": self.elapsed,
            "eta_s": self.eta,
            "retries": self.retries,
            "errors": dict(self.errors),
            "error": self.error,
            "notify": self.notify,
            "memory": self.memory,
            "proofs": {file: dict(entry) for file, entry in self.proofs.items()},
        }


RATE_WINDOW = 20.0
"""Seconds of recent progress the ETA is computed from."""


class LoadTracker:
    """The observer that keeps totals; thread-safe; :meth:`snapshot` for the API.

    ``clock`` (monotonic seconds) times the recent-throughput window; tests pass their own.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._landed: deque[tuple[float, int]] = deque()
        """(time, bytes so far) after each landing, the oldest at most RATE_WINDOW old (plus one before)."""
        self._loading_since: float | None = None
        self._lock = threading.Lock()
        self._status = LoadStatus(phase="starting", source="", segment="")
        self._bytes = 0
        self._ready = 0
        self._retries = 0
        self._errors: Counter[str] = Counter()

    def snapshot(self) -> LoadStatus:
        with self._lock:
            return _replace(
                self._status,
                recent_throughput=self._recent_rate(),
                bytes_done=self._bytes,
                tensors_ready=self._ready,
                retries=self._retries,
                errors=dict(self._errors),
            )

    def load_started(self, *, source: str, segment: str) -> None:
        with self._lock:
            self._status = LoadStatus(
                phase="starting", source=source, segment=segment, started_at=time.time()
            )

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        with self._lock:
            self._status = _replace(
                self._status,
                phase="loading",
                format=model_format,
                tensors_total=tensors,
                bytes_total=nbytes,
                manifest_at=time.time(),
                notify=notify,
            )
            self._loading_since = self._clock()

    def bytes_loaded(self, count: int) -> None:
        now = self._clock()
        with self._lock:
            self._bytes += count
            self._landed.append((now, self._bytes))
            while len(self._landed) > 1 and self._landed[1][0] <= now - RATE_WINDOW:
                self._landed.popleft()

    def _recent_rate(self) -> float | None:
        """Bytes per second over the last RATE_WINDOW seconds (or since loading began, when sooner)."""
        if self._loading_since is None:
            return None
        now = self._clock()
        start = max(now - RATE_WINDOW, self._loading_since)
        if now - start <= 0:
            return None
        before = 0
        for when, total in self._landed:  # the total as the window opened: the last landing before it
            if when > start:
                break
            before = total
        return (self._bytes - before) / (now - start)

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self._count_ready(1)

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        self._count_ready(len(indices))

    def _count_ready(self, count: int) -> None:
        with self._lock:
            self._ready += count
            if self._status.first_tensor_at is None:
                self._status = _replace(self._status, first_tensor_at=time.time())

    def retried(self, *, kind: str, message: str) -> None:
        with self._lock:
            self._retries += 1
            self._errors[kind] += 1

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._status = _replace(self._status, phase="complete", finished_at=time.time())

    def memory_changed(self, status: dict[str, Any]) -> None:
        with self._lock:
            self._status = _replace(self._status, memory=status)

    def file_proof(self, *, file: str, proof: str, state: str) -> None:
        with self._lock:
            proofs = {**self._status.proofs, file: {"proof": proof, "state": state}}
            self._status = _replace(self._status, proofs=proofs)

    def load_failed(self, *, kind: str, reason: str) -> None:
        with self._lock:
            self._errors[kind] += 1
            phase: LoadPhase = "stopped" if kind == "stopped" else "failed"
            self._status = _replace(self._status, phase=phase, finished_at=time.time(), error=reason)


class Observers:
    """Fans each event out to several observers; an observer that raises is logged and skipped."""

    def __init__(self, *observers: object) -> None:
        self._observers = observers

    def __getattr__(self, event: str) -> object:
        if event not in EVENTS:
            raise AttributeError(f"{event!r} is not a load event (known: {', '.join(sorted(EVENTS))})")
        if event == "tensors_published":
            methods = [
                _batch_of(o) for o in self._observers if hasattr(o, event) or hasattr(o, "tensor_ready")
            ]
        else:
            methods = [getattr(o, event) for o in self._observers if hasattr(o, event)]

        def fan_out(*args: object, **kwargs: object) -> None:
            for method in methods:
                try:
                    method(*args, **kwargs)
                except Exception:
                    log.exception("observer %r failed on %s", method, event)

        self.__dict__[event] = fan_out  # built once per event: this runs on the readers' hot path
        return fan_out


def _batch_of(observer: object) -> Callable[..., None]:
    """``observer``'s ``tensors_published``, or one that calls its ``tensor_ready`` for each tensor."""
    batch = getattr(observer, "tensors_published", None)
    if batch is not None:
        return batch
    single = observer.tensor_ready  # type: ignore[attr-defined]

    def each(*, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]) -> None:
        for index, name, size in zip(indices, names, nbytes, strict=True):
            single(index=index, name=name, nbytes=size)

    return each


def _replace(status: LoadStatus, **changes: object) -> LoadStatus:
    return replace(status, **changes)  # type: ignore[arg-type]
