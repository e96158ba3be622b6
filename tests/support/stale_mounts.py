"""Volumes that killed runs of the suite left mounted, unmounted when a new run starts.

The huge-page and full-volume tests mount hugetlbfs and tmpfs volumes under their ``tmp_path`` and unmount
them when they end. A run killed in between (a timeout, ^C) leaves them mounted: a hugetlbfs volume with a
file on it keeps its huge pages from the pool, so the next run's huge-page tests find too few, and pytest
cannot delete the old folder. pytest marks the folder of each live run with a ``.lock`` file holding its
process id (and removes it when the run ends), so a mount under a folder without a live lock is a dead
run's, and is unmounted; a run going on beside this one keeps its volumes.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import tempfile
from pathlib import Path

__all__ = ["default_root", "unmount_stale"]


def default_root() -> Path:
    """Where pytest makes each run's folder by default (``pytest-of-USER`` in the temp directory)."""
    return Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}"


def unmount_stale(root: Path) -> list[Path]:
    """Unmount (lazily) every volume mounted under a run folder of ``root`` whose run is over; returns
    their mount points. Needs root; without it, or without ``/proc/self/mounts``, does nothing."""
    if os.geteuid() != 0:
        return []
    try:
        table = Path("/proc/self/mounts").read_text()
    except OSError:
        return []
    root = root.resolve()
    done: list[Path] = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        point = Path(fields[1].replace("\\040", " "))
        try:
            run = root / point.relative_to(root).parts[0]
        except (ValueError, IndexError):
            continue
        if run == point or _live(run):
            continue
        if subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False).returncode == 0:
            done.append(point)
    return done


def _live(run: Path) -> bool:
    """Whether ``run``'s pytest is still running: its ``.lock`` names a process that exists."""
    try:
        pid = int((run / ".lock").read_text().strip() or 0)
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
