"""A bounds-checked reader of little-endian fields over a byte buffer.

Every structure of the format (the index entries, a tensor header, its crypt_info block) is parsed through a
cursor bounded by the length its container declares, so a field that claims more bytes than its container
holds is refused before anything is sliced or allocated. The error names the structure and the field.
"""

from __future__ import annotations

import struct

from modelload.loader.errors import BoundsError, FormatError

__all__ = ["Cursor"]

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")
_I64 = struct.Struct("<q")


class Cursor:
    """Reads fields from ``buf[start:end]`` in order; overruns raise ``overrun`` (BoundsError by default)."""

    __slots__ = ("_buf", "_end", "_overrun", "_source", "pos", "what")

    def __init__(
        self,
        buf: memoryview,
        *,
        what: str,
        source: str | None = None,
        start: int = 0,
        end: int | None = None,
        overrun: type[FormatError] = BoundsError,
    ) -> None:
        self._buf = buf
        self.pos = start
        self._end = len(buf) if end is None else end
        self.what = what
        self._source = source
        self._overrun = overrun

    @property
    def buffer(self) -> memoryview:
        return self._buf

    @property
    def remaining(self) -> int:
        return self._end - self.pos

    def need(self, n: int, field: str) -> None:
        """Refuse a field of ``n`` bytes that would run past the end of the structure."""
        if n > self._end - self.pos:
            raise self._overrun(
                f"{self.what}: {field} needs {n} bytes at byte {self.pos} but the structure ends "
                f"{self._end - self.pos} bytes later; the file is corrupt or was cut, re-create it",
                source=self._source,
            )

    def u8(self, field: str) -> int:
        self.need(1, field)
        value = self._buf[self.pos]
        self.pos += 1
        return value

    def _unpack(self, fmt: struct.Struct, field: str) -> int:
        self.need(fmt.size, field)
        (value,) = fmt.unpack_from(self._buf, self.pos)
        self.pos += fmt.size
        return int(value)

    def u16(self, field: str) -> int:
        return self._unpack(_U16, field)

    def u32(self, field: str) -> int:
        return self._unpack(_U32, field)

    def u64(self, field: str) -> int:
        return self._unpack(_U64, field)

    def i32(self, field: str) -> int:
        return self._unpack(_I32, field)

    def i64(self, field: str) -> int:
        return self._unpack(_I64, field)

    def take(self, n: int, field: str) -> memoryview:
        """The next ``n`` bytes as a view (no copy)."""
        self.need(n, field)
        view = self._buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def dims(self, ndim: int, *, wide: bool, field: str) -> tuple[int, ...]:
        """``ndim`` dimensions of 4 bytes each, or 8 for long (data version 5) tensors."""
        width = 8 if wide else 4
        self.need(ndim * width, field)
        shape = struct.unpack_from(f"<{ndim}{'Q' if wide else 'I'}", self._buf, self.pos)
        self.pos += ndim * width
        return tuple(int(d) for d in shape)
