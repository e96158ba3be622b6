"""``modelload push`` as a new user runs it against a real registry (Debian's docker-registry): a tag that
already names another model, a directory the sidecar could not load, a Docker config that is not there, a
private registry without credentials. Each ends in one line saying what is wrong and what to do, exit status
2 for a bad argument, and nothing half-pushed under the tag."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.cli.main import main
from modelload.loader.formats.safetensors import save_file
from tests.support.fixtures import REGISTRY_USERS
from tests.support.registry import RegistryServer


def model_dir(root: Path, *, rows: int = 4) -> Path:
    folder = root / f"model-{rows}"
    folder.mkdir(parents=True, exist_ok=True)
    save_file({"w": np.full((rows, 4), rows, dtype=np.float32)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "toy"}')
    return folder


def push(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    status = main(["push", *(str(a) for a in argv)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def tagged_digest(registry: RegistryServer, repository: str, tag: str) -> str:
    request = urllib.request.Request(
        f"http://{registry.host}/v2/{repository}/manifests/{tag}",
        method="HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.headers["Docker-Content-Digest"])


def test_a_tag_that_names_another_model_is_not_moved_without_force(
    registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = registry.uri("traps/tagged", "v1")
    status, first, _ = push(capsys, model_dir(tmp_path, rows=4), uri, "--plain-http")
    assert status == 0
    pinned = tagged_digest(registry, "traps/tagged", "v1")
    assert first.strip().endswith(pinned)
    status, out, err = push(capsys, model_dir(tmp_path, rows=8), uri, "--plain-http")
    assert status == 2, err
    assert f"{uri} already names another model ({pinned[:19]}" in err and "--force" in err
    assert "Traceback" not in err and out == ""
    assert tagged_digest(registry, "traps/tagged", "v1") == pinned, "the tag moved"
    status, out, _ = push(capsys, model_dir(tmp_path, rows=8), uri, "--plain-http", "--force")
    assert status == 0 and tagged_digest(registry, "traps/tagged", "v1") != pinned


def test_pushing_the_same_directory_to_its_tag_again_changes_nothing_and_succeeds(
    registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = registry.uri("traps/again", "v1")
    folder = model_dir(tmp_path)
    assert push(capsys, folder, uri, "--plain-http")[0] == 0
    pinned = tagged_digest(registry, "traps/again", "v1")
    (folder / "config.json").touch()  # a copy or a checkout changes times, not the model
    status, out, err = push(capsys, folder, uri, "--plain-http")
    assert status == 0, err
    assert out.strip().endswith(pinned) and "unchanged" in err
    assert tagged_digest(registry, "traps/again", "v1") == pinned


def test_a_directory_without_safetensors_or_tensorizer_weights_is_refused_naming_what_it_holds(
    registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a pickled state_dict")
    (folder / "config.json").write_text("{}")
    status, _, err = push(capsys, folder, registry.uri("traps/pickled", "v1"), "--plain-http")
    assert status == 2
    assert "pytorch_model.bin" in err and "safetensors" in err and "sidecar" in err
    with pytest.raises(urllib.error.HTTPError):  # nothing was pushed under the tag
        tagged_digest(registry, "traps/pickled", "v1")


def test_a_docker_config_that_is_not_there_is_named_instead_of_pushing_anonymously(
    registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere" / "config.json"
    uri = registry.uri("traps/config", "v1")
    status, _, err = push(capsys, model_dir(tmp_path), uri, "--plain-http", "--docker-config", missing)
    assert status == 2
    assert f"{missing}" in err and "does not exist" in err


def test_a_private_registry_without_credentials_says_to_log_in_for_a_push(
    token_registry: RegistryServer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty-docker"))  # no ~/.docker/config.json
    uri = token_registry.uri("traps/private", "v1")
    status, _, err = push(capsys, model_dir(tmp_path), uri, "--plain-http")
    assert status == 1
    assert "refused the push" in err and "docker login" in err and "--docker-config" in err
    assert "ModelLoad" not in err and "pull" not in err


def test_credentials_the_registry_refuses_are_named_by_where_they_came_from(
    token_registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = next(iter(REGISTRY_USERS))
    config = tmp_path / "docker.json"
    import base64

    auth = base64.b64encode(f"{user}:wrong-password".encode()).decode()
    config.write_text(json.dumps({"auths": {token_registry.host: {"auth": auth}}}))
    uri = token_registry.uri("traps/refused", "v1")
    status, _, err = push(capsys, model_dir(tmp_path), uri, "--plain-http", "--docker-config", config)
    assert status == 1
    assert "refused the credentials" in err and str(config) in err
    assert "wrong-password" not in err and "Secret" not in err
