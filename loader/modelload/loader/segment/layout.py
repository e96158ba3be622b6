"""The segment's byte layout (SPEC.md beside this file): planning a layout and validating one that was read.

This module is pure bytes: it plans where every region and tensor slot goes and packs the header and the
manifest. Checking a header and manifest read from a file is in ``validate``; reading and writing the file
itself is in ``reader`` and ``writer``.
"""

from __future__ import annotations

import array
import functools
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum, IntFlag
from typing import Any, TypeVar, cast

import numpy as np

from modelload.loader.dtypes import DType
from modelload.loader.errors import SegmentLayoutError
from modelload.loader.formats import has_repeats
from modelload.loader.segment.geometry import Ring
from modelload.loader.segment.kinds import Kinds
from modelload.loader.segment.manifest_bytes import ManifestLength, manifest_pieces
from modelload.loader.segment.placing import ALIGNMENT, PACKED_ALIGNMENT, align, place_slots
from modelload.loader.segment.slots import Same, Slot, SlotTable

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
    "PACKED_ALIGNMENT",
    "ENTRY_CRC32",
    "ENTRY_FLAGS",
    "ENTRY_READY_NS",
    "ENTRY_STATE",
    "STATE_ENTRY_LENGTH",
    "Header",
    "Layout",
    "MemoryMode",
    "Slot",
    "SlotTable",
    "TensorFlags",
    "TensorSpec",
    "TensorSpecs",
    "TensorState",
    "WriterState",
    "align",
    "entry_offset",
    "error_bytes",
    "plan_layout",
]

IntColumn = np.ndarray[Any, np.dtype[np.integer[Any]]]
_Step = TypeVar("_Step", int, np.ndarray[Any, np.dtype[np.int64]])

MAGIC = b"MODELSEG"
LAYOUT_VERSION = 5
"""The newest layout version. A segment of one weight file is written as version 1 (which older loaders
read); a segment of several files as version 2, which records each tensor's file; a segment whose pages the
writer gives back once consumed as version 3 (memory mode release) or 4 (memory mode ring, whose file holds
only a ring of data that tensors reuse); a segment of many small tensors, its slots packed as
its weight files hold them rather than on pages, as version 5. Older loaders refuse the versions they do not
know."""
LAYOUT_VERSIONS = (1, 2, 3, 4, 5)
MAX_FILES = 65536
MODEL_DIR_KEY = "model_dir"
"""The metadata key naming the model directory (an absolute path) the writer filled with the model's
small files (config, tokenizer) before publishing the segment."""
HEADER_LENGTH = 4096
STATE_ENTRY_LENGTH = 32
MAX_TENSORS = 1 << 20
MAX_MANIFEST_LENGTH = 64 << 20
MAX_NDIM = 64
ERROR_CAPACITY = 1024

# Field offsets in the header (SPEC.md, "Header").
_FIXED = struct.Struct("<8sIIQQQIIQQQQQQ32s")  # bytes 0-127, written once
OFF_LOAD_ID = 80
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


def error_bytes(reason: str) -> bytes:
    """``reason`` as the header's error field holds it: UTF-8, cut at a character boundary to
    :data:`ERROR_CAPACITY` bytes."""
    encoded = reason.encode("utf-8", errors="replace")
    if len(encoded) <= ERROR_CAPACITY:
        return encoded
    return encoded[:ERROR_CAPACITY].decode("utf-8", errors="ignore").encode()


def entry_offset(state_offset: int, index: int, field: int = ENTRY_STATE) -> int:
    """The absolute offset of ``field`` of tensor ``index``'s state entry."""
    return state_offset + STATE_ENTRY_LENGTH * index + field


_MEMORY = struct.Struct(
    "<IIQ16x"
)  # versions 3 and 4: bytes 96-127, memory_mode, reserved, ring_size, reserved


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


