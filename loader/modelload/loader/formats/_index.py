"""What a model file holds, as far as planning a load needs: the index every format reader returns.

An index is read from the first bytes of a file alone (the tensorizer metadata block, the safetensors JSON
header), so a remote reader can plan its byte ranges from one or two small reads. It says where each
tensor's bytes are in the file and how many bytes the tensor takes in memory; the bytes themselves are read
later, by range.
"""

from __future__ import annotations

import array
import functools
import itertools
import math
import mmap
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import numpy as np

from modelload.loader.dtypes import DType

__all__ = [
    "MAX_NDIM", "FormatName", "ModelIndex", "Names", "RangeRead", "TensorEntry", "TensorTable",
    "WritableBuffer", "has_repeats",
]  # fmt: skip

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


Offsets = np.ndarray[Any, np.dtype[Any]]
"""A column of file offsets or lengths: int64, or Python ints (object) when one does not fit in 63 bits (a
header checked without the file's size may claim such offsets; whoever plans them refuses it)."""

Kind = Literal["param", "buffer", "state_dict"]


class Names(Sequence[str]):
    """Tensor names as one text and where each starts and ends: a mixture of experts names 100,000 tensors,
    and a string object each cost 11 MiB kept for the whole load, twice what their characters take.

    ``names[i]`` (and iteration, a batch at a time) makes each name afresh from the text; a slice is a list.
    Equal to a list or tuple of the same names in the same order.
    """

    __slots__ = ("_bounds", "_hashes", "_repeats", "_text")

    def __init__(self, names: Iterable[str] = ()) -> None:
        listed = names if isinstance(names, list | tuple) else list(names)
        self._repeats: bool | None = None  # has_repeats' answer, once asked (the names never change)
        self._text = "".join(listed)
        self._bounds = array.array("q", [0])  # name i is text[bounds[i]:bounds[i + 1]]
        self._bounds.extend(itertools.accumulate(map(len, listed)))
        # Each name's hash, taken while the strings are here (a parser's dict keys, whose hashes are kept):
        # has_repeats sorts these rather than make every name again to hash it. Dropped once it answers.
        self._hashes: np.ndarray[Any, np.dtype[np.int64]] | None = np.fromiter(
            map(hash, listed), dtype=np.int64, count=len(listed)
        )

    @classmethod
    def concat(cls, parts: Sequence[Names]) -> Names:
        """The names of ``parts`` one after the other."""
        joined = cls()
        joined._text = "".join(part._text for part in parts)
        lengths = np.fromiter(map(len, (part._text for part in parts)), dtype=np.int64, count=len(parts))
        shifts = (np.cumsum(lengths) - lengths).tolist()  # where each part's text starts in the joined one
        starts = zip(parts, shifts, strict=True)
        ends = [np.frombuffer(part._bounds, dtype=np.int64)[1:] + at for part, at in starts]
        if ends:
            joined._bounds.frombytes(np.concatenate(ends).tobytes())
        hashes = [part._hashes for part in parts if part._hashes is not None]
        joined._hashes = np.concatenate(hashes) if parts and len(hashes) == len(parts) else None
        return joined

    @property
    def text(self) -> str:
        """Every name, one after the other, with nothing between them."""
        return self._text

    def __len__(self) -> int:
        return len(self._bounds) - 1

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            first, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(first, stop, step)]
            return list(self._between(first, max(first, stop)))
        bounds = self._bounds
        if i < 0:
            i += len(bounds) - 1
        if not 0 <= i < len(bounds) - 1:
            raise IndexError(f"name {i} out of range of {len(self)}")
        return self._text[bounds[i] : bounds[i + 1]]

    def __iter__(self) -> Iterator[str]:
        for first in range(0, len(self), _NAMES_BATCH):
            yield from self._between(first, min(first + _NAMES_BATCH, len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Names | list | tuple):
            return NotImplemented
        if isinstance(other, Names):
            return self._text == other._text and self._bounds == other._bounds
        return len(self) == len(other) and all(map(operator.eq, self, other))

    __hash__ = None  # type: ignore[assignment]  # as a list's

    def __repr__(self) -> str:
        return f"<Names of {len(self)} tensors>"

    def _between(self, first: int, stop: int) -> Iterator[str]:
        bounds = self._bounds[first : stop + 1]
        return map(self._text.__getitem__, map(slice, bounds[:-1], bounds[1:]))


_NAMES_BATCH = 4096


def has_repeats(names: Sequence[str]) -> bool:
    """Whether a name appears twice in ``names``: their hashes are sorted (an array, not a set of strings
    each kept), and only equal hashes make the names themselves compared. :class:`Names` keep the answer:
    the merged index and the segment's layout ask it of the same names."""
    if isinstance(names, Names) and names._repeats is not None:
        return names._repeats
    hashes = names._hashes if isinstance(names, Names) else None
    if hashes is None:
        hashes = np.fromiter(map(hash, names), dtype=np.int64, count=len(names))
    hashes.sort()
    repeats = bool((hashes[1:] == hashes[:-1]).any()) and len(set(names)) != len(names)
    if isinstance(names, Names):
        names._repeats, names._hashes = repeats, None
    return repeats


def offsets_column(values: Iterable[int] | np.ndarray[Any, Any]) -> Offsets:
    """``values`` as an int64 column, or an object column when one is past int64."""
    listed = values if isinstance(values, np.ndarray) else list(values)
    try:
        return np.asarray(listed, dtype=np.int64)
    except OverflowError:
        return np.array([int(v) for v in listed], dtype=object)


class TensorTable(Sequence[TensorEntry]):
    """The tensors of an index as columns, one entry per position, in file order.

    A mixture of experts lists 100,000 tensors: an object per tensor costs about a microsecond to build and a
    hundred-odd bytes to keep, for every load, while the load itself reads whole columns (the planner, the
    layout). The table keeps the columns and makes a :class:`TensorEntry` only when one is asked for
    (``table[i]``, iteration), so callers that want entries still get them, each made afresh.

    ``paths``, ``kinds`` and ``encrypted`` are None when every tensor has the default (safetensors).
    """

    __slots__ = ("data_lengths", "data_offsets", "dtypes", "encrypted", "files", "kinds", "names", "paths",
                 "record_offsets", "shapes")  # fmt: skip

    def __init__(
        self,
        names: Sequence[str],
        dtypes: Sequence[DType],
        shapes: Sequence[tuple[int, ...]],
        record_offsets: Offsets,
        data_offsets: Offsets,
        data_lengths: Offsets,
        files: np.ndarray[Any, np.dtype[np.int32]],
        *,
        paths: Sequence[tuple[str | int, ...] | None] | None = None,
        kinds: Sequence[Kind] | None = None,
        encrypted: Sequence[bool] | None = None,
    ) -> None:
        count = len(names)
        columns = (dtypes, shapes, record_offsets, data_offsets, data_lengths, files)
        if any(len(c) != count for c in (*columns, *(c for c in (paths, kinds, encrypted) if c is not None))):
            raise ValueError("a tensor table's columns must all have one length")
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.record_offsets, self.data_offsets, self.data_lengths = record_offsets, data_offsets, data_lengths
        self.files = files
        self.paths, self.kinds, self.encrypted = paths, kinds, encrypted

    @classmethod
    def of(cls, entries: Iterable[TensorEntry]) -> TensorTable:
        """The table of ``entries`` (in their order)."""
        listed = list(entries)
        paths = [e.path for e in listed]
        kinds: list[Kind] = [e.kind for e in listed]
        encrypted = [e.encrypted for e in listed]
        return cls(
            [e.name for e in listed],
            [e.dtype for e in listed],
            [e.shape for e in listed],
            offsets_column(e.record_offset for e in listed),
            offsets_column(e.data_offset for e in listed),
            offsets_column(e.data_length for e in listed),
            np.fromiter((e.file for e in listed), dtype=np.int32, count=len(listed)),
            paths=paths if any(p is not None for p in paths) else None,
            kinds=kinds if any(k != "state_dict" for k in kinds) else None,
            encrypted=encrypted if any(encrypted) else None,
        )

    @classmethod
    def concat(cls, tables: Sequence[TensorTable], files: Sequence[int]) -> TensorTable:
        """One table of ``tables`` in order, the tensors of ``tables[i]`` in weight file ``files[i]``."""

        def joined(column: str) -> list[Any]:
            return list(itertools.chain.from_iterable(getattr(table, column) for table in tables))

        named = [table.names for table in tables if isinstance(table.names, Names)]
        names = Names.concat(named) if tables and len(named) == len(tables) else joined("names")

        def optional(column: str, default: Any) -> list[Any] | None:
            if all(getattr(table, column) is None for table in tables):
                return None
            return [v for t in tables for v in (getattr(t, column) or [default] * len(t))]

        def offsets(column: str) -> Offsets:
            parts = [getattr(table, column) for table in tables]
            if all(part.dtype == np.int64 for part in parts):
                return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            return np.array([int(v) for part in parts for v in part], dtype=object)

        numbers = [np.full(len(t), file, dtype=np.int32) for t, file in zip(tables, files, strict=True)]
        records = offsets("record_offsets")
        # Where every record is its data (safetensors), one column serves both, as in each file's table.
        same = all(table.record_offsets is table.data_offsets for table in tables)
        return cls(
            names,
            joined("dtypes"),
            joined("shapes"),
            records,
            records if same else offsets("data_offsets"),
            offsets("data_lengths"),
            np.concatenate(numbers) if numbers else np.zeros(0, dtype=np.int32),
            paths=optional("paths", None),
            kinds=optional("kinds", "state_dict"),
            encrypted=optional("encrypted", False),
        )

    def in_file(self, file: int) -> TensorTable:
        """These tensors as tensors of weight file ``file``."""
        return TensorTable(
            self.names, self.dtypes, self.shapes, self.record_offsets, self.data_offsets, self.data_lengths,
            np.full(len(self), file, dtype=np.int32), paths=self.paths, kinds=self.kinds,
            encrypted=self.encrypted,
        )  # fmt: skip

    @property
    def leads(self) -> Offsets:
        """Bytes of each record before its data (tensorizer's per-tensor header; 0 for safetensors)."""
        return self.data_offsets - self.record_offsets

    def nbytes(self) -> list[int]:
        """Each tensor's bytes in memory (C-level maps over the columns)."""
        return list(map(operator.mul, map(_ITEMSIZE, self.dtypes), map(math.prod, self.shapes)))

    def __len__(self) -> int:
        return len(self.names)

    @overload
    def __getitem__(self, i: int) -> TensorEntry: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[TensorEntry]: ...

    def __getitem__(self, i: int | slice) -> TensorEntry | Sequence[TensorEntry]:
        if isinstance(i, slice):
            return tuple(self._entry(j) for j in range(*i.indices(len(self))))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"tensor {i} out of range of {len(self)}")
        return self._entry(i)

    def __iter__(self) -> Iterator[TensorEntry]:
        return map(self._entry, range(len(self)))

    def __eq__(self, other: object) -> bool:
        """Equal to another table, tuple or list of the same entries in the same order."""
        if not isinstance(other, TensorTable | tuple | list):
            return NotImplemented
        return len(self) == len(other) and all(map(operator.eq, self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"<TensorTable of {len(self)} tensors>"

    def _entry(self, i: int) -> TensorEntry:
        return TensorEntry(
            self.names[i], self.dtypes[i], self.shapes[i], int(self.record_offsets[i]),
            int(self.data_offsets[i]), int(self.data_lengths[i]),
            None if self.paths is None else self.paths[i],
            "state_dict" if self.kinds is None else self.kinds[i],
            False if self.encrypted is None else self.encrypted[i],
            int(self.files[i]),
        )  # fmt: skip


_ITEMSIZE = operator.attrgetter("itemsize")


@dataclass(frozen=True)
class ModelIndex:
    """The tensors of one model file, in file order, and what the file says about itself."""

    format: FormatName
    version: int
    """The format's data version (tensorizer 1-5; safetensors has none and reports 1)."""
    tensors: Sequence[TensorEntry]
    """In file order: a :class:`TensorTable` (what is given is made one); :attr:`table` gives its columns."""
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

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, TensorTable):
            object.__setattr__(self, "tensors", TensorTable.of(self.tensors))

    @property
    def table(self) -> TensorTable:
        """The tensors as columns: what code that reads every tensor uses, rather than an entry each."""
        assert isinstance(self.tensors, TensorTable)  # made one in __post_init__
        return self.tensors

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of all tensors in memory."""
        return sum(self.table.nbytes())

    def __len__(self) -> int:
        return len(self.tensors)

    @functools.cached_property
    def _by_name(self) -> dict[str, int]:
        return dict(zip(self.table.names, range(len(self.tensors)), strict=True))

    def entry(self, tensor: str | TensorEntry, *, source: str) -> TensorEntry:
        """A tensor's entry by name (an entry is returned as it is); ``KeyError`` naming ``source``, the
        file, when it has no such tensor. What every reader's ``entry`` answers."""
        if isinstance(tensor, TensorEntry):
            return tensor
        try:
            return self.tensors[self._by_name[tensor]]
        except KeyError:
            raise KeyError(f"{source} has no tensor named {tensor!r}") from None
