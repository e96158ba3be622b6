"""Element types: one table that every format, the segment and the loader API translate through.

A dtype has one canonical name, torch's name without the ``torch.`` prefix (``"bfloat16"``,
``"float8_e4m3fn"``). The table maps it to:

- its element size in bytes;
- the numpy dtype that holds its bytes. Types numpy has no equivalent for (bfloat16, float8, complex32, the
  sub-byte and ``bits`` types) are *opaque*: numpy sees them as unsigned integers of the same width, and torch
  reinterprets the same bytes with the right dtype, without a copy;
- the tensorizer dtype string (numpy's ``dtype.str``, or for opaque types the void string, a NUL and the torch
  name: ``"<V2\\x00torch.bfloat16"``);
- the safetensors dtype string (``"BF16"``), where safetensors has one.

Everything is little-endian. Quantized torch types (qint8, quint8, ...) are not representable: they need
quantization parameters that no supported format stores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from modelload.loader.errors import UnsupportedDtypeError

if TYPE_CHECKING:
    import torch

__all__ = ["DType", "by_name", "from_numpy", "from_safetensors", "from_tensorizer", "from_torch", "names"]


@dataclass(frozen=True)
class DType:
    """One element type. Instances are interned: compare with ``is`` or ``==``."""

    name: str
    """Canonical name: torch's dtype name without ``torch.`` (``"float32"``, ``"bfloat16"``)."""
    itemsize: int
    """Bytes per element."""
    numpy_str: str
    """The numpy dtype string of the storage (``"<f4"``; ``"<u2"`` for the opaque bfloat16)."""
    opaque: bool
    """True when numpy has no equivalent: numpy views carry the raw bits as unsigned integers."""
    safetensors: str | None
    """The safetensors dtype string, or None when safetensors cannot store this type."""

    def nbytes(self, shape: Iterable[int]) -> int:
        """Bytes of a C-order tensor of this type and ``shape``: the one place the product is written."""
        return math.prod(shape) * self.itemsize

    @property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype of the storage (the same width, unsigned ints for opaque types)."""
        return np.dtype(self.numpy_str)

    @property
    def tensorizer(self) -> str:
        """The dtype string tensorizer writes for this type."""
        if not self.opaque:
            return np.dtype(self.numpy_str).str
        void = np.dtype(f"<i{self.itemsize}" if self.itemsize > 1 else "|i1").str.replace("i", "V")
        return f"{void}\x00torch.{self.name}"

    def torch(self) -> torch.dtype:
        """The torch dtype. Imports torch, which stays an optional dependency."""
        import torch

        value = getattr(torch, self.name, None)
        if not isinstance(value, torch.dtype):
            raise UnsupportedDtypeError(f"this torch build has no dtype torch.{self.name}; upgrade torch")
        return value

    def __str__(self) -> str:
        return self.name

    def __hash__(self) -> int:
        # Interned, and the name is unique: hashing it alone keeps dicts and sets of dtypes cheap (the
        # generated hash would hash all five fields, for each of 100,000 tensors).
        return hash(self.name)


def _plain(name: str, numpy_str: str, safetensors: str | None) -> DType:
    return DType(name, np.dtype(numpy_str).itemsize, np.dtype(numpy_str).str, False, safetensors)


def _opaque(name: str, itemsize: int, safetensors: str | None) -> DType:
    storage = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}[itemsize]
    return DType(name, itemsize, storage, True, safetensors)


_TABLE: tuple[DType, ...] = (
    _plain("bool", "|b1", "BOOL"),
    _plain("uint8", "|u1", "U8"),
    _plain("int8", "|i1", "I8"),
    _plain("int16", "<i2", "I16"),
    _plain("uint16", "<u2", "U16"),
    _plain("int32", "<i4", "I32"),
    _plain("uint32", "<u4", "U32"),
    _plain("int64", "<i8", "I64"),
    _plain("uint64", "<u8", "U64"),
    _plain("float16", "<f2", "F16"),
    _plain("float32", "<f4", "F32"),
    _plain("float64", "<f8", "F64"),
    _plain("complex64", "<c8", "C64"),
    _plain("complex128", "<c16", None),
    _opaque("bfloat16", 2, "BF16"),
    _opaque("complex32", 4, None),
    _opaque("float8_e4m3fn", 1, "F8_E4M3"),
    _opaque("float8_e4m3fnuz", 1, "F8_E4M3FNUZ"),
    _opaque("float8_e5m2", 1, "F8_E5M2"),
    _opaque("float8_e5m2fnuz", 1, "F8_E5M2FNUZ"),
    _opaque("float8_e8m0fnu", 1, "F8_E8M0"),
    _opaque("float4_e2m1fn_x2", 1, None),
    _opaque("bits8", 1, None),
    _opaque("bits16", 2, None),
    _opaque("bits1x8", 1, None),
    _opaque("bits2x4", 1, None),
    _opaque("bits4x2", 1, None),
    *(_opaque(f"uint{n}", 1, None) for n in range(1, 8)),
    *(_opaque(f"int{n}", 1, None) for n in range(1, 8)),
)

_BY_NAME = {d.name: d for d in _TABLE}
_BY_SAFETENSORS = {d.safetensors: d for d in _TABLE if d.safetensors}
_BY_NUMPY = {d.numpy_str: d for d in _TABLE if not d.opaque}
_QUANTIZED = frozenset({"qint8", "quint8", "qint32", "quint4x2", "quint2x4"})


def names() -> tuple[str, ...]:
    """Every canonical dtype name, in table order."""
    return tuple(_BY_NAME)


def by_name(name: str) -> DType:
    """The dtype with this canonical name (``"bfloat16"``); a ``torch.`` prefix is accepted."""
    key = name.removeprefix("torch.")
    try:
        return _BY_NAME[key]
    except KeyError:
        if key in _QUANTIZED:
            raise UnsupportedDtypeError(
                f"quantized dtype {key!r} needs quantization parameters that no supported format stores; "
                "dequantize the tensor before serializing"
            ) from None
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; known: {', '.join(_BY_NAME)}") from None


def from_numpy(dtype: Any) -> DType:
    """The dtype of a numpy array's elements. Big-endian arrays are refused: segments are little-endian."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">" or (dt.byteorder == "=" and np.little_endian is False):
        raise UnsupportedDtypeError(
            f"big-endian dtype {dt.str!r}; convert with .astype({dt.newbyteorder('<')})"
        )
    try:
        return _BY_NUMPY[dt.str]
    except KeyError:
        raise UnsupportedDtypeError(f"numpy dtype {dt.str!r} has no tensor equivalent") from None


