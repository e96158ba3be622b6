"""Checking a tensor's stored CRC32 and SHA-256 (docs/tensorizer-format.md, "Hashes"), streaming and without
copies.

Both hashes cover the tensor header (hash values zeroed, crypt_info cut out; :attr:`TensorHeader.hashable`)
followed by the *plaintext* data, so an encrypted tensor is verified after it is decrypted. zlib and hashlib
release the GIL on large buffers, so hashing a memoryview of shared memory in a worker thread runs beside
other work; nothing here copies the data.

The hashes are unkeyed and stored in clear: they catch corruption in storage or transfer, not tampering
(the Poly1305 MACs of an encrypted file do that).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from modelload.loader.errors import HashMismatchError, SizeMismatchError
from modelload.loader.formats.tensorizer.tensor_header import HASH_CRC32, HASH_SHA256, TensorHeader

if TYPE_CHECKING:
    from hashlib import _Hash

    from typing_extensions import Buffer

__all__ = ["RunningHashes", "TensorHasher", "crc32", "crc32_bytes", "crc32_combine", "fastest_hash", "verify"]

_crc32: Callable[..., int]
try:  # ISA-L computes the same IEEE CRC-32 as zlib, about 7x faster (16 vs 2.2 GiB/s here): verifying a
    # multi-GiB model then costs next to nothing. Installed with the sidecar extra; zlib otherwise.
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - depends on the environment
    _crc32 = zlib.crc32


_GIL_KEPT_UP_TO = 5 << 10
"""Both ISA-L's and zlib's ``crc32`` let go of the GIL for a buffer over this many bytes, and keep it for one
of at most this many."""
_SLICED_UP_TO = 64 << 10
"""Buffers up to this size are taken in slices of :data:`_GIL_KEPT_UP_TO` bytes, keeping the GIL."""


def crc32(data: Buffer, value: int = 0) -> int:
    """CRC-32 (zlib/IEEE) of ``data``, continuing from ``value``: ISA-L's where installed, zlib's otherwise.

    The one CRC-32 of the package: tensorizer's stored hashes, the segment's state entries and the peers'
    manifests all use it.

    A buffer of a few KiB is taken in slices small enough that the GIL is kept: released and taken back
    for each 8 KiB tensor of a mixture of experts, while other threads wait for it, the GIL cost two to
    five futex calls and a thread switch a tensor, far more than the CRC itself (eight readers landing
    100,000 such tensors made 530,000 futex calls, and 67,000 with the slices). Larger buffers are taken in
    one call, the GIL let go.
    """
    view = memoryview(data)
    if _GIL_KEPT_UP_TO < view.nbytes <= _SLICED_UP_TO and view.c_contiguous:
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        return crc32_bytes(view, value) & 0xFFFFFFFF
    return int(_crc32(data, value)) & 0xFFFFFFFF


def crc32_bytes(view: memoryview, value: int = 0) -> int:
    """:func:`crc32` of a one-dimensional, contiguous memoryview of bytes (``format`` B), such as a slice of a
    reader's buffer: the same CRC-32 and the same slices, without :func:`crc32`'s checks of the buffer's
    shape. Its caller takes one for each of a mixture of experts' 100,000 tensors, where those checks cost
    more than the CRC itself (1.2 against 0.4 us a 8 KiB tensor here)."""
    length = len(view)
    if length <= _GIL_KEPT_UP_TO or length > _SLICED_UP_TO:
        return _crc32(view, value)
    for at in range(0, length, _GIL_KEPT_UP_TO):
        value = _crc32(view[at : at + _GIL_KEPT_UP_TO], value)
    return value


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of two buffers one after the other, from the CRC-32 of each and the second's length.

    A tensor larger than a range lands in pieces, each on its own reader thread, in any order: each piece's
    CRC is taken while its bytes are in the CPU's caches, and the tensor's is made from them here, with no
    pass over its bytes. The CRC register is linear over GF(2): appending ``n`` bytes to what gave ``first``
    moves its register through the same linear map whatever the bytes, and adds (XOR) what those bytes alone
    would give, which is ``second`` (the initial and final inversions of CRC-32 cancel in this sum). The map
    for ``n`` bytes is made from the maps for powers of two bytes, each one the square of the one before.
    """
    register, step = first, 0
    while second_length:
        if second_length & 1:
            register = _apply(_zero_bytes(step), register)
        second_length >>= 1
        step += 1
    return register ^ second


_REVERSED_POLYNOMIAL = 0xEDB88320
"""CRC-32's generator (IEEE 802.3), bit-reversed as zlib's registers hold it."""


