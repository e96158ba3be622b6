"""The per-tensor header that precedes each tensor's data (docs/tensorizer-format.md, "Records and tensor
headers"), parsed and built.

A record is ``[header][data]``. The header repeats the index entry's name, dtype and shape and adds what the
index lacks: the module index, the hashes, the crypt_info block, and the data length. A reader that fetched a
record by the index's offsets parses the header with the index entry at hand: a header that disagrees with
its entry is a lying header (HeaderError), because a reader that trusted either one would place or
interpret bytes differently from a reader that trusted the other.

Two facts the header does not state are taken from outside it: the dimension width (u64 dimensions for data
version 5 "long" tensors, which the index marks) and whether a crypt_info block is present. The second is
read from the lengths: after the hash section, exactly 8 bytes remain when there is no crypt_info.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Literal

from modelload.loader import dtypes
from modelload.loader.dtypes import DType
from modelload.loader.errors import HeaderError, SizeMismatchError, TruncatedError, UnsupportedDtypeError
from modelload.loader.formats._index import MAX_NDIM, TensorEntry
from modelload.loader.formats.tensorizer._cursor import Cursor
from modelload.loader.formats.tensorizer.crypt_info import CryptInfo, parse_crypt_info
from modelload.loader.formats.tensorizer.names import Path, PathError, decode_name

__all__ = [
    "HASH_CRC32",
    "HASH_SHA256",
    "KINDS",
    "LONG_DIM",
    "HeaderLayout",
    "Kind",
    "TensorHash",
    "TensorHeader",
    "build_tensor_header",
    "decode_dtype",
    "parse_tensor_header",
]

Kind = Literal["param", "buffer", "state_dict"]
KINDS: tuple[Kind, ...] = ("param", "buffer", "state_dict")
"""tensorizer's TensorType values 0, 1, 2, in order."""

HASH_CRC32 = 0
HASH_SHA256 = 1
_HASH_LENGTHS = {HASH_CRC32: 4, HASH_SHA256: 32}
LONG_DIM = 1 << 32
"""Dimensions at or above this need u64 fields (data version 5)."""

_START = struct.Struct("<QHBH")  # header size, module index, tensor type, name length
_I64 = struct.Struct("<q")
_FIXED = _START.size + 1 + 1 + 2 + 1 + 8  # + dtype len, ndim, hash section len, hash count, data length


@dataclass(frozen=True)
class TensorHash:
    """One stored hash: ``kind`` 0 = CRC32 (4 bytes, little-endian u32), 1 = SHA-256 (32 bytes)."""

    kind: int
    value: bytes

    @property
    def label(self) -> str:
        return {HASH_CRC32: "CRC32", HASH_SHA256: "SHA-256"}[self.kind]


@dataclass(frozen=True)
class TensorHeader:
    """A parsed per-tensor header.

    ``hashable`` is what the hashes cover before the data: the header bytes with every hash value zeroed
    and the crypt_info block cut out (docs/tensorizer-format.md, "Hashes"). It is computed once here, so
    verifying streams only data.
    """

    size: int
    """Header bytes; the data starts ``size`` bytes after the header's first byte."""
    module_idx: int
    kind: Kind
    name: str
    path: Path | None
    dtype: DType
    shape: tuple[int, ...]
    hashes: tuple[TensorHash, ...]
    crypt: CryptInfo | None
    """The crypt_info block, or None when the header has none (an unencrypted file)."""
    data_length: int
    hashable: bytes = field(repr=False)

    @property
    def encrypted(self) -> bool:
        """Whether the data is ciphertext (a crypt_info block with an encryption chunk)."""
        return self.crypt is not None and self.crypt.cipher is not None

    @property
    def nbytes(self) -> int:
        return self.dtype.nbytes(self.shape)

    @property
    def is_meta(self) -> bool:
        return self.data_length == 0 and self.nbytes > 0


def decode_dtype(raw: bytes | memoryview, *, what: str, source: str | None) -> DType:
    """The dtype of a stored dtype string; undecodable or unknown strings raise UnsupportedDtypeError."""
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise HeaderError(f"{what}: the dtype string {bytes(raw)!r} is not UTF-8", source=source) from None
    try:
        return dtypes.from_tensorizer(text)
    except UnsupportedDtypeError as exc:
        raise UnsupportedDtypeError(f"{what}: {exc}", source=source) from None
    except (TypeError, ValueError, SyntaxError):
        raise UnsupportedDtypeError(f"{what}: {text!r} is not a dtype string", source=source) from None


