"""The operator under test: the real kopf handlers and webhook server against KMock's Kubernetes emulator.

kopf, the webhook's aiohttp server and KMock share the test's event loop (a kopf runner in a thread would
block the loop that serves KMock). The emulator serves real HTTP: kopf watches and patches through it, the
operator's own client (``kubernetes``) reads Secrets and patches status through it, and tests change pods'
status through it as the kubelet would.

Models live in moto's S3 server (``tests/support``), created with the real safetensors package.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures import hub, moto_s3, nginx, token_registry  # noqa: F401 - fixtures
from tests.support.sidecars import sidecars  # noqa: F401 - fixture
from tests.support.waiting import wait_for_async

NAMESPACE = "serving"
OPERATOR_NAMESPACE = "modelload-system"
MODELLOADS = "modelload.dev/v1alpha1/modelloads"
MWC = "admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"
MWC_NAME = "modelload"
LOOPBACK = "127.0.0.0/8,::1/128"
"""The networks the tests' operator may read sources from: its test servers, on loopback. An operator with the
chart's defaults refuses them (tests/operator/test_source_reads.py)."""


def model_bytes(tensors: int = 3, rows: int = 64) -> bytes:
    """A small safetensors file written by the real safetensors package."""
    import numpy as np
    from safetensors.numpy import save

    arrays = {f"layers.{i}.weight": np.full((rows, 16), i, dtype=np.float32) for i in range(tensors)}
    return save(arrays)


@pytest.fixture
def no_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """botocore's chain finds nothing: credentials can only come from the ModelLoad's Secret."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "missing"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "missing"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def seeded(obj: dict[str, Any]) -> dict[str, Any]:
    """An object as KMock must hold it: kopf's patches test metadata.resourceVersion, KMock never sets it."""
    obj.setdefault("metadata", {}).setdefault("resourceVersion", "1")
    return obj


def modelload(name: str, spec: dict[str, Any], *, namespace: str = NAMESPACE) -> dict[str, Any]:
    return seeded(
        {
            "apiVersion": "modelload.dev/v1alpha1",
            "kind": "ModelLoad",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
    )


def secret(name: str, data: dict[str, bytes], *, namespace: str = NAMESPACE) -> dict[str, Any]:
    import base64

    return seeded(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
    )


def webhook_configuration() -> dict[str, Any]:
    """The chart's MutatingWebhookConfiguration as the API server holds it before the operator starts."""
    return seeded(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": MWC_NAME},
            "webhooks": [
                {
                    "name": "pods.modelload.dev",
                    "clientConfig": {
                        "service": {
                            "name": "modelload-webhook",
                            "namespace": OPERATOR_NAMESPACE,
                            "path": "/mutate-pods",
                            "port": 443,
                        }
                    },
                }
            ],
        }
    )


async def wait_for(
    predicate: Callable[[], Any | Awaitable[Any]], *, timeout: float = 10.0, what: str = "a condition"
) -> Any:
    """The shared wait (:func:`tests.support.waiting.wait_for_async`) on the operator's event loop, with
    this area's default deadline."""
    return await wait_for_async(predicate, timeout=timeout, what=what, interval=0.05)


def handled(caplog: pytest.LogCaptureFixture, handler: str, name: str) -> int:
    """How many times kopf has run ``handler`` for the object called ``name``: kopf logs each success at
    INFO with the object's reference, so a test can wait for the operator to have seen an event (the test
    sets ``caplog.set_level(logging.INFO, logger="kopf")``)."""
    done = f"Handler {handler!r} succeeded."
    return sum(
        1
        for r in caplog.records
        if r.getMessage() == done and (getattr(r, "k8s_ref", None) or {}).get("name") == name
    )


