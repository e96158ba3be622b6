"""The CUDA driver library, ``libcuda.so.1``, through ctypes: the calls torch and its runtime bindings lack.

Two users. The copy to a GPU (``_api/gpu_copy.py``) pins host memory where it is (``cuMemHostRegister``,
read-only). Through the driver rather than torch's ``cudaHostRegister`` binding: a refused runtime call also
stays behind as the thread's "last error", which torch reports at the next kernel launch as if that kernel
had failed (seen on an H100: ``cudaErrorHostMemoryAlreadyRegistered`` raised by an unrelated ``torch.equal``),
and torch binds no ``cudaGetLastError`` to clear it. A driver call returns its status and leaves nothing
behind.

The hand-off needs a handful of driver calls that neither torch nor the runtime API exposes: allocations
that can be exported as a POSIX file descriptor (``cuMemCreate`` asking for
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, then ``cuMemExportToShareableHandle``), imported in another
process (``cuMemImportFromShareableHandle``), and mapped into an address range of that process with chosen
access (``cuMemAddressReserve``, ``cuMemMap``, ``cuMemSetAccess``). Unlike the legacy ``cudaIpc*`` handles,
a descriptor passed over a Unix socket needs no shared PID namespace: the kernel hands the other process its
own descriptor for the same allocation.

ctypes rather than ``cuda-python``: a dozen functions do not earn a dependency whose package names change with
the CUDA major version, and the driver's C ABI for these calls has been stable since CUDA 10.2. The driver
library comes with the NVIDIA driver (the container toolkit mounts it); without it every entry point raises
:class:`~modelload.loader.errors.DeviceError` saying so. This is the one module that calls the driver, and
driver errors become ``DeviceError`` here, named by call and by the driver's own error name.

Every call runs with the device's primary context current on the calling thread: the context torch uses,
so the addresses mapped here are ordinary device pointers to torch and its kernels, and host memory pinned
here is what torch's copies see as pinned.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from modelload.loader.errors import DeviceError

__all__ = ["Driver", "driver"]

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_MEMHOSTREGISTER_PORTABLE = 0x01
CU_MEMHOSTREGISTER_READ_ONLY = 0x08

_LIBRARY = "libcuda.so.1"


class CUmemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _AllocFlags(ctypes.Structure):
    _fields_ = (
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    )


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = (
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    )


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = (("location", CUmemLocation), ("flags", ctypes.c_int))


class CUuuid(ctypes.Structure):
    _fields_ = (("bytes", ctypes.c_ubyte * 16),)


_u64 = ctypes.c_ulonglong
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuGetErrorString": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
    "cuDeviceGetCount": (ctypes.POINTER(ctypes.c_int),),
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetAttribute": (ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDeviceGetName": (ctypes.c_char_p, ctypes.c_int, ctypes.c_int),
    "cuDeviceGetUuid": (ctypes.POINTER(CUuuid), ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
    "cuCtxSetCurrent": (ctypes.c_void_p,),
    "cuCtxPushCurrent": (ctypes.c_void_p,),
    "cuCtxPopCurrent": (ctypes.POINTER(ctypes.c_void_p),),
    "cuMemHostRegister": (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint),
    "cuMemHostUnregister": (ctypes.c_void_p,),
    "cuMemGetAllocationGranularity": (
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(CUmemAllocationProp),
        ctypes.c_int,
    ),
    "cuMemCreate": (ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.POINTER(CUmemAllocationProp), _u64),
    "cuMemRelease": (_u64,),
    "cuMemExportToShareableHandle": (ctypes.c_void_p, _u64, ctypes.c_int, _u64),
    "cuMemImportFromShareableHandle": (ctypes.POINTER(_u64), ctypes.c_void_p, ctypes.c_int),
    "cuMemAddressReserve": (ctypes.POINTER(_u64), ctypes.c_size_t, ctypes.c_size_t, _u64, _u64),
    "cuMemAddressFree": (_u64, ctypes.c_size_t),
    "cuMemMap": (_u64, ctypes.c_size_t, ctypes.c_size_t, _u64, _u64),
    "cuMemUnmap": (_u64, ctypes.c_size_t),
    "cuMemSetAccess": (_u64, ctypes.c_size_t, ctypes.POINTER(CUmemAccessDesc), ctypes.c_size_t),
}
_VERSIONED = {
    "cuDeviceGetUuid": "cuDeviceGetUuid_v2",
    "cuCtxPushCurrent": "cuCtxPushCurrent_v2",
    "cuCtxPopCurrent": "cuCtxPopCurrent_v2",
    "cuMemHostRegister": "cuMemHostRegister_v2",
}


class Driver:
    """The driver calls of the hand-off, each checked. One instance per process: see :func:`driver`."""

    def __init__(self, library: str = _LIBRARY) -> None:
        try:
            lib = ctypes.CDLL(library)
        except OSError as exc:
            raise DeviceError(
                f"cannot load the CUDA driver library {library} ({exc}): the CUDA hand-off needs an NVIDIA "
                "driver and a GPU in this container"
            ) from None
        self._fns: dict[str, Any] = {}
        for name, argtypes in _SIGNATURES.items():
            symbol = _VERSIONED.get(name, name)
            fn = getattr(lib, symbol, None) or getattr(lib, name, None)
            if fn is None:
                raise DeviceError(f"the CUDA driver {library} has no {symbol}: it is older than CUDA 10.2")
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            self._fns[name] = fn
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self.call("cuInit", 0)

    def call(self, name: str, *args: Any) -> None:
        status = self._fns[name](*args)
        if status:
            raise DeviceError(f"{name} failed: {self.describe(status)}")

    def describe(self, status: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._fns["cuGetErrorName"](status, ctypes.byref(name))
        self._fns["cuGetErrorString"](status, ctypes.byref(text))
        label = (name.value or b"CUDA_ERROR_%d" % status).decode()
        return f"{label} ({(text.value or b'').decode()})"

    # --- devices ------------------------------------------------------------------------------------------

    def device_count(self) -> int:
        count = ctypes.c_int()
        self.call("cuDeviceGetCount", ctypes.byref(count))
        return count.value

    def uuid(self, ordinal: int) -> str:
        """The GPU's UUID as ``nvidia-smi -L`` prints it (``GPU-xxxxxxxx-xxxx-...``): the same in every
        container that sees the GPU, whatever ordinal CUDA gives it there."""
        value = CUuuid()
        self.call("cuDeviceGetUuid", ctypes.byref(value), self._device(ordinal))
        raw = bytes(value.bytes).hex()
        return f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"

    def name(self, ordinal: int) -> str:
        buffer = ctypes.create_string_buffer(256)
        self.call("cuDeviceGetName", buffer, len(buffer), self._device(ordinal))
        return buffer.value.decode(errors="replace")

    def ordinal_of(self, uuid: str) -> int:
        """This process's ordinal for the GPU with ``uuid``; DeviceError when this container lacks it."""
        seen = [self.uuid(i) for i in range(self.device_count())]
        if uuid in seen:
            return seen.index(uuid)
        raise DeviceError(
            f"the keeper's GPU {uuid} is not visible in this container (it sees {', '.join(seen) or 'none'}):"
            " both containers must be given the same GPU (one DRA ResourceClaim listed in both; "
            "docs/handoff.md)"
        )

    def check_support(self, ordinal: int) -> None:
        """Refuse a GPU or driver without VMM allocations exportable as POSIX file descriptors."""
        for attribute, what in (
            (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
            (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "POSIX file descriptor export"),
        ):
            value = ctypes.c_int()
            self.call("cuDeviceGetAttribute", ctypes.byref(value), attribute, self._device(ordinal))
            if not value.value:
                raise DeviceError(f"GPU {ordinal} ({self.name(ordinal)}) does not support {what}")

    def _device(self, ordinal: int) -> int:
        device = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(device), ordinal)
        return device.value

    def use(self, ordinal: int) -> None:
        """Make the device's primary context (torch's) current on this thread."""
        self.call("cuCtxSetCurrent", ctypes.c_void_p(self._primary(ordinal)))

    @contextmanager
    def current(self, ordinal: int) -> Iterator[None]:
        """The device's primary context current on this thread for the calls inside, then the thread's own
        again: torch reads its current device from the current context, which this leaves as it was."""
        self.call("cuCtxPushCurrent", ctypes.c_void_p(self._primary(ordinal)))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self.call("cuCtxPopCurrent", ctypes.byref(popped))

    def _primary(self, ordinal: int) -> int:
        with self._lock:
            context = self._contexts.get(ordinal)
            if context is None:
                handle = ctypes.c_void_p()
                self.call("cuDevicePrimaryCtxRetain", ctypes.byref(handle), self._device(ordinal))
                context = self._contexts[ordinal] = int(handle.value or 0)
        return context

    # --- host memory ------------------------------------------------------------------------------------

    def host_register(self, address: int, size: int, *, ordinal: int) -> None:
        """Pin ``[address, address + size)`` of this process's memory for every context (portable), read-only:
        the device reads it, never writes it, so the kernel pins the pages as they are (a private mapping's
        page is not copied first). Raises :class:`DeviceError` naming the driver's refusal."""
        flags = CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY
        with self.current(ordinal):
            self.call("cuMemHostRegister", ctypes.c_void_p(address), size, flags)

    def host_unregister(self, address: int, *, ordinal: int) -> None:
        """Unpin the range :meth:`host_register` pinned at ``address``."""
        with self.current(ordinal):
            self.call("cuMemHostUnregister", ctypes.c_void_p(address))

    # --- allocations ------------------------------------------------------------------------------------

    def granularity(self, ordinal: int) -> int:
        """Bytes every block size, offset and address must be a multiple of on this device."""
        value = ctypes.c_size_t()
        prop = _prop(ordinal)
        self.call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(value),
            ctypes.byref(prop),
            CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        return int(value.value)

    def create(self, ordinal: int, size: int) -> int:
        """A new allocation of ``size`` bytes of the device's memory, exportable as a file descriptor."""
        handle = _u64()
        prop = _prop(ordinal)
        self.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        return int(handle.value)

    def export(self, handle: int) -> int:
        """A new file descriptor for the allocation: the caller owns (and closes) it."""
        fd = ctypes.c_int(-1)
        self.call(
            "cuMemExportToShareableHandle",
            ctypes.byref(fd),
            _u64(handle),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
        return fd.value

    def import_fd(self, fd: int) -> int:
        """The allocation behind a descriptor another process exported (the descriptor stays the caller's)."""
        handle = _u64()
        self.call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        return int(handle.value)

    def release(self, handle: int) -> None:
        self.call("cuMemRelease", _u64(handle))

    def map(self, handle: int, size: int, *, ordinal: int, alignment: int, writable: bool) -> int:
        """Map the allocation into a new address range of this process with the access asked; its address."""
        address = _u64()
        self.call("cuMemAddressReserve", ctypes.byref(address), size, alignment, _u64(0), _u64(0))
        try:
            self.call("cuMemMap", address, size, 0, _u64(handle), _u64(0))
            try:
                self.set_access(address.value, size, ordinal=ordinal, writable=writable)
            except BaseException:
                self.call("cuMemUnmap", address, size)
                raise
        except BaseException:
            self.call("cuMemAddressFree", address, size)
            raise
        return int(address.value)

    def set_access(self, address: int, size: int, *, ordinal: int, writable: bool) -> None:
        flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else CU_MEM_ACCESS_FLAGS_PROT_READ
        desc = CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal), flags)
        self.call("cuMemSetAccess", _u64(address), size, ctypes.byref(desc), 1)

    def unmap(self, address: int, size: int) -> None:
        """Undo :meth:`map`: the range is unmapped and given back."""
        try:
            self.call("cuMemUnmap", _u64(address), size)
        finally:
            self.call("cuMemAddressFree", _u64(address), size)


def _prop(ordinal: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)
    return prop


_driver: Driver | None = None
_driver_lock = threading.Lock()


def driver() -> Driver:
    """The process's driver, loaded and initialised on first use."""
    global _driver  # noqa: PLW0603  # one driver library per process, loaded once
    with _driver_lock:
        if _driver is None:
            _driver = Driver()
        return _driver
