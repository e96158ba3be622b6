"""The checksums stores keep of whole objects, and the arithmetic that checks landed bytes against them.

Stores keep checksums of what was uploaded: S3 (CRC64NVME for uploads that carry none, CRC32 from AWS's SDKs,
CRC32C, SHA-1 or SHA-256 where the uploader chose them; of the whole object, or for a multipart upload a
composite over its parts), GCS (CRC32C always, MD5 unless the object was composed), Azure Blob (Content-MD5
where the uploader or the service set one). A source reports them as :class:`StoreChecksum` values in its
:class:`~._base.ObjectInfo`, pinned to the version it read.

The three CRCs are *composable*: the CRC of ``A || B`` follows from ``crc(A)``, ``crc(B)`` and ``len(B)``
(:func:`crc_combine`, O(log len) multiplications in GF(2)[x]). Readers compute the CRC of each range as it
lands, in any order, and the whole object's CRC is combined from them without reading a byte twice. MD5 and
the SHAs are not: they need the bytes in order, which the load's consumer of them (``load/proof.py``) does
once a file is complete.

The CRC kernels are native: CRC-32 from ISA-L (``isal``, already the tensorizer hash's), CRC-32C and
CRC-64/NVME from AWS's common runtime (``awscrt``, 1 MB, what botocore itself uses for them); each is
imported on first use, and
:func:`crc_available` tells whether one is installed.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "COMPOSABLE",
    "STREAMED",
    "StoreChecksum",
    "crc",
    "crc_available",
    "crc_combine",
    "crc_width",
    "new_hash",
]

COMPOSABLE = ("crc64nvme", "crc32c", "crc32")
"""The CRCs, in the order a proof prefers them (fewest undetected errors first)."""
STREAMED = ("sha256", "sha1", "md5")
"""The digests that need the bytes in order, in the order a proof prefers them."""

# Reflected polynomials; every one of these CRCs starts from all ones and ends with an inversion.
_POLY = {"crc32": (32, 0xEDB88320), "crc32c": (32, 0x82F63B78), "crc64nvme": (64, 0x9A6C9329AC4BC9B5)}


@dataclass(frozen=True)
class StoreChecksum:
    """One checksum a store keeps of a whole object.

    ``value`` is the digest's bytes (a CRC big-endian, as stores encode it in base64). A composite checksum
    (an S3 multipart upload's) is the digest of the concatenated digests of its ``parts``, each ``(size,
    digest)`` in order; ``parts`` is empty for a checksum of the whole byte stream.
    """

    algorithm: str
    value: bytes
    parts: tuple[tuple[int, bytes], ...] = ()

    @property
    def composable(self) -> bool:
        return self.algorithm in _POLY

    @property
    def composite(self) -> bool:
        return bool(self.parts)

    def describe(self) -> str:
        """``crc32c AAAAAA==``, or ``sha256 of 12 parts ...``: what /status and the segment record."""
        encoded = base64.b64encode(self.value).decode("ascii")
        return (
            f"{self.algorithm} of {len(self.parts)} parts {encoded}"
            if self.parts
            else f"{self.algorithm} {encoded}"
        )

    @classmethod
    def from_base64(
        cls, algorithm: str, text: str, *, parts: tuple[tuple[int, bytes], ...] = ()
    ) -> StoreChecksum | None:
        """A checksum from a store's base64 text (a header or a JSON field); None when it does not decode to
        the algorithm's length (a store's composite marker ``-N`` is stripped by the caller)."""
        try:
            value = base64.b64decode(text.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        if len(value) != digest_size(algorithm):
            return None
        return cls(algorithm, value, parts)


def digest_size(algorithm: str) -> int:
    if algorithm in _POLY:
        return _POLY[algorithm][0] // 8
    return hashlib.new(algorithm).digest_size


def crc_width(algorithm: str) -> int:
    return _POLY[algorithm][0]


# --- the kernels -------------------------------------------------------------------------------------------


@functools.cache
def _kernel(algorithm: str) -> Callable[[Any, int], int] | None:
    """``f(data, previous) -> crc`` for a CRC, or None when its library is not installed."""
    try:
        if algorithm == "crc32":
            from isal import isal_zlib

            return isal_zlib.crc32
        from awscrt import checksums

        if algorithm == "crc32c":
            return checksums.crc32c
        if algorithm == "crc64nvme":
            return checksums.crc64nvme
    except ImportError:
        return None
    raise ValueError(f"not a CRC this loader knows: {algorithm!r}")


def crc_available(algorithm: str) -> bool:
    """Whether the CRC's native kernel is installed (the sidecar extra brings all three)."""
    return algorithm in _POLY and _kernel(algorithm) is not None


def crc(algorithm: str, data: Any, previous: int = 0) -> int:
    """The CRC of ``data`` (any buffer), continuing from ``previous`` (the CRC of the bytes before it)."""
    kernel = _kernel(algorithm)
    if kernel is None:
        raise RuntimeError(f"no {algorithm} implementation is installed")
    return kernel(data, previous)


def new_hash(algorithm: str) -> Any:
    """A hashlib object for a streamed digest (md5, sha1, sha256)."""
    return hashlib.new(algorithm, usedforsecurity=False)


# --- combining ---------------------------------------------------------------------------------------------


def _multiply(a: int, b: int, poly: int, width: int) -> int:
    """``a * b mod P`` in the reflected bit order of the CRC registers."""
    top = 1 << (width - 1)
    product = 0
    while a:
        if a & top:
            product ^= b
        a = (a << 1) & ((1 << width) - 1)
        b = (b >> 1) ^ poly if b & 1 else b >> 1
    return product


@functools.cache
def _powers(algorithm: str) -> tuple[int, ...]:
    """``x^(2^k) mod P`` for k = 0..127, reflected: enough for any length a file can have."""
    width, poly = _POLY[algorithm]
    table = [1 << (width - 2)]  # x^1
    for _ in range(127):
        table.append(_multiply(table[-1], table[-1], poly, width))
    return tuple(table)


def crc_combine(algorithm: str, first: int, second: int, second_length: int) -> int:
    """The CRC of ``A || B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` in bytes: ``crc(A) * x^(8 len B)
    mod P`` plus ``crc(B)``, the multiplication by square-and-multiply over the table of ``x^(2^k)``."""
    if second_length == 0:
        return first
    width, poly = _POLY[algorithm]
    powers = _powers(algorithm)
    shift = 1 << (width - 1)  # x^0
    bits, k = second_length * 8, 0
    while bits:
        if bits & 1:
            shift = _multiply(powers[k], shift, poly, width)
        bits >>= 1
        k += 1
    return _multiply(shift, first, poly, width) ^ second


def crc_bytes(algorithm: str, value: int) -> bytes:
    """A CRC register as the big-endian bytes stores encode."""
    return value.to_bytes(crc_width(algorithm) // 8, "big")
