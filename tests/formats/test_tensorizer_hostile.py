"""A hostile corpus: valid files broken one rule at a time, each refused with its own error and message.

Every case starts from a valid file our writer made (checked valid by tensorizer's interop tests) and
changes a few bytes. Each asserts the exact error class (not a subclass or a parent) and that the message
says what is wrong. The cases that claim huge sizes are also run in a child process whose address space is
capped, so a reader that allocated what the file claims would fail there with MemoryError.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import errors
from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    DecryptionKey,
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
    parse_tensor_header,
    read_index,
)
from tests.formats.tensorizer_support import Surgery, torch

KEY = bytes(range(32))


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """Three tensors behind a metadata block sized exactly to the index (so overruns leave the block)."""
    path = tmp_path / "plain.tensors"
    tensors = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.int16),
        "c": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
    }
    with TensorizerWriter(path, metadata_size=0) as writer:
        writer.write_state_dict(tensors)
    return path


@pytest.fixture
def encrypted(tmp_path: Path) -> Path:
    """A raw-key file: "big" spans three 1 KiB chunks, "small" one."""
    path = tmp_path / "encrypted.tensors"
    with TensorizerWriter(path, encryption=EncryptionParams.from_key(KEY, chunk_size=1024)) as writer:
        writer.write_tensor("big", np.arange(600, dtype=np.float32))
        writer.write_tensor("small", np.arange(4, dtype=np.float16))
    return path


def load_all(path: Path, *, key: DecryptionKey | None = None, verify: bool = True) -> None:
    with TensorizerReader(path, key=key, verify=verify) as reader:
        for entry in reader.index.tensors:
            reader.readinto(entry, bytearray(entry.nbytes))


def expect(error: type[Exception], match: str, action: Callable[[], object]) -> str:
    with pytest.raises(errors.ModelloadError) as caught:
        action()
    assert type(caught.value) is error, f"{type(caught.value).__name__}: {caught.value}"
    message = str(caught.value)
    assert match.lower() in message.lower(), message
    return message


def mutated(path: Path, change: Callable[[Surgery], object]) -> Path:
    surgery = Surgery(path)
    change(surgery)
    return surgery.write(path.with_suffix(".bad"))


# --- the file header ---------------------------------------------------------------------------------------


def test_a_file_of_another_format_is_refused_by_its_magic(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(0, "5s", b"|TZX|"))
    expect(errors.BadMagicError, "not a tensorizer file", lambda: load_all(bad))
    safetensors_like = b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + bytes(100)
    expect(errors.BadMagicError, "not a tensorizer file", lambda: read_index(safetensors_like))


@pytest.mark.parametrize("version", [0, 6, 0xFFFFFFFF])
def test_an_unknown_data_version_is_refused(plain: Path, version: int) -> None:
    bad = mutated(plain, lambda s: s.put(5, "<I", version))
    expect(errors.UnsupportedVersionError, f"data version {version}", lambda: load_all(bad))


def test_unknown_feature_flags_are_refused(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(5, "<I", 4).put(9, "<B", 0x04))
    expect(errors.UnsupportedVersionError, "unknown feature flags 0x4", lambda: load_all(bad))


def test_flags_a_version_cannot_have_are_refused(plain: Path) -> None:
    on_v1 = mutated(plain, lambda s: s.put(9, "<B", 0x01))
    expect(errors.HeaderError, "feature flags 0x1 are set in a data version 2 file", lambda: load_all(on_v1))
    versioned_on_v4 = mutated(plain, lambda s: s.put(5, "<I", 4).put(9, "<B", 0x02))
    expect(
        errors.HeaderError, "versioned_headers flag needs data version 5", lambda: load_all(versioned_on_v4)
    )


@pytest.mark.parametrize(
    ("keep", "match"),
    [(0, "empty"), (3, "inside the magic"), (40, "file header"), (73 + 20, "metadata block")],
)
def test_a_file_cut_in_its_header_or_index_is_truncated(plain: Path, keep: int, match: str) -> None:
    data = plain.read_bytes()[:keep]
    expect(errors.TruncatedError, match, lambda: read_index(data))


def test_a_file_cut_inside_its_index_is_truncated_before_a_second_read(plain: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.tensors"
    cut.write_bytes(plain.read_bytes()[:100])
    expect(errors.TruncatedError, "the metadata block ends at byte", lambda: load_all(cut))


def test_a_file_cut_inside_a_record_is_truncated(plain: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.tensors"
    cut.write_bytes(plain.read_bytes()[:-12])  # the end marker and 4 bytes of the last tensor
    expect(errors.TruncatedError, "index entry 2 ('c'): its record ends", lambda: load_all(cut))


def test_a_huge_tensor_count_is_refused_before_the_index_is_read(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(57, "<Q", 2**60))
    calls: list[tuple[int, int]] = []
    data = bad.read_bytes()

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return data[offset : offset + length]

    expect(errors.BoundsError, f"claims {2**60} tensors", lambda: read_index(read))
    assert len(calls) == 1


def test_a_huge_metadata_length_is_refused_before_it_is_read(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(65, "<Q", 2**62))
    expect(errors.BoundsError, "above the cap", lambda: load_all(bad))


# --- the index ---------------------------------------------------------------------------------------------


def test_a_record_offset_past_the_end_of_the_file_is_refused(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(s.entry_field(2, "header_offset"), "<Q", 2**40))
    expect(errors.BoundsError, "starts at byte 1099511627776, past the end", lambda: load_all(bad))


def test_a_data_offset_past_the_end_of_the_file_is_refused(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(s.entry_field(2, "data_offset"), "<Q", 2**40))
    expect(
        errors.BoundsError, "data starts at byte 1099511627776, past the end of the", lambda: load_all(bad)
    )


def test_a_data_length_that_disagrees_with_dtype_and_shape_is_refused(plain: Path) -> None:
    for length in (8, 2**50):
        bad = mutated(plain, lambda s, n=length: s.put(s.entry_field(0, "data_length"), "<Q", n))
        expect(errors.SizeMismatchError, "float32[2, 3], which takes 24", lambda b=bad: load_all(b))


def test_overlapping_records_are_refused(plain: Path) -> None:
    def overlap(s: Surgery) -> None:
        s.put(s.entry_field(1, "header_offset"), "<Q", s.entries[0].data_offset)

    expect(errors.OverlapError, "inside the previous record", lambda: load_all(mutated(plain, overlap)))
    into_index = mutated(plain, lambda s: s.put(s.entry_field(0, "header_offset"), "<Q", 100))
    expect(errors.OverlapError, "inside the metadata block", lambda: load_all(into_index))


def test_a_gap_between_records_is_refused(plain: Path) -> None:
    def gap(s: Surgery) -> None:
        e = s.entries[1]
        s.put(s.entry_field(1, "header_offset"), "<Q", e.record_offset + 4)
        s.put(s.entry_field(1, "data_offset"), "<Q", e.data_offset + 4)

    expect(errors.OverlapError, "leaving a gap", lambda: load_all(mutated(plain, gap)))


@pytest.mark.parametrize(("field", "value"), [("name_len", 0xFFFF), ("dtype_len", 0xFF), ("ndim", 64)])
def test_lengths_in_the_index_past_the_end_of_the_block_are_refused(
    plain: Path, field: str, value: int
) -> None:
    fmt = "<H" if field == "name_len" else "<B"
    bad = mutated(plain, lambda s: s.put(s.entry_field(2, field), fmt, value))
    expect(errors.BoundsError, "index entry 2", lambda: load_all(bad))


@pytest.mark.parametrize("ndim", [65, 0xFF])
def test_more_dimensions_than_numpy_holds_are_refused_with_the_index(plain: Path, ndim: int) -> None:
    """Before: 65 dimensions in bounds reached numpy, whose ValueError escaped the error tree."""
    bad = mutated(plain, lambda s: s.put(s.entry_field(2, "ndim"), "<B", ndim))
    expect(errors.HeaderError, f"{ndim} dimensions", lambda: load_all(bad))


def test_a_structured_name_with_a_lone_surrogate_is_refused_when_read(tmp_path: Path) -> None:
    """A JSON-seq name can spell an unpaired surrogate as an escape; printing or staging it would crash."""
    path = tmp_path / "named.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict({"zzzzzz": {"w": np.zeros(2, np.float32)}})
    data = path.read_bytes()
    assert data.count(b'"zzzzzz"') == 2  # the index entry and the tensor's own header
    path.write_bytes(data.replace(b'"zzzzzz"', b'"\\ud800"'))
    expect(errors.HeaderError, "unpaired UTF-16 surrogate", lambda: load_all(path))


@pytest.mark.parametrize(
    "write",
    [
        lambda w: w.write_tensor("w\udc80", np.zeros(2)),
        lambda w: w.write_state_dict({"w\ud800": np.zeros(2)}),
        lambda w: w.write_state_dict({"layers": [{"w\ud800": np.zeros(2)}]}),
    ],
    ids=["flat tensor", "flat state_dict", "structured path"],
)
def test_the_writer_refuses_a_name_with_a_lone_surrogate(
    tmp_path: Path, write: Callable[[TensorizerWriter], None]
) -> None:
    """Before: a flat name raised UnicodeEncodeError; a structured one was written and crashed the readers."""
    with TensorizerWriter(tmp_path / "w.tensors") as writer:
        expect(errors.ConfigError, "unpaired UTF-16 surrogate", lambda: write(writer))
        writer.write_tensor("ok", np.zeros(2))
    with TensorizerReader(tmp_path / "w.tensors") as reader:
        assert [t.name for t in reader.index.tensors] == ["ok"]


def test_two_tensors_with_one_name_are_refused(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(s.entry_field(1, "name"), "1s", b"a"))
    expect(errors.DuplicateNameError, "the name 'a' is used by an earlier tensor", lambda: load_all(bad))


@pytest.mark.parametrize(
    ("dtype", "match"), [(b"<U1", "'<U1'"), (b">f4", "big-endian"), (b"<q8", "'<q8' is not a")]
)
def test_dtypes_without_a_tensor_equivalent_are_refused(plain: Path, dtype: bytes, match: str) -> None:
    bad = mutated(plain, lambda s: s.put(s.entry_field(0, "dtype"), "3s", dtype))
    expect(errors.UnsupportedDtypeError, match, lambda: load_all(bad))


def test_unparseable_index_fields_are_header_errors(plain: Path) -> None:
    kind = mutated(plain, lambda s: s.put(s.entry_field(0, "type"), "<B", 7))
    expect(errors.HeaderError, "tensor type 7", lambda: load_all(kind))
    utf8 = mutated(plain, lambda s: s.put(s.entry_field(0, "name"), "<B", 0xFF))
    expect(errors.HeaderError, "not valid UTF-8", lambda: load_all(utf8))


def test_a_bad_structured_path_is_a_header_error(tmp_path: Path) -> None:
    path = tmp_path / "nested.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict({"n": [np.zeros(2, dtype=np.float32)]})
    data = path.read_bytes()
    assert b'\x1e["n",0]' in data
    cases = [
        (b'\x1e["n",-]', "not valid JSON"),
        (b"\x1e[1.5,0]", "only strings and non-negative integers"),
        (b"\x1e[false]", "neither a str key nor an int index"),
        (b'\x1e["",-1]', "negative index"),
        (b'\x1e{"n":0}', "followed by a JSON array"),
    ]
    for broken, match in cases:
        bad = data.replace(b'\x1e["n",0]', broken)
        expect(errors.HeaderError, match, lambda b=bad: read_index(b))


def test_a_meta_tensor_in_a_version_1_file_is_refused(plain: Path) -> None:
    bad = mutated(plain, lambda s: s.put(s.entry_field(2, "data_length"), "<Q", 0))
    expect(errors.SizeMismatchError, "meta tensors need data version 4", lambda: load_all(bad))


# --- the per-tensor headers --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "fmt", "value", "match"),
    [
        ("dims", "<II", (3, 2), "shape (3, 2) but the index says (2, 3)"),
        ("dtype", "3s", b"<i4", "dtype 'int32' but the index says 'float32'"),
        ("name", "1s", b"z", "name 'z' but the index says 'a'"),
        ("type", "<B", 0, "tensor type 'param' but the index says 'state_dict'"),
    ],
)
def test_a_header_that_disagrees_with_its_index_entry_is_refused(
    plain: Path, field: str, fmt: str, value: object, match: str
) -> None:
    values = value if isinstance(value, tuple) else (value,)
    bad = mutated(plain, lambda s: s.put(s.header_field(0, field), fmt, *values))
    message = expect(errors.HeaderError, match, lambda: load_all(bad))
    assert "lies" in message


@pytest.mark.parametrize(("field", "fmt", "value"), [("name_len", "<H", 0xFFFF), ("dtype_len", "<B", 0xFF)])
def test_lengths_in_a_header_past_its_end_are_refused(plain: Path, field: str, fmt: str, value: int) -> None:
    bad = mutated(plain, lambda s: s.put(s.header_field(1, field), fmt, value))
    expect(errors.BoundsError, "tensor header of 'b'", lambda: load_all(bad))
    entry = read_index(bad.read_bytes()).tensors[1]
    record = bad.read_bytes()[entry.record_offset : entry.data_offset]
    expect(errors.BoundsError, "tensor header", lambda: parse_tensor_header(record))


def test_unparseable_header_fields_are_refused(plain: Path) -> None:
    negative = mutated(plain, lambda s: s.put(s.header_field(0, "tail"), "<q", -24))
    expect(errors.HeaderError, "negative data length", lambda: load_all(negative))
    marker = mutated(plain, lambda s: s.put(s.header_field(0, "size"), "<Q", 0))
    expect(errors.HeaderError, "end-of-file marker", lambda: load_all(marker))
    hash_type = mutated(plain, lambda s: s.put(s.header_field(0, "hashes"), "<B", 7))
    expect(errors.HeaderError, "hash 0 has type 7", lambda: load_all(hash_type))
    short_section = mutated(plain, lambda s: s.put(s.header_field(0, "hash_len"), "<H", 40))
    expect(errors.BoundsError, "hash section", lambda: load_all(short_section))


def test_corrupt_data_or_a_wrong_stored_hash_fails_verification(plain: Path) -> None:
    data = mutated(plain, lambda s: s.flip(s.entries[1].data_offset + 3))
    message = expect(errors.HashMismatchError, "tensor 'b'", lambda: load_all(data))
    assert "CRC32" in message
    load_all(data, verify=False)  # the bytes are only refused by verification
    crc = mutated(plain, lambda s: s.flip(s.header_field(2, "hashes") + 2))
    expect(errors.HashMismatchError, "tensor 'c': CRC32", lambda: load_all(crc))
    sha = mutated(plain, lambda s: s.flip(s.header_field(2, "hashes") + 6 + 2 + 5))
    expect(errors.HashMismatchError, "tensor 'c': SHA-256", lambda: load_all(sha))


# --- encryption --------------------------------------------------------------------------------------------


def crypt_at(s: Surgery, i: int) -> int:
    """Offset of tensor i's crypt_info block (after a SHA-256-only hash section)."""
    return s.header_field(i, "hashes") + 34


