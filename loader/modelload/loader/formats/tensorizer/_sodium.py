"""XSalsa20-Poly1305 in detached mode, in place, through the libsodium that pynacl bundles.

tensorizer stores each chunk's 16-byte MAC in the header and the ciphertext, of the plaintext's length, in
the data. libsodium's ``crypto_secretbox_open_detached`` opens exactly that, in place (libsodium allows the
message and ciphertext pointers to be equal), so a chunk of shared memory is decrypted where it lies.

pynacl's public bindings only offer the combined form (MAC then ciphertext), but its bundled shared library
exports the detached functions; we call them through ctypes, which releases the GIL during the call. When
the symbols are missing (another pynacl build), :func:`open_in_place` falls back to the combined binding,
which costs one copy per chunk (the chunk size, 2 MiB by default), never a copy of the tensor.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

__all__ = ["detached_available", "open_in_place", "seal_in_place"]

_MAC = 16


@functools.cache
def _library() -> Any | None:
    """The bundled libsodium with the detached secretbox functions typed, or None when unavailable."""
    try:
        import nacl._sodium as sodium_module
        import nacl.bindings  # noqa: F401  # runs sodium_init(), which picks the fastest implementations

        lib = ctypes.CDLL(sodium_module.__file__)
        open_fn = lib.crypto_secretbox_open_detached
        seal_fn = lib.crypto_secretbox_detached
    except (ImportError, OSError, AttributeError):
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_ulonglong
    # int crypto_secretbox_open_detached(m, c, mac, clen, n, k)
    open_fn.argtypes = [pointer, pointer, ctypes.c_char_p, size, ctypes.c_char_p, ctypes.c_char_p]
    open_fn.restype = ctypes.c_int
    # int crypto_secretbox_detached(c, mac, m, mlen, n, k)
    seal_fn.argtypes = [pointer, ctypes.c_char_p, pointer, size, ctypes.c_char_p, ctypes.c_char_p]
    seal_fn.restype = ctypes.c_int
    return lib


def detached_available() -> bool:
    """Whether the in-place path is available (else the one-copy-per-chunk fallback is used)."""
    return _library() is not None


def _as_bytes(view: memoryview) -> memoryview:
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.readonly:
        raise TypeError("decryption and encryption work in place: pass a writable buffer")
    return view


def open_in_place(
    view: memoryview, mac: bytes, nonce: bytes, key: bytes, *, force_fallback: bool = False
) -> bool:
    """Decrypt ``view`` in place; False (and ``view`` unchanged) when the MAC does not verify."""
    view = _as_bytes(view)
    n = view.nbytes
    lib = None if force_fallback else _library()
    if lib is not None:
        array = (ctypes.c_char * n).from_buffer(view)
        try:
            return int(lib.crypto_secretbox_open_detached(array, array, mac, n, nonce, key)) == 0
        finally:
            del array
    return _open_combined(view, mac, nonce, key)


def seal_in_place(view: memoryview, nonce: bytes, key: bytes, *, force_fallback: bool = False) -> bytes:
    """Encrypt ``view`` in place and return its 16-byte MAC."""
    view = _as_bytes(view)
    n = view.nbytes
    lib = None if force_fallback else _library()
    if lib is not None:
        mac = ctypes.create_string_buffer(_MAC)
        array = (ctypes.c_char * n).from_buffer(view)
        try:
            if lib.crypto_secretbox_detached(array, mac, array, n, nonce, key) != 0:
                raise RuntimeError("crypto_secretbox_detached failed")
        finally:
            del array
        return mac.raw
    return _seal_combined(view, nonce, key)


# --- the fallback: pynacl's combined-mode bindings, one copy of the chunk each way -------------------------


def _open_combined(view: memoryview, mac: bytes, nonce: bytes, key: bytes) -> bool:
    from nacl import bindings, exceptions

    try:
        plain = bindings.crypto_secretbox_open(mac + view.tobytes(), nonce, key)
    except exceptions.CryptoError:
        return False
    view[:] = plain
    return True


def _seal_combined(view: memoryview, nonce: bytes, key: bytes) -> bytes:
    from nacl import bindings

    sealed = bindings.crypto_secretbox(view.tobytes(), nonce, key)
    view[:] = memoryview(sealed)[_MAC:]
    return bytes(sealed[:_MAC])
