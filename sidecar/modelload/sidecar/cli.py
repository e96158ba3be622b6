"""``modelload sidecar``: load one model into a segment, serve its status, and stay up until told to stop.

The process has three threads of note. The main thread parses the settings, starts the others, then waits
for SIGTERM or SIGINT: it owns the signals so that it can stop things in the right order (the engine first,
so the segment is left consistent, then the API). The status API (uvicorn) runs in a thread of its own and
starts first, so the liveness probe answers from the first second. The engine runs in a third thread; its
readers report through observers (``progress.py``): the tracker behind ``/status`` and the probes, the
Prometheus metrics, the pyzmq notifier, and a logger.

Only argparse and the standard library are imported at module level (plus the settings table, which is
stdlib-only): ``modelload --help`` loads every subcommand's ``register``, and FastAPI, uvicorn, pyzmq and
the engine are imported when the command runs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from modelload.loader.errors import ConfigError, ModelloadError
from modelload.loader.sizes import format_bytes
from modelload.sidecar.logs import add_log_format, apply_log_format
from modelload.sidecar.settings import SidecarSettings, add_arguments, parse_settings
from modelload.sidecar.sources import check_scheme, display_url

if TYPE_CHECKING:
    from modelload.sidecar.api import ApiServer
    from modelload.sidecar.notify import Notifier
    from modelload.sidecar.progress import LoadObserver, LoadStatus, LoadTracker

__all__ = ["EngineFactory", "LoadEngine", "LoggingObserver", "Sidecar", "register", "run_sidecar"]

log = logging.getLogger("modelload.sidecar")

DESCRIPTION = """\
Stream a model's weights from S3, HTTP(S) or a file into a shared-memory segment, and serve the load's
status until the pod stops.

HTTP endpoints (--host/--port): /healthz (200 while the process runs), /startupz (200 once the manifest is
published: apps can attach), /readyz (200 once every tensor is in, 503 while loading, 500 when the load
failed), /status (JSON progress), /metrics (Prometheus).

The process keeps running after the load, complete or failed: the segment and the API stay up. A failed
load does not exit: liveness stays green while readiness is red (500, with the reason in the body and in
/status), so the pod shows why instead of restarting into the same failure. Every flag has a MODELLOAD_*
variable; a flag given wins over its variable."""

EPILOG = """\
signals: SIGTERM or SIGINT stop the engine (a segment still loading is marked FAILED, never left torn; a
wait before a retry is cut short), then the API; a second signal exits at once.
failures before the manifest: <segment>.failed holds the reason, for apps waiting in attach().
exit status: 0 after a stop if the load had completed, 1 if it had not (failed or still loading), 2 for a
bad flag or variable (a source scheme no backend serves, a segment folder that does not exist), or when the
API port or the notify endpoint cannot be bound (or another sidecar publishes on it)."""

STOP_TIMEOUT = 10.0
"""Seconds to wait for the engine's readers after stop(): they stop at their next chunk, which a stalled
source bounds by its stall timeout; the kubelet's default grace period is 30 s."""

PROGRESS_INTERVAL = 10.0
"""Seconds between progress lines in the log while loading (``kubectl logs`` stays readable)."""


# --- the engine, as this module uses it --------------------------------------------------------------------


class LoadEngine(Protocol):
    """What the sidecar needs of an engine: ``run`` blocks until the load ends, ``stop`` from any thread."""

    def run(self) -> None: ...

    def stop(self) -> None: ...


EngineFactory = Callable[[SidecarSettings, "LoadObserver"], LoadEngine]


