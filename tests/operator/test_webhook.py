"""The pod webhook over HTTPS: the operator's own TLS, the patch it answers with, and the pods it refuses.

AdmissionReviews are sent as the API server sends them: POSTed over TLS to the running operator, trusting
only the CA the operator patched into the MutatingWebhookConfiguration.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
import uuid
from pathlib import Path
from typing import Any

import httpx
import jsonpatch
import kubernetes_validate
import pytest

from modelload.operator.app import native_sidecars
from tests.operator.conftest import (
    MODELLOADS,
    MWC,
    MWC_NAME,
    NAMESPACE,
    OPERATOR_NAMESPACE,
    create_modelload,
    current,
    resolved,
)


def pod(label: str = "tiny", *, name: str = "server-1") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"app": "server", "modelload.dev/model": label},
        },
        "spec": {"containers": [{"name": "server", "image": "vllm:1", "ports": [{"containerPort": 8000}]}]},
    }


def review(obj: dict[str, Any], *, operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": NAMESPACE,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": obj,
            "dryRun": False,
        },
    }


def trusting(ca_pem: bytes) -> ssl.SSLContext:
    """Trust only the operator's CA. The certificate names the Service, not 127.0.0.1: the chain is checked,
    the host name is checked separately (tests/operator/test_tls.py)."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.check_hostname = False
    return context


