"""Which format a model file is in, from its first bytes, and reading its index with one first request.

A tensorizer file starts with the magic ``|TZR|``. A safetensors file has no magic: it starts with the
header's size (a u64 that a real header keeps small) followed by the header's ``{``. Both checks read the
first nine bytes, so detection costs nothing beyond the read a format reader makes anyway.

:func:`read_index` reads a prefix once, keeps it in a :class:`PrefixedRead` that answers later reads inside
the prefix from memory, detects the format and hands that reader to the format's own ``read_index``. Remote
sources pay per request: a model whose index fits in the prefix costs one request in all.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Literal

from modelload.loader.errors import BadMagicError, ConfigError, TruncatedError
from modelload.loader.formats import safetensors
from modelload.loader.formats._index import FormatName, ModelIndex, RangeRead

__all__ = ["PREFIX_LENGTH", "TENSORIZER_MAGIC", "PrefixedRead", "detect_format", "read_index"]

TENSORIZER_MAGIC = b"|TZR|"
PREFIX_LENGTH = 512 * 1024
"""Bytes read first. It covers the tensorizer reader's first read (a prologue and the 256 KiB metadata block
tensorizer reserves by default) and safetensors headers of up to a few thousand tensors, so either format
usually costs one request. Against per-request billing and a first-byte latency of tens of milliseconds,
the extra bytes cost little."""

_FORMATS = ("auto", "tensorizer", "safetensors")
_EXPECTED = (
    "expected a tensorizer file (starting with '|TZR|') or a safetensors file (an 8-byte little-endian "
    "header size, then '{')"
)
# What the first bytes of a file that is not a model often are, and what to do about it.
_LOOKALIKES = (
    (b"version https://git-lfs", "a Git LFS pointer, not the weights: fetch the LFS object (git lfs pull)"),
    (b"PK\x03\x04", "a zip archive, perhaps a PyTorch .pt/.bin checkpoint: convert it to safetensors"),
    (b"\x80\x02", "a Python pickle, perhaps a PyTorch checkpoint: convert it to safetensors"),
    (b"\x1f\x8b", "gzip-compressed: decompress it first"),
    (b"GGUF", "a GGUF file, a format modelload does not read"),
    (b"<", "HTML or XML, perhaps an error page from the server: check the URL and credentials"),
)


def detect_format(prefix: bytes | memoryview) -> FormatName:
    """The format of a file from its first bytes (at least 9 of them for a safetensors file).

    >>> detect_format(b"|TZR|\\x05\\x00\\x00\\x00")
    'tensorizer'
    >>> detect_format(b"\\x40\\x00\\x00\\x00\\x00\\x00\\x00\\x00{")
    'safetensors'
    """
    head = bytes(prefix[:32])
    if head.startswith(TENSORIZER_MAGIC):
        return "tensorizer"
    if len(head) >= 9 and head[8] == 0x7B:
        (size,) = struct.unpack_from("<Q", head)
        if 2 <= size <= safetensors.HEADER_SIZE_CAP:
            return "safetensors"
    raise BadMagicError(_describe(head, len(prefix)))


def _describe(head: bytes, length: int) -> str:
    if length == 0:
        return f"the file is empty; {_EXPECTED}"
    # The bytes themselves are never shown: the message reaches logs and a ModelLoad's status, and a file
    # that is not a model may be anything (a secret the source was pointed at); what they look like is said.
    text = f"{_EXPECTED}; its first bytes are neither"
    if length < 9:
        text = f"the file is only {length} bytes; {text}"
    for start, meaning in _LOOKALIKES:
        if head.startswith(start):
            return f"{text}, which looks like {meaning}"
    return text


class PrefixedRead:
    """A :data:`RangeRead` that answers from a prefix of the file read once, and asks the source only for
    bytes past it.

    When the prefix came back shorter than asked for, the file ends there: reads past it return nothing
    without asking the source, and :attr:`size` is the file's size.
    """

    def __init__(self, read: RangeRead, prefix: bytes, *, complete: bool) -> None:
        """``prefix`` is the file's first bytes; ``complete`` says they are the whole file."""
        self._read = read
        self.prefix = prefix
        self.size: int | None = len(prefix) if complete else None

    def __call__(self, offset: int, length: int) -> bytes:
        end = offset + length
        cached = len(self.prefix)
        if end <= cached or (self.size is not None and offset < cached):
            return self.prefix[offset:end]
        if offset >= cached:
            return b"" if self.size is not None else self._read(offset, length)
        return b"".join((memoryview(self.prefix)[offset:], self._read(cached, end - cached)))


def read_index(
    read: RangeRead,
    *,
    format: Literal["auto", "tensorizer", "safetensors"] = "auto",  # noqa: A002 - the CLI's word for it
    source: str | None = None,
    size: int | None = None,
    file: int = 0,
    shapes: dict[tuple[int, ...], tuple[int, ...]] | None = None,
    first_read: int = PREFIX_LENGTH,
) -> ModelIndex:
    """Read the index of a model file of either format through ``read(offset, length)``.

    ``format`` names the format or asks to detect it. ``source`` names the file in error messages. ``size``
    is the file's size when the caller knows it (a ``Content-Length``); then the index is also checked
    against it, so a truncated file fails here rather than after the load starts. ``file`` is the file's
    number among a model's weight files, recorded in each entry (:attr:`TensorEntry.file`). ``shapes`` is a
    dictionary the files of one model share, so that equal shapes are one tuple (safetensors files).
    ``first_read``: how many bytes the first read asks for (an index longer than that costs more reads).
    """
    if format not in _FORMATS:
        raise ConfigError(f"unknown model format {format!r}; use one of {', '.join(_FORMATS)}")
    wanted = first_read if size is None else min(first_read, size)
    prefix = read(0, wanted)
    cached = PrefixedRead(read, prefix, complete=len(prefix) < wanted or len(prefix) == size)
    try:
        found: FormatName | None = detect_format(prefix)
    except BadMagicError as exc:
        if format == "auto":
            raise BadMagicError(str(exc), source=source) from None
        found = None  # the named format's own reader says precisely what is wrong
    if format != "auto" and found is not None and found != format:
        raise BadMagicError(
            f"the file was named a {format} file but is a {found} file; set the format to {found} or auto",
            source=source,
        )
    known = size if size is not None else cached.size
    if (found or format) == "safetensors":
        return safetensors.read_index(cached, source=source, size=known, file=file, shapes=shapes)
    # Imported here: the tensorizer reader is the larger module (and pulls in its crypto), and a
    # safetensors-only caller never needs it.
    from modelload.loader.formats import tensorizer

    index = tensorizer.read_index(cached, source=source, size=known)
    if file:
        index = replace(index, tensors=index.table.in_file(file))
    if known is not None and index.data_end > known:
        raise TruncatedError(
            f"the file is {known} bytes, but its index places data up to byte {index.data_end}; the file was "
            "cut short (an interrupted upload or download): fetch or upload it again",
            source=source,
        )
    return index
