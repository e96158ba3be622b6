"""The files of an uncompressed tar layer, found with a few small range reads: no download, no unpacking.

A tar is a sequence of 512-byte headers, each followed by its file's bytes padded to 512. Reading one header
says where the file's bytes start and how long they are, and where the next header is; a layer of N files
costs N small reads (2N where a PAX or GNU long-name record precedes a header). The file's bytes are then read
by range at their offset in the blob, like any other file.

Regular files are listed (ustar, GNU and PAX, with PAX ``path`` and ``size`` overrides and GNU long names);
directories are skipped; links, devices and anything else are refused (a model directory holds files).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from modelload.loader.errors import FormatError

__all__ = ["TarMember", "tar_members", "looks_like_tar"]

BLOCK = 512
MAX_MEMBERS = 100_000
_EXTENDED_MAX = 1 << 20


@dataclass(frozen=True)
class TarMember:
    """One regular file of a tar: its path, where its bytes start in the tar, and how many there are."""

    name: str
    offset: int
    size: int


def _octal(field: bytes, *, where: str) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for sizes over 8 GiB
        value = int.from_bytes(field[1:], "big")
        return value
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise FormatError(f"a tar header field is not octal: {text[:16]!r}", source=where) from None


def _valid(header: bytes, *, where: str) -> bool:
    stored = _octal(header[148:156], where=where)
    computed = sum(header[:148]) + 8 * 32 + sum(header[156:])
    return stored == computed


def looks_like_tar(first_block: bytes) -> bool:
    """Whether a blob's first 512 bytes are a tar header (a valid checksum): a sniff for oras's mislabelled
    plain files."""
    if len(first_block) < BLOCK or not any(first_block):
        return False
    try:
        return _valid(first_block[:BLOCK], where="")
    except FormatError:
        return False


def _pax(data: bytes, *, where: str) -> dict[str, str]:
    """PAX records: ``"<len> <key>=<value>\\n"`` each."""
    found: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        try:
            length = int(data[pos:space])
        except ValueError:
            raise FormatError("a PAX record has no length", source=where) from None
        if length <= 0 or pos + length > len(data):
            raise FormatError("a PAX record runs past its header's data", source=where)
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        found[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        pos += length
    return found


def _clean(name: str, *, where: str) -> str:
    name = name.lstrip("/")
    while name.startswith("./"):
        name = name[2:]
    parts = [part for part in name.split("/") if part]
    if any(part in (".", "..") for part in parts):
        raise FormatError(f"the tar holds a path with '.' or '..': {name!r}", source=where)
    return "/".join(parts)


def tar_members(read: Callable[[int, int], bytes], size: int, *, where: str) -> list[TarMember]:
    """Every regular file of the tar of ``size`` bytes that ``read(offset, length)`` reads."""
    members: list[TarMember] = []
    pos = 0
    pending: dict[str, str] = {}
    while pos + BLOCK <= size:
        header = read(pos, BLOCK)
        if not any(header):
            break  # the end-of-archive blocks
        if not _valid(header, where=where):
            raise FormatError(f"the tar header at offset {pos} has a wrong checksum: not a tar", source=where)
        length = _octal(header[124:136], where=where)
        kind = header[156:157]
        data_at = pos + BLOCK
        if data_at + length > size:
            raise FormatError(f"the tar entry at offset {pos} runs past the layer's end", source=where)
        if kind in (b"x", b"L"):
            if length > _EXTENDED_MAX:
                raise FormatError(f"an extended tar header of {length} bytes", source=where)
            data = read(data_at, length)
            if kind == b"x":
                pending.update(_pax(data, where=where))
            else:
                pending["path"] = data.split(b"\0", 1)[0].decode("utf-8", "replace")
        elif kind in (b"0", b"\0", b"7"):
            name = pending.get("path") or _ustar_name(header)
            length = int(pending.get("size", length))
            members.append(TarMember(_clean(name, where=where), data_at, length))
            pending = {}
            if len(members) > MAX_MEMBERS:
                raise FormatError(f"the tar holds more than {MAX_MEMBERS} files", source=where)
        elif kind in (b"5", b"g"):
            pending = {} if kind == b"5" else pending
        else:
            raise FormatError(
                f"the tar holds {_ustar_name(header)!r} of type {kind!r}: a model layer holds regular files "
                "only (no links or devices)",
                source=where,
            )
        pos = data_at + (length + BLOCK - 1) // BLOCK * BLOCK
    return members


def _ustar_name(header: bytes) -> str:
    name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
        if prefix:
            name = f"{prefix}/{name}"
    return name
