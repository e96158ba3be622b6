"""Reading and checking a safetensors header: the index of a safetensors file, from its first bytes.

A safetensors file is ``N`` (u64, little-endian), ``N`` bytes of UTF-8 JSON, then the data buffer. The JSON
header is the whole index, so a remote reader gets it with one or two range reads. Every rule is checked
before anything the header claims is trusted or allocated; each rule fails with its own error class:

========================================================  ==========================
rule                                                      error when broken
========================================================  ==========================
the file holds the 8-byte size and the whole header       TruncatedError
``N`` is at most :data:`HEADER_SIZE_CAP`                  BoundsError
the header starts with ``{``, is UTF-8 JSON (an object),  HeaderError
may end in JSON whitespace (the writers' padding)
no tensor name appears twice                              DuplicateNameError
no key repeats inside an entry or ``__metadata__``        HeaderError
``__metadata__`` maps strings to strings                  HeaderError
each entry has a string dtype, a shape of non-negative    HeaderError
ints, ``data_offsets`` of two ints with begin <= end
the shape has at most 64 dimensions (numpy's limit)       HeaderError
the dtype is one we can represent                         UnsupportedDtypeError
``end - begin`` is the dtype's size times the elements    SizeMismatchError
a self-consistent header whose data runs past the file    TruncatedError
any other range that reaches past the file                BoundsError
the ranges cover the data buffer exactly: no overlap,     OverlapError
no hole, no bytes after the last tensor
========================================================  ==========================

The file size is needed for the last three rules. It is known when the caller passes ``size`` or when the
first read comes back short (a small file); otherwise the caller checks ``data_end`` against the size it
learns from its source.

The JSON subset is the one the reference implementation (serde_json) accepts (parsed in ``_json``): no
``NaN``/``Infinity``, no floats where integers are due, integers up to 2**64 - 1, no unpaired UTF-16
surrogates in names.
"""

from __future__ import annotations

import itertools
import math
import operator
import struct
from typing import Any

import numpy as np

from modelload.loader import dtypes
from modelload.loader.errors import (
    BoundsError,
    HeaderError,
    OverlapError,
    SizeMismatchError,
    TruncatedError,
    UnsupportedDtypeError,
)
from modelload.loader.formats._index import MAX_NDIM, ModelIndex, Names, RangeRead, TensorEntry, TensorTable
from modelload.loader.formats.safetensors._json import (
    FAST_JSON,
    METADATA_KEY,
    REWRITE,
    RepeatedKeys,
    kept_every_key,
    load_header_json,
    plain_header_json,
)

__all__ = ["FIRST_READ_LENGTH", "HEADER_SIZE_CAP", "METADATA_KEY", "read_index"]

HEADER_SIZE_CAP = 100_000_000
"""The largest header accepted, in bytes: the reference implementation's limit, so files we accept it
accepts too. It bounds what one hostile size field can make us read and parse."""

FIRST_READ_LENGTH = 64 * 1024
"""The speculative first read. It holds the whole header of most models (a few hundred tensors), so a remote
source answers one request; a bigger header costs exactly one more."""

_U64_MAX = 2**64 - 1

Shapes = dict[tuple[int, ...], tuple[int, ...]]
"""Each distinct shape, by itself: what the files of one model share so that each shape is one tuple."""


def read_index(
    read: RangeRead,
    *,
    source: str | None = None,
    size: int | None = None,
    file: int = 0,
    shapes: Shapes | None = None,
) -> ModelIndex:
    """Read and check the header of a safetensors file through ``read(offset, length)``.

    At most two reads: :data:`FIRST_READ_LENGTH` bytes from offset 0, then the rest of the header when it is
    longer. ``size`` is the file's size when the caller knows it (a local ``fstat``, an HTTP
    ``Content-Length``); with it, the data ranges are checked against the file too. ``file`` is the file's
    number among a model's weight files (:attr:`TensorEntry.file`). ``shapes``: see :func:`parse_header`.

    >>> from modelload.loader.formats.safetensors import serialize
    >>> import numpy as np
    >>> blob = serialize({"w": np.zeros((2, 3), np.float32)})
    >>> index = read_index(lambda offset, length: blob[offset : offset + length])
    >>> [(t.name, t.dtype.name, t.shape, t.data_offset, t.data_length) for t in index.tensors]
    [('w', 'float32', (2, 3), 72, 24)]
    """
    first = read(0, FIRST_READ_LENGTH)
    if size is None and len(first) < FIRST_READ_LENGTH:
        size = len(first)
    if len(first) < 8:
        raise TruncatedError(
            f"the file is {len(first)} bytes, too short for the 8-byte header size of a safetensors file; "
            "the upload or download was cut short",
            source=source,
        )
    (header_size,) = struct.unpack_from("<Q", first)
    if header_size > HEADER_SIZE_CAP:
        raise BoundsError(
            f"the header size field says {header_size} bytes, over the {HEADER_SIZE_CAP}-byte limit of "
            "safetensors readers; the file is corrupt or not a safetensors file",
            source=source,
        )
    header_end = 8 + header_size
    if size is not None and header_end > size:
        raise TruncatedError(
            f"the file is {size} bytes, but its header size field says the header alone ends at byte "
            f"{header_end}; the file was cut short or its first 8 bytes are corrupt",
            source=source,
        )
    view = memoryview(first)
    if header_end <= len(first):
        header: bytes | memoryview = view[8:header_end]
    else:
        rest = read(len(first), header_end - len(first))
        if len(rest) < header_end - len(first):
            raise TruncatedError(
                f"the file ends at byte {len(first) + len(rest)}, inside its {header_size}-byte header; "
                "the file was cut short",
                source=source,
            )
        header = b"".join((view[8:], rest))
    return parse_header(header, size=size, source=source, file=file, shapes=shapes)


