"""The webhook's JSON patch: what a pod gets, where the operations point, and that the result is a valid pod.

Each patch is applied with the ``jsonpatch`` package (RFC 6902, as the API server applies it) and the pod
that comes out is validated against the Kubernetes schema, strictly, for 1.29 and 1.33.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.injection import (
    InjectionError,
    build_patch,
    pointer,
)
from modelload.operator.quantity import parse_bytes
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import parse_spec
from modelload.operator.settings import InjectedSidecar
from modelload.operator.sizing import segment_bytes

GIB = 1 << 30
SIDECAR = InjectedSidecar(image="registry.test/modelload-sidecar:1")


def model(spec: dict[str, Any] | None = None, *, nbytes: int = 3 * GIB, tensors: int = 291) -> ResolvedModel:
    full = {"source": "s3://models/llama.tensors", **(spec or {})}
    return ResolvedModel(
        name="llama", namespace="serving", spec=parse_spec(full), bytes=nbytes, tensors=tensors
    )


def bare_pod() -> dict[str, Any]:
    """A pod with nothing the patch adds to: no volumes, no init containers, no env, no annotations."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "server", "namespace": "serving", "labels": {"modelload.dev/model": "llama"}},
        "spec": {"containers": [{"name": "server", "image": "vllm:1"}]},
    }


