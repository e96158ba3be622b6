"""``--header-file``: the sidecar, with its real engine, loads from a private HTTP server behind a bearer
token (nginx on loopback), and a refused token fails the load with the URL and what to check, while the token
stays out of the error, /status, /metrics, the log and the segment."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from modelload.loader.errors import ConfigError
from modelload.loader.segment import SegmentReader, WriterState
from modelload.sidecar.process import Sidecar
from modelload.sidecar.settings import parse_settings
from tests.sidecar import models
from tests.support.fault_proxy import FaultProxy, Respond, Stall
from tests.support.nginx import TOKEN, NginxServer
from tests.support.sidecars import Sidecars
from tests.support.waiting import wait_for

PASS = Stall(after=0, seconds=0.0)
WRONG = TOKEN.replace("EXAMPLE", "REVOKED")


def header_file(directory: Path, text: str) -> Path:
    return models.write_secret(directory, "token", text.encode())


def start(shm_dir: Path, source: str, *flags: str, started: Sidecars) -> Sidecar:
    flags = ("--readers", "3", "--chunk-size", "1MiB", "--notify", "none", *flags)
    return started.start(source, shm_dir / "model.seg", *flags)


def get(sidecar: Sidecar, path: str) -> httpx.Response:
    return httpx.get(sidecar.api.url + path, timeout=5)


def ready(sidecar: Sidecar, status: int) -> None:
    """Wait until the sidecar's /readyz answers ``status`` (200 loaded, 500 failed)."""
    wait_for(lambda: get(sidecar, "/readyz").status_code == status, timeout=30, what=f"/readyz {status}")


def everything_shown(sidecar: Sidecar, caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(
        [get(sidecar, p).text for p in ("/status", "/readyz", "/metrics")]
        + [caplog.text, repr(sidecar.settings)]
    )


# --- settings ----------------------------------------------------------------------------------------------


def test_the_flag_and_its_variable_read_the_file_into_headers(tmp_path: Path) -> None:
    path = header_file(tmp_path, f"{TOKEN}\n")
    by_flag = parse_settings(["--source", "https://hub.test/m.safetensors", "--header-file", str(path)], {})
    by_env = parse_settings(
        ["--source", "https://hub.test/m.safetensors"], {"MODELLOAD_HEADER_FILE": str(path)}
    )
    for settings in (by_flag, by_env):
        headers = settings.sources.http.headers
        assert headers is not None and headers.items() == (("Authorization", f"Bearer {TOKEN}"),)
        assert TOKEN not in repr(settings)
    assert parse_settings(["--source", "https://hub.test/m.safetensors"], {}).sources.http.headers is None


def test_a_malformed_file_is_a_config_error_naming_the_flag_file_and_line(tmp_path: Path) -> None:
    path = header_file(tmp_path, f"X-Api-Key: {TOKEN}\nBearer {TOKEN}\n")
    with pytest.raises(ConfigError) as caught:
        parse_settings(["--source", "https://hub.test/m"], {"MODELLOAD_HEADER_FILE": str(path)})
    message = str(caught.value)
    assert message.startswith(
        f"the header file {path} (MODELLOAD_HEADER_FILE), line 2: expected 'Name: value'"
    )
    assert TOKEN not in message


def test_a_header_file_for_an_s3_or_file_source_is_refused(tmp_path: Path) -> None:
    path = header_file(tmp_path, TOKEN)
    for source in ("s3://models/m.safetensors", "file:///models/m.safetensors"):
        with pytest.raises(ConfigError, match="is for http\\(s\\):// sources"):
            parse_settings(["--source", source, "--header-file", str(path)], {})


def test_the_command_exits_2_with_the_message_and_no_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from modelload.loader.cli.main import main

    path = header_file(tmp_path, f"Range: {TOKEN}\n")
    status = main(["sidecar", "--source", "https://hub.test/m", "--header-file", str(path), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert "--header-file), line 1: Range is set by the loader itself" in err
    assert TOKEN not in err


# --- loads -------------------------------------------------------------------------------------------------


def test_the_right_token_loads_the_model_byte_exact(
    nginx: NginxServer, shm_dir: Path, tmp_path: Path, sidecars: Sidecars
) -> None:
    tensors = models.state_dict(seed=41, layers=4, width=512)
    nginx.put("private-sidecar/model.safetensors", models.safetensors_bytes(tensors))
    path = header_file(tmp_path, TOKEN)
    source = nginx.private_url("private-sidecar/model.safetensors")
    sidecar = start(shm_dir, source, "--header-file", str(path), started=sidecars)
    ready(sidecar, 200)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_a_refused_token_fails_the_load_with_the_url_and_never_shows_the_token(
    nginx: NginxServer,
    shm_dir: Path,
    tmp_path: Path,
    sidecars: Sidecars,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="modelload")
    nginx.put("private-sidecar/refused.safetensors", models.safetensors_bytes(models.state_dict(seed=42)))
    source = nginx.private_url("private-sidecar/refused.safetensors")
    path = header_file(tmp_path, f"Authorization: Bearer {WRONG}\n")
    sidecar = start(shm_dir, source, "--header-file", str(path), started=sidecars)
    ready(sidecar, 500)
    error = get(sidecar, "/status").json()["error"]
    assert error.startswith(f"{source} refused the configured token or headers (HTTP 401")
    assert "Secret" in error and "expired" in error
    assert 'modelload_errors_total{kind="access_denied"} 1.0' in get(sidecar, "/metrics").text
    assert not (shm_dir / "model.seg").exists()  # refused at the first request: nothing was published
    shown = everything_shown(sidecar, caplog)
    assert source in shown
    assert WRONG not in shown and TOKEN not in shown


def test_a_token_revoked_mid_load_marks_the_segment_failed_with_the_reason(
    nginx: NginxServer,
    nginx_proxy: FaultProxy,
    shm_dir: Path,
    tmp_path: Path,
    sidecars: Sidecars,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="modelload")
    tensors = models.state_dict(seed=43, layers=4, width=512)
    nginx.put("private-sidecar/revoked.safetensors", models.safetensors_bytes(tensors))
    nginx_proxy.push(PASS, PASS)  # the stat and the index read go through; the token is then revoked
    nginx_proxy.always(Respond(401, b"token revoked"))
    source = nginx_proxy.url("private/private-sidecar/revoked.safetensors")
    sidecar = start(shm_dir, source, "--header-file", str(header_file(tmp_path, TOKEN)), started=sidecars)
    ready(sidecar, 500)
    error = get(sidecar, "/status").json()["error"]
    assert error.startswith(f"{source} refused the configured token or headers (HTTP 401")
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.FAILED
        assert segment.error == error
        recorded = segment.error
    assert {r.headers.get("authorization") for r in nginx_proxy.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in everything_shown(sidecar, caplog) + recorded
