"""The segment's byte layout (SPEC.md beside this file): planning a layout and validating one that was read.

This module is pure bytes: it plans where every region and tensor slot goes, packs the header and the
manifest, and checks a header and manifest read from a file against every rule of the spec before anything
of the size they declare is allocated. Reading and writing the file itself is in ``reader`` and ``writer``.
"""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum, IntFlag
from typing import Any

from modelload.loader import dtypes
from modelload.loader.dtypes import DType
from modelload.loader.errors import (
    ModelloadError,
    SegmentLayoutError,
    SegmentVersionError,
)

__all__ = [
    "ALIGNMENT",
    "HEADER_LENGTH",
    "LAYOUT_VERSION",
    "LAYOUT_VERSIONS",
    "MAX_FILES",
    "MODEL_DIR_KEY",
    "MAGIC",
    "MAX_MANIFEST_LENGTH",
    "MAX_TENSORS",
    "ENTRY_CRC32",
    "ENTRY_FLAGS",
    "ENTRY_READY_NS",
    "ENTRY_STATE",
    "STATE_ENTRY_LENGTH",
    "Header",
    "Layout",
    "MemoryMode",
    "Slot",
    "TensorFlags",
    "TensorSpec",
    "TensorState",
    "WriterState",
    "align",
    "entry_offset",
    "parse_header",
    "parse_manifest",
    "plan_layout",
]

MAGIC = b"MODELSEG"
LAYOUT_VERSION = 4
"""The newest layout version. A segment of one weight file is written as version 1 (which older loaders
read); a segment of several files as version 2, which records each tensor's file; a segment whose pages the
writer gives back once consumed as version 3 (memory mode release) or 4 (memory mode ring, whose file holds
only a ring of data that tensors reuse), which older loaders refuse."""
LAYOUT_VERSIONS = (1, 2, 3, 4)
MAX_FILES = 65536
MODEL_DIR_KEY = "model_dir"
"""The metadata key naming the model directory (an absolute path) the writer filled with the model's
small files (config, tokenizer) before publishing the segment."""
HEADER_LENGTH = 4096
ALIGNMENT = 4096
STATE_ENTRY_LENGTH = 32
MAX_TENSORS = 1 << 20
MAX_MANIFEST_LENGTH = 64 << 20
MAX_NDIM = 64
ERROR_CAPACITY = 1024

# Field offsets in the header (SPEC.md, "Header").
_FIXED = struct.Struct("<8sIIQQQIIQQQQQQ32s")  # bytes 0-127, written once
OFF_WRITER_STATE = 128
OFF_WRITER_PID = 132
OFF_TENSORS_READY = 136
OFF_BYTES_READY = 144
OFF_FINISHED_NS = 152
OFF_ERROR_LENGTH = 160
OFF_HEARTBEAT_NS = 168
OFF_ERROR = 176
_RESERVED_TAIL = (OFF_ERROR + ERROR_CAPACITY, HEADER_LENGTH)

# Field offsets inside a 32-byte state entry (SPEC.md, "State table").
ENTRY_STATE = 0
"""u32: PENDING, READY, FAILED (and RELEASED in layouts 3 and 4)."""
ENTRY_FLAGS = 4
"""u32: TensorFlags."""
ENTRY_READY_NS = 8
"""u64: when the tensor became READY."""
ENTRY_CRC32 = 16
"""u32: the tensor's CRC-32, when the CRC32 flag is set."""


def entry_offset(state_offset: int, index: int, field: int = ENTRY_STATE) -> int:
    """The absolute offset of ``field`` of tensor ``index``'s state entry."""
    return state_offset + STATE_ENTRY_LENGTH * index + field


_MANIFEST_KEYS = {
    1: frozenset({"tensors", "metadata"}),
    2: frozenset({"tensors", "metadata", "files"}),
    3: frozenset({"tensors", "metadata", "files"}),
    4: frozenset({"tensors", "metadata", "files"}),
}
_TENSOR_KEYS = {
    1: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256"}),
    2: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
    3: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
    4: frozenset({"name", "dtype", "shape", "offset", "nbytes", "sha256", "file"}),
}
_MEMORY = struct.Struct(
    "<IIQ16x"
)  # versions 3 and 4: bytes 96-127, memory_mode, reserved, ring_size, reserved
_REQUIRED_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})
_HEX = frozenset("0123456789abcdef")


