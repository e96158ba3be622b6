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
import secrets
from pathlib import Path

__all__ = ["MAX_REASON_BYTES", "marker_path", "read_failure", "remove_failure", "write_failure"]

MAX_REASON_BYTES = 4096
"""A reason is cut to this many bytes; a longer marker file is read only this far."""


def marker_path(segment: Path) -> Path:
    """``<segment>.failed``, beside the segment."""
    return segment.with_name(segment.name + ".failed")


def write_failure(segment: Path, reason: str) -> None:
    """Leave the marker for ``segment`` (replacing an older one); silently nothing where it cannot be written
    (a read-only or full volume): the marker is a courtesy to readers, and the failure is logged anyway."""
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


def remove_failure(segment: Path) -> None:
    """Remove the marker of an earlier load, if any (a new load is starting)."""
    with contextlib.suppress(OSError):
        marker_path(segment).unlink()


def read_failure(segment: Path) -> str | None:
    """The reason in ``segment``'s marker, or None when there is no marker."""
    try:
        with marker_path(segment).open("rb") as file:
            data = file.read(MAX_REASON_BYTES)
    except OSError:
        return None
    return data.decode("utf-8", "replace").strip() or "no reason given"
