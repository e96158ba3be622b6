"""The chart's opt-in PodMonitors and the operator's metrics port, rendered with helm-python-sdk.

The PodMonitors must point at ports that exist: the operator container's ``metrics`` port, and the port the
webhook declares on every sidecar it injects (the name is taken from the injection code, not repeated here).
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from modelload.operator.injection import METRICS_PORT_NAME
from modelload.operator.settings import from_args
from tests.chart.test_chart import CHART, NAMESPACE, one, render

MONITORED = {"metrics": {"podMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}}


def monitors(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in render(values) if d["kind"] == "PodMonitor"}


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_no_podmonitor_unless_asked_for() -> None:
    assert monitors({}) == {}


def test_the_operator_exposes_its_metrics_port_and_the_setting_that_opens_it() -> None:
    container = operator_container(render({}))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"] if "value" in e}
    assert ports["metrics"] == from_args(None, env).metrics_port == 9090
    off = operator_container(render({"metrics": {"port": 0}}))
    assert "metrics" not in {p["name"] for p in off["ports"]}


def test_podmonitors_scrape_the_operator_and_every_injected_sidecar() -> None:
    found = monitors(MONITORED)
    operator, sidecars = found["modelload-operator"], found["modelload-sidecars"]
    for monitor in (operator, sidecars):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == NAMESPACE
        assert monitor["metadata"]["labels"]["release"] == "prometheus"
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["interval"] == "30s"
    assert sidecars["spec"]["podMetricsEndpoints"][0]["port"] == METRICS_PORT_NAME
    assert sidecars["spec"]["selector"] == {
        "matchExpressions": [{"key": "modelload.dev/model", "operator": "Exists"}]
    }
    assert sidecars["spec"]["namespaceSelector"] == {"any": True}
    deployment = one(render(MONITORED), "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert operator["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_watched_namespaces_limit_the_sidecar_podmonitor() -> None:
    values = {**MONITORED, "watchNamespaces": ["serving", "research"]}
    sidecars = monitors(values)["modelload-sidecars"]
    assert sidecars["spec"]["namespaceSelector"] == {"matchNames": ["serving", "research"]}


def test_the_chart_with_podmonitors_lints_clean() -> None:
    report = helm.lint(str(CHART), MONITORED, strict=True, kube_version="v1.31.0", namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 1] == []


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"metrics": {"podMonitor": {"enabled": "yes"}}}, "enabled"),
        ({"metrics": {"port": 70000}}, "port"),
        ({"metrics": {"podMonitor": {"interval": "often"}}}, "interval"),
        ({"logFormat": "yaml"}, "logFormat"),
        ({"sidecar": {"segmentGroup": -1}}, "segmentGroup"),
    ],
)
def test_the_values_schema_refuses_bad_monitoring_values(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(str(CHART)) as chart, pytest.raises(helm.HelmValuesError, match=message):
        chart.validate_schema(values)
