"""GPU memory that one process allocates and exports and others map: the CUDA side of the hand-off.

The keeper allocates blocks (:class:`CudaMemory`), copies the model into them, and exports each as a file
descriptor; an app process imports those descriptors and maps them (:class:`CudaMapper`). Both sides see
a block as torch tensors over its address range, made through ``__cuda_array_interface__``: no copy, and
the tensors keep the block mapped. A mapped block is unmapped once no tensor uses it any more.

The memory lives as long as any process holds it: the keeper's allocation handle and descriptors, or an
app's mapping (docs/handoff.md, "Lifetimes"). An app's mapping therefore survives a keeper that exits, and
a keeper's allocation survives every app that restarts.

:class:`Memory` and :class:`Mapper` are the two small interfaces the keeper and the client program against;
the CPU tests give them memfd-backed stand-ins, so the protocol and the keeper run for real without a GPU.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from modelload.loader._cuda import Driver, driver
from modelload.loader.errors import DeviceError
from modelload.loader.handoff.protocol import TensorPlace

if TYPE_CHECKING:
    import torch

    from modelload.loader._api.gpu_copy import Region

__all__ = [
    "Block",
    "Copier",
    "CudaMapper",
    "CudaMemory",
    "ExportedBlock",
    "Mapped",
    "Mapper",
    "Memory",
    "view",
]

log = logging.getLogger(__name__)


class Block(Protocol):
    """A block of memory seen from one process: its size and its bytes as a torch tensor."""

    size: int

    def bytes(self) -> torch.Tensor:
        """The whole block as a flat uint8 tensor, without a copy."""


class ExportedBlock(Block, Protocol):
    fd: int
    """The block's exported descriptor, owned by the block (sent to apps; the kernel gives each a copy)."""


class Copier(Protocol):
    """Copies host tensors into tensors of the blocks (``DeviceCopier``'s shape)."""

    def copy(
        self, host: torch.Tensor, *, into: torch.Tensor, on_done: Callable[[], None] | None = None
    ) -> torch.Tensor: ...

    def pin(self, region: Region) -> bool:
        """Pin ``region`` once for every copy from inside it; False where it was refused."""

    def finish(self) -> None: ...


class Memory(Protocol):
    """The keeper's side: where blocks come from."""

    @property
    def device(self) -> Mapping[str, str]:
        """``uuid`` and ``name`` of the GPU, for the manifest."""

    @property
    def granularity(self) -> int:
        """Bytes every block size is a multiple of."""

    def allocate(self, size: int) -> ExportedBlock: ...

    def copier(self, *, pin_in_place: bool) -> Copier:
        """A copier into the blocks; ``pin_in_place=False`` stages every copy through pinned buffers."""


@dataclass(frozen=True)
class Mapped:
    """The keeper's blocks as mapped into this process."""

    device: Any
    """The torch device they are on, by this process's numbering."""
    blocks: list[Block]
    writable: bool
    """Whether this process may write them (a write lands in the keeper's copy, for every app after it)."""


class Mapper(Protocol):
    """The app's side: descriptors from the keeper, mapped into this process."""

    def map(
        self, device: Mapping[str, Any], fds: Sequence[int], sizes: Sequence[int], *, writable: bool
    ) -> Mapped:
        """Map each descriptor (the caller closes them afterwards)."""


def view(blocks: Sequence[torch.Tensor], place: TensorPlace) -> torch.Tensor:
    """Tensor ``place`` over its block's bytes (``blocks``: each block's :meth:`Block.bytes`)."""
    flat = blocks[place.block][place.offset : place.offset + place.nbytes]
    target = place.dtype.torch()
    if target != flat.dtype:
        flat = flat.view(target)
    return flat.reshape(place.shape)


# --- CUDA --------------------------------------------------------------------------------------------------


class _CudaBlock:
    """A block mapped into this process. Its ``__cuda_array_interface__`` lets torch wrap it without a copy;
    every tensor over it holds a reference, and the range is unmapped when the last one goes."""

    def __init__(self, driver: Driver, *, ordinal: int, address: int, size: int, torch_device: Any) -> None:
        self.size = size
        self.address = address
        self._ordinal = ordinal
        self._torch_device = torch_device
        self.fd = -1
        finalizer = weakref.finalize(self, _unmap, driver, ordinal, address, size)
        finalizer.atexit = False  # at exit the driver tears the process's mappings down itself

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        # data: (pointer, read-only flag); torch refuses the flag set, whatever the mapping's access
        return {
            "shape": (self.size,),
            "typestr": "|u1",
            "data": (self.address, False),
            "strides": None,
            "version": 3,
        }

    def bytes(self) -> torch.Tensor:
        import torch

        tensor = torch.as_tensor(self, device=self._torch_device)
        if tensor.data_ptr() != self.address:
            raise DeviceError(
                f"torch copied a mapped block instead of wrapping it (its device {tensor.device}, the "
                f"block's {self._torch_device})"
            )
        return tensor


