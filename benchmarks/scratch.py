"""The benchmarks' work folder: in /dev/shm, as a pod's segment volume is memory, and removed afterwards."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def scratch(prefix: str, *, keep: bool = False) -> Iterator[Path]:
    """A fresh folder in /dev/shm (the temp folder where there is none), removed at the end unless ``keep``."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield work
    finally:
        if keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
