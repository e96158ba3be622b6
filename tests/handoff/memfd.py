"""Host-memory stand-ins for the keeper's GPU memory: memfd blocks, exported and mapped like CUDA's.

A memfd is what a CUDA VMM export is to the protocol: a file descriptor for memory, passed with
SCM_RIGHTS, imported by mapping it, alive while any process holds a descriptor or a mapping. With these the
keeper, the client and the protocol run for real, across processes, on a machine without a GPU; the
``gpu``-marked tests run the same code with :class:`~modelload.loader.handoff.device.CudaMemory`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from modelload.loader._api.torch import as_tensor
from modelload.loader.dtypes import by_name
from modelload.loader.errors import DeviceError
from modelload.loader.handoff.device import Mapped

DEVICE = {"uuid": "memfd-stand-in", "name": "host memory (test stand-in)"}
GRANULARITY = 64 << 10


class MemfdBlock:
    """A block in a memfd, mapped into this process (read-only on the app's side)."""

    def __init__(self, size: int, fd: int | None = None, *, writable: bool = True) -> None:
        self.size = size
        if fd is None:
            fd = os.memfd_create("modelload-handoff-test")
            os.ftruncate(fd, size)
            self.fd = fd
        else:
            self.fd = -1  # the caller's descriptor, closed by the caller: the mapping keeps the memory
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self.inode = os.fstat(fd).st_ino

    def bytes(self) -> torch.Tensor:
        return as_tensor(memoryview(self._map), by_name("uint8"), (self.size,))

    def close(self) -> None:
        """Drop this process's hold (descriptor; the mapping goes once no tensor uses it)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostCopier:
    """The keeper's copier on the host: a plain copy, done at once."""

    def __init__(self, *, pin_in_place: bool) -> None:
        self.copies = 0
        self.pin_in_place = pin_in_place
        self.pinned: list[int] = []
        self.finished = False

    def copy(
        self, host: torch.Tensor, *, into: torch.Tensor, on_done: Callable[[], None] | None = None
    ) -> torch.Tensor:
        into.copy_(host)
        self.copies += 1
        if on_done is not None:
            on_done()
        return into

    def pin(self, region: Any) -> bool:
        if self.pin_in_place:  # as DeviceCopier: nothing is pinned when copies are staged
            self.pinned.append(region.ring or region.bytes.numel())  # its length: the mapping may go first
        return self.pin_in_place

    def finish(self) -> None:
        self.finished = True


class MemfdMemory:
    device: Mapping[str, str] = DEVICE
    granularity = GRANULARITY

    def __init__(self) -> None:
        self.blocks: list[MemfdBlock] = []

    def allocate(self, size: int) -> MemfdBlock:
        block = MemfdBlock(size)
        self.blocks.append(block)
        return block

    def copier(self, *, pin_in_place: bool) -> HostCopier:
        self.last_copier = HostCopier(pin_in_place=pin_in_place)
        return self.last_copier


class MemfdMapper:
    """The app's side: maps each descriptor read-only, and notes which memory (inode) it got."""

    def __init__(self) -> None:
        self.inodes: list[int] = []

    def map(
        self, device: Mapping[str, Any], fds: Sequence[int], sizes: Sequence[int], *, writable: bool
    ) -> Mapped:
        if device.get("uuid") != DEVICE["uuid"]:
            raise DeviceError(f"the keeper's GPU {device.get('uuid')} is not visible in this container")
        blocks = [MemfdBlock(size, fd, writable=writable) for fd, size in zip(fds, sizes, strict=True)]
        self.inodes = [block.inode for block in blocks]
        return Mapped(torch.device("cpu"), list(blocks), writable)
