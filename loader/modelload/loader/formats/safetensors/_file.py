"""A local safetensors file, read tensor by tensor into buffers the caller owns.

This is the simple path for files on a local disk (the ``stage`` and ``inspect`` commands): the index comes
from :func:`read_index` with the file's real size, so every rule is checked, including the ones that need
the size; each tensor's bytes then go straight from the kernel into the caller's memory with ``os.preadv``,
without an intermediate ``bytes`` object.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from modelload.loader.errors import TruncatedError
from modelload.loader.formats._index import ModelIndex, TensorEntry, WritableBuffer
from modelload.loader.formats.safetensors._header import read_index

if TYPE_CHECKING:
    from modelload.loader.formats.tensorizer.tensor_header import TensorHeader

__all__ = ["SafetensorsFile", "WritableBuffer", "load_numpy"]


class SafetensorsFile:
    """An open safetensors file: its checked index, and reads of single tensors.

    >>> import numpy as np, tempfile, os
    >>> from modelload.loader.formats.safetensors import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "tiny.safetensors")
    >>> save_file({"w": np.arange(6, dtype=np.int32).reshape(2, 3)}, path)
    >>> with SafetensorsFile(path) as f:
    ...     f.numpy("w").tolist()
    [[0, 1, 2], [3, 4, 5]]
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            size = os.fstat(self._fd).st_size
            self.index: ModelIndex = read_index(self._pread, source=self.path, size=size)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def metadata(self) -> dict[str, str]:
        """The file's ``__metadata__`` (empty when it has none)."""
        return self.index.metadata

    def names(self) -> list[str]:
        """Tensor names in file order."""
        return [entry.name for entry in self.index.tensors]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.index.tensors)

    def entry(self, tensor: str | TensorEntry) -> TensorEntry:
        """The index entry of one tensor (``KeyError`` when the file has no such tensor)."""
        return self.index.entry(tensor, source=self.path)

    def read_header(self, tensor: str | TensorEntry) -> TensorHeader | None:
        """None: safetensors records have no header (the :class:`~modelload.loader.formats.ModelReader`
        protocol's tensorizer part)."""
        self.entry(tensor)
        return None

    def read_record(self, tensor: str | TensorEntry, out: WritableBuffer) -> None:
        """:meth:`readinto`: a safetensors tensor is stored as it loads, with no header to return."""
        self.readinto(tensor, out)

    def readinto(self, tensor: str | TensorEntry, buffer: WritableBuffer) -> None:
        """Read one tensor's bytes into ``buffer``, which must be writable, contiguous and exactly as long."""
        entry = self.entry(tensor)
        name = entry.name
        view = buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
        if view.readonly:
            raise ValueError(f"the buffer for tensor {name!r} is read-only")
        if view.nbytes != entry.data_length:
            raise ValueError(f"tensor {name!r} is {entry.data_length} bytes, the buffer {view.nbytes}")
        if entry.data_length == 0:
            return
        if not view.c_contiguous:
            raise ValueError(f"the buffer for tensor {name!r} is not C-contiguous")
        self._readinto(view.cast("B"), entry.data_offset)

    def chunks(self, tensor: str | TensorEntry, scratch: WritableBuffer) -> Iterator[memoryview]:
        """One tensor's bytes in order, read piece by piece into ``scratch`` and yielded as views of it.

        Each view is valid until the next one is read. Memory stays at ``scratch`` whatever the tensor's
        size: the way to read a tensor through (to check the file is whole) without holding it.
        """
        entry = self.entry(tensor)
        window = scratch.data if isinstance(scratch, np.ndarray) else memoryview(scratch)
        window = window.cast("B")
        if not window.nbytes or window.readonly:
            raise ValueError("chunks() needs a writable scratch buffer of at least one byte")
        for start in range(0, entry.data_length, window.nbytes):
            piece = window[: min(window.nbytes, entry.data_length - start)]
            self._readinto(piece, entry.data_offset + start)
            yield piece

    def check(self, tensor: str | TensorEntry, *, scratch: WritableBuffer) -> None:
        """Read one tensor through ``scratch`` to its end: the file holds it whole (safetensors stores no
        hashes to compare)."""
        for _ in self.chunks(tensor, scratch):
            pass

    def numpy(self, tensor: str | TensorEntry) -> np.ndarray[Any, Any]:
        """One tensor as a fresh numpy array (types numpy lacks, such as bfloat16, as same-width unsigned
        integers: reinterpret with torch's ``.view(dtype)``)."""
        entry = self.entry(tensor)
        array: np.ndarray[Any, Any] = np.empty(entry.shape, dtype=entry.dtype.numpy)
        self.readinto(entry, array)
        return array

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pread(self, offset: int, length: int) -> bytes:
        return os.pread(self._fd, length, offset)

    def _readinto(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                count = os.preadv(self._fd, [view[done:]], offset + done)
            else:  # pragma: no cover - platforms without preadv
                chunk = os.pread(self._fd, len(view) - done, offset + done)
                view[done : done + len(chunk)] = chunk
                count = len(chunk)
            if count == 0:
                raise TruncatedError(
                    f"the file ended at byte {offset + done} while reading a tensor: it shrank after it was "
                    "opened (is something rewriting it?)",
                    source=self.path,
                )
            done += count


def load_numpy(path: str | os.PathLike[str]) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of a local safetensors file as numpy arrays, in file order."""
    with SafetensorsFile(path) as file:
        return {name: file.numpy(name) for name in file.names()}
