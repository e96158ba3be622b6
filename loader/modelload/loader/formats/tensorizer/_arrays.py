"""Numpy arrays and torch tensors in and out of raw little-endian bytes, without importing torch eagerly.

The writer needs a tensor's dtype and shape first (cheap: to size the index before any data is written),
then its bytes as one flat memoryview (a view of the array itself when it is C-contiguous on the CPU: no
copy). The reader hands back numpy arrays over buffers it filled, and torch tensors over those arrays, with
opaque dtypes (bfloat16, float8, ...) carried as unsigned integers in numpy and reinterpreted by torch.

torch is optional: an object can only be a torch tensor if torch is already imported, so the check looks in
``sys.modules`` and never imports it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from modelload.loader import dtypes
from modelload.loader.dtypes import DType
from modelload.loader.errors import ConfigError, UnsupportedDtypeError

__all__ = ["TensorSpec", "as_numpy", "as_torch", "describe", "flat_bytes", "is_torch_tensor"]


def is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


@dataclass(frozen=True)
class TensorSpec:
    """What the writer knows about a tensor before touching its data."""

    dtype: DType
    shape: tuple[int, ...]
    meta: bool
    """A torch meta tensor: a shape and a dtype, no data (written with data length 0)."""
    value: Any

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


def describe(value: Any, *, dtype: DType | str | None = None) -> TensorSpec:
    """The dtype and shape of a numpy array or torch tensor; ``dtype`` reinterprets same-width raw bits.

    Reinterpreting lets numpy-only callers write types numpy lacks: ``np.uint16`` bits as ``"bfloat16"``.
    """
    override = dtypes.by_name(dtype) if isinstance(dtype, str) else dtype
    if isinstance(value, np.generic):
        value = np.asarray(value)  # a numpy scalar: a 0-d array
    if is_torch_tensor(value):
        own = dtypes.from_torch(value.dtype)
        shape = tuple(int(d) for d in value.shape)
        meta = bool(value.is_meta)
    elif isinstance(value, np.ndarray):
        if value.dtype.hasobject or value.dtype.fields is not None:
            raise UnsupportedDtypeError(f"numpy dtype {value.dtype} cannot be stored as a tensor")
        own = dtypes.from_numpy(value.dtype) if override is None else _check_width(value.dtype, override)
        shape = tuple(int(d) for d in value.shape)
        meta = False
    else:
        raise ConfigError(f"a tensor must be a numpy array or a torch tensor, not {type(value).__name__}")
    if override is not None and override.itemsize != own.itemsize:
        raise UnsupportedDtypeError(
            f"cannot reinterpret {own.name} ({own.itemsize} bytes) as {override.name} "
            f"({override.itemsize} bytes)"
        )
    return TensorSpec(override or own, shape, meta, value)


def _check_width(np_dtype: np.dtype[Any], override: DType) -> DType:
    if np_dtype.byteorder == ">":
        raise UnsupportedDtypeError(f"big-endian dtype {np_dtype.str!r}; convert to little-endian first")
    if np_dtype.itemsize != override.itemsize:
        raise UnsupportedDtypeError(
            f"cannot reinterpret numpy {np_dtype} ({np_dtype.itemsize} bytes) as {override.name} "
            f"({override.itemsize} bytes)"
        )
    return override


def flat_bytes(spec: TensorSpec) -> memoryview:
    """The tensor's bytes in C order as a flat byte view; copies only a non-contiguous or non-CPU tensor."""
    value = spec.value
    if is_torch_tensor(value):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.resolve_conj().resolve_neg().contiguous()
        array = t.reshape(-1).view(torch.uint8).numpy()
    else:
        array = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    view = memoryview(array)
    assert view.nbytes == spec.nbytes, (view.nbytes, spec.nbytes)
    return view


def as_numpy(buffer: Any, dtype: DType, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A numpy array over ``buffer`` (no copy); opaque dtypes come out as same-width unsigned integers."""
    return np.frombuffer(buffer, dtype=dtype.numpy).reshape(shape)


def as_torch(array: np.ndarray[Any, Any], dtype: DType) -> Any:
    """A torch tensor sharing ``array``'s memory, with the true dtype. Imports torch."""
    import torch

    tensor = torch.from_numpy(array)
    return tensor.view(dtype.torch()) if dtype.opaque else tensor
