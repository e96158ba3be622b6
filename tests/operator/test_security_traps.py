"""Traps a pod's owner should not fall into: who reads the segment, signatures in pod specs, a name clash.

Every patch is applied with ``jsonpatch`` (as the API server applies it) and the resulting pod validated
against the Kubernetes schema, so a patch the API server would reject fails here first.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.injection import InjectionError, build_patch, source_query_problem
from modelload.operator.resolve import resolve
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import parse_spec
from modelload.operator.settings import InjectedSidecar
from modelload.operator.sizing import SizingDefaults

SIDECAR = InjectedSidecar(image="registry.test/modelload-sidecar:1")
PRESIGNED = (
    "https://models.s3.amazonaws.com/llama.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256"
    "&X-Amz-Credential=AKIAEXAMPLE%2F20261124%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Expires=604800"
    "&X-Amz-Signature=0123456789abcdeffedcba9876543210"
)


def model(source: str = "s3://models/llama.tensors") -> ResolvedModel:
    spec = parse_spec({"source": source})
    return ResolvedModel(name="llama", namespace="serving", spec=spec, bytes=1 << 30, tensors=291)


def pod(
    *, security: dict[str, Any] | None = None, extra: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "server", "image": "vllm:1"}, *(extra or [])]}
    if security is not None:
        spec["securityContext"] = security
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "server", "namespace": "serving", "labels": {"modelload.dev/model": "llama"}},
        "spec": spec,
    }


def patched(original: dict[str, Any], *, native: bool = True) -> dict[str, Any]:
    ops = build_patch(pod=original, model=model(), sidecar=SIDECAR, native=native)
    result: dict[str, Any] = jsonpatch.apply_patch(copy.deepcopy(original), ops)
    kubernetes_validate.validate(result, "1.31", strict=True)
    return result


def sidecar_of(result: dict[str, Any]) -> dict[str, Any]:
    spec = result["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "modelload")


# --- who can read the segment ------------------------------------------------------------------------------


@pytest.mark.parametrize("security", [None, {"runAsNonRoot": True}, {"supplementalGroups": [5000]}])
def test_a_pod_without_fsgroup_gets_the_segment_group_in_every_container(
    security: dict[str, Any] | None,
) -> None:
    result = patched(pod(security=security))
    assert 8479 in result["spec"]["securityContext"]["supplementalGroups"]
    assert sidecar_of(result)["securityContext"]["runAsGroup"] == 8479
    if security and "supplementalGroups" in security:
        assert 5000 in result["spec"]["securityContext"]["supplementalGroups"]
    if security and "runAsNonRoot" in security:
        assert result["spec"]["securityContext"]["runAsNonRoot"] is True


def test_a_pod_with_an_fsgroup_is_left_to_it() -> None:
    result = patched(pod(security={"fsGroup": 2000}))
    assert result["spec"]["securityContext"] == {"fsGroup": 2000}
    assert "runAsGroup" not in sidecar_of(result)["securityContext"]


def test_the_segment_group_can_be_turned_off() -> None:
    ops = build_patch(pod=pod(), model=model(), sidecar=InjectedSidecar(segment_group=0), native=False)
    assert not any(op["path"].startswith("/spec/securityContext") for op in ops)


# --- the metrics port --------------------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False])
def test_the_sidecar_declares_its_metrics_port(native: bool) -> None:
    sidecar = sidecar_of(patched(pod(), native=native))
    assert sidecar["ports"] == [{"name": "metrics", "containerPort": 8479, "protocol": "TCP"}]


# --- signatures in the pod spec ----------------------------------------------------------------------------


def test_a_presigned_source_is_refused_with_what_to_use_instead() -> None:
    with pytest.raises(InjectionError) as raised:
        build_patch(pod=pod(), model=model(PRESIGNED), sidecar=SIDECAR, native=True)
    message = str(raised.value)
    assert "headersSecretRef" in message and "credentialsSecretRef" in message
    assert "X-Amz-Signature" not in message and "0123456789abcdef" not in message


@pytest.mark.parametrize(
    ("source", "refused"),
    [
        (PRESIGNED, True),
        ("https://hub.example/llama.safetensors?token=abc", True),
        ("https://hub.example/llama.safetensors", False),
        ("http://files.example/models/llama/", False),
        ("s3://models/llama.tensors", False),
        ("file:///models/llama?.tensors", False),
    ],
)
def test_only_http_sources_with_a_query_string_are_refused(source: str, refused: bool) -> None:
    assert (source_query_problem(source) is not None) is refused


async def test_resolving_a_presigned_modelload_fails_before_anything_is_fetched() -> None:
    spec = parse_spec({"source": PRESIGNED})
    with pytest.raises(ConfigError, match=r"^spec\.source: carries a query string"):
        # No Kubernetes client: the check must come before any Secret read or request.
        await resolve(kube=None, namespace="serving", spec=spec, sizing=SizingDefaults())  # type: ignore[arg-type]


# --- a container already named like the sidecar ------------------------------------------------------------


@pytest.mark.parametrize("where", ["containers", "initContainers"])
def test_a_pod_with_its_own_container_named_modelload_is_refused_clearly(where: str) -> None:
    original = pod()
    original["spec"].setdefault(where, []).append({"name": "modelload", "image": "their-own:1"})
    with pytest.raises(InjectionError, match=r"already has a container named 'modelload'.*rename"):
        build_patch(pod=original, model=model(), sidecar=SIDECAR, native=True)


def test_a_pod_this_webhook_injected_is_still_topped_up_not_refused() -> None:
    once = patched(pod())
    once["spec"]["containers"].append({"name": "mesh-proxy", "image": "proxy:1"})
    ops = build_patch(pod=once, model=model(), sidecar=SIDECAR, native=True)
    again = jsonpatch.apply_patch(copy.deepcopy(once), ops)
    kubernetes_validate.validate(again, "1.31", strict=True)
    proxy = next(c for c in again["spec"]["containers"] if c["name"] == "mesh-proxy")
    assert any(m["name"] == "modelload" for m in proxy["volumeMounts"])
    assert build_patch(pod=again, model=model(), sidecar=SIDECAR, native=True) == []


# --- volumes and mounts already named like the injected ones -----------------------------------------------


def _encrypted_peered(**spec: Any) -> ResolvedModel:
    full = {
        "source": "s3://models/llama.tensors",
        "decryptionKeySecretRef": {"name": "llama-key"},
        "peers": True,
        **spec,
    }
    return ResolvedModel(name="llama", namespace="serving", spec=parse_spec(full), bytes=1 << 30, tensors=291)


@pytest.mark.parametrize(
    "volume",
    [
        {"name": "modelload-key", "secret": {"secretName": "another-key"}},
        {"name": "modelload-key", "configMap": {"name": "not-a-key"}},
        {"name": "modelload-peer-token", "secret": {"secretName": "a-token-of-my-own"}},
    ],
)
def test_a_pod_volume_named_like_a_secret_the_sidecar_mounts_is_refused_not_mounted_instead(
    volume: dict[str, Any],
) -> None:
    original = pod()
    original["spec"]["volumes"] = [volume]
    with pytest.raises(InjectionError, match=rf"already has a volume named '{volume['name']}'.*rename"):
        build_patch(pod=original, model=_encrypted_peered(), sidecar=SIDECAR, native=True)


def test_a_pod_that_already_holds_the_very_volumes_the_webhook_adds_is_injected_without_duplicates() -> None:
    once = jsonpatch.apply_patch(
        pod(), build_patch(pod=pod(), model=_encrypted_peered(), sidecar=SIDECAR, native=True)
    )
    copy_without_sidecar = copy.deepcopy(once)  # a pod spec copied from an injected pod, sidecar taken out
    copy_without_sidecar["spec"].pop("initContainers")
    copy_without_sidecar["metadata"].pop("annotations")
    ops = build_patch(pod=copy_without_sidecar, model=_encrypted_peered(), sidecar=SIDECAR, native=True)
    again = jsonpatch.apply_patch(copy.deepcopy(copy_without_sidecar), ops)
    kubernetes_validate.validate(again, "1.31", strict=True)
    assert [v["name"] for v in again["spec"]["volumes"]] == [v["name"] for v in once["spec"]["volumes"]]


def test_a_huge_page_volume_of_another_page_size_than_the_models_is_refused() -> None:
    original = pod()
    original["spec"]["volumes"] = [{"name": "modelload-hugepages", "emptyDir": {"medium": "HugePages-1Gi"}}]
    spec = parse_spec({"source": "s3://models/llama.tensors", "memory": {"hugePages": "2Mi"}})
    huge = ResolvedModel(name="llama", namespace="serving", spec=spec, bytes=1 << 30, tensors=291)
    with pytest.raises(InjectionError, match=r"HugePages-1Gi.*HugePages-2Mi"):
        build_patch(pod=original, model=huge, sidecar=SIDECAR, native=True)


def test_a_memory_volume_of_the_pods_own_too_small_for_the_model_is_refused() -> None:
    original = pod()
    original["spec"]["volumes"] = [
        {"name": "modelload", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}
    ]
    with pytest.raises(InjectionError, match=r"sizeLimit 64Mi.*below"):
        build_patch(pod=original, model=model(), sidecar=SIDECAR, native=True)


def test_a_target_mounting_the_model_volume_elsewhere_is_refused_rather_than_left_without_the_segment() -> (
    None
):
    original = pod()
    original["spec"]["volumes"] = [{"name": "modelload", "emptyDir": {"medium": "Memory"}}]
    original["spec"]["containers"][0]["volumeMounts"] = [{"name": "modelload", "mountPath": "/models"}]
    with pytest.raises(InjectionError, match=r"mounts 'modelload' at /models.*/run/modelload"):
        build_patch(pod=original, model=model(), sidecar=SIDECAR, native=True)


# --- a pod already injected, for another model -------------------------------------------------------------


def test_a_pod_injected_for_one_model_and_labelled_for_another_is_refused() -> None:
    copied = patched(pod())  # e.g. kubectl debug --copy-to, or a manifest saved from a running pod
    copied["metadata"]["labels"]["modelload.dev/model"] = "mistral"
    mistral = ResolvedModel(
        name="mistral", namespace="serving", spec=parse_spec({"source": "s3://models/mistral.tensors"}),
        bytes=1 << 30, tensors=291,
    )  # fmt: skip
    with pytest.raises(InjectionError, match=r"injected for ModelLoad 'llama'.*'mistral'"):
        build_patch(pod=copied, model=mistral, sidecar=SIDECAR, native=True)