async def admit(operator: Any, ca_pem: bytes, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(verify=trusting(ca_pem), timeout=10) as client:
        response = await client.post(f"https://127.0.0.1:{operator.webhook_port}/mutate-pods", json=body)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    assert answer["response"]["uid"] == body["request"]["uid"]
    return answer


def ca_bundle(kube: Any) -> bytes:
    mwc = current(kube, MWC, None, MWC_NAME)
    assert mwc is not None
    return base64.b64decode(mwc["webhooks"][0]["clientConfig"]["caBundle"])


@pytest.fixture
async def ready_model(kube: Any, model_url: str, api: Any) -> dict[str, Any]:
    await create_modelload(api, "tiny", {"source": model_url})
    return await resolved(kube, "tiny")


async def test_the_operator_patches_its_ca_into_the_webhook_configuration_and_serves_with_it(
    kube, operator
) -> None:
    ca = ca_bundle(kube)
    assert ca == operator.ca_pem
    tls = current(kube, "v1/secrets", OPERATOR_NAMESPACE, "modelload-webhook-tls")
    assert tls is not None and base64.b64decode(tls["data"]["ca.crt"]) == ca
    async with httpx.AsyncClient(verify=trusting(ca)) as client:
        assert (await client.get(f"https://127.0.0.1:{operator.webhook_port}/healthz")).status_code == 200
    untrusting = ssl.create_default_context()  # the system's CAs do not know the operator's
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(verify=untrusting) as client:
            await client.get(f"https://127.0.0.1:{operator.webhook_port}/healthz")


@pytest.mark.parametrize("version", ["1.29", "1.33"])
async def test_a_labelled_pod_comes_back_with_a_patch_that_makes_a_valid_injected_pod(
    kube, operator, ready_model, version
) -> None:
    original = pod()
    answer = await admit(operator, operator.ca_pem, review(original))
    response = answer["response"]
    assert response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    ops = jsonpatch.JsonPatch.from_string(base64.b64decode(response["patch"]).decode())
    patched = ops.apply(copy.deepcopy(original))
    kubernetes_validate.validate(patched, version, strict=True)
    assert operator.native  # KMock reports 1.31
    (sidecar,) = patched["spec"]["initContainers"]
    assert sidecar["name"] == "modelload" and sidecar["restartPolicy"] == "Always"
    (volume,) = patched["spec"]["volumes"]
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": ready_model["status"]["volumeSizeLimit"]}
    assert patched["metadata"]["annotations"]["modelload.dev/injected"] == "tiny"


async def test_the_same_pod_sent_twice_is_not_injected_twice(kube, operator, ready_model) -> None:
    first = await admit(operator, operator.ca_pem, review(pod()))
    ops = jsonpatch.JsonPatch.from_string(base64.b64decode(first["response"]["patch"]).decode())
    injected = ops.apply(pod())
    second = await admit(operator, operator.ca_pem, review(injected))
    assert second["response"]["allowed"] is True
    assert "patch" not in second["response"]


async def test_a_pod_asking_for_a_missing_modelload_is_refused_with_a_clear_message(kube, operator) -> None:
    answer = await admit(operator, operator.ca_pem, review(pod("no-such-model")))
    response = answer["response"]
    assert response["allowed"] is False
    assert "patch" not in response
    assert response["status"]["code"] == 403
    message = response["status"]["message"]
    assert "modelload.dev/model=no-such-model" in message
    assert "does not exist in namespace 'serving'" in message


async def test_a_pod_asking_for_a_model_that_is_not_resolved_is_refused(kube, operator, api, nginx) -> None:
    await create_modelload(api, "broken", {"source": nginx.url("nowhere/model.safetensors")})
    await resolved_or_failed(kube, "broken")
    answer = await admit(operator, operator.ca_pem, review(pod("broken")))
    assert answer["response"]["allowed"] is False
    message = answer["response"]["status"]["message"]
    assert "ModelLoad 'broken' is not ready yet" in message
    assert "SourceNotFound" in message


async def resolved_or_failed(kube: Any, name: str) -> dict[str, Any]:
    from tests.operator.conftest import wait_for

    return await wait_for(
        lambda: (
            (obj := current(kube, MODELLOADS, NAMESPACE, name))
            and (obj.get("status") or {}).get("phase")
            and obj
        ),
        what=f"ModelLoad {name} to get a phase",
    )


async def test_a_pod_label_matching_a_podlabelvalue_finds_its_model(kube, operator, model_url, api) -> None:
    await create_modelload(api, "llama-v2", {"source": model_url, "podLabelValue": "llama"})
    await resolved(kube, "llama-v2")
    answer = await admit(operator, operator.ca_pem, review(pod("llama")))
    assert answer["response"]["allowed"] is True and "patch" in answer["response"]
    refused = await admit(operator, operator.ca_pem, review(pod("llama-v2")))
    assert refused["response"]["allowed"] is False  # the name no longer selects pods


async def test_updates_and_unlabelled_pods_pass_untouched(kube, operator) -> None:
    unlabelled = pod()
    del unlabelled["metadata"]["labels"]["modelload.dev/model"]
    for body in (review(unlabelled), review(pod(), operation="UPDATE")):
        answer = await admit(operator, operator.ca_pem, body)
        assert answer["response"] == {"uid": body["request"]["uid"], "allowed": True}


async def test_a_request_that_is_not_an_admission_review_is_a_bad_request(kube, operator) -> None:
    async with httpx.AsyncClient(verify=trusting(operator.ca_pem)) as client:
        response = await client.post(
            f"https://127.0.0.1:{operator.webhook_port}/mutate-pods", json={"hello": 1}
        )
    assert response.status_code == 400


class _Versioned:
    def __init__(self, version: tuple[int, int] | None) -> None:
        self.version = version

    async def server_version(self) -> tuple[int, int]:
        from modelload.operator.kube import KubeUnavailableError

        if self.version is None:
            raise KubeUnavailableError("get /version: HTTP 503")
        return self.version


@pytest.mark.parametrize(
    ("mode", "version", "native"),
    [
        ("auto", (1, 29), True),
        ("auto", (1, 33), True),
        ("auto", (1, 28), False),
        ("auto", None, False),
        ("native", (1, 27), True),
        ("regular", (1, 33), False),
    ],
)
async def test_the_sidecar_mode_follows_the_setting_or_the_api_servers_version(mode, version, native) -> None:
    assert await native_sidecars(_Versioned(version), mode, first_delay=0) is native  # type: ignore[arg-type]


async def test_a_version_read_that_fails_at_start_up_is_tried_again_before_falling_back_to_regular() -> None:
    class Blip(_Versioned):
        """An API server that answers /version after two failures (a restart, a load balancer warming)."""

        failures = 2

        async def server_version(self) -> tuple[int, int]:
            from modelload.operator.kube import KubeUnavailableError

            if self.failures:
                self.failures -= 1
                raise KubeUnavailableError("get /version: HTTP 503")
            return await super().server_version()

    # A fall-back for the process's life: every pod would get a regular sidecar, and Jobs be refused.
    assert await native_sidecars(Blip((1, 31)), "auto", first_delay=0) is True  # type: ignore[arg-type]


async def _lookup_fails(namespace: str, value: str) -> Any:
    from modelload.operator.kube import KubeUnavailableError

    raise KubeUnavailableError("list ModelLoads in serving: HTTP 503 Service Unavailable")


async def _lookup_has_a_bug(namespace: str, value: str) -> Any:
    raise RuntimeError("a bug")


@pytest.mark.parametrize(
    ("lookup", "code", "words"),
    [(_lookup_fails, 503, "cannot look up the model"), (_lookup_has_a_bug, 500, "the pod was not changed")],
)
async def test_a_webhook_that_cannot_decide_refuses_the_pod_with_a_reason(lookup, code, words) -> None:
    from modelload.operator.settings import InjectedSidecar
    from modelload.operator.webhook import PodWebhook

    webhook = PodWebhook(lookup=lookup, sidecar=InjectedSidecar(), native=True)
    body = review(pod())
    answer = await webhook.review(body)
    assert answer["response"]["uid"] == body["request"]["uid"]
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == code
    assert words in answer["response"]["status"]["message"]
    assert "patch" not in answer["response"]


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def silent_api_server() -> Any:
    """An API server that accepts connections and never answers (a half-open connection, a hung server)."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


async def test_an_api_server_that_never_answers_is_a_refusal_with_a_reason_before_the_api_servers_deadline(
    silent_api_server: str,
) -> None:
    import yaml
    from kubernetes import client

    from modelload.operator.kube import REQUEST_TIMEOUT, Kube
    from modelload.operator.settings import InjectedSidecar
    from modelload.operator.webhook import PodWebhook, kube_lookup

    values = yaml.safe_load((ROOT / "charts" / "modelload" / "values.yaml").read_text())
    assert values["webhook"]["timeoutSeconds"] > REQUEST_TIMEOUT, "the API server would give up first"
    kube = Kube(client.Configuration(host=silent_api_server), timeout=0.5)
    try:
        webhook = PodWebhook(lookup=kube_lookup(kube), sidecar=InjectedSidecar(), native=True)
        answer = await asyncio.wait_for(webhook.review(review(pod())), 60)  # hung for good before the fix
    finally:
        await kube.close()
    assert answer["response"]["allowed"] is False
    assert answer["response"]["status"]["code"] == 503
    assert "did not answer" in answer["response"]["status"]["message"]


async def test_of_two_modelloads_answering_to_one_label_the_older_serves_and_the_newer_says_so(
    kube, operator, model_url, nginx, api
) -> None:
    from tests.operator.conftest import delete_modelload, model_bytes
    from tests.operator.test_resolving import failed, ready_condition

    newer_url = str(nginx.put(f"operator/{uuid.uuid4().hex}/v2.safetensors", model_bytes(tensors=2)))
    await create_modelload(api, "llama", {"source": model_url}, created="2026-11-01T10:00:00Z")
    await resolved(kube, "llama")
    spec = {"source": newer_url, "podLabelValue": "llama"}
    await create_modelload(api, "llama-v2", spec, created="2026-11-02T10:00:00Z")
    obj = await failed(kube, "llama-v2", "LabelTaken")
    assert "ModelLoad 'llama'" in ready_condition(obj)["message"]
    assert "spec.podLabelValue" in ready_condition(obj)["message"]

    def source_of(answer: dict[str, Any]) -> str:
        ops = json.loads(base64.b64decode(answer["response"]["patch"]))
        sidecar = next(op["value"][0] for op in ops if op["path"] == "/spec/initContainers")
        return next(e["value"] for e in sidecar["env"] if e["name"] == "MODELLOAD_SOURCE")

    answer = await admit(operator, operator.ca_pem, review(pod("llama")))
    assert answer["response"]["allowed"] is True, answer["response"].get("status")
    assert source_of(answer) == model_url  # the older one's model, as both ModelLoads say

    await delete_modelload(api, "llama")  # the label is free: the newer one is retried and takes it
    await resolved(kube, "llama-v2")
    answer = await admit(operator, operator.ca_pem, review(pod("llama")))
    assert source_of(answer) == newer_url


async def test_a_pod_in_another_namespace_never_gets_a_modelload_of_this_one(
    kube, operator, ready_model
) -> None:
    body = review(pod("tiny"))
    body["request"]["namespace"] = body["request"]["object"]["metadata"]["namespace"] = "other-team"
    answer = await admit(operator, operator.ca_pem, body)
    assert answer["response"]["allowed"] is False and "patch" not in answer["response"]
    assert "does not exist in namespace 'other-team'" in answer["response"]["status"]["message"]


async def test_model_reads_that_hang_do_not_hold_up_the_admission_of_pods_of_ready_models(
    kube, operator, ready_model, api, monkeypatch
) -> None:
    import os
    import threading

    from modelload.operator import resolve as resolving
    from tests.operator.conftest import wait_for

    release = threading.Event()
    hanging: list[str] = []

    def slow_origin(spec: Any, **_: Any) -> Any:  # a tenant's origin that drips its index out
        hanging.append(spec.source)
        release.wait(60)
        raise RuntimeError("released")

    monkeypatch.setattr(resolving, "read_summary", slow_origin)
    threads = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor, which API calls use too
    try:
        for i in range(threads + 2):
            await create_modelload(api, f"slow-{i}", {"source": f"https://slow.example/m{i}.safetensors"})
        await wait_for(lambda: len(hanging) >= 4, what="the slow reads to start")
        answer = await admit(operator, operator.ca_pem, review(pod("tiny")))
    finally:
        release.set()
    assert answer["response"]["allowed"] is True, answer["response"].get("status")