def current(kmock: Any, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
    """The object as KMock holds it now, or None (``in`` on KMock's array does not parse string keys)."""
    try:
        obj = kmock.objects[resource, namespace, name]
    except KeyError:
        return None
    return None if obj.deleted else dict(obj.raw)


@pytest.fixture
def kube(kmock: Any) -> Any:
    """KMock declared like a cluster with the CRD installed, reporting Kubernetes 1.31."""
    with warnings.catch_warnings():  # kmock 0.8 reads its bundled resources with a deprecated importlib call
        warnings.simplefilter("ignore", DeprecationWarning)
        kmock.resources.load_bundled()
    kmock.resources[MODELLOADS] = {
        "kind": "ModelLoad",
        "singular": "modelload",
        "namespaced": True,
        "verbs": ["get", "list", "watch", "patch", "create", "delete", "update"],
        "subresources": ["status"],
        "shortnames": ["ml"],
    }
    # The official client asks /version/ (with the slash); KMock only answers /version by itself.
    kmock["get /version/"] << {"major": "1", "minor": "31", "gitVersion": "v1.31.2"}
    kmock.objects[MWC, None, MWC_NAME] = webhook_configuration()
    return kmock


@pytest.fixture
def client_configuration(kube: Any) -> Any:
    from kubernetes import client

    return client.Configuration(host=str(kube.url).rstrip("/"))


@pytest.fixture
def api(client_configuration: Any) -> Iterator[Any]:
    """The official client, as a test's stand-in for kubectl and the kubelet."""
    from kubernetes import client

    with client.ApiClient(client_configuration) as api_client:
        yield api_client


def operator_settings(
    tmp_path: Path, *, source_networks: Any = None, fleet_interval: float = 20.0, **sidecar: Any
) -> Any:
    from modelload.operator.settings import InjectedSidecar, OperatorSettings, RetrySettings, WebhookSettings
    from modelload.sidecar.sources import parse_networks

    return OperatorSettings(
        namespace=OPERATOR_NAMESPACE,
        # the test servers listen on loopback only: allowed here, refused by the chart's defaults
        source_networks=parse_networks(LOOPBACK) if source_networks is None else source_networks,
        fleet_interval=fleet_interval,
        retry=RetrySettings(first_delay=0.2, max_delay=1.0),  # a fixed spec is noticed within a second
        webhook=WebhookSettings(host="127.0.0.1", port=0, cert_dir=tmp_path / "certs"),
        sidecar=InjectedSidecar(image="registry.test/modelload-sidecar:1", **sidecar),
    )


@pytest.fixture
async def start_operator(
    kube: Any, client_configuration: Any, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start the operator (kopf and the webhook) in this loop; it stops before KMock does."""
    import kopf

    from modelload.operator.app import running

    def login(**_: Any) -> Any:
        return kopf.ConnectionInfo(server=str(kube.url), insecure=True, default_namespace=NAMESPACE)

    async with contextlib.AsyncExitStack() as stack:

        async def start(**options: Any) -> Any:
            """``options``: :func:`operator_settings`' keywords (the sidecar's settings among them)."""
            settings = operator_settings(tmp_path, **options)
            return await stack.enter_async_context(
                running(settings, configuration=client_configuration, login=login, liveness=False)
            )

        yield start


@pytest.fixture
async def operator(start_operator: Callable[..., Awaitable[Any]]) -> Any:
    return await start_operator()


@pytest.fixture
def model_url(request: pytest.FixtureRequest) -> str:
    """A safetensors model served by nginx on loopback (which the tests' operator is allowed to read)."""
    server = request.getfixturevalue("nginx")
    return str(server.put(f"operator/{uuid.uuid4().hex}/tiny.safetensors", model_bytes(tensors=4, rows=32)))


async def resolved(kube: Any, name: str, *, timeout: float = 15.0) -> dict[str, Any]:
    """The ModelLoad once the operator has read its index (status.bytes set)."""
    return await wait_for(
        lambda: (
            (obj := current(kube, MODELLOADS, NAMESPACE, name))
            and (obj.get("status") or {}).get("bytes")
            and obj
        ),
        timeout=timeout,
        what=f"ModelLoad {name} to be resolved",
    )


def posted_events(kube: Any) -> list[dict[str, Any]]:
    """Every Event the operator posted (KMock keeps only the first under generateName; its log has all)."""
    return [
        r.data
        for r in list(kube)
        if str(r.method).upper().endswith("POST") and r.url.path.endswith("/events")
    ]


def request_bodies(kube: Any) -> str:
    """Everything every client sent to the emulated API server, as text."""
    return "\n".join(r.text or r.body.decode("utf-8", "replace") for r in list(kube))


async def create_modelload(
    api: Any,
    name: str,
    spec: dict[str, Any],
    *,
    created: str | None = None,
    generation: int | None = None,
    uid: str | None = None,
) -> None:
    """POST a ModelLoad through the API, so watchers see it (writing into KMock's store emits nothing).
    ``created``, ``generation`` and ``uid``: its creationTimestamp, generation and uid, which the API
    server sets and KMock does not."""
    from kubernetes import client

    body = modelload(name, spec)
    for field, value in (("creationTimestamp", created), ("generation", generation), ("uid", uid)):
        if value is not None:
            body["metadata"][field] = value
    await asyncio.to_thread(
        client.CustomObjectsApi(api).create_namespaced_custom_object,
        "modelload.dev",
        "v1alpha1",
        NAMESPACE,
        "modelloads",
        body,
        _preload_content=False,
    )


async def delete_modelload(api: Any, name: str) -> None:
    """DELETE a ModelLoad through the API, as kubectl would."""
    from kubernetes import client

    await asyncio.to_thread(
        client.CustomObjectsApi(api).delete_namespaced_custom_object,
        "modelload.dev",
        "v1alpha1",
        NAMESPACE,
        "modelloads",
        name,
        _preload_content=False,
    )


async def patch_modelload(api: Any, name: str, body: dict[str, Any]) -> None:
    """Merge-patch a ModelLoad through the API, as ``kubectl patch --type merge`` would."""
    from kubernetes import client

    await asyncio.to_thread(
        client.CustomObjectsApi(api).patch_namespaced_custom_object,
        "modelload.dev",
        "v1alpha1",
        NAMESPACE,
        "modelloads",
        name,
        body,
        _content_type="application/merge-patch+json",
    )
