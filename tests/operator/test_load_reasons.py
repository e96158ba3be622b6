"""A pod whose load failed, or that the sidecar retries, says why: an Event on the pod and the ModelLoad's
Degraded condition, from the sidecar's own /status (a real sidecar on loopback, as the pod's IP)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from modelload.operator.load_reasons import PodReason, degraded_condition
from modelload.sidecar.load.attempts import AttemptPolicy
from modelload.sidecar.process import Sidecar
from modelload.sidecar.settings import parse_settings
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    create_modelload,
    current,
    modelload,
    posted_events,
    resolved,
    wait_for,
)
from tests.operator.test_pod_status import Kubelet, injected_pod, sidecar_status
from tests.support.fault_proxy import FaultProxy, server_error
from tests.support.sidecars import Sidecars

pytestmark = pytest.mark.timeout(120)
RUNNING = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "ready": False}
FAST = SourceSettings(
    http=HttpSettings(connect_timeout=1.0, stall_timeout=1.0),
    retry=RetryPolicy(attempts=2, initial_backoff=0.01, max_backoff=0.02, jitter=0.0, deadline=5.0),
)


@pytest.fixture
async def operator(start_operator: Any) -> Any:
    """The operator, asking not-ready pods every 0.3 s."""
    return await start_operator(fleet_interval=0.3)


@pytest.fixture
def sidecar(sidecars: Sidecars, shm_dir: Path) -> Any:
    """A sidecar in this process loading ``source``, which starts a transient failure's next attempt only
    after 30 s (the test is over by then)."""

    def start(source: str) -> Sidecar:
        argv = ["--source", source, "--segment", str(shm_dir / "model.seg"), "--host", "127.0.0.1"]
        settings = dataclasses.replace(parse_settings([*argv, "--port", "0"], environ={}), sources=FAST)
        return sidecars.run(settings, attempts=AttemptPolicy(first_delay=30.0, max_delay=30.0))

    return start


def pod_at(name: str, port: int) -> dict[str, Any]:
    pod = injected_pod(name)
    pod["spec"]["initContainers"][0]["env"] = [{"name": "MODELLOAD_PORT", "value": str(port)}]
    return pod


def pod_events(kube: Any, pod: str) -> list[dict[str, Any]]:
    return [e for e in posted_events(kube) if (e.get("involvedObject") or {}).get("name") == pod]


def degraded(kube: Any) -> dict[str, Any] | None:
    obj = current(kube, MODELLOADS, NAMESPACE, "tiny") or {}
    found = [c for c in (obj.get("status") or {}).get("conditions") or () if c.get("type") == "Degraded"]
    return found[0] if found else None


async def test_a_failed_load_is_told_on_the_pod_and_on_the_modelload(
    kube: Any, operator: Any, api: Any, model_url: str, nginx: Any, sidecar: Any
) -> None:
    await create_modelload(api, "tiny", {"source": model_url})
    await resolved(kube, "tiny")
    failing = sidecar(nginx.url("reasons/missing.safetensors"))
    await wait_for(lambda: failing.tracker.snapshot().phase == "failed", what="the sidecar's failure")
    kubelet = Kubelet(api)
    await kubelet.create(pod_at("web-1", failing.api.port))
    await kubelet.status("web-1", {"phase": "Running", "podIP": "127.0.0.1", **sidecar_status(**RUNNING)})
    events = await wait_for(lambda: pod_events(kube, "web-1"), what="an Event on the pod")
    assert events[0]["reason"] == "LoadFailed" and events[0]["type"] == "Warning"
    assert "missing.safetensors does not exist" in events[0]["message"]
    condition = await wait_for(lambda: degraded(kube), what="the Degraded condition")
    assert (condition["status"], condition["reason"]) == ("True", "LoadFailed")
    assert "web-1: " in condition["message"] and "does not exist" in condition["message"]
    ready = [
        c
        for c in current(kube, MODELLOADS, NAMESPACE, "tiny")["status"]["conditions"]
        if c["type"] == "Ready"
    ]
    assert ready and ready[0]["status"] == "True", "the model itself is still resolved"
    await kubelet.delete("web-1")  # the pod is replaced: nothing reports a failure any more
    condition = await wait_for(
        lambda: (c := degraded(kube)) and c["status"] == "False" and c, what="the condition to clear"
    )
    assert condition["reason"] == "LoadsHealthy"


async def test_a_load_the_sidecar_retries_is_told_as_retrying(
    kube: Any, operator: Any, api: Any, model_url: str, nginx: Any, sidecar: Any
) -> None:
    await create_modelload(api, "tiny", {"source": model_url})
    await resolved(kube, "tiny")
    nginx.put("reasons/outage.safetensors", b"x" * 100)
    with FaultProxy(nginx.port) as proxy:
        proxy.always(server_error())
        retrying = sidecar(proxy.url("reasons/outage.safetensors"))
        await wait_for(lambda: retrying.tracker.snapshot().phase == "retrying", what="a retry of the load")
        kubelet = Kubelet(api)
        await kubelet.create(pod_at("web-2", retrying.api.port))
        await kubelet.status("web-2", {"phase": "Running", "podIP": "127.0.0.1", **sidecar_status(**RUNNING)})
        events = await wait_for(lambda: pod_events(kube, "web-2"), what="an Event on the pod")
    assert events[0]["reason"] == "LoadRetrying"
    assert (
        "load attempt 1 failed" in events[0]["message"]
        and "starts the whole load again" in events[0]["message"]
    )
    condition = await wait_for(lambda: degraded(kube), what="the Degraded condition")
    assert (condition["status"], condition["reason"]) == ("True", "LoadRetrying")


def test_the_condition_names_failed_pods_first_and_counts_the_rest() -> None:
    reasons = [PodReason(f"p{i}", str(i), "retrying", "503") for i in range(3)]
    reasons += [PodReason(f"f{i}", f"u{i}", "failed", "404 not found") for i in range(5)]
    status, reason, message = degraded_condition(reasons)
    assert (status, reason) == ("True", "LoadFailed")
    assert message.startswith("5 of the pods report a failed load: f0: 404 not found")
    assert "(and 2 more)" in message and "p0" not in message
    assert degraded_condition([])[0] == "False"


async def test_the_degraded_condition_keeps_the_conditions_its_stale_view_of_the_modelload_lacks(
    kube: Any, client_configuration: Any
) -> None:
    # The index the poller reads lags behind the ModelLoad: Ready and PodsScheduled were written since. A
    # merge patch replaces the conditions list whole, so Degraded is written from a fresh read.
    from modelload.operator.kube import Kube
    from modelload.operator.load_reasons import LoadReasons

    written = [
        {"type": "Ready", "status": "True", "reason": "Resolved", "message": "ok"},
        {"type": "PodsScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"},
    ]
    kube.objects[MODELLOADS, NAMESPACE, "tiny"] = {
        **modelload("tiny", {"source": "http://models.example/m.safetensors"}),
        "status": {"conditions": written},
    }
    reasons = LoadReasons(Kube(client_configuration), interval=60)
    failed = [PodReason("web-1", "u1", "failed", "404 not found")]
    await reasons._write((NAMESPACE, "tiny"), "tiny", [], failed)
    conditions = current(kube, MODELLOADS, NAMESPACE, "tiny")["status"]["conditions"]
    assert [c["type"] for c in conditions] == ["Ready", "PodsScheduled", "Degraded"]
    assert conditions[:2] == written
    assert (conditions[2]["status"], conditions[2]["reason"]) == ("True", "LoadFailed")


async def test_what_was_told_of_pods_that_left_is_forgotten_so_pod_churn_grows_no_memory() -> None:
    from modelload.operator.load_reasons import LoadReasons
    from modelload.operator.pods import PodLoad

    reasons = LoadReasons(None, interval=60)  # type: ignore[arg-type] # no ModelLoad: no API call
    reasons._told.update({f"uid-{i}": ("failed", "404 not found") for i in range(1000)})  # pods gone since
    staying = dataclasses.replace(PodLoad("ready"), uid="uid-7")
    await reasons.poll({}, {(NAMESPACE, "tiny"): [staying]})
    assert set(reasons._told) == {"uid-7"}
