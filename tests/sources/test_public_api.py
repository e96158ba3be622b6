"""The sources layer stands alone and exports a deliberate, sorted surface."""

from __future__ import annotations

import json
import subprocess
import sys

import modelload.sidecar.sources as sources


def test_importing_the_layer_pulls_in_no_web_framework_cloud_sdk_or_other_sidecar_module() -> None:
    code = (
        "import json, sys; import modelload.sidecar.sources; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('fastapi', 'uvicorn', 'boto3', 'botocore', 'kopf', 'kubernetes', 'zmq') "
        "or (m.startswith('modelload.sidecar.') and not m.startswith('modelload.sidecar.sources')))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == []


def test_all_is_sorted_and_every_name_exists() -> None:
    assert sources.__all__ == sorted(sources.__all__)
    for name in sources.__all__:
        assert hasattr(sources, name), name


def test_every_public_name_is_exported() -> None:
    public = {name for name in vars(sources) if not name.startswith("_") and name != "annotations"}
    assert public == set(sources.__all__)
