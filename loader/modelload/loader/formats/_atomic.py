"""Writing a file that appears whole or not at all: the one policy every writer of model files follows.

The policy, for ``save_file`` and the ``serialize`` command alike:

- the data goes to a hidden temporary file beside the target (``.NAME.XXXX.partial``, same directory, so
  the final rename is atomic);
- its mode is what ``open()`` would give a new file, ``0o666`` less the umask (``mkstemp``'s ``0o600``
  would make a model unreadable to the inference user that ``open()`` lets in);
- on success the file is flushed and ``fsync``'ed, renamed over the target, and the directory ``fsync``'ed
  where it can be opened, so after a crash the target is the old file or the whole new one;
- on any error, or an interrupt, the temporary file is removed.

With ``replace=False`` an existing target is never replaced, also one that appears while the file is being
written: the rename is then a hard link, which fails with FileExistsError (on a filesystem without hard
links, a check just before the rename).
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_file"]

_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


@contextlib.contextmanager
def atomic_file(target: Path, *, replace: bool = True) -> Iterator[IO[bytes]]:
    """A new binary file (read and write) that becomes ``target`` when the block ends without an error."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    temporary = Path(name)
    file = os.fdopen(fd, "w+b")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        yield file
        file.flush()
        os.fsync(file.fileno())
        file.close()
        _rename(temporary, target, replace=replace)
    except BaseException:
        with contextlib.suppress(OSError):  # closing flushes, and a full disk fails that too
            file.close()
        temporary.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # make the rename durable where the directory can be opened
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _rename(temporary: Path, target: Path, *, replace: bool) -> None:
    if replace:
        temporary.replace(target)
        return
    try:
        os.link(temporary, target)
    except OSError as exc:
        if isinstance(exc, FileExistsError) or exc.errno not in _NO_HARD_LINKS:
            raise
        if target.exists():  # a filesystem without hard links: check, then rename
            raise FileExistsError(errno.EEXIST, "the target exists", str(target)) from None
        temporary.replace(target)
    else:
        temporary.unlink()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
