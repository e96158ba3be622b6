"""The writers a streaming converter uses: one atomic-file policy, the safetensors header planned ahead, the
tensorizer metadata block reserved ahead, and one reader protocol over both formats."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from modelload.loader import dtypes, errors
from modelload.loader.formats import open_reader
from modelload.loader.formats._atomic import atomic_file
from modelload.loader.formats.safetensors import plan_header, save_file, serialize
from modelload.loader.formats.tensorizer import TensorizerWriter

TENSORS = {
    "z.bias": np.arange(3, dtype=np.float16),
    "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "m.idx": np.arange(5, dtype=np.int64),
}


def test_an_atomic_file_gets_the_mode_open_would_give_and_is_synced(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    old = os.umask(0o027)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(os, "fsync", fsync)
            with atomic_file(target) as file:
                file.write(b"data")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"data"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert len(synced) == 2, "the file and its directory"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_an_atomic_file_leaves_nothing_behind_on_an_error(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError), atomic_file(target) as file:
        file.write(b"new")
        raise RuntimeError("interrupted")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_an_atomic_file_without_replace_never_replaces_a_file_that_appeared(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    with pytest.raises(FileExistsError), atomic_file(target, replace=False) as file:
        file.write(b"new")
        target.write_bytes(b"appeared meanwhile")
    assert target.read_bytes() == b"appeared meanwhile"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_save_file_follows_the_atomic_policy(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        save_file(TENSORS, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o644


def test_a_planned_safetensors_header_streams_into_the_file_save_file_writes(tmp_path: Path) -> None:
    planned = {name: (dtypes.from_numpy(a.dtype), a.shape) for name, a in TENSORS.items()}
    header, offsets = plan_header(planned, metadata={"format": "pt"})
    blob = bytearray(header) + bytearray(sum(a.nbytes for a in TENSORS.values()))
    for name, array in TENSORS.items():
        at = len(header) + offsets[name]
        blob[at : at + array.nbytes] = array.tobytes()
    assert bytes(blob) == serialize(TENSORS, metadata={"format": "pt"})


def test_a_planned_safetensors_header_refuses_what_save_file_refuses() -> None:
    with pytest.raises(errors.UnsupportedDtypeError, match="'c'"):
        plan_header({"c": (dtypes.by_name("complex128"), (1,))})
    with pytest.raises(errors.HeaderError, match="reserved"):
        plan_header({"__metadata__": (dtypes.by_name("float32"), (1,))})


def test_reserving_the_tensorizer_block_lets_many_tensors_be_written_one_at_a_time(tmp_path: Path) -> None:
    names = [f"layer.{i}.a_rather_long_parameter_name.weight" for i in range(2000)]
    f32 = dtypes.by_name("float32")
    small = np.zeros(1, np.float32)
    with (
        pytest.raises(errors.ConfigError, match="too many tensors"),
        TensorizerWriter(tmp_path / "unreserved.tensors", metadata_size=4096) as writer,
    ):
        for name in names:
            writer.write_tensor(name, small)
    with TensorizerWriter(tmp_path / "m.tensors", metadata_size=4096) as writer:
        writer.reserve((name, f32, (1,)) for name in names)
        for name in names:
            writer.write_tensor(name, small)
    with open_reader(tmp_path / "m.tensors", "tensorizer") as reader:
        assert [t.name for t in reader.index.tensors] == names


def test_reserving_after_data_is_refused(tmp_path: Path) -> None:
    with TensorizerWriter(tmp_path / "m.tensors") as writer:
        writer.write_tensor("a", np.zeros(1, np.float32))
        with pytest.raises(errors.ConfigError, match="before the first tensor"):
            writer.reserve([("b", dtypes.by_name("float32"), (1,))])


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_both_readers_answer_to_the_same_names(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / f"m.{fmt}"
    if fmt == "tensorizer":
        with TensorizerWriter(path) as writer:
            writer.write_state_dict(TENSORS)
    else:
        save_file(TENSORS, path)
    with open_reader(path, fmt) as reader:  # type: ignore[arg-type]
        assert reader.path == str(path)
        for name, array in TENSORS.items():
            entry = reader.entry(name)
            assert reader.numpy(name).tobytes() == array.tobytes()
            out = bytearray(entry.nbytes)
            header = reader.readinto(entry, out)
            assert bytes(out) == array.tobytes()
            assert (header is not None) == (fmt == "tensorizer")
            reader.check(entry, scratch=bytearray(7))
        with pytest.raises(KeyError, match="nope"):
            reader.entry("nope")
