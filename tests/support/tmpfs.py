"""Small tmpfs volumes of their own, for tests of a full or read-only volume.

Mounting needs root (CAP_SYS_ADMIN). Without it the test skips on a developer's machine and fails under
``make test`` (``MODELLOAD_REQUIRE_SERVERS=1``), like a missing server (:func:`tests.conftest.require`):
the full-volume tests must never pass by skipping in CI.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import require

__all__ = ["tmpfs"]


@contextlib.contextmanager
def tmpfs(path: Path, *, size: int | str, read_only: bool = False) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (bytes, or mount's own spelling such as ``1m``) at ``path`` (created), and
    unmount it after. The unmount is lazy: a thread that still holds a file there (a sidecar's memory
    thread finishing) does not keep the mount behind."""
    path.mkdir(exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    if os.geteuid() == 0:
        command = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)]
        done = subprocess.run(command, capture_output=True, check=False)
        why = " ".join(done.stderr.decode(errors="replace").split()) or f"mount exited {done.returncode}"
        mounted = done.returncode == 0
    else:
        why, mounted = "this user is not root", False
    require(mounted, f"mounting a tmpfs needs root with CAP_SYS_ADMIN ({why})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
