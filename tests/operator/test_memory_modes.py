"""spec.memory: the sidecar's memory mode from the ModelLoad, and a pod sized from the ring in ring mode."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.injection import build_patch
from modelload.operator.quantity import parse_bytes
from modelload.operator.schema import parse_spec
from modelload.operator.sizing import FIXED_HEADROOM, SizingDefaults, plan_sizing
from tests.operator.test_crd import openapi_schema
from tests.operator.test_injection import SIDECAR, apply, bare_pod, container, env_of, model

GIB = 1 << 30
SOURCE = "s3://models/llama.tensors"


def _sizing(memory: dict[str, Any] | None, *, model_bytes: int = 16 * GIB, tensors: int = 291) -> Any:
    spec = parse_spec({"source": SOURCE, **({"memory": memory} if memory else {})})
    segment = model_bytes + tensors * 4096 + (1 << 20)
    return plan_sizing(
        model_bytes=model_bytes, tensors=tensors, spec=spec, defaults=SizingDefaults(), segment=segment
    )


def test_ring_mode_sizes_the_volume_and_the_sidecar_from_the_ring_not_the_model() -> None:
    full, release, ring = (
        _sizing(None),
        _sizing({"mode": "release"}),
        _sizing({"mode": "ring", "ringSize": "2Gi"}),
    )
    assert full.volume_size_limit == release.volume_size_limit, "release may hold the whole model first"
    assert parse_bytes(full.volume_size_limit) >= 16 * GIB
    volume = parse_bytes(ring.volume_size_limit)
    assert 2 * GIB + FIXED_HEADROOM <= volume < 2 * GIB + 2 * FIXED_HEADROOM
    memory = parse_bytes(ring.resources["limits"]["memory"])
    assert memory == volume + SizingDefaults().working_set_bytes


def test_a_ring_larger_than_the_model_is_sized_as_the_model() -> None:
    small = _sizing({"mode": "ring", "ringSize": "64Gi"}, model_bytes=GIB)
    assert small.volume_size_limit == _sizing(None, model_bytes=GIB).volume_size_limit


def test_the_sidecar_gets_its_memory_mode_and_full_adds_nothing() -> None:
    memory = {"mode": "ring", "ringSize": "2Gi", "waitTimeoutSeconds": 900, "consumers": 2}
    pod = bare_pod()
    env = env_of(
        container(
            apply(pod, build_patch(pod=pod, model=model({"memory": memory}), sidecar=SIDECAR, native=True)),
            "modelload",
        )
    )
    assert (env["MODELLOAD_MEMORY_MODE"], env["MODELLOAD_RING_SIZE"]) == ("ring", str(2 * GIB))
    assert (env["MODELLOAD_MEMORY_WAIT_TIMEOUT"], env["MODELLOAD_CONSUMERS"]) == ("900", "2")
    plain = env_of(
        container(apply(pod, build_patch(pod=pod, model=model(), sidecar=SIDECAR, native=True)), "modelload")
    )
    assert not [name for name in plain if name.startswith(("MODELLOAD_MEMORY", "MODELLOAD_RING"))]


@pytest.mark.parametrize(
    ("memory", "wanted"),
    [(None, None), ({"slots": "auto"}, None), ({"slots": "paged"}, "paged"), ({"slots": "packed"}, "packed")],
)
def test_the_sidecar_gets_the_slots_a_modelload_asks_for(
    memory: dict[str, Any] | None, wanted: str | None
) -> None:
    # A fleet whose apps pin a loader older than packed segments keeps every tensor on its own page.
    pod = bare_pod()
    spec = {"memory": memory} if memory is not None else {}
    env = env_of(
        container(
            apply(pod, build_patch(pod=pod, model=model(spec), sidecar=SIDECAR, native=True)), "modelload"
        )
    )
    assert env.get("MODELLOAD_SLOTS") == wanted
    assert "MODELLOAD_MEMORY_MODE" not in env  # full, the default, adds nothing


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ({"mode": "ring"}, "set ringSize with mode ring"),
        ({"mode": "release", "ringSize": "1Gi"}, "set ringSize with mode ring"),
        ({"mode": "ring", "ringSize": "512Ki"}, "ringSize: 512Ki is below 1Mi"),
        ({"mode": "small"}, "memory.mode"),
        ({"mode": "release", "slots": "packed"}, "memory.slots: packed is for mode full; mode release"),
        ({"slots": "dense"}, "memory.slots"),
    ],
)
def test_a_bad_memory_spec_is_refused_naming_the_field(memory: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_spec({"source": SOURCE, "memory": memory})


def test_the_crd_schema_carries_the_memory_fields_and_their_rule() -> None:
    schema = openapi_schema()
    doc = {"apiVersion": "modelload.dev/v1alpha1", "kind": "ModelLoad", "metadata": {"name": "m"}}
    jsonschema.validate(
        {**doc, "spec": {"source": SOURCE, "memory": {"mode": "ring", "ringSize": "2Gi"}}}, schema
    )
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "spec": {"source": SOURCE, "memory": {"mode": "tiny"}}}, schema)
    spec_schema = schema["properties"]["spec"]
    rules = [rule["rule"] for rule in spec_schema["x-kubernetes-validations"]]
    assert any("self.memory.ringSize" in rule for rule in rules)
    assert any("self.memory.slots == 'paged'" in rule for rule in rules)
    jsonschema.validate({**doc, "spec": {"source": SOURCE, "memory": {"slots": "paged"}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**doc, "spec": {"source": SOURCE, "memory": {"slots": "tight"}}}, schema)


def test_a_spec_writes_every_size_as_ring_size_does_and_the_chunk_size_reads_it() -> None:
    schema = openapi_schema()
    doc = {"apiVersion": "modelload.dev/v1alpha1", "kind": "ModelLoad", "metadata": {"name": "m"}}
    spec = {"source": SOURCE, "chunkSize": "64Mi", "memory": {"mode": "ring", "ringSize": "2Gi"}}
    jsonschema.validate({**doc, "spec": spec}, schema)
    pod = bare_pod()
    patch = build_patch(
        pod=pod, model=model({k: v for k, v in spec.items() if k != "source"}), sidecar=SIDECAR, native=True
    )
    env = env_of(container(apply(pod, patch), "modelload"))
    assert (env["MODELLOAD_CHUNK_SIZE"], env["MODELLOAD_RING_SIZE"]) == (str(64 << 20), str(2 << 30))
    assert schema["properties"]["spec"]["properties"]["chunkSize"]["default"] == "32Mi"
    jsonschema.validate(
        {**doc, "spec": {"source": SOURCE, "chunkSize": "64MiB"}}, schema
    )  # as it was written


async def test_a_ring_smaller_than_the_largest_tensor_is_a_badspec_condition_not_a_load_failed_in_every_pod(
    kube: Any, operator: Any, api: Any, nginx: Any
) -> None:
    from tests.operator.conftest import create_modelload, model_bytes, resolved
    from tests.operator.test_resolving import failed, ready_condition

    # 4 tensors of 20000 x 16 float32: 1.2 MiB each, more than a 1Mi ring (the sidecar refuses that load)
    url = str(nginx.put("operator/ring/wide.safetensors", model_bytes(tensors=4, rows=20000)))
    await create_modelload(api, "narrow", {"source": url, "memory": {"mode": "ring", "ringSize": "1Mi"}})
    obj = await failed(kube, "narrow", "BadSpec")
    message = ready_condition(obj)["message"]
    assert message.startswith("spec.memory.ringSize: 1Mi")
    assert "'layers.0.weight'" in message and "at least 2Mi" in message

    await create_modelload(api, "wide", {"source": url, "memory": {"mode": "ring", "ringSize": "2Mi"}})
    await resolved(kube, "wide")
