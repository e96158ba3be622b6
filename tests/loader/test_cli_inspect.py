"""``modelload inspect``: what it reports, checked against the real packages' view of the same files."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader.cli.main import main
from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.release import Releaser
from modelload.loader.sizes import format_bytes
from tests.formats.tensorizer_support import index_of, sample, torch, tz_write

safetensors_torch = pytest.importorskip("safetensors.torch")
tensorizer = pytest.importorskip("tensorizer")
from safetensors import safe_open  # noqa: E402
from tensorizer import TensorDeserializer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MIN_ARGON2 = (tensorizer.EncryptionParams.OpsLimit.MIN, tensorizer.EncryptionParams.MemLimit.MIN)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["inspect", "--no-progress", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    return code, out, err


def inspect_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, dict[str, Any]]:
    code, out, _ = cli(capsys, "--json", *args)
    assert out.count("\n") == 1, "one JSON document on one line"
    return code, json.loads(out)


MODEL = {
    "embed.weight": ("bfloat16", (16, 8)),
    "layers.0.w": ("float32", (8, 8)),
    "layers.0.b": ("float32", (8,)),
    "layers.1.w": ("float16", (8, 8)),
    "step": ("int64", ()),
}


def model() -> dict[str, Any]:
    return {name: sample(dtype, shape, seed=i) for i, (name, (dtype, shape)) in enumerate(MODEL.items())}


# --- human output ------------------------------------------------------------------------------------------


def test_human_output_shows_format_counts_dtypes_metadata_and_a_limited_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(model(), str(path), metadata={"format": "pt"})
    code, out, _ = cli(capsys, path, "--limit", "2")
    assert code == 0
    lines = out.splitlines()
    assert "format      safetensors" in lines
    assert f"tensors     5, {16 * 8 * 2 + 64 * 4 + 8 * 4 + 64 * 2 + 8} B" in lines
    assert "metadata    format = pt" in lines
    assert any(line.startswith("dtypes      float32") and "2 tensors" in line for line in lines)
    assert any(line.startswith("            bfloat16") and "1 tensors" in line for line in lines)
    table = lines[lines.index("") + 1 :]
    assert table[0].split() == ["name", "dtype", "shape", "bytes"]
    in_file_order = [t.name for t in index_of(path).tensors]
    assert [row.split()[0] for row in table[1:3]] == in_file_order[:2]
    assert table[1].split()[1:] == ["int64", "[]", "8", "B"]
    assert len(table) == 4 and table[3] == "... 3 more tensors (--all shows every one)"

    code, out, _ = cli(capsys, path, "--all")
    names = {line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in MODEL}
    assert names == set(MODEL)
    assert "more tensors" not in out


def test_encrypted_file_shows_its_index_without_a_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "enc.tensors"
    tz_write(path, model(), encryption=tensorizer.EncryptionParams.from_string("pw", *MIN_ARGON2))
    code, out, _ = cli(capsys, path)
    assert code == 0
    assert "encrypted   yes, key derived from a password (Argon2id, 1 passes, 8.0 KiB)" in out
    assert "layers.1.w" in out and "[8, 8]" in out


# --- JSON --------------------------------------------------------------------------------------------------


def test_json_of_a_tensorizer_file_matches_what_the_real_tensorizer_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.tensors"
    tz_write(path, model())
    code, report = inspect_json(capsys, path)
    assert code == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deserializer = TensorDeserializer(str(path), lazy_load=False)
    try:
        loaded = dict(deserializer.items())
    finally:
        deserializer.close()
    assert report["format"] == "tensorizer" and report["encrypted"] is False and report["encryption"] is None
    assert report["file_size"] == path.stat().st_size
    assert report["tensor_count"] == len(loaded)
    assert report["total_bytes"] == sum(t.numel() * t.element_size() for t in loaded.values())
    assert [row["name"] for row in report["tensors"]] == list(loaded)
    for row in report["tensors"]:
        tensor = loaded[row["name"]]
        assert row["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert row["shape"] == list(tensor.shape)
        assert row["bytes"] == tensor.numel() * tensor.element_size()
        assert row["kind"] == "state_dict" and row["data_length"] == row["bytes"]
    assert report["dtypes"]["float32"] == {"count": 2, "bytes": (64 + 8) * 4}
    assert "verify" not in report


def test_json_of_a_safetensors_file_matches_safe_open(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(model(), str(path), metadata={"format": "pt"})
    code, report = inspect_json(capsys, path)
    assert code == 0
    with safe_open(str(path), framework="pt") as file:
        assert report["metadata"] == file.metadata()
        assert sorted(row["name"] for row in report["tensors"]) == sorted(file.keys())
        for row in report["tensors"]:
            tensor = file.get_tensor(row["name"])
            assert row["dtype"] == str(tensor.dtype).removeprefix("torch.")
            assert row["shape"] == list(file.get_slice(row["name"]).get_shape())
            assert row["bytes"] == tensor.numel() * tensor.element_size()
    header = int.from_bytes(path.read_bytes()[:8], "little")
    assert min(row["offset"] for row in report["tensors"]) == 8 + header


# --- verify ------------------------------------------------------------------------------------------------


def test_verify_catches_one_corrupted_tensor_and_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.tensors"
    tz_write(path, model())
    code, out, _ = cli(capsys, path, "--verify")
    assert code == 0
    assert "verify      ok: CRC32 and SHA-256 of every tensor checked" in out

    entry = next(t for t in index_of(path).tensors if t.name == "layers.0.w")
    data = bytearray(path.read_bytes())
    data[entry.data_offset + entry.data_length // 2] ^= 0x01
    path.write_bytes(data)

    code, report = inspect_json(capsys, path, "--verify")
    assert code == 1
    verify = report["verify"]
    assert verify["ok"] is False and verify["checked"] == len(MODEL)
    assert [f["name"] for f in verify["failures"]] == ["layers.0.w"]
    assert "CRC32" in verify["failures"][0]["error"] or "SHA-256" in verify["failures"][0]["error"]

    code, out, _ = cli(capsys, path, "--verify")
    assert code == 1
    assert "verify      FAILED for 1 tensors" in out and "  layers.0.w: " in out


def test_verify_of_an_encrypted_file_needs_and_uses_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = tensorizer.EncryptionParams.random()
    path = tmp_path / "enc.tensors"
    tz_write(path, model(), encryption=params)
    (tmp_path / "key").write_bytes(params.key)
    (tmp_path / "wrong").write_bytes(bytes(32))

    code, report = inspect_json(capsys, path)
    assert code == 0
    assert report["encrypted"] is True
    assert report["encryption"] == {"key": "raw", "argon2": None, "chunk_size": 2 * 1024 * 1024}

    code, _, err = cli(capsys, path, "--verify")
    assert code == 1 and "is encrypted" in err and "--key-file" in err

    code, report = inspect_json(capsys, path, "--verify", "--key-file", tmp_path / "key")
    assert code == 0
    assert report["verify"]["ok"] is True and "after decryption" in report["verify"]["note"]

    code, _, err = cli(capsys, path, "--verify", "--key-file", tmp_path / "wrong")
    assert code == 1 and "key or password is wrong" in err


def test_verify_of_safetensors_reads_everything_and_says_there_is_nothing_to_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(model(), str(path))
    code, report = inspect_json(capsys, path, "--verify")
    assert code == 0
    assert report["verify"]["checked"] == len(MODEL) and "stores no hashes" in report["verify"]["note"]


def test_verify_memory_follows_its_window_not_what_the_file_declares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: --verify allocated the largest tensor's size, meta tensors included (a tiny file declaring
    a 256 MiB meta tensor cost 256 MiB). Now it reads through one window (8 MiB) whatever the file claims."""
    path = tmp_path / "meta.tensors"
    real = np.random.default_rng(3).integers(0, 255, 24 << 20, dtype=np.uint8)
    tz_write(
        path,
        {"ghost": torch.empty(1 << 26, dtype=torch.float32, device="meta"), "real": torch.from_numpy(real)},
    )
    assert path.stat().st_size < 25 << 20
    tracemalloc.start()
    try:
        code, report = inspect_json(capsys, path, "--verify")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert code == 0 and report["verify"]["ok"] is True and report["total_bytes"] == (256 + 24) << 20
    assert peak < 16 << 20, f"verify peaked at {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("window", [1000, 4096])
