"""``modelload sidecar``: the process around the engine, in this process with a scripted engine, and as a
real command with the real engine on a local safetensors file: probes, notifications, failures, SIGTERM."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import zmq

from modelload.loader import attach
from modelload.loader.cli.main import main
from modelload.loader.errors import ConfigError
from modelload.loader.formats.safetensors import save_file
from modelload.loader.segment import SegmentReader, TensorState, WriterState
from modelload.sidecar.logs import LoggingObserver
from modelload.sidecar.process import Sidecar
from modelload.sidecar.settings import SidecarSettings
from tests.sidecar.scripted import ELEMENTS, ScriptedEngine, scripted, tensor_values
from tests.support.clock import FakeClock
from tests.support.ports import free_port
from tests.support.processes import start_sidecar, stop_sidecar
from tests.support.sidecars import Sidecars
from tests.support.subscriptions import PROBE, heard_on, receive, until_heard
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_sidecar(sidecars: Sidecars, shm_dir: Path) -> Callable[..., Sidecar]:
    """Start a Sidecar in this process with an engine factory; stopped at the end of the test."""

    def start(factory: Any, *flags: str, source: str = "scripted://model") -> Sidecar:
        return sidecars.start(source, shm_dir / "model.seg", *flags, engine_factory=factory)

    return start


def ready(sidecar: Sidecar, status: int) -> None:
    """Wait until the sidecar's /readyz answers ``status`` (200 loaded, 500 failed)."""
    wait_for(lambda: get(sidecar, "/readyz").status_code == status, timeout=10, what=f"/readyz {status}")


def get(sidecar: Sidecar, path: str) -> httpx.Response:
    return httpx.get(sidecar.api.url + path, timeout=5)


# --- in this process, with a scripted engine ---------------------------------------------------------------