def from_torch(dtype: torch.dtype) -> DType:
    """The dtype of a torch tensor's elements."""
    return by_name(str(dtype))


def from_safetensors(code: str) -> DType:
    """The dtype of a safetensors dtype string (``"BF16"``)."""
    try:
        return _BY_SAFETENSORS[code]
    except KeyError:
        raise UnsupportedDtypeError(f"safetensors dtype {code!r} is not supported") from None


def from_tensorizer(text: str) -> DType:
    """The dtype of a tensorizer dtype string: ``"<f4"``, or an opaque ``"<V2\\x00torch.bfloat16"``.

    Opaque types are recognised by their ``\\x00torch.<name>`` suffix, whose element size must agree with the
    void prefix; the intermediate integer type is tensorizer's implementation detail.
    """
    if "\x00" in text:
        parts = text.split("\x00")
        if len(parts) != 2:
            raise UnsupportedDtypeError(f"tensorizer dtype {text!r} has more than one NUL separator")
        void, torch_name = parts
        if not torch_name.startswith("torch."):
            raise UnsupportedDtypeError(f"tensorizer dtype {text!r}: opaque suffix must name a torch dtype")
        dtype = by_name(torch_name)
        try:
            width = np.dtype(void).itemsize
        except TypeError:
            raise UnsupportedDtypeError(f"tensorizer dtype {text!r}: bad storage type {void!r}") from None
        if width != dtype.itemsize:
            raise UnsupportedDtypeError(
                f"tensorizer dtype {text!r}: storage of {width} bytes for {dtype.name} of {dtype.itemsize}"
            )
        return dtype
    try:
        return from_numpy(np.dtype(text))
    except TypeError:
        raise UnsupportedDtypeError(f"tensorizer dtype {text!r} is not a numpy dtype string") from None
