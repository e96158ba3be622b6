"""The crypt_info block of an encrypted tensor's header (docs/tensorizer-format.md, "The crypt_info block"):
how to derive the key, how to decrypt.

Layout: ``u64 body_len``, then ``u16 chunk_count`` and that many ``u64 chunk_len`` + chunk. Chunk types:

- 1, key derivation, method 1 (Argon2id ``crypto_pwhash``): opslimit, memlimit, algorithm, 16-byte salt;
- 2, XSalsa20-Poly1305 in parallel chunks: chunk size, the first chunk's 24-byte nonce, one 16-byte MAC
  per chunk (chunk k uses the nonce plus k, a 192-bit little-endian increment);
- 3, XSalsa20-Poly1305 sequential: one nonce and one MAC over the whole tensor (read only; no writer we know
  of emits it, tensorizer reads it).

The parser is strict: every chunk must be consumed exactly, the MAC count must match the data length, and
the key-derivation limits must be ones libsodium accepts and below caps that keep a hostile file from making
a reader spend gigabytes of memory or minutes of CPU deriving a key.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from modelload.loader.errors import BoundsError, HeaderError
from modelload.loader.formats.tensorizer._cursor import Cursor

__all__ = [
    "ALG_ARGON2ID13",
    "CHUNK_QUANTUM",
    "DEFAULT_CHUNK_SIZE",
    "MAC_BYTES",
    "MAX_MEMLIMIT",
    "MAX_OPSLIMIT",
    "MEMLIMIT_MIN",
    "MIN_CHUNK_SIZE",
    "NONCE_BYTES",
    "OPSLIMIT_MIN",
    "SALT_BYTES",
    "Cipher",
    "CryptInfo",
    "PWHashParams",
    "parse_crypt_info",
]

_KEY_DERIVATION, _PARALLEL, _SEQUENTIAL = 1, 2, 3
_METHOD_PWHASH = 1
ALG_ARGON2ID13 = 2
"""libsodium's ``crypto_pwhash_ALG_ARGON2ID13``: the only algorithm tensorizer writes."""
SALT_BYTES = 16
NONCE_BYTES = 24
MAC_BYTES = 16
CHUNK_QUANTUM = 64
MIN_CHUNK_SIZE = 1024
DEFAULT_CHUNK_SIZE = 2 * 1024 * 1024
OPSLIMIT_MIN = 1
MEMLIMIT_MIN = 8192
MAX_OPSLIMIT = 32
"""Refuse key derivation above this many passes: 8x libsodium's SENSITIVE preset."""
MAX_MEMLIMIT = 4 * 1024**3
"""Refuse key derivation above 4 GiB of memory: 4x libsodium's SENSITIVE preset. The limits come from the
file, which anyone can write; a reader must not let it ask for a terabyte."""

_PWHASH_BODY = struct.Struct("<HHQQiH")  # chunk type, method, opslimit, memlimit, alg, salt_len
_PARALLEL_HEAD = struct.Struct(f"<HQ{NONCE_BYTES}sQ")  # chunk type, chunk size, nonce, num_macs
_SEQUENTIAL_BODY = struct.Struct(f"<H{NONCE_BYTES}s{MAC_BYTES}s")
_U64 = struct.Struct("<Q")
_U16 = struct.Struct("<H")


@dataclass(frozen=True)
class PWHashParams:
    """Argon2id parameters stored in the file; the key is ``crypto_pwhash(32, password, salt, ...)``."""

    opslimit: int
    memlimit: int
    salt: bytes
    alg: int = ALG_ARGON2ID13

    def pack(self) -> bytes:
        body = _PWHASH_BODY.pack(
            _KEY_DERIVATION, _METHOD_PWHASH, self.opslimit, self.memlimit, self.alg, len(self.salt)
        )
        return body + self.salt


@dataclass(frozen=True)
class Cipher:
    """XSalsa20-Poly1305 over chunks of ``chunk_size`` bytes; ``macs`` holds one 16-byte MAC per chunk."""

    chunk_size: int
    nonce: bytes
    macs: bytes
    sequential: bool = False
    """A type-3 chunk: one MAC over the whole tensor (``chunk_size`` is then the data length)."""

    @property
    def num_macs(self) -> int:
        return len(self.macs) // MAC_BYTES

    def mac(self, index: int) -> bytes:
        return self.macs[index * MAC_BYTES : (index + 1) * MAC_BYTES]

    def pack(self) -> bytes:
        if self.sequential:
            return _SEQUENTIAL_BODY.pack(_SEQUENTIAL, self.nonce, self.macs)
        return _PARALLEL_HEAD.pack(_PARALLEL, self.chunk_size, self.nonce, self.num_macs) + self.macs


@dataclass(frozen=True)
class CryptInfo:
    """A decoded crypt_info block. Both parts are None for a tensor without data in an encrypted file."""

    kdf: PWHashParams | None = None
    cipher: Cipher | None = None

    def pack(self) -> bytes:
        """The whole block, ``u64 body_len`` included, in tensorizer's chunk order (derivation first)."""
        chunks = [c.pack() for c in (self.kdf, self.cipher) if c is not None]
        body = _U16.pack(len(chunks)) + b"".join(_U64.pack(len(c)) + c for c in chunks)
        return _U64.pack(len(body)) + body

    @property
    def size(self) -> int:
        return len(self.pack())


