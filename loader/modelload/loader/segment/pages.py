"""The memory under a segment's volume: 4 KiB pages, or huge pages, and what each asks of the segment.

Most of the cost of landing bytes in fresh shared memory is allocating, zeroing and faulting in its pages:
262,144 per GiB at 4 KiB, 512 at 2 MiB. Two kinds of volume give huge pages:

- **hugetlbfs**: pages from the kernel's pre-allocated pool (``nr_hugepages``), what a Kubernetes ``emptyDir``
  with ``medium: HugePages-2Mi`` (or ``HugePages-1Gi``) mounts. Its files take no ``write()``, ``splice`` or
  ``copy_file_range``: bytes go in through a mapping only; their size must be a multiple of the page size;
  a mapping's file offset must be one too; a private mapping reserves a pool page for every page it could
  copy on write (so readers map it shared).
- **tmpfs mounted** ``huge=always`` **or** ``huge=within_size``: ordinary tmpfs files whose pages the kernel
  allocates 2 MiB at a time (``huge=advise`` only for mappings that ask, which ours do not; the global
  ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` ``force`` and ``deny`` override every mount).

Everything else (a tmpfs of 4 KiB pages, the ``emptyDir`` with ``medium: Memory`` of today, or a disk) is
``small``. :func:`volume_of` tells them apart in one place, from ``statfs`` (the file system's magic number
and block size) and, for tmpfs, the mount's own options in ``/proc/self/mountinfo``.

Which landing path is cheaper follows from the pages (:func:`prefers_mapping`), as ``benchmarks/landing.py``
measured on this project's 2-core machine (1 GiB from /dev/shm, 8 threads, 32 MiB pieces, CPU-seconds per
GiB, median of 5): on 4 KiB tmpfs ``splice`` through the file descriptor costs 0.84 against 1.24 through a
reserved mapping; on huge tmpfs the mapping costs 0.53 against splice's 1.44; hugetlbfs takes only the
mapping (0.52). The sidecar from nginx: 0.76 on hugetlbfs against 1.13 by splice on 4 KiB pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from modelload.loader.errors import SegmentError

__all__ = [
    "HUGETLBFS_MAGIC",
    "SMALL_PAGE",
    "TMPFS_MAGIC",
    "Volume",
    "VolumeKind",
    "available_bytes",
    "check_page_size",
    "full_volume_advice",
    "mapped_length",
    "prefers_mapping",
    "round_up",
    "volume_of",
]

HUGETLBFS_MAGIC = 0x958458F6
TMPFS_MAGIC = 0x01021994
SMALL_PAGE = mmap.PAGESIZE
_HUGE_TMPFS = frozenset({"always", "within_size"})
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_POOLS = Path("/sys/kernel/mm/hugepages")
_CGROUP = Path("/sys/fs/cgroup")

VolumeKind = Literal["hugetlbfs", "tmpfs-huge", "small"]


@dataclass(frozen=True)
class Volume:
    """What a segment's volume gives: its ``kind`` and the ``page_size`` its memory comes in (bytes)."""

    kind: VolumeKind
    page_size: int = SMALL_PAGE

    @property
    def huge(self) -> bool:
        """Whether the volume's memory comes in huge pages."""
        return self.kind != "small"

    @property
    def mapping_only(self) -> bool:
        """Whether bytes can reach a file of this volume only through a mapping (hugetlbfs): no
        ``write()``, ``splice``, ``copy_file_range``, and file sizes in whole pages."""
        return self.kind == "hugetlbfs"

    def describe(self) -> str:
        size = f"{self.page_size >> 20} MiB" if self.page_size >= 1 << 20 else f"{self.page_size >> 10} KiB"
        return {"hugetlbfs": "hugetlbfs", "tmpfs-huge": "tmpfs with huge pages", "small": "4 KiB pages"}[
            self.kind
        ] + (f" ({size} pages)" if self.huge else "")


