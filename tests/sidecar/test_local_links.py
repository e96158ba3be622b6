"""Symbolic links in a local model directory: followed when they stay inside it (or inside the Hugging Face
cache's blobs, as huggingface_hub lays out a snapshot), refused when they leave it, by the sidecar and by
``modelload stage`` alike; nothing the link points to reaches the app's model directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelload.loader.cli.main import main
from modelload.loader.errors import SourceAccessDeniedError
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import SourceSettings
from tests.sidecar import models
from tests.support import hfdir
from tests.support.failures import assert_load_failed

SECRET = b"root:$6$salt$not-for-the-app:19000:0:99999:7:::\n"


def model_directory(tmp_path: Path, tensors: dict) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    hfdir.write(directory, hfdir.files(tensors, shards=2, small={"config.json": b"{}"}))
    return directory


def load(source: Path, segment: Path) -> None:
    Engine(
        LoadSettings(source=str(source), segment=segment), sources=SourceSettings(), observer=LoadTracker()
    ).run()


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model-00001-of-00002.safetensors"])
def test_a_link_leaving_a_local_model_directory_refuses_the_load(
    name: str, tmp_path: Path, shm_dir: Path
) -> None:
    directory = model_directory(tmp_path, models.state_dict(seed=85, layers=1))
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    (directory / name).unlink(missing_ok=True)
    (directory / name).symlink_to(secret)
    with pytest.raises(SourceAccessDeniedError, match=f"{name} is a symbolic link to {secret}, outside"):
        load(directory, shm_dir / "model.seg")
    assert not (shm_dir / "model").exists(), "nothing was copied into the app's model directory"
    assert_load_failed(shm_dir / "model.seg", match="outside the model directory")


def test_stage_refuses_the_same_link(
    tmp_path: Path, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = model_directory(tmp_path, models.state_dict(seed=86, layers=1))
    secret = tmp_path / "shadow"
    secret.write_bytes(SECRET)
    (directory / "config.json").unlink()
    (directory / "config.json").symlink_to(secret)
    code = main(["stage", "--no-progress", str(directory), str(shm_dir / "model.seg")])
    err = capsys.readouterr().err
    assert code == 1 and "config.json is a symbolic link" in err and "outside the model directory" in err
    assert not (shm_dir / "model").exists()


def test_links_inside_the_directory_and_into_the_hub_cache_blobs_are_followed(
    tmp_path: Path, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=87, layers=1)
    content = hfdir.files(tensors, shards=2, small={"config.json": b'{"model_type": "llama"}'})
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, (name, data) in enumerate(content.items()):
        blob = repo / "blobs" / f"blob{i}"
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))  # as huggingface_hub writes them
    (snapshot / "generation_config.json").symlink_to("config.json")  # a link inside the directory
    load(snapshot, shm_dir / "model.seg")
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert (shm_dir / "model" / "generation_config.json").read_bytes() == b'{"model_type": "llama"}'