def _unmap(driver: Driver, ordinal: int, address: int, size: int) -> None:
    try:
        driver.use(ordinal)
        driver.unmap(address, size)
    except DeviceError as exc:  # a finaliser has no caller to tell: say it, once per block
        log.warning("unmapping a hand-off block failed: %s", exc)


class CudaMemory:
    """The keeper's blocks: VMM allocations on one GPU, exportable as file descriptors."""

    def __init__(self, device: str | torch.device) -> None:
        import torch

        self._torch_device = torch.device(device)
        if self._torch_device.type != "cuda":
            raise DeviceError(f"the keeper holds weights on a CUDA device, not {self._torch_device}")
        _require_cuda()
        torch.empty(0, device=self._torch_device)  # torch makes its (the primary) context first
        self._ordinal = (
            self._torch_device.index if self._torch_device.index is not None else torch.cuda.current_device()
        )
        self._torch_device = torch.device("cuda", self._ordinal)
        self._driver = driver()
        self._driver.check_support(self._ordinal)
        self._driver.use(self._ordinal)
        self.device = {"uuid": self._driver.uuid(self._ordinal), "name": self._driver.name(self._ordinal)}
        self.granularity = self._driver.granularity(self._ordinal)
        self._handles: list[int] = []

    def allocate(self, size: int) -> _CudaBlock:
        drv = self._driver
        drv.use(self._ordinal)
        handle = drv.create(self._ordinal, size)
        try:
            address = drv.map(handle, size, ordinal=self._ordinal, alignment=self.granularity, writable=True)
            block = _CudaBlock(
                drv, ordinal=self._ordinal, address=address, size=size, torch_device=self._torch_device
            )
            block.fd = drv.export(handle)
        except BaseException:
            drv.release(handle)
            raise
        self._handles.append(handle)  # held for the keeper's life: the memory outlives every app's restart
        return block

    def copier(self, *, pin_in_place: bool) -> Copier:
        from modelload.loader._api.gpu_copy import DeviceCopier

        return DeviceCopier(self._torch_device, pin_in_place=pin_in_place)


class CudaMapper:
    """An app's view of a keeper's blocks: each descriptor imported and mapped on the keeper's GPU."""

    def map(
        self, device: Mapping[str, Any], fds: Sequence[int], sizes: Sequence[int], *, writable: bool
    ) -> Mapped:
        import torch

        _require_cuda()
        drv = driver()
        ordinal = drv.ordinal_of(str(device["uuid"]))
        torch_device = torch.device("cuda", ordinal)
        torch.empty(0, device=torch_device)  # the primary context, made by torch first
        drv.use(ordinal)
        granularity = drv.granularity(ordinal)
        blocks: list[Block] = []
        for fd, size in zip(fds, sizes, strict=True):
            if size % granularity:
                raise DeviceError(f"a block of {size} bytes is not a multiple of this GPU's {granularity}")
            handle = drv.import_fd(fd)
            try:
                address, writable = self._map(drv, handle, size, ordinal, granularity, writable)
            finally:
                drv.release(handle)  # the mapping keeps the memory; the handle is not needed any more
            blocks.append(
                _CudaBlock(drv, ordinal=ordinal, address=address, size=size, torch_device=torch_device)
            )
        return Mapped(torch_device, blocks, writable)

    @staticmethod
    def _map(
        drv: Driver, handle: int, size: int, ordinal: int, granularity: int, writable: bool
    ) -> tuple[int, bool]:
        """Map read-only unless asked otherwise; where the driver refuses read-only access, map read-write
        and say so (the app then must not write: the keeper's copy is every later app's)."""
        try:
            return drv.map(handle, size, ordinal=ordinal, alignment=granularity, writable=writable), writable
        except DeviceError as exc:
            if writable:
                raise
            log.warning("read-only mapping refused (%s); mapping the keeper's blocks read-write", exc)
            return drv.map(handle, size, ordinal=ordinal, alignment=granularity, writable=True), True


def _require_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        raise DeviceError(
            f"torch {torch.__version__} sees no CUDA device"
            + ("" if built else " (it is a build without CUDA)")
            + ": the hand-off needs the GPU and a CUDA build of torch in this container"
        )


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            log.debug("descriptor %d was already closed", fd)
