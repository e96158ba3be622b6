"""End to end on a real cluster: install the chart, apply a ModelLoad and a workload, see the pod attach.

Opt-in: runs only with ``-m e2e`` semantics satisfied by ``KUBECONFIG`` pointing to a cluster (kind works;
docs/operator.md has the steps). The images must be pullable by the cluster or loaded into it:

- ``MODELLOAD_E2E_OPERATOR_IMAGE`` (default ``ghcr.io/modelload/operator:0.1.0``)
- ``MODELLOAD_E2E_SIDECAR_IMAGE`` (default ``ghcr.io/modelload/sidecar:0.1.0``)

The model is a small safetensors file served inside the cluster by a pod running the sidecar image (it has
Python): a throwaway HTTP server with Range support, so nothing outside the cluster is needed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not os.environ.get("KUBECONFIG"), reason="end-to-end tests need KUBECONFIG to name a cluster"
    ),
    pytest.mark.timeout(900),
]

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "modelload"
SYSTEM = "modelload-system"
NAMESPACE = "modelload-e2e"
OPERATOR_IMAGE = os.environ.get("MODELLOAD_E2E_OPERATOR_IMAGE", "ghcr.io/modelload/operator:0.1.0")
SIDECAR_IMAGE = os.environ.get("MODELLOAD_E2E_SIDECAR_IMAGE", "ghcr.io/modelload/sidecar:0.1.0")

MODEL_SERVER = r"""
import http.server, json, os, struct

# A safetensors file: three float32 tensors of 256x256 (768 KiB), written by hand.
names = [f"layers.{i}.weight" for i in range(3)]
size = 256 * 256 * 4
header = {
    name: {"dtype": "F32", "shape": [256, 256], "data_offsets": [i * size, (i + 1) * size]}
    for i, name in enumerate(names)
}
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
DATA = struct.pack("<Q", len(text)) + text + b"".join(bytes([i + 1]) * size for i in range(3))
ETAG = '"e2e-model-1"'

class Handler(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(DATA)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", ETAG)
        self.end_headers()

    def do_GET(self):
        spec = self.headers.get("Range", "")
        if not spec.startswith("bytes="):
            self.do_HEAD()
            self.wfile.write(DATA)
            return
        first, _, last = spec[6:].partition("-")
        first, last = int(first), min(int(last or len(DATA) - 1), len(DATA) - 1)
        body = DATA[first:last + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {first}-{last}/{len(DATA)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", ETAG)
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer(("0.0.0.0", 8080), Handler).serve_forever()
"""

APP = r"""
import time
from modelload.loader import attach
start = time.monotonic()
model = attach(timeout=600)
model.wait()
print(f"attached {len(model)} tensors, {model.nbytes} bytes, in {time.monotonic() - start:.1f} s", flush=True)
open("/tmp/attached", "w").close()
while True:
    time.sleep(3600)
"""


def _image(ref: str) -> dict[str, str]:
    repository, _, tag = ref.rpartition(":")
    return {"repository": repository, "tag": tag}


def wait_until(what: str, check: Callable[[], Any], timeout: float = 300.0, every: float = 2.0) -> Any:
    """The shared wait (tests/support/waiting.py) at a cluster's pace: minutes, looking every 2 s."""
    return wait_for(check, timeout=timeout, what=what, interval=every)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from kubernetes import client, config

    try:
        config.load_kube_config()
        api = client.ApiClient()
        client.VersionApi(api).get_code()
    except Exception as exc:  # any failure means there is no cluster to test against
        pytest.skip(f"KUBECONFIG names no reachable cluster: {type(exc).__name__}")
    yield api
    api.close()


@pytest.fixture(scope="module")
def installed(cluster: Any) -> Iterator[None]:
    import helm_python as helm

    values = {
        "image": {**_image(OPERATOR_IMAGE), "pullPolicy": "IfNotPresent"},
        "sidecar": {"image": _image(SIDECAR_IMAGE), "pullPolicy": "IfNotPresent"},
        "logLevel": "DEBUG",
    }
    with helm.Config(namespace=SYSTEM) as helm_config:
        helm_config.install(
            str(ROOT / "charts" / "modelload"),
            RELEASE,
            values,
            namespace=SYSTEM,
            create_namespace=True,
            wait="watcher",
            timeout=300,
        )
        try:
            yield
        finally:
            helm_config.uninstall(RELEASE, ignore_not_found=True, wait="watcher", timeout=300)


@pytest.fixture(scope="module")
def model_server(cluster: Any, installed: None) -> Iterator[str]:
    from kubernetes import client

    core, apps = client.CoreV1Api(cluster), client.AppsV1Api(cluster)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    labels = {"app": "model-server"}
    core.create_namespaced_config_map(
        NAMESPACE, {"metadata": {"name": "model-server"}, "data": {"serve.py": MODEL_SERVER}}
    )
    apps.create_namespaced_deployment(
        NAMESPACE,
        {
            "metadata": {"name": "model-server"},
            "spec": {
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "server",
                                "image": SIDECAR_IMAGE,
                                "imagePullPolicy": "IfNotPresent",
                                "command": ["python", "/srv/serve.py"],
                                "ports": [{"containerPort": 8080}],
                                "volumeMounts": [{"name": "script", "mountPath": "/srv"}],
                                "readinessProbe": {"tcpSocket": {"port": 8080}},
                            }
                        ],
                        "volumes": [{"name": "script", "configMap": {"name": "model-server"}}],
                    },
                },
            },
        },
    )
    core.create_namespaced_service(
        NAMESPACE,
        {
            "metadata": {"name": "model-server"},
            "spec": {"selector": labels, "ports": [{"port": 80, "targetPort": 8080}]},
        },
    )
    wait_until(
        "the model server",
        lambda: (apps.read_namespaced_deployment("model-server", NAMESPACE).status.ready_replicas or 0) >= 1,
    )
    try:
        yield f"http://model-server.{NAMESPACE}.svc/tiny.safetensors"
    finally:
        core.delete_namespace(NAMESPACE)


