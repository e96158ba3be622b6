"""Traps a new user walked into with the sidecar: shared notify sockets, slow stops, unsupported schemes, a
segment folder that does not exist, a fallback no flag exposed, no ``--version``, docs naming wrong labels."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from modelload.loader.cli.main import main
from modelload.loader.errors import ConfigError
from modelload.sidecar.metrics import MetricsObserver
from modelload.sidecar.notify import Notifier
from modelload.sidecar.settings import parse_settings
from tests.support.ports import free_port
from tests.support.sidecars import Sidecars
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


def test_two_segments_in_one_folder_get_two_notify_sockets_and_stopping_one_keeps_the_other(
    shm_dir: Path,
) -> None:
    endpoints = [
        parse_settings(["--source", "/m.bin", "--segment", str(shm_dir / name)], environ={}).notify.endpoint
        for name in ("a.seg", "b.seg")
    ]
    assert endpoints == [f"ipc://{shm_dir}/a.seg.notify.sock", f"ipc://{shm_dir}/b.seg.notify.sock"]
    first, second = (Notifier(endpoint) for endpoint in endpoints if endpoint is not None)
    first.close()
    assert (shm_dir / "b.seg.notify.sock").is_socket()
    second.close()


def test_a_second_publisher_on_a_live_socket_is_refused_instead_of_taking_it(shm_dir: Path) -> None:
    endpoint = f"ipc://{shm_dir}/shared.sock"
    with Notifier(endpoint):
        with pytest.raises(ConfigError, match="another process publishes notifications on ipc://"):
            Notifier(endpoint)
        assert (shm_dir / "shared.sock").is_socket()


def test_a_missing_segment_folder_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-volume" / "model.seg"
    status = main(["sidecar", "--source", str(tmp_path / "m.bin"), "--segment", str(missing), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 2
    assert f"the segment's folder {missing.parent} does not exist" in err
    assert "notif" not in err


@pytest.mark.timeout(20)  # before the fix the sidecar served its failure forever
def test_an_unsupported_scheme_exits_at_once_with_a_config_error(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    started = time.monotonic()
    status = main(
        ["sidecar", "--source", "ftp://host/m.bin", "--segment", str(shm_dir / "m.seg"), "--port", "0"]
    )
    err = capsys.readouterr().err
    assert status == 2 and time.monotonic() - started < 5
    assert "no source for ftp:// URIs (supported: " in err
    assert all(f"{scheme}://" in err for scheme in ("az", "file", "gs", "hf", "http", "https", "oci", "s3"))
    # (that production lists no memory:// is checked in a fresh process: tests here register it)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("source", ["s3:/bucket/model/", "https:/host/m.safetensors", "s3:bucket/m"])
def test_a_uri_missing_a_slash_is_named_as_such_instead_of_read_as_a_local_path(
    source: str, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix "s3:/bucket/model/" was a local path: the load failed with "no file at s3:/bucket/model/:
    # check the path and the volume mount", and the sidecar served that failure instead of exiting
    status = main(["sidecar", "--source", source, "--segment", str(shm_dir / "m.seg"), "--port", "0"])
    err = capsys.readouterr().err
    scheme = source.split(":", 1)[0]
    assert status == 2
    assert f"{source!r} is not a {scheme}:// URI" in err and f"{scheme}://" in err


def test_a_stop_during_connection_retries_is_prompt(shm_dir: Path, sidecars: Sidecars) -> None:
    closed = free_port()  # nothing listens: every connect is refused and retried with backoff
    sidecar = sidecars.start(f"http://127.0.0.1:{closed}/m.safetensors", shm_dir / "model.seg")
    try:
        wait_for(lambda: sidecar.tracker.snapshot().retries >= 3, timeout=20, what="three retries")
    finally:
        started = time.monotonic()
        status = sidecar.stop()
        took = time.monotonic() - started
    assert status == 1
    assert took < 2.0, f"stopping took {took:.1f} s"
    snapshot = sidecar.tracker.snapshot()
    assert snapshot.phase == "stopped"
    assert not (shm_dir / "model.seg.failed").exists()  # a stop is not a failure for apps to report


def test_the_range_fallback_has_a_flag_and_a_variable() -> None:
    source = ["--source", "http://127.0.0.1:9/m.bin"]
    assert parse_settings(source, environ={}).sources.http.range_fallback is False
    assert parse_settings([*source, "--range-fallback"], environ={}).sources.http.range_fallback is True
    env = {"MODELLOAD_RANGE_FALLBACK": "true"}
    assert parse_settings(source, environ=env).sources.http.range_fallback is True
    assert parse_settings([*source, "--no-range-fallback"], environ=env).sources.http.range_fallback is False


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"modelload {version('modelload')}"


def test_the_docs_name_the_metrics_and_labels_the_sidecar_exports() -> None:
    observer = MetricsObserver()
    observer.load_started(source="s3://b/k", segment="/run/modelload/model.seg")
    observer.retried(kind="connection", message="reset")
    observer.load_failed(kind="not_found", reason="gone")
    exported: dict[str, set[str]] = {}
    for line in generate_latest(observer.registry).decode().splitlines():
        match = re.match(r"^(modelload_\w+?)(?:\{([^}]*)\})? ", line)
        if match and not match.group(1).endswith("_created"):  # creation stamps, not families
            labels = {pair.split("=")[0] for pair in (match.group(2) or "").split(",") if pair}
            exported.setdefault(match.group(1), set()).update(labels - {"le"})
    row = next(
        line for line in (REPO / "docs/sidecar.md").read_text().splitlines() if "`GET /metrics`" in line
    )
    documented = re.findall(r"`(modelload_\w+)(?:\{(\w+)\})?`", row)
    assert documented, "the docs' /metrics row names no metric"
    for name, label in documented:
        family = name if name in exported else f"{name}_bucket"
        assert family in exported, f"docs/sidecar.md names {name}, which the sidecar does not export"
        assert ({label} if label else set()) == exported[family], f"{name}: docs say {{{label}}}"
    families = {name.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for name in exported}
    assert families <= {name for name, _ in documented}, "a family the docs do not list"
