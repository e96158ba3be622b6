"""torch interop: zero-copy torch tensors over the segment's bytes.

torch is optional; this module imports it only inside its functions, so ``import modelload.loader`` works in
an image without it. The copy to a GPU is in :mod:`.gpu_copy`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

from modelload.loader.dtypes import DType

if TYPE_CHECKING:
    import torch

__all__ = ["Views", "as_tensor"]

_NOT_WRITABLE = "The given buffer is not writable"


def as_tensor(view: memoryview, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A torch tensor over all of ``view``'s bytes, without a copy, with ``dtype`` and ``shape`` (one
    :class:`Views` tensor; a read-only ``view`` gives a tensor that must not be written)."""
    views = Views(view)
    with views.quiet():
        return views(0, dtype, shape, len(view))


class Views:
    """torch tensors over one buffer (a segment's data mapping), without a copy, each made by one
    ``torch.frombuffer`` call: no slice of the buffer per tensor, the torch dtype looked up once per dtype, so
    100,000 tensors cost a fraction of a second.

    Each tensor has a storage of its own: a tensor sharing one storage with every other weight of the model
    would look tied to all of them to whoever saves the model (transformers' ``save_pretrained`` drops
    tensors that share storage). A read-only buffer (a ring segment's) gives tensors that must not be
    written: torch cannot mark a tensor read-only, and the pages are mapped without write access, so a
    write faults (:meth:`quiet` silences torch's warning about it).
    """

    def __init__(self, buffer: memoryview) -> None:
        import torch

        self._torch = torch
        self._buffer = buffer
        self._dtypes: dict[str, torch.dtype] = {}

    def __call__(self, start: int, dtype: DType, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` whose ``nbytes`` bytes start at ``start`` in the buffer."""
        target = self._dtypes.get(dtype.name)
        if target is None:
            target = self._dtypes[dtype.name] = dtype.torch()
        if not nbytes:
            return self._torch.empty(shape, dtype=target)
        flat = self._torch.frombuffer(
            self._buffer, dtype=target, count=nbytes // dtype.itemsize, offset=start
        )
        return flat if len(shape) == 1 else flat.view(shape)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Make tensors over a read-only buffer (a ring's) without torch's warning for each one."""
        if not self._buffer.readonly:
            yield
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
            yield
