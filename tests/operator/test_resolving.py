"""A ModelLoad gets its status from its model's index, or a condition that says what is wrong.

The real handlers run under kopf against KMock; models are in moto's S3 server, which enforces IAM for the
tests that pass credentials, so a model is only readable with the keys from the ModelLoad's Secret.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    current,
    model_bytes,
    modelload,
    secret,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("no_aws_env")

BUCKET = "operator-models"


def ready_condition(obj: dict[str, Any] | None) -> dict[str, Any] | None:
    for condition in ((obj or {}).get("status") or {}).get("conditions") or ():
        if condition["type"] == "Ready":
            return dict(condition)
    return None


async def settled(kube: Any, name: str, *, timeout: float = 15.0) -> dict[str, Any]:
    """The ModelLoad once its Ready condition is set."""
    return await wait_for(
        lambda: (obj := current(kube, MODELLOADS, NAMESPACE, name)) and ready_condition(obj) and obj,
        timeout=timeout,
        what=f"ModelLoad {name} to get a Ready condition",
    )


async def test_a_modelload_gets_format_tensors_and_bytes_from_its_s3_model(kube, operator, moto_s3) -> None:
    data = model_bytes(tensors=3, rows=64)
    uri = moto_s3.put(BUCKET, "tiny.safetensors", data)
    with moto_s3.enforce_auth() as keys:
        kube.objects["v1/secrets", NAMESPACE, "s3-reader"] = secret(
            "s3-reader",
            {
                "AWS_ACCESS_KEY_ID": keys.reader.access_key.encode(),
                "AWS_SECRET_ACCESS_KEY": keys.reader.secret_key.encode(),
            },
        )
        kube.objects[MODELLOADS, NAMESPACE, "tiny"] = modelload(
            "tiny",
            {
                "source": uri,
                "credentialsSecretRef": {"name": "s3-reader"},
                "s3": {"endpoint": moto_s3.endpoint, "region": "us-east-1", "addressing": "path"},
            },
        )
        obj = await settled(kube, "tiny")
    status = obj["status"]
    assert ready_condition(obj)["status"] == "True", ready_condition(obj)
    assert status["phase"] == "Ready"
    assert status["format"] == "safetensors"
    assert status["tensors"] == 3
    assert status["bytes"] == 3 * 64 * 16 * 4
    assert status["fileBytes"] == len(data)
    assert status["encrypted"] is False
    assert status["volumeSizeLimit"].endswith("Mi")
    assert keys.reader.secret_key not in repr(obj)