def test_verify_through_a_small_window_still_catches_corruption_in_every_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, window: int
) -> None:
    """Streaming must not weaken the check: a window smaller and larger than the 1 KiB encryption chunks."""
    from modelload.loader.cli import inspect as inspect_cli
    from modelload.loader.formats.tensorizer import EncryptionParams, TensorizerWriter

    monkeypatch.setattr(inspect_cli, "VERIFY_WINDOW", window)
    key = bytes(range(32))
    (tmp_path / "key").write_bytes(key)
    tensors = {"w": np.arange(3000, dtype=np.float32), "b": np.arange(5, dtype=np.int16)}
    plain, enc, st_path = tmp_path / "p.tensors", tmp_path / "e.tensors", tmp_path / "m.safetensors"
    with TensorizerWriter(plain) as writer:
        writer.write_state_dict(tensors)
    with TensorizerWriter(enc, encryption=EncryptionParams.from_key(key, chunk_size=1024)) as writer:
        writer.write_state_dict(tensors)
    safetensors_torch.save_file({k: torch.from_numpy(v) for k, v in tensors.items()}, str(st_path))
    for path, extra in ((plain, ()), (enc, ("--key-file", tmp_path / "key")), (st_path, ())):
        code, report = inspect_json(capsys, path, "--verify", *extra)
        assert code == 0 and report["verify"]["ok"] is True, report["verify"]
    for path, extra in ((plain, ()), (enc, ("--key-file", tmp_path / "key"))):
        entry = next(t for t in index_of(path).tensors if t.name == "w")
        data = bytearray(path.read_bytes())
        data[entry.data_offset + entry.data_length - 3] ^= 0x10  # in the last window and the last chunk
        path.write_bytes(data)
        code, report = inspect_json(capsys, path, "--verify", *extra)
        assert code == 1 and [f["name"] for f in report["verify"]["failures"]] == ["w"], report["verify"]