def test_a_labelled_deployment_gets_the_sidecar_and_its_pod_attaches_to_the_model(
    cluster: Any, model_server: str
) -> None:
    from kubernetes import client

    custom, core, apps = (
        client.CustomObjectsApi(cluster),
        client.CoreV1Api(cluster),
        client.AppsV1Api(cluster),
    )
    custom.create_namespaced_custom_object(
        "modelload.dev",
        "v1alpha1",
        NAMESPACE,
        "modelloads",
        {
            "apiVersion": "modelload.dev/v1alpha1",
            "kind": "ModelLoad",
            "metadata": {"name": "tiny"},
            "spec": {"source": model_server},
        },
    )

    def modelload() -> dict[str, Any]:
        return custom.get_namespaced_custom_object(
            "modelload.dev", "v1alpha1", NAMESPACE, "modelloads", "tiny"
        )  # type: ignore[no-any-return]

    status = wait_until(
        "the ModelLoad to be Ready",
        lambda: (modelload().get("status") or {}).get("phase") == "Ready" and modelload()["status"],
    )
    assert status["tensors"] == 3
    assert status["format"] == "safetensors"

    labels = {"app": "e2e-server", "modelload.dev/model": "tiny"}
    apps.create_namespaced_deployment(
        NAMESPACE,
        {
            "metadata": {"name": "e2e-server"},
            "spec": {
                "selector": {"matchLabels": {"app": "e2e-server"}},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "server",
                                "image": SIDECAR_IMAGE,
                                "imagePullPolicy": "IfNotPresent",
                                "command": ["python", "-c", APP],
                                "readinessProbe": {"exec": {"command": ["test", "-e", "/tmp/attached"]}},
                                "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
                            }
                        ],
                        "volumes": [{"name": "tmp", "emptyDir": {}}],
                    },
                },
            },
        },
    )

    def ready_pod() -> Any:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector="app=e2e-server").items
        return next(
            (
                p
                for p in pods
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            ),
            None,
        )

    pod = wait_until("the injected pod to be Ready", ready_pod)
    sidecars = [c for c in (pod.spec.init_containers or []) + pod.spec.containers if c.name == "modelload"]
    assert len(sidecars) == 1
    version = client.VersionApi(cluster).get_code()
    if (int(version.major), int("".join(ch for ch in version.minor if ch.isdigit()))) >= (1, 29):
        assert sidecars[0] in (pod.spec.init_containers or []) and sidecars[0].restart_policy == "Always"
    assert any(v.name == "modelload" and v.empty_dir.medium == "Memory" for v in pod.spec.volumes)
    logs = core.read_namespaced_pod_log(pod.metadata.name, NAMESPACE, container="server")
    assert "attached 3 tensors" in logs
    wait_until(
        "status.pods.ready", lambda: ((modelload().get("status") or {}).get("pods") or {}).get("ready") == 1
    )


def test_a_pod_asking_for_a_missing_model_is_refused_by_the_api_server(
    cluster: Any, model_server: str
) -> None:
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    pod = {
        "metadata": {"name": "orphan", "labels": {"modelload.dev/model": "no-such-model"}},
        "spec": {"containers": [{"name": "c", "image": SIDECAR_IMAGE, "command": ["sleep", "60"]}]},
    }
    with pytest.raises(ApiException) as refused:
        client.CoreV1Api(cluster).create_namespaced_pod(NAMESPACE, pod)
    assert refused.value.status == 403
    assert "does not exist" in str(refused.value.body)