@dataclass(frozen=True, slots=True)
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
    alignment: int = ALIGNMENT
    """What every slot's offset is a multiple of: :data:`ALIGNMENT`; in version 5 :data:`PACKED_ALIGNMENT`,
    each slot then on a multiple of its element size."""

    @property
    def ring(self) -> bool:
        """Whether the data region is a ring (version 4): offsets past it wrap around to its start."""
        return self.layout_version == 4

    def slot_step(self, itemsize: _Step) -> _Step | int:
        """What the offset of a slot of ``itemsize``-byte elements is a multiple of: the alignment, or in a
        packed segment (version 5) the element's size (an int, or a column of them)."""
        return itemsize if self.alignment == PACKED_ALIGNMENT else self.alignment

    def pack(self) -> bytes:
        return _FIXED.pack(
            MAGIC,
            self.layout_version,
            HEADER_LENGTH,
            self.segment_length,
            self.manifest_offset,
            self.manifest_length,
            self.manifest_crc32,
            self.alignment,
            self.state_offset,
            self.tensor_count,
            self.data_offset,
            self.data_length,
            self.load_id,
            self.created_ns,
            _MEMORY.pack(self.memory_mode, 0, self.ring_size) if self.layout_version in (3, 4) else bytes(32),
        )


@dataclass(frozen=True)
class Layout:
    """A complete plan for a segment: every region's place, every slot, and the manifest's length.

    The manifest's bytes are made from the slots when asked for (:attr:`manifest`), or written straight into
    a segment (:meth:`write_manifest`): a segment of 100,000 tensors has a 14 MB manifest, which a writer
    need not hold in memory besides the segment.
    """

    slots: Sequence[Slot]
    """By tensor index: a :class:`SlotTable` (what is given is made one); :attr:`table` gives its columns."""
    metadata: Mapping[str, str]
    manifest_length: int
    state_offset: int
    data_offset: int
    data_length: int
    files: tuple[str, ...] = ()
    """The model's weight files, for a segment of several (layout version 2)."""
    memory_mode: MemoryMode = MemoryMode.FULL
    """RELEASE makes the segment layout version 3, RING version 4 (both with a consumer table beside it)."""
    ring_size: int = 0
    """Ring mode: the bytes of the ring, the file's data region (a multiple of ``page_size``)."""
    page_size: int = ALIGNMENT
    """The page size of the volume the segment is planned for (``segment.pages``): on huge pages (2 MiB or
    1 GiB) the data region and the ring start on a page boundary and the file is a whole number of pages
    (hugetlbfs takes no other size). Not recorded in the header: readers see it in the offsets and the file's
    size."""
    slot_alignment: int = ALIGNMENT
    """The header's alignment: :data:`ALIGNMENT`, every slot on a page; or :data:`PACKED_ALIGNMENT` in a
    packed segment (layout version 5, memory mode full only), every slot on a multiple of its element size."""

    def __post_init__(self) -> None:
        if not isinstance(self.slots, SlotTable):
            object.__setattr__(self, "slots", SlotTable.of(tuple(self.slots)))
        if self.slot_alignment != ALIGNMENT and self.memory_mode != MemoryMode.FULL:
            raise SegmentLayoutError("only a memory mode full segment is packed: release and ring free pages")

    @property
    def table(self) -> SlotTable:
        """The slots as columns: what code that reads every slot uses, rather than a :class:`Slot` each."""
        assert isinstance(self.slots, SlotTable)  # made one in __post_init__
        return self.slots

    @functools.cached_property
    def by_name(self) -> Mapping[str, int]:
        """Each tensor's index by its name: made on first use (a writer that fills slots by index never asks,
        and 100,000 names cost a 7 MiB dict)."""
        return dict(zip(self.table.names, range(len(self.table)), strict=True))

    @property
    def layout_version(self) -> int:
        if self.memory_mode == MemoryMode.RING:
            return 4
        if self.memory_mode == MemoryMode.RELEASE:
            return 3
        if self.slot_alignment != ALIGNMENT:
            return 5
        return 2 if self.files else 1

    @property
    def segment_length(self) -> int:
        """The file's size: the data region after the tables, or in ring mode the ring instead."""
        if self.memory_mode == MemoryMode.RING:
            return self.data_offset + self.ring_size
        return align(self.data_offset + self.data_length, self.page_size)

    @property
    def ring(self) -> Ring | None:
        """Ring mode: the data region's ring, where offsets past it wrap around; None in other modes."""
        return Ring(self.data_offset, self.ring_size) if self.memory_mode == MemoryMode.RING else None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without padding)."""
        return int(self.table.nbytes.sum())

    @functools.cached_property
    def manifest(self) -> bytes:
        """The manifest's bytes (SPEC.md, "Manifest")."""
        out = bytearray()
        for piece in manifest_pieces(self.table, self.metadata, self.files):
            out += piece
        return bytes(out)

    def write_manifest(self, view: memoryview) -> int:
        """Write the manifest into ``view`` (:attr:`manifest_length` bytes) a piece at a time; its CRC-32."""
        checksum, at = 0, 0
        for piece in manifest_pieces(self.table, self.metadata, self.files):
            view[at : at + len(piece)] = piece
            checksum = zlib.crc32(piece, checksum)
            at += len(piece)
        if at != self.manifest_length:
            raise SegmentLayoutError(f"the manifest took {at} bytes, its length says {self.manifest_length}")
        return checksum

    def header(self, *, load_id: int, created_ns: int, manifest_crc32: int | None = None) -> Header:
        """The header's write-once fields; ``manifest_crc32`` when the caller has it (else computed)."""
        return Header(
            segment_length=self.segment_length,
            manifest_length=self.manifest_length,
            manifest_crc32=zlib.crc32(self.manifest) if manifest_crc32 is None else manifest_crc32,
            state_offset=self.state_offset,
            tensor_count=len(self.slots),
            data_offset=self.data_offset,
            data_length=self.data_length,
            load_id=load_id,
            created_ns=created_ns,
            layout_version=self.layout_version,
            memory_mode=self.memory_mode,
            ring_size=self.ring_size,
            alignment=self.slot_alignment,
        )