def test_a_wrong_or_missing_key_is_refused(encrypted: Path, plain: Path) -> None:
    wrong = DecryptionKey.from_bytes(bytes(32))
    expect(
        errors.WrongKeyError,
        "tensor 'big': encrypted chunk 1 of 3 fails",
        lambda: load_all(encrypted, key=wrong),
    )
    expect(errors.MissingKeyError, "no key or password was given", lambda: load_all(encrypted))
    key = DecryptionKey.from_bytes(KEY)
    expect(errors.NotEncryptedError, "the file is not encrypted", lambda: load_all(plain, key=key))
    password = DecryptionKey.from_password("pw")
    expect(errors.WrongKeyError, "encrypted with a raw key", lambda: load_all(encrypted, key=password))
    load_all(encrypted, key=key)


def test_a_flipped_ciphertext_byte_is_refused(encrypted: Path) -> None:
    key = DecryptionKey.from_bytes(KEY)
    first = mutated(encrypted, lambda s: s.flip(s.entries[0].data_offset + 10))
    expect(errors.WrongKeyError, "or the encrypted bytes are corrupt", lambda: load_all(first, key=key))
    later_chunk = mutated(encrypted, lambda s: s.flip(s.entries[0].data_offset + 2100))
    expect(
        errors.HashMismatchError,
        "chunk 3 of 3 fails authentication although",
        lambda: load_all(later_chunk, key=key),
    )
    later_tensor = mutated(encrypted, lambda s: s.flip(s.entries[1].data_offset))
    expect(errors.HashMismatchError, "tensor 'small'", lambda: load_all(later_tensor, key=key))


