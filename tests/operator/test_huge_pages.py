"""``spec.memory.hugePages``: the pod's huge-page volume, its request and limit, and the segment path.

Each patch is applied with ``jsonpatch`` and the pod validated against the Kubernetes schema (strict); the
huge pages the sidecar asks for are checked against what the sidecar's own planner lays out for the same
model on huge pages, so the operator never asks for fewer than the segment takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from modelload.loader.errors import ConfigError
from modelload.loader.wiring import HUGE_PAGES_MOUNT_PATH, HUGE_PAGES_SEGMENT_PATH, MOUNT_PATH
from modelload.operator.injection import InjectionError, build_patch
from modelload.operator.model_source import segment_bound
from modelload.operator.quantity import parse_bytes
from modelload.operator.schema import parse_spec
from modelload.operator.sizing import HUGE_PAGE_SIZES, SizingDefaults, plan_sizing
from tests.operator.test_injection import SIDECAR, apply, bare_pod, busy_pod, container, env_of, model

MIB, GIB = 1 << 20, 1 << 30


def huge(size: str = "2Mi", **memory: Any) -> dict[str, Any]:
    return {"memory": {"hugePages": size, **memory}}


@pytest.mark.parametrize("version", ["1.29", "1.33"])
@pytest.mark.parametrize("size", ["2Mi", "1Gi"])
def test_huge_pages_give_the_pod_a_huge_page_volume_and_the_sidecar_its_request_and_limit(
    version: str, size: str
) -> None:
    pod = busy_pod()
    patched = apply(pod, build_patch(pod=pod, model=model(huge(size)), sidecar=SIDECAR, native=True))
    kubernetes_validate.validate(patched, version, strict=True)
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    assert volumes["modelload-hugepages"] == {
        "name": "modelload-hugepages",
        "emptyDir": {"medium": f"HugePages-{size}"},
    }
    assert volumes["modelload"]["emptyDir"]["medium"] == "Memory", "the model directory and socket stay"
    sidecar = container(patched, "modelload")
    resources = sidecar["resources"]
    wanted = resources["limits"][f"hugepages-{size}"]
    assert resources["requests"][f"hugepages-{size}"] == wanted, "Kubernetes wants request = limit"
    assert parse_bytes(wanted) % HUGE_PAGE_SIZES[size] == 0 and parse_bytes(wanted) >= 3 * GIB
    assert "memory" in resources["requests"], "huge pages also need a memory or cpu request"
    assert parse_bytes(resources["limits"]["memory"]) < GIB, "the 3 GiB model is no longer charged as memory"
    for c in (sidecar, container(patched, "server"), container(patched, "metrics")):
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts["modelload"] == MOUNT_PATH and mounts["modelload-hugepages"] == HUGE_PAGES_MOUNT_PATH
        env = env_of(c)
        assert env["MODELLOAD_SEGMENT"] == HUGE_PAGES_SEGMENT_PATH
        assert env["MODELLOAD_MODEL_DIR"] == f"{MOUNT_PATH}/model", "small files stay off hugetlbfs"
        assert env["MODELLOAD_NOTIFY"] == f"ipc://{MOUNT_PATH}/notify.sock", "and so does the socket"
    assert "hugepages-2Mi" not in str(container(patched, "server").get("resources")), "the app takes none"


def test_without_huge_pages_nothing_changes() -> None:
    patched = apply(bare_pod(), build_patch(pod=bare_pod(), model=model(), sidecar=SIDECAR, native=True))
    assert [v["name"] for v in patched["spec"]["volumes"]] == ["modelload"]
    assert "hugepages" not in str(container(patched, "modelload")["resources"])
    assert env_of(container(patched, "server"))["MODELLOAD_SEGMENT"] == f"{MOUNT_PATH}/model.seg"


def test_a_reinvoked_webhook_gives_a_new_container_both_volumes_and_the_huge_page_segment() -> None:
    pod = bare_pod()
    once = apply(pod, build_patch(pod=pod, model=model(huge()), sidecar=SIDECAR, native=True))
    assert build_patch(pod=once, model=model(huge()), sidecar=SIDECAR, native=True) == []
    once["spec"]["containers"].append({"name": "proxy", "image": "envoy:1"})
    twice = apply(once, build_patch(pod=once, model=model(huge()), sidecar=SIDECAR, native=True))
    proxy = container(twice, "proxy")
    assert {m["name"] for m in proxy["volumeMounts"]} == {"modelload", "modelload-hugepages"}
    assert env_of(proxy)["MODELLOAD_SEGMENT"] == HUGE_PAGES_SEGMENT_PATH
    kubernetes_validate.validate(twice, "1.33", strict=True)


def test_a_clash_at_the_huge_page_mount_or_volume_name_is_refused() -> None:
    pod = busy_pod()
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "cache", "mountPath": HUGE_PAGES_MOUNT_PATH})
    with pytest.raises(InjectionError, match=f"already mounts 'cache' at {HUGE_PAGES_MOUNT_PATH}"):
        build_patch(pod=pod, model=model(huge()), sidecar=SIDECAR, native=True)
    pod = busy_pod()
    pod["spec"]["volumes"].append({"name": "modelload-hugepages", "emptyDir": {}})
    with pytest.raises(InjectionError, match="not a huge-page emptyDir"):
        build_patch(pod=pod, model=model(huge()), sidecar=SIDECAR, native=True)


def test_an_override_of_the_huge_pages_must_hold_the_segment_and_keep_request_equal_to_limit() -> None:
    low = {
        **huge(),
        "sidecar": {"resources": {"limits": {"hugepages-2Mi": "1Gi"}, "requests": {"hugepages-2Mi": "1Gi"}}},
    }
    with pytest.raises(ConfigError, match="hugepages-2Mi 1Gi is below"):
        build_patch(pod=bare_pod(), model=model(low), sidecar=SIDECAR, native=True)
    uneven = {**huge(), "sidecar": {"resources": {"limits": {"hugepages-2Mi": "8Gi"}}}}
    with pytest.raises(ConfigError, match=r"request .* and limit 8Gi differ"):
        build_patch(pod=bare_pod(), model=model(uneven), sidecar=SIDECAR, native=True)
    both = {
        **huge(),
        "sidecar": {"resources": {"limits": {"hugepages-2Mi": "8Gi"}, "requests": {"hugepages-2Mi": "8Gi"}}},
    }
    patched = apply(bare_pod(), build_patch(pod=bare_pod(), model=model(both), sidecar=SIDECAR, native=True))
    assert container(patched, "modelload")["resources"]["limits"]["hugepages-2Mi"] == "8Gi"


@pytest.mark.parametrize(
    ("memory", "override"),
    [
        ({"hugePages": "2Mi"}, "hugepages-1Gi"),  # pages of a size the segment is not on
        (None, "hugepages-2Mi"),  # the segment is on ordinary memory
    ],
)
def test_huge_pages_of_a_size_the_segment_does_not_use_are_refused_not_reserved_for_nothing(
    memory: dict[str, Any] | None, override: str
) -> None:
    spec = {
        **({"memory": memory} if memory else {}),
        "sidecar": {"resources": {"limits": {override: "4Gi"}, "requests": {override: "4Gi"}}},
    }
    with pytest.raises(ConfigError, match=rf"^spec.sidecar.resources: {override} .*spec.memory.hugePages"):
        build_patch(pod=bare_pod(), model=model(spec), sidecar=SIDECAR, native=True)


def test_a_ring_on_huge_pages_is_sized_from_the_ring_not_the_model() -> None:
    ring = huge("2Mi", mode="ring", ringSize="256Mi")
    spec = parse_spec({"source": "s3://models/x.tensors", **ring})
    sizing = plan_sizing(model_bytes=40 * GIB, tensors=2000, spec=spec, defaults=SizingDefaults())
    assert sizing.huge_pages is not None
    assert 256 * MIB < sizing.huge_pages.bytes < 512 * MIB


def test_a_bad_huge_page_size_is_refused_naming_the_sizes() -> None:
    with pytest.raises(ConfigError, match="hugePages"):
        parse_spec({"source": "s3://models/x.tensors", "memory": {"hugePages": "4Ki"}})


@pytest.mark.parametrize("mode", ["full", "release", "ring"])
def test_the_huge_pages_asked_for_cover_the_segment_the_sidecar_lays_out_on_huge_pages(
    mode: str, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    planner = pytest.importorskip("modelload.sidecar.planner")
    memory_module = pytest.importorskip("modelload.sidecar.memory")
    from modelload.loader.formats import read_index
    from tests.sidecar import models

    tensors = models.state_dict(seed=70, width=512, layers=3)
    tensors["big"] = torch.ones(3 * MIB + 7, dtype=torch.uint8)
    data = models.tensorizer_bytes(tensors)
    index = read_index(lambda offset, length: data[offset : offset + length], size=len(data))
    memory = {"mode": mode, **({"ringSize": "8Mi"} if mode == "ring" else {})}
    spec = parse_spec({"source": "s3://models/model.tensors", "memory": {**memory, "hugePages": "2Mi"}})
    bound = segment_bound(index, source=spec.source)
    sizing = plan_sizing(
        model_bytes=index.nbytes,
        tensors=len(index.tensors),
        spec=spec,
        defaults=SizingDefaults(),
        segment=bound,
    )
    assert sizing.huge_pages is not None
    plan = planner.plan_load(index, chunk_size=1 << 20, metadata={"source": spec.source}, page_size=2 * MIB)
    settings = memory_module.MemorySettings(mode=mode, ring_size=8 * MIB if mode == "ring" else 0)
    layout = memory_module.plan_memory(plan, settings).layout
    table = 2 * MIB if mode != "full" else 0
    assert layout.segment_length + table <= sizing.huge_pages.bytes, "the pod asks for every page it takes"
    assert sizing.huge_pages.bytes - (layout.segment_length + table) <= 3 * 2 * MIB, "and not many more"
