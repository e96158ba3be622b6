"""Writing tensorizer files that the real tensorizer (2.12) loads with ``verify_hash=True``.

Layout decisions, all as tensorizer makes them (docs/tensorizer-format.md): records back to back after the
metadata
block with no alignment; CRC32 and SHA-256 in plain headers, SHA-256 only plus a crypt_info block in
encrypted ones (an empty block for tensors without data); the data version raised to the highest feature
used (1; 2 for opaque dtypes; 3 when encrypted; 4 for meta tensors; 5, with versioned index entries, for a
dimension >= 2**32); flags written only from version 4.

Where we differ, on purpose:

- The prologue and index are written once, at :meth:`close`. Until then the file starts with zeros, so an
  interrupted write leaves a file every reader refuses (bad magic) rather than a valid-looking prefix.
- The metadata block: a fixed reservation (``metadata_size``, 256 KiB by default, as tensorizer) that a
  first :meth:`write_state_dict` / :meth:`write_module` call grows to fit, since it knows every name before
  writing any data. After data is written the block cannot move, and a tensor whose entry would not fit is
  refused (ConfigError) before any of its bytes are written.
- Writes go through ``os.pwrite`` of the array's own memory (a C-contiguous numpy array or CPU tensor is
  not copied). Encryption copies each plaintext chunk (2 MiB by default) into one reused scratch buffer and
  encrypts it there, so the caller's tensor is never modified and never copied whole.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import IO, Any

from modelload.loader.dtypes import DType
from modelload.loader.errors import ConfigError, DuplicateNameError
from modelload.loader.formats._index import MAX_NDIM
from modelload.loader.formats.tensorizer._arrays import TensorSpec, describe, flat_bytes, is_torch_tensor
from modelload.loader.formats.tensorizer.crypt_info import NONCE_BYTES, Cipher, CryptInfo
from modelload.loader.formats.tensorizer.crypto import ChunkSealer, NonceLedger
from modelload.loader.formats.tensorizer.file_header import (
    DEFAULT_METADATA_SIZE,
    FLAG_ENCRYPTED,
    FLAG_VERSIONED_HEADERS,
    MAX_METADATA_SIZE,
    PROLOGUE_SIZE,
    VERSION_ENCRYPTED,
    VERSION_LONG_DIMS,
    VERSION_META,
    VERSION_OPAQUE,
    VERSION_PLAIN,
    FileHeader,
)
from modelload.loader.formats.tensorizer.hashes import RunningHashes
from modelload.loader.formats.tensorizer.index import pack_entry
from modelload.loader.formats.tensorizer.keys import EncryptionParams
from modelload.loader.formats.tensorizer.names import (
    Path,
    PathError,
    PathTree,
    encode_name,
    join_path,
    normalize_path,
)
from modelload.loader.formats.tensorizer.tensor_header import (
    HASH_CRC32,
    HASH_SHA256,
    LONG_DIM,
    Kind,
    build_tensor_header,
)

__all__ = ["TensorizerWriter"]

_MAX_NAME = 0xFFFF
_MAX_DTYPE = 0xFF
_MAX_NDIM = MAX_NDIM  # the field holds 255, but no reader can load more than this
_MAX_MODULE_IDX = 0xFFFF
_END_MARKER = bytes(8)
_TEXT_NAMES = "give names as real text (a name decoded with errors='surrogateescape' is not)"


@dataclass
class _Entry:
    body: bytes
    """The entry without its version tag."""
    long_dims: bool


class TensorizerWriter:
    """Writes a tensorizer file from numpy arrays and torch tensors.

    ``file`` is a path (created or truncated) or a seekable binary file object, written from offset 0. One
    writer is used from one thread at a time. After an error inside a ``with`` block the writer aborts and
    the file stays unreadable; outside one, call :meth:`abort` or :meth:`close` yourself (a tensor that
    was refused was not written, so closing keeps the ones before it).

    >>> with TensorizerWriter("model.tensors") as writer:                    # doctest: +SKIP
    ...     writer.write_state_dict(model.state_dict())
    >>> with TensorizerWriter("m.tensors", encryption=EncryptionParams.random()) as writer:  # doctest: +SKIP
    ...     writer.write_module(model)
    """

    def __init__(
        self,
        file: str | os.PathLike[str] | IO[bytes],
        *,
        encryption: EncryptionParams | None = None,
        metadata_size: int = DEFAULT_METADATA_SIZE,
    ) -> None:
        if not 0 <= metadata_size <= MAX_METADATA_SIZE:
            raise ConfigError(
                f"metadata_size must be between 0 and {MAX_METADATA_SIZE} bytes, got {metadata_size}"
            )
        if isinstance(file, str | os.PathLike):
            self._file: IO[bytes] = FsPath(file).open("w+b")  # noqa: SIM115 - closed by close()
            self._owned = True
        else:
            self._file = file
            self._owned = False
        try:
            self._fd: int | None = self._file.fileno()
        except (OSError, AttributeError, io.UnsupportedOperation):
            self._fd = None
        self._encryption = encryption
        self._metadata_size = metadata_size
        self._data_started = False
        self._pos = 0
        self._entries: list[_Entry] = []
        self._tree = PathTree()
        self._names: set[str] = set()
        self._version = VERSION_ENCRYPTED if encryption is not None else VERSION_PLAIN
        self._tensor_size = 0
        self._nonces = NonceLedger()
        self._scratch: bytearray | None = None
        self._closed = False
        self._pwrite(bytes(PROLOGUE_SIZE), 0)

    # --- public API --------------------------------------------------------------------------------------

    def write_tensor(
        self,
        name: str | Sequence[str | int],
        tensor: Any,
        *,
        kind: Kind = "state_dict",
        module_idx: int = 0,
        dtype: str | None = None,
    ) -> None:
        """Write one tensor. ``name`` is a str key or a structured path (``("layers", 0, "w")``).

        ``kind`` is tensorizer's tensor type (``"param"``/``"buffer"`` for ``load_into_module``, which also
        needs ``module_idx``); ``dtype`` reinterprets a numpy array's raw bits (``"bfloat16"`` for uint16).
        """
        spec = describe(tensor, dtype=dtype)
        path = self._check_name(name, kind)
        self._reserve_block([(path, spec)])
        self._register([path])
        self._write_record(path, spec, kind=kind, module_idx=module_idx)

    def reserve(self, tensors: Iterable[tuple[str | Sequence[str | int], DType, tuple[int, ...]]]) -> None:
        """Size the metadata block for tensors that will be written one at a time with :meth:`write_tensor`
        (``(name, dtype, shape)`` each), before any data: the block is fixed at the first data write.

        What a streaming converter calls, which knows every tensor's name and shape but holds one tensor's
        bytes at a time. Raises ConfigError when the index cannot fit in any block.
        """
        if self._data_started:
            raise ConfigError("reserve() comes before the first tensor is written")
        self._reserve_block(
            [
                (self._check_name(name, "state_dict"), TensorSpec(dtype, shape, False, None))
                for name, dtype, shape in tensors
            ]
        )

    def write_state_dict(self, state_dict: Mapping[str, Any] | Sequence[Any]) -> None:
        """Write every tensor of a flat or nested state_dict (dicts with str keys, lists, tuples)."""
        try:
            items = [(normalize_path(path), describe(value)) for path, value in _flatten(state_dict, ())]
        except PathError as exc:
            raise ConfigError(f"state_dict: {exc}; {_TEXT_NAMES}") from None
        for path, _ in items:
            self._check_path(path, "state_dict")
        self._reserve_block(items)
        self._register([path for path, _ in items])
        for path, spec in items:
            self._write_record(path, spec, kind="state_dict", module_idx=0)

    def write_module(self, module: Any, *, include_non_persistent_buffers: bool = True) -> None:
        """Write a torch module's parameters and buffers as tensorizer's ``write_module`` does.

        Names are ``f"{module_name}.{name}"`` (``".weight"`` for the root module's own), module indices
        follow ``named_modules()``, parameters come before buffers within a module.
        """
        items: list[tuple[Path, TensorSpec, Kind, int]] = []
        for idx, (module_name, sub) in enumerate(module.named_modules()):
            skip = (
                set()
                if include_non_persistent_buffers
                else set(getattr(sub, "_non_persistent_buffers_set", ()))
            )
            for name, value in sub.named_parameters(recurse=False):
                items.append(((f"{module_name}.{name}",), describe(value), "param", idx))
            for name, value in sub.named_buffers(recurse=False):
                if name not in skip:
                    items.append(((f"{module_name}.{name}",), describe(value), "buffer", idx))
        for path, _, kind, _ in items:
            self._check_path(path, kind)
        self._reserve_block([(path, spec) for path, spec, _, _ in items])
        self._register([path for path, _, _, _ in items])
        for path, spec, kind, idx in items:
            self._write_record(path, spec, kind=kind, module_idx=idx)

    def close(self) -> None:
        """Write the prologue, the index and the end marker, and close the file if we opened it."""
        if self._closed:
            return
        self._closed = True
        try:
            self._reserve_block([])
            self._finish()
        finally:
            if self._owned:
                self._file.close()

    def abort(self) -> None:
        """Stop without writing the index: the file stays unreadable (it starts with zeros)."""
        self._closed = True
        if self._owned:
            self._file.close()

    def __enter__(self) -> TensorizerWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # --- names and the metadata block --------------------------------------------------------------------

    def _check_name(self, name: str | Sequence[str | int], kind: Kind) -> Path:
        try:
            path = normalize_path(name)
        except PathError as exc:
            raise ConfigError(f"tensor name {name!r}: {exc}; {_TEXT_NAMES}") from None
        self._check_path(path, kind)
        return path

    def _check_path(self, path: Path, kind: Kind) -> None:
        structured = not (len(path) == 1 and isinstance(path[0], str))
        if structured and kind != "state_dict":
            raise ConfigError(
                f"tensor {path!r}: a {kind} needs a plain str name; structured paths are for state_dicts"
            )
        if len(encode_name(path)) > _MAX_NAME:
            raise ConfigError(
                f"tensor name {join_path(path)[:60]!r}...: longer than {_MAX_NAME} bytes when encoded"
            )

    def _register(self, paths: Sequence[Path]) -> None:
        """Record the names of tensors about to be written; all or nothing, before any data is written."""
        batch = len(paths) > 1
        tree = self._tree.copy() if batch else self._tree
        names = set(self._names) if batch else self._names
        for path in paths:
            name = join_path(path)
            if name in names:
                raise DuplicateNameError(f"a tensor named {name!r} is written twice; names must be unique")
            try:
                tree.add(path)
            except PathError as exc:
                if exc.duplicate:
                    raise DuplicateNameError(str(exc)) from None
                raise ConfigError(
                    f"tensor {name!r}: {exc}; tensorizer could not rebuild the structure"
                ) from None
            names.add(name)
        self._tree, self._names = tree, names

    def _index_bytes(self, extra: Sequence[tuple[Path, TensorSpec]]) -> int:
        long_any = any(e.long_dims for e in self._entries) or any(_is_long(s) for _, s in extra)
        total = sum(len(e.body) for e in self._entries)
        total += sum(_entry_size(p, s) for p, s in extra)
        return total + (4 * (len(self._entries) + len(extra)) if long_any else 0)

    def _reserve_block(self, upcoming: Sequence[tuple[Path, TensorSpec]]) -> None:
        """Fix the metadata block's size at the first data write (growing it to fit what is known), and
        refuse a tensor whose index entry would not fit in the fixed block."""
        needed = self._index_bytes(upcoming)
        if not self._data_started:
            if needed > MAX_METADATA_SIZE:
                raise ConfigError(
                    f"the index of these tensors needs {needed} bytes, above {MAX_METADATA_SIZE}"
                )
            self._metadata_size = max(self._metadata_size, needed)
            return
        if needed > self._metadata_size:
            raise ConfigError(
                f"too many tensors: the index needs {needed} bytes but the metadata block holds "
                f"{self._metadata_size}; create the writer with metadata_size={_round_up(needed * 2)}, or "
                "write every tensor in one write_state_dict/write_module call, which sizes the block to fit"
            )

    # --- records -----------------------------------------------------------------------------------------

    def _write_record(self, path: Path, spec: TensorSpec, *, kind: Kind, module_idx: int) -> None:
        if not self._data_started:
            self._data_started = True
            self._pos = PROLOGUE_SIZE + self._metadata_size
        if not 0 <= module_idx <= _MAX_MODULE_IDX:
            raise ConfigError(f"module_idx {module_idx} does not fit in 16 bits")
        if len(spec.shape) > _MAX_NDIM:
            raise ConfigError(
                f"tensor {join_path(path)!r} has {len(spec.shape)} dimensions; at most {_MAX_NDIM}"
            )
        name = encode_name(path)
        dtype = spec.dtype.tensorizer.encode("utf-8")
        long_dims = _is_long(spec)
        data_length = 0 if spec.meta else spec.nbytes
        crypt, sealer = self._crypt_for(data_length)
        layout = build_tensor_header(
            module_idx=module_idx,
            kind=kind,
            name=name,
            dtype=dtype,
            shape=spec.shape,
            long_dims=long_dims,
            hash_kinds=(HASH_SHA256,) if self._encryption is not None else (HASH_CRC32, HASH_SHA256),
            crypt=crypt,
            data_length=data_length,
        )
        header_at = self._pos
        data_at = header_at + len(layout.buffer)
        hashes = RunningHashes(*layout.hashable_parts())
        if data_length:
            data = flat_bytes(spec)
            if sealer is None:
                hashes.update(data)
                self._pwrite(data, data_at)
            else:
                self._write_sealed(data, data_at, hashes, sealer)
                assert crypt is not None and crypt.cipher is not None
                cipher = Cipher(crypt.cipher.chunk_size, crypt.cipher.nonce, bytes(sealer.macs))
                layout.set_crypt_info(CryptInfo(kdf=crypt.kdf, cipher=cipher).pack())
        crc, sha = hashes.digests()
        if HASH_CRC32 in layout.hash_offsets:
            layout.set_hash(HASH_CRC32, crc.to_bytes(4, "little"))
        layout.set_hash(HASH_SHA256, sha)
        self._pwrite(layout.buffer, header_at)
        self._pos = data_at + data_length
        self._tensor_size += data_length
        body = pack_entry(
            name=name,
            kind=kind,
            dtype=dtype,
            shape=spec.shape,
            long_dims=long_dims,
            header_offset=header_at,
            data_offset=data_at,
            data_length=data_length,
            versioned=False,
        )
        self._entries.append(_Entry(body, long_dims))
        self._version = max(
            self._version,
            VERSION_OPAQUE if spec.dtype.opaque else VERSION_PLAIN,
            VERSION_META if spec.meta else VERSION_PLAIN,
            VERSION_LONG_DIMS if long_dims else VERSION_PLAIN,
        )

    def _crypt_for(self, data_length: int) -> tuple[CryptInfo | None, ChunkSealer | None]:
        params = self._encryption
        if params is None:
            return None, None
        if data_length == 0:
            return CryptInfo(), None  # tensorizer's readers expect an empty block on data-less tensors
        chunks = -(-data_length // params.chunk_size)
        nonce = self._fresh_nonce(chunks)
        placeholder = Cipher(params.chunk_size, nonce, bytes(16 * chunks))
        sealer = ChunkSealer(key=params.key, nonce=nonce, chunk_size=params.chunk_size)
        return CryptInfo(kdf=params.kdf, cipher=placeholder), sealer

    def _fresh_nonce(self, chunks: int) -> bytes:
        """A random first nonce whose ``chunks`` consecutive nonces were never used in this file."""
        while True:
            nonce = secrets.token_bytes(NONCE_BYTES)
            if self._nonces.claim(nonce, chunks):
                return nonce

    def _write_sealed(self, data: memoryview, at: int, hashes: RunningHashes, sealer: ChunkSealer) -> None:
        size = sealer.chunk_size
        if self._scratch is None or len(self._scratch) < min(size, data.nbytes):
            self._scratch = bytearray(min(size, max(data.nbytes, 1)))
        scratch = memoryview(self._scratch)
        for index, start in enumerate(range(0, data.nbytes, size)):
            plain = data[start : start + size]
            hashes.update(plain)
            chunk = scratch[: plain.nbytes]
            chunk[:] = plain
            sealer.seal(index, chunk)
            self._pwrite(chunk, at + start)

    # --- finishing and raw I/O ---------------------------------------------------------------------------

    def _finish(self) -> None:
        if not self._data_started:
            self._pos = PROLOGUE_SIZE + self._metadata_size
        versioned = any(e.long_dims for e in self._entries)
        block = bytearray(self._metadata_size)
        at = 0
        for entry in self._entries:
            tag = (5 if entry.long_dims else 1).to_bytes(4, "little") if versioned else b""
            piece = tag + entry.body
            block[at : at + len(piece)] = piece
            at += len(piece)
        assert at <= self._metadata_size
        encrypted = self._encryption is not None
        flags = (FLAG_ENCRYPTED if encrypted else 0) | (FLAG_VERSIONED_HEADERS if versioned else 0)
        header = FileHeader(self._version, flags, self._tensor_size, len(self._entries), self._metadata_size)
        self._pwrite(_END_MARKER, self._pos)
        self._pwrite(block, PROLOGUE_SIZE)
        self._pwrite(header.pack(), 0)
        if hasattr(self._file, "truncate"):
            self._file.flush()
            self._file.truncate(self._pos + len(_END_MARKER))
        self._file.flush()

    def _pwrite(self, data: bytes | bytearray | memoryview, offset: int) -> None:
        view = memoryview(data)
        if self._fd is None:
            self._file.seek(offset)
            self._file.write(view)
            return
        done = 0
        while done < view.nbytes:
            done += os.pwrite(self._fd, view[done:], offset + done)


def _is_long(spec: TensorSpec) -> bool:
    return any(d >= LONG_DIM for d in spec.shape)


def _entry_size(path: Path, spec: TensorSpec) -> int:
    dims = (8 if _is_long(spec) else 4) * len(spec.shape)
    return 2 + len(encode_name(path)) + 1 + 1 + len(spec.dtype.tensorizer.encode()) + 1 + dims + 24


def _round_up(n: int, quantum: int = 4096) -> int:
    return -(-n // quantum) * quantum


def _flatten(obj: Any, prefix: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(path, leaf) for every tensor of nested dicts (str keys) and lists/tuples, in order."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            if not isinstance(key, str):
                raise ConfigError(f"state_dict keys must be str, got {key!r} at {prefix!r}")
            yield from _leaf_or_branch(value, (*prefix, key))
    elif isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        for index, value in enumerate(obj):
            yield from _leaf_or_branch(value, (*prefix, index))
    else:
        raise ConfigError(f"a state_dict is a dict or list of tensors, not {type(obj).__name__}")


def _leaf_or_branch(value: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    import numpy as np

    if is_torch_tensor(value) or isinstance(value, np.ndarray | np.generic):
        yield path, value
    else:
        yield from _flatten(value, path)