def test_a_wrong_stored_hash_in_an_encrypted_file_fails_after_decryption(encrypted: Path) -> None:
    bad = mutated(encrypted, lambda s: s.flip(s.header_field(1, "hashes") + 2))
    expect(
        errors.HashMismatchError,
        "tensor 'small': SHA-256",
        lambda: load_all(bad, key=DecryptionKey.from_bytes(KEY)),
    )


@pytest.mark.parametrize("size", [1000, 1030, 0])
def test_a_bad_encryption_chunk_size_is_refused(encrypted: Path, size: int) -> None:
    bad = mutated(encrypted, lambda s: s.put(crypt_at(s, 0) + 20, "<Q", size))
    expect(
        errors.HeaderError,
        f"chunk size {size} must be a multiple of 64",
        lambda: load_all(bad, key=DecryptionKey.from_bytes(KEY)),
    )


def test_a_mac_count_that_disagrees_with_the_data_is_refused(encrypted: Path) -> None:
    bad = mutated(encrypted, lambda s: s.put(crypt_at(s, 0) + 52, "<Q", 2))
    key = DecryptionKey.from_bytes(KEY)
    expect(
        errors.HeaderError,
        "2 MACs for 2400 bytes in chunks of 1024, which needs 3",
        lambda: load_all(bad, key=key),
    )
    huge = mutated(encrypted, lambda s: s.put(crypt_at(s, 0) + 52, "<Q", 2**60))
    expect(errors.HeaderError, f"{2**60} MACs", lambda: load_all(huge, key=key))


