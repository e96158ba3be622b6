"""An in-memory source, for tests only: it lives here, not in the sidecar, so production never opens it.

It behaves like a real source (cached stat, range checks, change detection) and can be scripted to fail,
so the engine's retry and resume paths can be tested without a server::

    src = MemorySource(b"x" * 100, faults=[Interrupt(landed=10), None])
    buf = bytearray(50)
    read_range(src, 0, memoryview(buf), policy=RetryPolicy(initial_backoff=0))
    assert src.calls == [(0, 50), (10, 40)]

``memory://NAME`` URIs open objects published with :func:`put_memory_object`, once a test has called
:func:`register_memory_scheme` (the sidecar registers no such scheme: a pod cannot name one).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from modelload.loader.errors import SourceChangedError, SourceError, SourceNotFoundError
from modelload.sidecar.sources import (
    InterruptedReadError,
    ObjectInfo,
    SourceBase,
    SourceSettings,
    register_source,
)
from modelload.sidecar.sources._base import byte_view

__all__ = [
    "Interrupt",
    "MemorySource",
    "put_memory_object",
    "register_memory_scheme",
    "remove_memory_object",
]


@dataclass(frozen=True)
class Interrupt:
    """A scripted broken stream: ``landed`` bytes arrive, then InterruptedReadError (``retry_after`` set)."""

    landed: int = 0
    retry_after: float | None = None


Fault = Interrupt | SourceError | None


class MemorySource(SourceBase):
    """A source over a bytes-like object.

    ``faults`` is consumed one entry per ``read_into`` call: ``None`` reads normally, an :class:`Interrupt`
    lands some bytes then fails transiently, an exception instance is raised as is. Once the list is used up,
    reads succeed. ``calls`` records every ``(offset, length)`` asked for, in order.
    """

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        *,
        name: str = "memory://object",
        faults: Iterable[Fault] = (),
        accepts_ranges: bool = True,
    ) -> None:
        super().__init__(name)
        self._data = memoryview(data).cast("B")
        self._version = 1
        self._faults = list(faults)
        self._accepts_ranges = accepts_ranges
        self._lock = threading.Lock()
        self.calls: list[tuple[int, int]] = []

    def replace(self, data: bytes | bytearray | memoryview) -> None:
        """Swap the object's bytes, as if it were re-uploaded: reads after a stat now fail as changed."""
        with self._lock:
            self._data = memoryview(data).cast("B")
            self._version += 1

    def add_faults(self, *faults: Fault) -> None:
        """Append to the fault script."""
        with self._lock:
            self._faults.extend(faults)

    def _etag(self) -> str:
        return f'"v{self._version}"'

    def _stat(self) -> ObjectInfo:
        with self._lock:
            return ObjectInfo(size=len(self._data), etag=self._etag(), accepts_ranges=self._accepts_ranges)

    def read_into(self, offset: int, buf: memoryview) -> None:
        buf = byte_view(buf)
        length = len(buf)
        info = self._checked_range(offset, length)
        with self._lock:
            self.calls.append((offset, length))
            fault = self._faults.pop(0) if self._faults else None
            if self._etag() != info.etag:
                raise SourceChangedError(
                    f"{self.display_uri} changed during the read (ETag {info.etag} -> {self._etag()})",
                    uri=self.display_uri,
                )
            data = self._data
        if isinstance(fault, Interrupt):
            landed = min(fault.landed, length)
            buf[:landed] = data[offset : offset + landed]
            raise InterruptedReadError(
                f"scripted interruption of {self.display_uri} after {landed} bytes",
                uri=self.display_uri,
                landed=landed,
                retry_after=fault.retry_after,
            )
        if fault is not None:
            raise fault
        buf[:] = data[offset : offset + length]


_objects: dict[str, bytes] = {}
_objects_lock = threading.Lock()


def put_memory_object(name: str, data: bytes) -> str:
    """Publish ``data`` under ``memory://name`` for :func:`open_source`; returns the URI."""
    with _objects_lock:
        _objects[name] = data
    return f"memory://{name}"


def remove_memory_object(name: str) -> None:
    """Forget an object published with :func:`put_memory_object`."""
    with _objects_lock:
        _objects.pop(name, None)


def open_memory(uri: str, settings: SourceSettings) -> MemorySource:
    """The registry's factory for ``memory://NAME``."""
    name = uri.removeprefix("memory://")
    with _objects_lock:
        data = _objects.get(name)
    if data is None:
        raise SourceNotFoundError(
            f"no in-memory object named {name!r} (publish it with put_memory_object)", uri=uri
        )
    return MemorySource(data, name=uri)


def register_memory_scheme() -> None:
    """Let :func:`~modelload.sidecar.sources.open_source` open ``memory://`` URIs (idempotent)."""
    register_source("memory", open_memory)
