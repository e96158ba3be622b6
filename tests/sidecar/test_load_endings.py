"""Every way a load ends, and what ``attach()`` gives the app then (docs/sidecar.md, "How a load ends").

Each row of that table is pinned here (or by the test the table names): complete, failed before or after
the segment, failed transiently (the whole load again), stopped (SIGTERM), killed (SIGKILL), restarted, and
replaced by another source. The promise under every row: the app gets the weights the load names or an
error with the reason, never an earlier load's model, and nothing waits without end.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelload.loader import attach
from modelload.loader.errors import (
    LoadFailedError,
    SidecarUnavailableError,
    SourceNotFoundError,
    WrongKeyError,
)
from modelload.loader.segment import SegmentReader, WriterState
from modelload.loader.segment.lock import SegmentBusyError
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.attempts import AttemptPolicy
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.settings import SidecarSettings, parse_settings
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.sidecar import models
from tests.support.failures import assert_load_failed
from tests.support.fault_proxy import Stall, server_error
from tests.support.ports import free_port
from tests.support.processes import start_sidecar, stop_sidecar
from tests.support.sidecars import Sidecars, wait_for_phase
from tests.support.waiting import wait_for

FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0),
)
PASS = Stall(after=0, seconds=0.0)


def load(source: str, segment: Path, **settings: Any) -> LoadTracker:
    tracker = LoadTracker()
    Engine(LoadSettings(source=source, segment=segment, **settings), sources=FAST, observer=tracker).run()
    return tracker


def sidecar_settings(
    source: str, segment: Path, *flags: str, sources: SourceSettings = FAST
) -> SidecarSettings:
    argv = ["--source", source, "--segment", str(segment), "--host", "127.0.0.1", "--port", "0", *flags]
    return dataclasses.replace(parse_settings(argv, environ={}), sources=sources)


# --- complete ----------------------------------------------------------------------------------------------


def test_a_complete_load_is_attached_byte_exact_and_says_what_it_holds(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=60, layers=1)
    url = nginx.put("endings-complete.safetensors", models.safetensors_bytes(tensors))
    load(url, shm_dir / "model.seg")
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        recorded = reader.metadata["load"]
    assert '"source":"' + url + '"' in recorded and '"version":"\\"' in recorded


# --- failed ------------------------------------------------------------------------------------------------


def test_a_failed_load_of_another_source_leaves_no_earlier_model_attachable(
    nginx: Any, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    load(nginx.put("endings-a.safetensors", models.safetensors_bytes(models.state_dict(seed=61))), segment)
    with pytest.raises(SourceNotFoundError):
        load(nginx.url("endings-missing.safetensors"), segment)
    reason = assert_load_failed(segment, match="endings-missing")
    assert "endings-a" not in reason
    assert sorted(p.name for p in shm_dir.iterdir()) == ["model.seg.failed", "model.seg.lock"], (
        "model A's segment is gone: it holds no memory and no app can take it for B"
    )


def test_a_wrong_key_fails_the_load_instead_of_reusing_what_the_right_key_opened(
    nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=62, layers=1)
    params = models.password_params("right")
    url = nginx.put("endings-encrypted.tensors", models.tensorizer_bytes(tensors, encryption=params))
    right = models.write_secret(shm_dir, "right", params.key)
    load(url, shm_dir / "model.seg", key_file=right)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    with pytest.raises(WrongKeyError):
        load(url, shm_dir / "model.seg", key_file=models.write_secret(shm_dir, "wrong", bytes(32)))
    assert_load_failed(shm_dir / "model.seg", match="wrong")
    load(url, shm_dir / "model.seg", key_file=right)  # and the right key loads it again
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_an_app_attached_to_a_load_that_fails_midway_gets_the_reason(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=63, layers=3)
    data = models.corrupt_tensor(models.tensorizer_bytes(tensors), "layers.2.attn.weight")
    nginx.put("endings-corrupt.tensors", data)
    nginx_proxy.push(PASS, Stall(after=0, seconds=1.0))  # the look-up and index; the first range is slow
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            load(nginx_proxy.url("endings-corrupt.tensors"), shm_dir / "model.seg", readers=1)
        except BaseException as exc:
            outcome.append(exc)

    loading = threading.Thread(target=run)
    loading.start()
    wait_for((shm_dir / "model.seg").exists, timeout=20, what="the segment")
    with attach(shm_dir / "model.seg", timeout=30, notify=False) as model, pytest.raises(LoadFailedError):
        model.wait(timeout=30)
    loading.join(30)
    assert outcome and "CRC32" in str(outcome[0])
    assert_load_failed(shm_dir / "model.seg", match="CRC32")


def test_a_transient_failure_that_outlasts_an_attempt_starts_the_whole_load_again(
    sidecars: Sidecars, nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=64, layers=1)
    nginx.put("endings-outage.safetensors", models.safetensors_bytes(tensors))
    nginx_proxy.always(server_error())  # an outage longer than an attempt's three tries
    settings = sidecar_settings(nginx_proxy.url("endings-outage.safetensors"), shm_dir / "model.seg")
    # Seconds between attempts: the checks below read the retrying phase before the next attempt begins, even
    # on a busy machine.
    sidecar = sidecars.run(settings, attempts=AttemptPolicy(first_delay=4.0, max_delay=4.0, jitter=0.0))
    wait_for_phase(sidecar, "retrying", timeout=20)  # a retry of the whole load
    status = httpx.get(sidecar.api.url + "/status", timeout=5).json()
    assert status["error"].startswith("gave up") and "500" in status["error"], status
    assert status["next_attempt_at"] > status["started_at"]
    ready = httpx.get(sidecar.api.url + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["phase"] == "retrying"
    assert 'modelload_load_attempts_total{outcome="retrying"}' in httpx.get(sidecar.api.url + "/metrics").text
    assert not (shm_dir / "model.seg.failed").exists(), "no marker: an app attaching now waits, not fails"
    nginx_proxy.clear()  # the outage ends
    with attach(shm_dir / "model.seg", timeout=30, notify=False) as model:
        model.wait(timeout=30)
    wait_for_phase(sidecar, "complete", timeout=20)
    assert sidecar.tracker.snapshot().attempt >= 2
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_a_permanent_failure_is_not_retried_and_stays_failed(
    sidecars: Sidecars, nginx: Any, shm_dir: Path
) -> None:
    settings = sidecar_settings(nginx.url("endings-gone.safetensors"), shm_dir / "model.seg")
    sidecar = sidecars.run(settings, attempts=AttemptPolicy(first_delay=0.05, max_delay=0.05, jitter=0.0))
    wait_for_phase(sidecar, "failed", timeout=20)
    thread = sidecar._load._thread
    wait_for(lambda: not thread.is_alive(), timeout=20, what="the load thread to end: no attempt follows")
    metrics = httpx.get(sidecar.api.url + "/metrics", timeout=5).text
    assert 'modelload_load_attempts_total{outcome="failed"} 1.0' in metrics
    assert 'modelload_load_attempts_total{outcome="retrying"} 0.0' in metrics
    assert sidecar.tracker.snapshot().phase == "failed"
    assert httpx.get(sidecar.api.url + "/readyz", timeout=5).status_code == 500


# --- one writer --------------------------------------------------------------------------------------------


def test_a_second_sidecar_on_the_same_segment_is_refused_naming_the_first(
    sidecars: Sidecars, nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    nginx.put("endings-writer.safetensors", models.safetensors_bytes(models.state_dict(seed=65)))
    nginx_proxy.always(Stall(after=0, seconds=1.0))  # the first one is still loading
    url = nginx_proxy.url("endings-writer.safetensors")
    first = sidecars.run(sidecar_settings(url, shm_dir / "model.seg"))
    other_socket = f"ipc://{shm_dir}/other.sock"  # its own notify endpoint: no socket clash to stop it
    with pytest.raises(SegmentBusyError) as refused:
        sidecars.run(sidecar_settings(url, shm_dir / "model.seg", "--notify", other_socket))
    message = str(refused.value)
    assert f"pid {os.getpid()}" in message and first.api.url in message, message
    assert refused.value.exit_status == 2
    assert not Path(other_socket.removeprefix("ipc://")).exists()


def test_the_command_refuses_a_second_sidecar_with_exit_status_2(nginx: Any, shm_dir: Path) -> None:
    url = nginx.put("endings-cli.safetensors", models.safetensors_bytes(models.state_dict(seed=66)))
    port = free_port()
    args = ["--source", url, "--segment", str(shm_dir / "model.seg"), "--host", "127.0.0.1"]
    first = start_sidecar([*args, "--port", str(port)], port=port)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "modelload.loader.cli.main", "sidecar", *args, "--port", str(free_port())],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        stop_sidecar(first)
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and f"http://127.0.0.1:{port}" in second.stderr
    assert "Traceback" not in second.stderr


# --- stopped and killed ------------------------------------------------------------------------------------


def test_sigterm_on_a_stalled_source_marks_the_segment_failed_before_the_process_exits(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    nginx.put("endings-stalled.safetensors", models.safetensors_bytes(models.state_dict(seed=67)))
    nginx_proxy.push(PASS)  # the look-up, which reads the index too
    nginx_proxy.always(Stall(after=0, seconds=120))  # every range hangs inside a recv
    port = free_port()
    segment = shm_dir / "model.seg"
    args = ["--source", nginx_proxy.url("endings-stalled.safetensors"), "--segment", str(segment)]
    args += ["--readers", "2", "--chunk-size", str(1 << 20)]  # 3.6 MB: both readers get a range
    process = start_sidecar([*args, "--host", "127.0.0.1", "--port", str(port)], port=port)
    try:
        wait_for(segment.exists, timeout=20, what="the segment")
        model = attach(segment, timeout=5, notify=False)
        wait_for(lambda: len(nginx_proxy.requests) >= 3, timeout=20, what="both readers to block")
        process.send_signal(signal.SIGTERM)
        with pytest.raises(LoadFailedError, match="stopped"):
            model.wait(timeout=20)  # an attached app hears of it while the readers still hang
        process.wait(timeout=25)  # and the process exits within the kubelet's 30 s grace
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    assert process.returncode == 1
    with SegmentReader.open(segment) as reader:
        assert reader.writer_state == WriterState.FAILED and "stopped" in reader.error
    model.close()


def test_a_killed_sidecar_is_noticed_by_attached_apps_at_once(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    nginx.put("endings-killed.safetensors", models.safetensors_bytes(models.state_dict(seed=68)))
    nginx_proxy.push(PASS)  # the look-up, which reads the index too
    nginx_proxy.always(Stall(after=0, seconds=120))
    port = free_port()
    segment = shm_dir / "model.seg"
    args = ["--source", nginx_proxy.url("endings-killed.safetensors"), "--segment", str(segment)]
    process = start_sidecar([*args, "--host", "127.0.0.1", "--port", str(port)], port=port)
    try:
        wait_for(segment.exists, timeout=20, what="the segment")
        model = attach(segment, timeout=5, notify=False)
        process.kill()  # SIGKILL, the OOM killer: no handler runs, the segment stays LOADING
        process.wait()
        with pytest.raises(LoadFailedError, match=f"pid {process.pid}.*is gone"):
            model.wait(timeout=20)  # not the heartbeat's 60 s: the writer's lock is free
        with pytest.raises(LoadFailedError, match="is gone"):
            attach(segment, timeout=5, notify=False)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
    model.close()


# --- restarted and replaced --------------------------------------------------------------------------------


def test_a_restart_mid_load_supersedes_the_unfinished_segment_and_loads_again(
    nginx: Any, shm_dir: Path
) -> None:
    from modelload.loader.segment import SegmentWriter
    from tests.segment.helpers import small_layout

    segment = shm_dir / "model.seg"
    crashed = SegmentWriter.create(segment, small_layout(), heartbeat=False)  # an older writer, no lock
    old = attach(segment, timeout=5, notify=False)
    tensors = models.state_dict(seed=69, layers=1)
    load(nginx.put("endings-restart.safetensors", models.safetensors_bytes(tensors)), segment)
    with pytest.raises(LoadFailedError, match="superseded"):
        old.wait(timeout=10)
    models.assert_segment_matches(segment, tensors)
    old.close()
    crashed.close()


def test_a_new_source_is_never_taken_for_the_model_an_earlier_load_left(
    nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    model_a = models.state_dict(seed=70, layers=1)
    model_b = models.state_dict(seed=71, layers=1)
    load(nginx.put("endings-model-a.safetensors", models.safetensors_bytes(model_a)), segment)
    app_on_a = attach(segment, timeout=5, notify=False)
    nginx.put("endings-model-b.safetensors", models.safetensors_bytes(model_b))
    nginx_proxy.push(Stall(after=0, seconds=2.0))  # B's first look-up is slow: A is still in the volume
    loading = threading.Thread(target=load, args=(nginx_proxy.url("endings-model-b.safetensors"), segment))
    loading.start()
    wait_for(lambda: len(nginx_proxy.requests) >= 1, timeout=20, what="B's load to start")
    with pytest.raises(SidecarUnavailableError):
        attach(segment, timeout=0.5, notify=False)  # waits for B: A is no longer the load
    loading.join(30)
    models.assert_segment_matches(segment, model_b)
    assert models.as_bytes(app_on_a.state_dict()["embed.weight"]) == models.as_bytes(
        model_a["embed.weight"]
    ), "an app attached to A keeps A's tensors: its mapping is untouched"
    app_on_a.close()


def test_a_restart_of_the_same_load_reuses_its_segment_but_not_after_the_object_changed(
    nginx: Any, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    first = models.state_dict(seed=72, layers=1)
    url = nginx.put("endings-same.safetensors", models.safetensors_bytes(first))
    load(url, segment)
    inode = segment.stat().st_ino
    load(url, segment)
    assert segment.stat().st_ino == inode, "the same load: the segment is reused as it is"
    second = models.state_dict(seed=73, layers=2)  # another size: another ETag (nginx: mtime and size)
    nginx.put("endings-same.safetensors", models.safetensors_bytes(second))
    load(url, segment)
    assert segment.stat().st_ino != inode
    models.assert_segment_matches(segment, second)


def test_a_restart_asking_for_other_slots_writes_the_segment_again_with_them(
    nginx: Any, shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    tensors = models.state_dict(seed=74, layers=1)
    url = nginx.put("endings-slots.safetensors", models.safetensors_bytes(tensors))
    load(url, segment, slots="packed")
    inode = segment.stat().st_ino
    with SegmentReader.open(segment) as reader:
        assert reader.header.layout_version == 5
    load(url, segment, slots="paged")  # (an app that pins an older loader, which reads pages only)
    assert segment.stat().st_ino != inode, "a packed segment is not the paged one asked for"
    with SegmentReader.open(segment) as reader:
        assert reader.header.layout_version in (1, 2)
    models.assert_segment_matches(segment, tensors)
    inode = segment.stat().st_ino
    load(url, segment, slots="paged")
    assert segment.stat().st_ino == inode, "the same slots: reused"


def test_a_load_refused_by_a_full_volume_leaves_no_model_directory_behind(
    nginx: Any, tiny_tmpfs: Path
) -> None:
    from modelload.loader.errors import SegmentSpaceError
    from tests.support import hfdir

    tensors = {"w": models.state_dict(seed=74, layers=1, width=512)["embed.weight"]}  # 1 MiB: too big
    for name, data in hfdir.files(tensors, shards=1, small={"config.json": b"{}"}).items():
        nginx.put(f"endings-full/{name}", data)
    with pytest.raises(SegmentSpaceError):
        load(nginx.url("endings-full/"), tiny_tmpfs / "model.seg")
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["model.seg.failed", "model.seg.lock"], (
        "no model/ folder of config files, no segment: only the reason"
    )
    assert_load_failed(tiny_tmpfs / "model.seg", match="sizeLimit")
