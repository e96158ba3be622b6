"""The sidecar the webhook injects is configured in words the sidecar itself understands.

The injected container's environment (with the Secret references filled in, as the kubelet does) goes
through the sidecar's own settings parser; what comes out must be what the ModelLoad asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from modelload.operator.injection import build_patch
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import parse_spec
from modelload.operator.settings import InjectedSidecar
from modelload.operator.sidecar_env import target_env

sidecar_settings = pytest.importorskip("modelload.sidecar.settings")


def injected_env(spec: dict[str, Any]) -> dict[str, str]:
    model = ResolvedModel(name="m", namespace="ns", spec=parse_spec(spec), bytes=1 << 30, tensors=100)
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "app", "image": "app:1"}]}}
    (op,) = [
        o
        for o in build_patch(pod=pod, model=model, sidecar=InjectedSidecar(), native=True)
        if "initContainers" in o["path"]
    ]
    (container,) = op["value"]
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = f"<{ref['name']}/{ref['key']}>"  # what the kubelet would put there
        else:
            env[item["name"]] = item["value"]
    assert container["command"] == ["modelload", "sidecar"]
    return env


def test_a_full_spec_reaches_the_sidecar_as_asked() -> None:
    env = injected_env(
        {
            "source": "s3://models/llama.tensors",
            "format": "tensorizer",
            "readers": 24,
            "chunkSize": "16MiB",
            "verifyHashes": False,
            "priority": ["embed", "layers.0."],
            "credentialsSecretRef": {"name": "creds"},
            "decryptionKeySecretRef": {"name": "key", "key": "model.key"},
            "s3": {"endpoint": "http://minio.storage:9000", "region": "eu-west-1", "addressing": "path"},
        }
    )
    settings = sidecar_settings.parse_settings([], env)
    engine = settings.engine
    assert engine.source == "s3://models/llama.tensors"
    assert engine.format == "tensorizer"
    assert engine.readers == 24
    assert engine.chunk_size == 16 << 20
    assert engine.verify is False
    assert tuple(engine.priority) == ("embed", "layers.0.")
    assert engine.segment == Path("/run/modelload/model.seg")
    assert engine.key_file == Path("/var/run/secrets/modelload/key/model.key")
    assert settings.api.port == 8479
    assert settings.api.host == "0.0.0.0"
    assert settings.notify.endpoint == "ipc:///run/modelload/notify.sock"
    s3 = settings.sources.s3
    assert (s3.endpoint_url, s3.region, s3.addressing, s3.unsigned) == (
        "http://minio.storage:9000",
        "eu-west-1",
        "path",
        False,
    )
    assert env["AWS_ACCESS_KEY_ID"] == "<creds/AWS_ACCESS_KEY_ID>"


def test_an_unsigned_model_with_a_password_reaches_the_sidecar() -> None:
    env = injected_env(
        {
            "source": "https://models.example.com/m.tensors",
            "passwordSecretRef": {"name": "pw"},
            "s3": {"unsigned": True},
        }
    )
    settings = sidecar_settings.parse_settings([], env)
    assert settings.engine.password_file == Path("/var/run/secrets/modelload/password/password")
    assert settings.sources.s3.unsigned is True
    assert settings.engine.verify is True


def test_the_inference_containers_point_where_the_sidecar_writes() -> None:
    env = injected_env({"source": "s3://models/m.tensors"})
    app = {e["name"]: e["value"] for e in target_env()}
    assert app["MODELLOAD_SEGMENT"] == env["MODELLOAD_SEGMENT"]
    assert app["MODELLOAD_NOTIFY"] == env["MODELLOAD_NOTIFY"]
    assert app["MODELLOAD_STATUS_URL"].endswith(":" + env["MODELLOAD_PORT"])
