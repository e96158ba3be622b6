"""Opening the files beside a segment only when they are regular files.

Every container of the pod that mounts the model volume writable can leave anything at the names the loader
opens: the segment, its failure marker, its consumer table. The sidecar writes only regular files there, so
anything else (a FIFO, a directory, a device, a socket, a link where none is followed) was put there by
something else, and must be refused with an error that says so, not read: ``open()`` of a FIFO blocks until
a writer comes (for ever, ignoring any timeout), a directory or a device fails deep inside a read with an
``OSError`` that names neither the file nor the fix, and ``/dev/zero`` or a link to another file would be
read as if the sidecar had written it.

:func:`open_regular` opens with ``O_NONBLOCK`` (a FIFO opens at once instead of waiting for a writer),
checks the open file with ``fstat`` (the file read is the file checked: no race between a check and the
open), refuses anything but a regular file with :class:`NotRegularFileError` naming the path and what it
is (:attr:`NotRegularFileError.file_kind`), and clears ``O_NONBLOCK`` again on the regular file it returns.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from modelload.loader.errors import SegmentLayoutError

__all__ = ["NotRegularFileError", "describe_mode", "open_regular"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symbolic link"),
)

# What os.open answers for a file it cannot open as asked because of its kind: a directory opened for
# writing (EISDIR), a socket (ENXIO), a link under O_NOFOLLOW (ELOOP).
_KIND_ERRNOS = frozenset({errno.EISDIR, errno.ENXIO, errno.ELOOP})


class NotRegularFileError(SegmentLayoutError):
    """A name beside a segment holds something other than a regular file (the sidecar writes only those)."""

    def __init__(self, what: str, path: Path, kind: str) -> None:
        self.path = path
        self.file_kind = kind
        """What is there: 'a FIFO (named pipe)', 'a directory', ..."""
        if what == "segment" and kind == "a directory":  # the volume named instead of the file in it?
            super().__init__(
                f"the segment {path} is a directory, not a regular file: if it is the folder the segment is "
                f"in, name the file in it ({path / 'model.seg'}, for example) with attach(path) or "
                "MODELLOAD_SEGMENT; the sidecar writes only regular files, so a directory at the segment's "
                "own name was put there by something else: remove that one"
            )
            return
        super().__init__(
            f"the {what} {path} is {kind}, not a regular file: the modelload sidecar writes only regular"
            " files there, so something else put it there; remove it"
        )


def describe_mode(mode: int) -> str:
    """What a file of ``mode`` is, for a message: 'a FIFO (named pipe)', 'a directory', ..."""
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def open_regular(path: Path, flags: int, *, what: str, follow: bool = True) -> int:
    """Open ``path`` with ``flags`` (plus ``O_CLOEXEC``) when it is a regular file, without ever blocking.

    ``follow=False`` refuses a symbolic link at ``path`` itself. Raises :class:`NotRegularFileError` (``what``
    names the file in its message) for anything but a regular file, and ``OSError`` as :func:`os.open` does
    otherwise (``FileNotFoundError``, ``PermissionError``...), for the caller to explain.
    """
    extra = os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags | extra)
    except OSError as exc:
        if exc.errno not in _KIND_ERRNOS:
            raise
        try:
            mode = path.stat(follow_symlinks=follow).st_mode
        except OSError:
            raise exc from None
        if stat.S_ISREG(mode):
            raise  # not the file's kind (a loop among links further up, say): os.open's own error
        raise NotRegularFileError(what, path, describe_mode(mode)) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(what, path, describe_mode(mode))
        with contextlib.suppress(OSError):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
