"""Reading: the index in one or two range reads, data straight into the caller's buffer, from any file."""

from __future__ import annotations

import io
import mmap
import threading
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import errors
from modelload.loader.formats import tensorizer
from modelload.loader.formats.tensorizer import TensorizerReader, TensorizerWriter, read_index, verify
from tests.formats.tensorizer_support import sample, torch


@pytest.fixture
def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict(
            {
                "a": np.arange(12, dtype=np.float32).reshape(3, 4),
                "b": sample("bfloat16", (5,)),
                "c": np.int64(7),
            }
        )
    return path


def counting_reader(data: bytes) -> tuple[list[tuple[int, int]], object]:
    calls: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return data[offset : offset + length]

    return calls, read


def test_a_default_index_takes_one_range_read(small: Path) -> None:
    calls, read = counting_reader(small.read_bytes())
    index = read_index(read)  # type: ignore[arg-type]
    assert len(calls) == 1 and [t.name for t in index.tensors] == ["a", "b", "c"]


def test_a_bigger_metadata_block_takes_a_second_range_read(tmp_path: Path) -> None:
    path = tmp_path / "big-block.tensors"
    with TensorizerWriter(path, metadata_size=300_000) as writer:
        writer.write_tensor("x", np.ones(3, dtype=np.float32))
    calls, read = counting_reader(path.read_bytes())
    index = read_index(read, size=path.stat().st_size)  # type: ignore[arg-type]
    assert len(calls) == 2 and index.index_length == 73 + 300_000
    assert calls[1][0] == calls[0][1], "the second read continues where the first stopped"


def test_the_index_is_what_planning_needs(small: Path) -> None:
    index = tensorizer.read_index(small.read_bytes(), source="s3://bucket/small")
    a, b, c = index.tensors
    assert index.format == "tensorizer" and index.version == 2 and index.data_end == small.stat().st_size - 8
    assert (a.dtype.name, a.shape, a.nbytes, a.kind) == ("float32", (3, 4), 48, "state_dict")
    assert (
        b.record_offset == a.data_offset + a.data_length
        and b.record_length == b.data_offset + 10 - b.record_offset
    )
    assert (c.shape, c.nbytes) == ((), 8)


def test_readinto_fills_numpy_mmap_and_torch_buffers(small: Path) -> None:
    with TensorizerReader(small) as reader:
        out = np.zeros(48, dtype=np.uint8)
        header = reader.readinto("a", out.data)
        assert out.view(np.float32).tolist() == list(range(12)) and header.size == 66 + 1 + 3 + 8
        with mmap.mmap(-1, 10) as region:
            reader.readinto("b", memoryview(region))
            assert bytes(region) == sample("bfloat16", (5,)).view(torch.uint8).numpy().tobytes()
        target = torch.empty(1, dtype=torch.int64)
        reader.readinto("c", target.numpy().data)
        assert target.item() == 7


def test_readinto_needs_a_writable_buffer_of_the_right_size(small: Path) -> None:
    with TensorizerReader(small) as reader:
        with pytest.raises(errors.ConfigError, match="exactly 48 bytes, got 47"):
            reader.readinto("a", bytearray(47))
        with pytest.raises(errors.ConfigError, match="read-only"):
            reader.readinto("a", bytes(48))
        with pytest.raises(KeyError, match="no tensor named 'zz'"):
            reader.read_numpy("zz")


def test_a_file_object_without_a_descriptor_reads_the_same(small: Path) -> None:
    with TensorizerReader(io.BytesIO(small.read_bytes())) as reader:
        assert dict(reader.iter_numpy())["a"].tolist() == np.arange(12).reshape(3, 4).tolist()


def test_tensors_read_concurrently_from_threads(tmp_path: Path) -> None:
    path = tmp_path / "many.tensors"
    arrays = {f"t{i}": np.full(4096, i, dtype=np.int32) for i in range(16)}
    with TensorizerWriter(path) as writer:
        writer.write_state_dict(arrays)
    results: dict[str, bytes] = {}
    with TensorizerReader(path) as reader:

        def work(names: list[str]) -> None:
            for name in names:
                results[name] = reader.read_numpy(name).tobytes()

        threads = [threading.Thread(target=work, args=(list(arrays)[i::2],)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == {name: array.tobytes() for name, array in arrays.items()}


def test_verify_checks_exactly_the_tensors_bytes(small: Path) -> None:
    with TensorizerReader(small) as reader:
        header = reader.read_header("a")
        data = reader.read_numpy("a")
    verify(header, data.reshape(-1).view(np.uint8).data)
    with pytest.raises(errors.SizeMismatchError, match="47 bytes given to verify"):
        verify(header, bytearray(47))


def test_an_encrypted_files_index_reads_without_a_key(tmp_path: Path) -> None:
    path = tmp_path / "e.tensors"
    with TensorizerWriter(path, encryption=tensorizer.EncryptionParams.random()) as writer:
        writer.write_tensor("x", np.ones(2, dtype=np.float32))
    with TensorizerReader(path) as reader:
        assert reader.index.encrypted and reader.entry("x").encrypted
        assert reader.read_header("x").encrypted
