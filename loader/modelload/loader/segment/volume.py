"""The one error for a full volume, whoever writes the segment or what sits beside it.

A segment lives on a memory-backed volume (tmpfs, a pod's ``emptyDir`` with ``medium: Memory``) whose room is
its size limit and, since tmpfs pages are charged to the writer's memory cgroup, the writer's memory limit.
Running out of either is an ordinary mistake of sizing, not a bug: whoever meets it (reserving the segment's
pages, splicing a range into it, a local copy, the model's small files) says so with a
:class:`~modelload.loader.errors.SegmentSpaceError` built here, which keeps the system's errno and reads as
one sentence of what found no room and what to do.

(A write through a mapping into a full tmpfs is no error at all but a SIGBUS that kills the process: the
writer reserves pages up front so that it meets ENOSPC here instead, see :mod:`.writer`.)
"""

from __future__ import annotations

import errno
import os

from modelload.loader.errors import SegmentSpaceError

__all__ = ["FULL", "RAISE_THE_LIMITS", "full_volume", "volume_full"]

FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errnos of a write that found the volume full: no space, or the quota (of a project or a user) spent."""

RAISE_THE_LIMITS = (
    "the volume is full: raise its sizeLimit (emptyDir medium: Memory) and the writer's memory limit (tmpfs "
    "pages count against it)"
)
"""What to do, for a writer on a pod's memory-backed volume."""


def volume_full(message: str, *, code: int = errno.ENOSPC) -> SegmentSpaceError:
    """The error for a full volume: ``message`` is its whole text (no ``[Errno N]`` prefix), ``code`` its
    errno (the error is an OSError too)."""
    error = SegmentSpaceError(message)
    error.errno = code
    return error


def full_volume(
    exc: OSError, what: str, *, advice: str = RAISE_THE_LIMITS, codes: frozenset[int] = FULL
) -> SegmentSpaceError | None:
    """``exc`` as the full-volume error when its errno is one of ``codes``, else None (the caller translates
    it otherwise). ``what`` says what found no room; the message adds the system's reason and ``advice``."""
    if exc.errno not in codes:
        return None
    reason = exc.strerror or os.strerror(exc.errno)
    return volume_full(f"{what}: {reason}; {advice}", code=exc.errno)