def parse_header(
    header: bytes | memoryview,
    *,
    size: int | None = None,
    source: str | None = None,
    file: int = 0,
    shapes: Shapes | None = None,
) -> ModelIndex:
    """Check the ``N`` header bytes (without the 8-byte size) and build the index, tensors in file order.

    ``shapes``, when given, is shared by the files of one model: each tensor's shape is the tuple already
    there when an equal one is (a mixture of experts repeats a few shapes over 100,000 tensors, whose
    tuples and dimensions were 8 MiB kept for the whole load), and new ones are added."""
    base = 8 + len(header)
    found = _read_at_once(header, base=base, size=size, file=file, shapes=shapes)
    if found is not None:
        tensors, buffer_end, metadata = found
    else:  # something may be wrong: the careful reading, rule by rule, says precisely what
        top = load_header_json(header, source)
        metadata = _metadata(top.pop(METADATA_KEY, None), source)
        entries = sorted(
            (_entry(name, raw, base, source).in_file(file) for name, raw in top.items()),
            key=lambda e: (e.data_offset, e.data_length),
        )
        buffer_end = _check_layout(entries, base=base, size=size, source=source)
        tensors = TensorTable.of(entries)
    return ModelIndex(
        format="safetensors",
        version=1,
        tensors=tensors,
        index_length=base,
        data_end=base + buffer_end,
        metadata=metadata,
    )


# --- JSON --------------------------------------------------------------------------------------------------


def _metadata(raw: Any, source: str | None) -> dict[str, str]:
    if raw is None:  # the reference implementation reads null as "no metadata"
        return {}
    if not isinstance(raw, dict):
        raise HeaderError(
            f"{METADATA_KEY} must be an object of strings, not {_json_type(raw)}; {REWRITE}", source=source
        )
    if isinstance(raw, RepeatedKeys):
        raise HeaderError(f"{METADATA_KEY} repeats the key {raw.repeated!r}; {REWRITE}", source=source)
    for key, value in raw.items():
        if not isinstance(value, str):
            raise HeaderError(
                f"{METADATA_KEY}[{key!r}] is {_json_type(value)}; safetensors metadata values must be "
                "strings (encode structured values as JSON text)",
                source=source,
            )
        _check_text(key, f"{METADATA_KEY} key", source)
        _check_text(value, f"{METADATA_KEY}[{key!r}]", source)
    return dict(raw)


# --- entries -----------------------------------------------------------------------------------------------


