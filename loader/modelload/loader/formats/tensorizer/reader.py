"""A whole-file reader for local tensorizer files: the index, then any tensor into a buffer you give.

This is what ``modelload stage``, ``inspect`` and ``serialize`` use on files on disk, through the
:class:`~modelload.loader.formats.ModelReader` protocol the safetensors reader shares; the sidecar instead
reads ranges from remote sources and finishes each record with the same :func:`.record.open_record`.

Data goes straight from the file into the caller's buffer with ``os.preadv`` (one syscall for the header and
the data when the file has a descriptor), is decrypted there, and verified there. Reads use positional I/O,
so several threads may call :meth:`TensorizerReader.readinto` at once on one reader.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal

import numpy as np

from modelload.loader.errors import ConfigError, NotEncryptedError, TruncatedError
from modelload.loader.formats._index import ModelIndex, TensorEntry, WritableBuffer
from modelload.loader.formats.tensorizer._arrays import as_numpy, as_torch
from modelload.loader.formats.tensorizer.crypto import TensorDecryptor
from modelload.loader.formats.tensorizer.hashes import TensorHasher, fastest_hash
from modelload.loader.formats.tensorizer.index import read_index
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.record import KeyState, open_record
from modelload.loader.formats.tensorizer.tensor_header import TensorHeader, parse_tensor_header

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["TensorizerReader"]


class TensorizerReader:
    """Reads a local tensorizer file (a path, or a binary file object that can seek).

    >>> key = DecryptionKey.from_file("key")                          # doctest: +SKIP
    >>> with TensorizerReader("model.tensors", key=key) as reader:
    ...     for entry in reader.index.tensors:
    ...         out = bytearray(entry.nbytes)
    ...         reader.readinto(entry, out)             # decrypted and verified in place
    ...     weights = reader.numpy("lm_head.weight")
    """

    def __init__(
        self,
        file: str | os.PathLike[str] | IO[bytes],
        *,
        key: DecryptionKey | None = None,
        verify: bool = True,
        hashes: Literal["all", "fastest"] = "all",
    ) -> None:
        if isinstance(file, str | os.PathLike):
            self._file: IO[bytes] = Path(file).open("rb")  # noqa: SIM115 - closed by close()
            self._owned = True
            self.path = os.fspath(file)
        else:
            self._file = file
            self._owned = False
            self.path = str(getattr(file, "name", "<file object>"))
        try:
            self._fd: int | None = self._file.fileno()
        except (OSError, AttributeError, io.UnsupportedOperation):
            self._fd = None
        self._lock = threading.Lock()
        self._keys = KeyState(key)
        self._verify = verify
        self._hashes = hashes
        try:
            self.size = self._size()
            self.index: ModelIndex = read_index(self._read_range, source=self.path, size=self.size)
            if key is not None and not self.index.encrypted:
                raise NotEncryptedError(
                    f"{self.path}: a key was given but the file is not encrypted; drop the key, or check "
                    "that this is the file you meant"
                )
        except BaseException:
            self.close()
            raise

    @property
    def source(self) -> str:
        """The file's path (or a file object's name): :attr:`path`, under its older name."""
        return self.path

    # --- file access -------------------------------------------------------------------------------------

    def _size(self) -> int:
        if self._fd is not None:
            return os.fstat(self._fd).st_size
        with self._lock:
            return self._file.seek(0, io.SEEK_END)

    def _read_range(self, offset: int, length: int) -> bytes:
        if self._fd is not None:
            return os.pread(self._fd, length, offset)
        with self._lock:
            self._file.seek(offset)
            return self._file.read(length)

    def _readinto(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` in order from ``offset``; a short read means the file ends early."""
        wanted = sum(v.nbytes for v in views)
        done = 0
        while views:
            if self._fd is not None:
                got = os.preadv(self._fd, views, offset + done)
            else:
                with self._lock:
                    self._file.seek(offset + done)
                    got = self._file.readinto(views[0]) or 0  # type: ignore[attr-defined]
            if got == 0:
                raise TruncatedError(
                    f"the file ends at byte {offset + done}, inside a tensor record that should end at byte "
                    f"{offset + wanted}; re-upload or re-create it",
                    source=self.path,
                )
            done += got
            while views and got >= views[0].nbytes:
                got -= views[0].nbytes
                views.pop(0)
            if views and got:
                views[0] = views[0][got:]

    # --- tensors -----------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.index.tensors)

    def __iter__(self) -> Iterator[str]:
        return (t.name for t in self.index.tensors)

    def entry(self, tensor: str | TensorEntry) -> TensorEntry:
        """The index entry of one tensor (``KeyError`` when the file has no such tensor)."""
        return self.index.entry(tensor, source=self.path)

    def read_header(self, tensor: str | TensorEntry) -> TensorHeader:
        """The parsed per-tensor header (module index, hashes, encryption parameters), checked against
        its index entry."""
        entry = self.entry(tensor)
        buf = bytearray(entry.header_length)
        self._readinto([memoryview(buf)], entry.record_offset)
        return self._parse(buf, entry)

    def _parse(self, buf: bytearray, entry: TensorEntry) -> TensorHeader:
        return parse_tensor_header(buf, entry=entry, encrypted_file=self.index.encrypted, source=self.path)

    def read_record(self, tensor: str | TensorEntry, out: Buffer | WritableBuffer) -> bytearray:
        """Land one tensor's data as stored (ciphertext when encrypted, unchecked) in the first
        ``data_length`` bytes of ``out`` (writable, exactly ``nbytes``); its record header's bytes.

        One ``preadv`` for both. :func:`.record.open_record` (or the segment's ``TensorFinisher``) then
        decrypts and verifies the data where it lies.
        """
        entry = self.entry(tensor)
        view = _writable(out, entry)
        header = bytearray(entry.header_length)
        views = [memoryview(header), view[: entry.data_length]] if entry.data_length else [memoryview(header)]
        self._readinto(views, entry.record_offset)
        return header

    def readinto(self, tensor: str | TensorEntry, out: Buffer | WritableBuffer) -> TensorHeader:
        """Read one tensor's bytes into ``out`` (writable, exactly ``nbytes``), decrypt and verify them there.

        A meta tensor (no data in the file) comes out as zeros. Returns the tensor's parsed header.
        """
        entry = self.entry(tensor)
        view = _writable(out, entry)
        header = self.read_record(entry, view)
        parsed = open_record(
            header,
            view[: entry.data_length],
            entry=entry,
            encrypted_file=self.index.encrypted,
            keys=self._keys,
            hashes=self._hashes if self._verify else "none",
            source=self.path,
        )
        if entry.data_length == 0 and entry.nbytes:
            np.frombuffer(view, dtype=np.uint8)[:] = 0
        return parsed

    def check(self, tensor: str | TensorEntry, *, scratch: Buffer | WritableBuffer) -> TensorHeader:
        """Decrypt and verify one tensor a piece at a time through ``scratch``, keeping nothing.

        This is ``readinto`` for a caller that wants the verdict, not the bytes (``inspect --verify``): memory
        stays at ``scratch``, whatever the tensor's size, and a meta tensor (no data) costs nothing although
        it would load as zeros. An encrypted tensor is opened one encryption chunk at a time; a chunk larger
        than ``scratch`` gets a buffer of its own, which the file's own bytes bound (the chunk lies in it).
        Raises as :meth:`readinto` does.
        """
        entry = self.entry(tensor)
        window = _view(scratch).cast("B")
        if not window.nbytes or window.readonly:
            raise ConfigError("check() needs a writable scratch buffer of at least one byte")
        header = self.read_header(entry)
        hasher = TensorHasher(fastest_hash(header) if self._hashes == "fastest" else header, source=self.path)
        if header.encrypted:
            decryptor = TensorDecryptor(
                header, self._keys.key, source=self.path, key_known_good=self._keys.proven
            )
            for k in range(decryptor.chunk_count):
                start, length = decryptor.chunk_span(k)
                piece = window[:length] if length <= window.nbytes else memoryview(bytearray(length))
                self._readinto([piece], entry.data_offset + start)
                decryptor.decrypt_chunk(k, piece)
                self._keys.prove()
                hasher.update(piece)
        else:
            for start in range(0, entry.data_length, window.nbytes):
                piece = window[: min(window.nbytes, entry.data_length - start)]
                self._readinto([piece], entry.data_offset + start)
                hasher.update(piece)
        hasher.verify()
        return header

    def numpy(self, tensor: str | TensorEntry) -> np.ndarray[Any, Any]:
        """A new numpy array with the tensor (opaque dtypes as same-width unsigned integers)."""
        entry = self.entry(tensor)
        storage = np.empty(entry.nbytes, dtype=np.uint8)
        self.readinto(entry, storage.data)
        return as_numpy(storage, entry.dtype, entry.shape)

    read_numpy = numpy
    """:meth:`numpy`, under its older name."""

    def read_torch(self, tensor: str | TensorEntry) -> Any:
        """A new CPU torch tensor with the tensor's true dtype. Imports torch."""
        entry = self.entry(tensor)
        return as_torch(self.numpy(entry), entry.dtype)

    def iter_numpy(self) -> Iterator[tuple[str, np.ndarray[Any, Any]]]:
        """Every tensor in file order, as (name, numpy array)."""
        for entry in self.index.tensors:
            yield entry.name, self.numpy(entry)

    # --- lifetime ----------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._owned:
            self._file.close()

    def __enter__(self) -> TensorizerReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorizerReader({self.path!r}, {len(self.index.tensors)} tensors, v{self.index.version})"


def _writable(out: Buffer | WritableBuffer, entry: TensorEntry) -> memoryview:
    """``out`` as flat bytes, checked to be writable and exactly the tensor's size."""
    view = _view(out)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.readonly or view.nbytes != entry.nbytes:
        raise ConfigError(
            f"readinto({entry.name!r}) needs a writable buffer of exactly {entry.nbytes} bytes, got "
            f"{'a read-only one of ' if view.readonly else ''}{view.nbytes}"
        )
    return view


def _view(buffer: Buffer | WritableBuffer) -> memoryview:
    return buffer.data if isinstance(buffer, np.ndarray) else memoryview(buffer)
