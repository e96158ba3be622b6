"""Landing a range of many small tensors through the segment's file descriptor, a few system calls a MiB.

A chunk of neighbouring small tensors (a mixture of experts: thousands of 4-16 KiB tensors a shard) is one
range of its weight file, but each tensor goes to its own slot in the segment (on a page, or in a packed
segment right after the one before it, as the file holds them). Spliced, that is two system calls per
tensor; written through the mapping of a 4 KiB-page volume, it is a page fault per page (after
``fallocate`` zeroed each one), which profiles put at a third of such a load's CPU.
Here the range comes into a reused buffer of the reader thread a window at a time
(:func:`~modelload.sidecar.sources.read_range_into_sink`), and each window goes into the segment file with
one ``pwritev``: an iovec per piece, at its slot, and the padding between neighbouring slots written as
zeros in the same call, so one call covers the window's whole span of the file. The kernel copies into
the file's pages itself, allocating them as it goes: no page fault in this process, and a full volume is
ENOSPC (:class:`~modelload.loader.errors.SegmentSpaceError`), never a SIGBUS.

The CRC-32 of each piece that is all tensor data is taken from the buffer while it is hot: the segment's
state entry records it (combined with the CRC-32s of its other pieces for a tensor cut across ranges, see
:func:`~modelload.loader.formats.tensorizer.hashes.crc32_combine`) without a second pass over the slot.

Only padding is ever written with zeros: two pieces are written as one run only when they are consecutive
tensors of the layout (slots are laid out in tensor order, so nothing else lies between them) and their gap
is at most :data:`MAX_GAP`. A ring segment's bytes wrap, so it keeps the mapping path.
"""

from __future__ import annotations

import os
from bisect import bisect_left, bisect_right
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from modelload.loader.formats.tensorizer.hashes import crc32_bytes
from modelload.loader.segment.volume import full_volume
from modelload.sidecar.planner import Chunk, LoadPlan

__all__ = ["MAX_GAP", "ChunkScatter", "Neighbours"]

MAX_GAP = 64 << 10
"""The most padding between two pieces written as zeros to keep them in one ``pwritev``: a slot's padding
is under its alignment plus its record header's lead, so in a plan's layout only a foreign piece breaks a
run."""
_ZEROS = memoryview(bytes(MAX_GAP))
_IOV_MAX = 1024
"""The most buffers one ``pwritev`` takes (Linux's IOV_MAX)."""


class Neighbours:
    """Per piece of a load plan: whether the gap to the next piece may be written as zeros (``joined``),
    whether the next piece starts right where it ends (``touching``: a packed segment's neighbours) and
    whether the piece is all tensor data (``hashed``: its CRC-32 is the slot's, or a part of it). Worked out
    once per load, over the plan's arrays."""

    def __init__(self, plan: LoadPlan) -> None:
        pieces = plan.pieces
        gap = pieces.dst[1:] - (pieces.dst[:-1] + pieces.length[:-1])
        consecutive = pieces.tensor[1:] == pieces.tensor[:-1] + 1
        joined = np.zeros(len(pieces), dtype=bool)
        joined[:-1] = consecutive & (gap >= 0) & (gap <= MAX_GAP)
        touching = np.zeros(len(pieces), dtype=bool)
        touching[:-1] = consecutive & (gap == 0)
        self.joined: npt.NDArray[np.bool_] = joined
        self.touching: npt.NDArray[np.bool_] = touching
        self.hashed: npt.NDArray[np.bool_] = pieces.data == pieces.length
        self._plan = plan

    def sink(self, chunk: Chunk, fd: int) -> ChunkScatter:
        """The sink that writes ``chunk``'s bytes into the segment file ``fd`` (not a ring's)."""
        pieces, span = self._plan.pieces, slice(chunk.first, chunk.first + chunk.count)
        return ChunkScatter(
            fd,
            dst=pieces.dst[span].tolist(),
            length=pieces.length[span].tolist(),
            joined=self.joined[span].tolist(),
            hashed=self.hashed[span].tolist(),
            contiguous=bool(self.touching[chunk.first : chunk.first + chunk.count - 1].all()),
        )


