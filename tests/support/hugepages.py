"""Real huge-page volumes for the tests and benchmarks: hugetlbfs over reserved pages, and huge tmpfs.

A pod gets huge pages from an ``emptyDir`` with ``medium: HugePages-2Mi`` (a hugetlbfs mount backed by the
node's pre-allocated pool); a tmpfs mounted ``huge=always`` (or ``within_size``) is the other way the kernel
backs shared memory with 2 MiB pages. Both are made here as the kernel makes them, never imitated:

- :func:`reserved_pages` grows the kernel's pool (``/sys/kernel/mm/hugepages/hugepages-2048kB/
  nr_hugepages``, the per-size twin of ``/proc/sys/vm/nr_hugepages``) until ``count`` pages are free, and
  shrinks it back by what it added; concurrent users (two test runs) are serialised with a lock file;
- :func:`mounted` mounts a file system on a folder and unmounts it afterwards;
- :func:`huge_volume` does both for one of the kinds ``hugetlbfs``, ``tmpfs-huge`` or ``tmpfs`` (4 KiB
  pages, for comparison).

Both need root. Where the kernel or the machine refuses (not root, no hugetlbfs, too little contiguous
memory for the pages), :class:`Unavailable` says exactly what was refused; the fixtures turn it into a skip,
or a failure under ``MODELLOAD_REQUIRE_SERVERS=1``.

The pytest fixtures (import them into a test module or an area's conftest.py): ``hugetlbfs`` and
``huge_tmpfs`` give each test a fresh folder on a volume mounted once per session (``SESSION_BYTES`` of
room: 128 pages of 2 MiB are taken from the kernel for the session, and given back after it).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import require

__all__ = [
    "HUGE_PAGE",
    "SESSION_BYTES",
    "Unavailable",
    "free_pages",
    "huge_tmpfs",
    "huge_tmpfs_volume",
    "huge_volume",
    "hugetlbfs",
    "hugetlbfs_volume",
    "mounted",
    "reserved_pages",
    "warm",
]

HUGE_PAGE = 2 << 20
SESSION_BYTES = 256 << 20
"""Room on each session volume: enough for the tests' models (a few MiB each) and a ring or two."""
_POOLS = Path("/sys/kernel/mm/hugepages")
_LOCK = Path("/run/lock/modelload-test-hugepages.lock")


class Unavailable(Exception):
    """The machine cannot provide the volume; the message says what was refused."""


def _pool(page_size: int) -> Path:
    return _POOLS / f"hugepages-{page_size // 1024}kB"


def _read(pool: Path, name: str) -> int:
    return int((pool / name).read_text())


def free_pages(page_size: int = HUGE_PAGE) -> int:
    """Pages of ``page_size`` in the pool that no mapping has reserved or taken."""
    pool = _pool(page_size)
    return _read(pool, "free_hugepages") - _read(pool, "resv_hugepages")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    _LOCK.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def reserved_pages(count: int, page_size: int = HUGE_PAGE) -> Iterator[None]:
    """At least ``count`` free pages of ``page_size`` in the kernel's pool while the block runs."""
    pool = _pool(page_size)
    if os.geteuid() != 0:
        raise Unavailable("reserving huge pages needs root (it writes /proc/sys/vm/nr_hugepages)")
    if not pool.is_dir():
        raise Unavailable(f"this kernel has no pool of {page_size >> 10} KiB huge pages ({pool} is missing)")
    with _locked():
        added = max(0, count - free_pages(page_size))
        if added:
            total = _read(pool, "nr_hugepages")
            try:
                (pool / "nr_hugepages").write_text(str(total + added))
            except OSError as exc:
                raise Unavailable(f"the kernel refused to grow the huge page pool: {exc}") from exc
            if free_pages(page_size) < count:
                got = free_pages(page_size)
                (pool / "nr_hugepages").write_text(str(total))
                raise Unavailable(
                    f"asked the kernel for {added} more {page_size >> 20} MiB pages and only {got} of the "
                    f"{count} needed are free (too little contiguous memory)"
                )
    try:
        yield
    finally:
        if added:
            with _locked():
                (pool / "nr_hugepages").write_text(str(max(0, _read(pool, "nr_hugepages") - added)))


