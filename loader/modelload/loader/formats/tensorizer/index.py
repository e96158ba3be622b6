"""The metadata index (docs/tensorizer-format.md, "Index"): where each tensor's record lies, read with one or
two range reads.

The index is what a remote reader fetches first and plans every other byte range from, so it is checked as
a whole before anyone trusts it: every entry parses inside the metadata block, names are unique and form a
tree, dtypes are known, each data length matches dtype and shape (or is 0 for a meta tensor, from data
version 4), and the records tile the file after the block in index order, back to back, with no overlap and
no hole (tensorizer's own readers walk records sequentially, so a file with a gap is unreadable to them).

Entry layout: ``[u32 version tag]`` (only with the versioned_headers flag), ``u16 name_len``, name,
``u8 tensor_type``, ``u8 dtype_len``, dtype, ``u8 ndim``, dims (u32, or u64 with tag 5), ``u64
header_offset``, ``u64 data_offset``, ``u64 data_length``.
"""

from __future__ import annotations

import struct

from modelload.loader.errors import (
    BoundsError,
    DuplicateNameError,
    HeaderError,
    OverlapError,
    SizeMismatchError,
    TruncatedError,
)
from modelload.loader.formats._index import MAX_NDIM, ModelIndex, RangeRead, TensorEntry
from modelload.loader.formats.tensorizer._cursor import Cursor
from modelload.loader.formats.tensorizer.file_header import (
    DEFAULT_METADATA_SIZE,
    PROLOGUE_SIZE,
    VERSION_META,
    FileHeader,
    parse_file_header,
)
from modelload.loader.formats.tensorizer.names import PathError, PathTree, decode_name
from modelload.loader.formats.tensorizer.tensor_header import KINDS, LONG_DIM, Kind, decode_dtype

__all__ = ["FIRST_READ", "MAX_HEADER_SLACK", "pack_entry", "parse_index", "read_index"]

FIRST_READ = PROLOGUE_SIZE + DEFAULT_METADATA_SIZE
"""The first range read: the prologue and a default-sized metadata block, so most files need one read."""
MAX_HEADER_SLACK = 1024 * 1024
"""A tensor header may be at most this plus data_length/64 bytes (one 16-byte MAC per 1 KiB chunk, the
smallest chunk allowed); a bigger one is a corrupt offset, refused before anyone reads it."""

_TAG_SHORT, _TAG_LONG = 1, 5
_LOCATION = struct.Struct("<QQQ")
_MIN_HEADER = 8 + 2 + 1 + 2 + 1 + 1 + 2 + 1 + 8  # fixed fields of a tensor header


def read_index(
    read: RangeRead | bytes | bytearray | memoryview,
    *,
    source: str | None = None,
    size: int | None = None,
) -> ModelIndex:
    """Read and check the index of a tensorizer file with at most two calls to ``read(offset, length)``.

    ``read`` may also be the file's first bytes (a prefix at least ``index_length`` long). ``size``, the
    file's size when known, lets records be checked against the end of the file too.

    >>> with open("model.tensors", "rb") as f:                          # doctest: +SKIP
    ...     index = read_index(lambda off, n: os.pread(f.fileno(), n, off), size=os.fstat(f.fileno()).st_size)
    """
    reader = _prefix_reader(read) if isinstance(read, bytes | bytearray | memoryview) else read
    first_length = FIRST_READ if size is None else min(FIRST_READ, size)
    first = bytes(reader(0, first_length))[:first_length]
    header = parse_file_header(first, source=source)
    need = header.index_length
    if size is not None and need > size:
        raise TruncatedError(
            f"the metadata block ends at byte {need} but the file has {size} bytes; re-upload or "
            "re-create it",
            source=source,
        )
    block = first[PROLOGUE_SIZE:need]
    if len(first) < need and len(first) == FIRST_READ:
        block += bytes(reader(FIRST_READ, need - FIRST_READ))[: need - FIRST_READ]
    if len(block) < header.metadata_len:
        raise TruncatedError(
            f"the file ends inside the metadata block: {header.metadata_len} bytes declared, "
            f"{len(block)} present; re-upload or re-create it",
            source=source,
        )
    return parse_index(header, memoryview(block), source=source, size=size)


