"""Pods that asked for a model report their loads into the ModelLoad's status; deleting a ModelLoad is clean.

Pods are created and their status changed through the emulated API server, as a ReplicaSet and the kubelet
would; the operator sees them through its watch.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    create_modelload,
    current,
    delete_modelload,
    handled,
    patch_modelload,
    resolved,
    seeded,
    wait_for,
)

MERGE = "application/merge-patch+json"


def injected_pod(name: str, *, label: str = "tiny", native: bool = True) -> dict[str, Any]:
    sidecar = {"name": "modelload", "image": "sidecar:1"}
    spec: dict[str, Any] = {"containers": [{"name": "server", "image": "vllm:1"}]}
    if native:
        spec["initContainers"] = [{**sidecar, "restartPolicy": "Always"}]
    else:
        spec["containers"].append(sidecar)
    return seeded(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"modelload.dev/model": label}},
            "spec": spec,
            "status": {"phase": "Pending"},
        }
    )


def sidecar_status(*, native: bool = True, **fields: Any) -> dict[str, Any]:
    key = "initContainerStatuses" if native else "containerStatuses"
    return {key: [{"name": "modelload", **fields}]}


class Kubelet:
    """Creates pods and moves their status, through the API like the kubelet does."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)

    async def create(self, pod: dict[str, Any]) -> None:
        await asyncio.to_thread(self.core.create_namespaced_pod, NAMESPACE, pod, _preload_content=False)

    async def status(self, name: str, status: dict[str, Any]) -> None:
        await asyncio.to_thread(
            self.core.patch_namespaced_pod_status,
            name,
            NAMESPACE,
            {"status": status},
            _content_type=MERGE,
            _preload_content=False,
        )

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self.core.delete_namespaced_pod, name, NAMESPACE, _preload_content=False)


def pods_status(kube: Any, name: str = "tiny") -> dict[str, Any]:
    obj = current(kube, MODELLOADS, NAMESPACE, name) or {}
    return dict((obj.get("status") or {}).get("pods") or {})


async def pods_become(kube: Any, expected: dict[str, Any], name: str = "tiny") -> dict[str, Any]:
    def matches() -> dict[str, Any] | None:
        now = pods_status(kube, name)
        return now if all(now.get(k) == v for k, v in expected.items()) else None

    try:
        return await wait_for(matches, what=f"status.pods to include {expected}")
    except AssertionError:
        raise AssertionError(f"status.pods is {pods_status(kube, name)}, expected {expected}") from None


@pytest.fixture
async def model(kube: Any, operator: Any, model_url: str, api: Any) -> dict[str, Any]:
    await create_modelload(api, "tiny", {"source": model_url})
    return await resolved(kube, "tiny")


