"""The worked example of the format spec (section 4.12), reproduced byte for byte by our writer.

The expected bytes are spelled out here from the spec's listing, field by field; only the SHA-256 values
(elided in the spec) and the second CRC32 are computed, with zlib and hashlib directly from the spec's rule
(header with hash values zeroed, then data), not through the code under test.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import numpy as np

from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
    parse_tensor_header,
    read_index,
)


def _with_hashes(header: bytes, data: bytes, crc_at: int, sha_at: int) -> bytes:
    crc = zlib.crc32(header + data)
    sha = hashlib.sha256(header + data).digest()
    out = bytearray(header)
    out[crc_at : crc_at + 4] = struct.pack("<I", crc)
    out[sha_at : sha_at + 32] = sha
    return bytes(out)


def expected_example() -> bytes:
    u64 = lambda n: struct.pack("<Q", n)  # noqa: E731
    prologue = b"|TZR|" + struct.pack("<I", 2) + bytes(32) + u64(20) + bytes(8) + u64(2) + u64(262144)
    entry_a = bytes.fromhex("01006100033c66320104000000") + u64(0x40049) + u64(0x40093) + u64(8)
    dtype_b = b"<V2\x00torch.bfloat16"
    entry_b = (
        bytes.fromhex("01006201") + bytes([len(dtype_b)]) + dtype_b + bytes.fromhex("020200000003000000")
    )
    entry_b += u64(0x4009B) + u64(0x400F8) + u64(12)
    block = (entry_a + entry_b).ljust(262144, b"\x00")

    hashes_zeroed = bytes.fromhex("2900020004000000000120") + bytes(32)
    header_a = u64(74) + bytes.fromhex("000000010061033c66320104000000") + hashes_zeroed + u64(8)
    data_a = bytes.fromhex("0000003c00400042")  # fp16 0, 1, 2, 3
    header_a = _with_hashes(header_a, data_a, crc_at=8 + 15 + 5, sha_at=8 + 15 + 11)
    assert header_a[28:32] == bytes.fromhex("98626301"), "the spec's CRC32 of tensor a"

    header_b = u64(93) + bytes.fromhex("000001010062") + bytes([len(dtype_b)]) + dtype_b
    header_b += bytes.fromhex("020200000003000000") + hashes_zeroed + u64(12)
    data_b = bytes.fromhex("803f") * 6  # bf16 ones
    header_b = _with_hashes(header_b, data_b, crc_at=42 + 5, sha_at=42 + 11)

    return prologue + block + header_a + data_a + header_b + data_b + u64(0)


def write_example(path: Path, **writer_args: object) -> None:
    with TensorizerWriter(path, **writer_args) as writer:  # type: ignore[arg-type]
        writer.write_tensor("a", np.array([0, 1, 2, 3], dtype=np.float16), kind="param")
        writer.write_tensor("b", np.full((2, 3), 0x3F80, dtype=np.uint16), kind="buffer", dtype="bfloat16")


def test_our_writer_reproduces_the_spec_example_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "example.tensors"
    write_example(path)
    expected = expected_example()
    assert len(expected) == 0x4010C
    assert path.read_bytes() == expected


def test_the_spec_example_parses_to_the_spec_fields() -> None:
    data = expected_example()
    index = read_index(data)
    assert index.version == 2 and not index.encrypted
    assert index.index_length == 73 + 262144 and index.data_end == 0x40104
    a, b = index.tensors
    assert (a.name, a.kind, a.dtype.name, a.shape) == ("a", "param", "float16", (4,))
    assert (a.record_offset, a.data_offset, a.data_length) == (0x40049, 0x40093, 8)
    assert (b.name, b.kind, b.dtype.name, b.shape) == ("b", "buffer", "bfloat16", (2, 3))
    assert (b.record_offset, b.data_offset, b.data_length) == (0x4009B, 0x400F8, 12)
    header = parse_tensor_header(data[a.record_offset :], entry=a, encrypted_file=False)
    assert header.size == 74 and header.module_idx == 0 and header.crypt is None
    assert (header.hashes[0].kind, header.hashes[0].value) == (0, bytes.fromhex("98626301"))


def test_the_spec_example_reads_back_to_its_values(tmp_path: Path) -> None:
    path = tmp_path / "example.tensors"
    path.write_bytes(expected_example())
    with TensorizerReader(path) as reader:
        assert reader.read_numpy("a").tolist() == [0.0, 1.0, 2.0, 3.0]
        assert reader.read_numpy("b").tolist() == [[0x3F80] * 3] * 2  # bf16 bits, carried as uint16


def test_the_encrypted_variant_has_the_spec_layout(tmp_path: Path) -> None:
    path = tmp_path / "encrypted.tensors"
    params = EncryptionParams.from_password("pw", limits=Argon2Limits.MIN, salt=b"0123456789abcdef")
    write_example(path, encryption=params)
    data = path.read_bytes()
    assert struct.unpack_from("<I", data, 5)[0] == 3
    assert data[9:41] == bytes(32), "flags stay zero below version 4"
    start = 0x40049
    header_size = struct.unpack_from("<Q", data, start)[0]
    assert header_size == 194
    hash_at = start + 8 + 15
    assert data[hash_at : hash_at + 5] == bytes.fromhex("2300010120")
    crypt_at = hash_at + 2 + 35
    body_len, count = struct.unpack_from("<QH", data, crypt_at)
    assert (body_len, count) == (118, 2)
    kdf_at = crypt_at + 10
    assert struct.unpack_from("<QHHQQiH", data, kdf_at) == (42, 1, 1, 1, 8192, 2, 16)
    assert data[kdf_at + 34 : kdf_at + 50] == b"0123456789abcdef"
    cipher_at = kdf_at + 50
    chunk_len, chunk_type, chunk_size = struct.unpack_from("<QHQ", data, cipher_at)
    assert (chunk_len, chunk_type, chunk_size) == (58, 2, 2097152)
    assert struct.unpack_from("<Q", data, cipher_at + 18 + 24)[0] == 1  # one MAC
    assert struct.unpack_from("<q", data, start + header_size - 8)[0] == 8
    assert data[start + header_size : start + header_size + 8] != bytes.fromhex("0000003c00400042")
    with TensorizerReader(path, key=params.decryption_key()) as reader:
        assert reader.read_numpy("a").tolist() == [0.0, 1.0, 2.0, 3.0]
