"""Shared pieces of the tensorizer format tests: sample tensors of every dtype, and byte surgery on files."""

from __future__ import annotations

import re
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader import dtypes, formats
from modelload.loader.formats.tensorizer import read_index

torch = pytest.importorskip("torch")

# torch warns that complex32 is experimental every time one is made; the tests make them on purpose.
warnings.filterwarnings("ignore", message="ComplexHalf support is experimental")

ALL_DTYPES = dtypes.names()
NUMPY_DTYPES = tuple(n for n in ALL_DTYPES if not dtypes.by_name(n).opaque)


def sample(name: str, shape: tuple[int, ...] = (3, 5), *, seed: int = 0) -> Any:
    """A torch tensor of dtype ``name`` filled with random bytes (NaN payloads, -0.0 and all)."""
    dtype = getattr(torch, name)
    itemsize = dtypes.by_name(name).itemsize
    numel = int(np.prod(shape))
    raw = np.random.default_rng(seed).integers(0, 256, size=numel * itemsize, dtype=np.uint8)
    if name == "bool":
        raw &= 1  # other byte values are not valid bools in torch
    if name == "float32" and numel >= 2:
        raw[:8] = np.array([-0.0, np.nan], dtype="<f4").view(np.uint8)
        raw[4:8] = np.frombuffer(struct.pack("<I", 0x7FC01234), dtype=np.uint8)  # a NaN with a payload
    return torch.from_numpy(raw.copy()).view(dtype).reshape(shape)


def tz_write(path: Path, tensors: dict[str, Any], *, encryption: Any = None) -> None:
    """Write ``tensors`` with the real tensorizer package (callers skip when it is not installed)."""
    from tensorizer import TensorSerializer

    serializer = TensorSerializer(str(path), encryption=encryption)
    serializer.write_state_dict(tensors)
    serializer.close()


def index_of(path: Path) -> Any:
    """The index of the model file at ``path`` (either format), read by ranges as a remote reader does."""
    data = path.read_bytes()
    return formats.read_index(lambda offset, length: data[offset : offset + length], size=len(data))


def raw_bytes(tensor: Any) -> bytes:
    """The bytes of a torch tensor or numpy array, compared instead of values (NaN != NaN)."""
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).tobytes()
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class Surgery:
    """A tensorizer file's bytes plus the offsets of its structures, to mutate one rule at a time."""

    def __init__(self, path: Path) -> None:
        self.data = bytearray(path.read_bytes())
        self.index = read_index(bytes(self.data))
        self.entries = self.index.tensors
        self._entry_starts = self._find_entry_starts()

    def _find_entry_starts(self) -> list[int]:
        # Re-walk the index to find where each entry starts (not part of the public API on purpose).
        starts, pos = [], 73
        for entry in self.entries:
            starts.append(pos)
            (name_len,) = struct.unpack_from("<H", self.data, pos)
            p = pos + 2 + name_len + 1
            dtype_len = self.data[p]
            p += 1 + dtype_len
            ndim = self.data[p]
            pos = p + 1 + 4 * ndim + 24
            assert entry is not None
        return starts

    def entry_field(self, i: int, field: str) -> int:
        """Absolute offset of a field of index entry ``i``: name_len, name, type, dtype_len, dtype, ndim,
        dims, header_offset, data_offset, data_length."""
        pos = self._entry_starts[i]
        (name_len,) = struct.unpack_from("<H", self.data, pos)
        offsets = {"name_len": pos, "name": pos + 2, "type": pos + 2 + name_len}
        offsets["dtype_len"] = offsets["type"] + 1
        dtype_len = self.data[offsets["dtype_len"]]
        offsets["dtype"] = offsets["dtype_len"] + 1
        offsets["ndim"] = offsets["dtype"] + dtype_len
        offsets["dims"] = offsets["ndim"] + 1
        after_dims = offsets["dims"] + 4 * self.data[offsets["ndim"]]
        offsets.update(header_offset=after_dims, data_offset=after_dims + 8, data_length=after_dims + 16)
        return offsets[field]

    def header_field(self, i: int, field: str) -> int:
        """Absolute offset of a field of tensor i's header: size, module, type, name_len, name, dtype_len,
        dtype, ndim, dims, hash_len, hash_count, hashes, tail (data length)."""
        start = self.entries[i].record_offset
        (name_len,) = struct.unpack_from("<H", self.data, start + 11)
        offsets = {"size": start, "module": start + 8, "type": start + 10, "name_len": start + 11}
        offsets["name"] = start + 13
        offsets["dtype_len"] = offsets["name"] + name_len
        offsets["dtype"] = offsets["dtype_len"] + 1
        offsets["ndim"] = offsets["dtype"] + self.data[offsets["dtype_len"]]
        offsets["dims"] = offsets["ndim"] + 1
        offsets["hash_len"] = offsets["dims"] + 4 * self.data[offsets["ndim"]]
        offsets["hash_count"] = offsets["hash_len"] + 2
        offsets["hashes"] = offsets["hash_count"] + 1
        offsets["tail"] = self.entries[i].data_offset - 8
        return offsets[field]

    def put(self, offset: int, fmt: str, *values: Any) -> Surgery:
        struct.pack_into(fmt, self.data, offset, *values)
        return self

    def flip(self, offset: int) -> Surgery:
        self.data[offset] ^= 0x01
        return self

    def write(self, path: Path) -> Path:
        path.write_bytes(bytes(self.data))
        return path


def escaped(text: str) -> str:
    return re.escape(text)
