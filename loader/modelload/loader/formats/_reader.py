"""One reader interface for local model files, whatever their format.

:class:`~modelload.loader.formats.tensorizer.TensorizerReader` and
:class:`~modelload.loader.formats.safetensors.SafetensorsFile` both implement :class:`ModelReader`, with the
same names for the same things, so the commands that read local files (``stage``, ``inspect``,
``serialize``) never ask which one they hold. What only tensorizer has (record headers: module indices,
hashes, encryption) comes back as a :class:`TensorHeader`, or None from a format without one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from modelload.loader.formats._index import FormatName, ModelIndex, TensorEntry, WritableBuffer
from modelload.loader.formats.safetensors._file import SafetensorsFile
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.reader import TensorizerReader
from modelload.loader.formats.tensorizer.tensor_header import TensorHeader

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ModelReader", "open_reader"]


class ModelReader(Protocol):
    """An open local model file: its checked index, and its tensors into buffers the caller owns."""

    path: str
    """The file's path, as given."""
    index: ModelIndex

    def entry(self, tensor: str | TensorEntry) -> TensorEntry:
        """A tensor's index entry (``KeyError`` naming the file when it has no such tensor)."""
        ...

    def read_header(self, tensor: str | TensorEntry) -> TensorHeader | None:
        """The tensor's record header (tensorizer), or None for a format without one."""
        ...

    def read_record(self, tensor: str | TensorEntry, out: WritableBuffer) -> bytes | bytearray | None:
        """Land the tensor's data as stored (encrypted, unchecked) at the start of ``out`` (exactly
        ``nbytes``); its record header's bytes, for the segment's ``TensorFinisher`` to open, or None."""
        ...

    def readinto(self, tensor: str | TensorEntry, out: WritableBuffer) -> TensorHeader | None:
        """The tensor's plaintext in ``out`` (exactly ``nbytes``), decrypted and verified where the format
        can be; the record header, or None."""
        ...

    def check(self, tensor: str | TensorEntry, *, scratch: WritableBuffer) -> TensorHeader | None:
        """Read the tensor through ``scratch`` to its end, checking what the format stores; keep nothing."""
        ...

    def numpy(self, tensor: str | TensorEntry) -> np.ndarray[Any, Any]:
        """The tensor as a new numpy array (opaque dtypes as same-width unsigned integers)."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...


def open_reader(
    path: str | os.PathLike[str],
    format: FormatName,  # noqa: A002 - the word every caller uses
    *,
    key: DecryptionKey | None = None,
    verify: bool = True,
    hashes: Literal["all", "fastest"] = "all",
) -> ModelReader:
    """Open a local file of a known format. ``key``, ``verify`` and ``hashes`` apply to tensorizer files
    (safetensors stores no hashes and is never encrypted)."""
    if format == "tensorizer":
        return TensorizerReader(path, key=key, verify=verify, hashes=hashes)
    return SafetensorsFile(path)
