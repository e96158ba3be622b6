"""``spec.peers``: the operator makes a headless Service and a token Secret per ModelLoad, and the webhook
wires each sidecar to them (DNS name, port, token file): sidecars find each other with no RBAC in the pod."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest

from modelload.operator.injection import build_patch
from modelload.operator.peers import peer_names
from tests.operator.conftest import NAMESPACE, create_modelload, current, resolved, wait_for
from tests.operator.test_injection import SIDECAR, bare_pod, model

pytestmark = pytest.mark.usefixtures("no_aws_env")


def _sidecar(ops: list[dict[str, Any]]) -> dict[str, Any]:
    for op in ops:
        value = op.get("value")
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, dict) and item.get("name") == "modelload" and "image" in item:
                return item
    raise AssertionError(f"no sidecar container in {ops}")


def _volumes(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [v for op in ops if op["path"].startswith("/spec/volumes") for v in op["value"]]


def test_a_sidecar_of_a_peered_model_gets_the_services_name_its_port_and_the_token_file() -> None:
    ops = build_patch(pod=bare_pod(), model=model({"peers": True}), sidecar=SIDECAR, native=True)
    sidecar = _sidecar(ops)
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["MODELLOAD_PEER_DNS"] == "llama-peers.serving.svc"
    assert env["MODELLOAD_PEER_PORT"] == "8480"
    token_file = env["MODELLOAD_PEER_TOKEN_FILE"]
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "modelload-peer-token")
    assert token_file.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    # KNative allows one declared port per pod: the peer port is not declared, the Service targets it anyway.
    assert all(port["containerPort"] != 8480 for port in sidecar.get("ports", []))
    volume = next(v for v in _volumes(ops) if v["name"] == "modelload-peer-token")
    assert volume["secret"]["secretName"] == "llama-peers"


def test_a_model_without_peers_gets_no_peer_wiring() -> None:
    ops = build_patch(pod=bare_pod(), model=model(), sidecar=SIDECAR, native=True)
    sidecar = _sidecar(ops)
    assert not [e for e in sidecar["env"] if e["name"].startswith("MODELLOAD_PEER")]
    assert not [v for v in _volumes(ops) if v["name"] == "modelload-peer-token"]


async def test_the_operator_makes_the_headless_service_and_the_token_secret_once(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    await create_modelload(api, "tiny", {"source": model_url, "peers": True})
    obj = await resolved(kube, "tiny")
    service = await wait_for(
        lambda: current(kube, "v1/services", NAMESPACE, "tiny-peers"), what="the peers' Service"
    )
    secret = current(kube, "v1/secrets", NAMESPACE, "tiny-peers")
    assert secret is not None
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"modelload.dev/model": "tiny"}
    assert service["spec"]["ports"][0]["port"] == 8480
    owner = service["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == (
        "ModelLoad",
        "tiny",
        obj["metadata"].get("uid", ""),
    )  # KMock sets none
    token = base64.b64decode(secret["data"]["token"])
    assert len(token) >= 32
    assert token.decode() not in str(obj.get("status"))


async def test_a_model_without_peers_gets_no_service(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    await create_modelload(api, "plain", {"source": model_url})
    await resolved(kube, "plain")
    assert current(kube, "v1/services", NAMESPACE, "plain-peers") is None
    assert current(kube, "v1/secrets", NAMESPACE, "plain-peers") is None


async def test_the_status_counts_the_pods_whose_sidecars_serve_their_peers(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    from tests.operator.test_pod_status import Kubelet, injected_pod, pods_become, sidecar_status

    await create_modelload(api, "tiny", {"source": model_url, "peers": True})
    await resolved(kube, "tiny")
    kubelet = Kubelet(api)
    for name, peers in (("p1", True), ("p2", True), ("p3", False)):
        pod = injected_pod(name)
        if peers:  # what the webhook wires into a peered model's sidecar
            pod["spec"]["initContainers"][0]["env"] = [
                {"name": "MODELLOAD_PEER_DNS", "value": "tiny-peers.x.svc"}
            ]
        await kubelet.create(pod)
    await pods_become(kube, {"injected": 3, "serving": 0})
    running = {"state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}, "ready": False}
    for name in ("p1", "p2", "p3"):
        await kubelet.status(name, {"phase": "Running", **sidecar_status(**running)})
    await pods_become(kube, {"injected": 3, "loading": 3, "serving": 2})
    await kubelet.status("p2", {"phase": "Failed"})
    await pods_become(kube, {"failed": 1, "serving": 1})


def test_the_knative_example_asks_for_a_model_with_peers_on() -> None:
    import yaml

    from modelload.operator.schema import parse_spec

    examples = Path(__file__).resolve().parents[2] / "manifests" / "examples"
    docs = [d for p in sorted(examples.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    services = [d for d in docs if d["apiVersion"].startswith("serving.knative.dev/")]
    labels = {s["spec"]["template"]["metadata"]["labels"].get("modelload.dev/model") for s in services}
    models = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ModelLoad"}
    assert any(parse_spec(models[label]["spec"]).peers for label in labels if label in models)


def test_the_fleet_figures_the_operator_writes_validate_against_the_crd() -> None:
    import jsonschema

    from modelload.operator import crd
    from modelload.operator.fleet import PodStats, fleet_body, sum_stats

    figures = {"origin_bytes": 7, "peer_bytes": 5, "uploaded_bytes": 5, "mismatches": 0}
    answers = [PodStats("a", figures=figures), PodStats("b", error="unreachable (ClientConnectorError)")]
    body = fleet_body(sum_stats(2, answers), now="2026-01-01T00:00:00Z")
    assert body == {
        "pods": 2,
        "reporting": 1,
        "originBytes": 7,
        "peerBytes": 5,
        "servedBytes": 5,
        "mismatches": 0,
        "updated": "2026-01-01T00:00:00Z",
    }
    version = crd.build_crd()["spec"]["versions"][0]
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    jsonschema.validate({"fleet": body}, status)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"fleet": {**body, "peerBytes": -1}}, status)


DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
"""What the API server requires of a Service's name (a DNS-1035 label, at most 63 characters)."""

