"""Our safetensors writer and reader against the real package's torch API: every torch dtype byte for byte,
the tensors torch makes awkward (views, conjugates, parameters), and sharing, which both refuse."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open

from modelload.loader import dtypes
from modelload.loader.errors import OverlapError, UnsupportedDtypeError
from modelload.loader.formats import safetensors as st
from tests.formats.test_safetensors_interop import SAFETENSORS_DTYPES, random_bytes, read_all

torch = pytest.importorskip("torch")
from safetensors.torch import load_file as torch_load_file  # noqa: E402
from safetensors.torch import save as torch_save  # noqa: E402
from safetensors.torch import save_file as torch_save_file  # noqa: E402

# The reference's torch API has no F8_E8M0 yet; the low-level tests in test_safetensors_interop cover it.
TORCH_DTYPES = [
    d
    for d in SAFETENSORS_DTYPES
    if isinstance(getattr(torch, d.name, None), torch.dtype) and d.safetensors != "F8_E8M0"
]


def torch_tensor(dtype: dtypes.DType, shape: tuple[int, ...], seed: int) -> Any:
    count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = torch.frombuffer(bytearray(random_bytes(dtype, shape, seed)), dtype=torch.uint8)
    return raw[:count].view(dtype.torch()).reshape(shape)


def torch_bytes(tensor: Any) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def saved(tmp_path: Path, tensors: dict[str, Any]) -> Path:
    path = tmp_path / "saved.safetensors"
    st.save_file(tensors, path)
    return path


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=lambda d: d.safetensors)
def test_torch_tensors_round_trip_through_both_implementations(tmp_path: Path, dtype: dtypes.DType) -> None:
    tensors = {"w": torch_tensor(dtype, (4, 3), seed=8), "s": torch_tensor(dtype, (), seed=9)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    st.save_file(tensors, ours, metadata={"k": "v"})
    torch_save_file(tensors, theirs, metadata={"k": "v"})
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = torch_load_file(ours)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert loaded[name].shape == tensor.shape
        assert torch_bytes(loaded[name]) == torch_bytes(tensor)
    assert read_all(theirs) == {
        name: (dtype.name, tuple(t.shape), torch_bytes(t)) for name, t in tensors.items()
    }


def test_safe_open_reads_our_metadata_and_slices_our_tensors(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    metadata = {"format": "pt", "note": "ünïcode ✓", "empty": ""}
    st.save_file({"x": torch.arange(6, dtype=torch.int32).reshape(2, 3)}, path, metadata=metadata)
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == metadata
        assert handle.get_slice("x")[1:].tolist() == [[3, 4, 5]]
    with st.SafetensorsFile(path) as file:
        assert file.metadata == metadata


def test_non_contiguous_and_conjugated_tensors_are_stored_as_their_values(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    other = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    complex_ = torch.randn(3, dtype=torch.complex64)
    tensors = {"t": base.t(), "strided": other[:, ::2], "conj": complex_.conj()}
    loaded = torch_load_file(saved(tmp_path, tensors))
    assert torch.equal(loaded["t"], base.t().contiguous())
    assert torch.equal(loaded["strided"], other[:, ::2].contiguous())
    assert torch.equal(loaded["conj"], complex_.conj().resolve_conj())


def test_a_slice_of_a_larger_storage_and_a_parameter_are_written_alone(tmp_path: Path) -> None:
    storage = torch.arange(100, dtype=torch.int64)
    path = saved(tmp_path, {"slice": storage[10:20], "param": torch.nn.Parameter(torch.ones(3))})
    with st.SafetensorsFile(path) as file:
        assert path.stat().st_size == file.index.index_length + 10 * 8 + 3 * 4
    assert torch_load_file(path)["slice"].tolist() == list(range(10, 20))


def test_tied_weights_are_refused_as_the_reference_refuses_them(tmp_path: Path) -> None:
    weight = torch.randn(4, 4)
    tied = {"embed.weight": weight, "lm_head.weight": weight}
    with pytest.raises(OverlapError, match=r"'embed.weight' and 'lm_head.weight' share memory.*clone"):
        st.save_file(tied, tmp_path / "tied.safetensors")
    with pytest.raises(RuntimeError, match="share memory"):
        torch_save(tied)
    assert not list(tmp_path.iterdir()), "a refused save leaves no file behind"


def test_overlapping_views_are_refused_and_disjoint_views_of_one_storage_are_not() -> None:
    storage = torch.arange(10, dtype=torch.float32)
    with pytest.raises(OverlapError, match="share memory"):
        st.serialize({"a": storage[:6], "b": storage[4:]})
    blob = st.serialize({"a": storage[:5], "b": storage[5:]})
    assert torch_save({"a": storage[:5].clone(), "b": storage[5:].clone()}) == blob


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions.*:UserWarning")
def test_quantized_and_sparse_torch_tensors_are_refused() -> None:
    with pytest.raises(UnsupportedDtypeError, match="dense tensors"):
        st.serialize({"x": torch.eye(3).to_sparse()})
    with pytest.raises(UnsupportedDtypeError, match="quantized"):
        st.serialize({"x": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)})
