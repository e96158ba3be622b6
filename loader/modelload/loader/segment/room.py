"""Where a new segment goes: its folder, the room its volume has for it, and its pages taken up front.

Before a writer publishes a segment (:meth:`~.writer.SegmentWriter.create`) it checks, in this order, what a
user can fix, each with its own message: the folder exists (:func:`check_folder`: writers never create it,
it is the shared volume's mount point), the volume is writable (:func:`check_writable`: a small read-only
mount is not "full"), and the volume has room for the whole segment (:func:`check_space`), or the error says
what to raise. A check is only a forecast (another writer can fill the volume after it), so the pages are
then taken for real (:func:`reserve_pages`, ``posix_fallocate``), where a full volume is an ordinary error
rather than a SIGBUS on the first write through the mapping.

A writer replacing a segment that is not complete (a sidecar restarted after a crash mid-load) needs room
for the new file while the old one still takes its pages. When both do not fit, :func:`make_room` marks the
old segment FAILED (its readers stop waiting) and removes it, with any temporary file a crashed writer left:
a volume sized for one model then holds the new load. Readers that still map the old file keep its pages
until they let go of it. A COMPLETE segment is never removed here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
from pathlib import Path

from modelload.loader.errors import ConfigError, SegmentError
from modelload.loader.segment.layout import (
    HEADER_LENGTH,
    MAGIC,
    OFF_WRITER_STATE,
    Layout,
    MemoryMode,
    WriterState,
)
from modelload.loader.segment.pages import available_bytes, full_volume_advice
from modelload.loader.segment.previous import supersede
from modelload.loader.segment.volume import FULL, full_volume, volume_full

__all__ = ["check_folder", "check_not_foreign", "check_space", "check_writable", "make_room", "reserve_pages"]

log = logging.getLogger(__name__)


def check_folder(segment: Path) -> None:
    """ConfigError when the segment's folder is missing, or the segment path is a folder itself (the
    volume named instead of a file in it). Writers never create the folder: in a pod it is the shared
    volume's mount point, and a folder made in its place would hold the model in the writer's own
    filesystem, out of the app's sight (the sidecar and ``modelload stage`` agree on this)."""
    if segment.is_dir():
        raise ConfigError(
            f"{segment} is a directory: name the segment file to create in it ({segment / 'model.seg'}, for "
            "example) with --segment/MODELLOAD_SEGMENT"
        )
    folder = segment.absolute().parent
    if not folder.is_dir():
        raise ConfigError(
            f"the segment's folder {folder} does not exist: create it (mkdir -p {folder}), mount the shared"
            " volume there, or name a segment path in an existing folder (--segment/MODELLOAD_SEGMENT)"
        )


def check_not_foreign(segment: Path) -> None:
    """ConfigError when a file at the segment's path is no segment (its first bytes are not the magic): the
    model file itself, or anything else the path was mistyped onto. A starting load sets whatever is there
    aside and removes it, so it is refused instead (``modelload stage`` asks for ``--force``)."""
    try:
        fd = os.open(segment, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO there must not block the start
    except (FileNotFoundError, IsADirectoryError):
        return  # nothing there, or check_folder's case
    except OSError as exc:
        raise ConfigError(f"cannot read {segment} to check it is a segment: {exc.strerror or exc}") from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
        head = os.pread(fd, len(MAGIC), 0) if regular else b""
    finally:
        os.close(fd)
    if head != MAGIC:
        raise ConfigError(
            f"{segment} exists and is not a modelload segment; a load would replace it: name another segment "
            "path (--segment/MODELLOAD_SEGMENT), or remove that file yourself"
        )


def check_writable(directory: Path) -> None:
    """A read-only volume is named as such, before the space checks: a small read-only mount is not "full"."""
    try:
        read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    except OSError:
        return  # check_space reports a missing directory
    if read_only:
        raise SegmentError(
            f"cannot create a segment in {directory}: it is on a read-only file system; mount the volume"
            " read-write there, or choose another folder (--segment/MODELLOAD_SEGMENT)"
        )


def check_space(directory: Path, layout: Layout) -> None:
    """SegmentSpaceError, saying what to raise, when ``directory``'s volume has less room than the
    segment of ``layout`` takes."""
    try:
        available = available_bytes(directory)
    except FileNotFoundError:
        raise SegmentError(
            f"segment directory {directory} does not exist; create it or mount the volume"
        ) from None
    needed = layout.segment_length
    if needed > available and layout.memory_mode == MemoryMode.RING:
        raise volume_full(
            f"ring mode needs {needed} bytes in {directory} (the ring of {layout.ring_size} and the "
            f"segment's header and tables) and the volume has {available} free: raise the volume's "
            "sizeLimit or lower --ring-size"
        )
    if needed > available:
        raise volume_full(
            f"the segment needs {needed} bytes and {directory} has {available} free; "
            + full_volume_advice(directory)
        )


def reserve_pages(fd: int, length: int, target: Path, *, offset: int = 0) -> None:
    """Allocate the pages of bytes ``[offset, offset + length)`` of the segment file ``fd`` now;
    SegmentSpaceError when the volume is full. Where the file system cannot, pages come on first write."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        # Reserving tmpfs pages past the writer's memory limit fails with ENOMEM: the volume is full too. The
        # advice is the volume's own: a hugetlbfs needs huge pages set aside, not a larger sizeLimit.
        full = full_volume(
            exc,
            f"no room for a {length}-byte segment at {target}",
            advice=full_volume_advice(target.parent),
            codes=FULL | {errno.ENOMEM},
        )
        if full is not None:
            raise full from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        log.debug("posix_fallocate is not supported at %s; pages are allocated on first write", target)


def make_room(target: Path, needed: int, load_id: int) -> None:
    """Remove an unfinished segment at ``target`` (and crashed writers' temporary files) when the volume
    cannot hold it and a new ``needed``-byte segment at once; a COMPLETE one is never removed here."""
    try:
        available = available_bytes(target.parent)
    except OSError:
        return  # check_space reports a missing directory
    if needed <= available:
        return
    leftovers = list(target.parent.glob(f".{target.name}.*.tmp"))
    old_state = _writer_state(target)
    if old_state is not None and old_state != WriterState.COMPLETE:
        supersede(target, f"superseded by a new load ({load_id:016x}); attach again")
        leftovers.append(target)
    for path in leftovers:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            log.warning("removed %s, an unfinished segment, to make room for a new load", path)


def _writer_state(target: Path) -> int | None:
    """The writer_state word of the segment at ``target``; None when there is no segment there."""
    try:
        with target.open("rb") as file:
            head = file.read(HEADER_LENGTH)
    except OSError:
        return None
    if len(head) < HEADER_LENGTH or head[: len(MAGIC)] != MAGIC:
        return None
    state: int = struct.unpack_from("<I", head, OFF_WRITER_STATE)[0]
    return state
