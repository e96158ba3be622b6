"""A pod as the webhook wires it, played out in processes: the real sidecar loads, the real loader attaches.

The injected sidecar's command and environment start ``modelload sidecar``; an "inference container" with
the environment the webhook gives target containers attaches to the segment and reads the tensors. Only the
volume's mount path is moved into a temporary folder, and the port to a free one (a pod has its own network
namespace; this test has not).
"""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import jsonpatch
import numpy as np
import pytest

from modelload.operator.injection import MOUNT_PATH, build_patch
from modelload.operator.model_source import read_summary
from modelload.operator.quantity import parse_bytes
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import parse_spec
from modelload.operator.settings import InjectedSidecar
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

APP = """
import json, sys
import numpy as np
from modelload.loader import attach
model = attach(timeout=60)
model.wait(timeout=60)
json.dump({name: float(np.asarray(model.numpy(name)).sum()) for name in model}, sys.stdout)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def plain_env(container: dict[str, Any], *, volume: Path, port: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        assert "value" in item, f"{item['name']} needs a Secret: not in this test's model"
        value = str(item["value"]).replace(MOUNT_PATH, str(volume)).replace("8479", str(port))
        env[item["name"]] = value
    return env


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def write_model(path: Path, fmt: str, arrays: dict[str, np.ndarray]) -> None:
    """A model file written by the real package of its format."""
    if fmt == "safetensors":
        from safetensors.numpy import save

        path.write_bytes(save(arrays))
        return
    torch = pytest.importorskip("torch")
    tensorizer = pytest.importorskip("tensorizer")
    serializer = tensorizer.TensorSerializer(str(path))
    serializer.write_state_dict({name: torch.from_numpy(a) for name, a in arrays.items()})
    serializer.close()


@pytest.mark.parametrize("fmt", ["safetensors", "tensorizer"])
def test_the_injected_sidecar_loads_the_model_and_the_app_attaches(
    fmt: str, shm_dir: Path, tmp_path: Path
) -> None:
    # Names of different lengths and odd sizes: the segment's padding, manifest and tensorizer headers vary.
    arrays = {
        f"model.layers.{i}.{'x' * (i * 37)}weight": np.full((61 + i, 33), i + 1, np.float32) for i in range(6)
    }
    path = tmp_path / f"model.{fmt}"
    write_model(path, fmt, arrays)
    spec = parse_spec({"source": f"file://{path}", "readers": 2, "chunkSize": "1MiB"})
    summary = read_summary(spec, credentials=None)
    model = ResolvedModel(
        name="tiny", namespace="ns", spec=spec, bytes=summary.bytes, tensors=summary.tensors
    )
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app", "image": "app:1"}]}}
    patched = jsonpatch.apply_patch(
        copy.deepcopy(pod), build_patch(pod=pod, model=model, sidecar=InjectedSidecar(), native=True)
    )
    (sidecar,) = patched["spec"]["initContainers"]
    (app,) = patched["spec"]["containers"]
    port = free_port()
    sidecar_env = plain_env(sidecar, volume=shm_dir, port=port) | {"MODELLOAD_HOST": "127.0.0.1"}
    base = {k: v for k, v in os.environ.items() if not k.startswith("MODELLOAD_")}
    command = [str(Path(sys.executable).with_name(sidecar["command"][0])), *sidecar["command"][1:]]
    process = subprocess.Popen(
        command, env=base | sidecar_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        probes = {
            p: sidecar[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")
        }

        def ready() -> bool:
            assert process.poll() is None, process.communicate()[0].decode()[-3000:]
            return get(f"http://127.0.0.1:{port}{probes['readinessProbe']}") == 200

        wait_for(ready, timeout=30, what="the injected sidecar ready", interval=0.1)
        assert get(f"http://127.0.0.1:{port}{probes['startupProbe']}") == 200
        assert get(f"http://127.0.0.1:{port}{probes['livenessProbe']}") == 200
        app_env = plain_env(app, volume=shm_dir, port=port)
        result = subprocess.run(
            [sys.executable, "-c", APP],
            env=base | app_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        sums = json.loads(result.stdout)
        assert sums == {name: float(a.sum()) for name, a in arrays.items()}
        (volume,) = patched["spec"]["volumes"]
        written = (shm_dir / "model.seg").stat().st_size
        assert written <= summary.segment_bytes <= parse_bytes(volume["emptyDir"]["sizeLimit"]), (
            written,
            summary,
        )
    finally:
        process.terminate()
        process.wait(timeout=15)