def _apply(operator: tuple[int, ...], register: int) -> int:
    """A linear map on the 32-bit register, given as the images of its 32 bits, applied to ``register``."""
    image, bit = 0, 0
    while register:
        if register & 1:
            image ^= operator[bit]
        register >>= 1
        bit += 1
    return image


@functools.cache
def _zero_bytes(power: int) -> tuple[int, ...]:
    """The map that appending 2**``power`` zero bytes applies to the register."""
    if power == 0:
        operator = (_REVERSED_POLYNOMIAL, *(1 << bit for bit in range(31)))  # one bit: shift right, fold it
        for _ in range(3):  # 1, 2, 4, then 8 bits
            operator = tuple(_apply(operator, image) for image in operator)
        return operator
    half = _zero_bytes(power - 1)
    return tuple(_apply(half, image) for image in half)


class TensorHasher:
    """Hashes a tensor's data as it arrives, in order, then checks it against the header.

    >>> hasher = TensorHasher(header)                       # doctest: +SKIP
    >>> for piece in pieces_in_order: hasher.update(piece)  # memoryviews of the segment
    >>> hasher.verify()                                     # raises HashMismatchError
    """

    __slots__ = ("_crc", "_header", "_length", "_sha", "_source")

    def __init__(self, header: TensorHeader, *, source: str | None = None) -> None:
        self._header = header
        self._source = source
        self._length = 0
        kinds = {h.kind for h in header.hashes}
        self._crc: int | None = crc32(header.hashable) if HASH_CRC32 in kinds else None
        self._sha: _Hash | None = hashlib.sha256(header.hashable) if HASH_SHA256 in kinds else None

    def update(self, data: Buffer) -> None:
        """Feed the next plaintext bytes of the tensor (a memoryview is hashed in place)."""
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if self._crc is not None:
            self._crc = crc32(view, self._crc)
        if self._sha is not None:
            self._sha.update(view)
        self._length += view.nbytes

    def verify(self) -> None:
        """Raise HashMismatchError naming the tensor when a stored hash differs from the bytes fed."""
        header = self._header
        if self._length != header.data_length:
            raise SizeMismatchError(
                f"tensor {header.name!r}: {self._length} bytes were hashed but the header has "
                f"{header.data_length}",
                source=self._source,
            )
        for stored in header.hashes:
            if stored.kind == HASH_CRC32:
                assert self._crc is not None
                got = self._crc.to_bytes(4, "little")
            else:
                assert self._sha is not None
                got = self._sha.digest()
            if got != stored.value:
                raise HashMismatchError(
                    f"tensor {header.name!r}: {stored.label} of the bytes read is {got.hex()} but the file "
                    f"stores {stored.value.hex()}; the file or the transfer is corrupt: read it again, or "
                    "re-create it",
                    source=self._source,
                )


class RunningHashes:
    """Both hashes over the header's hashable parts, then data fed in order: what a writer stores."""

    __slots__ = ("_crc", "_sha")

    def __init__(self, *parts: Buffer) -> None:
        self._crc = 0
        self._sha = hashlib.sha256()
        for part in parts:
            self.update(part)

    def update(self, data: Buffer) -> None:
        self._crc = crc32(data, self._crc)
        self._sha.update(data)

    def digests(self) -> tuple[int, bytes]:
        """(CRC32 as an int, SHA-256 digest)."""
        return self._crc, self._sha.digest()


def verify(header: TensorHeader, data: Buffer, *, source: str | None = None) -> None:
    """Check a whole tensor's plaintext against its header's hashes; raises HashMismatchError.

    ``data`` is the tensor's ``header.data_length`` bytes. For a meta tensor (no data in the file) it may be
    the zero-filled buffer the tensor loads as: only the header is hashed then, as the writer did.
    """
    hasher = TensorHasher(header, source=source)
    if header.data_length:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        if view.nbytes != header.data_length:
            raise SizeMismatchError(
                f"tensor {header.name!r}: {view.nbytes} bytes given to verify, the header has "
                f"{header.data_length}",
                source=source,
            )
        hasher.update(view)
    hasher.verify()


def fastest_hash(header: TensorHeader) -> TensorHeader:
    """``header`` with only its fastest stored hash: CRC32 (16 GiB/s here with ISA-L) when there is one, else
    SHA-256 (about 1 GiB/s a core). Both catch corruption in storage or transfer equally well; neither is a
    defence against tampering (encrypted files have their MACs for that)."""
    crc = next((h for h in header.hashes if h.kind == HASH_CRC32), None)
    return dataclasses.replace(header, hashes=(crc,)) if crc is not None else header