def _prefix_reader(prefix: bytes | bytearray | memoryview) -> RangeRead:
    data = memoryview(prefix).cast("B")

    def read(offset: int, length: int) -> bytes:
        return bytes(data[offset : offset + length])

    return read


def parse_index(
    header: FileHeader, block: memoryview, *, source: str | None = None, size: int | None = None
) -> ModelIndex:
    """Parse ``header.tensor_count`` entries from the metadata block and check the records' layout."""
    cur = Cursor(block, what="metadata index", source=source)
    tree = PathTree()
    seen: set[str] = set()
    entries: list[TensorEntry] = []
    expected_offset = header.index_length
    for i in range(header.tensor_count):
        entry, raw_length = _parse_entry(cur, i, header, source)
        what = f"index entry {i} ({entry.name!r})"
        _check_name(entry, tree, seen, what, source)
        _check_layout(entry, raw_length, expected_offset, header, what, source, size)
        expected_offset = entry.data_offset + entry.data_length
        entries.append(entry)
    return ModelIndex(
        format="tensorizer",
        version=header.version,
        tensors=tuple(entries),
        index_length=header.index_length,
        data_end=expected_offset,
        encrypted=header.has_crypt_info,
    )


def _parse_entry(cur: Cursor, i: int, header: FileHeader, source: str | None) -> tuple[TensorEntry, int]:
    """One entry, and the bytes its name, dtype and dims take (which its tensor header repeats)."""
    cur.what = f"index entry {i}"
    wide = False
    if header.versioned_headers:
        tag = cur.u32("version tag")
        if tag not in (_TAG_SHORT, _TAG_LONG):
            raise HeaderError(f"index entry {i}: version tag {tag}; writers use 1 or 5", source=source)
        wide = tag == _TAG_LONG
    raw_start = cur.pos
    try:
        name, path = decode_name(cur.take(cur.u16("name length"), "name"))
    except PathError as exc:
        raise HeaderError(f"index entry {i}: {exc}; re-create the file", source=source) from None
    what = f"index entry {i} ({name!r})"
    cur.what = what
    kind_code = cur.u8("tensor type")
    if kind_code >= len(KINDS):
        raise HeaderError(
            f"{what}: tensor type {kind_code} is not 0 (param), 1 (buffer) or 2 (state_dict)", source=source
        )
    kind: Kind = KINDS[kind_code]
    if path is not None and kind != "state_dict":
        raise HeaderError(
            f"{what}: a structured path on a {kind}; only state_dict entries have paths", source=source
        )
    dtype = decode_dtype(cur.take(cur.u8("dtype length"), "dtype"), what=what, source=source)
    ndim = cur.u8("ndim")
    if ndim > MAX_NDIM:
        raise HeaderError(
            f"{what}: {ndim} dimensions; numpy, torch and the segment hold at most {MAX_NDIM}, so the tensor "
            "cannot be loaded: re-create the file",
            source=source,
        )
    shape = cur.dims(ndim, wide=wide, field="dimensions")
    if wide and not any(d >= LONG_DIM for d in shape):
        raise HeaderError(
            f"{what}: tagged as a long (u64) tensor but no dimension reaches 2**32; writers tag only "
            "long ones",
            source=source,
        )
    raw_length = cur.pos - raw_start
    cur.need(_LOCATION.size, "offsets")
    header_offset, data_offset, data_length = _LOCATION.unpack_from(cur.buffer, cur.pos)
    cur.pos += _LOCATION.size
    entry = TensorEntry(
        name=name,
        dtype=dtype,
        shape=shape,
        record_offset=header_offset,
        data_offset=data_offset,
        data_length=data_length,
        path=path,
        kind=kind,
        encrypted=header.has_crypt_info and data_length > 0,
    )
    return entry, raw_length


