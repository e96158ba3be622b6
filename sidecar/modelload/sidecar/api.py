"""The status API: the kubelet's probes, a JSON status, and Prometheus metrics, over FastAPI.

Endpoints (docs/contracts.md, "The status API")::

    GET /healthz    200 while the process runs (liveness: a failed load is not a reason to restart)
    GET /startupz   200 once the segment's manifest is published (apps can attach), else 503;
                    500 when the load failed before that (the startup probe then restarts the sidecar)
    GET /readyz     200 once every tensor is in, 503 while starting, loading or retrying (the reason in
                    "error"), 500 with {"phase": "failed", "error": ...} when the load failed
    GET /status     the load's snapshot as JSON (LoadStatus.as_dict, plus "state", the contract's name
                    for "phase")
    GET /metrics    Prometheus text exposition of the metrics registry

Every answer comes from one :meth:`LoadTracker.snapshot`, so the handlers never wait on the engine. A
failed load keeps the process up: liveness stays green while readiness is red, so the pod shows the reason
(``kubectl describe`` lists the probe's failures, ``/status`` holds the message) instead of restarting into
the same failure.

The port is reachable from the pod network (the kubelet's probes come from the node), so no client may hold
it: at most :data:`MAX_CONNECTIONS` connections at once and :data:`PER_ADDRESS` from one address (more are
closed as they come), a connection must send a complete request head within :data:`REQUEST_TIMEOUT` seconds
of opening or of its last answer (uvicorn's keep-alive timeout only starts after an answer, so an idle new
connection, or one that trickles its headers, would otherwise stay forever), heads are capped at
:data:`HEAD_BYTES`, and :data:`MAX_CONNECTIONS` requests in flight at once (uvicorn answers 503 beyond). A
dropped connection is one debug line, never a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from typing import Any, Protocol

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, generate_latest

from modelload.loader.errors import ConfigError
from modelload.sidecar.progress import LoadStatus

__all__ = ["ApiServer", "StatusSource", "create_app", "status_body"]

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 128
"""Connections the status API holds at once (probes, scrapes and a few ``/status`` readers need a handful)."""
PER_ADDRESS = 32
"""... from one client address, so one misbehaving client cannot take them all."""
REQUEST_TIMEOUT = 5.0
"""Seconds a connection has to send a whole request head, from its opening or from its last answer."""
KEEP_ALIVE = 5
"""Seconds an idle kept-alive connection stays open after an answer (uvicorn's ``timeout_keep_alive``)."""
HEAD_BYTES = 16384
"""The largest request head accepted (h11's incomplete event size)."""
BACKLOG = 1024
"""Connections the kernel queues before they are accepted: a burst (of probes, or of a flood that the caps
then close) must not overflow it and reset an honest connection."""

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format, which every Prometheus and scraper reads. Newer prometheus_client versions
announce 1.0.0, which differs only for names outside [a-zA-Z0-9_:], and ours are all inside."""


class StatusSource(Protocol):
    """What the API reads: a :class:`~modelload.sidecar.progress.LoadTracker`, or anything with snapshots."""

    def snapshot(self) -> LoadStatus: ...


def status_body(status: LoadStatus) -> dict[str, Any]:
    """The ``/status`` document: the snapshot's fields (``state``: the phase's older name)."""
    return status.as_dict()


def _probe(status: LoadStatus, *, passed: bool) -> JSONResponse:
    """200 when the probe passes, 500 when the load failed (the reason is in the body), 503 otherwise."""
    code = 200 if passed else 500 if status.phase == "failed" else 503
    return JSONResponse(_summary(status), status_code=code)


def _summary(status: LoadStatus) -> dict[str, Any]:
    return {
        "phase": status.phase,
        "tensors_ready": status.tensors_ready,
        "tensors_total": status.tensors_total,
        "error": status.error,
        "attempt": status.attempt,
    }


def create_app(tracker: StatusSource, *, metrics_registry: CollectorRegistry) -> FastAPI:
    """The API over ``tracker``'s snapshots and ``metrics_registry``'s metrics."""
    app = FastAPI(
        title="modelload sidecar",
        description="Load progress and probes of the modelload sidecar.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/startupz")
    async def startupz() -> JSONResponse:
        status = tracker.snapshot()
        return _probe(status, passed=status.published)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status = tracker.snapshot()
        return _probe(status, passed=status.ready)

    @app.get("/status")
    async def status() -> dict[str, Any]:
        return status_body(tracker.snapshot())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(metrics_registry), media_type=METRICS_CONTENT_TYPE)

    return app


class ApiServer:
    """uvicorn serving ``app`` from a thread of its own, on a socket bound when the server is built.

    The socket is bound here, in the caller's thread, so a port in use is an immediate
    :class:`ConfigError` rather than a log line from a background thread, and port 0 resolves to a real
    port before anything starts (:attr:`port`). uvicorn runs in a thread because the main thread keeps the
    signals: uvicorn installs handlers only when it runs in the main thread, and the sidecar must stop the
    engine before it stops serving, an order uvicorn's own handlers would not keep.
    """

    def __init__(self, app: FastAPI, *, host: str, port: int, graceful_timeout: int = 5) -> None:
        import uvicorn

        self._socket = _listen(host, port)
        self.host = host
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,  # keep the process's logging; uvicorn's loggers propagate to it
            access_log=False,  # probes every few seconds would drown the load's own lines
            lifespan="off",
            timeout_graceful_shutdown=graceful_timeout,
            http=_guarded_protocol(),
            limit_concurrency=MAX_CONNECTIONS,
            timeout_keep_alive=KEEP_ALIVE,
            h11_max_incomplete_event_size=HEAD_BYTES,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="modelload-api", daemon=True)
        self.failure: BaseException | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host  # noqa: S104 - a reachable name
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, *, timeout: float = 10.0) -> None:
        """Start serving; returns once uvicorn accepts requests. Raises if it cannot start in ``timeout``."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(
                    f"the status API did not start on {self.url}: {self.failure!r}; check --host and --port"
                    " (MODELLOAD_HOST, MODELLOAD_PORT)"
                )
            time.sleep(0.01)

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop accepting, let requests in flight finish (up to the graceful timeout), and close."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._socket.close()

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # SystemExit from uvicorn included: report it, do not kill the thread
            self.failure = exc
            log.exception("the status API stopped")


def _guarded_protocol() -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, with the connection caps and the request deadline of the module docstring."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _address = "?"

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            peer = transport.get_extra_info("peername")
            self._address = str(peer[0]) if peer else "?"
            same = sum(1 for c in self.connections if getattr(c, "_address", None) == self._address)
            over = len(self.connections) >= MAX_CONNECTIONS or same >= PER_ADDRESS
            super().connection_made(transport)
            if over:
                log.debug("status API: dropped a connection from %s (over the connection cap)", self._address)
                transport.abort()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(REQUEST_TIMEOUT, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered: its answer re-arms the deadline
            if not self.transport.is_closing():
                log.debug("status API: dropped a connection from %s (no request in time)", self._address)
                self.transport.abort()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a whole request head arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port``; ConfigError naming the setting when that fails."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host/MODELLOAD_HOST: cannot resolve {host!r} ({exc})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"the status API cannot listen on {host}:{port} ({exc.strerror or exc}); choose another"
            " --port/MODELLOAD_PORT or --host/MODELLOAD_HOST"
        ) from None
    return sock