def test_a_complete_load_is_served_until_the_sidecar_stops(
    run_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    sidecar = run_sidecar(scripted(tensors=4))
    ready(sidecar, 200)
    status = get(sidecar, "/status").json()
    assert (status["state"], status["tensors_ready"], status["bytes_done"]) == (
        "complete",
        4,
        4 * ELEMENTS * 4,
    )
    assert status["notify"] == f"ipc://{shm_dir}/model.seg.notify.sock"
    assert "modelload_tensors_ready 4.0" in get(sidecar, "/metrics").text
    assert get(sidecar, "/healthz").status_code == 200  # the load is over; the sidecar keeps serving
    with attach(shm_dir / "model.seg", timeout=5) as model:
        assert np.array_equal(model.numpy("layer3.weight"), tensor_values(3))
    url = sidecar.api.url
    assert sidecar.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/healthz", timeout=2)
    assert not (shm_dir / "model.seg.notify.sock").exists()
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.COMPLETE  # the segment outlives the sidecar's API


def test_notifications_reach_a_subscriber_while_the_model_loads(
    run_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    gate = threading.Event()
    sidecar = run_sidecar(scripted(tensors=3, pause_at=0, gate=gate))
    sub: Any = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"ipc://{shm_dir}/model.seg.notify.sock")
    notifier = sidecar.notifier
    assert notifier is not None
    until_heard(lambda: notifier.tensor_ready(index=PROBE, name="probe", nbytes=0), heard_on(sub))
    gate.set()  # the first tensor only once the subscription is in place
    frames = receive(sub, 4)
    sub.close(linger=0)
    assert frames == [
        [b"ready", b"\x00\x00\x00\x00"],
        [b"ready", b"\x01\x00\x00\x00"],
        [b"ready", b"\x02\x00\x00\x00"],
        [b"done", b""],
    ]


def test_a_failed_load_keeps_the_sidecar_serving_the_reason(
    run_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    sidecar = run_sidecar(scripted(tensors=4, fail_at=2))
    ready(sidecar, 500)
    reason = "layer2.weight: hash mismatch (the transfer or the file is corrupt)"
    assert get(sidecar, "/readyz").json()["error"] == reason
    assert get(sidecar, "/healthz").status_code == 200  # liveness green: no restart into the same failure
    assert get(sidecar, "/startupz").status_code == 200  # the manifest was published before the failure
    status = get(sidecar, "/status").json()
    assert (status["state"], status["error"], status["errors"]) == ("failed", reason, {"hash_mismatch": 1})
    assert 'modelload_errors_total{kind="hash_mismatch"} 1.0' in get(sidecar, "/metrics").text
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.FAILED
        assert segment.error == reason
    assert get(sidecar, "/readyz").status_code == 500  # still up, still saying why
    assert sidecar.stop() == 1


def test_stopping_during_a_load_leaves_the_segment_failed_not_torn(
    run_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    sidecar = run_sidecar(scripted(tensors=4, pause_at=2))
    wait_for(lambda: get(sidecar, "/status").json()["tensors_ready"] == 2, timeout=10, what="2 tensors ready")
    assert get(sidecar, "/readyz").status_code == 503
    assert sidecar.stop() == 1
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.FAILED
        assert [segment.state(i) for i in range(4)] == [TensorState.READY] * 2 + [TensorState.PENDING] * 2
    assert sidecar.tracker.snapshot().phase == "stopped"


def test_an_engine_that_cannot_be_built_is_served_as_a_failed_load(
    run_sidecar: Callable[..., Sidecar],
) -> None:
    def broken(settings: SidecarSettings, observer: object) -> ScriptedEngine:
        raise ConfigError("--key-file /secrets/key: no such file")

    sidecar = run_sidecar(broken)
    ready(sidecar, 500)
    status = get(sidecar, "/status").json()
    assert status["error"] == "--key-file /secrets/key: no such file"
    assert status["errors"] == {"config": 1}


def test_an_engine_that_crashes_is_served_as_a_failed_load(run_sidecar: Callable[..., Sidecar]) -> None:
    class Crashing:
        def run(self) -> None:
            raise RuntimeError("a bug")

        def stop(self) -> None:
            pass

    sidecar = run_sidecar(lambda settings, observer: Crashing())
    ready(sidecar, 500)
    assert get(sidecar, "/status").json()["errors"] == {"internal": 1}


def test_credentials_in_the_source_never_reach_the_logs(
    run_sidecar: Callable[..., Sidecar], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="modelload")
    uri = "https://alice:hunter2@models.example/m.safetensors?X-Amz-Signature=deadbeef"
    # The scripted engine reports the raw URI (the real one reports its display form): the log must not care.
    sidecar = run_sidecar(scripted(tensors=2, fail_at=1, source=uri), source=uri)
    ready(sidecar, 500)
    sidecar.stop()
    assert "loading https://models.example/m.safetensors?…" in caplog.text
    assert "load failed (hash_mismatch)" in caplog.text
    for secret in ("hunter2", "alice", "deadbeef"):
        assert secret not in caplog.text


def test_retries_are_logged_at_most_once_a_second(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="modelload")
    clock = FakeClock()
    observer = LoggingObserver(retry_interval=1.0, clock=clock)
    for _ in range(50):
        observer.retried(kind="timeout", message="no byte for 30 s")
        clock.advance(0.01)
    clock.advance(0.6)  # past 1 s since the first
    observer.retried(kind="throttled", message="503 SlowDown")
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert lines == [
        "retrying a range (timeout): no byte for 30 s",
        "retrying a range (throttled): 503 SlowDown (49 more retries not logged)",
    ]


def test_a_ranges_tensors_are_logged_one_by_one_at_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    class Unmade(list):  # names that may not be made: at INFO nothing per tensor is
        def __iter__(self) -> Any:
            raise AssertionError("a tensor's name was made for a log line nobody keeps")

    observer = LoggingObserver()
    caplog.set_level(logging.INFO, logger="modelload")
    observer.tensors_published(indices=[3, 4], names=Unmade(["a", "b"]), nbytes=[8, 16])
    assert not [r for r in caplog.records if r.levelno == logging.DEBUG]
    caplog.set_level(logging.DEBUG, logger="modelload")
    observer.tensors_published(indices=[3, 4], names=["a", "b"], nbytes=[8, 16])
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert lines == ["tensor 3 ready: a (8 bytes)", "tensor 4 ready: b (16 bytes)"]


def test_progress_is_logged_while_the_model_loads(
    run_sidecar: Callable[..., Sidecar], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("modelload.sidecar.process.PROGRESS_INTERVAL", 0.0)
    caplog.set_level(logging.INFO, logger="modelload")
    sidecar = run_sidecar(scripted(tensors=4, pause_at=2))
    wait_for(lambda: sidecar.tracker.snapshot().tensors_ready == 2, timeout=10, what="2 tensors ready")
    waiter = threading.Thread(target=sidecar.wait)
    waiter.start()
    try:
        wait_for(lambda: "loading: 50.0% 8.0 KiB/16.0 KiB" in caplog.text, timeout=5, what="a progress line")
    finally:
        sidecar.shutdown.set()
        waiter.join(5)
    assert "2/4 tensors, 0 retries, ETA" in caplog.text


# --- the command line ---------------------------------------------------------------------------------------


def test_bad_settings_exit_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sidecar", "--source", "s3://b/k", "--readers", "0"]) == 2
    assert "--readers: expected a number from 1 to 256, got 0" in capsys.readouterr().err


def test_a_missing_source_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MODELLOAD_SOURCE", raising=False)
    assert main(["sidecar"]) == 2
    assert "no model source: pass --source URI or set MODELLOAD_SOURCE" in capsys.readouterr().err


def test_a_port_in_use_exits_2(capsys: pytest.CaptureFixture[str], shm_dir: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["sidecar", "--source", "x", "--segment", str(shm_dir / "m.seg"), "--host", "127.0.0.1"]
        assert main([*argv, "--port", port]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_help_states_what_a_failed_load_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sidecar", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "liveness stays green while readiness is red" in text
    assert "MODELLOAD_CHUNK_SIZE" in text and "--no-verify" in text
    assert "exit status: 0 after a stop if the load had completed" in text


def test_loading_the_commands_imports_no_web_framework_or_zmq() -> None:
    code = (
        "import sys, modelload.sidecar.cli, modelload.sidecar.process, modelload.sidecar.monitor;"
        "heavy = ('fastapi', 'uvicorn', 'zmq', 'prometheus_client', 'modelload.sidecar.load.engine');"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- as a real command -------------------------------------------------------------------------------------


def test_the_command_loads_a_safetensors_file_and_exits_0_on_sigterm(shm_dir: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors = {
        f"model.layers.{i}.weight": rng.standard_normal((64, 96)).astype(np.float32) for i in range(12)
    }
    tensors["model.embed.weight"] = rng.integers(0, 100, (33, 7)).astype(np.int64)
    save_file(tensors, tmp_path / "model.safetensors")
    port = free_port()
    args = ["--source", f"file://{tmp_path}/model.safetensors", "--segment", str(shm_dir / "model.seg")]
    process = start_sidecar(
        [*args, "--host", "127.0.0.1", "--port", str(port), "--chunk-size", "1MiB"], port=port
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, timeout=20, what="ready")
        status = httpx.get(url + "/status", timeout=5).json()
        assert status["tensors_total"] == status["tensors_ready"] == 13
        assert status["bytes_done"] == status["bytes_total"] == sum(t.nbytes for t in tensors.values())
        with attach(shm_dir / "model.seg", timeout=5) as model:
            assert model.metadata["notify"] == f"ipc://{shm_dir}/model.seg.notify.sock"
            for name, expected in tensors.items():
                assert np.array_equal(model.numpy(name), expected)
    finally:
        code, stderr = stop_sidecar(process)
    assert code == 0, stderr
    assert "load complete" in stderr and "SIGTERM" in stderr
    assert not (shm_dir / "model.seg.notify.sock").exists()
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.COMPLETE


def test_the_command_keeps_serving_a_missing_source_as_a_failed_load(shm_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    args = ["--source", str(tmp_path / "missing.safetensors"), "--segment", str(shm_dir / "model.seg")]
    process = start_sidecar([*args, "--host", "127.0.0.1", "--port", str(port)], port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 500, timeout=20, what="failed")
        status = httpx.get(url + "/status", timeout=5).json()
        assert status["state"] == "failed"
        assert "missing.safetensors" in status["error"]
        assert httpx.get(url + "/healthz", timeout=5).status_code == 200
        assert process.poll() is None
    finally:
        code, stderr = stop_sidecar(process)
    assert code == 1
    assert "load failed" in stderr


PAUSED = """
import sys
from modelload.sidecar.cli import _configure_logging
from modelload.sidecar.process import run_sidecar
from modelload.sidecar.settings import parse_settings
from tests.sidecar.scripted import scripted

_configure_logging("info", verbose=0)
sys.exit(run_sidecar(parse_settings(sys.argv[1:], {}), engine_factory=scripted(tensors=4, pause_at=2)))
"""


def test_sigterm_during_a_load_marks_the_segment_failed_and_exits_1(shm_dir: Path) -> None:
    port = free_port()
    args = ["--source", "scripted://m", "--segment", str(shm_dir / "model.seg"), "--host", "127.0.0.1"]
    process = start_sidecar([*args, "--port", str(port)], port=port, script=PAUSED)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: httpx.get(url + "/status", timeout=5).json()["tensors_ready"] == 2,
            timeout=20,
            what="2 tensors ready",
        )
    finally:
        code, stderr = stop_sidecar(process)
    assert code == 1, stderr
    assert "SIGTERM: stopping the load, then the status API" in stderr
    with SegmentReader.open(shm_dir / "model.seg") as segment:
        assert segment.writer_state == WriterState.FAILED
        assert "stopped" in segment.error
        assert segment.tensors_ready == 2
    assert os.path.exists(shm_dir / "model.seg")
