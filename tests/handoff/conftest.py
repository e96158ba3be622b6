"""Fixtures of the hand-off tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for sockets (a Unix socket path must stay under 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="ml-keeper-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