@dataclass(frozen=True)
class TensorSpecs:
    """Tensors to place, as columns (one sequence per :class:`TensorSpec` field, all of one length): what
    :func:`plan_layout` takes for 100,000 tensors without an object for each.

    ``leads`` and ``files`` may be integer arrays (a model index's own columns): they are then checked and
    kept with numpy, not a Python int at a time."""

    names: Sequence[str]
    dtypes: Sequence[DType]
    shapes: Sequence[tuple[int, ...]]
    leads: Sequence[int] | IntColumn
    files: Sequence[int | None] | IntColumn
    sha256: Sequence[str | None]

    @classmethod
    def of(cls, specs: Iterable[TensorSpec]) -> TensorSpecs:
        listed = list(specs)
        return cls(
            names=[s.name for s in listed],
            dtypes=[s.dtype for s in listed],
            shapes=[tuple(s.shape) for s in listed],
            leads=[s.lead for s in listed],
            files=[s.file for s in listed],
            sha256=[s.sha256 for s in listed],
        )

    def __len__(self) -> int:
        return len(self.names)


def plan_layout(
    tensors: Iterable[TensorSpec] | TensorSpecs,
    *,
    metadata: Mapping[str, str] | None = None,
    files: Sequence[str] = (),
    memory_mode: MemoryMode = MemoryMode.FULL,
    ring_size: int = 0,
    page_size: int = ALIGNMENT,
    packed: bool | None = None,
) -> Layout:
    """Place ``tensors`` in a segment, in the given order, each slot on a 4096-byte boundary (or packed).

    >>> from modelload.loader.dtypes import by_name
    >>> layout = plan_layout([TensorSpec("w", by_name("float32"), (2, 3))])
    >>> layout.slots[0].offset, layout.slots[0].nbytes, layout.segment_length
    (12288, 24, 16384)

    ``files`` names the weight files of a model of several (a directory's shards); every spec then says its
    ``file``, and the segment is written as layout version 2. Memory mode RELEASE makes it version 3, RING
    version 4; ``ring_size`` (ring mode only) is rounded up to a multiple of 4096. Many tensors are best
    given as :class:`TensorSpecs` (columns); the rules are checked a column at a time either way.

    ``page_size``, the page size of the segment's volume (:func:`.pages.volume_of`), aligns more where it is
    larger than 4096 (huge pages): the data region and the ring start on a page boundary, the ring and the
    file are whole pages.

    >>> huge = plan_layout([TensorSpec("w", by_name("float32"), (2, 3))], page_size=2 << 20)
    >>> huge.slots[0].offset, huge.segment_length
    (2097152, 4194304)

    ``packed`` puts each slot right after the one before it, on the next multiple of its element's size,
    rather than on a page (layout version 5, memory mode full only: release and ring give pages back a
    tensor at a time): neighbouring tensors of a weight file are then as contiguous as in the file. None
    (the default) packs a full-mode segment when page-aligned slots would pad the model's bytes by more than
    :data:`PACKING_WASTE` (and :data:`PACKING_MIN`): thousands of small tensors, whose padding the writer
    would otherwise allocate and fill page by page.

    >>> small = [TensorSpec(f"w{i}", by_name("float16"), (2048 + i,)) for i in range(3)]
    >>> packed = plan_layout(small, packed=True)
    >>> [slot.offset - packed.data_offset for slot in packed.slots], packed.layout_version
    ([0, 4096, 8194], 5)
    """
    if (memory_mode == MemoryMode.RING) != (ring_size > 0):
        raise SegmentLayoutError("a ring size is given exactly when the memory mode is ring")
    if page_size < ALIGNMENT or page_size % ALIGNMENT:
        raise SegmentLayoutError(f"a page size must be a multiple of {ALIGNMENT}, got {page_size}")
    ring_size = align(ring_size, page_size)
    specs = tensors if isinstance(tensors, TensorSpecs) else TensorSpecs.of(tensors)
    count = len(specs)
    meta = dict(metadata or {})
    files = tuple(files)
    _check_files(files, specs)
    if count > MAX_TENSORS:
        raise SegmentLayoutError(f"{count} tensors is more than a segment holds ({MAX_TENSORS})")
    for key, value in meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise SegmentLayoutError(f"segment metadata must map strings to strings, got {key!r}: {value!r}")
    if has_repeats(specs.names):
        first = {name: i for i, name in reversed(list(enumerate(specs.names)))}
        twice = next(name for i, name in enumerate(specs.names) if first[name] != i)
        raise SegmentLayoutError(f"tensor name {twice!r} appears twice")
    kinds = Kinds(specs.dtypes, specs.shapes)
    _check_specs(specs, kinds, ring_size if memory_mode == MemoryMode.RING else None)
    sizes = np.asarray(kinds.nbytes, dtype=np.int64)[kinds.of]
    leads = np.asarray(specs.leads, dtype=np.int64)
    # Kept for the whole load: one value where every tensor has it (no hash, no file), files as int32.
    shas = Same(None, count) if specs.sha256.count(None) == count else specs.sha256
    numbers = _file_numbers(specs.files) if files else Same(None, count)

    # The manifest holds the slot offsets, which depend on where the data starts, which depends on the
    # manifest's length. The slots keep their distances whatever the start (every start is aligned), so the
    # length is arithmetic over the offsets' digit counts: find the stable start, then encode once.
    if packed is None and memory_mode != MemoryMode.FULL:
        packed = False  # release and ring free a tensor's pages: asked to pack, the Layout refuses
    relative, slot_alignment = place_slots(sizes, leads, kinds, packed=packed)
    lead = int(relative[0]) if count else 0
    columns = (specs.names, specs.dtypes, specs.shapes)
    manifest = ManifestLength(SlotTable(*columns, relative, sizes, shas, numbers, kinds=kinds), meta, files)
    data_offset = align(
        align(HEADER_LENGTH + 1) + align(STATE_ENTRY_LENGTH * max(count, 1)) + lead, page_size
    )
    while True:
        length = manifest.length(relative + (data_offset - lead))
        if length > MAX_MANIFEST_LENGTH:
            raise SegmentLayoutError(f"manifest of {length} bytes exceeds {MAX_MANIFEST_LENGTH}")
        state_offset = align(HEADER_LENGTH + length)
        needed = align(align(state_offset + STATE_ENTRY_LENGTH * count) + lead, page_size)
        if needed == data_offset:
            break
        data_offset = needed
    placed = relative + (data_offset - lead)
    slots = SlotTable(*columns, placed, sizes, shas, numbers, kinds=kinds)
    ends = placed + sizes
    data_end = align(int(ends.max())) if count else data_offset
    return Layout(
        slots=slots,
        metadata=meta,
        manifest_length=length,
        state_offset=state_offset,
        data_offset=data_offset,
        data_length=max(data_end - data_offset, 0),
        files=files,
        memory_mode=memory_mode,
        ring_size=ring_size,
        page_size=page_size,
        slot_alignment=slot_alignment,
    )


