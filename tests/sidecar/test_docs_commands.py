"""The commands docs/sidecar.md shows for the newer sources run as written, against the real local servers
the tests use: Debian's docker-registry, fake-gcs-server, Azurite and the Hub stand-in.

Each block is marked ``<!-- commands: NAME -->`` in the doc and read from there, so a changed doc is what is
run. What a one-machine run cannot keep is swapped, and only that: a fixed port (5000, 4443, 10000) for the
server's free one, a placeholder host (``registry.internal:5000``, ``hf-mirror.internal``) for the local
server, the segment's and the secrets' paths for a test folder; the sidecar gets ``--port 0`` and is
stopped once its load completed. Commands that need a real cloud account or the real Hub are checked as far
as a machine without them can: their settings parse and their source passes the sidecar's start-up check.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.formats.safetensors import save_file
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import check_source_uri
from tests.support.cloud_emulators import Azurite, FakeGcs
from tests.support.fixtures import azurite, cloud_env, fake_gcs, hub, registry
from tests.support.hub import HubServer
from tests.support.ports import free_port, wait_for_port
from tests.support.processes import stop_process
from tests.support.registry import RegistryServer, find_registry

__all__ = ["azurite", "cloud_env", "fake_gcs", "hub", "registry"]  # fixtures

DOC = Path(__file__).resolve().parents[2] / "docs" / "sidecar.md"
MODELLOAD = [sys.executable, "-m", "modelload.loader.cli.main"]


def commands(name: str) -> list[str]:
    """The lines of the ``sh`` block marked ``<!-- commands: NAME ... -->`` in the doc."""
    text = DOC.read_text()
    match = re.search(rf"<!-- commands: {re.escape(name)}\b[^>]*-->\n```sh\n(.*?)```", text, re.S)
    assert match is not None, f"docs/sidecar.md has no command block marked {name!r}"
    return [line for line in match.group(1).splitlines() if line.strip()]


def swapped(line: str, swaps: Mapping[str, str]) -> str:
    for old, new in swaps.items():
        line = line.replace(old, new)
    return line


def argv_of(line: str) -> tuple[dict[str, str], list[str]]:
    """A shell line ``[VAR=value ...] modelload ARGS`` as its variables and the command to run."""
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "modelload", line
    return env, [*MODELLOAD, *words[1:]]


def model_folder(where: Path) -> Path:
    folder = where / "llama"
    folder.mkdir(parents=True)
    save_file({"w": np.arange(64, dtype=np.float32).reshape(8, 8)}, folder / "model.safetensors")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def run_sidecar(line: str, *, cwd: Path, env: Mapping[str, str] | None = None) -> str:
    """Run a documented ``modelload sidecar`` line until its load completes; its log."""
    variables, argv = argv_of(line)
    environ = {**os.environ, **(env or {}), **variables}
    process = subprocess.Popen(
        [*argv, "--port", "0"], cwd=cwd, env=environ, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    log: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            text = process.stderr.readline()
            if not text and process.poll() is not None:
                break
            log.append(text)
            if "load complete" in text or "load failed" in text:
                break
    finally:
        stop_process(process, timeout=10)
    output = "".join(log)
    assert "load complete" in output, output
    assert process.returncode == 0, output
    return output


def checked_offline(line: str, swaps: Mapping[str, str]) -> None:
    """A command that needs the real Hub or a real cloud: its settings parse and its source is one the
    sidecar starts on."""
    _, argv = argv_of(swapped(line, swaps))
    words = argv[len(MODELLOAD) :]
    assert words[0] == "sidecar"
    settings = parse_settings(words[1:], environ={})
    check_source_uri(settings.engine.source)


# --- OCI -------------------------------------------------------------------------------------------------


def test_the_one_machine_registry_commands_run_as_written(tmp_path: Path, shm_dir: Path) -> None:
    if find_registry() is None:
        pytest.fail("docker-registry is not installed (make venv installs it)")
    port = free_port()
    swaps = {
        "127.0.0.1:5000": f"127.0.0.1:{port}",
        "/tmp/registry": str(tmp_path / "registry"),
        "/dev/shm/llama.seg": str(shm_dir / "llama.seg"),
    }
    write_config, serve, push, load = (swapped(line, swaps) for line in commands("oci-local"))
    model_folder(tmp_path)
    subprocess.run(["bash", "-c", write_config], cwd=tmp_path, check=True)
    assert serve.endswith(" &")
    server = subprocess.Popen(shlex.split(serve[:-2]), cwd=tmp_path, stderr=subprocess.DEVNULL)
    try:
        assert wait_for_port(port, timeout=20, alive=server), "docker-registry did not start"
        _, argv = argv_of(push)
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        assert re.fullmatch(rf"oci://127\.0\.0\.1:{port}/models/llama@sha256:[0-9a-f]{{64}}\n", done.stdout)
        run_sidecar(load, cwd=tmp_path)
    finally:
        stop_process(server, timeout=5)


def test_the_registry_commands_with_your_registry_run_against_a_local_one(
    registry: RegistryServer, tmp_path: Path, shm_dir: Path
) -> None:
    block = commands("oci")
    swaps = {"registry.internal:5000": registry.host, "/dev/shm/llama.seg": str(shm_dir / "llama.seg")}
    push, load, ghcr = (swapped(line, swaps) for line in block)
    model_folder(tmp_path)
    _, argv = argv_of(push)
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    run_sidecar(load, cwd=tmp_path)
    checked_offline(ghcr, {"~/.docker/config.json": str(write_docker_config(tmp_path))})


def write_docker_config(where: Path) -> Path:
    path = where / "docker-config.json"
    path.write_text('{"auths": {}}')
    return path


# --- the Hub ---------------------------------------------------------------------------------------------


def test_the_hub_commands_run_against_the_stand_in(hub: HubServer, tmp_path: Path, shm_dir: Path) -> None:
    real, mirror = commands("hub")
    folder = model_folder(tmp_path)
    files = {path.name: path.read_bytes() for path in folder.iterdir()}
    hub.commit("org/model", files, ref="v1.0", private=True, readers={"hf_doc-token"})
    token = tmp_path / "token"
    token.write_text("hf_doc-token\n")
    swaps = {
        "https://hf-mirror.internal": hub.url,
        "/run/secrets/hf/token": str(token),
        "/dev/shm/model.seg": str(shm_dir / "model.seg"),
    }
    run_sidecar(swapped(mirror, swaps), cwd=tmp_path)
    checked_offline(real, {"/dev/shm/llama.seg": str(shm_dir / "llama.seg")})


# --- GCS and Azure Blob ----------------------------------------------------------------------------------


def test_the_emulator_commands_run_as_written(
    fake_gcs: FakeGcs, azurite: Azurite, cloud_env: None, tmp_path: Path, shm_dir: Path
) -> None:
    real_gcs, real_azure, gcs, azure = commands("cloud")
    folder = model_folder(tmp_path)
    for path in folder.iterdir():
        fake_gcs.put("models", f"llama/{path.name}", path.read_bytes())
        azurite.container("models").upload_blob(f"llama/{path.name}", path.read_bytes(), overwrite=True)
    segment = {"/dev/shm/llama.seg": str(shm_dir / "llama.seg")}
    run_sidecar(swapped(gcs, {**segment, "127.0.0.1:4443": f"127.0.0.1:{fake_gcs.port}"}), cwd=tmp_path)
    (shm_dir / "llama.seg").unlink()
    dev = f"UseDevelopmentStorage=true;BlobEndpoint={azurite.endpoint}"  # Azurite on its free port
    run_sidecar(swapped(azure, {**segment, "UseDevelopmentStorage=true": shlex.quote(dev)}), cwd=tmp_path)
    for line in (real_gcs, real_azure):
        checked_offline(line, segment)