def test_inspect_of_a_name_with_a_lone_surrogate_is_a_clear_error_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from modelload.loader.formats.tensorizer import TensorizerWriter

    path = tmp_path / "named.tensors"
    with TensorizerWriter(path) as writer:
        writer.write_state_dict({"zzzzzz": {"w": np.zeros(2, np.float32)}})
    path.write_bytes(path.read_bytes().replace(b'"zzzzzz"', b'"\\udc80"'))
    code, out, err = cli(capsys, path)
    assert code == 1 and out == ""
    assert "unpaired UTF-16 surrogate" in err and "Traceback" not in err


# --- segments ----------------------------------------------------------------------------------------------


def test_a_segment_shows_its_writer_state_readiness_error_metadata_and_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = [TensorSpec("a", by_name("float32"), (4,)), TensorSpec("b", by_name("int8"), (3,))]
    path = tmp_path / "model.seg"
    writer = SegmentWriter.create(path, plan_layout(specs, metadata={"format": "tensorizer", "source": "x"}))
    with writer:
        writer.slot(0)[:] = bytes(range(16))
        writer.mark_ready(0, verified=True, decrypted=True, crc32=12345)
        code, report = inspect_json(capsys, path)
        assert code == 0
        assert report["format"] == "segment" and report["version"] == 1
        assert report["metadata"] == {"format": "tensorizer", "source": "x"}
        segment = report["segment"]
        assert segment["writer_state"] == "LOADING" and segment["tensors_ready"] == 1
        assert segment["bytes_ready"] == 16 and segment["load_id"] == f"{writer.load_id:016x}"
        a, b = report["tensors"]
        assert (
            a["state"] == "READY" and a["flags"] == ["verified", "decrypted", "crc32"] and a["crc32"] == 12345
        )
        assert b["state"] == "PENDING" and b["flags"] == []

        code, report = inspect_json(capsys, path, "--verify")
        assert code == 1, "the CRC-32 recorded for 'a' is not that of its bytes"
        assert [f["name"] for f in report["verify"]["failures"]] == ["a"]
        assert "1 are not ready" in report["verify"]["note"]

        writer.mark_failed("the source went away")
        code, out, _ = cli(capsys, path)
        assert code == 0
        assert "writer      FAILED" in out and "error       the source went away" in out
        assert "flags       verified 1, decrypted 1, crc32 1" in out


