"""Keys for encrypted tensorizer files: what a reader decrypts with and what a writer encrypts with.

A file is encrypted with a 32-byte XSalsa20 key. The key is either raw (stored out of band, e.g. in a
Kubernetes Secret) or derived from a password with Argon2id, whose salt and limits the file stores in every
encrypted tensor's header. A raw key opens any file, including one written with a password (its key is the
derived key); a password opens only files that carry derivation parameters.

Argon2id is slow on purpose (hundreds of milliseconds and hundreds of MiB at the default "moderate" limits),
so a :class:`DecryptionKey` caches each derived key per (salt, limits): a file whose tensors share one salt
derives once. Neither type ever shows its key or password in a repr, a str or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from modelload.loader.errors import ConfigError, EncryptionError, WrongKeyError
from modelload.loader.formats.tensorizer.crypt_info import (
    ALG_ARGON2ID13,
    CHUNK_QUANTUM,
    DEFAULT_CHUNK_SIZE,
    MAX_MEMLIMIT,
    MAX_OPSLIMIT,
    MEMLIMIT_MIN,
    MIN_CHUNK_SIZE,
    OPSLIMIT_MIN,
    SALT_BYTES,
    PWHashParams,
)

__all__ = ["KEY_BYTES", "Argon2Limits", "DecryptionKey", "EncryptionParams"]

KEY_BYTES = 32


@dataclass(frozen=True)
class Argon2Limits:
    """Argon2id cost: passes over memory, and bytes of memory. The presets are libsodium's."""

    opslimit: int
    memlimit: int

    MIN: ClassVar[Argon2Limits]
    """1 pass, 8 KiB: for tests only."""
    INTERACTIVE: ClassVar[Argon2Limits]
    """2 passes, 64 MiB."""
    MODERATE: ClassVar[Argon2Limits]
    """3 passes, 256 MiB: the default, as in tensorizer."""
    SENSITIVE: ClassVar[Argon2Limits]
    """4 passes, 1 GiB."""


Argon2Limits.MIN = Argon2Limits(OPSLIMIT_MIN, MEMLIMIT_MIN)
Argon2Limits.INTERACTIVE = Argon2Limits(2, 64 * 1024**2)
Argon2Limits.MODERATE = Argon2Limits(3, 256 * 1024**2)
Argon2Limits.SENSITIVE = Argon2Limits(4, 1024**3)


def _derive(password: bytes, params: PWHashParams) -> bytes:
    """crypto_pwhash (Argon2id) of the password with the file's salt and limits: the 32-byte key."""
    from nacl import bindings, exceptions

    try:
        key = bindings.crypto_pwhash_alg(
            KEY_BYTES, password, params.salt, params.opslimit, params.memlimit, params.alg
        )
    except (exceptions.CryptoError, ValueError, TypeError, MemoryError) as exc:
        raise EncryptionError(
            f"Argon2id key derivation failed (opslimit={params.opslimit}, memlimit={params.memlimit}): "
            f"{type(exc).__name__}; give the raw key instead, or more memory"
        ) from None
    return bytes(key)


_FINGERPRINT_PREFIX = b"modelload key fingerprint v1\0"
_FINGERPRINT_SALT_BYTES = 16


def _raw_fingerprint(raw: bytes) -> str:
    return "sha256:" + hashlib.sha256(_FINGERPRINT_PREFIX + raw).hexdigest()


def _fingerprint_hash(password: bytes, salt: bytes) -> bytes:
    """Argon2id at libsodium's interactive cost (2 passes, 64 MiB): what a password's fingerprint is."""
    limits = Argon2Limits.INTERACTIVE
    return _derive(
        password,
        PWHashParams(opslimit=limits.opslimit, memlimit=limits.memlimit, salt=salt, alg=ALG_ARGON2ID13),
    )


