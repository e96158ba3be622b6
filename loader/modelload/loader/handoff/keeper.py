"""The keeper: one process of the pod that holds the model in GPU memory and lends it to the app's processes.

It attaches to the segment like any app (a registered consumer in memory modes release and ring), copies
every tensor as it becomes ready into blocks of exportable GPU memory (:mod:`.device`), and answers on a
Unix socket: to ``open``, the manifest and one file descriptor per block; to ``status``, its state. An app
process that restarts (a crash, an OOM kill, a new image of the app container) connects again and maps the
same memory: no copy, no wait for the segment.

The keeper listens before it loads, so an app that connects early is told the load's progress every
:data:`PROGRESS_INTERVAL` seconds rather than left waiting in silence, and a failed load is answered with
its reason. docs/handoff.md gives the protocol, the lifetimes and what a pod needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError, HandoffProtocolError, ModelloadError
from modelload.loader.handoff import protocol
from modelload.loader.handoff.device import ExportedBlock, Memory, view
from modelload.loader.handoff.placement import place

if TYPE_CHECKING:
    from modelload.loader._api.model import Model

__all__ = ["PROGRESS_INTERVAL", "Keeper", "Progress"]

log = logging.getLogger(__name__)

PROGRESS_INTERVAL = 1.0
"""Seconds between ``loading`` messages to an app waiting for the load."""

REQUEST_TIMEOUT = 10.0
"""Seconds a new connection has to send its whole request (not each byte of it)."""

REQUEST_LIMIT = 64 << 10
"""The largest request (and lease message) an app may send: a request is a few hundred bytes, and the keeper
allocates what a message announces (the protocol's own limit, for manifests, is 256 MiB)."""

SOCKET_MODE = 0o666
"""Mode of the socket file: an app container may run as another user of the pod (as for notify.sock)."""

MAX_CLIENTS = 256
"""Connections served at once; more are answered ``busy``."""


@dataclass
class Progress:
    state: str = "starting"
    """``starting`` (waiting for the segment), ``loading``, ``ready`` or ``failed``."""
    tensors_ready: int = 0
    tensors_total: int = 0
    bytes_ready: int = 0
    bytes_total: int = 0
    error: str | None = None
    seconds: float | None = None
    """From the start of the copy to the last tensor on the device, once ready."""

    def fields(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "tensors_ready": self.tensors_ready,
            "tensors_total": self.tensors_total,
            "bytes_ready": self.bytes_ready,
            "bytes_total": self.bytes_total,
            "error": self.error,
            "seconds": self.seconds,
        }


class Keeper:
    """Loads a model into ``memory`` and serves it on ``socket_path``. ``start()`` listens; ``load()`` fills
    the blocks (in the calling thread); ``close()`` stops serving (apps keep what they mapped)."""

    def __init__(self, memory: Memory, *, socket_path: str | os.PathLike[str], block_size: int) -> None:
        self.memory = memory
        self.socket_path = Path(socket_path)
        self.block_size = block_size
        self.progress = Progress()
        self._changed = threading.Condition()
        self._manifest: protocol.Manifest | None = None
        self._blocks: list[ExportedBlock] = []
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._mapped = 0
        self._closed = False
        self._threads: list[threading.Thread] = []

    # --- serving ------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on the socket (refusing one another live keeper answers on) and accept in a thread."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.socket_path.exists() or self.socket_path.is_symlink():
            if _answers(self.socket_path):
                raise ConfigError(
                    f"another keeper already answers on {self.socket_path}: one keeper per socket",
                    setting="--socket",
                )
            self.socket_path.unlink()  # a socket left by a keeper that died
        # Bound and opened to the pod under a temporary name, then renamed into place: an app never finds
        # the socket before it accepts every user of the pod.
        staging = self.socket_path.with_name(f".{self.socket_path.name}.{os.getpid()}")
        staging.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(staging))
        staging.chmod(SOCKET_MODE)
        listener.listen(64)
        staging.rename(self.socket_path)
        self._listener = listener
        thread = threading.Thread(target=self._accept, name="keeper-accept", daemon=True)
        thread.start()
        self._threads.append(thread)
        log.info("keeper listening on %s", self.socket_path)

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed
            with self._changed:
                if self._closed:
                    conn.close()
                    return
                busy = len(self._connections) >= MAX_CLIENTS
                if not busy:
                    self._connections.add(conn)
            if busy:
                with contextlib.suppress(OSError), conn:
                    protocol.send(conn, protocol.error("busy", f"{MAX_CLIENTS} apps are connected already"))
                continue
            threading.Thread(target=self._serve, args=(conn,), name="keeper-client", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peer = _peer(conn)
        try:
            deadline = time.monotonic() + REQUEST_TIMEOUT
            try:
                request = protocol.receive(conn, max_fds=0, limit=REQUEST_LIMIT, deadline=deadline)
            except HandoffProtocolError as exc:
                with contextlib.suppress(OSError):
                    protocol.send(conn, protocol.error("bad-request", str(exc)))
                raise
            if request is None:
                return
            conn.settimeout(None)
            version = protocol.choose_version(request.message.get("versions"))
            if version is None:
                protocol.send(conn, protocol.error(
                    "version",
                    f"this keeper speaks protocol versions {list(protocol.VERSIONS)}, the app offered "
                    f"{request.message.get('versions')!r}: run both with one modelload release",
                    versions=list(protocol.VERSIONS),
                ))  # fmt: skip
            elif request.op == "status":
                protocol.send(conn, self._status(version))
            elif request.op == "open":
                self._open(conn, version, peer)
            else:
                protocol.send(conn, protocol.error("bad-request", f"unknown op {request.op!r}"))
        except (OSError, HandoffProtocolError) as exc:
            log.info("connection from %s ended: %s", peer, exc)
        finally:
            with self._changed:
                self._connections.discard(conn)
            conn.close()

    def _status(self, version: int) -> dict[str, Any]:
        with self._changed:
            return {"op": "status", "version": version, **self.progress.fields(), "apps": self._mapped}

    def _open(self, conn: socket.socket, version: int, peer: str) -> None:
        while True:
            with self._changed:
                waiting = self.progress.state in ("starting", "loading") and not self._closed
                if not waiting:
                    closed, state, error = self._closed, self.progress.state, self.progress.error
                    manifest, blocks = self._manifest, list(self._blocks)
                    break
                update = {"op": "loading", "version": version, **self.progress.fields()}
            protocol.send(conn, update)
            with self._changed:
                self._changed.wait_for(self._settled, PROGRESS_INTERVAL)
        if closed:
            protocol.send(conn, protocol.error("stopping", "the keeper is stopping"))
            return
        if state == "failed":
            protocol.send(conn, protocol.error("failed", error or "the load failed"))
            return
        assert manifest is not None
        protocol.send(conn, manifest.message(version))
        fds = [block.fd for block in blocks]
        for first in range(0, len(fds), protocol.MAX_FDS_PER_MESSAGE):
            batch = fds[first : first + protocol.MAX_FDS_PER_MESSAGE]
            protocol.send(conn, {"op": "fds", "first": first, "count": len(batch)}, batch)
        answer = protocol.expect(protocol.receive(conn, max_fds=0, limit=REQUEST_LIMIT), "mapped", "error")
        if answer.op == "error":
            log.warning("app %s could not map the weights: %s", peer, answer.message.get("message"))
            return
        with self._changed:
            self._mapped += 1
        log.info("app %s mapped the weights (%d apps hold them)", peer, self._mapped)
        try:
            # the app's lease: open while it lives
            while protocol.receive(conn, max_fds=0, limit=REQUEST_LIMIT) is not None:
                pass
        finally:
            with self._changed:
                self._mapped -= 1

    def _settled(self) -> bool:
        return self._closed or self.progress.state not in ("starting", "loading")

    def close(self) -> None:
        """Stop listening and end every connection; apps keep the memory they mapped."""
        with self._changed:
            self._closed = True
            connections = list(self._connections)
            self._changed.notify_all()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    # --- loading ------------------------------------------------------------------------------------------

    def load(self, model: Model) -> None:
        """Copy every tensor of ``model`` into the blocks as it becomes ready; the state ends ``ready`` or
        ``failed`` (with the reason, also raised)."""
        try:
            self._load(model)
        except BaseException as exc:
            self.fail(str(exc) if isinstance(exc, ModelloadError) else f"{type(exc).__name__}: {exc}")
            raise

    def fail(self, reason: str) -> None:
        """Answer every app with ``reason`` from now on (the segment never appeared, the load failed)."""
        with self._changed:
            self.progress.state, self.progress.error = "failed", reason
            self._changed.notify_all()

    def _load(self, model: Model) -> None:
        started = time.monotonic()
        entries = [(name, by_name(model.dtype(name)), model.shape(name)) for name in model.names]
        sizes, places = place(entries, block_size=self.block_size, granularity=self.memory.granularity)
        with self._changed:
            self.progress.state = "loading"
            self.progress.tensors_total = len(places)
            self.progress.bytes_total = sum(p.nbytes for p in places)
            self._changed.notify_all()
        blocks = [self.memory.allocate(size) for size in sizes]
        log.info("keeper: %d tensors, %d bytes, in %d blocks", len(places), sum(sizes), len(blocks))
        flat = [block.bytes() for block in blocks]
        by_tensor = {p.name: p for p in places}
        # As state_dict copies: pinned in place where pages are few (huge pages) or reused (a ring), once for
        # the whole region where it can be, else through pinned staging buffers (Model._pins_in_place).
        copier = self.memory.copier(pin_in_place=model._pins_in_place())
        consumed = model.consumed if model.memory_mode != "full" else None
        try:
            region = model._pinnable(list(model.names))
            if region is not None:
                copier.pin(region)
            for name in model.iter_ready():
                host = model.tensor(name, wait=False)
                done = None if consumed is None else _marker(consumed, name)
                copier.copy(host, into=view(flat, by_tensor[name]), on_done=done)
                with self._changed:
                    self.progress.tensors_ready += 1
                    self.progress.bytes_ready += by_tensor[name].nbytes
        except BaseException:
            # A failed load (the sidecar's failure, a timeout, a copy refused) gives back what the copier
            # holds: the region's pin (a whole hugetlbfs segment, or the ring) and its queued copies, which
            # would otherwise stay for the keeper's life, since it goes on answering apps with the failure.
            with contextlib.suppress(Exception):
                copier.finish()
            raise
        copier.finish()
        model.wait_complete()  # no app is handed weights whose files then fail the sidecar's proof
        manifest = protocol.Manifest(
            device=self.memory.device,
            blocks=tuple(sizes),
            tensors=tuple(places),
            metadata=dict(model.metadata),
        )
        with self._changed:
            self._manifest, self._blocks = manifest, blocks
            self.progress.state = "ready"
            self.progress.seconds = time.monotonic() - started
            self._changed.notify_all()
        log.info("keeper: ready in %.2f s", self.progress.seconds)

    def wait(self, timeout: float | None = None) -> str:
        """Block until the state is ``ready`` or ``failed`` (or ``timeout``); return it."""
        with self._changed:
            self._changed.wait_for(lambda: self.progress.state in ("ready", "failed"), timeout)
            return self.progress.state


def _marker(consumed: Callable[[str], None], name: str) -> Callable[[], None]:
    return lambda: consumed(name)


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _peer(conn: socket.socket) -> str:
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return "an app"
    return f"pid {pid} (uid {uid})"
