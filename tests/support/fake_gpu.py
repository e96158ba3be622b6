"""A stand-in for the CUDA calls of the copy to a GPU (``modelload.loader._api.cuda.Gpu``), so that
``DeviceCopier``'s logic runs, and is tested, on a machine without one.

It keeps the rules a GPU run showed or the driver documents, and is stricter where that finds bugs sooner:

- a registration covers whole pages, and one that overlaps another is refused
  (``CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED``); unpinning an address nobody pinned is refused too;
- a copy must read from inside one registration or one pinned buffer: one that crosses from a registration
  into other memory is refused (seen on an H100); one from memory nobody pinned is a pageable copy, counted;
- a batch of device clones (``clone_many``) is queued behind the copies so far (the caller's stream waits for
  the side stream), and is made only of integer views (a float kernel canonicalises NaNs, seen on an H200);
- copies run in the order they were queued, and as late as they can: only when an event after them is
  waited for, or the stream finishes. A copy reads its source when it runs, so a copier that hands the host
  bytes back (``on_done``) or reuses a staging buffer before its copy ran copies the wrong bytes, and one
  that unpins them first is caught here. A caller that waits for a copy nobody makes run waits forever.

"Device" tensors are host tensors. :func:`install` puts the stand-in in place of the real device.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from modelload.loader._api import cuda
from modelload.loader.errors import DeviceError

PAGE = 4096
INTEGERS = (torch.uint8, torch.int16, torch.int32, torch.int64)
DEVICE = -3
"""The holder of a clone's source: the device's own memory, nothing to pin."""


class CopyRefused(RuntimeError):
    """What torch raises when the driver refuses a copy."""


@dataclass
class FakeEvent:
    gpu: FakeGpu
    mark: int
    """How many copies the stream must have run for this event to be complete."""

    def query(self) -> bool:
        return self.gpu.ran >= self.mark

    def synchronize(self) -> None:
        self.gpu.run_until(self.mark)


@dataclass
class FakeGpu:
    """One stand-in device. ``refuse(address, nbytes)``: a reason to refuse that registration, or None."""

    device: torch.device = field(default_factory=lambda: torch.device("cuda", 0))
    refuse: Callable[[int, int], str | None] | None = None
    pins: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Live registrations: the address given, to its page-aligned ``[start, stop)``."""
    registered: list[tuple[int, int]] = field(default_factory=list)
    """Every registration made, ``(address, nbytes)``."""
    unregistered: list[int] = field(default_factory=list)
    buffers: list[tuple[int, int]] = field(default_factory=list)
    pageable: int = 0
    """Copies from memory nobody pinned."""
    sources: list[tuple[int, int]] = field(default_factory=list)
    """Every copy queued: its source's address and length."""
    queued: deque[tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=deque)
    batched: list[int] = field(default_factory=list)
    """Each batch of device clones: how many tensors it held."""
    ran: int = 0
    made: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    # --- Gpu --------------------------------------------------------------------------------------------

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def pinned(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.buffers.append((buffer.data_ptr(), buffer.data_ptr() + nbytes))
        return buffer

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        assert destination.is_contiguous() and destination.nbytes == source.nbytes
        with self.lock:
            address, nbytes = source.data_ptr(), source.nbytes
            holder = self._holder(address, nbytes)
            self.sources.append((address, nbytes))
            if holder is None:
                self.pageable += 1
            self.queued.append((destination, source, -1 if holder is None else holder))
            self.made += 1

    def scratch(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def clone_many(self, sources: list[torch.Tensor], scratch: torch.Tensor) -> list[torch.Tensor]:
        with self.lock:
            assert all(source.dtype in INTEGERS for source in sources), "cloned as integers: bits stay bits"
            self.batched.append(len(sources))
            clones = [torch.empty_like(source) for source in sources]
            for clone, source in zip(clones, sources, strict=True):  # behind the side stream's copies
                self.queued.append((clone, source, DEVICE))
                self.made += 1
            return clones

    def record(self) -> FakeEvent:
        with self.lock:
            return FakeEvent(self, self.made)

    def finish(self) -> None:
        self.run_until(self.made)

    def register(self, address: int, nbytes: int) -> None:
        with self.lock:
            start, stop = address // PAGE * PAGE, -(-(address + nbytes) // PAGE) * PAGE
            reason = self.refuse(address, nbytes) if self.refuse else None
            if reason is None and any(a < stop and start < b for a, b in self.pins.values()):
                reason = "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"
            if reason is not None:
                raise DeviceError(f"cuMemHostRegister failed: {reason}")
            self.pins[address] = (start, stop)
            self.registered.append((address, nbytes))

    def unregister(self, address: int) -> None:
        with self.lock:
            if self.pins.pop(address, None) is None:
                raise DeviceError("cuMemHostUnregister failed: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED")
            self.unregistered.append(address)

    # --- the stream ---------------------------------------------------------------------------------------

    def run_until(self, mark: int) -> None:
        """Run the queued copies, in order, until ``mark`` of them have run."""
        with self.lock:
            while self.ran < mark:
                destination, source, holder = self.queued.popleft()
                if holder >= 0 and holder not in self.pins:
                    raise CopyRefused("the copy's source was unpinned before the copy ran")
                destination.copy_(source)
                self.ran += 1

    def _holder(self, address: int, nbytes: int) -> int | None:
        """The registration (its address) or buffer (-2) holding the whole source; None when none holds any
        of it; refused when one holds part of it."""
        stop = address + nbytes
        if self._in_buffer_range(address, stop):
            return -2
        for key, (a, b) in self.pins.items():
            if a <= address and stop <= b:
                return key
            if a < stop and address < b:
                raise CopyRefused(f"a copy of [{address:#x}, {stop:#x}) crosses the pinned [{a:#x}, {b:#x})")
        return None

    def _in_buffer_range(self, start: int, stop: int) -> bool:
        return any(a <= start and stop <= b for a, b in self.buffers)


def install(monkeypatch: pytest.MonkeyPatch, **kwargs: Any) -> list[FakeGpu]:
    """Make every ``DeviceCopier`` made from now on (in this test) copy through a new :class:`FakeGpu`;
    returns the list they are appended to."""
    made: list[FakeGpu] = []

    def open_gpu(device: torch.device) -> FakeGpu:
        gpu = FakeGpu(**kwargs)
        made.append(gpu)
        return gpu

    monkeypatch.setattr(cuda, "open_gpu", open_gpu)
    return made
