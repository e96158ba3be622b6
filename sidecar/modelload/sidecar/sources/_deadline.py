"""A deadline for the parts of an exchange that come in pieces: a response's status line and headers, a
proxy's answer to CONNECT.

A socket's timeout bounds each wait for bytes, not a whole exchange: a server that sends its headers a byte
every few seconds is never silent for the stall timeout, and ``http.client`` would read such a head for hours
(it takes header lines of up to 64 KiB, a hundred of them). (A TLS handshake needs none: ``ssl`` bounds it as
a whole by the socket's timeout.) Bodies have their rate
floor (``_splice.RateFloor``); these parts, which a healthy server sends at once, have a deadline: one
watchdog thread for the process shuts down the socket of an exchange whose deadline passes, and the read
blocked in it ends at once, as a broken connection does. A :class:`Deadline` says whether it fired: the part
read until then is cut short (``http.client`` takes the end of the stream for the end of the headers), so
whatever came of it is an error, whose message says why.

One thread and a heap, not a timer per request: a load makes thousands of requests, and arming or disarming
a deadline is a push and a flag under a lock.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["Deadline", "DeadlineError"]


class DeadlineError(TimeoutError):
    """A part of an exchange that a healthy server sends at once did not come within its deadline."""


class Deadline:
    """Within a ``with`` block, shut down ``sock`` (or the socket ``sock()`` gives when the deadline passes:
    a connection still being made has none yet) once ``seconds`` have passed; ``fired`` says it did."""

    __slots__ = ("done", "fired", "seconds", "sock")

    def __init__(self, sock: socket.socket | Callable[[], socket.socket | None], seconds: float) -> None:
        self.sock = sock if callable(sock) else (lambda: sock)
        self.seconds = seconds
        self.done = False
        self.fired = False

    def __enter__(self) -> Deadline:
        _WATCHDOG.arm(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _WATCHDOG.disarm(self)

    def error(self, what: str) -> DeadlineError:
        return DeadlineError(f"{what} did not come within {self.seconds:g} s (it came in pieces, too slowly)")


class _Watchdog:
    def __init__(self) -> None:
        self._wake = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, armed: Deadline) -> None:
        with self._wake:
            heapq.heappush(self._heap, (time.monotonic() + armed.seconds, next(self._order), armed))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="source-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is armed:
                self._wake.notify()

    def disarm(self, armed: Deadline) -> None:
        with self._wake:
            armed.done = True  # left in the heap: dropped when its time comes

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._heap:
                    self._wake.wait()
                when, _, armed = self._heap[0]
                now = time.monotonic()
                if when > now and not armed.done:
                    self._wake.wait(when - now)
                    continue
                heapq.heappop(self._heap)
                if armed.done:
                    continue
                armed.fired = True
                sock = armed.sock()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


_WATCHDOG = _Watchdog()
