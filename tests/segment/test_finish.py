"""TensorFinisher: landed bytes to a READY tensor, the one way the sidecar, stage and peers finish tensors."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import dtypes, errors
from modelload.loader.formats import ModelReader, open_reader
from modelload.loader.formats.safetensors import save_file
from modelload.loader.formats.tensorizer import DecryptionKey, EncryptionParams, TensorizerWriter
from modelload.loader.segment import (
    SegmentReader,
    SegmentWriter,
    TensorFinisher,
    TensorFlags,
    TensorSpec,
    TensorState,
    plan_layout,
)

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
_f32 = dtypes.by_name("float32")
TENSORS = {f"t{i}": np.arange(100 * (i + 1), dtype=np.float32) for i in range(3)}


def tensorizer_file(path: Path, *, key: bytes | None = None) -> Path:
    encryption = EncryptionParams.from_key(key, chunk_size=1024) if key is not None else None
    with TensorizerWriter(path, encryption=encryption) as writer:
        for name, array in TENSORS.items():
            writer.write_tensor(name, array)
    return path


def safetensors_file(path: Path) -> Path:
    save_file(TENSORS, path)
    return path


def corrupt_data_of(path: Path, name: str) -> None:
    """Flip a byte in the middle of tensor ``name``'s stored data."""
    with open_reader(path, "tensorizer", verify=False) as reader:
        entry = reader.entry(name)
    data = bytearray(path.read_bytes())
    data[entry.data_offset + entry.data_length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def segment(shm_dir: Path) -> Iterator[tuple[SegmentWriter, Path]]:
    path = shm_dir / "finish.seg"
    layout = plan_layout([TensorSpec(n, _f32, a.shape) for n, a in TENSORS.items()])
    writer = SegmentWriter.create(path, layout)
    yield writer, path
    writer.close()


@contextlib.contextmanager
def encrypted_load(
    tmp_path: Path, writer: SegmentWriter, key: bytes, *, corrupt: str | None = None
) -> Iterator[tuple[TensorFinisher, ModelReader]]:
    """A file encrypted with KEY (tensor ``corrupt`` damaged), read and finished with ``key``."""
    file = tensorizer_file(tmp_path / "m.tensors", key=KEY)
    if corrupt is not None:
        corrupt_data_of(file, corrupt)
    finisher = TensorFinisher(writer, key=DecryptionKey.from_bytes(key), encrypted=True, verify=True)
    with open_reader(file, "tensorizer", key=finisher.keys.key) as reader:
        yield finisher, reader


def land(reader: ModelReader, writer: SegmentWriter, i: int) -> bytes | bytearray | None:
    return reader.read_record(reader.index.tensors[i], writer.slot(i))


def finish_all(
    reader: ModelReader, writer: SegmentWriter, finisher: TensorFinisher, order: list[int] | None = None
) -> list[bool]:
    done = []
    for i in order if order is not None else range(len(reader.index.tensors)):
        header = land(reader, writer, i)
        done.append(finisher.finish(i, entry=reader.index.tensors[i], header=header, source=reader.path))
    return done


def test_a_plain_tensorizer_tensor_is_verified_and_published_with_its_crc(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    with open_reader(tensorizer_file(tmp_path / "m.tensors"), "tensorizer") as reader:
        assert finish_all(reader, writer, finisher) == [True, True, True]
    finisher.settle()
    with SegmentReader.open(path) as seg:
        for i, array in enumerate(TENSORS.values()):
            assert seg.state(i) == TensorState.READY
            assert seg.flags(i) & TensorFlags.VERIFIED and not seg.flags(i) & TensorFlags.DECRYPTED
            assert seg.crc32(i) == zlib.crc32(array.tobytes())


def test_a_checksum_the_caller_computed_is_recorded_without_a_second_pass(
    segment: tuple[SegmentWriter, Path],
) -> None:
    writer, path = segment
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    entries = {}
    with open_reader(safetensors_file(path.parent / "m.safetensors"), "safetensors") as reader:
        for i, entry in enumerate(reader.index.tensors):
            reader.readinto(entry, writer.slot(i))
            entries[i] = entry
    given = zlib.crc32(writer.slot(0)) ^ 1  # not the bytes' own: proves it is the caller's that is kept
    assert finisher.finish(0, entry=entries[0], header=None, source="m", crc32=given)
    assert finisher.finish(1, entry=entries[1], header=None, source="m")
    with SegmentReader.open(path) as seg:
        assert seg.crc32(0) == given
        assert seg.crc32(1) == zlib.crc32(TENSORS["t1"].tobytes())


def test_tensors_finished_together_from_the_index_columns_keep_the_given_checksums_and_take_the_rest(
    segment: tuple[SegmentWriter, Path],
) -> None:
    writer, path = segment
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    with open_reader(safetensors_file(path.parent / "m.safetensors"), "safetensors") as reader:
        table = reader.index.table
        for i, entry in enumerate(reader.index.tensors):
            reader.readinto(entry, writer.slot(i))
    given = zlib.crc32(writer.slot(1)) ^ 1  # not the bytes' own: proves it is the caller's that is kept
    checks: list[bool] = []
    done = finisher.finish_many(
        np.array([1, 0], dtype=np.int32), entries=table, headers=None, source="m", check=checks.append,
        crcs=np.array([given, -1], dtype=np.int64),
    )  # fmt: skip
    assert done.tolist() == [1, 0] and checks == [False]  # one check for the range, nothing verified by hash
    with SegmentReader.open(path) as seg:
        assert seg.crc32(1) == given
        assert seg.crc32(0) == zlib.crc32(TENSORS["t0"].tobytes())
        assert [seg.state(i) for i in (0, 1)] == [TensorState.READY] * 2


def test_a_checksum_given_for_a_tensor_the_finish_changes_is_refused(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    with open_reader(tensorizer_file(tmp_path / "m.tensors"), "tensorizer") as reader:
        header = land(reader, writer, 0)
        with pytest.raises(ValueError, match="whose bytes this finish changes"):
            finisher.finish(0, entry=reader.index.tensors[0], header=header, source="m", crc32=1)
    with SegmentReader.open(path) as seg:
        assert seg.state(0) == TensorState.PENDING


def test_an_encrypted_tensor_is_decrypted_in_its_slot(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    with encrypted_load(tmp_path, writer, KEY) as (finisher, r):
        finish_all(r, writer, finisher)
    assert finisher.keys.proven
    with SegmentReader.open(path) as seg:
        assert seg.flags(0) & TensorFlags.DECRYPTED
        assert bytes(writer.slot(0)) == TENSORS["t0"].tobytes()


def test_corrupt_bytes_fail_the_hash_and_nothing_is_published(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    file = tensorizer_file(tmp_path / "m.tensors")
    corrupt_data_of(file, "t1")
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    with open_reader(file, "tensorizer") as reader:
        finish_all(reader, writer, finisher, order=[0])
        with pytest.raises(errors.HashMismatchError, match="'t1'"):
            finish_all(reader, writer, finisher, order=[1])
    with SegmentReader.open(path) as seg:
        assert seg.state(0) == TensorState.READY and seg.state(1) != TensorState.READY


def test_without_verify_a_corrupt_plain_tensor_is_published_unverified(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    file = tensorizer_file(tmp_path / "m.tensors")
    corrupt_data_of(file, "t1")
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=False)
    with open_reader(file, "tensorizer") as reader:
        finish_all(reader, writer, finisher)
    with SegmentReader.open(path) as seg:
        assert seg.state(1) == TensorState.READY and not seg.flags(1) & TensorFlags.VERIFIED


def test_a_wrong_key_is_told_once_two_tensors_fail_with_it(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, _ = segment
    with encrypted_load(tmp_path, writer, OTHER_KEY) as (finisher, r):
        assert finish_all(r, writer, finisher, order=[0]) == [False], "the first failure is held"
        with pytest.raises(errors.WrongKeyError):
            finish_all(r, writer, finisher, order=[1])


def test_the_only_failing_tensor_settles_as_a_wrong_key(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, _ = segment
    with encrypted_load(tmp_path, writer, OTHER_KEY) as (finisher, r):
        assert finish_all(r, writer, finisher, order=[2]) == [False]
    with pytest.raises(errors.WrongKeyError):
        finisher.settle()


@pytest.mark.parametrize("order", [[1, 0], [0, 1]], ids=["corrupt-first", "corrupt-after-a-good-one"])
def test_a_corrupt_encrypted_tensor_is_told_as_corrupt_when_another_opens(
    tmp_path: Path, segment: tuple[SegmentWriter, Path], order: list[int]
) -> None:
    writer, path = segment
    with (
        encrypted_load(tmp_path, writer, KEY, corrupt="t1") as (finisher, reader),
        pytest.raises(errors.HashMismatchError, match=r"'t1'.*corrupt"),
    ):
        finish_all(reader, writer, finisher, order=order)
    with SegmentReader.open(path) as seg:
        assert seg.state(1) != TensorState.READY


def test_a_safetensors_tensor_is_published_unverified_after_the_callers_check(
    tmp_path: Path, segment: tuple[SegmentWriter, Path]
) -> None:
    writer, path = segment
    file = tmp_path / "m.safetensors"
    save_file(TENSORS, file)
    seen: list[bool] = []
    finisher = TensorFinisher(writer, key=None, encrypted=False, verify=True)
    with open_reader(file, "safetensors") as reader:
        names = [t.name for t in reader.index.tensors]
        assert names == list(TENSORS)
        header = land(reader, writer, 0)
        assert header is None
        assert finisher.finish(
            0, entry=reader.index.tensors[0], header=None, source=reader.path, check=seen.append
        )

        def refuse(verified: bool) -> None:
            raise errors.SourceChangedError("changed under us")

        land(reader, writer, 1)
        with pytest.raises(errors.SourceChangedError):
            finisher.finish(1, entry=reader.index.tensors[1], header=None, source=reader.path, check=refuse)
    assert seen == [False]
    with SegmentReader.open(path) as seg:
        assert seg.state(0) == TensorState.READY and seg.flags(0) & TensorFlags.CRC32
        assert not seg.flags(0) & TensorFlags.VERIFIED
        assert seg.state(1) != TensorState.READY, "a refused check publishes nothing"
