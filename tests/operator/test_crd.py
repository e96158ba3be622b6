"""The generated CRD: current, structural, valid for Kubernetes 1.29-1.33, and accepting our examples."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from modelload.operator import crd
from modelload.operator.schema import parse_spec

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ["1.29", "1.30", "1.31", "1.32", "1.33"]


def openapi_schema() -> dict[str, Any]:
    return crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_the_generated_files_on_disk_are_current() -> None:
    assert crd.main(["--check"]) == 0, "run `make crds` (python -m modelload.operator.crd --write)"


def test_the_check_fails_with_a_diff_when_a_generated_file_is_stale(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "charts", tmp_path / "charts")
    crd.write(tmp_path)
    assert crd.check(tmp_path) == []
    target = tmp_path / "manifests" / "crd" / crd.CRD_FILE
    target.write_text(target.read_text().replace("maximum: 256", "maximum: 512"))
    (diff,) = crd.check(tmp_path)
    assert "-" + " " * 18 + "maximum: 512" in diff or "maximum: 512" in diff
    assert "modelloads.modelload.dev.yaml (generated)" in diff


def test_the_chart_carries_the_same_crd_as_the_manifests() -> None:
    a = (ROOT / "manifests" / "crd" / crd.CRD_FILE).read_text()
    b = (ROOT / "charts" / "modelload" / "crds" / crd.CRD_FILE).read_text()
    assert a == b == crd.HEADER + crd.render_yaml(crd.build_crd())


@pytest.mark.parametrize("version", VERSIONS)
def test_the_crd_validates_against_the_kubernetes_schema(version: str) -> None:
    kubernetes_validate.validate(crd.build_crd(), version, strict=True)


def _walk(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += _walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_the_schema_is_structural() -> None:
    """Every node has a type (or is an int-or-string), and no map also declares properties."""
    for path, node in _walk(openapi_schema()):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
            continue
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}, path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_default_is_valid_for_its_own_field() -> None:
    for path, node in _walk(openapi_schema()):
        if "default" in node:
            jsonschema.validate(node["default"], node)
            assert node["type"] != "object" or node["default"] == {}, path


def test_the_status_subresource_and_printer_columns_are_declared() -> None:
    version = crd.build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Size"] == ".status.size"
    assert columns["Ready"] == ".status.pods.ready"
    assert columns["Load"] == ".status.pods.medianLoadSeconds"
    assert columns["Age"] == ".metadata.creationTimestamp"


def _custom_resources() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((ROOT / "manifests").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "ModelLoad":
                found.append((f"{path.relative_to(ROOT)}:{doc['metadata']['name']}", doc))
    return found


CUSTOM_RESOURCES = _custom_resources()


def test_the_manifests_hold_example_modelloads() -> None:
    assert len(CUSTOM_RESOURCES) >= 2


@pytest.mark.parametrize(("where", "doc"), CUSTOM_RESOURCES, ids=[w for w, _ in CUSTOM_RESOURCES])
def test_every_modelload_in_the_manifests_validates_against_the_crd(where: str, doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, openapi_schema())
    parse_spec(doc["spec"])


def test_the_crd_schema_refuses_a_modelload_with_a_bad_field() -> None:
    doc = dict(CUSTOM_RESOURCES[0][1])
    doc["spec"] = {**doc["spec"], "readers": 0}
    with pytest.raises(jsonschema.ValidationError, match="minimum"):
        jsonschema.validate(doc, openapi_schema())


@pytest.mark.parametrize("version", ["1.29", "1.33"])
def test_every_built_in_object_in_the_examples_validates(version: str) -> None:
    checked = 0
    for path in sorted((ROOT / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["apiVersion"] in ("v1", "apps/v1", "batch/v1"):
                kubernetes_validate.validate(doc, version, strict=True)
                checked += 1
    assert checked >= 3
