"""Encryption: keys that never show themselves, in-place chunked decryption, the fallback path, Argon2id."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import errors
from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    DecryptionKey,
    EncryptionParams,
    TensorDecryptor,
    TensorHasher,
    TensorizerReader,
    TensorizerWriter,
    _sodium,
    decrypt_in_place,
    keys,
    parse_tensor_header,
    read_index,
    verify,
)
from modelload.loader.formats.tensorizer.crypt_info import Cipher, CryptInfo
from modelload.loader.formats.tensorizer.crypto import NonceLedger, nonce_add
from modelload.loader.formats.tensorizer.tensor_header import HASH_SHA256, build_tensor_header

KEY = bytes(range(100, 132))
PLAIN = np.arange(1000, dtype=np.float32)  # 4000 bytes: four 1 KiB chunks


@pytest.fixture
def encrypted(tmp_path: Path) -> Path:
    path = tmp_path / "enc.tensors"
    with TensorizerWriter(path, encryption=EncryptionParams.from_key(KEY, chunk_size=1024)) as writer:
        writer.write_tensor("w", PLAIN)
        writer.write_tensor("v", np.arange(3, dtype=np.int64))
    return path


def record_of(path: Path, name: str) -> tuple[bytearray, int, object]:
    """The record's bytes (header + data) in a fresh bytearray, the header size, and the index entry."""
    data = path.read_bytes()
    index = read_index(data)
    entry = next(t for t in index.tensors if t.name == name)
    record = bytearray(data[entry.record_offset : entry.data_offset + entry.data_length])
    return record, entry.data_offset - entry.record_offset, entry


def test_decryption_happens_in_the_callers_buffer(encrypted: Path) -> None:
    record, header_size, entry = record_of(encrypted, "w")
    header = parse_tensor_header(record, entry=entry, encrypted_file=True)  # type: ignore[arg-type]
    data = memoryview(record)[header_size:]
    assert bytes(data) != PLAIN.tobytes()
    decrypt_in_place(header, data, DecryptionKey.from_bytes(KEY))
    assert bytes(record[header_size:]) == PLAIN.tobytes(), "the bytearray itself now holds the plaintext"
    verify(header, data)


def test_chunks_decrypt_in_any_order_and_hash_in_pieces(encrypted: Path) -> None:
    record, header_size, entry = record_of(encrypted, "w")
    header = parse_tensor_header(record, entry=entry)  # type: ignore[arg-type]
    segment = np.frombuffer(bytearray(record[header_size:]), dtype=np.uint8)  # a writable numpy buffer
    decryptor = TensorDecryptor(header, DecryptionKey.from_bytes(KEY))
    spans = [decryptor.chunk_span(k) for k in range(decryptor.chunk_count)]
    assert spans == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 928)]
    for k in reversed(range(decryptor.chunk_count)):
        start, length = spans[k]
        decryptor.decrypt_chunk(k, segment.data[start : start + length])
    assert segment.tobytes() == PLAIN.tobytes()
    hasher = TensorHasher(header)
    for start, length in spans:
        hasher.update(segment.data[start : start + length])
    hasher.verify()
    short = TensorHasher(header)
    short.update(segment.data[:100])
    with pytest.raises(errors.SizeMismatchError, match="100 bytes were hashed"):
        short.verify()


