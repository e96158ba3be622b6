"""torch interop: zero-copy tensors over the segment, and copies to a GPU through pinned memory.

torch is optional; this module imports it only inside its functions, so ``import modelload.loader`` works in
an image without it.

The copy to a GPU pins the tensor's pages where they are: ``cudaHostRegister`` on the segment's own mapping
with the read-only flag, then an asynchronous host-to-device copy on a side stream. The data is mapped
copy-on-write, and pinning it writable would make the kernel copy every page (doubling the memory and cutting
the view off from the segment), so only read-only registration is used. Where the driver refuses it (old
drivers, some platforms), the copy goes through two pinned staging buffers instead: one CPU memcpy more, the
same overlap of copying with loading.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import TYPE_CHECKING, Any

from modelload.loader.dtypes import DType
from modelload.loader.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceCopier", "as_tensor"]

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_READ_ONLY = 8
_STAGING_BYTES = 64 << 20


def as_tensor(view: memoryview, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor over ``view``'s bytes, without a copy, with ``dtype`` and ``shape``.

    A read-only ``view`` (a ring segment's) gives a tensor that must not be written: torch cannot mark it
    read-only, and the pages are mapped without write access, so a write faults.
    """
    import torch

    target = dtype.torch()
    if not len(view):
        return torch.empty(shape, dtype=target)
    if view.readonly:  # a ring's bytes (memory mode ring): torch has no read-only tensors, and says so once
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="The given buffer is not writable", category=UserWarning
            )
            flat = torch.frombuffer(view, dtype=torch.uint8)
    else:
        flat = torch.frombuffer(view, dtype=torch.uint8)
    if target is not torch.uint8:
        flat = flat.view(target)
    return flat.reshape(shape)


class DeviceCopier:
    """Copies host tensors to one CUDA device as they are handed in, overlapping copies with loading.

    ``pin_in_place=False`` skips registration and copies through the staging buffers from the start (the
    GPU benchmark measures both ways; registration is otherwise always tried first).
    """

    def __init__(self, device: str | torch.device, *, pin_in_place: bool = True) -> None:
        import torch

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"DeviceCopier copies to CUDA devices, not {self.device}")
        self._torch = torch
        self._stream = torch.cuda.Stream(self.device)
        self._registered: list[tuple[Any, int, torch.Tensor, Callable[[], None] | None]] = []
        """(event, pointer, keep-alive, what to call once the copy has left the host bytes)"""
        self._staging: list[tuple[torch.Tensor, Any]] | None = None
        self._next_stage = 0
        self._pin_in_place = pin_in_place

    @property
    def pins_in_place(self) -> bool:
        """Whether copies still pin the host pages in place (False once registration was refused)."""
        return self._pin_in_place

    def copy(
        self,
        host: torch.Tensor,
        *,
        into: torch.Tensor | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Start copying ``host`` to the device. The result may be used once :meth:`finish` returns.

        ``into`` is a device tensor of the same dtype and shape to copy into (the hand-off keeper's memory);
        by default a new one is allocated. ``on_done`` is called once the host bytes are no longer needed
        (the copy has read them): the loader then marks the tensor consumed, so the sidecar may give its
        pages back (memory modes).
        """
        torch = self._torch
        target = self._target(host, into)
        if not host.numel():
            if on_done is not None:
                on_done()
            return target
        if self._pin_in_place and self._register(host):
            with torch.cuda.stream(self._stream):
                target.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            if on_done is not None:
                # Someone waits for these host bytes to be released (memory modes release and ring): the
                # next tensor may only land once they are, so finish this copy now rather than at the next.
                event.synchronize()
                _unregister(host.data_ptr())
                on_done()
            else:
                self._registered.append((event, host.data_ptr(), host, on_done))
            self._release_finished()
        else:
            self._copy_staged(host, target)
            if on_done is not None:  # the bytes are in a staging buffer now
                on_done()
        return target

    def _target(self, host: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        torch = self._torch
        if into is None:
            return torch.empty(host.shape, dtype=host.dtype, device=self.device)
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if (
            into.shape != host.shape
            or into.dtype != host.dtype
            or into.device != torch.device("cuda", index)  # "cuda" names the current device
            or not into.is_contiguous()
        ):
            raise ConfigError(
                f"cannot copy a {host.dtype} tensor of shape {tuple(host.shape)} into a {into.dtype} "
                f"tensor of shape {tuple(into.shape)} on {into.device} (copying to {self.device}; it must be "
                "contiguous)"
            )
        return into

    def finish(self) -> None:
        """Wait for every copy, release the pinned pages, and order the current stream after the copies."""
        torch = self._torch
        self._stream.synchronize()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        for _, pointer, _, on_done in self._registered:
            _unregister(pointer)
            if on_done is not None:
                on_done()
        self._registered.clear()

    def _register(self, host: torch.Tensor) -> bool:
        cudart = self._torch.cuda.cudart()
        nbytes = host.nbytes
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY
        status = cudart.cudaHostRegister(host.data_ptr(), nbytes, flags)
        if int(status) == 0:
            return True
        self._pin_in_place = False
        log.info("cudaHostRegister(read-only) failed (%s); copying through pinned staging buffers", status)
        return False

    def _release_finished(self) -> None:
        keep = []
        for entry in self._registered:
            if entry[0].query():
                _unregister(entry[1])
                if entry[3] is not None:
                    entry[3]()
            else:
                keep.append(entry)
        self._registered = keep

    def _copy_staged(self, host: torch.Tensor, target: torch.Tensor) -> None:
        torch = self._torch
        if self._staging is None:
            self._staging = [
                (torch.empty(_STAGING_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                for _ in range(2)
            ]
        source = host.reshape(-1).view(torch.uint8)
        destination = target.reshape(-1).view(torch.uint8)
        for start in range(0, source.numel(), _STAGING_BYTES):
            stop = min(start + _STAGING_BYTES, source.numel())
            buffer, event = self._staging[self._next_stage]
            self._next_stage ^= 1
            event.synchronize()  # the buffer's previous copy has left it
            buffer[: stop - start].copy_(source[start:stop])
            with torch.cuda.stream(self._stream):
                destination[start:stop].copy_(buffer[: stop - start], non_blocking=True)
                event.record(self._stream)


def copy_all(
    items: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    *,
    on_done: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Copy each ``(name, host tensor)`` to ``device`` as it comes; yield the device tensors at the end.

    ``on_done(name)`` is called for each tensor once its host bytes have been read (see
    :meth:`DeviceCopier.copy`), in the course of the copies rather than at the end.
    """
    copier = DeviceCopier(device)

    def done(name: str) -> Callable[[], None] | None:
        return None if on_done is None else (lambda: on_done(name))

    results = [(name, copier.copy(host, on_done=done(name))) for name, host in items]
    copier.finish()
    yield from results


def _unregister(pointer: int) -> None:
    import torch

    with suppress(RuntimeError):
        torch.cuda.cudart().cudaHostUnregister(pointer)