def default_engine(settings: SidecarSettings, observer: LoadObserver, *, peers: Any = None) -> LoadEngine:
    """The streaming engine of ``modelload.sidecar.engine``, built from the sidecar's settings (and this
    sidecar's :class:`~modelload.sidecar.peers.Peers` when peers are on)."""
    from modelload.sidecar.engine import Engine, EngineSettings

    load = settings.engine
    engine_settings = EngineSettings(
        source=load.source,
        segment=load.segment,
        format=load.format,
        readers=load.readers,
        chunk_size=load.chunk_size,
        verify=load.verify,
        key_file=load.key_file,
        password_file=load.password_file,
        priority=load.priority,
        notify=settings.notify.endpoint,
        model_dir=load.model_dir,
        files=load.files,
        memory=load.memory,
    )
    return Engine(engine_settings, sources=settings.sources, observer=observer, peers=peers)


# --- the command -------------------------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``modelload sidecar`` to the main CLI (through the ``modelload.commands`` entry point)."""
    parser = subparsers.add_parser(
        "sidecar",
        help="load a model into a shared-memory segment and serve its status",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_log_format(parser)
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    try:
        settings = parse_settings(args, os.environ)
        # An ftp:// source is a bad flag (exit 2), not a load that fails and is served as failed forever.
        check_scheme(settings.engine.source)
        _configure_logging(settings.log_level, verbose=getattr(args, "verbose", 0))
        apply_log_format(args, os.environ)
        return run_sidecar(settings)
    except ConfigError as exc:
        print(f"modelload sidecar: {exc}", file=sys.stderr)
        return exc.exit_status


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _configure_logging(level: str, *, verbose: int) -> None:
    """Let modelload's own records through at ``level`` (or lower with ``-v``), whatever the root's level.

    The main CLI sets the root logger to WARNING unless ``-v`` is given; a sidecar's INFO lines (start,
    manifest, finish) belong in ``kubectl logs`` by default, so the ``modelload`` logger gets its own level.
    """
    wanted = min(_LEVELS[level], logging.WARNING - 10 * min(verbose, 2))
    logging.getLogger("modelload").setLevel(wanted)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def run_sidecar(settings: SidecarSettings, *, engine_factory: EngineFactory = default_engine) -> int:
    """Run the sidecar until SIGTERM/SIGINT (when called from the main thread); returns the exit status."""
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


# --- the process -------------------------------------------------------------------------------------------


class Sidecar:
    """The observers, the status API and the engine's thread of one sidecar, started and stopped in order.

    Building it binds the API's port and the notify endpoint (ConfigError when either is taken), so a
    misconfigured pod fails at once. :meth:`start` serves and starts the load; :meth:`wait` returns when
    :attr:`shutdown` is set (by a signal, or a test) or the API dies; :meth:`stop` returns the exit status.
    """

    def __init__(self, settings: SidecarSettings, *, engine_factory: EngineFactory = default_engine) -> None:
        from modelload.sidecar.api import ApiServer, create_app
        from modelload.sidecar.metrics import MetricsObserver
        from modelload.sidecar.notify import FailureMarker, Notifier
        from modelload.sidecar.progress import LoadTracker, Observers

        folder = settings.engine.segment.parent
        if not folder.is_dir():
            raise ConfigError(
                f"the segment's folder {folder} does not exist: create it, mount the shared volume there,"
                " or point --segment/MODELLOAD_SEGMENT into an existing folder"
            )
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
        self.peers: Any = None
        if settings.peers.enabled:
            from modelload.sidecar.peers import Peers

            try:
                self.peers = Peers(settings.peers, host=settings.api.host, retry=settings.sources.retry)
            except BaseException:
                self.api.stop()
                if self.notifier is not None:
                    self.notifier.close()
                raise
            self.peers.register_metrics(self.metrics.registry)
            if engine_factory is default_engine:
                engine_factory = functools.partial(default_engine, peers=self.peers)
        marker = FailureMarker(settings.engine.segment)
        observers = [self.tracker, self.metrics, LoggingObserver(), marker, self.notifier, self.peers]
        self.observer: LoadObserver = Observers(*[o for o in observers if o is not None])  # type: ignore[assignment]
        self._load = _LoadThread(lambda: engine_factory(settings, self.observer), self.observer, self.tracker)
        self._stopped: int | None = None

    def start(self) -> None:
        """Serve the API (the liveness probe answers from now on), then start the load."""
        self.api.start()
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
        log.info("stopped (load %s): exit status %d", status.phase, self._stopped)
        return self._stopped


class _LoadThread:
    """Builds the engine and runs it in a thread; a failure before the engine could report it is reported.

    The engine reports its own failures to the observers before raising; an error in building it (a bad
    combination of settings, a missing engine module) has nobody to report it, so this thread does, and the
    sidecar then serves the failure on /readyz like any other.
    """

    def __init__(self, build: Callable[[], LoadEngine], observer: LoadObserver, tracker: LoadTracker) -> None:
        self._build = build
        self._observer = observer
        self._tracker = tracker
        self._lock = threading.Lock()
        self._engine: LoadEngine | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="modelload-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            engine = self._engine
        if engine is not None:
            engine.stop()

    def join(self, timeout: float) -> bool:
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            with self._lock:
                if self._stopping:
                    return
                self._engine = engine = self._build()
            engine.run()
        except ModelloadError as exc:
            self._report(exc, exc.kind)
        except Exception as exc:
            log.exception("the engine failed unexpectedly")
            self._report(exc, "internal")

    def _report(self, exc: BaseException, kind: str) -> None:
        if self._tracker.snapshot().phase in ("failed", "stopped"):
            return  # the engine reported it already
        self._observer.load_failed(kind=kind, reason=str(exc) or type(exc).__name__)


# --- logging -----------------------------------------------------------------------------------------------


def describe_progress(status: LoadStatus) -> str:
    """One line of progress: ``loading: 45.2% 1.2 GiB/2.7 GiB, 800.0 MiB/s, 120/291 tensors, ETA 2 s``."""
    share = status.bytes_done / status.bytes_total if status.bytes_total else 0.0
    eta = status.eta
    return (
        f"{status.phase}: {share:.1%} {format_bytes(status.bytes_done)}/{format_bytes(status.bytes_total)},"
        f" {format_bytes(status.throughput)}/s, {status.tensors_ready}/{status.tensors_total} tensors,"
        f" {status.retries} retries, ETA {'?' if eta is None else f'{eta:.0f} s'}"
    )


class LoggingObserver:
    """Logs a load's milestones at INFO, its retries and failure at WARNING/ERROR, each tensor at DEBUG.

    Sources are shown without user info or query strings (:func:`display_url`), and the engine's
    messages never hold credentials (the error tree's rule). Retries are logged at most once per
    ``retry_interval`` seconds, with a count of those left out, so a flapping source cannot flood the log.
    """

    def __init__(self, *, logger: logging.Logger = log, retry_interval: float = 1.0) -> None:
        self._log = logger
        self._interval = retry_interval
        self._lock = threading.Lock()
        self._last_retry = float("-inf")
        self._quiet = 0

    def load_started(self, *, source: str, segment: str) -> None:
        self._log.info("loading %s into %s", display_url(source), segment)

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        self._log.info(
            "manifest published: %d tensors, %s, %s; apps can attach now",
            tensors,
            format_bytes(nbytes),
            model_format,
        )

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self._log.debug("tensor %d ready: %s (%d bytes)", index, name, nbytes)

    def retried(self, *, kind: str, message: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_retry < self._interval:
                self._quiet += 1
                return
            self._last_retry, quiet, self._quiet = now, self._quiet, 0
        more = f" ({quiet} more retries not logged)" if quiet else ""
        self._log.warning("retrying a range (%s): %s%s", kind, message, more)

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        rate = nbytes / seconds if seconds > 0 else 0.0
        self._log.info(
            "load complete: %s in %.2f s (%s/s)", format_bytes(nbytes), seconds, format_bytes(rate)
        )

    def load_failed(self, *, kind: str, reason: str) -> None:
        if kind == "stopped":
            self._log.warning("load stopped before it finished: %s", reason)
        else:
            self._log.error(
                "load failed (%s): %s; the sidecar keeps serving /status and /readyz (500)", kind, reason
            )