def parse_crypt_info(view: memoryview, *, data_length: int, what: str, source: str | None) -> CryptInfo:
    """Decode a crypt_info block that fills ``view`` exactly and check it against the tensor's data length."""
    cur = Cursor(view, what=f"{what} crypt_info", source=source)
    body_len = cur.u64("body length")
    if body_len != cur.remaining:
        raise HeaderError(
            f"{what}: crypt_info says its body is {body_len} bytes but {cur.remaining} bytes lie between the "
            "hashes and the data length; the header is corrupt",
            source=source,
        )
    kdf: PWHashParams | None = None
    cipher: Cipher | None = None
    for index in range(cur.u16("chunk count")):
        length = cur.u64(f"length of chunk {index}")
        cur.need(length, f"chunk {index}")
        chunk = Cursor(
            view, what=f"{what} crypt_info chunk {index}", source=source, start=cur.pos, end=cur.pos + length
        )
        cur.pos += length
        kind = chunk.u16("chunk type")
        if kind == _KEY_DERIVATION:
            if kdf is not None:
                raise HeaderError(f"{what}: crypt_info has two key-derivation chunks", source=source)
            kdf = _parse_pwhash(chunk, what=what, source=source)
        elif kind in (_PARALLEL, _SEQUENTIAL):
            if cipher is not None:
                raise HeaderError(f"{what}: crypt_info has two encryption chunks", source=source)
            cipher = _parse_cipher(chunk, kind, data_length=data_length, what=what, source=source)
        else:
            raise HeaderError(
                f"{what}: unknown crypt_info chunk type {kind} (known: 1 key derivation, 2 and 3 XSalsa20); "
                "a newer tensorizer may have written it",
                source=source,
            )
        if chunk.remaining:
            raise HeaderError(
                f"{what}: crypt_info chunk {index} (type {kind}) has {chunk.remaining} unexpected "
                "trailing bytes",
                source=source,
            )
    if cur.remaining:
        raise HeaderError(f"{what}: {cur.remaining} bytes follow the last crypt_info chunk", source=source)
    return CryptInfo(kdf=kdf, cipher=cipher)


def _parse_pwhash(cur: Cursor, *, what: str, source: str | None) -> PWHashParams:
    method = cur.u16("derivation method")
    if method != _METHOD_PWHASH:
        raise HeaderError(
            f"{what}: unknown key derivation method {method} (known: 1, Argon2id)", source=source
        )
    opslimit = cur.u64("opslimit")
    memlimit = cur.u64("memlimit")
    alg = cur.i32("algorithm")
    salt = bytes(cur.take(cur.u16("salt length"), "salt"))
    if alg != ALG_ARGON2ID13:
        raise HeaderError(
            f"{what}: key derivation algorithm {alg}; only Argon2id (2) is supported", source=source
        )
    if len(salt) != SALT_BYTES:
        raise HeaderError(f"{what}: the Argon2id salt is {len(salt)} bytes, not {SALT_BYTES}", source=source)
    if opslimit < OPSLIMIT_MIN or memlimit < MEMLIMIT_MIN:
        raise HeaderError(
            f"{what}: Argon2id limits opslimit={opslimit}, memlimit={memlimit} are below libsodium's minimum "
            f"({OPSLIMIT_MIN}, {MEMLIMIT_MIN})",
            source=source,
        )
    if opslimit > MAX_OPSLIMIT or memlimit > MAX_MEMLIMIT:
        raise BoundsError(
            f"{what}: Argon2id limits opslimit={opslimit}, memlimit={memlimit} exceed the caps "
            f"({MAX_OPSLIMIT}, {MAX_MEMLIMIT} bytes); re-encrypt with a raw key or lower limits",
            source=source,
        )
    return PWHashParams(opslimit=opslimit, memlimit=memlimit, salt=salt, alg=alg)


def _parse_cipher(cur: Cursor, kind: int, *, data_length: int, what: str, source: str | None) -> Cipher:
    if kind == _SEQUENTIAL:
        nonce = bytes(cur.take(NONCE_BYTES, "nonce"))
        mac = bytes(cur.take(MAC_BYTES, "MAC"))
        return Cipher(chunk_size=data_length, nonce=nonce, macs=mac, sequential=True)
    chunk_size = cur.u64("chunk size")
    nonce = bytes(cur.take(NONCE_BYTES, "nonce"))
    num_macs = cur.u64("MAC count")
    if chunk_size < MIN_CHUNK_SIZE or chunk_size % CHUNK_QUANTUM:
        raise HeaderError(
            f"{what}: encryption chunk size {chunk_size} must be a multiple of {CHUNK_QUANTUM} and at least "
            f"{MIN_CHUNK_SIZE}; the header is corrupt",
            source=source,
        )
    expected = -(-data_length // chunk_size)
    if num_macs != expected:
        raise HeaderError(
            f"{what}: {num_macs} MACs for {data_length} bytes in chunks of {chunk_size}, which needs "
            f"{expected}; the header is corrupt",
            source=source,
        )
    macs = bytes(cur.take(num_macs * MAC_BYTES, "MACs"))
    return Cipher(chunk_size=chunk_size, nonce=nonce, macs=macs)
