"""Fixtures shared by every tier of the suite.

Tests that need a real server (nginx, moto's S3 server) or an optional package skip when it is missing on a
developer's machine, and fail under ``make test`` (which sets MODELLOAD_REQUIRE_SERVERS=1), so CI can never
pass by skipping what it was meant to run.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE_SERVERS = os.environ.get("MODELLOAD_REQUIRE_SERVERS") == "1"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Unmount the volumes a killed run of the suite left mounted (:mod:`tests.support.stale_mounts`): a
    hugetlbfs volume left behind keeps huge pages this run's huge-page tests need."""
    from tests.support.stale_mounts import default_root, unmount_stale

    unmount_stale(default_root())


def require(condition: bool, reason: str) -> None:
    """Skip the test when ``condition`` is false, or fail it when the run requires every server."""
    if condition:
        return
    if REQUIRE_SERVERS:
        pytest.fail(f"required for this run: {reason}")
    pytest.skip(reason)


def find_executable(name: str) -> str | None:
    """An executable beside this Python (a tool from a wheel in the virtualenv, which ``make test`` runs
    without activating), on PATH, or in the sbin folders Debian installs servers into."""
    here = str(Path(sys.executable).parent)
    return (
        shutil.which(name, path=here)
        or shutil.which(name)
        or shutil.which(name, path="/usr/sbin:/usr/local/sbin:/sbin")
    )


@pytest.fixture
def shm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh folder on a memory-backed filesystem when there is one (/dev/shm), else a temp folder."""
    base = Path("/dev/shm")
    if base.is_dir() and os.access(base, os.W_OK):
        path = Path(os.path.join(base, f"modelload-test-{os.getpid()}-{os.urandom(4).hex()}"))
        path.mkdir()
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path_factory.mktemp("shm")


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own, for tests of a full volume (needs root: :mod:`tests.support.tmpfs`)."""
    from tests.support.tmpfs import tmpfs

    with tmpfs(tmp_path / "tiny", size="1m") as mount:
        yield mount
