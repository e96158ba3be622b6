"""The status API on a real uvicorn server on loopback: probes through a load's phases, /status, /metrics."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelload.loader.errors import ConfigError
from modelload.sidecar.api import ApiServer, create_app
from modelload.sidecar.metrics import MetricsObserver
from modelload.sidecar.progress import LoadObserver, LoadTracker, Observers

CONTRACT_FIELDS = {
    "state",
    "bytes_total",
    "bytes_done",
    "tensors_total",
    "tensors_ready",
    "throughput_bytes_per_s",
    "started_at",
    "first_tensor_at",
    "finished_at",
    "eta_s",
    "retries",
    "errors",
}


@dataclass
class Served:
    tracker: LoadTracker
    metrics: MetricsObserver
    observer: LoadObserver
    client: httpx.Client
    server: ApiServer


@pytest.fixture
def served() -> Iterator[Served]:
    tracker, metrics = LoadTracker(), MetricsObserver()
    server = ApiServer(create_app(tracker, metrics_registry=metrics.registry), host="127.0.0.1", port=0)
    server.start()
    with httpx.Client(base_url=server.url, timeout=5) as client:
        yield Served(tracker, metrics, cast(LoadObserver, Observers(tracker, metrics)), client, server)
    server.stop()


def codes(client: httpx.Client) -> tuple[int, int, int]:
    return tuple(client.get(path).status_code for path in ("/healthz", "/startupz", "/readyz"))  # type: ignore[return-value]


def test_the_probes_follow_a_load_from_start_to_complete(served: Served) -> None:
    observer, client = served.observer, served.client
    assert codes(client) == (200, 503, 503)
    observer.load_started(source="s3://models/m.safetensors", segment="/run/modelload/model.seg")
    assert codes(client) == (200, 503, 503)
    observer.manifest_published(model_format="safetensors", tensors=2, nbytes=8192, notify=None)
    assert codes(client) == (200, 200, 503)  # apps can attach: the startup probe passes
    for i in range(2):
        observer.bytes_loaded(4096)
        observer.tensor_ready(index=i, name=f"t{i}", nbytes=4096)
    assert codes(client) == (200, 200, 503)  # every tensor, but not yet COMPLETE
    observer.load_finished(seconds=0.5, nbytes=8192)
    assert codes(client) == (200, 200, 200)
    assert client.get("/readyz").json() == {
        "phase": "complete",
        "tensors_ready": 2,
        "tensors_total": 2,
        "error": None,
        "attempt": 1,
    }


def test_a_failed_load_is_a_500_on_readyz_with_the_reason_while_liveness_stays_green(served: Served) -> None:
    observer, client = served.observer, served.client
    observer.load_started(source="s3://models/m.safetensors", segment="/s")
    observer.manifest_published(model_format="safetensors", tensors=3, nbytes=3, notify=None)
    observer.load_failed(kind="hash_mismatch", reason="t1: the bytes do not match the file's hash")
    assert codes(client) == (200, 200, 500)
    body = client.get("/readyz").json()
    assert body["phase"] == "failed"
    assert body["error"] == "t1: the bytes do not match the file's hash"
    status = client.get("/status").json()
    assert status["state"] == status["phase"] == "failed"
    assert status["error"] == "t1: the bytes do not match the file's hash"
    assert status["errors"] == {"hash_mismatch": 1}


def test_a_load_that_fails_before_its_manifest_fails_the_startup_probe(served: Served) -> None:
    served.observer.load_started(source="s3://models/missing", segment="/s")
    served.observer.load_failed(kind="not_found", reason="s3://models/missing: no such key")
    assert codes(served.client) == (200, 500, 500)
    assert served.client.get("/startupz").json()["error"] == "s3://models/missing: no such key"


def test_a_stopped_load_is_not_ready_and_not_an_error(served: Served) -> None:
    served.observer.load_started(source="s3://b/k", segment="/s")
    served.observer.manifest_published(model_format="tensorizer", tensors=1, nbytes=1, notify=None)
    served.observer.load_failed(kind="stopped", reason="stopped")
    assert codes(served.client) == (200, 200, 503)


def test_status_carries_every_field_of_the_contract_with_the_loads_values(served: Served) -> None:
    observer = served.observer
    observer.load_started(source="s3://models/m.safetensors", segment="/run/modelload/model.seg")
    observer.manifest_published(
        model_format="safetensors", tensors=4, nbytes=4 << 20, notify="ipc:///run/modelload/notify.sock"
    )
    observer.retried(kind="timeout", message="stalled")
    observer.bytes_loaded(1 << 20)
    observer.tensor_ready(index=0, name="t0", nbytes=1 << 20)
    response = served.client.get("/status")
    assert response.headers["content-type"] == "application/json"
    status = response.json()
    assert set(status) >= CONTRACT_FIELDS
    assert status["state"] == "loading"
    assert (status["bytes_total"], status["bytes_done"]) == (4 << 20, 1 << 20)
    assert (status["tensors_total"], status["tensors_ready"]) == (4, 1)
    assert status["retries"] == 1 and status["errors"] == {"timeout": 1}
    assert status["throughput_bytes_per_s"] > 0
    assert status["eta_s"] is not None and status["eta_s"] > 0
    assert status["started_at"] <= status["first_tensor_at"]
    assert status["finished_at"] is None
    assert status["source"] == "s3://models/m.safetensors"
    assert status["notify"] == "ipc:///run/modelload/notify.sock"


def test_metrics_are_prometheus_text_of_the_load(served: Served) -> None:
    observer = served.observer
    observer.load_started(source="s3://b/k", segment="/s")
    observer.manifest_published(model_format="safetensors", tensors=1, nbytes=4096, notify=None)
    observer.bytes_loaded(4096)
    observer.tensor_ready(index=0, name="t0", nbytes=4096)
    observer.load_finished(seconds=0.2, nbytes=4096)
    response = served.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    assert values[("modelload_loaded_bytes_total", ())] == 4096
    assert values[("modelload_tensors_ready", ())] == 1
    assert values[("modelload_phase", (("modelload_phase", "complete"),))] == 1


def test_unknown_paths_are_404_and_no_docs_are_served(served: Served) -> None:
    for path in ("/", "/docs", "/openapi.json", "/status/extra"):
        assert served.client.get(path).status_code == 404


def test_a_port_in_use_is_a_config_error_naming_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tracker, metrics = LoadTracker(), MetricsObserver()
        app = create_app(tracker, metrics_registry=metrics.registry)
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port}.*--port/MODELLOAD_PORT"):
            ApiServer(app, host="127.0.0.1", port=port)


def test_stopping_the_server_releases_its_port(served: Served) -> None:
    port = served.server.port
    served.server.stop()
    assert not served.server.alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
