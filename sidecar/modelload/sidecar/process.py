"""The sidecar's process: its threads, its signals, and the order in which they start and stop.

The process has three threads of note. The main thread starts the others, then waits for SIGTERM or
SIGINT: it owns the signals so that it can stop things in the right order (the engine first, so the segment
is left consistent, then the API). The status API (uvicorn) runs in a thread of its own and starts first, so
the liveness probe answers from the first second. The engine runs in a third thread; its readers report
through observers (``progress.py``): the tracker behind ``/status`` and the probes, the Prometheus metrics,
the pyzmq notifier, and a logger (:class:`~modelload.sidecar.logs.LoggingObserver`).

The command line (:mod:`modelload.sidecar.cli`) builds the settings and calls :func:`run_sidecar`; tests
build a :class:`Sidecar` with an engine of their own. FastAPI, uvicorn, pyzmq and the engine are imported
when a sidecar is built, not with this module.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from modelload.loader.errors import ModelloadError
from modelload.sidecar.heap import tune_heap
from modelload.sidecar.load.attempts import AttemptPolicy
from modelload.sidecar.logs import LoggingObserver, describe_progress
from modelload.sidecar.settings import SidecarSettings

if TYPE_CHECKING:
    from modelload.loader.segment.lock import WriterLock
    from modelload.sidecar.api import ApiServer
    from modelload.sidecar.load.readers import PeerHook
    from modelload.sidecar.notify import Notifier
    from modelload.sidecar.peers.hook import Peers
    from modelload.sidecar.progress import LoadObserver, LoadTracker

__all__ = ["EngineFactory", "LoadEngine", "Sidecar", "default_engine", "run_sidecar"]

log = logging.getLogger("modelload.sidecar")

STOP_TIMEOUT = 10.0
"""Seconds to wait for the engine's readers after stop(): they stop at their next chunk, which a stalled
source bounds only by its stall timeout (30 s). The segment is marked FAILED before the wait, so a reader
still blocked then costs nothing but its thread; the kubelet's default grace period is 30 s."""

PROGRESS_INTERVAL = 10.0
"""Seconds between progress lines in the log while loading (``kubectl logs`` stays readable)."""


# --- the engine, as this module uses it --------------------------------------------------------------------


class LoadEngine(Protocol):
    """What the sidecar needs of an engine: ``run`` blocks until the load ends, ``stop`` from any thread."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


EngineFactory = Callable[[SidecarSettings, "LoadObserver"], LoadEngine]


def default_engine(
    settings: SidecarSettings,
    observer: LoadObserver,
    *,
    peers: PeerHook | None = None,
    lock: WriterLock | None = None,
) -> LoadEngine:
    """The streaming engine of ``modelload.sidecar.load.engine``, built from the sidecar's settings (and this
    sidecar's :class:`~modelload.sidecar.peers.hook.Peers` when peers are on, and the segment's writer lock
    the sidecar holds). Transient failures are left to the sidecar, which starts the whole load again."""
    from modelload.sidecar.load.engine import Engine

    return Engine(
        settings.engine,
        sources=settings.sources,
        observer=observer,
        peers=peers,
        lock=lock,
        retry_transient=True,
    )


# --- the process -------------------------------------------------------------------------------------------


def run_sidecar(settings: SidecarSettings, *, engine_factory: EngineFactory = default_engine) -> int:
    """Run the sidecar until SIGTERM/SIGINT (when called from the main thread); returns the exit status.

    The process is the sidecar's own: its C heap is tuned first (:mod:`modelload.sidecar.heap`)."""
    tune_heap()
    sidecar = Sidecar(settings, engine_factory=engine_factory)
    restore = _install_signals(sidecar) if threading.current_thread() is threading.main_thread() else {}
    try:
        sidecar.start()
        sidecar.wait()
    finally:
        status = sidecar.stop()
        for signum, handler in restore.items():
            signal.signal(signum, handler)
    return status


