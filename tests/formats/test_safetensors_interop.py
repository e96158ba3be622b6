"""Our safetensors reader and writer against the real safetensors package, in both directions.

Tensors are compared by their bytes, not their values: NaN payloads, negative zeros and the float8 types
must survive exactly, and a byte comparison is the only one that says so for every dtype.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from modelload.loader import dtypes
from modelload.loader.errors import OverlapError, SizeMismatchError, UnsupportedDtypeError
from modelload.loader.formats import safetensors as st

SAFETENSORS_DTYPES = [d for d in (dtypes.by_name(n) for n in dtypes.names()) if d.safetensors]
NUMPY_DTYPES = [d for d in SAFETENSORS_DTYPES if not d.opaque]


def random_bytes(dtype: dtypes.DType, shape: tuple[int, ...], seed: int) -> bytes:
    """Random bytes for a tensor; bools get 0 and 1 only (other bytes are not booleans)."""
    count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, count, dtype=np.uint8)
    return (raw & 1).tobytes() if dtype.name == "bool" else raw.tobytes()


def numpy_array(dtype: dtypes.DType, shape: tuple[int, ...], seed: int) -> np.ndarray[Any, Any]:
    return np.frombuffer(random_bytes(dtype, shape, seed), dtype=dtype.numpy).reshape(shape).copy()


def ours(dtype: dtypes.DType, array: np.ndarray[Any, Any]) -> Any:
    """What our writer takes for a tensor of ``dtype``: the array itself, or its bytes with the dtype named
    when numpy has no such type (bfloat16, float8)."""
    return st.RawTensor(dtype, array.shape, array) if dtype.opaque else array


def reference_spec(dtype: dtypes.DType, data: np.ndarray[Any, Any], shape: tuple[int, ...]) -> Any:
    """A tensor for the reference's low-level serializer, which takes any of its dtypes as raw bytes."""
    return safetensors.TensorSpec(
        dtype=dtype.name, shape=list(shape), data_ptr=data.ctypes.data, data_len=data.nbytes
    )


def read_all(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    with st.SafetensorsFile(path) as file:
        return {
            name: (file.entry(name).dtype.name, file.entry(name).shape, file.numpy(name).tobytes())
            for name in file.names()
        }


# --- every dtype, both directions -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=lambda d: d.safetensors)
def test_every_dtype_we_write_reads_back_byte_for_byte_in_the_reference(
    tmp_path: Path, dtype: dtypes.DType
) -> None:
    array = numpy_array(dtype, (3, 5), seed=1)
    blob = st.serialize({"t": ours(dtype, array), "scalar": ours(dtype, numpy_array(dtype, (), seed=2))})
    parsed = dict(safetensors.deserialize(blob))
    assert parsed["t"]["dtype"] == dtype.safetensors
    assert parsed["t"]["shape"] == [3, 5]
    assert bytes(parsed["t"]["data"]) == array.tobytes()
    assert parsed["scalar"]["shape"] == []
    assert bytes(parsed["scalar"]["data"]) == random_bytes(dtype, (), seed=2)


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=lambda d: d.safetensors)
def test_every_dtype_the_reference_writes_reads_back_byte_for_byte(
    tmp_path: Path, dtype: dtypes.DType
) -> None:
    data = numpy_array(dtype, (4, 2), seed=3)
    path = tmp_path / "ref.safetensors"
    safetensors.serialize_file({"t": reference_spec(dtype, data, (4, 2))}, path)
    assert read_all(path) == {"t": (dtype.name, (4, 2), data.tobytes())}


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=lambda d: d.safetensors)
def test_our_files_equal_the_reference_writers_files(dtype: dtypes.DType) -> None:
    f64 = dtypes.by_name("float64")
    arrays = {
        "b": (dtype, numpy_array(dtype, (2, 3), seed=4)),
        "a": (dtype, numpy_array(dtype, (7,), seed=5)),
        "empty": (dtype, numpy_array(dtype, (0, 4), seed=6)),
        "wide": (f64, numpy_array(f64, (3,), seed=7)),
    }
    tensors = {name: ours(d, a) for name, (d, a) in arrays.items()}
    specs = {name: reference_spec(d, a, a.shape) for name, (d, a) in arrays.items()}
    assert st.serialize(tensors, metadata={"format": "np"}) == safetensors.serialize(specs, {"format": "np"})


# --- what the writer refuses -----------------------------------------------------------------------------


def test_raw_tensors_must_hold_exactly_their_bytes() -> None:
    bf16 = dtypes.by_name("bfloat16")
    with pytest.raises(SizeMismatchError, match="12 bytes, but its data is 10"):
        st.serialize({"x": st.RawTensor(bf16, (2, 3), bytes(10))})
    blob = st.serialize({"x": st.RawTensor(bf16, (2, 3), bytes(range(12)))})
    assert dict(safetensors.deserialize(blob))["x"] == {
        "dtype": "BF16",
        "shape": [2, 3],
        "data": bytearray(range(12)),
    }


