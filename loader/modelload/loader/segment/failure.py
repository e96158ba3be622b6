"""The failure marker: how a writer tells readers that a load failed before any segment existed.

Once a segment is published, a failure is recorded in it (its writer state turns FAILED, with a reason),
and a reader waiting for a tensor raises at once. Before that (the object does not exist, access is
denied, the key is missing, the volume is full) there is no segment to record it in, and a reader waiting
for the segment to appear would wait its whole timeout and then guess. So the writer leaves a small file
beside where the segment would be, ``<segment>.failed``, holding the reason as UTF-8 text, and removes it
when a load starts again. A reader that finds the marker and no segment raises
:class:`~modelload.loader.errors.LoadFailedError` with that reason.

A file rather than only the sidecar's ``/status``: it needs no HTTP client, no network policy and no port
in the loader, works for ``modelload stage`` as well, and is in the volume both containers already share.
It is written whole (a temporary file renamed into place) so a reader never sees half a reason, and read
with a size bound. Reasons hold no credentials (the error tree's rule), so the file is world-readable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from modelload.loader.segment._regular import NotRegularFileError, open_regular

if TYPE_CHECKING:
    from modelload.loader.segment.writer import SegmentWriter

log = logging.getLogger(__name__)

__all__ = [
    "MAX_REASON_BYTES",
    "leave_failed",
    "marker_path",
    "read_failure",
    "remove_failure",
    "write_failure",
]

MAX_REASON_BYTES = 4096
"""A reason is cut to this many bytes; a longer marker file is read only this far."""

_HIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp"})
"""Unicode categories never shown from a marker: control, format (bidi overrides), line and paragraph
separators."""
_SPACES = re.compile(r" {2,}")


def marker_path(segment: Path) -> Path:
    """``<segment>.failed``, beside the segment."""
    return segment.with_name(segment.name + ".failed")


def write_failure(segment: Path, reason: str) -> bool:
    """Leave the marker for ``segment`` (replacing an older one); False where it cannot be written (a
    read-only or full volume): the failure is logged anyway, and a FAILED segment says it too."""
    target = marker_path(segment)
    text = reason.encode("utf-8", "replace")[:MAX_REASON_BYTES].decode("utf-8", "ignore")
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}")
    try:
        temporary.write_text(text, encoding="utf-8")
        temporary.chmod(0o644)
        temporary.replace(target)
    except OSError:
        with contextlib.suppress(OSError):
            temporary.unlink()
        return False
    return True


def remove_failure(segment: Path) -> None:
    """Remove the marker of an earlier load, if any (a new load is starting)."""
    with contextlib.suppress(OSError):
        marker_path(segment).unlink()


def read_failure(segment: Path) -> str | None:
    """The reason in ``segment``'s marker, or None when there is no marker (or it cannot be read).

    The writer leaves only a regular file here, so anything else at the name (a FIFO, a directory, a device,
    a symbolic link to any file) is not a reason to read: opening a FIFO would block for ever, and a link to
    ``/etc/shadow`` or ``/dev/zero`` would put that file's bytes in the app's error and logs. It is reported
    instead as what it is, a failed load whose reason says the marker is not a regular file and to remove it:
    a marker is read before the segment (SPEC.md reader rule 6) and a stray regular marker fails the attach
    too, so this keeps the rule "a clear error, never wrong data" without reading anything but the writer's
    own kind of file. The text shown has its control characters (terminal escapes, newlines that would forge
    log lines) replaced by spaces.
    """
    target = marker_path(segment)
    try:
        fd = open_regular(target, os.O_RDONLY, what="failure marker", follow=False)
    except NotRegularFileError as exc:
        return str(exc)
    except OSError:
        return None
    try:
        data = os.read(fd, MAX_REASON_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _printable(data.decode("utf-8", "replace")) or "no reason given"


def _printable(text: str) -> str:
    """``text`` with every control or format character (C0, DEL, C1, line separators, bidi overrides) made a
    space, runs of spaces made one, and stripped."""
    shown = "".join(" " if unicodedata.category(c) in _HIDDEN else c for c in text)
    return _SPACES.sub(" ", shown).strip()


def leave_failed(
    segment: Path, reason: str, *, writer: SegmentWriter | None = None, marker: bool = True
) -> str | None:
    """Leave a failed load as readers must find it, holding no memory: the segment ``writer`` published is
    marked FAILED with ``reason`` (processes that map it stop waiting and let go of it), the marker gets the
    reason (a process attaching later fails with it), and the segment is removed from the name (its pages go
    once nobody maps it). Where the marker cannot be written (a full volume), the FAILED segment stays: it
    then is what tells. ``marker=False`` (a load that will be tried again) writes none: a process attaching
    meanwhile waits for the next attempt. Returns None, or what the caller must tell the user when the
    segment could not be removed (where it is, and how to remove it).
    """
    if writer is not None:
        from modelload.loader.errors import SegmentError

        with contextlib.suppress(SegmentError):  # closed: the failure came while publishing
            writer.mark_failed(reason)
    if marker and not write_failure(segment, reason):
        return None  # a full volume: the FAILED segment stays, the one place that holds the reason
    if writer is None or not _is_ours(segment, writer):
        return None
    try:
        segment.unlink()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return (
            f"the failed segment {segment} could not be removed ({exc.strerror or exc}) and holds memory:"
            f" remove it with `rm {segment}`"
        )
    log.info("removed the failed segment %s; the reason is in %s", segment, marker_path(segment))
    return None


def _is_ours(segment: Path, writer: SegmentWriter) -> bool:
    """Whether the name still holds the writer's file (and not a newer writer's)."""
    try:
        return segment.stat().st_ino == os.fstat(writer.fileno()).st_ino
    except (OSError, ValueError):
        return False
