"""Writing safetensors files from numpy arrays and torch tensors, without copying what is already contiguous.

The layout follows the reference writer byte for byte, so a file written here equals the one
``safetensors.numpy.save`` or ``safetensors.torch.save`` writes for the same tensors (when the metadata has at
most one key: the reference orders several keys by hash, we keep the caller's order):

- tensors sorted by descending alignment (the reference's dtype order, widest first), then by name, so every
  tensor's offset in the data buffer is a multiple of its element size;
- the header compact JSON (``__metadata__`` first), padded with spaces so the data buffer starts on an
  8-byte boundary.

Each tensor's bytes go to the file straight from its memory with ``os.pwritev``. Non-contiguous tensors are
copied into contiguous ones first (the format stores no strides). Two tensors that share memory (tied
weights, overlapping views) are refused with :class:`~modelload.loader.errors.OverlapError`: the format
cannot express sharing, and writing the bytes twice would change the model's size and tie silently.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import islice, pairwise
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from modelload.loader import dtypes
from modelload.loader.errors import (
    BoundsError,
    HeaderError,
    OverlapError,
    SizeMismatchError,
    UnsupportedDtypeError,
)
from modelload.loader.formats._atomic import atomic_file
from modelload.loader.formats.safetensors._header import HEADER_SIZE_CAP
from modelload.loader.formats.safetensors._json import METADATA_KEY

__all__ = ["RawTensor", "plan_header", "save_file", "serialize"]

# The reference writer's dtype order, narrowest first; it sorts by the reverse, then by name. Ties between
# dtypes of one width follow this order too, which is what makes our files equal to the reference's.
_REFERENCE_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
    "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_RANK = {code: rank for rank, code in enumerate(_REFERENCE_ORDER)}
_IOV_MAX = 1024


@dataclass(frozen=True)
class RawTensor:
    """A tensor given as its bytes and a declared dtype, for writing without torch.

    numpy has no bfloat16 or float8 types, so a numpy array alone cannot say that its ``uint16`` storage
    holds bfloat16 values. Wrapping the bytes says so: ``RawTensor(dtypes.by_name("bfloat16"), (2, 3),
    array)``. Also the way to copy tensors from another file or a segment without decoding them.
    """

    dtype: dtypes.DType
    shape: tuple[int, ...]
    data: Any
    """A C-contiguous buffer (bytes, memoryview, numpy array) of exactly ``itemsize * prod(shape)`` bytes."""


@dataclass(frozen=True)
class _Planned:
    """A tensor as the header lists it: its bytes come later."""

    name: str
    code: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _Prepared:
    name: str
    code: str
    shape: tuple[int, ...]
    data: memoryview
    """The tensor's bytes, C order, one byte per item."""

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


_Item = TypeVar("_Item", _Planned, _Prepared)


def serialize(tensors: Mapping[str, Any], *, metadata: Mapping[str, str] | None = None) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (numpy arrays or torch tensors).

    >>> import numpy as np
    >>> blob = serialize({"bias": np.ones(2, np.float16)}, metadata={"format": "np"})
    >>> size = int.from_bytes(blob[:8], "little")
    >>> blob[8 : 8 + size]
    b'{"__metadata__":{"format":"np"},"bias":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}'
    >>> blob[8 + size :]  # two float16 ones
    b'\\x00<\\x00<'
    """
    header, items = _prepare(tensors, metadata)
    return b"".join([header, *(item.data for item in items)])


def save_file(
    tensors: Mapping[str, Any], path: str | os.PathLike[str], *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (numpy arrays or torch tensors) to a safetensors file at ``path``.

    The file appears whole or not at all (:func:`~modelload.loader.formats._atomic.atomic_file`: written
    beside ``path`` under a temporary name, synced, and renamed over it when complete).
    """
    header, items = _prepare(tensors, metadata)
    with atomic_file(Path(path)) as file:
        _write_all(file.fileno(), [memoryview(header), *(item.data for item in items)])