def parse_tensor_header(
    buf: bytes | bytearray | memoryview,
    *,
    entry: TensorEntry | None = None,
    encrypted_file: bool | None = None,
    long_dims: bool | None = None,
    source: str | None = None,
) -> TensorHeader:
    """Parse the header at the start of ``buf`` (which may continue with the data) and check it.

    ``long_dims`` says whether dimensions are u64; by default it follows ``entry`` (an entry with a dimension
    >= 2**32 is a long tensor; the index reader refuses any other use of the long form), else u32. With
    ``entry``, every field the two share must agree, and so must the header's size with the entry's offsets.
    ``encrypted_file`` (the index's ``encrypted``), when given, says whether a crypt_info block must be
    present.
    """
    what = f"tensor header of {entry.name!r}" if entry is not None else "tensor header"
    view = _sized_view(buf, what=what, source=source)
    size = len(view)
    if long_dims is None:
        long_dims = entry is not None and any(d >= LONG_DIM for d in entry.shape)
    cur = Cursor(view, what=what, source=source, start=8, end=size - 8)
    module_idx = cur.u16("module index")
    kind_code = cur.u8("tensor type")
    if kind_code >= len(KINDS):
        raise HeaderError(
            f"{what}: tensor type {kind_code} is not 0 (param), 1 (buffer) or 2 (state_dict)", source=source
        )
    try:
        name, path = decode_name(cur.take(cur.u16("name length"), "name"))
    except PathError as exc:
        raise HeaderError(f"{what}: {exc}; re-create the file", source=source) from None
    dtype = decode_dtype(cur.take(cur.u8("dtype length"), "dtype"), what=what, source=source)
    ndim = cur.u8("ndim")
    if ndim > MAX_NDIM:
        raise HeaderError(
            f"{what}: {ndim} dimensions, more than the {MAX_NDIM} any reader holds", source=source
        )
    shape = cur.dims(ndim, wide=long_dims, field="dimensions")
    hashes, value_spans = _parse_hashes(cur, cur.u16("hash section length"), what=what, source=source)
    crypt_start = cur.pos
    (data_length,) = _I64.unpack_from(view, size - 8)
    if data_length < 0:
        raise HeaderError(
            f"{what}: negative data length {data_length} (reserved for compression, which no reader "
            "supports)",
            source=source,
        )
    crypt = None
    if cur.remaining:
        crypt = parse_crypt_info(
            view[crypt_start : size - 8], data_length=data_length, what=what, source=source
        )
    hashable = bytearray(view[:crypt_start])
    for start, end in value_spans:
        hashable[start:end] = bytes(end - start)
    hashable += view[size - 8 :]
    header = TensorHeader(
        size=size,
        module_idx=module_idx,
        kind=KINDS[kind_code],
        name=name,
        path=path,
        dtype=dtype,
        shape=shape,
        hashes=hashes,
        crypt=crypt,
        data_length=data_length,
        hashable=bytes(hashable),
    )
    _check_consistency(header, entry, encrypted_file, what=what, source=source)
    return header


def _sized_view(buf: bytes | bytearray | memoryview, *, what: str, source: str | None) -> memoryview:
    """The header's bytes, exactly as many as its size field says (the buffer may hold more)."""
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if len(view) < 8:
        raise TruncatedError(f"{what}: {len(view)} bytes, less than the 8-byte size field", source=source)
    size = int.from_bytes(view[:8], "little")
    if size == 0:
        raise HeaderError(
            f"{what}: found the end-of-file marker where a tensor header should be", source=source
        )
    if size > len(view):
        raise TruncatedError(
            f"{what}: says it is {size} bytes but only {len(view)} were given", source=source
        )
    if size < _FIXED:
        raise HeaderError(
            f"{what}: a size of {size} bytes is below the smallest possible {_FIXED}", source=source
        )
    return view[:size]


def _check_consistency(
    header: TensorHeader,
    entry: TensorEntry | None,
    encrypted_file: bool | None,
    *,
    what: str,
    source: str | None,
) -> None:
    if header.data_length not in (header.nbytes, 0):
        raise SizeMismatchError(
            f"{what}: {header.data_length} data bytes for {header.dtype.name}{list(header.shape)}, "
            f"which takes {header.nbytes}",
            source=source,
        )
    if encrypted_file is not None and (header.crypt is not None) != encrypted_file:
        state = "encrypted" if encrypted_file else "not encrypted"
        raise HeaderError(
            f"{what}: the file is {state} but this header {'lacks' if encrypted_file else 'has'} a "
            "crypt_info block; the file is corrupt",
            source=source,
        )
    if entry is not None:
        _check_against_entry(header, entry, what=what, source=source)