def test_a_ring_segment_is_verified_through_the_ring_and_released_tensors_count_as_not_ready(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate([5000, 6000, 7000])]
    layout = plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=3 * 4096)
    path = tmp_path / "ring.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        releaser = Releaser(writer.fileno(), layout, punch=False)
        for slot in layout.slots[:2]:  # t1 runs past the ring's end, over t0's bytes; t2 is pending
            data = bytes([slot.index + 1]) * slot.nbytes
            writer.slot(slot.index)[:] = data
            writer.mark_ready(slot.index, crc32=zlib.crc32(data))
            if slot.index == 0:
                releaser.release(0)
        releaser.close()
        assert len(writer.file_ranges(layout.slots[1].offset, 6000)) == 2
        code, report = inspect_json(capsys, path, "--verify")
    assert code == 0, report.get("verify")
    assert report["version"] == 4 and report["file_size"] == layout.data_offset + 3 * 4096
    assert [t["state"] for t in report["tensors"]] == ["RELEASED", "READY", "PENDING"]
    assert report["verify"]["ok"] is True and report["verify"]["checked"] == 1
    assert "2 are not ready" in report["verify"]["note"]


def test_a_torch_checkpoint_or_a_stranger_is_refused_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    code, _, err = cli(capsys, tmp_path / "w.pt")
    assert code == 2 and "torch checkpoint" in err and "modelload serialize" in err
    (tmp_path / "x").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(40))
    code, _, err = cli(capsys, tmp_path / "x")
    assert code == 1 and "GGUF" in err


def test_the_console_script_prints_json_in_a_fresh_process(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    safetensors_torch.save_file(model(), str(path))
    done = subprocess.run(
        [sys.executable, "-m", "modelload.loader.cli.main", "inspect", "--json", str(path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensor_count"] == len(MODEL)


# --- model directories --------------------------------------------------------------------------------------


def test_inspect_shows_a_model_directory_as_one_model(tmp_path: Path) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=61, layers=3)
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=3))
    out = subprocess_json(main, ["inspect", str(source), "--json", "--verify", "--no-progress"])
    report = json.loads(out)
    assert report["tensor_count"] == len(weights)
    assert sorted(row["name"] for row in report["tensors"]) == sorted(weights)
    assert [f["name"] for f in report["files"]] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sum(f["tensor_count"] for f in report["files"]) == len(weights)
    assert "config.json" in report["small_files"] and "README.md" in report["ignored"]
    assert report["verify"]["ok"] and report["verify"]["checked"] == len(weights)


def test_verifying_a_model_directory_draws_one_bar_over_the_whole_model(tmp_path: Path, capsys: Any) -> None:
    # before the fix each shard drew a bar of its own, "100.0% 250.0 KiB/250.0 KiB" once per file
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=63, layers=3)
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=3))
    assert main(["inspect", str(source), "--verify"]) == 0
    drawn = [line for line in capsys.readouterr().err.splitlines() if line.startswith("verify [")]
    total = format_bytes(sum(t.numel() * t.element_size() for t in weights.values()))
    assert all(f"/{total} " in line for line in drawn), drawn
    finished = [line for line in drawn if " in " in line]
    assert len(finished) == 1 and f"100.0% {total}/{total}" in finished[0], drawn


def test_inspect_refuses_overlapping_shards_and_remote_uris(tmp_path: Path, capsys: Any) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=62, layers=2)
    content = hfdir.files(weights, shards=2, index=False)
    first = next(iter(weights))
    content["model-extra.safetensors"] = hfdir._safetensors({first: weights[first]})
    source = hfdir.write(tmp_path / "overlap", content)
    assert main(["inspect", str(source)]) != 0
    err = capsys.readouterr().err
    assert "model-extra.safetensors" in err and "Traceback" not in err
    assert main(["inspect", "s3://bucket/model.safetensors"]) != 0
    err = capsys.readouterr().err
    assert "modelload sidecar --source" in err and "s3:/bucket" not in err
    # the advice is two commands, each quoted whole (the closing backtick once fell after the second)
    assert "`modelload sidecar --source URI --segment PATH`, then `modelload inspect PATH`" in err


def subprocess_json(main: Any, argv: list[str]) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()