def test_numpy_views_that_share_memory_are_refused() -> None:
    array = np.zeros(10, np.float32)
    with pytest.raises(OverlapError, match="'a' and 'b'"):
        st.serialize({"a": array, "b": array[::-1]})


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.zeros(2, np.complex128), "complex128, which safetensors cannot store"),
        (np.zeros(2, ">f4"), "big-endian"),
    ],
)
def test_arrays_safetensors_cannot_hold_are_refused(value: Any, match: str) -> None:
    with pytest.raises(UnsupportedDtypeError, match=match):
        st.serialize({"x": value})


# --- numpy API of the reference, sizes and shapes ---------------------------------------------------------


def test_numpy_files_round_trip_with_zero_size_and_scalar_tensors(tmp_path: Path) -> None:
    tensors = {
        f"{d.name}.{kind}": numpy_array(d, shape, seed=i)
        for i, d in enumerate(NUMPY_DTYPES)
        for kind, shape in (("scalar", ()), ("empty", (0,)), ("empty2", (3, 0, 2)), ("full", (2, 3)))
    }
    path = tmp_path / "np.safetensors"
    st.save_file(tensors, path)
    assert path.read_bytes() == safetensors.numpy.save(tensors)
    loaded = safetensors.numpy.load_file(path)
    assert {k: (v.dtype, v.shape, v.tobytes()) for k, v in loaded.items()} == {
        k: (v.dtype, v.shape, v.tobytes()) for k, v in tensors.items()
    }
    safetensors.numpy.save_file(tensors, tmp_path / "ref.safetensors")
    ours = st.load_numpy(tmp_path / "ref.safetensors")
    assert {k: (v.dtype, v.shape, v.tobytes()) for k, v in ours.items()} == {
        k: (v.dtype, v.shape, v.tobytes()) for k, v in tensors.items()
    }


def test_many_tensors_and_a_header_past_the_first_read_need_exactly_two_reads(tmp_path: Path) -> None:
    names = [f"model.layers.{i}.mlp.down_proj.weight.{'x' * (i % 40)}" for i in range(3000)]
    tensors = {name: np.full((i % 5, 3), i, np.int16) for i, name in enumerate(names)}
    blob = safetensors.numpy.save(tensors, metadata={"big": "y" * 70_000})
    header_size = int.from_bytes(blob[:8], "little")
    assert header_size > st.FIRST_READ_LENGTH

    calls: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return blob[offset : offset + length]

    index = st.read_index(read, size=len(blob))
    assert calls == [
        (0, st.FIRST_READ_LENGTH),
        (st.FIRST_READ_LENGTH, 8 + header_size - st.FIRST_READ_LENGTH),
    ]
    assert len(index) == 3000
    assert index.metadata == {"big": "y" * 70_000}
    assert index.index_length == 8 + header_size
    assert index.data_end == len(blob)
    by_name = {t.name: t for t in index.tensors}
    for i, name in enumerate(names):
        entry = by_name[name]
        assert entry.shape == (i % 5, 3)
        assert (
            np.frombuffer(blob[entry.data_offset : entry.data_offset + entry.data_length], "<i2").tolist()
            == [i] * (i % 5) * 3
        )


def test_a_small_header_costs_one_read_and_tensors_come_in_file_order() -> None:
    blob = safetensors.numpy.save(
        {"z": np.ones(3, np.float64), "a": np.ones(2, np.uint8), "m": np.ones(4, np.float32)}
    )
    calls = []

    def read(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return blob[offset : offset + length]

    index = st.read_index(read)
    assert calls == [(0, st.FIRST_READ_LENGTH)]
    offsets = [t.data_offset for t in index.tensors]
    assert offsets == sorted(offsets)
    assert [t.name for t in index.tensors] == ["z", "m", "a"]  # the reference's order: widest dtype first
    assert all(t.record_offset == t.data_offset and t.kind == "state_dict" for t in index.tensors)
    assert index.format == "safetensors" and index.version == 1
    assert index.tensors[0].data_offset % 8 == 0, "the padded header aligns the data buffer to 8 bytes"


def test_readinto_fills_a_caller_buffer_and_refuses_a_wrong_one(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    st.save_file({"v": values}, path)
    with st.SafetensorsFile(path) as file:
        target = bytearray(48)
        file.readinto("v", target)
        assert bytes(target) == values.tobytes()
        into = np.empty((3, 4), np.float32)
        file.readinto("v", memoryview(into))
        assert np.array_equal(into, values)
        with pytest.raises(ValueError, match="48 bytes, the buffer 40"):
            file.readinto("v", bytearray(40))
        with pytest.raises(ValueError, match="read-only"):
            file.readinto("v", bytes(48))
        with pytest.raises(ValueError, match="C-contiguous"):
            file.readinto("v", np.empty((4, 6), np.float32)[:, ::2].T)
        with pytest.raises(KeyError):
            file.readinto("missing", target)


def test_torch_stays_unimported_until_torch_tensors_are_handed_in() -> None:
    code = (
        "import sys, numpy as np\n"
        "from modelload.loader.formats import safetensors as st\n"
        "blob = st.serialize({'x': np.zeros(3, np.float32)})\n"
        "st.read_index(lambda o, n: blob[o:o + n])\n"
        "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules, sorted(sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
