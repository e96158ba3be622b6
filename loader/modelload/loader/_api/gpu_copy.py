"""The copy from a segment to a GPU, through pinned memory, as tensors are handed in.

torch is optional; this module imports it only inside its functions.

The copy to a GPU pins the host pages where they are: a read-only registration (``cuMemHostRegister``) of the
segment's own mapping, then asynchronous host-to-device copies on a side stream. The data is mapped
copy-on-write, and pinning it writable would make the kernel copy every page (doubling the memory and cutting
the view off from the segment), so only read-only registration is used. Pinning costs per page (on 4 KiB
pages, more than the copy itself), so what can be pinned once is: a complete full-mode segment's whole data
mapping, or a ring (its pages are reused lap after lap, never freed while the load runs). In memory mode
release each tensor is pinned on its own, since a pinned page could not go back to the volume when its
tensor is released. Where the driver refuses to pin (old drivers, some platforms), the copy goes through two
pinned staging buffers instead: one CPU memcpy more, the same overlap of copying with loading. Small
neighbours (a mixture of experts' thousands of experts) are copied in runs: one copy of the bytes they span
into a scratch block on the device, then a batched clone of each out of it (:meth:`DeviceCopier.copy_run`).
The CUDA calls themselves are in :mod:`.cuda`.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelload.loader.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    import torch

    from modelload.loader._api.cuda import Event

__all__ = ["DeviceCopier", "Region", "copy_all", "runs"]

log = logging.getLogger(__name__)

_STAGING_BYTES = 64 << 20
_RUN_TENSOR = 1 << 20
"""Tensors smaller than this are copied in runs (:func:`runs`); a larger one costs more than its launch."""
_RUN_BYTES = 32 << 20
"""A run spans at most this many bytes (the scratch block it passes through on the device)."""
_RUN_GAP = 4096
"""The most bytes between two tensors of one run (padding, copied along): a page, what a paged slot leaves."""
_RUN_ALIGN = 16
"""A run's block starts on a multiple of this in the data (of every element size), and is as long."""
_SAME_SIZE_INTEGER = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
"""The integer dtype a run's bytes are cloned as, by element size: copied as integers, bits stay bits."""


