"""Ready notifications: an observer that publishes each event of the load on a pyzmq PUB socket.

The messages are those of docs/contracts.md ("Notifications"), two frames each::

    [b"ready",  <u32 tensor index, little-endian> ...]   (the tensors published together: one range's)
    [b"done",   b""]
    [b"failed", <UTF-8 reason>]

They are hints. The loader (``modelload.loader._api.notify``) wakes up on any message and re-reads the
segment's state table, which stays the truth; so a message dropped here costs a subscriber one poll
interval, never a wrong answer. That is why sending never waits: the socket has a deep send queue
(``send_hwm`` per subscriber), each send is non-blocking, and a message that does not fit is dropped.

Threads: the engine's readers call :meth:`Notifier.tensor_ready` concurrently, and a zmq socket must not be
used by two threads at once. A lock serialises the sends; a non-blocking send on a PUB socket only copies
a few bytes into a queue, so the lock is held for microseconds, far less than the reader spent on the
tensor. (A dedicated sender thread would add a queue hop and a thread to shut down, for nothing.)

Permissions: the app container may run as another user than the sidecar (``runAsUser`` differs, or the
image's default user does), and connecting to a Unix socket needs write permission on its file. libzmq
creates the ``ipc://`` file with the process's umask (typically ``srwxr-xr-x``), so after binding we
``chmod`` it to ``0666`` (``srw-rw-rw-``): any process that can reach the shared volume may subscribe,
which is the volume's own access boundary (the emptyDir is ``0777`` and only mounted into this pod). A
subscriber that connects in the instant before the chmod is refused and retried by libzmq on its own.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import stat
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from modelload.loader.errors import ConfigError

__all__ = ["MAX_REASON_BYTES", "SOCKET_MODE", "FailureMarker", "Notifier"]

log = logging.getLogger(__name__)

SOCKET_MODE = 0o666
"""Mode of an ``ipc://`` socket file: every user in the pod may subscribe (see the module docstring)."""

MAX_REASON_BYTES = 4096
"""A failure reason is cut to this many bytes of UTF-8 (the segment keeps 1024; this is only a hint)."""

_INDEX = struct.Struct("<I")