def test_the_combined_mode_fallback_gives_the_same_bytes(
    encrypted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nonce = os.urandom(24)
    detached, combined = bytearray(PLAIN.tobytes()), bytearray(PLAIN.tobytes())
    mac = _sodium.seal_in_place(memoryview(detached), nonce, KEY)
    assert _sodium.seal_in_place(memoryview(combined), nonce, KEY, force_fallback=True) == mac
    assert detached == combined
    assert _sodium.open_in_place(memoryview(combined), mac, nonce, KEY, force_fallback=True)
    assert bytes(combined) == PLAIN.tobytes()
    assert not _sodium.open_in_place(memoryview(detached), bytes(16), nonce, KEY, force_fallback=True)
    monkeypatch.setattr(_sodium, "_library", lambda: None)
    with TensorizerReader(encrypted, key=DecryptionKey.from_bytes(KEY)) as reader:
        assert reader.read_numpy("w").tobytes() == PLAIN.tobytes()


def test_the_detached_functions_are_found_in_the_bundled_libsodium() -> None:
    assert _sodium.detached_available()


def test_nonces_increase_as_192_bit_little_endian_integers() -> None:
    assert nonce_add(b"\xff" * 24, 1) == bytes(24)
    assert nonce_add(b"\xff" + bytes(23), 1) == b"\x00\x01" + bytes(22)
    lib = _sodium._library()
    nonce = bytearray(os.urandom(24))
    expected = nonce_add(bytes(nonce), 3)
    buf = (ctypes.c_ubyte * 24).from_buffer(nonce)
    for _ in range(3):
        lib.sodium_increment(buf, ctypes.c_size_t(24))  # libsodium's own increment, as tensorizer uses
    del buf
    assert bytes(nonce) == expected


def test_the_writer_never_reuses_a_nonce_range() -> None:
    ledger = NonceLedger()
    base = (10**20).to_bytes(24, "little")
    assert ledger.claim(base, 4)
    assert not ledger.claim(nonce_add(base, 3), 1), "overlaps the last chunk"
    assert not ledger.claim(nonce_add(base, -2), 3), "runs into the first chunk"
    assert ledger.claim(nonce_add(base, 4), 2) and ledger.claim(nonce_add(base, -2), 2)
    top = (2**192 - 1).to_bytes(24, "little")
    assert ledger.claim(top, 3), "wraps around to 0 and 1"
    assert not ledger.claim(bytes(24), 1)


def test_a_sequential_chunk_decrypts_as_one_box() -> None:
    plain = bytes(range(256)) * 10
    nonce = os.urandom(24)
    sealed = bytearray(plain)
    mac = _sodium.seal_in_place(memoryview(sealed), nonce, KEY)
    crypt = CryptInfo(cipher=Cipher(chunk_size=len(plain), nonce=nonce, macs=mac, sequential=True))
    layout = build_tensor_header(
        module_idx=0,
        kind="state_dict",
        name=b"s",
        dtype=b"|u1",
        shape=(len(plain),),
        long_dims=False,
        hash_kinds=(HASH_SHA256,),
        crypt=crypt,
        data_length=len(plain),
    )
    header = parse_tensor_header(bytes(layout.buffer), encrypted_file=True)
    assert header.crypt is not None and header.crypt.cipher is not None and header.crypt.cipher.sequential
    decrypt_in_place(header, memoryview(sealed), DecryptionKey.from_bytes(KEY))
    assert bytes(sealed) == plain


def test_keys_and_passwords_never_show_in_reprs_or_errors(encrypted: Path) -> None:
    secret = "hunter2-correct-horse"
    for obj in (
        DecryptionKey.from_bytes(KEY),
        DecryptionKey.from_password(secret),
        EncryptionParams.from_key(KEY),
        EncryptionParams.from_password(secret, limits=Argon2Limits.MIN),
    ):
        for text in (repr(obj), str(obj)):
            assert secret not in text and KEY.hex() not in text and repr(KEY)[2:20] not in text
    with pytest.raises(errors.WrongKeyError) as caught:
        TensorizerReader(encrypted, key=DecryptionKey.from_password(secret)).read_numpy("w")
    assert secret not in str(caught.value)


def test_key_files_hold_exactly_32_bytes(tmp_path: Path) -> None:
    good = tmp_path / "key"
    good.write_bytes(KEY)
    assert DecryptionKey.from_file(good).raw_key(None, tensor="x") == KEY
    newline = tmp_path / "key-nl"
    newline.write_bytes(KEY + b"\n")
    with pytest.raises(errors.ConfigError, match=r"33 bytes \(a trailing newline") as caught:
        DecryptionKey.from_file(newline)
    assert KEY.hex() not in str(caught.value)
    with pytest.raises(errors.ConfigError, match="exactly 32 bytes"):
        EncryptionParams.from_key(b"short")


def test_a_password_file_drops_one_trailing_newline(tmp_path: Path) -> None:
    path = tmp_path / "pw.tensors"
    with TensorizerWriter(
        path, encryption=EncryptionParams.from_password("pw", limits=Argon2Limits.MIN)
    ) as w:
        w.write_tensor("x", PLAIN[:10])
    password_file = tmp_path / "password"
    password_file.write_bytes(b"pw\n")
    with TensorizerReader(path, key=DecryptionKey.from_password_file(password_file)) as reader:
        assert reader.read_numpy("x").tobytes() == PLAIN[:10].tobytes()


def test_argon2id_runs_once_per_salt_and_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    params = EncryptionParams.from_password("pw", limits=Argon2Limits.MIN)
    path = tmp_path / "pw.tensors"
    with TensorizerWriter(path, encryption=params) as writer:
        for i in range(3):
            writer.write_tensor(f"t{i}", PLAIN[: 10 + i])
    calls = []
    real = keys._derive

    def counting(password: bytes, kdf: object) -> bytes:
        calls.append(kdf)
        return real(password, kdf)  # type: ignore[arg-type]

    monkeypatch.setattr(keys, "_derive", counting)
    with TensorizerReader(path, key=DecryptionKey.from_password("pw")) as reader:
        for i in range(3):
            assert reader.read_numpy(f"t{i}").tobytes() == PLAIN[: 10 + i].tobytes()
    assert len(calls) == 1


def test_a_raw_key_opens_a_password_encrypted_file(tmp_path: Path) -> None:
    params = EncryptionParams.from_password("pw", limits=Argon2Limits.MIN)
    path = tmp_path / "pw.tensors"
    with TensorizerWriter(path, encryption=params) as writer:
        writer.write_tensor("x", PLAIN)
    with TensorizerReader(path, key=DecryptionKey.from_bytes(params.key)) as reader:
        assert reader.read_numpy("x").tobytes() == PLAIN.tobytes()


def test_encryption_leaves_the_callers_array_untouched(tmp_path: Path) -> None:
    array = PLAIN.copy()
    with TensorizerWriter(
        tmp_path / "e.tensors", encryption=EncryptionParams.random(chunk_size=1024)
    ) as writer:
        writer.write_tensor("x", array)
    assert array.tobytes() == PLAIN.tobytes()


def test_bad_encryption_settings_are_config_errors() -> None:
    with pytest.raises(errors.ConfigError, match="multiple of 64"):
        EncryptionParams.random(chunk_size=1000)
    with pytest.raises(errors.ConfigError, match="salt is exactly 16"):
        EncryptionParams.from_password("pw", limits=Argon2Limits.MIN, salt=b"short")
    with pytest.raises(errors.ConfigError, match="outside what readers accept"):
        EncryptionParams.from_password("pw", limits=Argon2Limits(64, 8192))