class WriterState(IntEnum):
    CREATING = 0
    LOADING = 1
    COMPLETE = 2
    FAILED = 3


class TensorState(IntEnum):
    PENDING = 0
    READY = 1
    FAILED = 2
    RELEASED = 3
    """Version 3: every consumer copied the tensor and the writer gave its pages back to the system."""


class MemoryMode(IntEnum):
    """What the writer does with a tensor's pages once every consumer copied it (SPEC.md, version 3)."""

    FULL = 0
    """Keep every page for the segment's life (layout versions 1 and 2)."""
    RELEASE = 1
    """Give a tensor's pages back once every registered consumer consumed it."""
    RING = 2
    """Never hold more than ``ring_size`` bytes of tensor data at once: the data lives in a ring of that size
    whose bytes newer tensors reuse once older ones are released (layout version 4)."""


class TensorFlags(IntFlag):
    NONE = 0
    VERIFIED = 1
    DECRYPTED = 2
    CRC32 = 4


def align(value: int, to: int = ALIGNMENT) -> int:
    """The smallest multiple of ``to`` at or above ``value``."""
    return -(-value // to) * to


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to place in a segment: what the writer knows before any byte arrives."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    sha256: str | None = None
    lead: int = 0
    """Bytes of scratch room the writer wants right before the slot, inside the padding readers ignore
    (the sidecar lands a tensorizer record's header there, so header and data arrive in one request)."""
    file: int | None = None
    """Which of the layout's ``files`` the tensor comes from; None when the model is one file."""

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Header:
    """The write-once part of a segment header (bytes 0-127)."""

    segment_length: int
    manifest_length: int
    manifest_crc32: int
    state_offset: int
    tensor_count: int
    data_offset: int
    data_length: int
    load_id: int
    created_ns: int
    manifest_offset: int = HEADER_LENGTH
    layout_version: int = LAYOUT_VERSION
    memory_mode: MemoryMode = MemoryMode.FULL
    ring_size: int = 0
    """Ring mode (version 4, or 3 from older writers): the bytes of the ring; 0 otherwise."""

    @property
    def ring(self) -> bool:
        """Whether the data region is a ring (version 4): offsets past it wrap around to its start."""
        return self.layout_version >= 4

    def pack(self) -> bytes:
        return _FIXED.pack(
            MAGIC,
            self.layout_version,
            HEADER_LENGTH,
            self.segment_length,
            self.manifest_offset,
            self.manifest_length,
            self.manifest_crc32,
            ALIGNMENT,
            self.state_offset,
            self.tensor_count,
            self.data_offset,
            self.data_length,
            self.load_id,
            self.created_ns,
            _MEMORY.pack(self.memory_mode, 0, self.ring_size) if self.layout_version >= 3 else bytes(32),
        )


@dataclass(frozen=True)
class Layout:
    """A complete plan for a segment: every region's place, every slot, and the manifest bytes."""

    slots: tuple[Slot, ...]
    metadata: Mapping[str, str]
    manifest: bytes
    state_offset: int
    data_offset: int
    data_length: int
    by_name: Mapping[str, int] = field(repr=False)
    files: tuple[str, ...] = ()
    """The model's weight files, for a segment of several (layout version 2)."""
    memory_mode: MemoryMode = MemoryMode.FULL
    """RELEASE makes the segment layout version 3, RING version 4 (both with a consumer table beside it)."""
    ring_size: int = 0
    """Ring mode: the bytes of the ring, the file's data region (a multiple of 4096)."""

    @property
    def layout_version(self) -> int:
        if self.memory_mode == MemoryMode.RING:
            return 4
        if self.memory_mode == MemoryMode.RELEASE:
            return 3
        return 2 if self.files else 1

    @property
    def segment_length(self) -> int:
        """The file's size: the data region after the tables, or in ring mode the ring instead."""
        if self.memory_mode == MemoryMode.RING:
            return self.data_offset + self.ring_size
        return self.data_offset + self.data_length

    def file_offset(self, offset: int) -> int:
        """Where the byte at segment offset ``offset`` (manifest arithmetic) lives in the file: the same
        offset, except in ring mode, where the data region wraps around the ring."""
        if self.memory_mode != MemoryMode.RING or offset < self.data_offset:
            return offset
        return self.data_offset + (offset - self.data_offset) % self.ring_size

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without padding)."""
        return sum(s.nbytes for s in self.slots)

    def header(self, *, load_id: int, created_ns: int) -> Header:
        return Header(
            segment_length=self.segment_length,
            manifest_length=len(self.manifest),
            manifest_crc32=zlib.crc32(self.manifest),
            state_offset=self.state_offset,
            tensor_count=len(self.slots),
            data_offset=self.data_offset,
            data_length=self.data_length,
            load_id=load_id,
            created_ns=created_ns,
            layout_version=self.layout_version,
            memory_mode=self.memory_mode,
            ring_size=self.ring_size,
        )


def plan_layout(
    tensors: Iterable[TensorSpec],
    *,
    metadata: Mapping[str, str] | None = None,
    files: Sequence[str] = (),
    memory_mode: MemoryMode = MemoryMode.FULL,
    ring_size: int = 0,
) -> Layout:
    """Place ``tensors`` in a segment, in the given order, each slot on a 4096-byte boundary.

    >>> from modelload.loader.dtypes import by_name
    >>> layout = plan_layout([TensorSpec("w", by_name("float32"), (2, 3))])
    >>> layout.slots[0].offset, layout.slots[0].nbytes, layout.segment_length
    (12288, 24, 16384)

    ``files`` names the weight files of a model of several (a directory's shards); every spec then says its
    ``file``, and the segment is written as layout version 2. Memory mode RELEASE makes it version 3, RING
    version 4; ``ring_size`` (ring mode only) is rounded up to a multiple of 4096.
    """
    if (memory_mode == MemoryMode.RING) != (ring_size > 0):
        raise SegmentLayoutError("a ring size is given exactly when the memory mode is ring")
    ring_size = align(ring_size)
    specs = list(tensors)
    meta = dict(metadata or {})
    files = tuple(files)
    _check_files(files, specs)
    if len(specs) > MAX_TENSORS:
        raise SegmentLayoutError(f"{len(specs)} tensors is more than a segment holds ({MAX_TENSORS})")
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SegmentLayoutError(f"segment metadata must map strings to strings, got {key!r}: {value!r}")
    by_name: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name in by_name:
            raise SegmentLayoutError(f"tensor name {spec.name!r} appears twice")
        if len(spec.shape) > MAX_NDIM or any(d < 0 for d in spec.shape):
            raise SegmentLayoutError(f"tensor {spec.name!r} has an invalid shape {spec.shape}")
        if spec.lead < 0:
            raise SegmentLayoutError(f"tensor {spec.name!r} asks for a negative lead {spec.lead}")
        if memory_mode == MemoryMode.RING and spec.nbytes > ring_size:
            raise SegmentLayoutError(
                f"tensor {spec.name!r}: {spec.nbytes} bytes do not fit in the ring of {ring_size}"
            )
        by_name[spec.name] = i

    # The manifest holds the slot offsets, which depend on where the data starts, which depends on the
    # manifest's length: plan with the offsets of a first guess, and re-plan until the length is stable.
    data_offset = align(HEADER_LENGTH + 1) + align(STATE_ENTRY_LENGTH * max(len(specs), 1))
    if specs:
        data_offset += align(specs[0].lead)
    while True:
        slots = _place(specs, data_offset)
        manifest = _encode_manifest(slots, meta, files)
        if len(manifest) > MAX_MANIFEST_LENGTH:
            raise SegmentLayoutError(f"manifest of {len(manifest)} bytes exceeds {MAX_MANIFEST_LENGTH}")
        state_offset = align(HEADER_LENGTH + len(manifest))
        needed = align(state_offset + STATE_ENTRY_LENGTH * len(specs)) + (
            align(specs[0].lead) if specs else 0
        )
        if needed == data_offset:
            break
        data_offset = needed
    data_end = max((align(s.offset + s.nbytes) for s in slots), default=data_offset)
    return Layout(
        slots=tuple(slots),
        metadata=meta,
        manifest=manifest,
        state_offset=state_offset,
        data_offset=data_offset,
        data_length=max(data_end - data_offset, 0),
        by_name=by_name,
        files=files,
        memory_mode=memory_mode,
        ring_size=ring_size,
    )


def _check_files(files: tuple[str, ...], specs: list[TensorSpec]) -> None:
    if len(files) > MAX_FILES or len(set(files)) != len(files) or not all(files):
        raise SegmentLayoutError(f"a segment's files must be at most {MAX_FILES} distinct non-empty names")
    for spec in specs:
        if files and (spec.file is None or not 0 <= spec.file < len(files)):
            raise SegmentLayoutError(f"tensor {spec.name!r} names no file of the {len(files)} given")
        if not files and spec.file is not None:
            raise SegmentLayoutError(f"tensor {spec.name!r} names a file, but the layout has no files")


def _place(specs: list[TensorSpec], data_offset: int) -> list[Slot]:
    slots = []
    end = data_offset - (align(specs[0].lead) if specs else 0)  # where the first slot's lead may begin
    for i, spec in enumerate(specs):
        offset = align(end + spec.lead)
        slots.append(
            Slot(i, spec.name, spec.dtype, tuple(spec.shape), offset, spec.nbytes, spec.sha256, spec.file)
        )
        end = offset + spec.nbytes
    return slots


def _encode_manifest(slots: Iterable[Slot], metadata: Mapping[str, str], files: tuple[str, ...]) -> bytes:
    tensors = []
    for s in slots:
        entry: dict[str, Any] = {
            "name": s.name,
            "dtype": s.dtype.name,
            "shape": list(s.shape),
            "offset": s.offset,
            "nbytes": s.nbytes,
        }
        if s.sha256 is not None:
            entry["sha256"] = s.sha256
        if s.file is not None:
            entry["file"] = s.file
        tensors.append(entry)
    document: dict[str, Any] = {"tensors": tensors, "metadata": dict(metadata)}
    if files:
        document["files"] = list(files)
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


# --- validation of what was read ----------------------------------------------------------------------------


def _fail(message: str) -> SegmentLayoutError:
    return SegmentLayoutError(f"{message}; the segment is corrupt or was not written by modelload")


def parse_header(buf: bytes | memoryview, *, file_size: int) -> Header:
    """Check the header's write-once bytes and geometry (reader rule 1) and return them.

    ``buf`` holds at least the first 4096 bytes. Nothing of the sizes the header declares is allocated.
    """
    if file_size < HEADER_LENGTH or len(buf) < HEADER_LENGTH:
        raise _fail(f"segment is {file_size} bytes, shorter than its {HEADER_LENGTH}-byte header (truncated)")
    (magic, version, header_length, segment_length, manifest_offset, manifest_length, manifest_crc32,
     alignment, state_offset, tensor_count, data_offset, data_length, load_id, created_ns,
     reserved) = _FIXED.unpack_from(buf, 0)  # fmt: skip
    if magic != MAGIC:
        raise SegmentLayoutError(
            f"not a modelload segment: first bytes are {bytes(magic).hex(' ')}, expected {MAGIC.hex(' ')}"
        )
    if version not in LAYOUT_VERSIONS:
        raise SegmentVersionError(
            f"segment layout version {version} is not known to this loader, which reads versions "
            f"{', '.join(map(str, LAYOUT_VERSIONS))}; install the modelload loader that matches the "
            "sidecar's version"
        )
    if header_length != HEADER_LENGTH:
        raise _fail(f"header length {header_length}, expected {HEADER_LENGTH}")
    if alignment != ALIGNMENT:
        raise _fail(f"alignment {alignment}, expected {ALIGNMENT}")
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
    if version >= 4:  # the data region is a ring: the file ends with it, whatever the model's size
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
    )


def _parse_memory(version: int, reserved: bytes) -> tuple[MemoryMode, int]:
    """Bytes 96-127: reserved (zero) before version 3; memory mode and ring size from version 3 on (version 4
    is always a ring)."""
    if version < 3:
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
    slots = tuple(_parse_slot(i, entry, header, len(files)) for i, entry in enumerate(entries))
    _check_disjoint(slots)
    return slots, metadata, files


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
    if offset % ALIGNMENT:
        raise _fail(f"{label}: offset {offset} is not a multiple of {ALIGNMENT}")
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