def plan_header(
    tensors: Mapping[str, tuple[dtypes.DType, tuple[int, ...]]], *, metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The size field and header of a file of ``tensors`` (``{name: (dtype, shape)}``) whose bytes come
    later, and where each tensor's bytes go, from the start of the data buffer (right after the header).

    For a writer that streams tensors one at a time into a file of this header (``modelload serialize``):
    the file is byte for byte the one :func:`save_file` writes for the same tensors.

    >>> header, offsets = plan_header({"b": (dtypes.by_name("float16"), (2,))})
    >>> header[8:]
    b'{"b":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}  '
    >>> offsets
    {'b': 0}
    """
    items = [
        _Planned(_check_name(name), _code(name, dtype), shape, dtype.nbytes(shape))
        for name, (dtype, shape) in tensors.items()
    ]
    header, ordered = _header(items, metadata)
    offsets: dict[str, int] = {}
    offset = 0
    for item in ordered:
        offsets[item.name] = offset
        offset += item.nbytes
    return header, offsets


def _prepare(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> tuple[bytes, list[_Prepared]]:
    """Check and convert every tensor, lay out the header: ``(size field + header, tensors in order)``."""
    _refuse_shared(tensors)
    return _header([_convert(name, value) for name, value in tensors.items()], metadata)


def _header(items: list[_Item], metadata: Mapping[str, str] | None) -> tuple[bytes, list[_Item]]:
    """The size field and header of ``items`` in the reference writer's order, and the items in it."""
    items.sort(key=lambda item: (-_RANK[item.code], item.name))
    document: dict[str, Any] = {}
    if metadata is not None:
        document[METADATA_KEY] = _check_metadata(metadata)
    offset = 0
    for item in items:
        document[item.name] = {
            "dtype": item.code,
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    try:
        text = json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise HeaderError(
            f"a tensor name or metadata string is not encodable as UTF-8 ({exc.reason})"
        ) from exc
    text += b" " * (-len(text) % 8)
    if len(text) > HEADER_SIZE_CAP:
        raise BoundsError(
            f"the header would be {len(text)} bytes, over the {HEADER_SIZE_CAP}-byte limit of safetensors "
            "readers; split the model into several files (shards), or write a tensorizer file"
        )
    return struct.pack("<Q", len(text)) + text, items


def _check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise HeaderError(
                f"metadata {key!r}: {value!r} is not a string-to-string pair; safetensors metadata holds "
                "text only (encode structured values as JSON text)"
            )
    return dict(metadata)


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise HeaderError(f"tensor names must be strings, got {name!r}")
    if name == METADATA_KEY:
        raise HeaderError(f"{METADATA_KEY!r} is reserved for the file's metadata; rename the tensor")
    return name


def _convert(name: Any, value: Any) -> _Prepared:
    _check_name(name)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _from_torch(name, value)
    if isinstance(value, np.ndarray | np.generic):
        return _from_numpy(name, np.asarray(value))
    if isinstance(value, RawTensor):
        return _from_raw(name, value)
    raise TypeError(
        f"tensor {name!r} is a {type(value).__name__}; pass a numpy array, a torch tensor or a RawTensor"
    )


def _code(name: str, dtype: dtypes.DType) -> str:
    if dtype.safetensors is None:
        raise UnsupportedDtypeError(
            f"tensor {name!r} has dtype {dtype.name}, which safetensors cannot store; convert it (for "
            "example complex128 to two float64 tensors) or write a tensorizer file"
        )
    return dtype.safetensors


def _from_numpy(name: str, array: np.ndarray[Any, Any]) -> _Prepared:
    try:
        dtype = dtypes.from_numpy(array.dtype)
    except UnsupportedDtypeError as exc:
        raise UnsupportedDtypeError(f"tensor {name!r}: {exc}") from exc
    code = _code(name, dtype)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return _Prepared(name, code, tuple(int(d) for d in array.shape), flat.data)


def _from_raw(name: str, raw: RawTensor) -> _Prepared:
    code = _code(name, raw.dtype)
    shape = tuple(int(d) for d in raw.shape)
    if any(d < 0 for d in shape):
        raise HeaderError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
    view = memoryview(raw.data)
    if view.nbytes and not view.c_contiguous:
        raise ValueError(f"the data of tensor {name!r} is not C-contiguous")
    expected = raw.dtype.nbytes(shape)
    if view.nbytes != expected:
        raise SizeMismatchError(
            f"tensor {name!r} is {raw.dtype.name} with shape {list(shape)}, {expected} bytes, but its data "
            f"is {view.nbytes} bytes"
        )
    return _Prepared(name, code, shape, view.cast("B") if view.nbytes else memoryview(b""))


def _from_torch(name: str, tensor: Any) -> _Prepared:
    import torch

    if tensor.layout != torch.strided:
        raise UnsupportedDtypeError(
            f"tensor {name!r} has layout {tensor.layout}; safetensors stores dense tensors: call .to_dense()"
        )
    if tensor.is_quantized or tensor.device.type == "meta":
        raise UnsupportedDtypeError(
            f"tensor {name!r} is {'quantized' if tensor.is_quantized else 'on the meta device'} and has no "
            "plain bytes to store; dequantize or materialize it first"
        )
    try:
        dtype = dtypes.from_torch(tensor.dtype)
    except UnsupportedDtypeError as exc:
        raise UnsupportedDtypeError(f"tensor {name!r}: {exc}") from exc
    code = _code(name, dtype)
    plain = tensor.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    flat = plain.reshape(-1).view(torch.uint8).numpy()
    return _Prepared(name, code, tuple(int(d) for d in tensor.shape), flat.data)


def _extent(value: Any) -> tuple[str, int, int] | None:
    """``(device, first byte, one past the last byte)`` of the memory a tensor views, or None when empty."""
    if isinstance(value, RawTensor):
        data = memoryview(value.data)
        value = np.frombuffer(data, np.uint8) if data.nbytes and data.c_contiguous else None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        if (
            value.numel() == 0
            or value.device.type == "meta"
            or value.layout != torch.strided
            or value.is_quantized
        ):
            return None
        start, itemsize = value.data_ptr(), value.element_size()
        strides, shape, device = value.stride(), value.shape, str(value.device)
    elif isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        start, itemsize = value.__array_interface__["data"][0], value.itemsize
        strides, shape, device = tuple(s // itemsize for s in value.strides), value.shape, "cpu"
    else:
        return None
    low = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s < 0)
    high = sum(s * (n - 1) for s, n in zip(strides, shape, strict=True) if s > 0)
    return device, start + low * itemsize, start + (high + 1) * itemsize


def _refuse_shared(tensors: Mapping[str, Any]) -> None:
    spans = sorted(
        (extent, name) for name, value in tensors.items() if (extent := _extent(value)) is not None
    )
    for (left, left_name), (right, right_name) in pairwise(spans):
        if left[0] == right[0] and right[1] < left[2]:
            raise OverlapError(
                f"tensors {left_name!r} and {right_name!r} share memory (tied weights, or views of one "
                "storage); safetensors cannot store sharing: save one of them, or pass a copy (.clone() / "
                ".copy()) of the other"
            )


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write the views back to back from offset 0, resuming after short writes (a single call moves at
    most about 2 GiB on Linux)."""
    pending = deque(view for view in views if view.nbytes)
    offset = 0
    while pending:
        if hasattr(os, "pwritev"):
            written = os.pwritev(fd, list(islice(pending, _IOV_MAX)), offset)
        else:  # pragma: no cover - platforms without pwritev
            written = os.pwrite(fd, pending[0], offset)
        if written <= 0:
            raise OSError(f"writing the safetensors file stalled at byte {offset}")
        offset += written
        while written:
            head = pending[0]
            if written >= head.nbytes:
                written -= head.nbytes
                pending.popleft()
            else:
                pending[0] = head[written:]
                written = 0
