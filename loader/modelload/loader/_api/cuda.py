"""What the copy to a GPU asks of CUDA, in one place: a side stream and its events, device and pinned host
allocations, and pinning host memory where it is.

:class:`~modelload.loader._api.gpu_copy.DeviceCopier` holds the logic (what to pin and when, which copy may go
ahead, when a tensor's host bytes are free again); this module is the few calls it makes, so that the same
logic runs on a stand-in of them on a machine without a GPU (the test suite's, ``tests/support/fake_gpu.py``)
and is tested there, not only on the rare runs that have a GPU.

Pinning goes through the driver (:mod:`modelload.loader._cuda`), not torch's ``cudaHostRegister`` binding: a
refused runtime call stays behind as the thread's last error and fails the next, unrelated, kernel.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["Event", "Gpu", "open_gpu"]

_SCRATCH_BLOCKS = 2
"""Scratch blocks a copier holds at once: one filling, one being cloned."""


class Event(Protocol):
    """A point in the side stream: the copies queued before it are done once it is."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Gpu(Protocol):
    """One device, seen from the copier."""

    device: torch.device
    """The device, with its index."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new tensor on the device."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A new flat uint8 host tensor of page-locked memory."""

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Queue ``source`` (host) into ``destination`` (device) on the side stream; returns at once."""

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 device tensor for the side stream's own use: freed once dropped, its memory is reused
        only by later work of that stream, so dropping it right after queueing copies through it is safe.
        Waits while two earlier blocks are still to be read by their clones."""

    def clone_many(self, sources: list[torch.Tensor], scratch: torch.Tensor) -> list[torch.Tensor]:
        """A new device tensor for each source (device tensors of one integer dtype, views of ``scratch``):
        made on the caller's current stream, where the weights will be used, once the side stream's copies
        queued so far are done, in as few kernels as the device allows; returns at once. ``scratch`` is kept
        from reuse until that stream has read it."""

    def record(self) -> Event:
        """An event after everything queued so far."""

    def finish(self) -> None:
        """Wait for the side stream and for the clones, and order the caller's current stream after them."""

    def register(self, address: int, nbytes: int) -> None:
        """Pin host bytes ``[address, address + nbytes)`` read-only; raises ``DeviceError`` when refused."""

    def unregister(self, address: int) -> None:
        """Unpin what :meth:`register` pinned at ``address``; raises ``DeviceError`` when refused."""


class CudaGpu:
    """:class:`Gpu` for a CUDA device: torch for the stream, events and allocations, the driver for pins."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._torch = torch
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._stream = torch.cuda.Stream(self.device)
        self._driver: Any = None
        self._blocks: deque[list[Any]] = deque()
        """For each scratch block in use, the events after the clones reading it (the caller's stream)."""

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self._torch.empty(shape, dtype=dtype, device=self.device)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def pinned(self, nbytes: int) -> torch.Tensor:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def copy(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        with self._torch.cuda.stream(self._stream):
            destination.copy_(source, non_blocking=True)

    def scratch(self, nbytes: int) -> torch.Tensor:
        # At most two blocks at a time: a caller's stream kept busy by other work would otherwise leave
        # every run's block allocated until it got to the clones.
        while len(self._blocks) >= _SCRATCH_BLOCKS:
            for event in self._blocks.popleft():
                event.synchronize()
        self._blocks.append([])
        with self._torch.cuda.stream(self._stream):
            return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def clone_many(self, sources: list[torch.Tensor], scratch: torch.Tensor) -> list[torch.Tensor]:
        torch = self._torch
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        scratch.record_stream(current)  # the side stream reuses it only once the clones have read it
        # Integers plus zero, out of place: a new tensor per source, allocated on the current stream, filled
        # by a few multi-tensor kernels (a clone per tensor would be a launch per tensor). _foreach_add is
        # torch's own (private) batched op; integer addition keeps every bit.
        clones = list(torch._foreach_add(sources, 0))
        event = torch.cuda.Event(blocking=True)
        event.record(current)
        self._blocks[-1].append(event)
        return clones

    def record(self) -> Event:
        # Blocking: the copier's completion thread waits on these; a spinning wait would take a core.
        event = self._torch.cuda.Event(blocking=True)
        event.record(self._stream)
        return event

    def finish(self) -> None:
        self._stream.synchronize()
        while self._blocks:  # the clones too: every result is on the device once this returns
            for event in self._blocks.popleft():
                event.synchronize()
        self._torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def register(self, address: int, nbytes: int) -> None:
        self._pins().host_register(address, nbytes, ordinal=self.device.index)

    def unregister(self, address: int) -> None:
        self._pins().host_unregister(address, ordinal=self.device.index)

    def _pins(self) -> Any:
        if self._driver is None:
            from modelload.loader._cuda import driver

            self._driver = driver()
        return self._driver


def _cuda_gpu(device: torch.device) -> Gpu:
    return CudaGpu(device)


open_gpu: Callable[[torch.device], Gpu] = _cuda_gpu
"""How a copier gets its device: the test suite replaces it with its stand-in to run the copier on a CPU."""
