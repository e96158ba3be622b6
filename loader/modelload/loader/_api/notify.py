"""Waking up when the sidecar publishes a tensor, without spinning: a pyzmq subscription.

The sidecar publishes on a PUB socket (an ``ipc://`` endpoint in the segment's volume): topic ``ready`` with
the tensor's index, ``done``, or ``failed`` with a reason. A subscriber only uses them as hints to look at
the segment again; the segment's state table stays the truth. So a late join (pyzmq drops messages sent
before a subscription is in place), a dropped message, or a sidecar that never publishes costs at most one
wait period, never a hang or a wrong answer.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Subscriber", "connect"]

log = logging.getLogger(__name__)


class Subscriber:
    """A SUB socket connected to the sidecar's endpoint; :meth:`wait` blocks until a message or timeout."""

    def __init__(self, endpoint: str, context: Any, socket: Any) -> None:
        self.endpoint = endpoint
        self._context = context
        self._socket = socket
        self._poller = _poller(socket)

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a message, then drain every message already queued. True when
        a message came (the caller looks at the segment again), False when the time ran out."""
        if self._poller is None or not self._poller.poll(max(int(timeout * 1000), 0)):
            return False
        import zmq

        try:
            while self._socket.recv_multipart(flags=zmq.NOBLOCK):
                pass
        except zmq.Again:
            pass
        return True

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
            self._poller = None

    def __repr__(self) -> str:
        return f"<Subscriber {self.endpoint}>"


def _poller(socket: Any) -> Any:
    import zmq

    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    return poller


def connect(endpoint: str) -> Subscriber | None:
    """Subscribe to every message at ``endpoint``; None (polling instead) when pyzmq is not usable."""
    try:
        import zmq
    except ImportError:
        log.info("pyzmq is not installed: waiting for tensors by polling the segment")
        return None
    context: Any = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.RCVHWM, 100_000)
        socket.connect(endpoint)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        log.warning("cannot subscribe to %s (%s): waiting for tensors by polling the segment", endpoint, exc)
        return None
    return Subscriber(endpoint, context, socket)