MODELLOAD_NAMES = [
    "llama",
    "llama-3.1-8b",  # a dot: a valid ModelLoad name, never a Service's
    "3b-chat",  # a leading digit: a Service's name starts with a letter
    "a" * 58,  # '-peers' takes the name past 63 characters
    "b" * 63 + ".x",
    "c" * 253,
    "m" * 63 + "-one",  # two long names that differ only past the 63rd character
    "m" * 63 + "-two",
    "1.2.3",
]


@pytest.mark.parametrize("name", MODELLOAD_NAMES)
def test_the_peers_service_and_secret_of_any_valid_modelload_name_get_a_name_the_api_server_accepts(
    name: str,
) -> None:
    assert DNS_1035_LABEL.match(peer_names(name)), peer_names(name)


def test_distinct_modelloads_never_share_a_peers_service_or_token() -> None:
    names = {peer_names(n) for n in MODELLOAD_NAMES}
    assert len(names) == len(MODELLOAD_NAMES)
    assert peer_names("llama") == "llama-peers"  # a name that fits keeps the plain form


async def test_a_peered_modelload_with_a_dotted_name_gets_its_service_and_admits_pods(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    await create_modelload(api, "llama-3.1-8b", {"source": model_url, "peers": True})
    await resolved(kube, "llama-3.1-8b")
    service_name = peer_names("llama-3.1-8b")
    assert DNS_1035_LABEL.match(service_name)
    service = await wait_for(
        lambda: current(kube, "v1/services", NAMESPACE, service_name), what="the peers' Service"
    )
    assert service["spec"]["selector"] == {"modelload.dev/model": "llama-3.1-8b"}
    assert current(kube, "v1/secrets", NAMESPACE, service_name) is not None


async def test_a_peers_service_the_api_server_refuses_is_a_condition_not_a_silent_retry(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    from tests.operator.test_resolving import failed

    kube[f"post /api/v1/namespaces/{NAMESPACE}/services"] << 403
    await create_modelload(api, "tiny", {"source": model_url, "peers": True})
    obj = await failed(kube, "tiny", "Forbidden")
    condition = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert "create Service" in condition["message"] and "tiny-peers" in condition["message"]
    assert obj["status"].get("bytes") is None  # pods would mount a token Secret with no Service beside it


async def test_a_peers_secret_that_is_not_this_modelloads_is_a_condition_until_it_goes(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    # A ModelLoad deleted and applied again before the garbage collector took its peers' Secret, or a
    # Secret of the team's own under that name: pods would mount it, and its token (or none) would be theirs.
    from tests.operator.conftest import secret
    from tests.operator.test_resolving import failed, ready_condition

    leftover = secret("tiny-peers", {"token": b"the old one"})
    leftover["metadata"]["ownerReferences"] = [
        {"apiVersion": "modelload.dev/v1alpha1", "kind": "ModelLoad", "name": "tiny", "uid": "old-uid"}
    ]
    kube.objects["v1/secrets", NAMESPACE, "tiny-peers"] = leftover
    body = {"source": model_url, "peers": True}
    await create_modelload(api, "tiny", body, uid="new-uid")
    obj = await failed(kube, "tiny", "PeersSecretTaken")
    assert "tiny-peers" in ready_condition(obj)["message"]
    assert obj["status"].get("bytes") is None  # no pod is admitted to mount it

    del kube.objects["v1/secrets", NAMESPACE, "tiny-peers"]  # collected at last
    await resolved(kube, "tiny")
    made = current(kube, "v1/secrets", NAMESPACE, "tiny-peers")
    assert made is not None and made["metadata"]["ownerReferences"][0]["uid"] == "new-uid"


async def test_the_peers_service_follows_a_changed_pod_label_value(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    # Pods ask for the model by spec.podLabelValue: a Service still selecting the old value would find none
    # of them, and every sidecar would load from the origin alone.
    from tests.operator.conftest import patch_modelload

    await create_modelload(api, "tiny", {"source": model_url, "peers": True, "podLabelValue": "first"})
    await resolved(kube, "tiny")
    service = await wait_for(
        lambda: current(kube, "v1/services", NAMESPACE, "tiny-peers"), what="the peers' Service"
    )
    assert service["spec"]["selector"] == {"modelload.dev/model": "first"}

    await patch_modelload(api, "tiny", {"spec": {"podLabelValue": "second"}})

    def selector() -> Any:
        made = current(kube, "v1/services", NAMESPACE, "tiny-peers")
        return made is not None and made["spec"]["selector"] == {"modelload.dev/model": "second"}

    await wait_for(selector, what="the Service's selector to follow spec.podLabelValue")
    kept = current(kube, "v1/services", NAMESPACE, "tiny-peers")
    assert kept is not None and kept["spec"]["clusterIP"] == "None"  # patched, not replaced


async def test_a_peers_service_that_is_not_this_modelloads_is_a_condition_until_it_goes(
    kube: Any, operator: Any, model_url: str, api: Any
) -> None:
    # Its selector is someone else's: the sidecars would ask pods that are not the model's.
    from tests.operator.test_resolving import failed, ready_condition

    kube.objects["v1/services", NAMESPACE, "tiny-peers"] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tiny-peers", "namespace": NAMESPACE},
        "spec": {"clusterIP": "None", "selector": {"app": "something-else"}},
    }
    await create_modelload(api, "tiny", {"source": model_url, "peers": True}, uid="new-uid")
    obj = await failed(kube, "tiny", "PeersServiceTaken")
    assert "tiny-peers" in ready_condition(obj)["message"]
    assert obj["status"].get("bytes") is None

    del kube.objects["v1/services", NAMESPACE, "tiny-peers"]  # the team removed theirs
    await resolved(kube, "tiny")
    made = current(kube, "v1/services", NAMESPACE, "tiny-peers")
    assert made is not None and made["metadata"]["ownerReferences"][0]["uid"] == "new-uid"
    assert made["spec"]["selector"] == {"modelload.dev/model": "tiny"}


class _Racing:
    """The API server as the operator meets it when a team deletes its Service (or the collector a
    predecessor's) between the operator's create and its read: the create is refused as existing, the read
    finds nothing. ``deletions`` such rounds, then the create goes through."""

    def __init__(self, deletions: int) -> None:
        self.deletions = deletions
        self.created: list[str] = []

    async def create_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.created.append(body["metadata"]["name"])

    async def create_service(self, namespace: str, body: dict[str, Any]) -> None:
        from modelload.operator.kube import KubeConflictError

        if self.deletions:
            raise KubeConflictError(f"create Service {namespace}/{body['metadata']['name']}: HTTP 409")
        self.created.append(body["metadata"]["name"])

    async def read_service(self, namespace: str, name: str) -> dict[str, Any]:
        from modelload.operator.kube import KubeNotFoundError

        self.deletions -= 1
        raise KubeNotFoundError(f"get Service {namespace}/{name}: HTTP 404 Not Found")


def _peered(name: str = "tiny") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NAMESPACE, "uid": "uid-1"}}


async def test_a_peers_service_deleted_between_the_create_and_the_read_is_created_again() -> None:
    from modelload.operator.peers import ensure_peer_objects

    kube = _Racing(deletions=1)
    await ensure_peer_objects(kube, namespace=NAMESPACE, body=_peered(), label_value="tiny")  # type: ignore[arg-type]
    assert kube.created == ["tiny-peers", "tiny-peers"]  # the Secret, then the Service on the second try


async def test_a_peers_service_that_keeps_coming_and_going_is_retried_not_a_permanent_404() -> None:
    from modelload.operator.kube import KubeUnavailableError
    from modelload.operator.peers import ensure_peer_objects

    kube = _Racing(deletions=10)
    with pytest.raises(KubeUnavailableError, match="deleted each time"):
        await ensure_peer_objects(kube, namespace=NAMESPACE, body=_peered(), label_value="tiny")  # type: ignore[arg-type]
