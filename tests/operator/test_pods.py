"""A pod's own status says whether its model is loading, loaded or failed, and how long the load took."""

from __future__ import annotations

from typing import Any

import pytest

from modelload.operator.pods import PodLoad, aggregate, classify


def injected_pod(*, native: bool = True, phase: str = "Running", **sidecar_status: Any) -> dict[str, Any]:
    sidecar = {"name": "modelload", "image": "sidecar:1"}
    spec: dict[str, Any] = {"containers": [{"name": "server", "image": "vllm:1"}]}
    status: dict[str, Any] = {"phase": phase}
    if native:
        spec["initContainers"] = [{**sidecar, "restartPolicy": "Always"}]
    else:
        spec["containers"].append(sidecar)
    if sidecar_status:
        key = "initContainerStatuses" if native else "containerStatuses"
        status[key] = [{"name": "modelload", **sidecar_status}]
        status["containerStatuses" if native else "initContainerStatuses"] = []
    return {"metadata": {"name": "p", "namespace": "serving"}, "spec": spec, "status": status}


def ready(pod: dict[str, Any], at: str) -> dict[str, Any]:
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True", "lastTransitionTime": at}]
    return pod


RUNNING = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}


@pytest.mark.parametrize("native", [True, False], ids=["native", "regular"])
def test_a_started_sidecar_that_is_not_ready_is_loading(native: bool) -> None:
    assert classify(injected_pod(native=native, state=RUNNING, ready=False)) == PodLoad("loading")


@pytest.mark.parametrize("native", [True, False], ids=["native", "regular"])
def test_a_ready_sidecar_reports_the_time_from_its_start_to_the_pods_ready_transition(native: bool) -> None:
    pod = ready(injected_pod(native=native, state=RUNNING, ready=True), "2026-01-01T00:00:12.5Z")
    assert classify(pod) == PodLoad("ready", load_seconds=12.5, ready_at="2026-01-01T00:00:12.5Z")


def test_a_pod_that_is_not_scheduled_yet_is_pending() -> None:
    assert classify(injected_pod(phase="Pending")) == PodLoad("pending")
    assert classify(injected_pod(state={"waiting": {"reason": "ContainerCreating"}})) == PodLoad("pending")


@pytest.mark.parametrize(
    "state",
    [
        {"waiting": {"reason": "CrashLoopBackOff"}},
        {"waiting": {"reason": "ImagePullBackOff"}},
        {"waiting": {"reason": "CreateContainerConfigError"}},  # e.g. a missing Secret key
        {"terminated": {"exitCode": 1, "reason": "Error"}},
        {"terminated": {"exitCode": 0, "reason": "Completed"}},  # the sidecar must never exit
    ],
)
def test_a_sidecar_that_cannot_run_is_failed(state: dict[str, Any]) -> None:
    assert classify(injected_pod(state=state, ready=False)) == PodLoad("failed")


def test_a_failed_pod_is_failed_and_a_finished_or_terminating_one_is_not_counted() -> None:
    assert classify(injected_pod(phase="Failed")) == PodLoad("failed")
    assert classify(injected_pod(phase="Succeeded")) is None
    terminating = injected_pod(state=RUNNING, ready=True)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    assert classify(terminating) is None


def test_a_labelled_pod_without_the_sidecar_is_not_counted() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "server"}]},
        "status": {"phase": "Running"},
    }
    assert classify(pod) is None


def test_the_sum_counts_states_and_takes_the_latest_and_median_load() -> None:
    loads = [
        PodLoad("ready", load_seconds=10.0, ready_at="2026-01-01T00:00:10Z"),
        PodLoad("ready", load_seconds=30.0, ready_at="2026-01-01T00:05:00Z"),
        PodLoad("ready", load_seconds=14.0, ready_at="2026-01-01T00:01:00Z"),
        PodLoad("loading"),
        PodLoad("pending"),
        PodLoad("failed"),
    ]
    status = aggregate(loads, model_bytes=3_000_000_000)
    assert (status.injected, status.loading, status.ready, status.failed) == (6, 1, 3, 1)
    assert status.last_load_seconds == 30.0
    assert status.median_load_seconds == 14.0
    assert status.last_throughput_bytes_per_second == 100_000_000


def test_the_sum_of_no_pods_is_zeros_without_times() -> None:
    status = aggregate([], model_bytes=None)
    assert (status.injected, status.ready, status.last_load_seconds, status.median_load_seconds) == (
        0,
        0,
        None,
        None,
    )


def test_a_pod_injected_for_an_earlier_generation_of_the_spec_counts_as_outdated() -> None:
    def at(generation: str | None) -> PodLoad:
        pod = injected_pod(state=RUNNING, ready=False)
        if generation is not None:
            pod["metadata"]["annotations"] = {"modelload.dev/generation": generation}
        load = classify(pod)
        assert load is not None
        return load

    loads = [at("1"), at("2"), at("3"), at(None), at("not a number")]
    assert [load.generation for load in loads] == [1, 2, 3, None, None]
    assert aggregate(loads, model_bytes=None, generation=3).outdated == 2
    assert aggregate(loads, model_bytes=None, generation=None).outdated == 0  # nothing to compare with
