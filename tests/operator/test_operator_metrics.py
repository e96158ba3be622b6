"""The operator's own /metrics: admissions, refusals by reason and resolve latency, scraped from a running
operator (kopf and the webhook against the emulated API server), as Prometheus would."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import httpx
import kopf
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelload.loader.errors import ConfigError
from modelload.operator.app import running
from modelload.operator.settings import from_args
from tests.operator.conftest import NAMESPACE, create_modelload, operator_settings, resolved
from tests.operator.test_webhook import admit, pod, review
from tests.support.ports import free_port


async def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    response.raise_for_status()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_the_operator_counts_what_it_admits_refuses_and_resolves(
    kube: Any, client_configuration: Any, api: Any, model_url: str, tmp_path: Path
) -> None:
    port = free_port()
    settings = dataclasses.replace(operator_settings(tmp_path), metrics_port=port)

    def login(**_: Any) -> Any:
        return kopf.ConnectionInfo(server=str(kube.url), insecure=True, default_namespace=NAMESPACE)

    async with contextlib.AsyncExitStack() as stack:
        operator = await stack.enter_async_context(
            running(settings, configuration=client_configuration, login=login, liveness=False)
        )
        before = await scrape(port)
        await create_modelload(api, "tiny", {"source": model_url})
        await resolved(kube, "tiny")
        assert (await admit(operator, operator.ca_pem, review(pod())))["response"]["allowed"] is True
        missing = await admit(operator, operator.ca_pem, review(pod("nothing-here", name="server-2")))
        assert missing["response"]["allowed"] is False
        clash = pod(name="server-3")
        clash["spec"]["containers"].append({"name": "modelload", "image": "theirs:1"})
        assert (await admit(operator, operator.ca_pem, review(clash)))["response"]["allowed"] is False
        unlabelled = pod(name="server-4")
        del unlabelled["metadata"]["labels"]["modelload.dev/model"]
        assert (await admit(operator, operator.ca_pem, review(unlabelled)))["response"]["allowed"] is True
        after = await scrape(port)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    admissions = "modelload_operator_admissions_total"
    refusals = "modelload_operator_refusals_total"
    assert grew(admissions, result="injected") == 1
    assert grew(admissions, result="refused") == 2
    assert grew(admissions, result="unchanged") == 1
    assert grew(refusals, reason="model_not_found") == 1
    assert grew(refusals, reason="bad_pod") == 1
    assert grew(refusals, reason="internal") == 0
    assert grew("modelload_operator_admission_seconds_count") == 4
    assert grew("modelload_operator_resolve_seconds_count", outcome="resolved") >= 1
    assert value(after, "modelload_operator_resolve_seconds_sum", outcome="resolved") > 0
    # Every refusal reason is exported from the start, so a rate() has a series before the first refusal.
    for reason in ("model_not_ready", "bad_spec", "api_unavailable"):
        assert (refusals, (("reason", reason),)) in after


def test_metrics_port_log_format_and_segment_group_come_from_the_environment() -> None:
    environ = {
        "MODELLOAD_OPERATOR_METRICS_PORT": "9090",
        "MODELLOAD_OPERATOR_LOG_FORMAT": "json",
        "MODELLOAD_OPERATOR_SEGMENT_GROUP": "0",
    }
    settings = from_args(None, environ)
    assert (settings.metrics_port, settings.log_format, settings.sidecar.segment_group) == (9090, "json", 0)
    defaults = from_args(None, {})
    assert (defaults.metrics_port, defaults.log_format, defaults.sidecar.segment_group) == (0, "text", 8479)


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("MODELLOAD_OPERATOR_LOG_FORMAT", "yaml", "'yaml' is not one of text, json"),
        ("MODELLOAD_OPERATOR_METRICS_PORT", "70000", "not a port number"),
        ("MODELLOAD_OPERATOR_SEGMENT_GROUP", "-1", "not a group id"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_wrong(variable: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=f"^{variable}: .*{words}"):
        from_args(None, {variable: value})