class DecryptionKey:
    """What a reader decrypts with: a raw 32-byte key, or a password for Argon2id-derived keys.

    >>> key = DecryptionKey.from_file("/var/run/secrets/modelload/key/key")   # doctest: +SKIP
    >>> key = DecryptionKey.from_password("correct horse")                     # doctest: +SKIP
    """

    __slots__ = ("__weakref__", "_cache", "_lock", "_password", "_raw")

    def __init__(self, *, raw: bytes | None = None, password: bytes | None = None) -> None:
        if (raw is None) == (password is None):
            raise ConfigError("a DecryptionKey is either a raw key or a password, not both or neither")
        if raw is not None and len(raw) != KEY_BYTES:
            raise ConfigError(f"a raw decryption key is exactly {KEY_BYTES} bytes; this one is {len(raw)}")
        self._raw = raw
        self._password = password
        self._cache: dict[tuple[int, int, int, bytes], bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_bytes(cls, key: bytes | bytearray | memoryview) -> DecryptionKey:
        """A raw 32-byte key."""
        return cls(raw=bytes(key))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> DecryptionKey:
        """A raw key from a file of exactly 32 bytes (a Secret's key mounted as a file)."""
        data = Path(path).read_bytes()
        if len(data) != KEY_BYTES:
            hint = " (a trailing newline?)" if len(data) == KEY_BYTES + 1 and data.endswith(b"\n") else ""
            raise ConfigError(
                f"the key file {os.fspath(path)} holds {len(data)} bytes{hint}; a raw key is exactly "
                f"{KEY_BYTES} bytes (use a password file for a passphrase)"
            )
        return cls(raw=data)

    @classmethod
    def from_password(cls, password: str | bytes) -> DecryptionKey:
        """A password (UTF-8 when a str) for files written with Argon2id key derivation."""
        data = password.encode("utf-8") if isinstance(password, str) else bytes(password)
        return cls(password=data)

    @classmethod
    def from_password_file(cls, path: str | os.PathLike[str]) -> DecryptionKey:
        """A password from a file; one trailing newline (``\\n`` or ``\\r\\n``) is not part of it."""
        data = Path(path).read_bytes()
        data = data.removesuffix(b"\n").removesuffix(b"\r") if data.endswith(b"\n") else data
        return cls(password=data)

    @property
    def is_password(self) -> bool:
        return self._password is not None

    def raw_key(self, kdf: PWHashParams | None, *, tensor: str) -> bytes:
        """The 32-byte key for a tensor whose header carries derivation parameters ``kdf`` (or none)."""
        if self._raw is not None:
            return self._raw
        assert self._password is not None
        if kdf is None:
            raise WrongKeyError(
                f"tensor {tensor!r} was encrypted with a raw key (the file stores no key-derivation "
                "parameters), so a password cannot open it: give the raw key (--key-file)"
            )
        slot = (kdf.opslimit, kdf.memlimit, kdf.alg, kdf.salt)
        with self._lock:
            key = self._cache.get(slot)
            if key is None:
                key = self._cache[slot] = _derive(self._password, kdf)
        return key

    def fingerprint(self) -> str:
        """A fingerprint of this key that does not give it away, for a segment to record which key its
        load used (:mod:`modelload.loader.segment.identity`). A raw key: SHA-256 under a fixed prefix (a
        random 32-byte key cannot be found from it). A password: Argon2id at libsodium's interactive cost
        with a random salt kept in the fingerprint, so that testing a guess against it costs what a guess
        against the file costs."""
        if self._raw is not None:
            return _raw_fingerprint(self._raw)
        assert self._password is not None
        salt = secrets.token_bytes(_FINGERPRINT_SALT_BYTES)
        return f"argon2id:{salt.hex()}:{_fingerprint_hash(self._password, salt).hex()}"

    def matches(self, fingerprint: str) -> bool:
        """Whether :meth:`fingerprint` of this key could have given ``fingerprint``."""
        if self._raw is not None:
            return hmac.compare_digest(fingerprint, _raw_fingerprint(self._raw))
        assert self._password is not None
        kind, _, rest = fingerprint.partition(":")
        salt_hex, _, digest_hex = rest.partition(":")
        try:
            salt, digest = bytes.fromhex(salt_hex), bytes.fromhex(digest_hex)
        except ValueError:
            return False
        if kind != "argon2id" or len(salt) != _FINGERPRINT_SALT_BYTES or len(digest) != KEY_BYTES:
            return False
        return hmac.compare_digest(_fingerprint_hash(self._password, salt), digest)

    def __repr__(self) -> str:
        return f"DecryptionKey({'password' if self._password is not None else 'raw key'}, hidden)"

    __str__ = __repr__


@dataclass(frozen=True, repr=False)
class EncryptionParams:
    """What a writer encrypts with: the key, the derivation parameters to store (for a password), and the
    chunk size (a multiple of 64, at least 1024; tensorizer uses 2 MiB).

    >>> params = EncryptionParams.random(); save(params.key)                   # doctest: +SKIP
    >>> params = EncryptionParams.from_password("pw", limits=Argon2Limits.MODERATE)  # doctest: +SKIP
    """

    key: bytes
    kdf: PWHashParams | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE

    def __post_init__(self) -> None:
        if len(self.key) != KEY_BYTES:
            raise ConfigError(f"an encryption key is exactly {KEY_BYTES} bytes; this one is {len(self.key)}")
        if self.chunk_size < MIN_CHUNK_SIZE or self.chunk_size % CHUNK_QUANTUM:
            raise ConfigError(
                f"encryption chunk size {self.chunk_size} must be a multiple of {CHUNK_QUANTUM} and at least "
                f"{MIN_CHUNK_SIZE}"
            )

    @classmethod
    def random(cls, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> EncryptionParams:
        """A fresh random key; save ``.key`` somewhere safe, the file cannot be opened without it."""
        return cls(key=secrets.token_bytes(KEY_BYTES), chunk_size=chunk_size)

    @classmethod
    def from_key(
        cls, key: bytes | bytearray | memoryview, *, chunk_size: int = DEFAULT_CHUNK_SIZE
    ) -> EncryptionParams:
        """Your own 32-byte key."""
        return cls(key=bytes(key), chunk_size=chunk_size)

    @classmethod
    def from_password(
        cls,
        password: str | bytes,
        *,
        limits: Argon2Limits | None = None,
        salt: bytes | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> EncryptionParams:
        """A key derived with Argon2id (default limits: libsodium's MODERATE, ~0.5 s and 256 MiB).

        The salt (random unless given) and limits are stored in the file, so readers need only the password.
        """
        limits = limits or Argon2Limits.MODERATE
        if not (
            OPSLIMIT_MIN <= limits.opslimit <= MAX_OPSLIMIT
            and MEMLIMIT_MIN <= limits.memlimit <= MAX_MEMLIMIT
        ):
            raise ConfigError(
                f"Argon2id limits opslimit={limits.opslimit}, memlimit={limits.memlimit} are outside what "
                f"readers accept ({OPSLIMIT_MIN}..{MAX_OPSLIMIT}, {MEMLIMIT_MIN}..{MAX_MEMLIMIT} bytes)"
            )
        salt = secrets.token_bytes(SALT_BYTES) if salt is None else bytes(salt)
        if len(salt) != SALT_BYTES:
            raise ConfigError(f"an Argon2id salt is exactly {SALT_BYTES} bytes; this one is {len(salt)}")
        kdf = PWHashParams(opslimit=limits.opslimit, memlimit=limits.memlimit, salt=salt, alg=ALG_ARGON2ID13)
        data = password.encode("utf-8") if isinstance(password, str) else bytes(password)
        return cls(key=_derive(data, kdf), kdf=kdf, chunk_size=chunk_size)

    def decryption_key(self) -> DecryptionKey:
        """The raw key as a DecryptionKey (opens the file whether or not it was password-derived)."""
        return DecryptionKey.from_bytes(self.key)

    def __repr__(self) -> str:
        how = "password-derived" if self.kdf is not None else "raw"
        return f"EncryptionParams({how} key hidden, chunk_size={self.chunk_size})"

    __str__ = __repr__
