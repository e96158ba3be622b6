"""The writer's own rules: versions and flags, the metadata block, names, inputs, and never a torn file."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import errors
from modelload.loader.formats.tensorizer import (
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
    parse_file_header,
    read_index,
)
from tests.formats.tensorizer_support import sample, torch


def header_of(path: Path):  # type: ignore[no-untyped-def]
    return parse_file_header(path.read_bytes()[:73])


@pytest.mark.parametrize(
    ("tensors", "encrypted", "version", "flags"),
    [
        ({"x": np.ones(2, dtype=np.float32)}, False, 1, 0),
        ({"x": sample("bfloat16")}, False, 2, 0),
        ({"x": np.ones(2, dtype=np.float32)}, True, 3, 0),
        ({"x": torch.empty(2, device="meta")}, False, 4, 0),
        ({"x": torch.empty(2, device="meta")}, True, 4, 1),
        ({"x": torch.empty(2**32, 0)}, False, 5, 2),
        ({"x": torch.empty(2**32, 0)}, True, 5, 3),
    ],
)
def test_the_version_is_raised_to_the_highest_feature_used(
    tmp_path: Path, tensors: dict[str, object], encrypted: bool, version: int, flags: int
) -> None:
    path = tmp_path / "v.tensors"
    with TensorizerWriter(path, encryption=EncryptionParams.random() if encrypted else None) as writer:
        writer.write_state_dict(tensors)
    header = header_of(path)
    assert (header.version, header.flags) == (version, flags)
    assert path.read_bytes()[9:41] == flags.to_bytes(32, "little")


def test_the_header_counts_tensors_and_data_bytes_and_the_file_ends_with_a_zero_marker(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict({"a": np.ones(3, dtype=np.float64), "m": torch.empty(9, device="meta")})
    header = header_of(path)
    assert (header.tensor_count, header.tensor_size) == (2, 24)
    data = path.read_bytes()
    assert data[-8:] == bytes(8) and len(data) == read_index(data).data_end + 8


def test_a_tensor_whose_index_entry_would_not_fit_is_refused_before_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "small-block.tensors"
    with TensorizerWriter(path, metadata_size=100) as writer:
        writer.write_tensor("first", np.ones(2, dtype=np.float32))
        writer.write_tensor("second", np.ones(2, dtype=np.float32))
        with pytest.raises(
            errors.ConfigError, match=r"too many tensors: the index needs .* metadata_size=4096"
        ):
            writer.write_tensor("third", np.ones(2, dtype=np.float32))
    with TensorizerReader(path) as reader:
        assert list(reader) == ["first", "second"]
        assert reader.index.index_length == 73 + 100


def test_a_first_bulk_write_grows_the_block_to_fit(tmp_path: Path) -> None:
    path = tmp_path / "grown.tensors"
    with TensorizerWriter(path, metadata_size=16) as writer:
        writer.write_state_dict({f"t{i}": np.full(1, i, dtype=np.int8) for i in range(50)})
    index = read_index(path.read_bytes())
    assert len(index) == 50 and index.index_length - 73 == sum(
        2 + len(f"t{i}") + 1 + 1 + 3 + 1 + 4 + 24 for i in range(50)
    )


def test_names_must_be_unique_and_form_a_tree(tmp_path: Path) -> None:
    with TensorizerWriter(tmp_path / "n.tensors") as writer:
        writer.write_tensor("a", np.ones(1, dtype=np.float32))
        with pytest.raises(errors.DuplicateNameError, match="'a'"):
            writer.write_tensor("a", np.ones(1, dtype=np.float32))
        with pytest.raises(errors.ConfigError, match="which is itself a tensor"):
            writer.write_state_dict({"x": {"y": np.ones(1)}, "z": np.ones(1)} | {"a": {"b": np.ones(1)}})
        writer.write_tensor(("r", "s"), np.ones(1))
        with pytest.raises(errors.ConfigError, match="both a tensor and a prefix"):
            writer.write_tensor("r", np.ones(1))
        with pytest.raises(errors.DuplicateNameError, match=r"'p\.0'"):
            writer.write_state_dict({"p.0": np.ones(1), "p": [np.ones(1)]})
        with pytest.raises(errors.ConfigError, match="one layer cannot be both a dict and a list"):
            writer.write_tensor(("q", 0), np.ones(1))
            writer.write_tensor(("q", "k"), np.ones(1))
        with pytest.raises(errors.ConfigError, match="needs a plain str name"):
            writer.write_tensor(("m", "w"), np.ones(1), kind="param")
        with pytest.raises(errors.ConfigError, match="negative index"):
            writer.write_tensor(("m", -1), np.ones(1))
    with TensorizerReader(tmp_path / "n.tensors") as reader:
        assert list(reader) == ["a", "r.s", "q.0"], "a refused batch writes nothing"


@pytest.mark.filterwarnings("ignore:.*quantize")
def test_unsupported_inputs_are_refused_with_the_reason(tmp_path: Path) -> None:
    with TensorizerWriter(tmp_path / "bad.tensors") as writer:
        with pytest.raises(errors.ConfigError, match="not list"):
            writer.write_tensor("l", [1, 2, 3])
        with pytest.raises(errors.UnsupportedDtypeError, match="cannot be stored"):
            writer.write_tensor("o", np.array([object()]))
        with pytest.raises(errors.UnsupportedDtypeError, match="big-endian"):
            writer.write_tensor("be", np.ones(2, dtype=">f4"))
        with pytest.raises(errors.UnsupportedDtypeError, match="reinterpret"):
            writer.write_tensor("w", np.ones(2, dtype=np.float32), dtype="bfloat16")
        with pytest.raises(errors.UnsupportedDtypeError, match="quantized"):
            writer.write_tensor("q", torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8))


def test_an_interrupted_write_leaves_a_file_every_reader_refuses(tmp_path: Path) -> None:
    path = tmp_path / "interrupted.tensors"
    with pytest.raises(RuntimeError), TensorizerWriter(path) as writer:
        writer.write_tensor("x", np.ones(4, dtype=np.float32))
        raise RuntimeError("crash")
    with pytest.raises(errors.BadMagicError):
        read_index(path.read_bytes())


def test_writing_to_a_file_object_without_a_descriptor(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    writer = TensorizerWriter(buffer)
    writer.write_tensor("x", np.arange(5, dtype=np.uint8))
    writer.close()
    writer.close()  # idempotent
    path = tmp_path / "copy.tensors"
    path.write_bytes(buffer.getvalue())
    with TensorizerReader(path) as reader:
        assert reader.read_numpy("x").tolist() == [0, 1, 2, 3, 4]


def test_torch_tensors_that_are_views_are_written_in_c_order(tmp_path: Path) -> None:
    base = sample("float16", (4, 6))
    view = base.t()[1:3]
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    path = tmp_path / "views.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_tensor("view", view)
        writer.write_tensor("conj", conj)
    with TensorizerReader(path) as reader:
        assert reader.read_torch("view").tolist() == view.tolist()
        assert reader.read_torch("conj").tolist() == [1 - 2j, 3 + 4j]


def test_module_indices_and_dtype_strings_land_in_the_headers(tmp_path: Path) -> None:
    path = tmp_path / "m.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_tensor("w", np.ones(2, dtype=np.float32), kind="param", module_idx=513)
        writer.write_tensor("f8", sample("float8_e8m0fnu", (2,)), kind="buffer", module_idx=1)
    with TensorizerReader(path) as reader:
        assert reader.read_header("w").module_idx == 513 and reader.entry("w").kind == "param"
        assert reader.read_header("f8").module_idx == 1
    assert b"|V1\x00torch.float8_e8m0fnu" in path.read_bytes()
    with (
        pytest.raises(errors.ConfigError, match="16 bits"),
        TensorizerWriter(tmp_path / "x.tensors") as writer,
    ):
        writer.write_tensor("w", np.ones(1), module_idx=70000)
    assert struct.unpack_from("<I", path.read_bytes(), 5)[0] == 2
