"""A tensor's place in a segment (:class:`Slot`), and every tensor's as columns (:class:`SlotTable`).

A layout of a mixture of experts places 100,000 tensors. Planning it, writing its manifest and filling it
read whole columns (offsets, sizes), and a frozen object per slot cost about a microsecond to build and a
hundred-odd bytes to keep for the whole load; the table keeps the columns and makes a :class:`Slot` only
when one is asked for.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

import numpy as np
import numpy.typing as npt

from modelload.loader.dtypes import DType
from modelload.loader.segment.kinds import Kinds

__all__ = ["Same", "Slot", "SlotTable"]

T = TypeVar("T")


class Same(Sequence[T]):
    """``count`` times one ``value``, as a column: the slots' hashes and files where every tensor has none
    (a list of 100,000 Nones is 0.8 MiB kept for the whole load)."""

    __slots__ = ("_count", "_value")

    def __init__(self, value: T, count: int) -> None:
        self._value, self._count = value, count

    @property
    def value(self) -> T:
        """The one value of every position."""
        return self._value

    def __len__(self) -> int:
        return self._count

    def count(self, value: object) -> int:
        """How many positions hold ``value``: all or none, without looking at each."""
        return self._count if self._count and (value is self._value or value == self._value) else 0

    @overload
    def __getitem__(self, i: int) -> T: ...

    @overload
    def __getitem__(self, i: slice) -> Same[T]: ...

    def __getitem__(self, i: int | slice) -> T | Same[T]:
        if isinstance(i, slice):
            return Same(self._value, len(range(*i.indices(self._count))))
        if not -self._count <= i < self._count:
            raise IndexError(f"{i} out of range of {self._count}")
        return self._value

    def __iter__(self) -> Iterator[T]:
        return itertools.repeat(self._value, self._count)

    def __repr__(self) -> str:
        return f"Same({self._value!r}, {self._count})"


@dataclass(frozen=True, slots=True)
class Slot:
    """A tensor's place in a segment: its spec and the absolute offset of its bytes."""

    index: int
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    sha256: str | None = None
    file: int | None = None
    """The index of the tensor's weight file in the segment's ``files`` (layout version 2), else None."""


class SlotTable(Sequence[Slot]):
    """Every slot of a layout, by tensor index, as columns; ``table[i]`` (and iteration) makes the
    :class:`Slot`, afresh each time. :attr:`kinds` groups the tensors by dtype and shape, for what is a fact
    of those (their manifest text)."""

    __slots__ = ("_kinds", "dtypes", "files", "names", "nbytes", "offsets", "sha256", "shapes")

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[DType],
        shapes: Sequence[tuple[int, ...]],
        offsets: npt.NDArray[np.int64],
        nbytes: npt.NDArray[np.int64],
        sha256: Sequence[str | None],
        files: Sequence[int | None],
        *,
        kinds: Kinds | None = None,
    ) -> None:
        count = len(names)
        if any(len(column) != count for column in (dtypes, shapes, offsets, nbytes, sha256, files)):
            raise ValueError("a slot table's columns must all have one length")
        if kinds is not None and len(kinds.of) != count:
            raise ValueError("a slot table's kinds must be its tensors'")
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.offsets, self.nbytes = offsets, nbytes
        self.sha256, self.files = sha256, files
        self._kinds = kinds

    @property
    def kinds(self) -> Kinds:
        """The tensors grouped by dtype and shape: as the layout that made the table grouped them, or grouped
        on first use."""
        if self._kinds is None:
            self._kinds = Kinds(self.dtypes, self.shapes)
        return self._kinds

    @classmethod
    def of(cls, slots: Sequence[Slot]) -> SlotTable:
        """The table of ``slots``, which must be in index order (``slots[i].index == i``)."""
        if any(slot.index != i for i, slot in enumerate(slots)):
            raise ValueError("slots must be given in index order")
        return cls(
            [s.name for s in slots],
            [s.dtype for s in slots],
            [s.shape for s in slots],
            np.fromiter((s.offset for s in slots), dtype=np.int64, count=len(slots)),
            np.fromiter((s.nbytes for s in slots), dtype=np.int64, count=len(slots)),
            [s.sha256 for s in slots],
            [s.file for s in slots],
        )

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> Slot: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[Slot]: ...

    def __getitem__(self, i: int | slice) -> Slot | Sequence[Slot]:
        if isinstance(i, slice):
            return tuple(map(self._slot, range(*i.indices(len(self)))))
        i = operator.index(i)
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"slot {i} out of range of {len(self)}")
        return self._slot(i)

    def __iter__(self) -> Iterator[Slot]:
        return map(self._slot, range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Equal to another table, tuple or list of the same slots in the same order."""
        if not isinstance(other, SlotTable | tuple | list):
            return NotImplemented
        return len(self) == len(other) and all(map(operator.eq, self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"<SlotTable of {len(self)} slots>"

    def _slot(self, i: int) -> Slot:
        return Slot(
            i, self.names[i], self.dtypes[i], self.shapes[i], int(self.offsets[i]), int(self.nbytes[i]),
            self.sha256[i], self.files[i],
        )  # fmt: skip