SMALL = Volume("small")


def round_up(value: int, page_size: int) -> int:
    """The smallest multiple of ``page_size`` at or above ``value``."""
    return -(-value // page_size) * page_size


def mapped_length(length: int, volume: Volume) -> int:
    """How many bytes to map for ``length`` bytes of a file on ``volume``: whole pages on hugetlbfs.

    The kernel maps a hugetlbfs file in whole pages whatever length is asked, but unmapping part of a huge
    page fails (EINVAL), and Python's ``mmap.close()`` ignores that failure: the mapping would stay, and keep
    the pages of a deleted segment from going back to the pool. The file is whole pages, so the rounded
    length never runs past its end.
    """
    return round_up(length, volume.page_size) if volume.mapping_only else length


def prefers_mapping(volume: Volume) -> bool:
    """Whether bytes should land through the segment's mapping (``readinto``/``preadv`` into it) rather than
    through its file descriptor (``splice``): on huge pages, where the mapping faults 512 times fewer pages
    and is about half the CPU of splice (see the module's figures); hugetlbfs takes nothing else."""
    return volume.huge


# --- detection ---------------------------------------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type and f_bsize are its first two words


def _statfs(target: str | int) -> tuple[int, int]:
    """``(f_type, f_bsize)`` of the file system holding ``target`` (a path, or an open descriptor)."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if isinstance(target, int):
        result = _libc.fstatfs(target, buf)
    else:
        result = _libc.statfs(os.fsencode(target), buf)
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), target if isinstance(target, str) else None)
    words = (ctypes.c_long * 2).from_buffer(buf)
    return words[0] & 0xFFFFFFFF, int(words[1])


def _tmpfs_huge(device: int) -> str:
    """The ``huge=`` option of the tmpfs mounted from ``device`` (``never`` when it has none)."""
    wanted = f"{os.major(device)}:{os.minor(device)}"
    option = "never"
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) < 3 or fields[2] != wanted or " - " not in line:
            continue
        supers = line.split(" - ", 1)[1].split()
        for item in (supers[2] if len(supers) > 2 else "").split(","):
            if item.startswith("huge="):
                option = item.partition("=")[2]
    return option


def _shmem_override() -> str | None:
    """``force`` or ``deny`` when the global shmem knob overrides every tmpfs mount's ``huge=``."""
    try:
        text = (_THP / "shmem_enabled").read_text()
    except OSError:
        return None
    chosen = text[text.find("[") + 1 : text.find("]")] if "[" in text else ""
    return chosen if chosen in ("force", "deny") else None


def _pmd_size() -> int:
    try:
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 2 << 20


def volume_of(target: str | os.PathLike[str] | int) -> Volume:
    """The kind of memory behind ``target``: a path (file or folder) or an open file descriptor.

    >>> volume_of("/proc").kind
    'small'
    """
    where = target if isinstance(target, int) else os.fspath(target)
    magic, block = _statfs(where)
    if magic == HUGETLBFS_MAGIC:
        return Volume("hugetlbfs", block)
    if magic != TMPFS_MAGIC:
        return SMALL
    override = _shmem_override()
    device = os.fstat(where).st_dev if isinstance(where, int) else Path(where).stat().st_dev
    huge = override == "force" or (override != "deny" and _tmpfs_huge(device) in _HUGE_TMPFS)
    return Volume("tmpfs-huge", _pmd_size()) if huge else SMALL


def check_page_size(directory: str | os.PathLike[str], page_size: int) -> Volume | None:
    """The volume of ``directory``; a segment planned for pages of ``page_size`` bytes, smaller than a
    hugetlbfs volume's own, is refused (hugetlbfs takes whole pages only). None when ``directory`` is missing
    (the writer's space check says so)."""
    try:
        volume = volume_of(directory)
    except OSError:
        return None
    if volume.mapping_only and page_size % volume.page_size:
        raise SegmentError(
            f"{os.fspath(directory)} is {volume.describe()}: a segment there must be planned for its pages "
            f"(plan_layout(page_size={volume.page_size})), not for {page_size}-byte pages"
        )
    return volume


# --- room --------------------------------------------------------------------------------------------------


def full_volume_advice(directory: str | os.PathLike[str]) -> str:
    """What to raise when ``directory``'s volume is too small: huge pages come from the node's pool and the
    pod's limit, ordinary memory from the volume's sizeLimit."""
    with contextlib.suppress(OSError):
        volume = volume_of(directory)
        if volume.mapping_only:
            return (
                f"it is hugetlbfs of {_page_name(volume.page_size)} pages, backed by the node's pool "
                f"of them ({_pool_state(volume.page_size)}) and the pod's hugepages limit: set more "
                f"aside on the node (vm.nr_hugepages, or /sys/kernel/mm/hugepages/hugepages-"
                f"{volume.page_size >> 10}kB/"
                "nr_hugepages) or raise the limit (the operator sizes it from spec.memory.hugePages)"
            )
    return (
        "raise the volume's sizeLimit (emptyDir medium: Memory) and the writer's memory limit (tmpfs pages "
        "count against it), or free space"
    )


def _page_name(page: int) -> str:
    return f"{page >> 30} GiB" if page >= 1 << 30 else f"{page >> 20} MiB"


def _pool_state(page: int) -> str:
    """``N free of M`` for the node's pool of ``page``-byte huge pages, as the kernel counts them now."""
    pool = _POOLS / f"hugepages-{page >> 10}kB"
    try:
        total = int((pool / "nr_hugepages").read_text())
        free = int((pool / "free_hugepages").read_text()) - int((pool / "resv_hugepages").read_text())
    except (OSError, ValueError):
        return "its size unknown"
    return f"{max(free, 0)} free of {total}"


def available_bytes(directory: str | os.PathLike[str], volume: Volume | None = None) -> int:
    """Bytes a new file in ``directory`` can take now.

    ``statvfs`` answers for tmpfs and for a hugetlbfs mounted with ``size=``. A hugetlbfs mounted without a
    size (as the kubelet mounts a ``HugePages-*`` ``emptyDir``) reports no blocks at all: its bound is the
    kernel's pool of pages of its size (free and not reserved by a mapping) and, in a container, the hugetlb
    cgroup's limit, whichever is smaller.
    """
    stats = os.statvfs(directory)
    volume = volume or volume_of(directory)
    if volume.kind != "hugetlbfs" or stats.f_blocks:
        return stats.f_bavail * stats.f_frsize
    page = volume.page_size
    pool = _POOLS / f"hugepages-{page >> 10}kB"
    try:
        free = int((pool / "free_hugepages").read_text()) - int((pool / "resv_hugepages").read_text())
    except (OSError, ValueError):
        return 0
    room = max(free, 0) * page
    cgroup = _cgroup_room(page)
    return room if cgroup is None else min(room, cgroup)


def _cgroup_room(page: int) -> int | None:
    """What the hugetlb cgroup of this process still allows for pages of ``page`` bytes; None if unbounded
    or unknown. cgroup v2 (``hugetlb.2MB.max``, ``.current``) and v1 (``.limit_in_bytes``,
    ``.usage_in_bytes``)."""
    name = f"{page >> 30}GB" if page >= 1 << 30 else f"{page >> 20}MB"
    v1 = _CGROUP / "hugetlb"
    for limit_file, usage_file in (
        (_CGROUP / f"hugetlb.{name}.max", _CGROUP / f"hugetlb.{name}.current"),
        (v1 / f"hugetlb.{name}.limit_in_bytes", v1 / f"hugetlb.{name}.usage_in_bytes"),
    ):
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= 1 << 62:  # v1's "unlimited"
            return None
        return max(limit - usage, 0)
    return None
