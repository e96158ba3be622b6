"""``modelload monitor`` against a live status API on loopback: progress, completion, failure, no sidecar."""

from __future__ import annotations

import http.server
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import cast

import pytest

from modelload.loader.cli.main import main
from modelload.sidecar.api import ApiServer, create_app
from modelload.sidecar.metrics import MetricsObserver
from modelload.sidecar.monitor import EXIT_FAILED, EXIT_LOADING, EXIT_UNREACHABLE, render, watch
from modelload.sidecar.progress import LoadObserver, LoadTracker, Observers
from tests.support.ports import free_port
from tests.support.waiting import wait_for


class Live:
    def __init__(self, *, port: int = 0) -> None:
        self.tracker = LoadTracker()
        self.observer = cast(LoadObserver, Observers(self.tracker))
        app = create_app(self.tracker, metrics_registry=MetricsObserver().registry)
        self.server = ApiServer(app, host="127.0.0.1", port=port)
        self.url = self.server.url

    def begin(self, *, tensors: int = 4, size: int = 1 << 20) -> None:
        self.observer.load_started(source="s3://models/m.safetensors", segment="/run/modelload/model.seg")
        self.observer.manifest_published(
            model_format="safetensors", tensors=tensors, nbytes=tensors * size, notify=None
        )

    def load(
        self,
        *,
        tensors: int = 4,
        size: int = 1 << 20,
        pause: float = 0.05,
        fail_at: int | None = None,
        hold: threading.Event | None = None,
    ) -> None:
        """``hold``: after the first tensor, wait (30 s at most) until it is set before going on; a load
        still held then fails, so that the monitor ends and the test says why."""
        self.begin(tensors=tensors, size=size)
        for i in range(tensors):
            if i == 1 and hold is not None and not hold.wait(30):
                self.observer.load_failed(
                    kind="stopped", reason="the monitor never printed the load in progress"
                )
                return
            time.sleep(pause)
            if i == fail_at:
                self.observer.load_failed(kind="access_denied", reason="403 Forbidden: check the Secret")
                return
            self.observer.bytes_loaded(size)
            self.observer.tensor_ready(index=i, name=f"t{i}", nbytes=size)
        self.observer.load_finished(seconds=tensors * pause, nbytes=tensors * size)


@pytest.fixture
def live() -> Iterator[Live]:
    sidecar = Live()
    sidecar.server.start()
    yield sidecar
    sidecar.server.stop()