class Notifier:
    """A :class:`~modelload.sidecar.progress.LoadObserver` that publishes ready, done and failed messages.

    ``Notifier(endpoint)`` binds at once, so subscribers can connect before the load starts; a bind that
    fails (a missing folder, a port in use) is a :class:`ConfigError` naming the endpoint. :meth:`close`
    unbinds and removes the socket file.
    """

    def __init__(self, endpoint: str, *, send_hwm: int = 100_000) -> None:
        import zmq

        self.endpoint = endpoint
        self._path = _ipc_path(endpoint)
        if self._path is not None:
            _refuse_a_live_socket(self._path, endpoint)
        self._zmq: Any = zmq
        self._lock = threading.Lock()
        self._context: Any = zmq.Context()
        self._socket: Any = self._context.socket(zmq.PUB)
        self._inode: int | None = None
        try:
            self._socket.setsockopt(zmq.SNDHWM, send_hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            raise ConfigError(
                f"cannot publish notifications on {endpoint} ({exc}); check that its folder exists and is"
                " writable, or set --notify/MODELLOAD_NOTIFY to another endpoint or 'none'"
            ) from exc
        if self._path is not None:
            self._open_to_the_pod(self._path)

    def _open_to_the_pod(self, path: Path) -> None:
        try:
            path.chmod(SOCKET_MODE)
            info = path.stat()
        except OSError as exc:
            log.warning(
                "cannot open %s to other users in the pod (%s): they may fail to subscribe", path, exc
            )
            return
        if stat.S_ISSOCK(info.st_mode):
            self._inode = info.st_ino

    # --- LoadObserver ---------------------------------------------------------------------------------

    def tensor_ready(self, *, index: int, name: str, nbytes: int) -> None:
        self._send(b"ready", _INDEX.pack(index))

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        """One message for the tensors of one range: their indices, u32 each (docs/contracts.md)."""
        self._send(b"ready", np.asarray(indices, dtype="<u4").tobytes())

    def load_finished(self, *, seconds: float, nbytes: int) -> None:
        self._send(b"done", b"")

    def load_failed(self, *, kind: str, reason: str) -> None:
        cut = reason.encode("utf-8")[:MAX_REASON_BYTES]
        self._send(b"failed", cut.decode("utf-8", "ignore").encode("utf-8"))  # never half a character

    # --- sending and closing --------------------------------------------------------------------------

    def _send(self, topic: bytes, payload: bytes) -> None:
        zmq = self._zmq
        with self._lock:
            if self._socket is None:
                return
            try:
                # A PUB socket drops a message for a subscriber whose queue is full without telling us;
                # NOBLOCK guards against anything else that would make send wait.
                self._socket.send_multipart((topic, payload), flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # zmq.Again included: the state table still has the news
                log.debug("dropped a %s notification: %s", topic.decode(), exc)

    def close(self) -> None:
        """Stop publishing (queued messages are dropped: linger 0) and remove our socket file. Idempotent."""
        with self._lock:
            socket, self._socket = self._socket, None
        if socket is None:
            return
        socket.close(linger=0)
        self._context.term()
        if self._path is not None and self._inode is not None:
            # Only our own file: a newer sidecar may already have bound a socket at the same path.
            with contextlib.suppress(OSError):
                if self._path.stat().st_ino == self._inode:
                    self._path.unlink()

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Notifier {self.endpoint}{'' if self._socket is not None else ' closed'}>"


class FailureMarker:
    """A :class:`~modelload.sidecar.progress.LoadObserver` that leaves ``<segment>.failed`` when the load
    fails before its manifest is published (``modelload.loader.segment.failure``), so an app waiting in
    ``attach()`` for a segment that will never come raises the sidecar's reason at once.

    Building it removes an earlier sidecar's marker, before the status API answers, so an app never reads
    the last run's failure as this one's; a new load removes it too. After the manifest the segment itself
    records a failure, so no marker is written; nor for a stopped load (the pod is going away, and a restart
    loads again).
    """

    def __init__(self, segment: Path) -> None:
        from modelload.loader.segment.failure import remove_failure

        self.segment = segment
        self._published = False
        remove_failure(segment)

    def load_started(self, *, source: str, segment: str) -> None:
        from modelload.loader.segment.failure import remove_failure

        self._published = False
        remove_failure(self.segment)

    def manifest_published(self, *, model_format: str, tensors: int, nbytes: int, notify: str | None) -> None:
        self._published = True

    def load_failed(self, *, kind: str, reason: str) -> None:
        from modelload.loader.segment.failure import write_failure

        if not self._published and kind != "stopped":
            write_failure(self.segment, f"{reason} ({kind})")


def _refuse_a_live_socket(path: Path, endpoint: str) -> None:
    """ConfigError when another process listens at ``path``: libzmq would silently replace its socket file,
    taking its subscribers. A stale file (a sidecar that was killed) refuses connections and is reused."""
    if not path.is_socket():
        if not path.parent.is_dir():
            raise ConfigError(
                f"cannot publish notifications on {endpoint}: the folder {path.parent} does not exist;"
                " create it (it is the segment's folder unless --notify/MODELLOAD_NOTIFY says otherwise)"
            )
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        return
    finally:
        probe.close()
    raise ConfigError(
        f"another process publishes notifications on {endpoint}: give this sidecar its own endpoint"
        " (--notify/MODELLOAD_NOTIFY) or its own segment path"
    )


def _ipc_path(endpoint: str) -> Path | None:
    """The file behind an ``ipc://`` endpoint; None for other transports and Linux's abstract sockets."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    if not path or path.startswith("@") or path == "*":
        return None
    return Path(path).absolute()
