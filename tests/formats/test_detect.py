"""Format detection from a file's first bytes, and reading an index of either format with one first read."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy

from modelload.loader import errors
from modelload.loader.formats import PrefixedRead, detect_format, read_index
from modelload.loader.formats import safetensors as st
from modelload.loader.formats._detect import PREFIX_LENGTH


class CountingSource:
    """A file in memory that records every range asked of it, as a remote source would bill them."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.calls: list[tuple[int, int]] = []

    def __call__(self, offset: int, length: int) -> bytes:
        self.calls.append((offset, length))
        return self.blob[offset : offset + length]


@pytest.fixture(scope="module")
def tensorizer_file(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small file written by the real tensorizer package."""
    torch = pytest.importorskip("torch")
    from tensorizer import TensorSerializer

    path = tmp_path_factory.mktemp("tz") / "model.tensors"
    serializer = TensorSerializer(str(path))
    serializer.write_state_dict(
        {"layer.weight": torch.ones(3, 2), "layer.bias": torch.zeros(2, dtype=torch.bfloat16)}
    )
    serializer.close()
    return path.read_bytes()


def safetensors_file(**arrays: np.ndarray) -> bytes:
    return safetensors.numpy.save(arrays or {"w": np.ones((2, 2), np.float32)})


# --- detect_format --------------------------------------------------------------------------------------


def test_a_tensorizer_file_is_detected_by_its_magic(tensorizer_file: bytes) -> None:
    assert detect_format(tensorizer_file[:64]) == "tensorizer"


def test_safetensors_files_of_both_writers_are_detected() -> None:
    assert detect_format(safetensors_file()) == "safetensors"
    assert detect_format(st.serialize({"x": np.zeros(1, np.int8)})[:9]) == "safetensors"


@pytest.mark.parametrize(
    ("prefix", "hint"),
    [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:ab", "Git LFS pointer"),
        (b"PK\x03\x04\x14\x00\x00\x00\x08\x00", "zip archive"),
        (b"\x80\x02}q\x00(X\x06\x00\x00\x00", "pickle"),
        (b"<!DOCTYPE html><html><body>403 Forbidden", "error page"),
        (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", "gzip"),
        (b"GGUF\x03\x00\x00\x00\x00\x00\x00\x00", "GGUF"),
    ],
)
def test_lookalike_files_are_named_in_the_error(prefix: bytes, hint: str) -> None:
    with pytest.raises(errors.BadMagicError, match=hint) as caught:
        detect_format(prefix)
    assert prefix[:4].hex(" ") not in str(caught.value), (
        "what a file looks like is said, its bytes never shown"
    )


@pytest.mark.parametrize(
    "secret",
    [bytes(range(250, 256)) + b"\x00\x01\x02\x03" * 10, b"root:*:19000:0:99999:7:::\ndaemon:*:19000"],
    ids=["binary", "text"],
)
def test_garbage_is_refused_with_the_expected_formats_and_none_of_its_bytes(secret: bytes) -> None:
    with pytest.raises(errors.BadMagicError) as caught:
        detect_format(secret)
    message = str(caught.value)
    assert "tensorizer" in message and "safetensors" in message and "'|TZR|'" in message
    assert secret[:16].hex(" ") not in message and secret[:16].hex() not in message
    assert "root" not in message, "a file that is not a model may be anything: none of it is echoed"
    assert message.isprintable()


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (b"", "the file is empty"),
        (b"|TZ", "only 3 bytes"),
        ((2**40).to_bytes(8, "little") + b"{", "expected a tensorizer file"),  # a size no header has
        ((0).to_bytes(8, "little") + b"{", "expected a tensorizer file"),
        ((64).to_bytes(8, "little") + b"[", "expected a tensorizer file"),
    ],
)
def test_prefixes_that_are_almost_a_format_are_refused(prefix: bytes, match: str) -> None:
    with pytest.raises(errors.BadMagicError, match=match):
        detect_format(prefix)


# --- read_index: dispatch -------------------------------------------------------------------------------


def test_a_small_safetensors_file_costs_one_request_in_all() -> None:
    source = CountingSource(safetensors_file(a=np.ones(3, np.float32), b=np.zeros((2, 2), np.int64)))
    index = read_index(source, source="mem://model")
    assert source.calls == [(0, PREFIX_LENGTH)]
    assert index.format == "safetensors"
    assert [(t.name, t.shape) for t in index.tensors] == [("b", (2, 2)), ("a", (3,))]
    assert index.data_end == len(source.blob)


def test_a_header_past_the_safetensors_readers_first_read_is_still_served_from_the_prefix() -> None:
    arrays = {f"blocks.{i}.attention.query_key_value.weight": np.ones(2, np.float16) for i in range(2000)}
    source = CountingSource(safetensors.numpy.save(arrays))
    assert st.FIRST_READ_LENGTH < 8 + int.from_bytes(source.blob[:8], "little") < PREFIX_LENGTH
    assert len(read_index(source)) == 2000
    assert source.calls == [(0, PREFIX_LENGTH)]


def test_a_header_past_the_prefix_costs_two_requests_and_reuses_the_prefix() -> None:
    arrays = {f"blocks.{i}.attention.query_key_value.weight": np.ones(2, np.float16) for i in range(12000)}
    source = CountingSource(safetensors.numpy.save(arrays))
    header_end = 8 + int.from_bytes(source.blob[:8], "little")
    assert header_end > PREFIX_LENGTH
    index = read_index(source)
    assert source.calls == [(0, PREFIX_LENGTH), (PREFIX_LENGTH, header_end - PREFIX_LENGTH)]
    assert len(index) == 12000


def test_a_tensorizer_file_goes_to_the_tensorizer_reader(tensorizer_file: bytes) -> None:
    source = CountingSource(tensorizer_file)
    index = read_index(source, source="mem://model.tensors")
    assert index.format == "tensorizer"
    assert sorted(t.name for t in index.tensors) == ["layer.bias", "layer.weight"]
    assert source.calls[0] == (0, PREFIX_LENGTH)
    assert len(source.calls) == 1, "the tensorizer reader was served from the prefix"


@pytest.mark.parametrize("named", ["tensorizer", "safetensors"])
def test_a_named_format_that_matches_reads_as_auto_does(named: str, tensorizer_file: bytes) -> None:
    blob = tensorizer_file if named == "tensorizer" else safetensors_file()
    assert read_index(CountingSource(blob), format=named) == read_index(CountingSource(blob))  # type: ignore[arg-type]


def test_a_named_format_that_does_not_match_says_which_it_is(tensorizer_file: bytes) -> None:
    with pytest.raises(errors.BadMagicError, match="named a safetensors file but is a tensorizer file"):
        read_index(CountingSource(tensorizer_file), format="safetensors", source="s3://b/m")
    with pytest.raises(errors.BadMagicError, match="set the format to safetensors or auto"):
        read_index(CountingSource(safetensors_file()), format="tensorizer")


def test_a_named_format_lets_its_reader_explain_a_broken_file() -> None:
    blob = bytearray(safetensors_file())
    blob[8] = ord("[")
    with pytest.raises(errors.BadMagicError, match="expected a tensorizer file"):
        read_index(CountingSource(bytes(blob)), source="f")
    with pytest.raises(errors.HeaderError, match=r"must start with '\{'"):
        read_index(CountingSource(bytes(blob)), format="safetensors", source="f")


def test_an_unknown_format_name_is_a_configuration_error() -> None:
    with pytest.raises(errors.ConfigError, match="auto, tensorizer, safetensors"):
        read_index(CountingSource(b""), format="gguf")  # type: ignore[arg-type]


def test_garbage_through_read_index_names_the_source() -> None:
    with pytest.raises(errors.BadMagicError, match=r"^http://host/m\.bin: .*looks like HTML"):
        read_index(CountingSource(b"<html>502 Bad Gateway</html>"), source="http://host/m.bin")


def test_a_known_size_catches_truncation_of_either_format(tensorizer_file: bytes) -> None:
    big = safetensors.numpy.save({"w": np.ones(50_000, np.float32)})
    for blob in (big, tensorizer_file):
        cut = blob[:-10]
        with pytest.raises(errors.TruncatedError, match=r"cut short|ends|truncat"):
            read_index(CountingSource(cut), size=len(cut))


def test_a_small_file_whose_prefix_came_back_short_is_checked_against_its_end() -> None:
    cut = safetensors_file()[:-1]
    with pytest.raises(errors.TruncatedError, match="cut short"):
        read_index(CountingSource(cut))


# --- PrefixedRead ---------------------------------------------------------------------------------------


def prefixed(blob: bytes, length: int) -> tuple[PrefixedRead, CountingSource]:
    source = CountingSource(blob)
    prefix = source(0, length)
    source.calls.clear()
    return PrefixedRead(source, prefix, complete=len(prefix) < length), source


def test_reads_inside_the_prefix_never_reach_the_source() -> None:
    read, source = prefixed(bytes(range(200)), 100)
    assert read(10, 5) == bytes(range(10, 15))
    assert read(0, 100) == bytes(range(100))
    assert source.calls == []


def test_a_read_across_the_end_of_the_prefix_asks_only_for_the_rest() -> None:
    read, source = prefixed(bytes(range(200)), 100)
    assert read(90, 20) == bytes(range(90, 110))
    assert source.calls == [(100, 10)]
    assert read(150, 10) == bytes(range(150, 160))
    assert source.calls[-1] == (150, 10)


def test_a_short_prefix_is_the_whole_file() -> None:
    read, source = prefixed(bytes(50), 100)
    assert read.size == 50
    assert read(40, 30) == bytes(10)
    assert read(60, 10) == b""
    assert source.calls == []
