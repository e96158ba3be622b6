"""What a model file holds, as far as planning a load needs: the index every format reader returns.

An index is read from the first bytes of a file alone (the tensorizer metadata block, the safetensors JSON
header), so a remote reader can plan its byte ranges from one or two small reads. It says where each
tensor's bytes are in the file and how many bytes the tensor takes in memory; the bytes themselves are read
later, by range.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from modelload.loader.dtypes import DType

__all__ = ["MAX_NDIM", "FormatName", "ModelIndex", "RangeRead", "TensorEntry", "WritableBuffer"]

MAX_NDIM = 64
"""The most dimensions a tensor may have: numpy's limit (and torch's), and the segment's. A file that declares
more could be indexed but never loaded, so the readers refuse it with the index."""

FormatName = Literal["tensorizer", "safetensors"]

WritableBuffer = bytearray | memoryview | mmap.mmap | np.ndarray[Any, Any]
"""Anything that exposes writable, C-contiguous memory through the buffer protocol: what the readers fill."""

RangeRead = Callable[[int, int], bytes]
"""``read(offset, length) -> bytes``: at most ``length`` bytes of the file from ``offset`` (fewer only at
the end of the file). Format readers take one of these to read an index without knowing the source."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a model file.

    The bytes to fetch for this tensor are ``[record_offset, data_offset + data_length)``. For safetensors the
    record is the data alone; for tensorizer it starts with the per-tensor header (hashes, encryption
    parameters), which the reader parses to verify and decrypt.
    """

    name: str
    """The tensor's name (a state_dict key; tensorizer structured paths are rendered as dotted keys)."""
    dtype: DType
    shape: tuple[int, ...]
    record_offset: int
    """Absolute file offset of the first byte to fetch for this tensor."""
    data_offset: int
    """Absolute file offset of the tensor's data bytes."""
    data_length: int
    """Bytes of data in the file: ``nbytes``, or 0 for a tensorizer meta tensor (no data, zeros)."""
    path: tuple[str | int, ...] | None = None
    """The structured state_dict path when the file stores one (tensorizer's ``\\x1e[...]`` names); the
    ``name`` is then its components joined with dots."""
    kind: Literal["param", "buffer", "state_dict"] = "state_dict"
    """tensorizer's tensor type; safetensors tensors are all ``state_dict``."""
    encrypted: bool = False
    file: int = 0
    """Which of the model's weight files holds the tensor (an index into :attr:`ModelIndex.files`); its
    offsets are in that file. Always 0 for a model of one file."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in memory: element size times the number of elements."""
        return self.dtype.nbytes(self.shape)

    @property
    def header_length(self) -> int:
        """Bytes of the record's header before the data: tensorizer's per-tensor header, 0 for safetensors."""
        return self.data_offset - self.record_offset

    @property
    def record_length(self) -> int:
        return self.header_length + self.data_length

    @property
    def is_meta(self) -> bool:
        """A tensor with a shape and no data in the file (tensorizer v4); it loads as zeros."""
        return self.data_length == 0 and self.nbytes > 0

    def in_file(self, file: int) -> TensorEntry:
        """This entry as tensor of weight file ``file`` of a model of several (``dataclasses.replace`` does
        the same at five times the cost, which 100,000 tensors notice)."""
        return TensorEntry(
            self.name, self.dtype, self.shape, self.record_offset, self.data_offset, self.data_length,
            self.path, self.kind, self.encrypted, file,
        )  # fmt: skip


@dataclass(frozen=True)
class ModelIndex:
    """The tensors of one model file, in file order, and what the file says about itself."""

    format: FormatName
    version: int
    """The format's data version (tensorizer 1-5; safetensors has none and reports 1)."""
    tensors: tuple[TensorEntry, ...]
    index_length: int
    """Bytes from the start of the file that hold the index (what a remote reader fetches first)."""
    data_end: int
    """The smallest file size the index is consistent with: the end of the last tensor's record."""
    encrypted: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    """Free-form string metadata the file carries (safetensors ``__metadata__``)."""
    files: tuple[str, ...] = ()
    """For a model of several weight files (a directory's shards): their names relative to the directory,
    indexed by :attr:`TensorEntry.file`. Empty for a single file. ``index_length`` and ``data_end`` then
    describe the first file only; each file's own index checks its own size."""

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of all tensors in memory."""
        return sum(t.nbytes for t in self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @functools.cached_property
    def _by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}

    def entry(self, tensor: str | TensorEntry, *, source: str) -> TensorEntry:
        """A tensor's entry by name (an entry is returned as it is); ``KeyError`` naming ``source``, the
        file, when it has no such tensor. What every reader's ``entry`` answers."""
        if isinstance(tensor, TensorEntry):
            return tensor
        try:
            return self._by_name[tensor]
        except KeyError:
            raise KeyError(f"{source} has no tensor named {tensor!r}") from None
