"""The segment an earlier load left at a path: out of readers' sight while a new load decides about it.

A writer that starts a load does not yet know what the segment already at the path holds compared with
what it is asked for: that takes a look at the source (the files' versions), which may take long or fail.
Until it knows, the old segment must not be attached by name, or an app would start serving the earlier
model (or an earlier version of it). So, holding the segment's lock (:mod:`.lock`), the writer first moves
the segment at the name to ``.<name>.previous`` beside it (SPEC.md, "Writers and loads"); an app attaching
meanwhile finds no segment and waits, as before any load. Then:

- the new load is the very load the old segment holds (:class:`~.identity.LoadIdentity`, and COMPLETE):
  :meth:`Previous.restore` moves it back, and the load is done without reading the model again;
- anything else: :meth:`Previous.discard` marks it FAILED when it was still LOADING (processes attached
  to it stop waiting: :func:`supersede`, which the writer also applies to a LOADING segment its new one
  replaces) and removes it. Processes that map it keep its pages until they let go.

Renames leave the file itself untouched, so processes attached to the old segment are not disturbed, and a
reader of any version only ever finds, by name, the current load's segment (or none).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from modelload.loader.errors import ModelloadError, SegmentError
from modelload.loader.segment import _memory
from modelload.loader.segment.identity import LoadIdentity
from modelload.loader.segment.layout import (
    HEADER_LENGTH,
    MAGIC,
    OFF_ERROR,
    OFF_ERROR_LENGTH,
    OFF_FINISHED_NS,
    OFF_WRITER_STATE,
    MemoryMode,
    WriterState,
    error_bytes,
)
from modelload.loader.segment.pages import mapped_length, volume_of

__all__ = ["Previous", "previous_path", "set_aside", "supersede"]

log = logging.getLogger(__name__)


def previous_path(segment: Path) -> Path:
    """``.<name>.previous`` beside the segment."""
    return segment.with_name(f".{segment.name}.previous")


@dataclass
class Previous:
    """An earlier load's segment, set aside. ``identity`` and ``state`` are None when it could not be read
    (a corrupt file, or not a segment): then it can only be discarded."""

    path: Path
    """Where it sits now (``.<name>.previous``)."""
    segment: Path
    """The name it was set aside from."""
    identity: LoadIdentity | None
    state: WriterState | None
    memory_mode: MemoryMode | None
    metadata: dict[str, str]

    @property
    def complete(self) -> bool:
        return self.state == WriterState.COMPLETE

    def restore(self) -> None:
        """Put it back under its name: the new load is this one."""
        self.path.rename(self.segment)
        log.info("reusing the complete segment at %s: the same load", self.segment)

    def discard(self, reason: str = "superseded by a new load; attach again") -> None:
        """Mark it FAILED if it was still LOADING (with ``reason``), then remove it. Idempotent."""
        if self.state == WriterState.LOADING:
            supersede(self.path, reason)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
            log.info("removed the previous segment of %s (%s)", self.segment, self._what())

    def _what(self) -> str:
        if self.identity is not None:
            return f"{self.identity.source}, {self.state.name if self.state is not None else 'unreadable'}"
        return self.metadata.get("source", "an unreadable segment")


def set_aside(segment: Path) -> Previous | None:
    """Move the segment at ``segment`` to ``.<name>.previous``; return it (or an older one set aside by a
    writer that died before deciding about it), or None when there is neither.

    The caller holds the segment's lock. A file at the name that is not a regular file (a directory, a
    socket) is left where it is: the writer's own checks refuse it.
    """
    aside = previous_path(segment)
    _clear_links(segment, aside)
    kind = _kind(segment)
    if kind == "file":
        if _kind(aside) == "file":  # an older one: the one at the name is newer
            _describe(aside, segment).discard()
        segment.rename(aside)
    if _kind(aside) != "file":
        return None
    return _describe(aside, segment)


def _kind(path: Path) -> str | None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return "file"
    return "link" if stat.S_ISLNK(mode) else "other"


def _clear_links(*paths: Path) -> None:
    """Remove symbolic links at these names (no writer makes them: someone planted them in the volume);
    refuse anything else that is not a file."""
    for path in paths:
        kind = _kind(path)
        if kind == "link":
            path.unlink()
        elif kind == "other":
            raise SegmentError(f"{path} is not a file (a directory?); a segment cannot replace it: remove it")


def _describe(path: Path, segment: Path) -> Previous:
    from modelload.loader.segment.reader import SegmentReader

    try:
        with SegmentReader.open(path) as reader:
            return Previous(
                path=path,
                segment=segment,
                identity=LoadIdentity.from_metadata(reader.metadata),
                state=reader.writer_state,
                memory_mode=reader.memory_mode,
                metadata=dict(reader.metadata),
            )
    except (ModelloadError, OSError, ValueError) as exc:
        log.info("the previous segment at %s cannot be read (%s): it will be removed", segment, exc)
        return Previous(path, segment, None, None, None, {})


def supersede(target: Path, reason: str) -> None:
    """Mark a LOADING segment at ``target`` FAILED with ``reason``, so its readers stop waiting (SPEC.md
    writer rule 4). Anything else at ``target`` is left alone."""
    try:
        fd = os.open(target, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_LENGTH:
            return
        length = min(mapped_length(HEADER_LENGTH, volume_of(fd)), size)
        with mmap.mmap(fd, length, flags=mmap.MAP_SHARED) as old:
            loading = struct.unpack_from("<I", old, OFF_WRITER_STATE)[0] == WriterState.LOADING
            if old[: len(MAGIC)] != MAGIC or not loading:
                return
            encoded = error_bytes(reason)
            old[OFF_ERROR : OFF_ERROR + len(encoded)] = encoded
            struct.pack_into("<I", old, OFF_ERROR_LENGTH, len(encoded))
            struct.pack_into("<Q", old, OFF_FINISHED_NS, time.time_ns())
            _memory.release_fence()
            struct.pack_into("<I", old, OFF_WRITER_STATE, WriterState.FAILED)
    except (OSError, ValueError) as exc:
        log.warning("could not mark the previous segment at %s superseded: %s", target, exc)
    finally:
        os.close(fd)