def _install_signals(sidecar: Sidecar) -> dict[int, Any]:
    def handle(signum: int, _: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if sidecar.shutdown.is_set():
            log.warning("%s again: exiting now", name)
            os._exit(1)
        log.info("%s: stopping the load, then the status API", name)
        sidecar.shutdown.set()

    return {signum: signal.signal(signum, handle) for signum in (signal.SIGTERM, signal.SIGINT)}


class Sidecar:
    """The observers, the status API and the engine's thread of one sidecar, started and stopped in order.

    Building it binds the API's port and the notify endpoint (ConfigError when either is taken), so a
    misconfigured pod fails at once. :meth:`start` serves and starts the load; :meth:`wait` returns when
    :attr:`shutdown` is set (by a signal, or a test) or the API dies; :meth:`stop` returns the exit status.
    """

    def __init__(
        self,
        settings: SidecarSettings,
        *,
        engine_factory: EngineFactory = default_engine,
        attempts: AttemptPolicy | None = None,
    ) -> None:
        from modelload.loader.segment.lock import WriterLock
        from modelload.loader.segment.room import check_folder, check_not_foreign
        from modelload.sidecar.load.keys import check_key_files

        attempts = attempts or AttemptPolicy()
        check_key_files(settings.engine)
        check_folder(settings.engine.segment)
        check_not_foreign(settings.engine.segment)
        # One writer per segment, before anything else binds: a second sidecar on this segment is refused
        # here, naming the first, rather than by the notify socket it would also share.
        self.lock = WriterLock.acquire(settings.engine.segment, program="modelload sidecar")
        try:
            self._build(settings, engine_factory, attempts)
        except BaseException:
            self.lock.release()
            raise

    def _build(
        self, settings: SidecarSettings, engine_factory: EngineFactory, attempts: AttemptPolicy
    ) -> None:
        from modelload.sidecar.api import ApiServer, create_app
        from modelload.sidecar.metrics import MetricsObserver
        from modelload.sidecar.notify import FailureMarker, Notifier
        from modelload.sidecar.progress import LoadTracker, Observers

        self.settings = settings
        self.shutdown = threading.Event()
        self.tracker: LoadTracker = LoadTracker()
        self.metrics = MetricsObserver()
        app = create_app(self.tracker, metrics_registry=self.metrics.registry)
        self.api: ApiServer = ApiServer(app, host=settings.api.host, port=settings.api.port)
        self.notifier: Notifier | None = None
        if settings.notify.endpoint is not None:
            try:
                self.notifier = Notifier(settings.notify.endpoint, send_hwm=settings.notify.send_hwm)
            except BaseException:
                self.api.stop()
                raise
        self.peers: Peers | None = None
        if settings.peers.enabled:
            from modelload.sidecar.peers.hook import Peers

            try:
                self.peers = Peers(settings.peers, host=settings.api.host, retry=settings.sources.retry)
            except BaseException:
                self.api.stop()
                if self.notifier is not None:
                    self.notifier.close()
                raise
            self.peers.register_metrics(self.metrics.registry)
        if engine_factory is default_engine:
            engine_factory = functools.partial(default_engine, peers=self.peers, lock=self.lock)
        marker = FailureMarker(settings.engine.segment)
        observers = [self.tracker, self.metrics, LoggingObserver(), marker, self.notifier, self.peers]
        self.observer: LoadObserver = Observers(*[o for o in observers if o is not None])  # type: ignore[assignment]
        self._load = _LoadThread(
            lambda: engine_factory(settings, self.observer), self.observer, self.tracker, attempts
        )
        self._stopped: int | None = None

    def start(self) -> None:
        """Serve the API (the liveness probe answers from now on), then start the load."""
        self.api.start()
        self.lock.update(status_url=self.api.url)  # a second writer's refusal names where to look
        if self.peers is not None:
            self.peers.start()
        log.info(
            "status API on %s (/healthz /startupz /readyz /status /metrics); notifications on %s",
            self.api.url,
            self.settings.notify.endpoint or "nothing (--notify none)",
        )
        self._load.start()

    def wait(self) -> None:
        """Serve until :attr:`shutdown` is set, logging progress while the load runs."""
        logged = time.monotonic()
        while not self.shutdown.wait(0.5):
            if not self.api.alive:
                log.error("the status API stopped unexpectedly: stopping the sidecar")
                return
            now = time.monotonic()
            status = self.tracker.snapshot()
            if status.phase == "loading" and now - logged >= PROGRESS_INTERVAL:
                logged = now
                log.info("%s", describe_progress(status))

    def stop(self) -> int:
        """Stop the load, then the API, then the notifier; 0 if the load had completed, else 1."""
        if self._stopped is not None:
            return self._stopped
        self.shutdown.set()
        self._load.stop()
        if not self._load.join(STOP_TIMEOUT):
            log.warning("the engine did not stop within %.0f s; exiting without it", STOP_TIMEOUT)
        self.api.stop()
        if self.peers is not None:
            self.peers.close()
        if self.notifier is not None:
            self.notifier.close()
        status = self.tracker.snapshot()
        self._stopped = 0 if status.phase == "complete" else 1
        self.lock.release()
        log.info("stopped (load %s): exit status %d", status.phase, self._stopped)
        return self._stopped


class _LoadThread:
    """Builds the engine and runs it in a thread, attempt after attempt while the failures are transient
    (:mod:`modelload.sidecar.load.attempts`); a failure before the engine could report it is reported.

    The engine reports its own final failures to the observers before raising; an error in building it (a
    bad combination of settings, a missing engine module) has nobody to report it, so this thread does, and
    the sidecar then serves the failure on /readyz like any other.
    """

    def __init__(
        self,
        build: Callable[[], LoadEngine],
        observer: LoadObserver,
        tracker: LoadTracker,
        attempts: AttemptPolicy,
    ) -> None:
        self._build = build
        self._observer = observer
        self._tracker = tracker
        self._attempts = attempts
        self._lock = threading.Lock()
        self._engine: LoadEngine | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="modelload-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping.set()
            engine = self._engine
        if engine is not None:
            engine.stop()

    def join(self, timeout: float) -> bool:
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        attempt = 1
        while not self._attempt(attempt):
            delay = self._attempts.delay(attempt)
            if self._stopping.wait(delay):
                return
            attempt += 1

    def _attempt(self, attempt: int) -> bool:
        """Run one attempt; False when it failed transiently and the load should start again."""
        try:
            with self._lock:
                if self._stopping.is_set():
                    return True
                self._engine = engine = self._build()
            engine.run()
        except ModelloadError as exc:
            if exc.transient and not self._stopping.is_set():
                delay = self._attempts.delay(attempt)
                self._observer.load_retrying(kind=exc.kind, reason=str(exc), attempt=attempt, delay=delay)
                return False
            self._report(exc, exc.kind)
        except Exception as exc:
            log.exception("the engine failed unexpectedly")
            self._report(exc, "internal")
        return True

    def _report(self, exc: BaseException, kind: str) -> None:
        if self._tracker.snapshot().phase in ("failed", "stopped"):
            return  # the engine reported it already
        self._observer.load_failed(kind=kind, reason=str(exc) or type(exc).__name__)
