"""docs/handoff.md says what the code does: its pod validates, its example imports, its protocol table and
error codes are the ones the keeper and the client use."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "handoff.md").read_text()
HANDOFF = ROOT / "loader" / "modelload" / "loader" / "handoff"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC, re.S)


@pytest.mark.parametrize("version", ["1.34", "1.35"])
def test_the_pod_of_the_doc_validates_against_kubernetes(version: str) -> None:
    docs = [doc for block in blocks("yaml") for doc in yaml.safe_load_all(block) if doc]
    assert {doc["kind"] for doc in docs} == {"ResourceClaimTemplate", "Deployment"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    pod = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    claim = pod["resourceClaims"][0]["name"]
    assert all({"name": claim} in c["resources"]["claims"] for c in pod["containers"]), "one GPU in both"
    assert "shareProcessNamespace" not in pod and "hostIPC" not in pod


def test_the_python_example_imports_what_exists() -> None:
    (example,) = blocks("python")
    imports = "\n".join(line for line in example.splitlines() if line.startswith(("from ", "import ")))
    exec(compile(imports, "docs/handoff.md", "exec"), {})


def test_the_protocol_table_lists_every_op_and_error_code_the_code_sends() -> None:
    code = "".join(path.read_text() for path in HANDOFF.glob("*.py"))
    ops = set(re.findall(r'"op": "(\w+)"', code))
    codes = set(re.findall(r'protocol\.error\(\s*"([\w-]+)"', code))
    table = DOC[DOC.index("## The protocol") :]
    assert ops >= {"open", "status", "loading", "fds", "mapped"}
    for op in ops | {"manifest", "error"}:
        assert f"| `{op}` |" in table, f"the protocol table lacks {op!r}"
    for name in codes:
        assert f"`{name}`" in table, f"the doc lacks error code {name!r}"
