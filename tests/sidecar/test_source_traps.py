"""Traps a new user walks into with the newer sources (gs://, az://, hf://, oci://): a URI of a known scheme
in the wrong shape, a Hub web page given as the source, a registry reached in the wrong protocol. Each ends
with one line that says what is wrong and what to write instead, exit status 2 for a bad setting, instead of
a load that fails and is served as failed (or retried for ten minutes)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.cli.main import main
from modelload.loader.errors import ConfigError
from modelload.loader.formats.safetensors import save_file
from modelload.operator.schema import parse_spec
from modelload.sidecar.process import Sidecar
from modelload.sidecar.progress import LoadStatus
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import RegistrySettings, SourceSettings
from modelload.sidecar.sources.oci import push_directory
from tests.sidecar import models
from tests.support.cloud_emulators import Azurite, FakeGcs
from tests.support.fixtures import azurite, cloud_env, fake_gcs
from tests.support.nginx import NginxServer
from tests.support.registry import RegistryServer
from tests.support.waiting import wait_for

__all__ = ["azurite", "cloud_env", "fake_gcs"]  # fixtures

# (source, what the message must say): URIs whose scheme is known but whose shape cannot name a model
MALFORMED = [
    ("gs://b", "a GCS source is gs://BUCKET/OBJECT"),
    ("gs://", "a GCS source is gs://BUCKET/OBJECT"),
    ("az://acct01", "an Azure Blob source is az://ACCOUNT/CONTAINER/PATH"),
    ("az://Account/models/m.bin", "the account: 3-24 lower-case letters and digits"),
    ("hf://org", "an hf:// source is hf://ORG/NAME[@REVISION][/PATH]"),
    ("hf://org/name@", "the revision after '@' is empty"),
    ("oci://registry/repo", "with the registry's host first"),
    ("oci://127.0.0.1:5000/Models/m:v1", "a repository is lower-case letters and digits"),
    ("s3://", "an S3 source is s3://BUCKET/KEY"),
    ("gcs://models/m.bin", "did you mean gs://models/m.bin?"),
    ("wasbs://models@acct01.blob.core.windows.net/m.bin", "az://acct01/models/m.bin"),
]

# Hugging Face web pages: what the browser's address bar shows is not a file, and not a listable directory
HUB_PAGES = [
    ("https://huggingface.co/org/name", "hf://org/name"),
    ("https://huggingface.co/org/name/", "hf://org/name"),
    ("https://huggingface.co/org/name/tree/main", "hf://org/name@main"),
    ("https://huggingface.co/org/name/tree/v1.0/onnx", "hf://org/name@v1.0/onnx/"),
    ("https://huggingface.co/org/name/blob/main/model.safetensors", "hf://org/name@main/model.safetensors"),
    ("https://hf.co/org/name", "hf://org/name"),
]


def sidecar(capsys: pytest.CaptureFixture[str], source: str, segment: Path) -> tuple[int, str]:
    status = main(["sidecar", "--source", source, "--segment", str(segment), "--port", "0"])
    return status, capsys.readouterr().err


@pytest.mark.timeout(20)  # before the fix the sidecar served the failed load until stopped
@pytest.mark.parametrize(("source", "says"), MALFORMED, ids=[s for s, _ in MALFORMED])
def test_a_malformed_uri_of_a_known_scheme_exits_at_start_with_the_shape_to_write(
    source: str, says: str, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = sidecar(capsys, source, shm_dir / "m.seg")  # returns at all: it did not serve a failed load
    assert status == 2
    assert says in err, err
    assert "Traceback" not in err
    assert not (shm_dir / "m.seg").exists() and not (shm_dir / "m.seg.failed").exists()


@pytest.mark.timeout(20)  # before the fix: retried against huggingface.co (or a 404 on its HTML page)
@pytest.mark.parametrize(("page", "means"), HUB_PAGES, ids=[p for p, _ in HUB_PAGES])
def test_a_hugging_face_web_page_as_the_source_names_the_hf_uri_it_means(
    page: str, means: str, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = sidecar(capsys, page, shm_dir / "m.seg")
    assert status == 2
    assert f"--source {means} " in err or err.rstrip().endswith(f"--source {means}"), err
    assert "web page" in err


@pytest.mark.parametrize(
    "url",
    [
        "https://huggingface.co/org/name/resolve/main/model.safetensors",  # a file: loads over HTTPS
        "https://huggingface.co/api/models/org/name",
        "https://models.example.com/org/name",
    ],
)
def test_a_file_url_on_the_hub_and_other_servers_pass_the_check(url: str) -> None:
    from modelload.sidecar.sources import check_source_uri

    check_source_uri(url)


@pytest.mark.parametrize(("source", "says"), [*MALFORMED[:8], *[(p, m) for p, m in HUB_PAGES[:3]]])
def test_a_modelload_with_such_a_source_gets_the_same_message(source: str, says: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_spec({"source": source})
    assert str(caught.value).startswith("spec.source: ")
    assert says in str(caught.value)


# --- a registry or server reached in the wrong protocol -----------------------------------------------------


def ended_load(argv: list[str], *, ends: tuple[str, ...], within: float) -> LoadStatus:
    """Run the sidecar until its load reaches a phase in ``ends`` (the sidecar keeps serving an ended load:
    stop it then)."""
    sidecar = Sidecar(parse_settings([*argv, "--host", "127.0.0.1", "--port", "0", "--notify", "none"], {}))
    sidecar.start()
    try:
        wait_for(
            lambda: sidecar.tracker.snapshot().phase in ends,
            timeout=within,
            what=f"the load {' or '.join(ends)}: {sidecar.tracker.snapshot()}",
        )
    finally:
        sidecar.stop()
    return sidecar.tracker.snapshot()


def failed_load(argv: list[str], *, within: float = 20.0) -> LoadStatus:
    """Run the sidecar until its load fails."""
    return ended_load(argv, ends=("failed",), within=within)


@pytest.mark.timeout(60)  # before the fix: retried, every other try on a dead socket (EBADF)
def test_a_plain_http_registry_reached_over_https_fails_at_once_naming_the_flag(
    registry: RegistryServer, shm_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": np.ones((4, 4), dtype=np.float32)}, folder / "model.safetensors")
    plain = SourceSettings(registry=RegistrySettings(plain_http=(registry.host,)))
    push_directory(folder, registry.uri("traps/plain", "v1"), plain)
    source = registry.uri("traps/plain", "v1")
    snapshot = failed_load(["--source", source, "--segment", str(shm_dir / "m.seg")])
    assert snapshot.retries == 0, "a protocol mismatch is not worth retrying"
    assert snapshot.error is not None and "answered in plain HTTP" in snapshot.error
    assert f"--registry-plain-http {registry.host}" in snapshot.error
    assert "Bad file descriptor" not in snapshot.error and "WRONG_VERSION_NUMBER" not in snapshot.error


@pytest.mark.timeout(60)
def test_an_https_url_to_a_plain_http_server_fails_at_once_saying_to_use_http(
    nginx: NginxServer, shm_dir: Path
) -> None:
    url = nginx.put("traps-plain.bin", b"\0" * 4096)
    https = url.replace("http://", "https://", 1)
    snapshot = failed_load(["--source", https, "--segment", str(shm_dir / "m.seg")])
    assert snapshot.retries == 0
    assert snapshot.error is not None and "answered in plain HTTP" in snapshot.error
    assert url in snapshot.error  # the http:// URL to use instead


def test_push_to_a_plain_http_registry_without_the_flag_says_to_add_it(
    registry: RegistryServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": np.ones((4, 4), dtype=np.float32)}, folder / "model.safetensors")
    status = main(["push", str(folder), registry.uri("traps/push", "v1")])
    err = capsys.readouterr().err
    assert status == 2
    assert "answered in plain HTTP" in err and "--plain-http" in err
    assert "SSLError" not in err and "Traceback" not in err


# --- no credentials, outside Kubernetes -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_gcs_load_without_credentials_says_how_to_give_them_on_the_command_line_too(
    fake_gcs: FakeGcs, cloud_env: None, shm_dir: Path
) -> None:
    source = fake_gcs.put("traps", "m.safetensors", b"\0" * 64)
    argv = ["--source", source, "--gcs-endpoint", fake_gcs.endpoint, "--segment", str(shm_dir / "m.seg")]
    snapshot = failed_load(argv)
    assert snapshot.errors == {"access_denied": 1}
    assert snapshot.error is not None and "no Google credentials found" in snapshot.error
    assert "GOOGLE_APPLICATION_CREDENTIALS" in snapshot.error  # outside a pod
    assert "gcloud auth application-default login" in snapshot.error
    assert "credentialsSecretRef" in snapshot.error  # in a pod


@pytest.mark.timeout(60)
def test_an_azure_load_without_credentials_says_how_to_give_them_in_one_line(
    azurite: Azurite, cloud_env: None, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = azurite.put("traps", "m.safetensors", b"\0" * 64)
    argv = ["--source", source, "--azure-endpoint", azurite.endpoint, "--segment", str(shm_dir / "m.seg")]
    snapshot = failed_load(argv)
    assert snapshot.errors == {"access_denied": 1}
    assert snapshot.error is not None and "no Entra ID token could be obtained" in snapshot.error
    assert "AZURE_STORAGE_CONNECTION_STRING" in snapshot.error and "az login" in snapshot.error
    chatter = [r for r in caplog.records if r.name.startswith("azure") and r.levelno >= logging.WARNING]
    assert chatter == [], "azure-identity's own multi-line warnings before the sidecar's one line"


@pytest.mark.timeout(60)
def test_the_emulators_standard_connection_string_reads_azurite(
    azurite: Azurite, cloud_env: None, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # UseDevelopmentStorage=true is what Microsoft documents for every storage emulator; before the fix it
    # failed as "has neither AccountKey nor SharedAccessSignature"
    data = models.safetensors_bytes(models.state_dict(seed=5, layers=1))
    source = azurite.put("traps", "dev.safetensors", data)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", "UseDevelopmentStorage=true")
    argv = ["--source", source, "--azure-endpoint", azurite.endpoint, "--segment", str(shm_dir / "m.seg")]
    status = ended_load(argv, ends=("complete", "failed"), within=30)
    assert status.phase == "complete", status.error
