"""A tensor record's bytes, landed, into checked plaintext: parse the header, decrypt in place, verify.

Every reader of tensorizer files finishes a record the same way, whatever brought its bytes (a local
``preadv`` in :class:`~modelload.loader.formats.tensorizer.TensorizerReader`, ranges from S3 or HTTP in the
sidecar, a local file in ``modelload stage``): :func:`open_record`. The segment's
:class:`~modelload.loader.segment.TensorFinisher` adds the publishing.

Whether the key is right is one piece of state per file and key, :class:`KeyState`, shared by the threads
that open its records. A MAC that fails means a wrong key or corrupt ciphertext, and libsodium cannot tell
which; once a tensor has opened with the key, a failure is corruption. Before that, a caller that can wait
(a load that goes on with other tensors) *holds* the verdict with :meth:`KeyState.doubt` until a second
encrypted tensor decides it: telling an operator the key is wrong when one tensor's bytes are corrupt sends
them to rotate a Secret that is fine.
"""

from __future__ import annotations

import threading
from typing import Literal

from modelload.loader.errors import HashMismatchError, WrongKeyError
from modelload.loader.formats._index import TensorEntry
from modelload.loader.formats.tensorizer.crypto import decrypt_in_place
from modelload.loader.formats.tensorizer.hashes import fastest_hash, verify
from modelload.loader.formats.tensorizer.keys import DecryptionKey
from modelload.loader.formats.tensorizer.tensor_header import TensorHeader, parse_tensor_header

__all__ = ["Hashes", "KeyState", "open_record"]

Hashes = Literal["all", "fastest", "none"]
"""Which stored hashes to check: every one, the fastest (CRC32 when stored, else SHA-256), or none."""


class KeyState:
    """A decryption key (or None for a plain file) and whether a tensor has proved it right. Thread-safe.

    >>> keys = KeyState(DecryptionKey.from_file("key"))                    # doctest: +SKIP
    >>> header = open_record(header_bytes, data, entry=entry, encrypted_file=True, keys=keys)
    """

    def __init__(self, key: DecryptionKey | None) -> None:
        self.key = key
        self._lock = threading.Lock()
        self._proven = False
        self._doubted: tuple[str, str, WrongKeyError] | None = None

    @property
    def proven(self) -> bool:
        """A tensor opened with this key: from now on a failing MAC is corruption, never a wrong key."""
        return self._proven

    def prove(self) -> None:
        """A tensor decrypted: the key is right, and a tensor held by :meth:`doubt` is corrupt (raised)."""
        with self._lock:
            self._proven = True
            doubted, self._doubted = self._doubted, None
        if doubted is not None:
            raise corrupt(doubted[0], doubted[1]) from doubted[2]

    def doubt(self, name: str, source: str, exc: WrongKeyError) -> bool:
        """Tensor ``name`` failed authentication: hold the verdict until a second encrypted tensor decides it.

        True: held (the tensor is not published; :meth:`settle` raises if nothing decides). False: a second
        tensor fails with this key, so it is the key (re-raise ``exc``). Raises the corruption when the key
        is already proven.
        """
        with self._lock:
            if self._proven:
                raise corrupt(name, source) from exc
            if self._doubted is not None:
                return False
            self._doubted = (name, source, exc)
            return True

    def settle(self) -> None:
        """At the end of a load: a tensor still held is the only encrypted one, and nothing proved the key,
        so its failure stands as a wrong key."""
        if self._doubted is not None:
            raise self._doubted[2]


def corrupt(name: str, source: str) -> HashMismatchError:
    """The error for a tensor that fails authentication when the key is known to be right."""
    return HashMismatchError(
        f"tensor {name!r}: its encrypted bytes fail authentication although the same key opened other "
        "tensors of this file: the file's bytes are corrupt (the key is right); re-upload or re-create the "
        "file",
        source=source,
    )


def open_record(
    header: bytes | bytearray | memoryview,
    data: memoryview,
    *,
    entry: TensorEntry,
    encrypted_file: bool,
    keys: KeyState,
    hashes: Hashes = "fastest",
    source: str,
) -> TensorHeader:
    """Parse a record's ``header`` bytes, decrypt ``data`` (its ``entry.data_length`` bytes) in place and
    check ``hashes``; the parsed header.

    Raises FormatError for a header that disagrees with its index entry, WrongKeyError (a MAC fails before
    ``keys`` is proven), HashMismatchError (a MAC fails after, or a stored hash differs), MissingKeyError.
    A header without hashes is not checked (the caller sees ``header.hashes`` empty).
    """
    parsed = parse_tensor_header(header, entry=entry, encrypted_file=encrypted_file, source=source)
    if parsed.encrypted:
        decrypt_in_place(parsed, data, keys.key, source=source, key_known_good=keys.proven)
        keys.prove()
    if hashes != "none" and parsed.hashes:
        verify(fastest_hash(parsed) if hashes == "fastest" else parsed, data, source=source)
    return parsed
