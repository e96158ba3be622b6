"""The ring of a layout-version-4 segment, mapped twice back to back so that no tensor is ever cut in two.

In memory mode ring (SPEC.md, "The ring") the file holds its header, manifest and state table and then only
``ring_size`` bytes of data; the data byte at manifest offset ``x`` lives at file offset
``data_offset + (x - data_offset) mod ring_size``. A tensor that runs past the ring's end continues at its
start. Mapping the ring twice, the second mapping right after the first, makes every run of at most
``ring_size`` bytes one contiguous stretch of addresses: tensors stay zero-copy views, with no per-tensor
mapping and no copy at the wrap.

Python's :mod:`mmap` cannot place a mapping at a chosen address, so this module calls ``mmap(2)`` through
ctypes: reserve the whole stretch of address space (``PROT_NONE``, no memory), then map the file over it
with ``MAP_FIXED``. The memoryview returned keeps the mapping alive; it is unmapped once the last view,
array or tensor taken from it is gone. Linux only, as the memory-backed volumes it serves are.

On huge pages (``segment.pages``) the ring works the same with pages of 2 MiB or 1 GiB: the layout starts the
ring on a page boundary and makes it whole pages, and the reserved stretch is aligned to the page size (a
hugetlbfs file can only be mapped at an address and a file offset that are multiples of its page size; on a
huge tmpfs the alignment lets the kernel map each 2 MiB page with one entry).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import weakref

from modelload.loader.errors import SegmentError

__all__ = ["map_ring"]

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_MAP_NORESERVE = 0x4000
_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _mmap(address: int | None, length: int, prot: int, flags: int, fd: int, offset: int) -> int:
    result = _libc.mmap(address, length, prot, flags, fd, offset)
    if result is None or result == _FAILED:
        code = ctypes.get_errno()
        raise SegmentError(
            f"cannot map the segment's ring ({length} bytes: {os.strerror(code)}); the process may lack "
            "address space (ulimit -v) or the volume may not support shared mappings"
        ) from OSError(code, os.strerror(code))
    return int(result)


def _unmap(address: int, length: int) -> None:
    _libc.munmap(address, length)


def _reserve_aligned(length: int, alignment: int) -> int:
    """Reserve ``length`` bytes of address space (no memory) starting at a multiple of ``alignment``."""
    flags = mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
    if alignment <= mmap.PAGESIZE:
        return _mmap(None, length, _PROT_NONE, flags, -1, 0)
    base = _mmap(None, length + alignment, _PROT_NONE, flags, -1, 0)
    aligned = -(-base // alignment) * alignment
    if aligned > base:
        _unmap(base, aligned - base)  # give back the slack before and after the aligned stretch
    if base + alignment > aligned:
        _unmap(aligned + length, base + alignment - aligned)
    return aligned


def map_ring(
    fd: int, *, start: int, ring_offset: int, ring_size: int, writable: bool, page_size: int = mmap.PAGESIZE
) -> memoryview:
    """Map file bytes ``[start, ring_offset + ring_size)``, then the ring ``[ring_offset, ring_offset +
    ring_size)`` once more right after them, shared; return a byte view of the whole stretch.

    Byte ``ring_offset + k`` of the file then shows at view offsets ``ring_offset - start + k`` and
    ``ring_offset - start + ring_size + k``. ``start``, ``ring_offset`` and ``ring_size`` are multiples of
    ``page_size``, the volume's page size (the second mapping starts where the first ends). The view is
    read-only unless ``writable``: readers of a ring must not keep private copies of pages the writer reuses
    for newer tensors.
    """
    page = max(page_size, mmap.PAGESIZE)
    if start % page or ring_offset % page or ring_size % page or ring_size <= 0 or start > ring_offset:
        raise SegmentError(
            f"cannot map a ring of {ring_size} bytes at offset {ring_offset} (from {start}) with pages of "
            f"{page} bytes: ring segments need the ring to start and end on page boundaries of the volume "
            "(a ring written for 4 KiB pages cannot be mapped on huge pages; elsewhere use memory mode full "
            "or release)"
        )
    first = ring_offset + ring_size - start
    total = first + ring_size
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    base = _reserve_aligned(total, page)
    try:
        _mmap(base, first, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, start)
        _mmap(base + first, ring_size, prot, mmap.MAP_SHARED | _MAP_FIXED, fd, ring_offset)
    except BaseException:
        _unmap(base, total)
        raise
    pages = (ctypes.c_ubyte * total).from_address(base)
    finalizer = weakref.finalize(pages, _unmap, base, total)  # the last view, array or tensor unmaps it
    finalizer.atexit = False  # at exit the process's mappings go anyway; a daemon thread may still read it
    view = memoryview(pages).cast("B")
    return view if writable else view.toreadonly()
