"""Pods that no node can take (too few free huge pages) show on the ModelLoad: a count and a condition.

The pods are created and their status moved through the emulated API server, as the scheduler writes
``PodScheduled`` (False, ``Unschedulable``, its message) on a pod it cannot place; the operator sees them
through its watch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelload.operator.scheduling import verdict
from tests.operator.conftest import MODELLOADS, NAMESPACE, create_modelload, current, resolved, wait_for
from tests.operator.test_pod_status import Kubelet, injected_pod, pods_become

NO_HUGE_PAGES = "0/3 nodes are available: 3 Insufficient hugepages-2Mi. preemption: 0/3 nodes are available."


def huge_pod(name: str) -> dict[str, Any]:
    pod = injected_pod(name)
    pages = {"hugepages-2Mi": "1030Mi", "memory": "600Mi"}
    pod["spec"]["initContainers"][0]["resources"] = {"requests": dict(pages), "limits": dict(pages)}
    return pod


def unschedulable(message: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
        ],
    }


def scheduled_condition(kube: Any) -> dict[str, Any] | None:
    obj = current(kube, MODELLOADS, NAMESPACE, "tiny") or {}
    for condition in (obj.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "PodsScheduled":
            return dict(condition)
    return None


@pytest.fixture
async def model(kube: Any, operator: Any, model_file: Path, api: Any) -> dict[str, Any]:
    await create_modelload(api, "tiny", {"source": f"file://{model_file}", "memory": {"hugePages": "2Mi"}})
    return await resolved(kube, "tiny")


async def test_pods_stuck_for_want_of_huge_pages_give_a_condition_that_says_what_to_do(
    kube, model, api
) -> None:
    kubelet = Kubelet(api)
    await kubelet.create(huge_pod("a"))
    await kubelet.create(huge_pod("b"))
    await pods_become(kube, {"injected": 2})
    assert scheduled_condition(kube) is None, "nothing to say while the scheduler has not spoken"
    await kubelet.status("a", unschedulable(NO_HUGE_PAGES))
    await kubelet.status("b", unschedulable(NO_HUGE_PAGES))
    await pods_become(kube, {"injected": 2, "unschedulable": 2})
    condition = await wait_for(
        lambda: (c := scheduled_condition(kube)) is not None and c["status"] == "False" and c,
        what="the PodsScheduled condition",
    )
    assert condition["reason"] == "InsufficientHugePages"
    message = condition["message"]
    assert message.startswith("2 injected pods cannot be scheduled: 0/3 nodes are available")
    assert "hugepages-2Mi: 1030Mi" in message and "vm.nr_hugepages" in message and "allocatable" in message
    ready = [
        c
        for c in current(kube, MODELLOADS, NAMESPACE, "tiny")["status"]["conditions"]
        if c["type"] == "Ready"
    ]
    assert ready and ready[0]["status"] == "True", "the Ready condition is kept beside it"

    placed = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    await kubelet.status("a", placed)
    await kubelet.status("b", placed)
    await pods_become(kube, {"injected": 2, "unschedulable": 0})
    condition = await wait_for(
        lambda: (c := scheduled_condition(kube)) is not None and c["status"] == "True" and c,
        what="the PodsScheduled condition to clear",
    )
    assert condition["reason"] == "Scheduled"


def test_another_reason_is_reported_as_the_scheduler_gives_it() -> None:
    said = verdict([("0/2 nodes are available: 2 node(s) had untolerated taint.", None)], existing=None)
    assert said is not None and said.reason == "Unschedulable" and "untolerated taint" in said.message
    assert verdict([(None, None)], existing=None) is None, "no condition while every pod is placed"