def _check_files(files: tuple[str, ...], specs: TensorSpecs) -> None:
    if len(files) > MAX_FILES or len(set(files)) != len(files) or not all(files):
        raise SegmentLayoutError(f"a segment's files must be at most {MAX_FILES} distinct non-empty names")
    numbers = specs.files
    if files:
        bad = _outside(numbers, len(files))
        if bad is not None:
            raise SegmentLayoutError(f"tensor {specs.names[bad]!r} names no file of the {len(files)} given")
    elif any(f is not None for f in numbers):
        bad = next(i for i, f in enumerate(numbers) if f is not None)
        raise SegmentLayoutError(f"tensor {specs.names[bad]!r} names a file, but the layout has no files")


def _outside(numbers: Sequence[int | None] | IntColumn, files: int) -> int | None:
    """The first tensor whose file number is not an int in ``range(files)``, or None."""
    if isinstance(numbers, np.ndarray):
        if numbers.dtype.kind in "iu":  # integers (an index's column): all at once
            outside = np.flatnonzero((numbers < 0) | (numbers >= files))
            return int(outside[0]) if len(outside) else None
        numbers = numbers.tolist()
    if set(numbers) <= set(range(files)) and not set(map(type, numbers)) - {int}:
        return None
    return next(i for i, f in enumerate(numbers) if type(f) is not int or not 0 <= f < files)