@contextlib.contextmanager
def mounted(fstype: str, target: Path, options: str) -> Iterator[Path]:
    """``target`` with a fresh ``fstype`` mounted on it (``mount -t FSTYPE -o OPTIONS``) for the block."""
    if os.geteuid() != 0:
        raise Unavailable(f"mounting {fstype} needs root")
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", fstype, "-o", options, fstype, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise Unavailable(f"mount -t {fstype} -o {options} failed: {done.stderr.strip() or done.returncode}")
    try:
        yield target
    finally:
        if subprocess.run(["umount", str(target)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


def warm(folder: Path, size: int) -> None:
    """Take and give back ``size`` bytes of pages on ``folder``'s volume once, as a node's pool is after its
    first load. Here the first use of huge pages just reserved cost 2.3 CPU-seconds per GiB (the first
    ``posix_fallocate`` on a fresh pool), every later use 0.09, most likely the virtual machine's host backing
    memory the guest had never touched: a benchmark that reserved its pages a moment ago would otherwise
    measure that, not the load."""
    probe = folder / ".warm"
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)
        probe.unlink()


@contextlib.contextmanager
def huge_volume(kind: str, target: Path, size: int) -> Iterator[Path]:
    """A volume of ``kind`` mounted on ``target`` with room for ``size`` bytes.

    ``hugetlbfs``: 2 MiB pages from the kernel's pool, mounted as a kubelet mounts a ``HugePages-2Mi``
    ``emptyDir`` (``pagesize=2M``, no size limit: the pool and the pod's cgroup bound it); ``tmpfs-huge``: a
    tmpfs mounted ``huge=always``; ``tmpfs``: a tmpfs of 4 KiB pages (``huge=never``).
    """
    pages = -(-size // HUGE_PAGE)
    if kind == "hugetlbfs":
        with reserved_pages(pages), mounted("hugetlbfs", target, "pagesize=2M") as path:
            yield path
    elif kind in ("tmpfs-huge", "tmpfs"):
        huge = "always" if kind == "tmpfs-huge" else "never"
        with mounted("tmpfs", target, f"size={pages * HUGE_PAGE},huge={huge},mode=1777") as path:
            yield path
    else:
        raise ValueError(f"unknown volume kind {kind!r}: hugetlbfs, tmpfs-huge or tmpfs")


def _session_volume(kind: str, factory: pytest.TempPathFactory) -> Iterator[Path]:
    stack = contextlib.ExitStack()
    try:
        path = stack.enter_context(huge_volume(kind, factory.mktemp(kind), SESSION_BYTES))
    except Unavailable as exc:
        require(False, f"a {kind} volume: {exc}")
    with stack:
        yield path


@pytest.fixture(scope="session")
def hugetlbfs_volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """hugetlbfs mounted for the session (import it with ``hugetlbfs``)."""
    yield from _session_volume("hugetlbfs", tmp_path_factory)


@pytest.fixture(scope="session")
def huge_tmpfs_volume(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tmpfs mounted ``huge=always`` for the session (import it with ``huge_tmpfs``)."""
    yield from _session_volume("tmpfs-huge", tmp_path_factory)


def _fresh(volume: Path) -> Iterator[Path]:
    folder = volume / f"test-{os.getpid()}-{os.urandom(4).hex()}"
    folder.mkdir(mode=0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def hugetlbfs(hugetlbfs_volume: Path) -> Iterator[Path]:
    """A fresh folder on hugetlbfs (2 MiB pages from the kernel's pool), as a ``HugePages-2Mi`` emptyDir."""
    yield from _fresh(hugetlbfs_volume)


@pytest.fixture
def huge_tmpfs(huge_tmpfs_volume: Path) -> Iterator[Path]:
    """A fresh folder on a tmpfs mounted ``huge=always``."""
    yield from _fresh(huge_tmpfs_volume)