def _entry(name: str, raw: Any, base: int, source: str | None) -> TensorEntry:
    _check_text(name, "a tensor name", source)
    where = f"tensor {name!r}"
    if not isinstance(raw, dict):
        raise HeaderError(f"{where} must be an object, not {_json_type(raw)}; {REWRITE}", source=source)
    if isinstance(raw, RepeatedKeys):
        raise HeaderError(f"{where} repeats the key {raw.repeated!r}; {REWRITE}", source=source)
    for key in ("dtype", "shape", "data_offsets"):
        if key not in raw:
            raise HeaderError(f"{where} has no {key!r}; {REWRITE}", source=source)
    code, shape_raw, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if not isinstance(code, str):
        raise HeaderError(
            f"{where}: dtype must be a string, not {_json_type(code)}; {REWRITE}", source=source
        )
    if not isinstance(shape_raw, list) or not all(_is_u64(d) for d in shape_raw):
        raise HeaderError(
            f"{where}: shape must be a list of non-negative integers, got {_short(shape_raw)}; {REWRITE}",
            source=source,
        )
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise HeaderError(
            f"{where}: data_offsets must be two non-negative integers [begin, end], got {_short(offsets)}; "
            f"{REWRITE}",
            source=source,
        )
    if len(shape_raw) > MAX_NDIM:
        raise HeaderError(
            f"{where} has {len(shape_raw)} dimensions; numpy, torch and the segment hold at most {MAX_NDIM}, "
            f"so it could never be loaded; {REWRITE}",
            source=source,
        )
    begin, end = offsets
    if end < begin:
        raise HeaderError(
            f"{where}: data_offsets [{begin}, {end}] end before they begin; {REWRITE}", source=source
        )
    try:
        dtype = dtypes.from_safetensors(code)
    except UnsupportedDtypeError as exc:
        raise UnsupportedDtypeError(
            f"{where} has dtype {code!r}, which this build cannot represent (supported: "
            f"{', '.join(_SUPPORTED)}); convert the tensor to a supported dtype before loading",
            source=source,
        ) from exc
    shape = tuple(shape_raw)
    length = end - begin
    needed = _nbytes_up_to(shape, dtype.itemsize, _U64_MAX)
    if needed != length:
        takes = f"{needed} bytes" if needed <= _U64_MAX else "more than 2**64 bytes"
        raise SizeMismatchError(
            f"{where} is {code} with shape {_short(list(shape))}, which takes {takes}, but its data_offsets "
            f"[{begin}, {end}] span {length}; {REWRITE}",
            source=source,
        )
    return TensorEntry(
        name=name,
        dtype=dtype,
        shape=shape,
        record_offset=base + begin,
        data_offset=base + begin,
        data_length=length,
    )


_SUPPORTED = tuple(code for code in (dtypes.by_name(n).safetensors for n in dtypes.names()) if code)
_BY_CODE = {code: dtypes.from_safetensors(code) for code in _SUPPORTED}
_DTYPE = operator.itemgetter("dtype")
_SHAPE = operator.itemgetter("shape")
_OFFSETS = operator.itemgetter("data_offsets")
_ITEMSIZE = operator.attrgetter("itemsize")
_I64_MAX = 2**63 - 1


def _read_at_once(
    header: bytes | memoryview, *, base: int, size: int | None, file: int, shapes: Shapes | None
) -> tuple[TensorTable, int, dict[str, str]] | None:
    """The tensors, the data buffer's length and the metadata of a header with nothing wrong, read by
    C-level passes (a shard of a mixture of experts lists thousands of tensors, and a Python statement per
    tensor costs microseconds); None when something may be wrong, or the header is of a shape these
    passes do not read (the caller then reads it carefully, which names what is wrong)."""
    plain = plain_header_json(header, fast=FAST_JSON)
    if plain is None:
        return None
    top, text = plain
    named = METADATA_KEY in top
    try:
        metadata = _metadata(top.pop(METADATA_KEY, None), None)
    except HeaderError:
        return None
    found = _entries_at_once(top, base=base, size=size, file=file, shapes=shapes)
    if found is None or not kept_every_key(text, tensors=len(top), metadata=metadata if named else None):
        return None
    return (*found, metadata)