def test_a_crypt_info_body_length_that_disagrees_is_refused(encrypted: Path) -> None:
    bad = mutated(encrypted, lambda s: s.put(crypt_at(s, 1), "<Q", 5))
    expect(
        errors.HeaderError,
        "crypt_info says its body is 5 bytes",
        lambda: load_all(bad, key=DecryptionKey.from_bytes(KEY)),
    )


def test_key_derivation_limits_above_the_caps_are_refused_without_deriving(tmp_path: Path) -> None:
    path = tmp_path / "pw.tensors"
    params = EncryptionParams.from_password("pw", limits=Argon2Limits.MIN)
    with TensorizerWriter(path, encryption=params) as writer:
        writer.write_tensor("x", np.ones(4, dtype=np.float32))
    data = path.read_bytes()
    memlimit = (8192).to_bytes(8, "little")
    assert data.count(memlimit) == 1
    bad = tmp_path / "greedy.tensors"
    bad.write_bytes(data.replace(memlimit, (2**40).to_bytes(8, "little")))
    expect(
        errors.BoundsError, "exceed the caps", lambda: load_all(bad, key=DecryptionKey.from_password("pw"))
    )
    load_all(path, key=DecryptionKey.from_password("pw"))


# --- bounded memory ----------------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (768 * 2**20, 768 * 2**20))
    from modelload.loader import errors
    from modelload.loader.formats.tensorizer import TensorizerReader, DecryptionKey
    key = DecryptionKey.from_bytes(bytes(range(32)))
    for path in sys.argv[1:]:
        try:
            encrypted = os.path.basename(path).startswith("enc")
            with TensorizerReader(path, key=key if encrypted else None) as reader:
                for entry in reader.index.tensors:
                    reader.read_header(entry)
        except errors.ModelloadError as exc:
            print(type(exc).__name__)
        else:
            print("accepted")
    """
)


def test_hostile_sizes_fail_fast_under_a_capped_address_space(
    plain: Path, encrypted: Path, tmp_path: Path
) -> None:
    files = [
        mutated(plain, lambda s: s.put(57, "<Q", 2**60)).rename(tmp_path / "count.tensors"),
        mutated(plain, lambda s: s.put(65, "<Q", 2**62)).rename(tmp_path / "metadata.tensors"),
        mutated(plain, lambda s: s.put(s.entry_field(0, "data_offset"), "<Q", 2**62)).rename(
            tmp_path / "d.tensors"
        ),
        mutated(encrypted, lambda s: s.put(crypt_at(s, 0) + 52, "<Q", 2**60)).rename(
            tmp_path / "enc-macs.tensors"
        ),
    ]
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["BoundsError", "BoundsError", "BoundsError", "HeaderError"]
