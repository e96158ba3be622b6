"""The file prologue: magic, data version, feature flags, counts, and the length of the metadata block.

The first 73 bytes of every tensorizer file (docs/tensorizer-format.md, "Prologue") say which data version
wrote it, whether its tensors
carry encryption parameters, how many index entries to parse and how long the metadata block is. Nothing
else in the file can be read before these are checked, so this module refuses early and cheaply: a bad
magic, a version outside 1-5, a flag this build does not know, a metadata block above a sane cap, or a
tensor count that the block could not possibly hold (checked before the block is read or allocated).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from modelload.loader.errors import (
    BadMagicError,
    BoundsError,
    HeaderError,
    TruncatedError,
    UnsupportedVersionError,
)

__all__ = [
    "DEFAULT_METADATA_SIZE",
    "FLAG_ENCRYPTED",
    "FLAG_VERSIONED_HEADERS",
    "MAGIC",
    "MAX_METADATA_SIZE",
    "PROLOGUE_SIZE",
    "SUPPORTED_VERSIONS",
    "VERSION_ENCRYPTED",
    "VERSION_LONG_DIMS",
    "VERSION_META",
    "VERSION_OPAQUE",
    "VERSION_PLAIN",
    "FileHeader",
    "min_entry_size",
    "parse_file_header",
]

MAGIC = b"|TZR|"

VERSION_PLAIN = 1
"""Numpy dtypes only."""
VERSION_OPAQUE = 2
"""Some tensor has a dtype numpy lacks (bfloat16, float8, complex32, ...)."""
VERSION_ENCRYPTED = 3
"""Written with encryption: every tensor header carries a crypt_info block."""
VERSION_META = 4
"""Some tensor is a meta tensor (no data); the feature flags become meaningful."""
VERSION_LONG_DIMS = 5
"""Some dimension is >= 2**32 (tensorizer 2.12): index entries carry a version tag."""
SUPPORTED_VERSIONS = range(VERSION_PLAIN, VERSION_LONG_DIMS + 1)

FLAG_ENCRYPTED = 1 << 0
FLAG_VERSIONED_HEADERS = 1 << 1
_KNOWN_FLAGS = FLAG_ENCRYPTED | FLAG_VERSIONED_HEADERS

DEFAULT_METADATA_SIZE = 256 * 1024
"""What tensorizer always reserves for the index, and our writer's default."""
MAX_METADATA_SIZE = 64 * 1024 * 1024
"""Readers refuse a larger metadata block before reading it: 256x the default, ~1M tensors of typical
names; anything beyond is a corrupt or hostile length, not a model."""

_BODY = struct.Struct("<I32sQ8xQQ")  # version, flags, tensor_size, unused, tensor_count, metadata_len
PROLOGUE_SIZE = len(MAGIC) + _BODY.size
"""73: the bytes before the metadata block (magic through metadata_len)."""


def min_entry_size(*, versioned: bool) -> int:
    """The smallest possible index entry: a 1-byte name and dtype, no dimensions, three u64 locations.

    Used to refuse a tensor_count the metadata block cannot hold, before parsing anything.
    """
    return (4 if versioned else 0) + 2 + 1 + 1 + 1 + 1 + 1 + 3 * 8


@dataclass(frozen=True)
class FileHeader:
    """The decoded prologue of a tensorizer file."""

    version: int
    flags: int
    """The 256-bit feature flags (meaningful from version 4; zero before)."""
    tensor_size: int
    """Sum of tensor data bytes as the writer counted them; informational, readers ignore it."""
    tensor_count: int
    metadata_len: int

    @property
    def has_crypt_info(self) -> bool:
        """Whether every tensor header carries a crypt_info block (docs/tensorizer-format.md, "Data versions
        and feature flags")."""
        return self.version == VERSION_ENCRYPTED or (
            self.version >= VERSION_META and bool(self.flags & FLAG_ENCRYPTED)
        )

    @property
    def versioned_headers(self) -> bool:
        """Whether every index entry starts with a u32 metadata version tag (docs/tensorizer-format.md,
        "Index")."""
        return bool(self.flags & FLAG_VERSIONED_HEADERS)

    @property
    def index_length(self) -> int:
        """Bytes from the start of the file through the end of the metadata block."""
        return PROLOGUE_SIZE + self.metadata_len

    def pack(self) -> bytes:
        """The 73 prologue bytes. Flags are written as zero below version 4, as tensorizer does."""
        flags = self.flags if self.version >= VERSION_META else 0
        return MAGIC + _BODY.pack(
            self.version, flags.to_bytes(32, "little"), self.tensor_size, self.tensor_count, self.metadata_len
        )


def parse_file_header(buf: bytes | memoryview, *, source: str | None = None) -> FileHeader:
    """Decode and check the first 73 bytes of a file (more may be given; they are ignored)."""
    view = memoryview(buf)
    magic = bytes(view[: len(MAGIC)])
    if not view:
        raise TruncatedError(
            "the file is empty; expected a tensorizer file (an interrupted upload?)", source=source
        )
    if magic != MAGIC:
        if len(magic) < len(MAGIC) and MAGIC.startswith(magic):
            raise TruncatedError(f"the file ends after {len(view)} bytes, inside the magic", source=source)
        raise BadMagicError(
            f"not a tensorizer file: it starts with {magic!r}, not {MAGIC!r}; check the file and the "
            "--format",
            source=source,
        )
    if len(view) < PROLOGUE_SIZE:
        raise TruncatedError(
            f"the file ends after {len(view)} bytes, inside the {PROLOGUE_SIZE}-byte file header; "
            "re-upload or re-create it",
            source=source,
        )
    version, flag_bytes, tensor_size, tensor_count, metadata_len = _BODY.unpack_from(view, len(MAGIC))
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersionError(
            f"tensorizer data version {version}; this build reads versions 1-5 (tensorizer up to 2.12). "
            "A newer writer (or the unreleased 3.0 layout) made this file: re-serialize it with tensorizer "
            "2.12 or upgrade modelload",
            source=source,
        )
    flags = int.from_bytes(flag_bytes, "little")
    _check_flags(version, flags, source)
    if metadata_len > MAX_METADATA_SIZE:
        raise BoundsError(
            f"the metadata block claims {metadata_len} bytes, above the cap of {MAX_METADATA_SIZE} "
            "(about a million tensors); the header is corrupt",
            source=source,
        )
    header = FileHeader(version, flags, tensor_size, tensor_count, metadata_len)
    smallest = min_entry_size(versioned=header.versioned_headers)
    if tensor_count > metadata_len // smallest:
        raise BoundsError(
            f"the header claims {tensor_count} tensors but a metadata block of {metadata_len} bytes holds at "
            f"most {metadata_len // smallest} entries; the header is corrupt",
            source=source,
        )
    return header


def _check_flags(version: int, flags: int, source: str | None) -> None:
    if version < VERSION_META and flags:
        raise HeaderError(
            f"feature flags {flags:#x} are set in a data version {version} file, where writers leave them "
            "zero; the header is corrupt",
            source=source,
        )
    unknown = flags & ~_KNOWN_FLAGS
    if unknown:
        raise UnsupportedVersionError(
            f"unknown feature flags {unknown:#x} (known: encrypted=0x1, versioned_headers=0x2); a newer "
            "tensorizer wrote this file: upgrade modelload or re-serialize with tensorizer 2.12",
            source=source,
        )
    if flags & FLAG_VERSIONED_HEADERS and version < VERSION_LONG_DIMS:
        raise HeaderError(
            f"the versioned_headers flag needs data version 5, and this file is version {version}; "
            "the header is corrupt",
            source=source,
        )
