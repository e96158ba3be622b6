"""Receiving a long body in batches: the socket wakes its reader once a batch is queued, not per packet.

A reader waiting on a socket is woken, by default, as soon as any byte arrives: on a fast link that is every
few tens of KiB, and each wake-up is a poll, a receive of a small piece and a trip through the scheduler. The
socket's low-water mark (``SO_RCVLOWAT``) moves the threshold: poll reports the socket readable, and the
kernel wakes the reader, only once that many bytes are queued (Linux grows the receive buffer to twice the
mark, so the sender is not throttled meanwhile, and caps the mark at half of ``net.ipv4.tcp_rmem``'s
maximum). Measured here (1 GiB from nginx on loopback into a hugetlbfs segment, 8 readers, 2 cores, the
code before and after in the same rounds, median of 3, load average 4-6, two runs), a 4 MiB mark took the
sidecar from 0.52-0.58 to 0.44 CPU-s per GiB, and bare ranged GETs into a mapping from 0.43-0.47 to
0.30-0.33. The sidecar and nginx together went from 0.77-0.87 to 0.75-0.76: on loopback, part of the gain is
TCP work done in nginx's turn rather than the sleeping reader's. A body spliced into a file waits for its
batches too (``_splice.splice_socket``): from nginx, which sends large pieces, that changed nothing, but from
s3rver, whose Node server writes 64 KiB at a time, it took the sidecar from 1.26 to 0.87 CPU-s per GiB.

Three rules keep it safe:

- **never more than the body still owes**: the mark is at most the bytes the current body has left, so its
  last bytes always wake the reader; and it goes back to 1 when the body ends (:meth:`LowWater.reset`,
  before the connection carries the next request, whose headers are a few hundred bytes);
- **a slow sender is read as it comes**: while the mark is up, the socket waits at most a probe at a time
  (:data:`PROBE`, or a quarter of the stall timeout if that is shorter); a wait that ends with bytes queued
  below the mark turns batching off for the rest of the body (a link slower than a batch per probe gains
  nothing from it), and those bytes are read at once;
- **a stall is still a stall**: waits that end with nothing queued add up, and only when they reach the
  stall timeout does the receive fail, as it would have without the mark. Bytes found queued at a probe
  may have come at its start, so silence is noticed at most one probe later than without the mark (30.5 s
  instead of 30 s by default).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios

__all__ = ["BATCH", "PROBE", "LowWater"]

BATCH = 4 << 20
"""The low-water mark of a long body: 4 MiB (1 MiB saved about half as much, 256 KiB nothing; 16 MiB a
little more, for up to 32 MiB of kernel memory per connection)."""
SHORTEST = 256 << 10
"""Bodies with fewer bytes left than this are received as they come: a batch would not save a wake-up."""
PROBE = 0.5
"""The longest single wait while the mark is up, in seconds: bytes below the mark wait no longer than this
(nor than a quarter of the stall timeout)."""
_SIOCINQ = getattr(termios, "FIONREAD", 0x541B)
_HAVE_MARK = hasattr(socket, "SO_RCVLOWAT")


class LowWater:
    """The low-water mark of one plain TCP socket while it receives one body (``stall_timeout``: the
    socket's own timeout, restored whenever the mark is down)."""

    __slots__ = ("_mark", "_off", "_probe", "_sock", "_stall_timeout", "_waited")

    def __init__(self, sock: socket.socket, stall_timeout: float) -> None:
        self._sock = sock
        self._stall_timeout = stall_timeout
        self._probe = min(PROBE, stall_timeout / 4)
        self._mark = 1
        self._off = not _HAVE_MARK
        self._waited = 0.0

    def expect(self, remaining: int) -> None:
        """The body has ``remaining`` bytes left, none of them buffered in this process: wake the reader
        when a batch of them is queued."""
        self._waited = 0.0
        if self._off:
            return
        mark = min(BATCH, remaining) if remaining >= SHORTEST else 1
        if mark != self._mark:
            self._set(mark)

    def waited(self) -> bool:
        """A receive timed out: True to receive again (bytes are queued below the mark, which is now down
        for the rest of the body; or nothing came yet but the stall timeout has not passed), False for a
        stall: no byte for the stall timeout."""
        if self._mark == 1:
            return False
        queued = struct.unpack("i", fcntl.ioctl(self._sock.fileno(), _SIOCINQ, b"\0\0\0\0"))[0]
        if queued:
            self._off = True
            self._set(1)
            return True
        self._waited += self._probe
        if self._waited < self._stall_timeout:
            return True
        self._set(1)
        return False

    @property
    def wait_seconds(self) -> float:
        """How long one wait for bytes may last now: a probe while the mark is up, the stall timeout else."""
        return self._probe if self._mark != 1 else self._stall_timeout

    def reset(self) -> None:
        """The body ended: wake on every byte again (the next answer's headers are short)."""
        if self._mark != 1:
            self._set(1)

    def _set(self, mark: int) -> None:
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
        if (mark == 1) != (self._mark == 1):
            self._sock.settimeout(self._stall_timeout if mark == 1 else self._probe)
        self._mark = mark