def busy_pod() -> dict[str, Any]:
    """A pod that already has every array the patch appends to."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "server",
            "namespace": "serving",
            "labels": {"modelload.dev/model": "llama"},
            "annotations": {"team": "ml"},
        },
        "spec": {
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "initContainers": [{"name": "warmup", "image": "busybox:1", "command": ["true"]}],
            "containers": [
                {
                    "name": "server",
                    "image": "vllm:1",
                    "env": [{"name": "PORT", "value": "8000"}],
                    "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                    "ports": [{"containerPort": 8000}],
                },
                {"name": "metrics", "image": "exporter:1"},
            ],
        },
    }


def apply(pod: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    return jsonpatch.apply_patch(copy.deepcopy(pod), ops)


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod["spec"]
    for c in spec.get("initContainers", []) + spec["containers"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(f"no container {name}")


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


@pytest.mark.parametrize("version", ["1.29", "1.33"])
@pytest.mark.parametrize("make_pod", [bare_pod, busy_pod], ids=["bare", "busy"])
def test_a_native_injection_yields_a_pod_the_kubernetes_schema_accepts(version: str, make_pod: Any) -> None:
    pod = make_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    kubernetes_validate.validate(patched, version, strict=True)
    sidecar = patched["spec"]["initContainers"][-1]
    assert sidecar["name"] == "modelload"
    assert sidecar["restartPolicy"] == "Always"


@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_a_regular_injection_yields_a_valid_pod_with_the_sidecar_among_the_containers(version: str) -> None:
    pod = busy_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=False))
    kubernetes_validate.validate(patched, version, strict=True)
    assert [c["name"] for c in patched["spec"]["containers"]] == ["server", "metrics", "modelload"]
    assert "restartPolicy" not in patched["spec"]["containers"][-1]
    assert [c["name"] for c in patched["spec"]["initContainers"]] == ["warmup"]


def test_absent_arrays_are_added_whole_and_present_ones_appended_to() -> None:
    bare = build_patch(pod=bare_pod(), model=model(), sidecar=SIDECAR, native=True)
    paths = {op["path"] for op in bare}
    assert {
        "/spec/volumes",
        "/spec/initContainers",
        "/spec/containers/0/env",
        "/metadata/annotations",
    } <= paths
    assert "/spec/containers/0/volumeMounts" in paths
    assert all(op["op"] == "add" for op in bare)
    busy = build_patch(pod=busy_pod(), model=model(), sidecar=SIDECAR, native=True)
    busy_paths = [op["path"] for op in busy]
    assert "/spec/volumes/-" in busy_paths
    assert "/spec/initContainers/-" in busy_paths
    assert "/spec/containers/0/env/-" in busy_paths
    assert "/spec/containers/0/volumeMounts/-" in busy_paths
    assert "/spec/containers/1/env" in busy_paths  # the second container had no env
    assert "/metadata/annotations/modelload.dev~1injected" in busy_paths
    assert not any(op["path"] in ("/spec/volumes", "/spec/initContainers") for op in busy)


def test_json_pointers_escape_tilde_and_slash() -> None:
    assert (
        pointer("metadata", "annotations", "modelload.dev/injected")
        == "/metadata/annotations/modelload.dev~1injected"
    )
    assert pointer("a~b/c", 0, "-") == "/a~0b~1c/0/-"


def test_the_volume_is_memory_backed_and_sized_for_the_model_with_headroom() -> None:
    pod = bare_pod()
    patched = apply(
        pod, build_patch(pod=pod, model=model(nbytes=3 * GIB, tensors=291), sidecar=SIDECAR, native=True)
    )
    (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload"]
    assert volume["emptyDir"]["medium"] == "Memory"
    size = parse_bytes(volume["emptyDir"]["sizeLimit"])
    assert size >= segment_bytes(model_bytes=3 * GIB, tensors=291) > 3 * GIB
    assert size < 3 * GIB + 128 * (1 << 20)


def test_the_sidecar_memory_limit_covers_the_volume_because_tmpfs_pages_are_charged_to_the_writer() -> None:
    pod = bare_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(nbytes=5 * GIB), sidecar=SIDECAR, native=True))
    sidecar = container(patched, "modelload")
    (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload"]
    limit = parse_bytes(sidecar["resources"]["limits"]["memory"])
    assert limit >= parse_bytes(volume["emptyDir"]["sizeLimit"]) + SIDECAR.sizing.working_set_bytes
    assert sidecar["resources"]["requests"]["memory"] == sidecar["resources"]["limits"]["memory"]
    assert "cpu" in sidecar["resources"]["requests"] and "cpu" not in sidecar["resources"]["limits"]


def test_the_sidecar_has_its_probes_its_configuration_and_its_metrics_port() -> None:
    pod = bare_pod()
    spec = {"readers": 16, "chunkSize": "64MiB", "verifyHashes": False, "priority": ["embed", "layers.0."]}
    patched = apply(pod, build_patch(pod=pod, model=model(spec), sidecar=SIDECAR, native=True))
    sidecar = container(patched, "modelload")
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/startupz"
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert sidecar["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert {p["httpGet"]["port"] for p in (sidecar["startupProbe"], sidecar["readinessProbe"])} == {8479}
    assert sidecar["ports"] == [{"name": "metrics", "containerPort": 8479, "protocol": "TCP"}]
    env = env_of(sidecar)
    assert env["MODELLOAD_SOURCE"] == "s3://models/llama.tensors"
    assert env["MODELLOAD_SEGMENT"] == "/run/modelload/model.seg"
    assert env["MODELLOAD_READERS"] == "16"
    assert env["MODELLOAD_CHUNK_SIZE"] == str(64 << 20)
    assert env["MODELLOAD_VERIFY"] == "false"
    assert env["MODELLOAD_PRIORITY"] == "embed,layers.0."
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert sidecar["image"] == "registry.test/modelload-sidecar:1"


def test_target_containers_get_the_volume_and_the_loader_environment() -> None:
    pod = busy_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    for name in ("server", "metrics"):
        c = container(patched, name)
        assert {"name": "modelload", "mountPath": "/run/modelload"} in c["volumeMounts"]
        env = env_of(c)
        assert env["MODELLOAD_SEGMENT"] == "/run/modelload/model.seg"
        assert env["MODELLOAD_NOTIFY"] == "ipc:///run/modelload/notify.sock"
        assert env["MODELLOAD_STATUS_URL"] == "http://127.0.0.1:8479"
    assert env_of(container(patched, "server"))["PORT"] == "8000"  # existing env is kept
    assert container(patched, "warmup").get("volumeMounts") is None  # init containers run before the model


def test_credentials_reach_only_the_sidecar_and_only_by_reference() -> None:
    spec = {"credentialsSecretRef": {"name": "s3-reader"}, "decryptionKeySecretRef": {"name": "model-key"}}
    pod = busy_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(spec), sidecar=SIDECAR, native=True))
    env = env_of(container(patched, "modelload"))
    assert env["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3-reader", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    }
    assert env["AWS_SECRET_ACCESS_KEY"]["secretKeyRef"]["key"] == "AWS_SECRET_ACCESS_KEY"
    assert env["AWS_SESSION_TOKEN"]["secretKeyRef"]["optional"] is True
    assert env["MODELLOAD_KEY_FILE"] == "/var/run/secrets/modelload/key/key"
    (key_volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload-key"]
    assert key_volume["secret"]["secretName"] == "model-key"
    assert {
        "name": "modelload-key",
        "mountPath": "/var/run/secrets/modelload/key",
        "readOnly": True,
    } in container(patched, "modelload")["volumeMounts"]
    for name in ("server", "metrics", "warmup"):
        c = container(patched, name)
        assert not any(k.startswith("AWS_") for k in env_of(c))
        assert all(m["name"] != "modelload-key" for m in c.get("volumeMounts", []))


def test_an_unsigned_model_passes_no_credentials_even_with_a_secret_named() -> None:
    spec = {"credentialsSecretRef": {"name": "s3-reader"}, "s3": {"unsigned": True, "region": "eu-west-1"}}
    patched = apply(bare_pod(), build_patch(pod=bare_pod(), model=model(spec), sidecar=SIDECAR, native=True))
    env = env_of(container(patched, "modelload"))
    assert env["MODELLOAD_S3_UNSIGNED"] == "true"
    assert env["MODELLOAD_S3_REGION"] == "eu-west-1"
    assert "AWS_ACCESS_KEY_ID" not in env


def test_the_containers_annotation_picks_the_targets() -> None:
    pod = busy_pod()
    pod["metadata"]["annotations"]["modelload.dev/containers"] = "server"
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    assert "MODELLOAD_SEGMENT" in env_of(container(patched, "server"))
    assert "MODELLOAD_SEGMENT" not in env_of(container(patched, "metrics"))


def test_a_container_name_the_pod_lacks_is_refused_with_the_names_it_has() -> None:
    pod = busy_pod()
    pod["metadata"]["annotations"]["modelload.dev/containers"] = "sever"
    with pytest.raises(InjectionError, match=r"sever.*it has: server, metrics"):
        build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True)
    with pytest.raises(InjectionError, match=r"spec\.containers"):
        build_patch(pod=busy_pod(), model=model({"containers": ["trainer"]}), sidecar=SIDECAR, native=True)


def test_a_pod_that_already_has_the_sidecar_gets_nothing_more() -> None:
    pod = busy_pod()
    once = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    assert build_patch(pod=once, model=model(), sidecar=SIDECAR, native=True) == []


def test_a_reinvoked_webhook_wires_only_the_containers_added_after_it() -> None:
    pod = bare_pod()
    once = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    once["spec"]["containers"].append({"name": "proxy", "image": "envoy:1"})  # another webhook's container
    ops = build_patch(pod=once, model=model(), sidecar=SIDECAR, native=True)
    assert {op["path"] for op in ops} == {"/spec/containers/1/volumeMounts", "/spec/containers/1/env"}
    twice = apply(once, ops)
    assert sum(c["name"] == "modelload" for c in twice["spec"]["initContainers"]) == 1
    assert len([v for v in twice["spec"]["volumes"] if v["name"] == "modelload"]) == 1


def test_a_mount_path_clash_is_refused_rather_than_shadowed() -> None:
    pod = busy_pod()
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "cache", "mountPath": "/run/modelload"})
    with pytest.raises(InjectionError, match="already mounts 'cache' at /run/modelload"):
        build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True)


def test_overrides_that_cannot_hold_the_model_are_refused() -> None:
    with pytest.raises(ConfigError, match="volumeSizeLimit 1Gi is below"):
        build_patch(pod=bare_pod(), model=model({"volumeSizeLimit": "1Gi"}), sidecar=SIDECAR, native=True)
    small = {"sidecar": {"resources": {"limits": {"memory": "2Gi"}}}}
    with pytest.raises(ConfigError, match="charged for every page"):
        build_patch(pod=bare_pod(), model=model(small), sidecar=SIDECAR, native=True)


def test_overrides_replace_the_image_and_the_computed_resources() -> None:
    spec = {
        "sidecar": {
            "image": "mirror.local/sidecar:2",
            "imagePullPolicy": "Always",
            "resources": {"requests": {"cpu": 2}},
        },
        "volumeSizeLimit": "8Gi",
    }
    patched = apply(bare_pod(), build_patch(pod=bare_pod(), model=model(spec), sidecar=SIDECAR, native=True))
    sidecar = container(patched, "modelload")
    assert sidecar["image"] == "mirror.local/sidecar:2"
    assert sidecar["imagePullPolicy"] == "Always"
    assert sidecar["resources"]["requests"]["cpu"] == "2"
    (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload"]
    assert volume["emptyDir"]["sizeLimit"] == "8Gi"
    assert parse_bytes(sidecar["resources"]["limits"]["memory"]) >= 8 * GIB
    kubernetes_validate.validate(patched, "1.33", strict=True)


def test_a_knative_pod_keeps_its_ports_and_the_sidecar_adds_its_metrics_port() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "llm-00001-deployment-", "labels": {"modelload.dev/model": "llama"}},
        "spec": {
            "containers": [
                {
                    "name": "user-container",
                    "image": "vllm:1",
                    "ports": [{"name": "user-port", "containerPort": 8080}],
                },
                {
                    "name": "queue-proxy",
                    "image": "queue:1",
                    "ports": [{"name": "http-queueadm", "containerPort": 8022}],
                },
            ]
        },
    }
    pod["metadata"]["annotations"] = {"modelload.dev/containers": "user-container"}
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    kubernetes_validate.validate(patched, "1.31", strict=True)
    # KNative checks its one-port rule on the Revision template; the pod its Deployment makes may carry more.
    assert container(patched, "user-container")["ports"] == [{"name": "user-port", "containerPort": 8080}]
    assert [p["name"] for p in container(patched, "modelload")["ports"]] == ["metrics"]
    assert "MODELLOAD_SEGMENT" not in env_of(container(patched, "queue-proxy"))


def test_the_operators_segment_bound_sizes_the_volume_when_the_status_has_one() -> None:
    estimated = model(nbytes=3 * GIB, tensors=291)
    exact = ResolvedModel(
        name="llama",
        namespace="serving",
        spec=estimated.spec,
        bytes=3 * GIB,
        tensors=291,
        segment_bytes=3 * GIB + (9 << 20),
    )
    sizes = []
    for m in (estimated, exact):
        patched = apply(bare_pod(), build_patch(pod=bare_pod(), model=m, sidecar=SIDECAR, native=True))
        (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload"]
        sizes.append(parse_bytes(volume["emptyDir"]["sizeLimit"]))
    assert sizes[1] == 3 * GIB + (9 << 20) + (64 << 20)
    assert sizes[0] != sizes[1]


def test_a_memory_volume_the_pod_already_names_is_used_not_duplicated() -> None:
    pod = busy_pod()
    pod["spec"]["volumes"].append(
        {"name": "modelload", "emptyDir": {"medium": "Memory", "sizeLimit": "20Gi"}}
    )
    patched = apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True))
    assert [v["name"] for v in patched["spec"]["volumes"]] == ["cache", "modelload"]
    kubernetes_validate.validate(patched, "1.33", strict=True)
    pod["spec"]["volumes"][-1] = {"name": "modelload", "emptyDir": {}}
    with pytest.raises(InjectionError, match="not a memory emptyDir"):
        build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True)


def test_the_pod_is_marked_with_the_generation_of_the_spec_it_was_injected_from() -> None:
    from dataclasses import replace

    patched = apply(
        bare_pod(),
        build_patch(pod=bare_pod(), model=replace(model(), generation=7), sidecar=SIDECAR, native=True),
    )
    assert patched["metadata"]["annotations"]["modelload.dev/generation"] == "7"
    kubernetes_validate.validate(patched, "1.33", strict=True)


@pytest.mark.parametrize("policy", ["Never", "OnFailure"])
def test_a_pod_that_runs_to_completion_is_refused_a_regular_sidecar_that_would_keep_it_running(
    policy: str,
) -> None:
    job_pod = bare_pod()
    job_pod["spec"]["restartPolicy"] = policy  # a Job's pod
    with pytest.raises(InjectionError, match=rf"restartPolicy {policy}.*never exits.*native"):
        build_patch(pod=job_pod, model=model(), sidecar=SIDECAR, native=False)
    patched = apply(job_pod, build_patch(pod=job_pod, model=model(), sidecar=SIDECAR, native=True))
    kubernetes_validate.validate(patched, "1.33", strict=True)  # a native sidecar never blocks completion