async def test_pods_moving_through_their_load_update_the_modelloads_status(kube, model, api) -> None:
    kubelet = Kubelet(api)
    await pods_become(kube, {"injected": 0, "ready": 0})
    await kubelet.create(injected_pod("a"))
    await kubelet.create(injected_pod("b", native=False))
    await pods_become(kube, {"injected": 2, "loading": 0, "ready": 0})

    started = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "ready": False}
    await kubelet.status("a", {"phase": "Running", **sidecar_status(**started)})
    await kubelet.status("b", {"phase": "Running", **sidecar_status(native=False, **started)})
    await pods_become(kube, {"injected": 2, "loading": 2, "ready": 0})

    loaded = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "ready": True}
    ready_at = [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:20Z"}]
    await kubelet.status("a", {**sidecar_status(**loaded), "conditions": ready_at})
    status = await pods_become(kube, {"loading": 1, "ready": 1})
    assert status["lastLoadSeconds"] == 20.0
    assert status["medianLoadSeconds"] == 20.0
    assert status["lastThroughputBytesPerSecond"] == model["status"]["bytes"] // 20

    crashed = {"state": {"waiting": {"reason": "CrashLoopBackOff"}}, "ready": False, "restartCount": 3}
    await kubelet.status("b", sidecar_status(native=False, **crashed))
    await pods_become(kube, {"injected": 2, "loading": 0, "ready": 1, "failed": 1})

    await kubelet.delete("b")
    await pods_become(kube, {"injected": 1, "ready": 1, "failed": 0})


async def test_pods_for_another_model_or_without_the_sidecar_are_not_counted(
    kube, model, api, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="kopf")
    kubelet = Kubelet(api)
    await kubelet.create(injected_pod("other", label="other-model"))
    plain = injected_pod("plain")
    plain["spec"].pop("initContainers")
    await kubelet.create(plain)
    await kubelet.create(injected_pod("mine"))
    await pods_become(kube, {"injected": 1})
    await wait_for(
        lambda: all(handled(caplog, "pod_changed", pod) for pod in ("other", "plain", "mine")),
        what="the operator to have seen every pod",
    )
    assert pods_status(kube)["injected"] == 1


async def test_a_modelload_created_after_its_pods_counts_them_at_once(
    kube, operator, api, model_url, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="kopf")
    kubelet = Kubelet(api)
    await kubelet.create(injected_pod("early"))
    await wait_for(lambda: handled(caplog, "pod_changed", "early"), what="the operator to see the pod")
    await create_modelload(api, "tiny", {"source": model_url})
    await resolved(kube, "tiny")
    await pods_become(kube, {"injected": 1})


async def test_deleting_a_modelload_is_immediate_and_later_pod_events_are_harmless(
    kube, model, api, caplog
) -> None:

    obj = current(kube, MODELLOADS, NAMESPACE, "tiny")
    assert obj is not None and not obj["metadata"].get("finalizers")  # nothing for kopf to release
    await delete_modelload(api, "tiny")
    await wait_for(
        lambda: current(kube, MODELLOADS, NAMESPACE, "tiny") is None, what="the ModelLoad to be gone"
    )
    kubelet = Kubelet(api)
    caplog.set_level(logging.INFO, logger="kopf")
    await kubelet.create(injected_pod("orphan"))
    await wait_for(lambda: handled(caplog, "pod_changed", "orphan"), what="the new pod handled")
    await kubelet.status("orphan", {"phase": "Running"})
    await wait_for(lambda: handled(caplog, "pod_changed", "orphan") >= 2, what="its status change handled")
    assert current(kube, MODELLOADS, NAMESPACE, "tiny") is None  # not re-created by a status patch
    errors = [r.getMessage() for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert errors == []
    history = kube.objects[MODELLOADS, NAMESPACE, "tiny"].history
    assert all(not (v or {}).get("metadata", {}).get("finalizers") for v in history if v is not None)


async def test_pods_injected_before_a_spec_change_are_counted_as_outdated(
    kube, operator, model_url, nginx, api
) -> None:

    from tests.operator.conftest import model_bytes

    await create_modelload(api, "tiny", {"source": model_url}, generation=1)
    await resolved(kube, "tiny")
    kubelet = Kubelet(api)
    for name, generation in (("p1", "1"), ("p2", "1")):
        pod = injected_pod(name)
        pod["metadata"]["annotations"] = {"modelload.dev/generation": generation}
        await kubelet.create(pod)
    await pods_become(kube, {"injected": 2, "outdated": 0})

    other = str(nginx.put("operator/outdated/other.safetensors", model_bytes(tensors=2)))
    # the API server bumps the generation itself; KMock does not
    await patch_modelload(api, "tiny", {"metadata": {"generation": 2}, "spec": {"source": other}})
    await wait_for(
        lambda: (
            ((current(kube, MODELLOADS, NAMESPACE, "tiny") or {}).get("status") or {}).get("tensors") == 2
        ),
        what="the new source read",
    )
    await pods_become(kube, {"injected": 2, "outdated": 2})  # they still load the old source
    pod = injected_pod("p3")
    pod["metadata"]["annotations"] = {"modelload.dev/generation": "2"}
    await kubelet.create(pod)
    await pods_become(kube, {"injected": 3, "outdated": 2})
    await kubelet.delete("p1")
    await pods_become(kube, {"injected": 2, "outdated": 1})


async def test_a_failed_write_of_the_pods_figures_fails_neither_the_resolve_nor_the_pod_event_as_a_traceback(
    kube, operator, model_url, api, caplog, monkeypatch
) -> None:
    from modelload.operator.handlers import PodAggregator
    from modelload.operator.kube import KubeUnavailableError

    async def unavailable(*_: Any, **__: Any) -> None:
        raise KubeUnavailableError("patch ModelLoad serving/tiny status: HTTP 503 Service Unavailable")

    monkeypatch.setattr(PodAggregator, "refresh", unavailable)
    caplog.set_level(logging.INFO, logger="kopf")
    await create_modelload(api, "tiny", {"source": model_url})
    await resolved(kube, "tiny")
    # the next pod event writes the figures; the model's read stands, and is not done again in a minute
    await wait_for(lambda: handled(caplog, "resolve", "tiny"), what="the resolve handler to succeed")
    await Kubelet(api).create(injected_pod("p1"))  # a pod event's write fails the same way: a warning
    await wait_for(lambda: handled(caplog, "pod_changed", "p1"), what="the pod event handled")
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert any("cannot write ModelLoad serving/tiny's pod figures" in r.getMessage() for r in caplog.records)