def in_background(target: object, **kwargs: object) -> threading.Thread:
    thread = threading.Thread(target=target, kwargs=kwargs, daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread


def test_the_monitor_follows_a_load_to_completion_and_exits_0(live: Live) -> None:
    out = io.StringIO()
    in_background(live.load, pause=0.1)
    assert watch(live.url, interval=0.05, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[-1].startswith("complete: 4.0 MiB in ")
    assert "4/4 tensors, 0 retries" in lines[-1]


class _Written(io.StringIO):
    """Output that tells when the load was first written to it with one tensor of four in (a status
    document, or the line drawn on a terminal)."""

    def __init__(self) -> None:
        super().__init__()
        self.progress = threading.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        if re.search(r'"tensors_ready": 1[,}]| 1/4 tensors', text):
            self.progress.set()
        return written


def test_json_mode_prints_one_status_document_per_poll(live: Live) -> None:
    out = _Written()
    # The load stops after its first tensor until the monitor has printed it loading: two documents at
    # least, whatever the machine's pace.
    in_background(live.load, pause=0, hold=out.progress)
    assert watch(live.url, interval=0.02, as_json=True, out=out) == 0
    documents = [json.loads(line) for line in out.getvalue().splitlines()]
    assert documents[-1]["state"] == "complete" and documents[-1]["bytes_done"] == 4 << 20
    assert any(0 < d["bytes_done"] < 4 << 20 for d in documents), "the load in progress was printed"
    assert [d["bytes_done"] for d in documents] == sorted(d["bytes_done"] for d in documents)


def test_once_prints_the_current_progress_and_says_the_load_is_still_running(live: Live) -> None:
    live.begin(tensors=4)
    live.observer.bytes_loaded(1 << 20)
    live.observer.tensor_ready(index=0, name="t0", nbytes=1 << 20)
    out = io.StringIO()
    assert watch(live.url, once=True, out=out) == EXIT_LOADING
    line = out.getvalue().strip()
    assert line.startswith("loading  [######..................]  25.0% 1.0 MiB/4.0 MiB")
    assert "1/4 tensors" in line


def test_a_failed_load_exits_1_with_its_reason(live: Live, capsys: pytest.CaptureFixture[str]) -> None:
    in_background(live.load, fail_at=1)
    assert watch(live.url, interval=0.02, out=io.StringIO()) == EXIT_FAILED
    assert "the load failed: 403 Forbidden: check the Secret" in capsys.readouterr().err


def test_an_unreachable_sidecar_exits_3_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert watch(url, interval=0.05, timeout=0.3, out=io.StringIO()) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert f"cannot reach the sidecar at {url}" in err
    assert "MODELLOAD_STATUS_URL" in err


def test_a_server_that_is_not_a_sidecar_exits_3(capsys: pytest.CaptureFixture[str]) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    in_background(server.serve_forever)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert watch(url, once=True, out=io.StringIO()) == EXIT_UNREACHABLE
    finally:
        server.shutdown()
        server.server_close()
    assert "answered HTTP 404: is --url the sidecar's status API?" in capsys.readouterr().err


def test_the_monitor_waits_for_a_sidecar_that_is_still_starting() -> None:
    # Started before its sidecar listens (refused), then before the load begins: it waits through both.
    port = free_port()
    started: list[Live] = []
    out = io.StringIO()

    def come_up() -> None:
        sidecar = Live(port=port)  # binds the port only now
        started.append(sidecar)
        sidecar.server.start()
        wait_for(
            lambda: "starting" in out.getvalue(), timeout=5, what="the monitor to see the sidecar starting"
        )
        sidecar.load(pause=0.01)

    threading.Timer(0.3, come_up).start()
    try:
        assert watch(f"http://127.0.0.1:{port}", interval=0.05, timeout=5, out=out) == 0
    finally:
        for sidecar in started:
            sidecar.server.stop()
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting: waiting for the model's index"
    assert lines[-1].startswith("complete: ")


def test_the_command_reads_the_url_from_the_environment(
    live: Live, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    live.load(pause=0)
    monkeypatch.setenv("MODELLOAD_STATUS_URL", live.url)
    assert main(["monitor", "--once"]) == 0
    assert capsys.readouterr().out.startswith("complete: 4.0 MiB")


def test_the_command_refuses_a_non_positive_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", "--interval", "0", "--url", "http://127.0.0.1:1"]) == 2
    assert "--interval and --timeout must be positive" in capsys.readouterr().err


class _Terminal(_Written):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_line_is_redrawn_in_place(live: Live) -> None:
    out = _Terminal()
    in_background(live.load, pause=0, hold=out.progress)
    assert watch(live.url, interval=0.02, out=out) == 0
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.count("\r\x1b[2K") >= 2


def test_render_shows_a_failure_with_what_was_loaded() -> None:
    line = render({"phase": "failed", "error": "no space", "bytes_done": 1024, "bytes_total": 4096,
                   "tensors_ready": 1, "tensors_total": 4})  # fmt: skip
    assert line == "failed: no space (1.0 KiB/4.0 KiB, 1/4 tensors)"


def test_render_says_a_transient_failure_starts_the_whole_load_again() -> None:
    import time

    line = render(
        {"phase": "retrying", "error": "HTTP 503", "attempt": 2, "next_attempt_at": time.time() + 30.4}
    )
    assert line.startswith("retrying: attempt 2 failed (HTTP 503); the whole load again in 3")


def test_render_shows_the_retries_of_a_load_still_looking_up_its_model() -> None:
    # before the fix a sidecar retrying a refused connection showed only "starting: waiting for the
    # model's index" until its attempt gave up, as if nothing were wrong
    line = render({"phase": "starting", "retries": 5, "errors": {"connection": 4, "server": 1}})
    assert line == "starting: waiting for the model's index, 5 retries (connection 4, server 1)"
    assert (
        render({"phase": "starting", "retries": 0, "errors": {}}) == "starting: waiting for the model's index"
    )