class ChunkScatter:
    """A :data:`~modelload.sidecar.sources.RangeSink` for one chunk: ``sink(data, at)`` writes range bytes
    ``[at, at + len(data))`` into their slots of file ``fd``; pieces ``dst``/``length`` in range order.

    Bytes must come in order; bytes it already had (a source that resumed early) are skipped, so each
    piece's CRC-32 covers each byte once. :meth:`crc_column` after the last byte; ``hashed`` per piece: take
    its CRC-32. ``contiguous``: each piece starts in the file where the one before ends (a packed segment),
    so a window is one buffer written at one offset, whatever number of tensors it holds."""

    __slots__ = ("_contiguous", "_crcs", "_done", "_dst", "_ends", "_fd", "_hashed", "_joined", "_starts")

    def __init__(
        self,
        fd: int,
        *,
        dst: list[int],
        length: list[int],
        joined: list[bool],
        hashed: list[bool],
        contiguous: bool = False,
    ):
        self._fd = fd
        self._contiguous = contiguous
        self._dst, self._joined, self._hashed = dst, joined, hashed
        self._ends = list(accumulate(length))
        self._starts = [0, *self._ends[:-1]]
        self._crcs = [0] * len(dst)
        self._done = 0

    def __call__(self, data: memoryview, at: int) -> None:
        if data.ndim != 1 or data.format != "B":
            data = data.cast("B")
        if at < self._done:  # the part already written, sent again
            data, at = data[self._done - at :], self._done
        if at != self._done:
            raise ValueError(f"range bytes from {at} came before bytes {self._done}-{at - 1}")
        end = at + len(data)
        if self._contiguous and self._ends and end > self._ends[-1]:  # never past the chunk's last piece
            data = data[: max(self._ends[-1] - at, 0)]
            end = at + len(data)
        self._hash(data, at, end)
        if self._contiguous:
            if data:
                _write(self._fd, [data], self._dst[0] + at, len(data))
            self._done = end
            return
        starts, ends, dst, joined = self._starts, self._ends, self._dst, self._joined
        iovs: list[memoryview] = []
        run_at = expect = 0  # where the run being gathered starts in the file, and where it ends so far
        i = bisect_right(ends, at)
        while i < len(ends) and starts[i] < end:
            low = max(starts[i], at)
            part = data[low - at : min(ends[i], end) - at]
            file_at = dst[i] + low - starts[i]
            if iovs:
                gap = file_at - expect
                if gap < 0 or (gap and not joined[i - 1]) or len(iovs) >= _IOV_MAX - 1:
                    _write(self._fd, iovs, run_at, expect - run_at)
                    iovs = []
                elif gap:
                    iovs.append(_ZEROS[:gap])
            if not iovs:
                run_at = file_at
            iovs.append(part)
            expect = file_at + len(part)
            i += 1
        if iovs:
            _write(self._fd, iovs, run_at, expect - run_at)
        self._done = end

    def _hash(self, data: memoryview, at: int, end: int) -> None:
        """Take the CRC-32 of each hashed piece's part in range bytes ``[at, end)``, held by ``data``: the
        pieces wholly inside in one pass (a window holds a hundred tensors of a mixture of experts), the
        one cut at each edge continued from what came before."""
        starts, ends, hashed, crcs = self._starts, self._ends, self._hashed, self._crcs
        first, stop = bisect_right(ends, at), bisect_left(starts, end)
        inner, outer = first + (starts[first] < at if first < stop else 0), stop
        if inner < outer and ends[outer - 1] > end:
            outer -= 1
        crcs[inner:outer] = [
            crc32_bytes(data[low - at : high - at]) if wanted else 0
            for low, high, wanted in zip(
                starts[inner:outer], ends[inner:outer], hashed[inner:outer], strict=True
            )
        ]
        for i in {first, stop - 1} - set(range(inner, outer)):
            if first <= i < stop and hashed[i]:
                crcs[i] = crc32_bytes(data[max(starts[i], at) - at : min(ends[i], end) - at], crcs[i])

    def crc_column(self) -> npt.NDArray[np.int64]:
        """Per piece, the CRC-32 of its bytes where it was to be taken (``hashed``), else -1."""
        if self._done < (self._ends[-1] if self._ends else 0):
            raise RuntimeError(f"the range is not all in: {self._done} of {self._ends[-1]} bytes")
        return np.where(np.asarray(self._hashed, dtype=bool), np.asarray(self._crcs, dtype=np.int64), -1)


def _write(fd: int, iovs: list[memoryview], offset: int, total: int) -> None:
    """``pwritev`` all ``total`` bytes of ``iovs`` at ``offset`` of ``fd``, however many calls it takes."""
    written = 0
    try:
        while True:
            count = os.pwritev(fd, iovs, offset + written)
            written += count
            if written >= total:
                return
            if count == 0:
                raise OSError(f"pwritev wrote nothing at offset {offset + written} of the segment")
            iovs = _after(iovs, count)  # a short write (a signal, the volume filling up): on from there
    except OSError as exc:
        full = full_volume(exc, f"no room left to write {total} bytes at offset {offset} of the segment")
        if full is not None:
            raise full from exc
        raise


def _after(iovs: list[memoryview], count: int) -> list[memoryview]:
    """``iovs`` less their first ``count`` bytes."""
    for first, iov in enumerate(iovs):
        if count < len(iov):
            return [iov[count:], *iovs[first + 1 :]]
        count -= len(iov)
    return []
