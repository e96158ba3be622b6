"""``modelload serialize``: conversions checked against the real safetensors, tensorizer and torch."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from modelload.loader import dtypes
from modelload.loader.cli.main import main
from tests.formats.tensorizer_support import index_of, raw_bytes, sample, torch, tz_write

safetensors_torch = pytest.importorskip("safetensors.torch")
tensorizer = pytest.importorskip("tensorizer")
from safetensors import safe_open  # noqa: E402
from tensorizer import DecryptionParams, TensorDeserializer, TensorSerializer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SAFETENSORS_DTYPES = tuple(n for n in dtypes.names() if dtypes.by_name(n).safetensors is not None)
PASSWORD = "correct horse battery staple"


def cli(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["serialize", "--no-progress", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    return code, out, err


def every_dtype() -> dict[str, Any]:
    return {f"t.{name}": sample(name, (3, 5), seed=i) for i, name in enumerate(SAFETENSORS_DTYPES)}


def tz_read(path: Path, **decryption: Any) -> dict[str, Any]:
    """What the real tensorizer loads from ``path``, hashes verified."""
    params = None
    if "key" in decryption:
        params = DecryptionParams.from_key(decryption["key"])
    elif "password" in decryption:
        params = DecryptionParams.from_string(decryption["password"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        deserializer = TensorDeserializer(str(path), verify_hash=True, encryption=params, lazy_load=False)
    try:
        return dict(deserializer.items())
    finally:
        deserializer.close()


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want) or sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert tuple(got[name].shape) == tuple(tensor.shape), name
        assert raw_bytes(got[name]) == raw_bytes(tensor), name


# --- conversions -------------------------------------------------------------------------------------------


def test_every_dtype_round_trips_safetensors_to_tensorizer_to_safetensors_byte_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = every_dtype()
    original = tmp_path / "original.safetensors"
    safetensors_torch.save_file(tensors, str(original))

    code, out, _ = cli(capsys, original, tmp_path / "model.tensors")
    assert code == 0
    assert out.startswith(f"wrote {tmp_path / 'model.tensors'} (tensorizer): {len(tensors)} tensors")
    assert_same(tz_read(tmp_path / "model.tensors"), tensors)

    code, _, _ = cli(capsys, tmp_path / "model.tensors", tmp_path / "back.safetensors")
    assert code == 0
    assert (tmp_path / "back.safetensors").read_bytes() == original.read_bytes()


def test_safetensors_metadata_carries_over_to_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"w": sample("float32", (4,)), "b": sample("bfloat16", (2,))}
    original = tmp_path / "a.safetensors"
    safetensors_torch.save_file(tensors, str(original), metadata={"format": "pt"})
    code, _, _ = cli(capsys, original, tmp_path / "copy.safetensors")
    assert code == 0
    assert (tmp_path / "copy.safetensors").read_bytes() == original.read_bytes()

    code, _, err = cli(capsys, original, tmp_path / "a.tensors")
    assert code == 0
    assert "metadata" in err and "not carried over" in err


def test_torch_checkpoint_becomes_a_tensorizer_file_the_real_tensorizer_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    layers = [{"w": sample("float32", (4, 4))}, {"w": sample("bfloat16", (2, 3), seed=1)}]
    state = {"encoder": {"layers": layers}, "head.bias": sample("float16", (3,), seed=2)}
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"state_dict": state, "epoch": 7, "optimizer": {"lr": 0.1}}, checkpoint)

    code, out, err = cli(capsys, checkpoint, tmp_path / "model.tensors")
    assert code == 0, err
    assert "under the checkpoint's key 'state_dict'" in err
    assert "metadata" not in err
    assert "3 tensors" in out
    flat = {
        "encoder.layers.0.w": layers[0]["w"],
        "encoder.layers.1.w": layers[1]["w"],
        "head.bias": state["head.bias"],
    }
    assert_same(tz_read(tmp_path / "model.tensors"), flat)


def test_a_torch_checkpoint_named_like_a_safetensors_file_is_read_by_its_content_not_its_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # torch.load hands any path ending in .safetensors to the safetensors package: before the fix a
    # checkpoint saved under that name ended serialize with a traceback ("header too large")
    state = {"w": sample("float32", (4, 4))}
    checkpoint = tmp_path / "model.safetensors"
    torch.save(state, checkpoint)

    code, out, err = cli(capsys, checkpoint, tmp_path / "model.tensors")
    assert code == 0, err
    assert "1 tensors" in out
    assert_same(tz_read(tmp_path / "model.tensors"), state)


def test_torch_checkpoint_to_safetensors_keeps_tied_weights_as_copies_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    embed = sample("float32", (8, 4))
    state = {"embed.weight": embed, "lm_head.weight": embed, "step": torch.tensor(3), "config": {"hidden": 4}}
    checkpoint = tmp_path / "model.bin"
    torch.save(state, checkpoint)

    code, _, err = cli(capsys, checkpoint, tmp_path / "model.safetensors")
    assert code == 0, err
    assert "share storage" in err and "'embed.weight'" in err
    assert "skipped 1 entries that are not tensors: config.hidden" in err
    loaded = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert_same(loaded, {"embed.weight": embed, "lm_head.weight": embed, "step": torch.tensor(3)})
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as file:
        assert file.metadata() == {"format": "pt"}


def test_state_dict_key_names_a_nested_state_dict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = {"a": sample("int32", (2,)), "b": sample("int64", (2,), seed=1)}
    torch.save({"ema": {"inner": weights}, "raw": {"c": sample("float32", (1,))}}, tmp_path / "c.pt")
    code, _, err = cli(capsys, tmp_path / "c.pt", tmp_path / "c.tensors", "--state-dict-key", "ema.inner")
    assert code == 0, err
    assert_same(tz_read(tmp_path / "c.tensors"), weights)

    code, _, err = cli(capsys, tmp_path / "c.pt", tmp_path / "d.tensors", "--state-dict-key", "ema.nope")
    assert code == 2
    assert "no key 'nope'" in err and "'inner'" in err


def test_a_checkpoint_holding_python_objects_is_refused_without_running_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(2), "when": Path("/tmp")}, tmp_path / "objects.pt")
    code, _, err = cli(capsys, tmp_path / "objects.pt", tmp_path / "out.tensors")
    assert code == 1
    assert "weights_only=True" in err and "torch.save(model.state_dict()" in err
    assert not (tmp_path / "out.tensors").exists()


def test_reading_a_torch_checkpoint_without_torch_says_what_to_install(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from modelload.loader.cli.main import main\n"
        f"sys.exit(main(['serialize', {str(tmp_path / 'w.pt')!r}, {str(tmp_path / 'w.tensors')!r}]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "needs torch" in done.stderr and "modelload[torch]" in done.stderr


def test_tensorizer_to_tensorizer_keeps_structured_names_kinds_and_module_indices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    serializer = TensorSerializer(str(tmp_path / "module.tensors"))
    serializer.write_module(net)
    serializer.close()
    code, _, err = cli(
        capsys, tmp_path / "module.tensors", tmp_path / "copy.tensors", "--generate-key", tmp_path / "k"
    )
    assert code == 0, err
    want = [(t.name, t.kind) for t in index_of(tmp_path / "module.tensors").tensors]
    assert [(t.name, t.kind) for t in index_of(tmp_path / "copy.tensors").tensors] == want
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = DecryptionParams.from_key((tmp_path / "k").read_bytes())
        deserializer = TensorDeserializer(str(tmp_path / "copy.tensors"), encryption=params, verify_hash=True)
        deserializer.load_into_module(fresh)
        deserializer.close()
    for (name, got), want_tensor in zip(fresh.state_dict().items(), net.state_dict().values(), strict=True):
        assert raw_bytes(got) == raw_bytes(want_tensor), name

    nested = {"model": {"layers": [sample("float32", (2,)), sample("int8", (3,), seed=1)]}}
    tz_write(tmp_path / "nested.tensors", nested)
    code, _, _ = cli(capsys, tmp_path / "nested.tensors", tmp_path / "nested2.tensors")
    assert code == 0
    paths = [t.path for t in index_of(tmp_path / "nested2.tensors").tensors]
    assert paths == [("model", "layers", 0), ("model", "layers", 1)]
    loaded = tz_read(tmp_path / "nested2.tensors")
    assert raw_bytes(loaded["model"]["layers"][1]) == raw_bytes(nested["model"]["layers"][1])


# --- encryption --------------------------------------------------------------------------------------------


def test_generated_key_is_private_and_opens_the_file_in_the_real_tensorizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"w": sample("float32", (600_000,)), "b": sample("bfloat16", (5,))}  # w spans two chunks
    safetensors_torch.save_file(tensors, str(tmp_path / "m.safetensors"))
    key_file = tmp_path / "model.key"

    code, out, _ = cli(capsys, tmp_path / "m.safetensors", tmp_path / "m.tensors", "--generate-key", key_file)
    assert code == 0
    assert "(tensorizer, encrypted)" in out
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = key_file.read_bytes()
    assert len(key) == 32
    assert index_of(tmp_path / "m.tensors").encrypted
    assert_same(tz_read(tmp_path / "m.tensors", key=key), tensors)

    code, _, err = cli(capsys, tmp_path / "m.tensors", tmp_path / "back.safetensors", "--key-file", key_file)
    assert code == 0
    assert "will hold the decrypted tensors" in err
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()


def test_password_encryption_reads_back_with_a_password_file_or_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {"w": sample("float16", (64,)), "n": sample("int8", (7,), seed=3)}
    safetensors_torch.save_file(tensors, str(tmp_path / "m.safetensors"))
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")

    code, _, err = cli(
        capsys,
        tmp_path / "m.safetensors",
        tmp_path / "m.tensors",
        "--encrypt-password-file",
        password_file,
        "--argon2",
        "min",
    )
    assert code == 0, err
    assert_same(tz_read(tmp_path / "m.tensors", password=PASSWORD), tensors)

    code, _, err = cli(
        capsys, tmp_path / "m.tensors", tmp_path / "a.safetensors", "--password-file", password_file
    )
    assert code == 0, err
    monkeypatch.setenv("MODELLOAD_PASSWORD", PASSWORD)
    code, _, err = cli(
        capsys, tmp_path / "m.tensors", tmp_path / "b.safetensors", "--password-env", "MODELLOAD_PASSWORD"
    )
    assert code == 0, err
    for out in ("a", "b"):
        assert (tmp_path / f"{out}.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()


def test_a_wrong_key_or_password_fails_clearly_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tz_write(
        tmp_path / "enc.tensors",
        {"w": sample("float32", (16,))},
        encryption=tensorizer.EncryptionParams.from_string(PASSWORD, *MIN_ARGON2),
    )
    (tmp_path / "wrong.key").write_bytes(bytes(32))
    (tmp_path / "wrong.password").write_text("not it")
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    code, _, err = cli(
        capsys, tmp_path / "enc.tensors", out_dir / "a.safetensors", "--key-file", tmp_path / "wrong.key"
    )
    assert code == 1
    assert err.startswith("modelload serialize: ") and "key or password is wrong" in err

    code, _, err = cli(
        capsys,
        tmp_path / "enc.tensors",
        out_dir / "a.safetensors",
        "--password-file",
        tmp_path / "wrong.password",
    )
    assert code == 1
    assert "key or password is wrong" in err and "not it" not in err

    code, _, err = cli(capsys, tmp_path / "enc.tensors", out_dir / "a.safetensors")
    assert code == 1
    assert "is encrypted" in err and "--key-file" in err
    assert list(out_dir.iterdir()) == []


MIN_ARGON2 = (tensorizer.EncryptionParams.OpsLimit.MIN, tensorizer.EncryptionParams.MemLimit.MIN)


def test_encrypting_a_safetensors_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safetensors_torch.save_file({"w": sample("float32", (2,))}, str(tmp_path / "m.safetensors"))
    key_file = tmp_path / "k"
    code, _, err = cli(
        capsys, tmp_path / "m.safetensors", tmp_path / "o.safetensors", "--generate-key", key_file
    )
    assert code == 2
    assert "safetensors files cannot be encrypted" in err
    assert not key_file.exists() and not (tmp_path / "o.safetensors").exists()


def test_generate_key_never_overwrites_and_is_removed_when_serialize_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_torch.save_file({"w": sample("float32", (2,))}, str(tmp_path / "m.safetensors"))
    existing = tmp_path / "existing.key"
    existing.write_bytes(b"the only copy of a key, 32 bytes")
    code, _, err = cli(capsys, tmp_path / "m.safetensors", tmp_path / "o.tensors", "--generate-key", existing)
    assert code == 2
    assert "never overwrites" in err
    assert existing.read_bytes() == b"the only copy of a key, 32 bytes"

    (tmp_path / "o.tensors").write_bytes(b"in the way")
    fresh = tmp_path / "fresh.key"
    code, _, err = cli(capsys, tmp_path / "m.safetensors", tmp_path / "o.tensors", "--generate-key", fresh)
    assert code == 2 and "exists" in err
    assert not fresh.exists(), "a key for a file that was never written is not left behind"


def test_help_says_passwords_never_come_from_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serialize", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "never from arguments" in text and "--encrypt-password-file" in text and "--password-env" in text


# --- safety of DST -----------------------------------------------------------------------------------------


def test_an_existing_dst_is_refused_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = {"w": sample("int16", (4,))}
    safetensors_torch.save_file(tensors, str(tmp_path / "m.safetensors"))
    dst = tmp_path / "m.tensors"
    dst.write_bytes(b"precious")

    code, _, err = cli(capsys, tmp_path / "m.safetensors", dst)
    assert code == 2
    assert "exists; pass --force" in err
    assert dst.read_bytes() == b"precious"

    code, _, _ = cli(capsys, tmp_path / "m.safetensors", dst, "--force")
    assert code == 0
    assert_same(tz_read(dst), tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.tensors"]


def test_a_failure_midway_leaves_no_dst_and_no_temporary_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = {"a": sample("float32", (1000,)), "b": sample("int64", (100,)), "c": sample("float16", (50,))}
    source = tmp_path / "model.tensors"
    tz_write(source, tensors)
    data = bytearray(source.read_bytes())
    last = index_of(source).tensors[-1]
    data[last.data_offset + 3] ^= 0x40  # the last tensor fails its hash after the others are written
    source.write_bytes(data)
    out_dir = tmp_path / "out"
    out_dir.mkdir()

    for dst in ("m.safetensors", "m.tensors"):
        code, _, err = cli(capsys, source, out_dir / dst)
        assert code == 1
        assert f"tensor {last.name!r}" in err and "corrupt" in err
        assert list(out_dir.iterdir()) == []


def test_dst_format_comes_from_the_extension_or_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    safetensors_torch.save_file({"w": sample("uint8", (3,))}, str(tmp_path / "m.safetensors"))
    code, _, err = cli(capsys, tmp_path / "m.safetensors", tmp_path / "model.bin")
    assert code == 2 and "--to" in err
    code, _, _ = cli(capsys, tmp_path / "m.safetensors", tmp_path / "model.bin", "--to", "tensorizer")
    assert code == 0
    assert index_of(tmp_path / "model.bin").format == "tensorizer"


def test_a_file_that_is_no_model_is_named_as_such(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "notes.txt").write_text("<html>not a model</html>")
    code, _, err = cli(capsys, tmp_path / "notes.txt", tmp_path / "m.tensors")
    assert code == 1
    assert "HTML" in err and str(tmp_path / "notes.txt") in err
    code, _, err = cli(capsys, tmp_path / "missing.safetensors", tmp_path / "m.tensors")
    assert code == 1 and "does not exist" in err


def test_the_console_script_converts_in_a_fresh_process(tmp_path: Path) -> None:
    tensors = {"w": sample("bfloat16", (6,)), "x": sample("int32", (2, 2), seed=4)}
    safetensors_torch.save_file(tensors, str(tmp_path / "m.safetensors"))
    done = subprocess.run(
        [sys.executable, "-m", "modelload.loader.cli.main", "serialize", "m.safetensors", "m.tensors"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote m.tensors (tensorizer): 2 tensors")
    assert "serialize [" in done.stderr  # the progress bar
    assert_same(tz_read(tmp_path / "m.tensors"), tensors)


def test_a_model_directory_serializes_into_one_file_of_either_format(tmp_path: Path) -> None:
    from modelload.loader.cli.main import main as cli_main
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=63, layers=3)
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=3))
    for name in ("merged.tensors", "merged.safetensors"):
        assert cli_main(["serialize", str(source), str(tmp_path / name), "--no-progress"]) == 0
        stage = tmp_path / f"{name}.seg"
        assert cli_main(["stage", str(tmp_path / name), str(stage), "--no-progress"]) == 0
        models.assert_segment_matches(stage, weights)


def test_a_file_serializes_into_a_sharded_directory_that_stages_back(tmp_path: Path) -> None:
    import json as json_module

    from modelload.loader.cli.main import main as cli_main
    from tests.sidecar import models

    weights = models.state_dict(seed=64, layers=4)
    single = tmp_path / "model.tensors"
    single.write_bytes(models.tensorizer_bytes(weights))
    out = tmp_path / "hf"
    assert cli_main(["serialize", str(single), str(out), "--shard-size", "300KiB", "--no-progress"]) == 0
    shards = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    assert len(shards) > 2 and all(
        (out / s).stat().st_size <= 300 * 1024 + 4096 or s == shards[0] for s in shards
    ), "each shard holds at most the size, besides one holding a single larger tensor"
    index = json_module.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(weights)
    assert sorted(set(index["weight_map"].values())) == shards
    assert cli_main(["stage", str(out), str(tmp_path / "back.seg"), "--no-progress"]) == 0
    models.assert_segment_matches(tmp_path / "back.seg", weights)
    assert cli_main(["serialize", str(single), str(out / "x"), "--shard-size", "0"]) != 0
