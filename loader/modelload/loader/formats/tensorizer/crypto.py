"""Decrypting a tensor in place, chunk by chunk, and encrypting one for the writer
(docs/tensorizer-format.md, "Encryption").

An encrypted tensor's data is split into chunks of ``chunk_size`` bytes (the last one short); chunk k is
XSalsa20-Poly1305 with the header's nonce plus k (a 192-bit little-endian increment) and the k-th MAC of the
header. Chunks are independent, so a streaming reader decrypts each one as soon as its bytes are in, in any
order, in the shared-memory segment itself: :class:`TensorDecryptor` gives the chunk spans and opens one
chunk at a time. :func:`decrypt_in_place` does a whole tensor.

A MAC that fails means a wrong key or corrupt ciphertext; libsodium cannot tell which. Once some chunk has
opened with the key (in this tensor, or in an earlier tensor of the same file when the caller says so),
a failure can only be corruption, and is reported as HashMismatchError instead of WrongKeyError.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from modelload.loader.errors import HashMismatchError, MissingKeyError, NotEncryptedError, WrongKeyError
from modelload.loader.formats.tensorizer import _sodium
from modelload.loader.formats.tensorizer.crypt_info import Cipher
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.tensor_header import TensorHeader

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ChunkSealer", "NonceLedger", "TensorDecryptor", "decrypt_in_place", "nonce_add"]

_NONCE_SPACE = 1 << 192


def nonce_add(nonce: bytes, k: int) -> bytes:
    """The nonce of chunk ``k``: the 24-byte nonce as a little-endian integer, plus ``k``, modulo 2**192."""
    return ((int.from_bytes(nonce, "little") + k) % _NONCE_SPACE).to_bytes(24, "little")


def _flat(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class TensorDecryptor:
    """Decrypts one tensor's chunks in place. Thread-safe: chunks may be opened from several threads.

    >>> dec = TensorDecryptor(header, key, source=uri)                      # doctest: +SKIP
    >>> for k in range(dec.chunk_count):
    ...     start, length = dec.chunk_span(k)
    ...     dec.decrypt_chunk(k, segment_view[start : start + length])
    """

    __slots__ = ("_cipher", "_key", "_opened", "_source", "header")

    def __init__(
        self,
        header: TensorHeader,
        key: DecryptionKey | None,
        *,
        source: str | None = None,
        key_known_good: bool = False,
    ) -> None:
        self.header = header
        self._source = source
        cipher = header.crypt.cipher if header.crypt is not None else None
        if cipher is None:
            raise NotEncryptedError(
                f"{_where(source)}tensor {header.name!r} is not encrypted; read it without decrypting"
            )
        if key is None:
            raise MissingKeyError(
                f"{_where(source)}tensor {header.name!r} is encrypted and no key or password was given: "
                "pass --key-file or --password-file"
            )
        self._cipher: Cipher = cipher
        kdf = header.crypt.kdf if header.crypt is not None else None
        self._key = key.raw_key(kdf, tensor=header.name)
        self._opened = key_known_good

    @property
    def chunk_count(self) -> int:
        return self._cipher.num_macs

    def chunk_span(self, index: int) -> tuple[int, int]:
        """``(offset, length)`` of chunk ``index`` within the tensor's data."""
        if not 0 <= index < self.chunk_count:
            raise IndexError(f"chunk {index} of {self.chunk_count}")
        if self._cipher.sequential:
            return 0, self.header.data_length
        start = index * self._cipher.chunk_size
        return start, min(self._cipher.chunk_size, self.header.data_length - start)

    def decrypt_chunk(self, index: int, view: Buffer) -> None:
        """Decrypt chunk ``index`` in place; ``view`` is exactly that chunk's bytes, writable."""
        flat = _flat(view)
        _, length = self.chunk_span(index)
        if flat.nbytes != length:
            raise ValueError(
                f"chunk {index} of tensor {self.header.name!r} is {length} bytes, got {flat.nbytes}"
            )
        nonce = nonce_add(self._cipher.nonce, index)
        if _sodium.open_in_place(flat, self._cipher.mac(index), nonce, self._key):
            self._opened = True
            return
        name, count = self.header.name, self.chunk_count
        if self._opened:
            raise HashMismatchError(
                f"tensor {name!r}: encrypted chunk {index + 1} of {count} fails authentication although "
                "the same key opened other data of this file; the bytes are corrupt: read them again or "
                "re-create the file",
                source=self._source,
            )
        raise WrongKeyError(
            f"{_where(self._source)}tensor {name!r}: encrypted chunk {index + 1} of {count} fails "
            "authentication: the key or password is wrong (or the encrypted bytes are corrupt)"
        )

    def decrypt(self, data: Buffer) -> None:
        """Decrypt the whole tensor in place (``header.data_length`` writable bytes)."""
        flat = _flat(data)
        if flat.nbytes != self.header.data_length:
            raise ValueError(
                f"tensor {self.header.name!r} has {self.header.data_length} data bytes, got {flat.nbytes}"
            )
        for index in range(self.chunk_count):
            start, length = self.chunk_span(index)
            self.decrypt_chunk(index, flat[start : start + length])


def decrypt_in_place(
    header: TensorHeader,
    data: Buffer,
    key: DecryptionKey | None,
    *,
    source: str | None = None,
    key_known_good: bool = False,
) -> None:
    """Decrypt a whole tensor's data where it lies (a writable memoryview, e.g. of the segment).

    Raises MissingKeyError (no key), NotEncryptedError (the tensor is plain), WrongKeyError (a MAC fails, or
    a password for a raw-key file), or HashMismatchError (a MAC fails after the key proved right).
    """
    TensorDecryptor(header, key, source=source, key_known_good=key_known_good).decrypt(data)


def _where(source: str | None) -> str:
    return f"{source}: " if source else ""


class ChunkSealer:
    """Encrypts a tensor chunk by chunk for the writer; collects the MACs in chunk order."""

    __slots__ = ("_key", "chunk_size", "macs", "nonce")

    def __init__(self, *, key: bytes, nonce: bytes, chunk_size: int) -> None:
        self._key = key
        self.nonce = nonce
        self.chunk_size = chunk_size
        self.macs = bytearray()

    def seal(self, index: int, view: memoryview) -> None:
        """Encrypt chunk ``index`` (given in order) in place."""
        if len(self.macs) != 16 * index:
            raise AssertionError("chunks must be sealed in order")
        self.macs += _sodium.seal_in_place(view, nonce_add(self.nonce, index), self._key)


class NonceLedger:
    """The nonce ranges a writer has used in one file, so no (key, nonce) pair is ever used twice.

    Each tensor takes a random 24-byte first nonce and the ``chunks`` nonces after it; a collision is
    astronomically unlikely, and checked anyway, as tensorizer does. Ranges are kept sorted, so a check
    costs a binary search, not a set entry per chunk.
    """

    __slots__ = ("_ends", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def claim(self, nonce: bytes, chunks: int) -> bool:
        """Record ``chunks`` nonces from ``nonce``; False (nothing recorded) if any was used before."""
        first = int.from_bytes(nonce, "little")
        end = first + chunks
        spans = [(first, end)] if end <= _NONCE_SPACE else [(first, _NONCE_SPACE), (0, end - _NONCE_SPACE)]
        for start, stop in spans:
            i = bisect.bisect_right(self._starts, start)
            if i and self._ends[i - 1] > start:
                return False
            if i < len(self._starts) and self._starts[i] < stop:
                return False
        for start, stop in spans:
            i = bisect.bisect_right(self._starts, start)
            self._starts.insert(i, start)
            self._ends.insert(i, stop)
        return True