def _entries_at_once(
    top: dict[str, Any], *, base: int, size: int | None, file: int, shapes: Shapes | None = None
) -> tuple[TensorTable, int] | None:
    """Every entry rule and the layout rule of :func:`_entry` and :func:`_check_layout`, checked column by
    column (C-level maps and numpy, not Python statements per tensor). Returns the tensors in file order,
    as columns (no object per tensor), and the data buffer's length, or None when a rule may be broken, or
    an entry holds more than its three keys."""
    names, raws = list(top), list(top.values())
    if not names or set(map(type, raws)) != {dict} or set(map(len, raws)) != {3}:
        return None
    try:  # three keys each, so these three or a KeyError
        found = list(map(_BY_CODE.__getitem__, map(_DTYPE, raws)))  # an unknown dtype: KeyError
        dims, offsets = list(map(_SHAPE, raws)), list(map(_OFFSETS, raws))
    except (KeyError, TypeError):  # TypeError: a dtype that is no string (a list cannot be looked up)
        return None
    if set(map(type, dims)) != {list} or set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}:
        return None
    if max(map(len, dims)) > MAX_NDIM:
        return None
    joined = "".join(names)
    if not joined.isascii():
        try:
            joined.encode("utf-8")  # an unpaired surrogate fails here
        except UnicodeEncodeError:
            return None
    dimensions = list(itertools.chain.from_iterable(dims))
    ends = list(itertools.chain.from_iterable(offsets))  # begin, end of each tensor
    if set(map(type, dimensions)) - {int} or set(map(type, ends)) != {int}:  # no float, no bool
        return None
    if dimensions and (min(dimensions) < 0 or max(dimensions) > _U64_MAX):
        return None
    count = len(names)
    try:  # uint64 takes exactly the integers 0 to 2**64 - 1: anything else is an OverflowError
        pairs = np.fromiter(ends, dtype=np.uint64, count=2 * count)
        elements = np.fromiter(map(math.prod, dims), dtype=np.uint64, count=count)
    except OverflowError:
        return None
    start, stop = pairs[0::2], pairs[1::2]
    if (stop < start).any():
        return None
    span = stop - start
    itemsizes = np.fromiter(map(_ITEMSIZE, found), dtype=np.uint64, count=count)
    if (span % itemsizes).any() or (span // itemsizes != elements).any():  # span == elements x itemsize
        return None
    if start[0] != 0 or (start[1:] != stop[:-1]).any():  # not listed in file order, as most writers list it
        order = np.lexsort((span, start))  # by (begin, length), ties in the header's order, as sorted() does
        start, stop, span = start[order], stop[order], span[order]
        if start[0] != 0 or (start[1:] != stop[:-1]).any():  # a hole or an overlap
            return None
        picked = order.tolist()
        names, found, dims = [list(map(column.__getitem__, picked)) for column in (names, found, dims)]
    buffer_end = int(stop[-1])
    if size is not None and buffer_end != size - base:  # cut short, or bytes after the last tensor
        return None
    if base + buffer_end > _I64_MAX:  # offsets past any file (the size unknown yet): kept as Python ints
        return None
    at = start.astype(np.int64) + base  # one column for both offsets: the record is the data
    tuples = list(map(tuple, dims))
    if shapes is not None:
        tuples = list(map(shapes.setdefault, tuples, tuples))
    tensors = TensorTable(
        Names(names),
        found,
        tuples,
        at,
        at,
        span.astype(np.int64),
        np.full(count, file, dtype=np.int32),
    )
    return tensors, buffer_end


def _nbytes_up_to(shape: tuple[int, ...], itemsize: int, limit: int) -> int:
    """The tensor's byte count, or some number above ``limit`` once the product passes it: a hostile shape of
    many huge dimensions must not make us multiply (or print) integers of millions of digits."""
    if 0 in shape:
        return 0
    total = itemsize
    for dim in shape:
        total *= dim
        if total > limit:
            return total
    return total


def _check_layout(entries: list[TensorEntry], *, base: int, size: int | None, source: str | None) -> int:
    """Check that the sorted ranges tile the data buffer; returns the buffer's length the header implies."""
    cursor = 0
    problem: str | None = None
    previous = "the start of the data buffer"
    for entry in entries:
        begin = entry.data_offset - base
        if problem is None and begin < cursor:
            problem = (
                f"tensor {entry.name!r} starts at data byte {begin}, inside {previous} (ending at {cursor})"
            )
        elif problem is None and begin > cursor:
            problem = (
                f"data bytes [{cursor}, {begin}) before tensor {entry.name!r} belong to no tensor; "
                "safetensors forbids holes (they could hide a second file in the first)"
            )
        if begin + entry.data_length >= cursor:
            cursor = begin + entry.data_length
            previous = f"tensor {entry.name!r}"
    if size is not None:
        available = size - base
        if problem is None and cursor > available:
            raise TruncatedError(
                f"the file is {size} bytes, but its header places data up to byte {base + cursor}; the file "
                "was cut short (an interrupted upload or download): fetch or upload it again",
                source=source,
            )
        for entry in entries:
            if entry.data_offset + entry.data_length > size:
                raise BoundsError(
                    f"tensor {entry.name!r} claims file bytes [{entry.data_offset}, "
                    f"{entry.data_offset + entry.data_length}), past the end of the {size}-byte file; "
                    f"{REWRITE}",
                    source=source,
                )
        if problem is None and cursor < available:
            problem = (
                f"the file has {available - cursor} bytes after the last tensor's data that belong to no "
                "tensor; safetensors forbids holes"
            )
    if problem is not None:
        raise OverlapError(f"{problem}; {REWRITE}", source=source)
    return cursor


# --- small helpers -----------------------------------------------------------------------------------------


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= _U64_MAX


def _check_text(text: str, what: str, source: str | None) -> None:
    """JSON escapes can spell unpaired UTF-16 surrogates, which are no UTF-8 text; serde_json refuses them."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise HeaderError(
                f"{what} holds an unpaired UTF-16 surrogate escape ({_short(text)}), which is not text; "
                f"{REWRITE}",
                source=source,
            ) from None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {
        dict: "an object",
        RepeatedKeys: "an object",
        list: "a list",
        str: "a string",
        int: "an integer",
    }.get(type(value), "null" if value is None else "a number")


def _short(value: Any) -> str:
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."