class DeviceCopier:
    """Copies host tensors to one CUDA device as they are handed in, overlapping copies with loading.

    Host bytes are read where they are wherever they can be pinned there: inside a region pinned once for the
    copier's life (:meth:`pin`: a segment's whole data mapping, or its ring), else each tensor's own bytes,
    pinned for its copy; where the driver refuses, through two pinned staging buffers. Pinning costs per
    page, not per call, so a region is pinned once rather than tensor by tensor.

    Small neighbours in a segment's mapping may be copied together (:meth:`copy_run`): one copy of the bytes
    they span into a scratch block on the device, then a batched clone of each out of it.

    Copies are queued on a side stream and never waited for one by one: each one's ``on_done`` is called
    from the copier's completion thread once its copy is done, in the order of the copies, so the caller
    may block waiting for the next tensor (which a ring lands only once earlier ones are consumed) while
    earlier copies finish and get consumed. :meth:`finish` must be called at the end, also after an error.

    ``pin_in_place=False`` skips registration and copies through the staging buffers from the start (the
    GPU benchmark measures both ways; registration is otherwise always tried first).
    """

    def __init__(self, device: str | torch.device, *, pin_in_place: bool = True) -> None:
        import torch

        from modelload.loader._api import cuda

        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ConfigError(f"DeviceCopier copies to CUDA devices, not {self.device}")
        self._torch = torch
        self._gpu = cuda.open_gpu(self.device)
        self._pin_in_place = pin_in_place
        self._regions: list[_Pinned] = []
        self._completions = _Completions(self._unregister)
        self._staging: list[tuple[torch.Tensor, Event | None]] | None = None
        self._next_stage = 0
        self._clock = threading.Lock()
        self.register_seconds = 0.0
        """Seconds spent pinning host memory so far (the benchmark reports them apart from the copies)."""
        self.unregister_seconds = 0.0
        """Seconds spent unpinning it."""

    @property
    def pins_in_place(self) -> bool:
        """Whether copies still pin the host pages in place (False once registration was refused)."""
        return self._pin_in_place

    def pin(self, region: Region) -> bool:
        """Pin ``region`` until :meth:`finish`: copies of tensors inside it then need no pinning of their own.

        Returns False when the driver refused (or ``pin_in_place`` is off); tensors are then pinned one by
        one, or staged, as without it.
        """
        if not self._pin_in_place or not region.bytes.numel():
            return False
        length = region.ring or region.bytes.numel()
        try:
            self._register(region.bytes.data_ptr(), length)
        except DeviceError as exc:
            log.info(
                "pinning the segment's %d mapped bytes was refused (%s); pinning each tensor", length, exc
            )
            return False
        self._regions.append(_Pinned(region, region.bytes.data_ptr()))
        return True

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
        (the copy has read them), from the copier's completion thread: the loader then marks the tensor
        consumed, so the sidecar may give its pages back (memory modes). An error raised by an earlier
        ``on_done`` is raised here.
        """
        self._completions.raise_error()
        target = self._target(host, into)
        if not host.numel():
            self._completions.put(None, None, None, on_done)
            return target
        spans = self._inside_region(host)
        if spans is not None:
            self._copy_pieces(_as_bytes(target), *spans)
            if on_done is not None:
                self._completions.put(self._gpu.record(), host, None, on_done)
        elif self._pin_in_place and host.is_contiguous() and self._pin_tensor(host):
            try:
                self._gpu.copy(target, host)
            except BaseException:
                with suppress(Exception):  # nothing may still read the pages once they are unpinned
                    self._gpu.finish()
                self._unregister(host.data_ptr())
                raise
            self._completions.put(self._gpu.record(), host, host.data_ptr(), on_done)
        else:
            self._copy_staged(host, target)
            if on_done is not None:  # the bytes are in a staging buffer now
                self._completions.put(None, None, None, on_done)
        return target

    def copy_run(
        self,
        data: torch.Tensor,
        hosts: list[torch.Tensor],
        *,
        on_done: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Start copying ``hosts``, contiguous tensors lying one after the other in ``data`` (a segment's data
        mapping as flat bytes), as one span: one host-to-device copy of the bytes from the first to the last
        into a scratch block, then one batched clone of each tensor's bytes out of the block, into memory of
        its own (:meth:`~.cuda.Gpu.clone_many`). A mixture of experts' 100,000 small tensors then cost a few
        dozen copies, not 100,000 (each a stream switch, a copy launch and an event). The clones are made on
        integer views of the bytes, never as floating point (a device kernel that reads a NaN as a float
        writes back the canonical NaN, not the checkpoint's bits), and each result has a storage of its own,
        as :class:`Views`' host tensors have. ``on_done`` is called once the host bytes of all of them are
        read. Each host tensor's offset in ``data`` must be a multiple of its element size, of 1, 2, 4 or 8
        bytes (:func:`runs` checks).
        """
        import torch

        self._completions.raise_error()
        base = data.data_ptr()
        start = _run_start(hosts[0].data_ptr() - base)
        stop = hosts[-1].data_ptr() - base + hosts[-1].nbytes
        length = stop - start
        block = self._gpu.scratch(-(-length // _RUN_ALIGN) * _RUN_ALIGN)
        spans = self._inside_region_at(base + start, length)
        if spans is not None:
            self._copy_pieces(block, *spans)
        else:  # pinning a span would overlap its neighbours' pages: staged (one memcpy of the whole span)
            self._copy_staged(data[start:stop], block[:length], one_thread=True)
        if on_done is not None:  # the host bytes are read once the copy into the block is done
            self._completions.put(self._gpu.record(), hosts, None, on_done)
        # One batch per element size: a batch of one dtype takes the device's fast path.
        shift = base + start
        batches: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        sizes = []
        for host in hosts:
            size = host.element_size()
            sizes.append(size)
            batch = batches.get(size)
            if batch is None:
                if size not in _SAME_SIZE_INTEGER:
                    raise ConfigError(f"a run holds {size}-byte elements: only 1, 2, 4 or 8 (see runs())")
                batch = batches[size] = (block.view(getattr(torch, _SAME_SIZE_INTEGER[size])), [])
            of_size, sources = batch
            at, off = divmod(host.data_ptr() - shift, size)
            if off or not 0 <= at * size <= length - host.nbytes:
                raise ConfigError("each tensor of a run lies in its span, on a multiple of its element size")
            sources.append(of_size.as_strided(host.shape, host.stride(), at))
        clones = {size: iter(self._gpu.clone_many(sources, block)) for size, (_, sources) in batches.items()}
        targets = []
        for host, size in zip(hosts, sizes, strict=True):
            clone = next(clones[size])
            targets.append(clone if clone.dtype == host.dtype else clone.view(host.dtype))
        return targets

    def _target(self, host: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
        if into is None:
            return self._gpu.empty(tuple(host.shape), host.dtype)
        if (
            into.shape != host.shape
            or into.dtype != host.dtype
            or not self._gpu.holds(into)  # "cuda" names the current device
            or not into.is_contiguous()
        ):
            raise ConfigError(
                f"cannot copy a {host.dtype} tensor of shape {tuple(host.shape)} into a {into.dtype} "
                f"tensor of shape {tuple(into.shape)} on {into.device} (copying to {self.device}; it must be "
                "contiguous)"
            )
        return into

    def finish(self) -> None:
        """Wait for every copy, call what is left of the ``on_done``s, release the pinned pages, and order the
        current stream after the copies. Raises the first error an ``on_done`` raised."""
        try:
            self._gpu.finish()
            self._completions.join()
        finally:
            regions, self._regions = self._regions, []
            for pinned in regions:
                self._unregister(pinned.address)
        self._completions.raise_error()

    def _inside_region(self, host: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        if not host.is_contiguous():
            return None
        return self._inside_region_at(host.data_ptr(), host.nbytes)

    def _inside_region_at(
        self, address: int, nbytes: int
    ) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
        for pinned in self._regions:
            pieces = pinned.pieces(address, nbytes)
            if pieces is not None:
                return pinned.region.bytes, pieces
        return None

    def _copy_pieces(
        self, destination: torch.Tensor, region: torch.Tensor, pieces: list[tuple[int, int]]
    ) -> None:
        """Queue the copy of ``pieces`` of a pinned ``region`` (:meth:`_inside_region_at`), one after the
        other, into the start of ``destination``: two pieces where a ring's bytes run past the ring's end."""
        done = 0
        for offset, length in pieces:
            self._gpu.copy(destination[done : done + length], region[offset : offset + length])
            done += length

    def _pin_tensor(self, host: torch.Tensor) -> bool:
        try:
            self._register(host.data_ptr(), host.nbytes)
        except DeviceError as exc:
            self._pin_in_place = False
            log.info(
                "pinning a tensor in place was refused (%s); copying through pinned staging buffers", exc
            )
            return False
        return True

    def _register(self, address: int, nbytes: int) -> None:
        started = time.perf_counter()
        try:
            self._gpu.register(address, nbytes)
        finally:
            with self._clock:
                self.register_seconds += time.perf_counter() - started

    def _unregister(self, address: int) -> None:
        """Unpin; a refusal is logged (the pages stay pinned until the process ends), never left behind."""
        started = time.perf_counter()
        try:
            self._gpu.unregister(address)
        except DeviceError as exc:
            log.warning("unpinning host memory at %#x was refused (%s); it stays pinned", address, exc)
        finally:
            with self._clock:
                self.unregister_seconds += time.perf_counter() - started

    def _copy_staged(self, host: torch.Tensor, target: torch.Tensor, *, one_thread: bool = False) -> None:
        """``host`` into ``target`` through the two pinned staging buffers. ``one_thread``: fill them with a
        plain memcpy on this thread rather than torch's copy, whose worker threads spin on after each copy:
        between runs, each followed by thousands of tensors' Python work, they took more CPU than the
        copies (a 100,000-tensor model on 16 cores: 5.5 CPU-s per GiB for a 1.6 s copy)."""
        if self._staging is None:
            self._staging = [(self._gpu.pinned(_STAGING_BYTES), None) for _ in range(2)]
        source, destination = _as_bytes(host), _as_bytes(target)
        for start in range(0, source.numel(), _STAGING_BYTES):
            stop = min(start + _STAGING_BYTES, source.numel())
            buffer, event = self._staging[self._next_stage]
            if event is not None:
                event.synchronize()  # the buffer's previous copy has left it
            if one_thread:  # ctypes lets the GIL go for the call
                ctypes.memmove(buffer.data_ptr(), source.data_ptr() + start, stop - start)
            else:
                buffer[: stop - start].copy_(source[start:stop])
            self._gpu.copy(destination[start:stop], buffer[: stop - start])
            self._staging[self._next_stage] = (buffer, self._gpu.record())
            self._next_stage ^= 1


@dataclass(frozen=True)
class Region:
    """Host memory a :class:`DeviceCopier` may pin once for its life: a segment's data mapping.

    ``bytes`` is the mapping as a flat uint8 tensor (it keeps the mapping alive while pinned). ``ring``: the
    mapping is a ring of that many bytes mapped twice back to back (memory mode ring); only its first copy
    is pinned, the same pages as the second, and a tensor that runs past the ring's end is copied in two
    pieces from the first (a copy must read from inside one registration).
    """

    bytes: torch.Tensor
    ring: int = 0


@dataclass(frozen=True)
class _Pinned:
    region: Region
    address: int

    def pieces(self, pointer: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Where host bytes ``[pointer, pointer + nbytes)`` are in the pinned bytes: ``(offset, length)``
        pieces, or None when they are not all inside the region."""
        offset = pointer - self.address
        if offset < 0 or offset + nbytes > self.region.bytes.numel():
            return None
        ring = self.region.ring
        if not ring:
            return [(offset, nbytes)]
        offset %= ring
        first = min(nbytes, ring - offset)
        return [(offset, first)] + ([(0, nbytes - first)] if nbytes > first else [])


class _Completions:
    """What follows each copy, once its event completed: giving back its own pin, then its ``on_done``.

    Unpinned first: the bytes are handed back unpinned, so the pages a released tensor leaves really go
    back to the volume (memory mode release), and the pages a ring reuses are never pinned by two
    registrations at once. A thread of its own waits on the events in the order of the copies, so nothing
    waits for a copy on the caller's thread, and a caller blocked on the next tensor still gets earlier
    copies consumed. The first error an ``on_done`` raises is kept for the caller; the later ``on_done``s
    are still called, so that a ring is not left waiting for tensors that were copied.
    """

    def __init__(self, unpin: Callable[[int], None]) -> None:
        self._unpin = unpin
        self._queue: queue.SimpleQueue[_Done | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(
        self,
        event: Event | None,
        keep: Any,
        pinned: int | None,
        on_done: Callable[[], None] | None,
    ) -> None:
        """After ``event`` (None: at once, after those before it): unpin ``pinned``, then ``on_done``.
        ``keep`` (the host tensor) stays referenced until then: its mapping must outlive the copy."""
        if on_done is None and pinned is None:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="modelload-gpu-copies", daemon=True)
            self._thread.start()
        self._queue.put(_Done(event, keep, pinned, on_done))

    def join(self) -> None:
        """Wait until everything put so far is done."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run(self) -> None:
        while (done := self._queue.get()) is not None:
            try:
                if done.event is not None:
                    done.event.synchronize()
                if done.pinned is not None:
                    self._unpin(done.pinned)
                if done.on_done is not None:
                    done.on_done()
            except BaseException as exc:  # for the caller: raised by its next copy() or finish()
                if self._error is None:
                    self._error = exc


@dataclass
class _Done:
    event: Event | None
    keep: Any
    pinned: int | None
    on_done: Callable[[], None] | None


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (a 0-dim tensor too: reshape first)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def copy_all(
    items: Iterable[tuple[str, torch.Tensor]],
    device: str | torch.device,
    *,
    on_done: Callable[[str], None] | None = None,
    region: Region | None = None,
    pin_in_place: bool = True,
    data: torch.Tensor | None = None,
) -> Iterator[tuple[str, Any]]:
    """Copy each ``(name, host tensor)`` to ``device`` as it comes; yield the device tensors at the end.

    ``on_done(name)`` is called for each tensor once its host bytes have been read (see
    :meth:`DeviceCopier.copy`), in the course of the copies rather than at the end. ``region``: the segment's
    mapping, pinned once for all the copies (:meth:`DeviceCopier.pin`). ``pin_in_place=False`` copies
    through the staging buffers only (``region`` is then not pinned). ``data``: the segment's data mapping as
    flat bytes, when the tensors are its views and nothing waits for them to be consumed (memory mode full):
    small neighbours are then copied in runs (:func:`runs`, :meth:`DeviceCopier.copy_run`), and each run's
    ``on_done`` calls come together once the run is read.
    """
    copier = DeviceCopier(device, pin_in_place=pin_in_place)

    def done(names: list[str]) -> Callable[[], None] | None:
        if on_done is None:
            return None
        callback = on_done

        def each() -> None:
            for name in names:
                callback(name)

        return each

    try:
        if region is not None:
            copier.pin(region)
        results: list[tuple[str, torch.Tensor]] = []
        for run in runs(items, data) if data is not None else ([item] for item in items):
            names = [name for name, _ in run]
            if len(run) == 1:
                results.append((names[0], copier.copy(run[0][1], on_done=done(names))))
            else:
                assert data is not None
                copied = copier.copy_run(data, [host for _, host in run], on_done=done(names))
                results.extend(zip(names, copied, strict=True))
    except BaseException:
        with suppress(Exception):  # the copies queued are waited for and the pins given back; this error wins
            copier.finish()
        raise
    copier.finish()
    yield from results


def runs(
    items: Iterable[tuple[str, torch.Tensor]], data: torch.Tensor
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``items`` in the same order, in lists: runs of small tensors that lie one after the other in ``data``
    (at most :data:`_RUN_GAP` bytes apart, spanning at most :data:`_RUN_BYTES`, each on a multiple of its
    element size there), and every other tensor alone. A run is yielded once the next tensor does not extend
    it, so it waits for that tensor: for memory mode full only, where no landing waits for a consumer."""
    base, length = data.data_ptr(), data.numel()
    run: list[tuple[str, torch.Tensor]] = []
    start = stop = 0
    for name, host in items:
        offset, nbytes, size = host.data_ptr() - base, host.nbytes, host.element_size()
        small = (
            0 < nbytes < _RUN_TENSOR
            and 0 <= offset <= length - nbytes
            and size in _SAME_SIZE_INTEGER
            and offset % size == 0
            and host.is_contiguous()
        )
        if run and small and 0 <= offset - stop <= _RUN_GAP and offset + nbytes - start <= _RUN_BYTES:
            run.append((name, host))
            stop = offset + nbytes
            continue
        if run:
            yield run
            run = []
        if small:
            run, start, stop = [(name, host)], _run_start(offset), offset + nbytes
        else:
            yield [(name, host)]
    if run:
        yield run


def _run_start(offset: int) -> int:
    """Where a run whose first tensor is at ``offset`` in the data starts its span: on a multiple of
    :data:`_RUN_ALIGN`, so that each element size divides every offset in its block."""
    return offset // _RUN_ALIGN * _RUN_ALIGN
