"""The CRC-32 of each tensor of a range, taken from its bytes just after they landed in the segment.

The segment's state entry records each tensor's CRC-32 (``modelload inspect --verify`` checks it later).
Taken after a 32 MiB range is all in, with seven other readers landing theirs meanwhile, it reads every byte
back from memory. Here the source tells (:func:`~modelload.sidecar.sources.watch_landing`) each part of the
segment a receive has just filled, a few MiB at most, and the CRC is taken while those bytes are still in the
CPU's caches.

A part is accepted only where it continues exactly what came before it: the next address in the same piece,
or the start of the next one. A source that lands bytes in another order, or lands some twice (a retry that
went back), breaks the run, and then no piece of the range reports a CRC, nor does any when the range did not
all come through the watcher: the finisher takes those from the segment, as before. A CRC is never given for
bytes it did not see land once, in order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from modelload.loader.formats.tensorizer.hashes import crc32

__all__ = ["HOT_PIECE", "LandedCrcs"]

HOT_PIECE = 64 << 10
"""The smallest mean piece size of a range whose CRCs are taken as it lands: below it (thousands of small
tensors a range) a check per received part costs more than reading the bytes again once."""

HOT_PART = 64 << 10
"""The smallest mean receive worth a CRC as it lands. Over TLS a receive brings one record, 16 KiB at most:
a CRC per record cost 0.21 CPU-s per GiB where reading the slots back costs 0.065 (one thread, 32 MiB
pieces), and 256 KiB receives cost 0.077. A range whose first :data:`_JUDGED_AFTER` receives average less
is left to the finisher."""
_JUDGED_AFTER = 16


def _address(view: memoryview) -> int | None:
    """Where ``view``'s first byte lies in this process's memory (None where it cannot tell: read-only)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


class LandedCrcs:
    """A :func:`~modelload.sidecar.sources.watch_landing` watcher over the pieces of one range (``views``, in
    range order; ``hashed`` per piece: take its CRC. The readers mark the pieces that are all of their
    tensor, whose CRC is the slot's)."""

    __slots__ = ("_at", "_crcs", "_ends", "_hashed", "_parts", "_piece", "_received", "_starts")

    def __init__(self, views: Sequence[memoryview], hashed: Sequence[bool]) -> None:
        if len(views) != len(hashed):
            raise ValueError(f"{len(views)} views for {len(hashed)} pieces")
        starts = [_address(view) if len(view) else 0 for view in views]
        self._starts = [start or 0 for start in starts]
        self._ends = [start + len(view) for start, view in zip(self._starts, views, strict=True)]
        self._hashed = list(hashed)
        self._crcs = [0] * len(views)
        self._piece: int | None = None  # the piece the next part goes on (len(views): all in); None: broken
        self._at = 0  # the address the next part must start at
        self._parts = self._received = 0  # receives and their bytes, until judged
        if None not in starts:
            self._advance(0)

    def __call__(self, part: memoryview) -> None:
        piece = self._piece
        if not len(part) or piece is None:
            return
        start, ends = _address(part), self._ends
        if start is None or piece == len(ends) or start != self._at or start + len(part) > ends[piece]:
            self._piece = None  # out of order, or landed again: no CRC at all for this range
            return
        if self._parts < _JUDGED_AFTER:
            self._parts += 1
            self._received += len(part)
            if self._parts == _JUDGED_AFTER and self._received < _JUDGED_AFTER * HOT_PART:
                self._piece = None  # receives too small to be worth a CRC each: the finisher takes them
                return
        if self._hashed[piece]:
            self._crcs[piece] = crc32(part, self._crcs[piece])
        self._at = start + len(part)
        if self._at == self._ends[piece]:
            self._advance(piece + 1)

    def _advance(self, piece: int) -> None:
        """Go on at ``piece``, or the first one after it that holds bytes (or past the last)."""
        while piece < len(self._ends) and self._starts[piece] == self._ends[piece]:
            piece += 1
        self._piece = piece
        self._at = self._starts[piece] if piece < len(self._ends) else 0

    def crc_column(self) -> npt.NDArray[np.int64]:
        """Per piece, the CRC-32 of its bytes where it was to be taken (``hashed``) and every byte of the
        range was seen landing once, in order; else -1."""
        seen = self._piece is not None and self._piece == len(self._ends)
        taken = np.asarray(self._hashed, dtype=bool) & seen
        return np.where(taken, np.asarray(self._crcs, dtype=np.int64), -1)