def _check_name(entry: TensorEntry, tree: PathTree, seen: set[str], what: str, source: str | None) -> None:
    if entry.name in seen:
        raise DuplicateNameError(
            f"{what}: the name {entry.name!r} is used by an earlier tensor; re-create the file with "
            "unique names",
            source=source,
        )
    seen.add(entry.name)
    try:
        tree.add(entry.path if entry.path is not None else (entry.name,))
    except PathError as exc:
        raise HeaderError(f"{what}: {exc}", source=source) from None


def _check_layout(
    entry: TensorEntry,
    raw_length: int,
    expected: int,
    header: FileHeader,
    what: str,
    source: str | None,
    size: int | None,
) -> None:
    """One entry's record against its dtype and shape, the file's size, the previous record, and the
    header size its offsets imply; the most specific rule is checked first."""
    _check_data_length(entry, header, what, source)
    start = entry.record_offset
    if start != expected:
        if size is not None and start >= size:
            raise BoundsError(
                f"{what}: its record starts at byte {start}, past the end of the {size}-byte file; "
                "the index is corrupt",
                source=source,
            )
        if start < expected:
            inside = "metadata block" if expected == header.index_length else "previous record"
            raise OverlapError(
                f"{what}: its record starts at byte {start}, inside the {inside} (which ends at "
                f"{expected}); the index is corrupt",
                source=source,
            )
        raise OverlapError(
            f"{what}: its record starts at byte {start}, leaving a gap after byte {expected}; records "
            "must follow each other in index order with no gap, so the index is corrupt",
            source=source,
        )
    header_size = entry.header_length
    # The header repeats the entry's name, dtype and dims (the entry's bytes less its 5 length/type bytes),
    # and in an encrypted file carries at least an empty crypt_info block (10 bytes).
    minimum = _MIN_HEADER + raw_length - 5 + (10 if header.has_crypt_info else 0)
    if header_size < minimum:
        raise HeaderError(
            f"{what}: data_offset {entry.data_offset} leaves {header_size} bytes for a tensor header "
            f"that needs at least {minimum}; the index is corrupt",
            source=source,
        )
    if header_size > MAX_HEADER_SLACK + entry.data_length // 64:
        past = (
            f", past the end of the {size}-byte file" if size is not None and entry.data_offset > size else ""
        )
        raise BoundsError(
            f"{what}: its data starts at byte {entry.data_offset}{past}, which implies a {header_size}-byte "
            "tensor header, more than any valid header needs; the index is corrupt",
            source=source,
        )
    end = entry.data_offset + entry.data_length
    if size is not None and end > size:
        raise TruncatedError(
            f"{what}: its record ends at byte {end} but the file has {size} bytes; re-upload or re-create it",
            source=source,
        )


def _check_data_length(entry: TensorEntry, header: FileHeader, what: str, source: str | None) -> None:
    if entry.data_length == entry.nbytes:
        return
    if entry.data_length != 0:
        raise SizeMismatchError(
            f"{what}: {entry.data_length} data bytes for {entry.dtype.name}{list(entry.shape)}, "
            f"which takes {entry.nbytes}; the index is corrupt",
            source=source,
        )
    if header.version < VERSION_META:
        raise SizeMismatchError(
            f"{what}: no data for {entry.nbytes} bytes of {entry.dtype.name}{list(entry.shape)}; meta "
            f"tensors need data version 4 and this file is version {header.version}",
            source=source,
        )


def pack_entry(
    *,
    name: bytes,
    kind: Kind,
    dtype: bytes,
    shape: tuple[int, ...],
    long_dims: bool,
    header_offset: int,
    data_offset: int,
    data_length: int,
    versioned: bool,
) -> bytes:
    """One index entry as the writer stores it (with a version tag when the file is versioned)."""
    tag = struct.pack("<I", _TAG_LONG if long_dims else _TAG_SHORT) if versioned else b""
    dims = struct.pack(f"<{len(shape)}{'Q' if long_dims else 'I'}", *shape)
    return (
        tag
        + struct.pack("<H", len(name))
        + name
        + bytes((KINDS.index(kind), len(dtype)))
        + dtype
        + bytes((len(shape),))
        + dims
        + _LOCATION.pack(header_offset, data_offset, data_length)
    )
