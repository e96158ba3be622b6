"""Tensors grouped by element type and shape (:class:`Kinds`): what most of a layout's per-tensor facts
depend on.

A mixture of experts places 100,000 tensors of a few thousand distinct (dtype, shape) pairs at most: its
experts repeat the same shapes. A tensor's bytes, whether its shape is valid, and the text of its dtype, shape
and size in the manifest are facts of its pair, so the layout works each out once per pair (a *kind*) and
gathers it for every tensor with numpy. Per tensor, grouping costs a dict lookup of its shape (and, when the
model mixes dtypes, of its dtype's identity: dtypes are interned).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from modelload.loader.dtypes import DType

__all__ = ["Kinds"]


class Kinds:
    """The distinct (dtype, shape) pairs of a column of tensors, and which one each tensor has.

    Kind ``k`` is ``dtypes[k]`` and ``shapes[k]``, of ``nbytes[k]`` bytes; tensor ``i`` is of kind ``of[i]``.
    Tensors of equal shapes and equal dtypes are of one kind (dtypes of a model that mixes them are told apart
    by identity, which for interned dtypes is equality; two equal dtypes that were not one object would make
    two kinds of the same facts, never one kind of different ones).
    """

    __slots__ = ("dtypes", "nbytes", "of", "shapes")

    def __init__(self, dtypes: Sequence[DType], shapes: Sequence[tuple[int, ...]]) -> None:
        count = len(shapes)
        if len(dtypes) != count:
            raise ValueError("a tensor's dtype and shape columns must have one length")
        # Each tensor's kind is first named by the first tensor of its kind (a position), then numbered in the
        # order the kinds first appear: numpy over the tensors, no sort.
        key = _first_of(shapes, count)
        if count and dtypes.count(dtypes[0]) != count:  # several dtypes: the first tensor of the same pair
            key = _first_of((key * count + _first_of(map(id, dtypes), count)).tolist(), count)
        starts = key == np.arange(count)
        first = np.flatnonzero(starts).tolist()
        self.of: npt.NDArray[np.intp] = (np.cumsum(starts) - 1)[key]
        self.shapes: list[tuple[int, ...]] = [shapes[i] for i in first]
        self.dtypes: list[DType] = [dtypes[i] for i in first]
        self.nbytes: list[int] = list(map(DType.nbytes, self.dtypes, self.shapes))
        """Python ints: a shape may claim more than int64 holds, which whoever places the tensors refuses."""

    def __len__(self) -> int:
        """How many kinds."""
        return len(self.shapes)

    def first_tensor(self, where: Sequence[bool]) -> int | None:
        """The first tensor (in order) of a kind for which ``where[kind]`` holds, or None."""
        marked = np.asarray(where, dtype=bool)
        if not marked.any():
            return None
        return int(np.flatnonzero(marked[self.of])[0])

    def counts(self) -> npt.NDArray[np.intp]:
        """How many tensors of each kind."""
        return np.bincount(self.of, minlength=len(self))


def _first_of(keys: Iterable[Hashable], count: int) -> npt.NDArray[np.int64]:
    """For each of ``count`` keys, the position of the first equal key (setdefault keeps the first position it
    was given for a key, and answers it for every later equal one)."""
    first: dict[Hashable, int] = {}
    return np.fromiter(map(first.setdefault, keys, itertools.count()), np.int64, count)