def _check_specs(specs: TensorSpecs, kinds: Kinds, ring_size: int | None) -> None:
    """Shapes, leads and (in ring mode) sizes, naming the first tensor that breaks one: shapes and sizes once
    per kind of tensor, leads a column at a time."""
    bad = kinds.first_tensor([len(shape) > MAX_NDIM or min(shape, default=0) < 0 for shape in kinds.shapes])
    if bad is not None:
        raise SegmentLayoutError(f"tensor {specs.names[bad]!r} has an invalid shape {specs.shapes[bad]}")
    leads = specs.leads
    if len(leads) and (int(leads.min()) if isinstance(leads, np.ndarray) else min(leads)) < 0:
        bad = next(i for i, lead in enumerate(specs.leads) if lead < 0)
        raise SegmentLayoutError(f"tensor {specs.names[bad]!r} asks for a negative lead {specs.leads[bad]}")
    if ring_size is not None:
        bad = kinds.first_tensor([size > ring_size for size in kinds.nbytes])
        if bad is not None:
            raise SegmentLayoutError(
                f"tensor {specs.names[bad]!r}: {kinds.nbytes[kinds.of[bad]]} bytes do not fit in the ring of"
                f" {ring_size}"
            )


def _file_numbers(column: Sequence[int | None] | IntColumn) -> array.array[int]:
    """Each tensor's file number as an int32 (C int) column, which the layout keeps for the whole load."""
    if isinstance(column, np.ndarray):
        return array.array("i", column.astype(np.intc).tobytes())
    return array.array("i", cast("Sequence[int]", column))
