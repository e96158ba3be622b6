"""``modelload stage``: files written by the real packages, staged into segments that attach() reads."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelload.loader import LoadFailedError, attach, dtypes
from modelload.loader.cli.main import main
from modelload.loader.errors import ConfigError
from modelload.loader.formats import read_index
from modelload.loader.segment import SegmentReader, TensorFlags
from modelload.loader.segment.modeldir import MARKER
from tests.formats.tensorizer_support import raw_bytes, sample, torch, tz_write
from tests.support.failures import assert_load_failed

safetensors_torch = pytest.importorskip("safetensors.torch")
tensorizer = pytest.importorskip("tensorizer")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MIN_ARGON2 = (tensorizer.EncryptionParams.OpsLimit.MIN, tensorizer.EncryptionParams.MemLimit.MIN)
SAFETENSORS_DTYPES = tuple(n for n in dtypes.names() if dtypes.by_name(n).safetensors is not None)


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["stage", "--no-progress", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    return code, out, err


def every_dtype() -> dict[str, Any]:
    tensors = {f"t.{name}": sample(name, (3, 5), seed=i) for i, name in enumerate(SAFETENSORS_DTYPES)}
    tensors["big"] = sample("float32", (300_000,))  # more than one page, spanning several
    tensors["empty"] = torch.empty((0, 4), dtype=torch.float16)
    tensors["scalar"] = sample("int64", ())
    return tensors


def assert_attached(segment: Path, tensors: dict[str, Any]) -> dict[str, str]:
    """Attach to the segment and compare every tensor byte for byte; return its metadata."""
    with attach(segment, timeout=5, notify=False) as model:
        assert model.complete
        assert sorted(model.names) == sorted(tensors)
        for name, tensor in tensors.items():
            got = model.tensor(name)
            assert got.dtype == tensor.dtype and tuple(got.shape) == tuple(tensor.shape), name
            assert raw_bytes(got) == raw_bytes(tensor), name
        return dict(model.metadata)


@pytest.mark.parametrize("threads", ["1", "3"])
def test_a_safetensors_file_stages_byte_exact_with_its_metadata(
    shm_dir: Path, capsys: pytest.CaptureFixture[str], threads: str
) -> None:
    tensors = every_dtype()
    source = shm_dir / "m.safetensors"
    safetensors_torch.save_file(tensors, str(source))
    segment = shm_dir / "model.seg"

    code, out, err = cli(capsys, source, segment, "--threads", threads)
    assert code == 0, err
    assert out.startswith(f"staged {segment} (safetensors): {len(tensors)} tensors, ")
    metadata = assert_attached(segment, tensors)
    assert metadata["format"] == "safetensors"
    assert metadata["source"] == str(source.resolve())
    assert metadata["source_size"] == str(source.stat().st_size)
    assert metadata["writer"].startswith("modelload-stage ")


def test_an_encrypted_tensorizer_file_stages_decrypted_and_verified(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = every_dtype()
    del tensors["empty"]  # the real tensorizer cannot encrypt a tensor of zero elements
    source = shm_dir / "m.tensors"
    password = shm_dir / "password"
    password.write_text("s3cret\n")
    tz_write(source, tensors, encryption=tensorizer.EncryptionParams.from_string("s3cret", *MIN_ARGON2))
    segment = shm_dir / "model.seg"

    code, out, err = cli(capsys, source, segment, "--password-file", password)
    assert code == 0, err
    assert "(tensorizer, decrypted, verified)" in out
    assert assert_attached(segment, tensors)["format"] == "tensorizer"
    with SegmentReader.open(segment) as reader:
        for slot in reader.slots:
            want = TensorFlags.VERIFIED | TensorFlags.CRC32
            want |= TensorFlags.DECRYPTED if slot.nbytes else TensorFlags.NONE
            assert reader.flags(slot.index) == want, slot.name


def test_an_encrypted_file_without_its_key_creates_no_segment(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = shm_dir / "m.tensors"
    tz_write(source, {"w": sample("float32", (4,))}, encryption=tensorizer.EncryptionParams.random())
    code, _, err = cli(capsys, source, shm_dir / "model.seg")
    assert code == 1 and "is encrypted" in err
    assert not (shm_dir / "model.seg").exists()


def test_a_corrupt_file_fails_the_stage_leaving_the_reason_and_no_segment_holding_memory(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"a": sample("float32", (100,)), "b": sample("int32", (50,)), "c": sample("float16", (8,))}
    source = shm_dir / "m.tensors"
    tz_write(source, tensors)
    data = bytearray(source.read_bytes())
    entry = read_index(lambda o, n: bytes(data[o : o + n]), size=len(data)).tensors[1]
    data[entry.data_offset] ^= 0x10
    source.write_bytes(data)
    segment = shm_dir / "model.seg"
    code, _, err = cli(capsys, source, segment, "--threads", "1")
    assert code == 1
    assert err.startswith("modelload stage: ") and "tensor 'b'" in err
    assert not segment.exists(), "the failed segment holds no memory"
    assert not list(shm_dir.glob(".model.seg*")), "nor does anything set aside"
    assert "tensor 'b'" in (shm_dir / "model.seg.failed").read_text()
    with pytest.raises(LoadFailedError, match=r"tensor 'b'.*corrupt"):
        attach(segment, timeout=5, notify=False)

    code, _, err = cli(capsys, source, segment, "--no-verify")
    assert code == 0, "without --verify the flipped bit goes unnoticed: the check above is the hash check"


def test_staging_into_a_missing_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "m.safetensors"
    safetensors_torch.save_file({"w": sample("float32", (2,))}, str(source))
    code, _, err = cli(capsys, source, tmp_path / "nowhere" / "model.seg")
    assert code == 2  # a configuration error, as every command exits
    assert "does not exist" in err and str(tmp_path / "nowhere") in err


def test_stage_refuses_a_missing_folder_as_the_sidecar_does_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from modelload.sidecar.process import Sidecar
    from modelload.sidecar.settings import parse_settings

    model = tmp_path / "model"  # a directory model: config beside the weights, as from the Hub
    model.mkdir()
    safetensors_torch.save_file({"w": sample("float32", (2,))}, str(model / "model.safetensors"))
    (model / "config.json").write_text("{}")
    target = tmp_path / "volume" / "model.seg"
    code, _, err = cli(capsys, model, target)
    assert code == 2
    assert f"the segment's folder {target.parent} does not exist" in err
    assert not target.parent.exists(), "stage created neither the folder nor a model directory in it"
    argv = ["--source", str(model), "--segment", str(target), "--port", "0"]
    with pytest.raises(ConfigError, match=f"the segment's folder {target.parent} does not exist"):
        Sidecar(parse_settings(argv, environ={}))  # the same words from the sidecar


def test_a_stage_refused_by_a_full_volume_leaves_no_model_directory_behind(
    tmp_path: Path, tiny_tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    safetensors_torch.save_file({"w": sample("float32", (600_000,))}, str(model / "model.safetensors"))
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "tokenizer.json").write_text("{}")
    code, _, err = cli(capsys, model, tiny_tmpfs / "model.seg")
    assert code == 1 and "sizeLimit" in err
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["model.seg.failed", "model.seg.lock"], (
        "no model/ folder of config files, no segment: only the reason"
    )


def test_a_file_that_is_not_a_segment_is_not_replaced_unless_forced(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"w": sample("bfloat16", (5,))}
    source = shm_dir / "m.safetensors"
    safetensors_torch.save_file(tensors, str(source))
    other = shm_dir / "notes.txt"
    other.write_text("keep me")

    code, _, err = cli(capsys, source, other)
    assert code == 2 and "not a modelload segment" in err and "--force" in err
    assert other.read_text() == "keep me"
    code, _, err = cli(capsys, source, source, "--force")
    assert code == 2 and "is the model file itself" in err
    assert source.stat().st_size > 0

    code, _, _ = cli(capsys, source, other, "--force")
    assert code == 0
    assert_attached(other, tensors)
    code, _, err = cli(capsys, source, other)
    assert code == 0 and "replacing the segment" in err


def test_the_console_script_stages_in_a_fresh_process(shm_dir: Path) -> None:
    tensors = {"w": sample("float32", (64, 64)), "b": sample("bfloat16", (64,), seed=1)}
    source = shm_dir / "m.tensors"
    tz_write(source, tensors)
    segment = shm_dir / "model.seg"
    done = subprocess.run(
        [sys.executable, "-m", "modelload.loader.cli.main", "stage", str(source), str(segment)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "stage [" in done.stderr and done.stdout.startswith(f"staged {segment} (tensorizer, verified)")
    assert_attached(segment, tensors)


def test_where_the_kernel_cannot_copy_tensors_are_read_into_their_slots(
    shm_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def refuse(*args: Any) -> int:
        calls.append(args)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    tensors = every_dtype()
    source = shm_dir / "m.safetensors"
    safetensors_torch.save_file(tensors, str(source))
    code, _, err = cli(capsys, source, shm_dir / "model.seg", "--threads", "1")
    assert code == 0, err
    assert len(calls) == 1, "after one refusal every tensor is read instead"
    assert_attached(shm_dir / "model.seg", tensors)


# --- model directories --------------------------------------------------------------------------------------


def test_a_model_directory_stages_every_shard_and_its_small_files(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, shm_dir: Path
) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=60, layers=3)
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=3))
    segment = shm_dir / "model.seg"
    code, out, _ = cli(capsys, source, segment)
    assert code == 0
    assert "from 3 files" in out
    models.assert_segment_matches(segment, weights)
    with attach(segment, notify=False) as model:
        assert model.model_dir == shm_dir / "model"
    assert sorted(p.name for p in (shm_dir / "model").iterdir()) == sorted(
        [*hfdir.SMALL_FILES, "model.safetensors.index.json", MARKER]  # the marker: a folder stage may replace
    )
    with SegmentReader.open(segment) as reader:
        assert len(reader.files) == 3
    elsewhere = tmp_path / "cfg"
    code, _, _ = cli(capsys, source, segment, "--model-dir", elsewhere)
    assert code == 0
    assert (elsewhere / "config.json").read_bytes() == hfdir.SMALL_FILES["config.json"]


def test_stage_refuses_a_remote_uri_naming_the_sidecar(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = cli(capsys, "s3://bucket/models/llama/", tmp_path / "x.seg")
    assert code != 0
    assert "s3:/bucket" not in err
    assert "modelload sidecar --source" in err
    assert "Traceback" not in err


def test_staging_with_a_wrong_key_says_the_key_is_wrong(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = shm_dir / "m.tensors"
    tz_write(
        source,
        {"a": sample("float32", (100,)), "b": sample("int32", (50,))},
        encryption=tensorizer.EncryptionParams.random(),
    )
    key = shm_dir / "wrong.key"
    key.write_bytes(os.urandom(32))
    segment = shm_dir / "model.seg"

    code, _, err = cli(capsys, source, segment, "--key-file", key, "--threads", "1")
    assert code == 1 and "key or password is wrong" in err
    assert_load_failed(segment, match="key or password is wrong")


def test_a_corrupt_encrypted_tensor_is_told_as_corrupt_not_as_a_wrong_key(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first tensor's MAC fails: held until the second opens with the same key (the sidecar's rule)."""
    source = shm_dir / "m.tensors"
    params = tensorizer.EncryptionParams.random()
    tz_write(source, {"a": sample("float32", (100,)), "b": sample("int32", (50,))}, encryption=params)
    data = bytearray(source.read_bytes())
    entry = read_index(lambda o, n: bytes(data[o : o + n]), size=len(data)).tensors[0]
    data[entry.data_offset] ^= 0x10
    source.write_bytes(data)
    key = shm_dir / "m.key"
    key.write_bytes(params.key)
    segment = shm_dir / "model.seg"

    code, _, err = cli(capsys, source, segment, "--key-file", key, "--threads", "1")
    assert code == 1
    assert "tensor 'a'" in err and "corrupt (the key is right)" in err
    assert_load_failed(segment, match="corrupt")
