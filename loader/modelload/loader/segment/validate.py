"""Validating a segment that was read: its header and manifest against every rule of SPEC.md (reader rule 1).

Everything a file declares (lengths, counts, offsets, shapes) is checked against the file's size and the
spec's bounds before anything of the size it declares is allocated; a failure is a SegmentLayoutError that
says the segment is corrupt (or a SegmentVersionError for a layout this loader does not know). The layout's
planning and packing, the other direction, is in ``layout``.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from modelload.loader import dtypes
from modelload.loader.errors import BadMagicError, ModelloadError, SegmentLayoutError, SegmentVersionError
from modelload.loader.formats import detect_format
from modelload.loader.segment.layout import (
    _FIXED,
    _MEMORY,
    _RESERVED_TAIL,
    ALIGNMENT,
    ERROR_CAPACITY,
    HEADER_LENGTH,
    LAYOUT_VERSIONS,
    MAGIC,
    MAX_FILES,
    MAX_MANIFEST_LENGTH,
    MAX_NDIM,
    MAX_TENSORS,
    OFF_ERROR_LENGTH,
    OFF_WRITER_STATE,
    PACKED_ALIGNMENT,
    STATE_ENTRY_LENGTH,
    Header,
    MemoryMode,
    Slot,
    WriterState,
)

__all__ = ["parse_header", "parse_manifest"]

_MANIFEST_KEYS = {
    1: frozenset({"tensors", "metadata"}),
    2: frozenset({"tensors", "metadata", "files"}),
    3: frozenset({"tensors", "metadata", "files"}),
    4: frozenset({"tensors", "metadata", "files"}),
    5: frozenset({"tensors", "metadata", "files"}),
}
_TENSOR_KEYS = {
    1: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256"}),
    2: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
    3: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
    4: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
    5: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
}
_REQUIRED_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
_HEX = frozenset("0123456789abcdef")


def _fail(message: str) -> SegmentLayoutError:
    return SegmentLayoutError(f"{message}; the segment is corrupt or was not written by modelload")


def _not_a_segment(buf: bytes | memoryview) -> str:
    """What a file that is no segment is, and what to do. Its bytes are never shown: a path pointed at the
    wrong file may name anything (a token, a key), and the message reaches logs."""
    try:
        kind = detect_format(buf[:32])
    except BadMagicError:
        return (
            f"not a modelload segment: it does not start with {MAGIC.decode()!r}, nor is it a model file; "
            "check the path (a sidecar or `modelload stage` writes the segment)"
        )
    return (
        f"the file is a {kind} file, not a modelload segment: load it into a segment with `modelload stage "
        "FILE SEGMENT` (or `modelload sidecar --source FILE --segment SEGMENT`) and attach to that"
    )


def parse_header(buf: bytes | memoryview, *, file_size: int) -> Header:
    """Check the header's write-once bytes and geometry (reader rule 1) and return them.

    ``buf`` holds at least the first 4096 bytes. Nothing of the sizes the header declares is allocated.
    """
    if len(buf) >= len(MAGIC) and bytes(buf[: len(MAGIC)]) != MAGIC:
        raise SegmentLayoutError(_not_a_segment(buf))  # before the size: a small model file is no segment
    if file_size < HEADER_LENGTH or len(buf) < HEADER_LENGTH:
        raise _fail(f"segment is {file_size} bytes, shorter than its {HEADER_LENGTH}-byte header (truncated)")
    (magic, version, header_length, segment_length, manifest_offset, manifest_length, manifest_crc32,
     alignment, state_offset, tensor_count, data_offset, data_length, load_id, created_ns,
     reserved) = _FIXED.unpack_from(buf, 0)  # fmt: skip
    if magic != MAGIC:
        raise SegmentLayoutError(_not_a_segment(buf))
    if version not in LAYOUT_VERSIONS:
        raise SegmentVersionError(
            f"segment layout version {version} is not known to this loader, which reads versions "
            f"{', '.join(map(str, LAYOUT_VERSIONS))}; install the modelload loader that matches the "
            "sidecar's version"
        )
    if header_length != HEADER_LENGTH:
        raise _fail(f"header length {header_length}, expected {HEADER_LENGTH}")
    expected = PACKED_ALIGNMENT if version == 5 else ALIGNMENT  # packed: each slot on its element size
    if alignment != expected:
        raise _fail(f"alignment {alignment}, expected {expected} in a version-{version} segment")
    if segment_length != file_size:
        raise _fail(f"header says the segment is {segment_length} bytes, the file is {file_size}")
    if manifest_offset != HEADER_LENGTH:
        raise _fail(f"manifest offset {manifest_offset}, expected {HEADER_LENGTH}")
    if manifest_length > MAX_MANIFEST_LENGTH:
        raise _fail(f"manifest length {manifest_length} exceeds the limit of {MAX_MANIFEST_LENGTH}")
    if tensor_count > MAX_TENSORS:
        raise _fail(f"tensor count {tensor_count} exceeds the limit of {MAX_TENSORS}")
    if state_offset % ALIGNMENT or state_offset < manifest_offset + manifest_length:
        raise _fail(f"state table offset {state_offset} is unaligned or inside the manifest")
    if data_offset % ALIGNMENT or data_offset < state_offset + STATE_ENTRY_LENGTH * tensor_count:
        raise _fail(f"data offset {data_offset} is unaligned or inside the state table")
    memory_mode, ring_size = _parse_memory(version, reserved)
    if version == 4:  # the data region is a ring: the file ends with it, whatever the model's size
        if data_offset + ring_size != segment_length:
            raise _fail(
                f"a ring segment is its tables and then its ring: {data_offset} + {ring_size} bytes, but the "
                f"header says {segment_length}"
            )
        if data_length > _MAX_FIELD - data_offset:
            raise _fail(f"data length {data_length} is larger than any segment")
    elif data_offset + data_length > segment_length:
        raise _fail(
            f"data region [{data_offset}, {data_offset + data_length}) runs past the end of the segment"
        )
    if any(bytes(buf[_RESERVED_TAIL[0] : _RESERVED_TAIL[1]])) or any(bytes(buf[164:168])):
        raise _fail("reserved header bytes are not zero")
    state = struct.unpack_from("<I", buf, OFF_WRITER_STATE)[0]
    if state not in WriterState._value2member_map_:
        raise _fail(f"unknown writer state {state}")
    error_length = struct.unpack_from("<I", buf, OFF_ERROR_LENGTH)[0]
    if error_length > ERROR_CAPACITY:
        raise _fail(f"error length {error_length} exceeds {ERROR_CAPACITY}")
    return Header(
        segment_length=segment_length,
        manifest_length=manifest_length,
        manifest_crc32=manifest_crc32,
        state_offset=state_offset,
        tensor_count=tensor_count,
        data_offset=data_offset,
        data_length=data_length,
        load_id=load_id,
        created_ns=created_ns,
        layout_version=version,
        memory_mode=memory_mode,
        ring_size=ring_size,
        alignment=alignment,
    )


def _parse_memory(version: int, reserved: bytes) -> tuple[MemoryMode, int]:
    """Bytes 96-127: reserved (zero) before version 3; memory mode and ring size from version 3 on (version 4
    is always a ring). Version 5 (packed) is memory mode full: reserved, as before version 3."""
    if version < 3 or version == 5:
        if any(reserved):
            raise _fail("reserved header bytes are not zero")
        return MemoryMode.FULL, 0
    mode, middle, ring_size = _MEMORY.unpack(reserved)
    if middle or any(reserved[_MEMORY.size - 16 :]):
        raise _fail("reserved header bytes are not zero")
    if version >= 4 and mode != MemoryMode.RING:
        raise _fail(f"memory mode {mode} is not 2 (ring) in a version-{version} segment")
    if mode not in (MemoryMode.RELEASE, MemoryMode.RING):
        raise _fail(f"memory mode {mode} is not 1 (release) or 2 (ring) in a version-3 segment")
    if (mode == MemoryMode.RING) != (ring_size > 0) or ring_size % ALIGNMENT or ring_size > _MAX_FIELD:
        raise _fail(f"ring size {ring_size} must be a positive multiple of {ALIGNMENT} in ring mode, else 0")
    return MemoryMode(mode), ring_size


def parse_manifest(
    data: bytes | memoryview, header: Header
) -> tuple[tuple[Slot, ...], dict[str, str], tuple[str, ...]]:
    """Check the manifest against its CRC and every manifest rule (reader rule 2).

    Returns the slots in manifest order, the metadata, and the weight files (empty before version 2).
    """
    if zlib.crc32(data) != header.manifest_crc32:
        raise _fail("manifest checksum does not match the header")
    try:
        document = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(f"manifest is not UTF-8 JSON ({exc})") from exc
    except ValueError:  # an integer past Python's digit limit (4300 by default)
        raise _fail("manifest holds a number of thousands of digits, larger than any size") from None
    except RecursionError:
        raise _fail("manifest nests JSON deeper than this reader can follow") from None
    version = header.layout_version
    if (
        not isinstance(document, dict)
        or not {"tensors", "metadata"} <= set(document)
        or not _MANIFEST_KEYS[version].issuperset(document)
    ):
        extra = ' (and maybe "files")' if version >= 2 else ""
        raise _fail(f'manifest must be an object with exactly "tensors" and "metadata"{extra}')
    files = _parse_files(document.get("files", []))
    metadata, entries = document["metadata"], document["tensors"]
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _fail("manifest metadata must map strings to strings")
    if not all(_is_text(t) for item in metadata.items() for t in item):
        raise _fail("manifest metadata holds an unpaired UTF-16 surrogate escape, which is not text")
    if not isinstance(entries, list) or len(entries) != header.tensor_count:
        count = len(entries) if isinstance(entries, list) else "no"
        raise _fail(f"manifest lists {count} tensors, the header says {header.tensor_count}")
    slots = _parse_slots_at_once(entries, header, len(files))
    if slots is None:  # something is off: the rule-by-rule pass says precisely what
        slots = tuple(_parse_slot(i, entry, header, len(files)) for i, entry in enumerate(entries))
        _check_disjoint(slots)
    return slots, metadata, files


_DTYPES = {**{name: dtypes.by_name(name) for name in dtypes.names()},
           **{f"torch.{name}": dtypes.by_name(name) for name in dtypes.names()}}  # fmt: skip
_SHA_KEY = frozenset({"sha256"})


def _parse_slots_at_once(entries: list[Any], header: Header, file_count: int) -> tuple[Slot, ...] | None:
    """Every manifest rule of :func:`_parse_slot` and :func:`_check_disjoint`, checked column by column
    (a pass of C-level maps and numpy per rule, not Python statements per tensor): what a segment of 100,000
    tensors can afford on every attach. None when any rule may fail, or the input is unusual (a JSON
    ``null`` where a key is optional, numbers past 64 bits): the caller then checks tensor by tensor, which
    names the offending one."""
    count = len(entries)
    if not count:
        return ()
    if set(map(type, entries)) != {dict}:
        return None
    allowed = _TENSOR_KEYS[header.layout_version]
    keysets = set(map(frozenset, entries))
    file_key = frozenset({"file"})
    for keys in keysets:
        if not (allowed >= keys >= _REQUIRED_KEYS) or bool(keys & file_key) != bool(file_count):
            return None
    try:
        names = [e["name"] for e in entries]
        types = set(map(type, names))
        found = [_DTYPES[e["dtype"]] for e in entries]  # a non-string is unhashable or unknown: KeyError
        shapes = [e["shape"] for e in entries]
        offsets = [e["offset"] for e in entries]
        sizes = [e["nbytes"] for e in entries]
    except (KeyError, TypeError):
        return None
    if (
        types != {str}
        or set(map(type, shapes)) != {list}
        or set(map(type, offsets)) | set(map(type, sizes)) != {int}
    ):
        return None
    try:
        "\0".join(names).encode("utf-8")  # an unpaired surrogate fails here
    except UnicodeEncodeError:
        return None
    if len(set(names)) != count or max(map(len, shapes)) > MAX_NDIM:
        return None
    dims = list(itertools.chain.from_iterable(shapes))
    if dims and (set(map(type, dims)) != {int} or min(dims) < 0 or max(dims) > _MAX_FIELD):
        return None
    itemsizes = [d.itemsize for d in found]
    if any(
        math.prod(shape) * item != size for shape, item, size in zip(shapes, itemsizes, sizes, strict=True)
    ):
        return None
    try:
        offset = np.array(offsets, dtype=np.int64)
        nbytes = np.array(sizes, dtype=np.int64)
    except OverflowError:
        return None
    data_end = header.data_offset + header.data_length
    if (
        (offset < header.data_offset).any()
        or (nbytes < 0).any()
        or (offset % header.slot_step(np.array(itemsizes, dtype=np.int64))).any()
        or (nbytes > data_end - offset).any()
        or (header.ring and (nbytes > header.ring_size).any())
    ):
        return None
    shas: list[str | None] = [None] * count
    if any(keys & _SHA_KEY for keys in keysets):
        shas = [e.get("sha256") for e in entries]
        if any(
            sha is not None and (type(sha) is not str or len(sha) != 64 or not _HEX.issuperset(sha))
            for sha in shas
        ):
            return None
    files: list[int | None] = [None] * count
    if file_count:
        numbers: list[int] = [e["file"] for e in entries]
        if set(map(type, numbers)) != {int} or min(numbers) < 0 or max(numbers) >= file_count:
            return None
        files = list(numbers)
    empty = np.flatnonzero(nbytes == 0).tolist()  # rare: checked one by one
    if any(_spanned(shapes[i], itemsizes[i]) > _MAX_FIELD for i in empty):
        return None
    placed = np.flatnonzero(nbytes)
    order = placed[np.argsort(offset[placed], kind="stable")]
    if (offset[order[:-1]] + nbytes[order[:-1]] > offset[order[1:]]).any():
        return None
    return tuple(map(Slot, range(count), names, found, map(tuple, shapes), offsets, sizes, shas, files))


def _spanned(shape: Sequence[int], itemsize: int) -> int:
    """The bytes ``shape``'s non-zero dimensions span: what numpy and torch must fit in 63 bits to shape even
    an array of no element (``(2**62, 0)`` of float32 is refused by both)."""
    return math.prod(d for d in shape if d) * itemsize


def _parse_files(files: object) -> tuple[str, ...]:
    if (
        not isinstance(files, list)
        or len(files) > MAX_FILES
        or not all(isinstance(f, str) and f and _is_text(f) for f in files)
        or len(set(files)) != len(files)
    ):
        raise _fail(f"manifest files must be at most {MAX_FILES} distinct non-empty strings")
    return tuple(files)


def _parse_slot(index: int, entry: object, header: Header, file_count: int) -> Slot:
    allowed = _TENSOR_KEYS[header.layout_version]
    if not isinstance(entry, dict) or not allowed.issuperset(entry) or not set(entry) >= _REQUIRED_KEYS:
        extra = ", file" if header.layout_version >= 2 else ""
        raise _fail(
            f"manifest tensor {index} must have name, dtype, shape, offset, nbytes (and maybe sha256{extra})"
        )
    file = entry.get("file")
    if (file is None) != (file_count == 0) or (
        file is not None and (type(file) is not int or not 0 <= file < file_count)
    ):
        raise _fail(f"manifest tensor {index}: file must index the manifest's {file_count} files")
    name, dtype_name, shape = entry.get("name"), entry.get("dtype"), entry.get("shape")
    offset, nbytes, sha256 = entry.get("offset"), entry.get("nbytes"), entry.get("sha256")
    label = f"manifest tensor {index} ({name!r})"
    if not isinstance(name, str) or not isinstance(dtype_name, str):
        raise _fail(f"{label}: name and dtype must be strings")
    if not _is_text(name):
        raise _fail(f"manifest tensor {index} ({name!a}): the name holds an unpaired UTF-16 surrogate")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(type(d) is int and 0 <= d <= _MAX_FIELD for d in shape)
    ):
        raise _fail(f"{label}: shape must be at most {MAX_NDIM} integers from 0 to 2**63 - 1")
    if not all(type(v) is int and 0 <= v <= _MAX_FIELD for v in (offset, nbytes)):
        raise _fail(f"{label}: offset and nbytes must be integers from 0 to 2**63 - 1")
    assert isinstance(offset, int) and isinstance(nbytes, int)
    if sha256 is not None and (
        not isinstance(sha256, str) or len(sha256) != 64 or not _HEX.issuperset(sha256)
    ):
        raise _fail(f"{label}: sha256 must be 64 lowercase hex digits")
    try:
        dtype = dtypes.by_name(dtype_name)
    except ModelloadError:
        raise _fail(f"{label}: unknown dtype {dtype_name!r}") from None
    if dtype.nbytes(shape) != nbytes:
        raise _fail(f"{label}: nbytes {nbytes} does not match {dtype_name} of shape {shape}")
    if not nbytes and _spanned(shape, dtype.itemsize) > _MAX_FIELD:
        raise _fail(
            f"{label}: shape {shape} holds no element, but its other dimensions span more than 2**63 - 1 "
            "bytes, which no array can be shaped as"
        )
    step = header.slot_step(dtype.itemsize)
    if offset % step:
        raise _fail(f"{label}: offset {offset} is not a multiple of {step}")
    data_end = header.data_offset + header.data_length
    if offset < header.data_offset or offset + nbytes > data_end:
        raise _fail(f"{label}: slot [{offset}, {offset + nbytes}) lies outside the data region")
    if header.ring and nbytes > header.ring_size:
        raise _fail(f"{label}: {nbytes} bytes do not fit in the ring of {header.ring_size}")
    return Slot(index, name, dtype, tuple(shape), offset, nbytes, sha256, file)


_MAX_FIELD = 2**63 - 1
"""The largest dimension, offset or size a manifest may hold: no file or mapping is larger, and the bound
keeps a hostile manifest from making the reader multiply integers of thousands of digits."""


def _is_text(value: str) -> bool:
    """False for a string holding a lone surrogate (a JSON escape can spell one): it cannot be printed or
    encoded, so it would crash whoever shows the name later."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_disjoint(slots: tuple[Slot, ...]) -> None:
    names: set[str] = set()
    for slot in slots:
        if slot.name in names:
            raise _fail(f"tensor name {slot.name!r} appears twice in the manifest")
        names.add(slot.name)
    placed = sorted((s for s in slots if s.nbytes), key=lambda s: s.offset)
    for before, after in itertools.pairwise(placed):
        if before.offset + before.nbytes > after.offset:
            raise _fail(f"tensors {before.name!r} and {after.name!r} overlap")