def _parse_hashes(
    cur: Cursor, section: int, *, what: str, source: str | None
) -> tuple[tuple[TensorHash, ...], list[tuple[int, int]]]:
    """The hashes of a section of ``section`` bytes at the cursor, and where their values lie."""
    cur.need(section, "hash section")
    sub = Cursor(cur.buffer, what=f"{what} hash section", source=source, start=cur.pos, end=cur.pos + section)
    cur.pos += section
    hashes: list[TensorHash] = []
    spans: list[tuple[int, int]] = []
    count = sub.u8("hash count")
    for index in range(count):
        kind = sub.u8(f"type of hash {index}")
        length = sub.u8(f"length of hash {index}")
        if _HASH_LENGTHS.get(kind) != length:
            raise HeaderError(
                f"{what}: hash {index} has type {kind} and length {length}; known are CRC32 (type 0, "
                "4 bytes) and SHA-256 (type 1, 32 bytes)",
                source=source,
            )
        spans.append((sub.pos, sub.pos + length))
        hashes.append(TensorHash(kind, bytes(sub.take(length, f"value of hash {index}"))))
    if sub.remaining:
        raise HeaderError(
            f"{what}: the hash section says {section} bytes but its {count} hashes leave "
            f"{sub.remaining} over",
            source=source,
        )
    return tuple(hashes), spans


def _check_against_entry(header: TensorHeader, entry: TensorEntry, *, what: str, source: str | None) -> None:
    expected_size = entry.header_length
    pairs = (
        ("header size", header.size, expected_size),
        ("name", header.name, entry.name),
        ("structured path", header.path, entry.path),
        ("tensor type", header.kind, entry.kind),
        ("dtype", header.dtype.name, entry.dtype.name),
        ("shape", header.shape, entry.shape),
        ("data length", header.data_length, entry.data_length),
        ("encryption", header.encrypted, entry.encrypted),
    )
    for label, got, want in pairs:
        if got != want:
            raise HeaderError(
                f"{what}: the header says {label} {got!r} but the index says {want!r}; the header lies about "
                "its tensor, so the file is corrupt or was edited: re-create it",
                source=source,
            )


@dataclass
class HeaderLayout:
    """A header built for writing, with the offsets where hashes and the crypt_info block go."""

    buffer: bytearray
    hash_offsets: dict[int, int]
    """Hash type -> offset of its value in ``buffer``."""
    crypt_start: int
    crypt_end: int

    def hashable_parts(self) -> tuple[memoryview, memoryview]:
        """The bytes the hashes cover, while the hash values are still zero: around the crypt_info block."""
        view = memoryview(self.buffer)
        return view[: self.crypt_start], view[self.crypt_end :]

    def set_hash(self, kind: int, value: bytes) -> None:
        at = self.hash_offsets[kind]
        self.buffer[at : at + len(value)] = value

    def set_crypt_info(self, block: bytes) -> None:
        if len(block) != self.crypt_end - self.crypt_start:
            raise AssertionError("crypt_info changed size after the header was laid out")
        self.buffer[self.crypt_start : self.crypt_end] = block


def build_tensor_header(
    *,
    module_idx: int,
    kind: Kind,
    name: bytes,
    dtype: bytes,
    shape: tuple[int, ...],
    long_dims: bool,
    hash_kinds: tuple[int, ...],
    crypt: CryptInfo | None,
    data_length: int,
) -> HeaderLayout:
    """Lay out a header with zeroed hash values (filled in later with :meth:`HeaderLayout.set_hash`)."""
    dims = struct.pack(f"<{len(shape)}{'Q' if long_dims else 'I'}", *shape)
    section = 1 + sum(2 + _HASH_LENGTHS[k] for k in hash_kinds)
    crypt_block = crypt.pack() if crypt is not None else b""
    size = _START.size + len(name) + 1 + len(dtype) + 1 + len(dims) + 2 + section + len(crypt_block) + 8
    buf = bytearray()
    buf += _START.pack(size, module_idx, KINDS.index(kind), len(name)) + name
    buf += bytes((len(dtype),)) + dtype + bytes((len(shape),)) + dims
    buf += struct.pack("<HB", section, len(hash_kinds))
    offsets: dict[int, int] = {}
    for k in hash_kinds:
        buf += bytes((k, _HASH_LENGTHS[k]))
        offsets[k] = len(buf)
        buf += bytes(_HASH_LENGTHS[k])
    crypt_start = len(buf)
    buf += crypt_block
    crypt_end = len(buf)
    buf += _I64.pack(data_length)
    assert len(buf) == size
    return HeaderLayout(buf, offsets, crypt_start, crypt_end)
