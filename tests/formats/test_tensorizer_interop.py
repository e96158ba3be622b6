"""Interop with the real tensorizer 2.12.1 package, in both directions, compared byte for byte.

Files tensorizer writes must read byte-exact through our reader; files we write must load through
``TensorDeserializer(verify_hash=True)`` byte-exact. For plain files our writer's output is also compared
with tensorizer's own output for the same input: they must be the same bytes.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader import dtypes
from modelload.loader.formats.tensorizer import (
    Argon2Limits,
    DecryptionKey,
    EncryptionParams,
    TensorizerReader,
    TensorizerWriter,
    read_index,
)
from tests.formats.tensorizer_support import ALL_DTYPES, NUMPY_DTYPES, raw_bytes, sample, torch, tz_write

tensorizer = pytest.importorskip("tensorizer")
from tensorizer import DecryptionParams, TensorDeserializer, TensorSerializer  # noqa: E402
from tensorizer import EncryptionParams as TzEncryption  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MIN = TzEncryption.OpsLimit.MIN, TzEncryption.MemLimit.MIN


def tz_read(path: Path, *, key: bytes | None = None, password: str | None = None) -> dict[Any, Any]:
    params = None
    if key is not None:
        params = DecryptionParams.from_key(key)
    elif password is not None:
        params = DecryptionParams.from_string(password)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deserializer = TensorDeserializer(str(path), verify_hash=True, encryption=params, lazy_load=False)
    try:
        return {k: v for k, v in deserializer.items()}
    finally:
        deserializer.close()


# --- tensorizer writes, we read ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_tensorizer_writes_reads_byte_exact(tmp_path: Path, name: str) -> None:
    tensor = sample(name)
    path = tmp_path / "t.tensors"
    tz_write(path, {"x": tensor})
    with TensorizerReader(path) as reader:
        entry = reader.entry("x")
        assert entry.dtype is dtypes.by_name(name)
        assert entry.shape == tuple(tensor.shape)
        assert reader.index.version == (2 if entry.dtype.opaque else 1)
        out = bytearray(entry.nbytes)
        reader.readinto("x", out)
        assert bytes(out) == raw_bytes(tensor)
        back = reader.read_torch("x")
        assert back.dtype == tensor.dtype and raw_bytes(back) == raw_bytes(tensor)


def test_encrypted_file_with_a_random_key_reads_byte_exact(tmp_path: Path) -> None:
    big = sample("float32", (700_000,))  # 2.8 MB: two 2 MiB chunks
    tensors = {"big": big, "small": sample("bfloat16", (4, 4)), "meta": torch.empty(6, device="meta")}
    params = TzEncryption.random()
    path = tmp_path / "enc.tensors"
    tz_write(path, tensors, encryption=params)
    with TensorizerReader(path, key=DecryptionKey.from_bytes(params.key)) as reader:
        assert reader.index.encrypted and reader.index.version == 4
        assert reader.read_header("big").crypt.cipher.num_macs == 2  # type: ignore[union-attr]
        assert raw_bytes(reader.read_torch("big")) == raw_bytes(big)
        assert raw_bytes(reader.read_torch("small")) == raw_bytes(tensors["small"])
        assert reader.read_numpy("meta").tolist() == [0.0] * 6


def test_encrypted_file_with_a_password_reads_byte_exact(tmp_path: Path) -> None:
    tensors = {"a": sample("float16", (64,)), "b": sample("int64", (3, 3))}
    path = tmp_path / "pw.tensors"
    tz_write(path, tensors, encryption=TzEncryption.from_string("s3cret", *MIN))
    key = DecryptionKey.from_password("s3cret")
    with TensorizerReader(path, key=key) as reader:
        for name, tensor in tensors.items():
            assert raw_bytes(reader.read_torch(name)) == raw_bytes(tensor)
        assert reader.read_header("a").crypt.kdf.opslimit == 1  # type: ignore[union-attr]


def test_nested_state_dict_from_tensorizer_reads_with_paths(tmp_path: Path) -> None:
    tensors = {
        "model": {"layers": [sample("float32", (2,)), sample("int8", (3,), seed=1)]},
        "head": sample("bool"),
    }
    path = tmp_path / "nested.tensors"
    tz_write(path, tensors)
    index = read_index(path.read_bytes())
    assert [(t.name, t.path) for t in index.tensors] == [
        ("model.layers.0", ("model", "layers", 0)),
        ("model.layers.1", ("model", "layers", 1)),
        ("head", None),
    ]
    with TensorizerReader(path) as reader:
        assert raw_bytes(reader.read_numpy("model.layers.1")) == raw_bytes(tensors["model"]["layers"][1])


class Small(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([2.0]))
        self.inner = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.register_buffer("steps", torch.tensor([7], dtype=torch.int64))
        self.register_buffer("cache", torch.arange(4, dtype=torch.float16), persistent=False)


def test_write_module_from_tensorizer_reads_with_kinds_and_module_indices(tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = Small()
    path = tmp_path / "module.tensors"
    serializer = TensorSerializer(str(path))
    serializer.write_module(module)
    serializer.close()
    with TensorizerReader(path) as reader:
        kinds = {e.name: e.kind for e in reader.index.tensors}
        assert kinds[".scale"] == "param" and kinds[".steps"] == "buffer" and kinds["inner.weight"] == "param"
        assert kinds["norm.running_mean"] == "buffer" and kinds[".cache"] == "buffer"
        modules = [name for name, _ in module.named_modules()]
        assert reader.read_header("inner.weight").module_idx == modules.index("inner")
        assert reader.read_header(".scale").module_idx == 0
        assert raw_bytes(reader.read_torch("inner.weight")) == raw_bytes(module.inner.weight)


def test_meta_tensors_from_tensorizer_read_as_zeros(tmp_path: Path) -> None:
    path = tmp_path / "meta.tensors"
    tz_write(path, {"m": torch.empty(3, 4, dtype=torch.bfloat16, device="meta"), "x": sample("uint8", (5,))})
    with TensorizerReader(path) as reader:
        assert reader.index.version == 4
        meta = reader.entry("m")
        assert meta.is_meta and meta.data_length == 0 and meta.nbytes == 24
        out = bytearray(b"\xff" * 24)
        reader.readinto("m", out)
        assert out == bytes(24)


def test_long_dimensions_from_tensorizer_read_as_version_5(tmp_path: Path) -> None:
    path = tmp_path / "long.tensors"
    tz_write(path, {"a": sample("int32", (3,)), "long": torch.empty(2**32, 0), "z": sample("uint8", (2,))})
    with TensorizerReader(path) as reader:
        assert reader.index.version == 5
        assert reader.entry("long").shape == (2**32, 0)
        assert reader.read_numpy("long").shape == (2**32, 0)
        assert raw_bytes(reader.read_numpy("z")) == raw_bytes(sample("uint8", (2,)))


# --- we write, tensorizer reads ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_every_dtype_we_write_loads_in_tensorizer_byte_exact(tmp_path: Path, name: str) -> None:
    tensor = sample(name)
    path = tmp_path / "ours.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_tensor("x", tensor)
    loaded = tz_read(path)["x"]
    assert loaded.dtype == tensor.dtype and tuple(loaded.shape) == tuple(tensor.shape)
    assert raw_bytes(loaded) == raw_bytes(tensor)
    reference = tmp_path / "theirs.tensors"
    tz_write(reference, {"x": tensor})
    assert path.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("name", NUMPY_DTYPES)
def test_numpy_arrays_we_write_load_in_tensorizer_byte_exact(tmp_path: Path, name: str) -> None:
    array = sample(name, (4, 6)).numpy()
    non_contiguous = array.T  # written in C order of the transposed view
    path = tmp_path / "numpy.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_tensor("a", array)
        writer.write_tensor("t", non_contiguous)
        writer.write_tensor("scalar", array[1, 2].reshape(()))
    loaded = tz_read(path)
    assert raw_bytes(loaded["a"]) == array.tobytes()
    assert raw_bytes(loaded["t"]) == np.ascontiguousarray(non_contiguous).tobytes()
    assert tuple(loaded["scalar"].shape) == () and raw_bytes(loaded["scalar"]) == array[1, 2].tobytes()


@pytest.mark.parametrize("how", ["random key", "password"])
def test_encrypted_files_we_write_load_in_tensorizer_byte_exact(tmp_path: Path, how: str) -> None:
    tensors = {
        "big": sample("float32", (1000,)),  # 4000 bytes in 1 KiB chunks: 4 MACs
        "bf": sample("bfloat16", (3, 3)),
        "empty": torch.zeros(0, 4),
        "meta": torch.empty(2, 2, device="meta"),
    }
    if how == "password":
        params = EncryptionParams.from_password("pw", limits=Argon2Limits.MIN, chunk_size=1024)
        reading = {"password": "pw"}
    else:
        params = EncryptionParams.random(chunk_size=1024)
        reading = {"key": params.key}
    path = tmp_path / "enc.tensors"
    with TensorizerWriter(path, encryption=params) as writer:
        writer.write_state_dict(tensors)
    loaded = tz_read(path, **reading)  # type: ignore[arg-type]
    for name in ("big", "bf", "empty"):
        assert raw_bytes(loaded[name]) == raw_bytes(tensors[name])
    assert loaded["meta"].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert path.read_bytes().count(raw_bytes(tensors["big"])[:64]) == 0, "the data is stored encrypted"
    with TensorizerReader(path, key=params.decryption_key()) as reader:
        assert reader.index.version == 4 and reader.read_header("big").crypt.cipher.num_macs == 4  # type: ignore[union-attr]
        assert raw_bytes(reader.read_torch("big")) == raw_bytes(tensors["big"])


def test_nested_state_dicts_we_write_match_tensorizer_bytes_and_structure(tmp_path: Path) -> None:
    tensors = {
        "model": {"layers": [sample("float32", (2,)), sample("float8_e4m3fn", (3,))]},
        "head": sample("bool"),
    }
    ours, theirs = tmp_path / "ours.tensors", tmp_path / "theirs.tensors"
    with TensorizerWriter(ours) as writer:
        writer.write_state_dict(tensors)
    tz_write(theirs, tensors)
    assert ours.read_bytes() == theirs.read_bytes()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deserializer = TensorDeserializer(str(ours), verify_hash=True)
    tree = deserializer.tree()
    assert raw_bytes(tree["model"]["layers"][1]) == raw_bytes(tensors["model"]["layers"][1])
    deserializer.close()


def test_modules_we_write_load_into_a_module_through_tensorizer(tmp_path: Path) -> None:
    torch.manual_seed(1)
    module = Small()
    ours, theirs = tmp_path / "ours.tensors", tmp_path / "theirs.tensors"
    with TensorizerWriter(ours) as writer:
        writer.write_module(module)
    serializer = TensorSerializer(str(theirs))
    serializer.write_module(module)
    serializer.close()
    assert ours.read_bytes() == theirs.read_bytes()
    torch.manual_seed(2)
    fresh = Small()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deserializer = TensorDeserializer(str(ours), verify_hash=True)
    deserializer.load_into_module(fresh)
    deserializer.close()
    loaded = fresh.state_dict()  # tensorizer re-registers the non-persistent buffer as persistent
    for name, value in module.state_dict().items():
        assert raw_bytes(loaded[name]) == raw_bytes(value), name
    assert raw_bytes(fresh.cache) == raw_bytes(module.cache)


def test_meta_and_long_tensors_we_write_match_tensorizer_bytes(tmp_path: Path) -> None:
    tensors = {
        "a": sample("float32", (3,)),
        "m": torch.empty(3, 4, device="meta"),
        "long": torch.empty(2**32, 0),
    }
    ours, theirs = tmp_path / "ours.tensors", tmp_path / "theirs.tensors"
    with TensorizerWriter(ours) as writer:
        writer.write_state_dict(tensors)
    tz_write(theirs, tensors)
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = tz_read(ours)
    assert loaded["m"].tolist() == [[0.0] * 4] * 3 and tuple(loaded["long"].shape) == (2**32, 0)
    assert read_index(ours.read_bytes()).version == 5


def test_an_index_bigger_than_the_default_block_loads_in_tensorizer(tmp_path: Path) -> None:
    tensors = {f"model.layers.{i}.attention.weight": torch.tensor([float(i)]) for i in range(4000)}
    path = tmp_path / "many.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict(tensors)
    index = read_index(path.read_bytes())
    assert index.index_length - 73 > 256 * 1024, "the block grew to fit"
    loaded = tz_read(path)
    assert len(loaded) == 4000 and loaded["model.layers.3999.attention.weight"].item() == 3999.0
