"""A ModelLoad gets its status from its model's index, or a condition that says what is wrong.

The real handlers run under kopf against KMock; models are in moto's S3 server, which enforces IAM for the
tests that pass credentials, so a model is only readable with the keys from the ModelLoad's Secret.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.operator.conftest import (
    MODELLOADS,
    NAMESPACE,
    create_modelload,
    current,
    model_bytes,
    patch_modelload,
    posted_events,
    request_bodies,
    resolved,
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


async def test_a_modelload_gets_format_tensors_and_bytes_from_its_s3_model(
    kube, operator, moto_s3, api
) -> None:
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
        await create_modelload(
            api,
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
    assert status["segmentBytes"] > status["bytes"]
    assert status["volumeSizeLimit"].endswith("Mi")
    assert keys.reader.secret_key not in repr(obj)


async def failed(kube: Any, name: str, reason: str) -> dict[str, Any]:
    """The ModelLoad once its Ready condition is False with ``reason``."""
    return await wait_for(
        lambda: (
            (obj := current(kube, MODELLOADS, NAMESPACE, name))
            and (cond := ready_condition(obj))
            and cond["status"] == "False"
            and cond["reason"] == reason
            and obj
        ),
        what=f"ModelLoad {name} to fail with {reason}",
    )


def warnings_posted(kube: Any, reason: str) -> list[dict[str, Any]]:
    return [e for e in posted_events(kube) if e.get("type") == "Warning" and e.get("reason") == reason]


async def test_a_bad_uri_is_a_permanent_badsource_condition(kube, operator, api) -> None:
    await create_modelload(api, "typo", {"source": "s4://models/llama.tensors"})
    obj = await failed(kube, "typo", "BadSource")
    assert obj["status"]["phase"] == "Failed"
    assert "s3://bucket/key" in ready_condition(obj)["message"]
    assert "bytes" not in obj["status"]
    await wait_for(lambda: warnings_posted(kube, "BadSource"), what="a BadSource Event")


async def test_a_missing_secret_is_named_in_the_condition(kube, operator, moto_s3, api) -> None:
    uri = moto_s3.put(BUCKET, "tiny.safetensors", model_bytes())
    spec = {"source": uri, "credentialsSecretRef": {"name": "nope"}, "s3": {"endpoint": moto_s3.endpoint}}
    await create_modelload(api, "nosecret", spec)
    obj = await failed(kube, "nosecret", "SecretNotFound")
    assert (
        "the Secret 'nope' (S3 credentials) does not exist in namespace 'serving'"
        in ready_condition(obj)["message"]
    )
    assert obj["status"]["phase"] == "Failed"


async def test_a_secret_without_the_named_key_lists_the_keys_it_has(kube, operator, moto_s3, api) -> None:
    uri = moto_s3.put(BUCKET, "tiny.safetensors", model_bytes())
    kube.objects["v1/secrets", NAMESPACE, "partial"] = secret("partial", {"AWS_ACCESS_KEY_ID": b"AKIA"})
    spec = {"source": uri, "credentialsSecretRef": {"name": "partial"}, "s3": {"endpoint": moto_s3.endpoint}}
    await create_modelload(api, "partial", spec)
    obj = await failed(kube, "partial", "SecretKeyMissing")
    assert "no key 'AWS_SECRET_ACCESS_KEY'" in ready_condition(obj)["message"]
    assert "it has: AWS_ACCESS_KEY_ID" in ready_condition(obj)["message"]


async def test_a_missing_object_is_a_sourcenotfound_condition(kube, operator, moto_s3, api) -> None:
    moto_s3.create_bucket(BUCKET)
    spec = {
        "source": f"s3://{BUCKET}/not-uploaded.safetensors",
        "s3": {"endpoint": moto_s3.endpoint, "unsigned": True},
    }
    await create_modelload(api, "missing", spec)
    obj = await failed(kube, "missing", "SourceNotFound")
    assert "not-uploaded.safetensors" in ready_condition(obj)["message"]


async def test_keys_the_store_refuses_are_an_accessdenied_condition_that_never_shows_the_keys(
    kube, operator, moto_s3, caplog, api
) -> None:
    uri = moto_s3.put(BUCKET, "tiny.safetensors", model_bytes())
    with moto_s3.enforce_auth() as keys:
        kube.objects["v1/secrets", NAMESPACE, "stranger"] = secret(
            "stranger",
            {
                "AWS_ACCESS_KEY_ID": keys.stranger.access_key.encode(),
                "AWS_SECRET_ACCESS_KEY": keys.stranger.secret_key.encode(),
            },
        )
        spec = {
            "source": uri,
            "credentialsSecretRef": {"name": "stranger"},
            "s3": {"endpoint": moto_s3.endpoint},
        }
        await create_modelload(api, "denied", spec)
        obj = await failed(kube, "denied", "AccessDenied")
        await wait_for(lambda: warnings_posted(kube, "AccessDenied"), what="an AccessDenied Event")
    for leaked in keys.stranger.secrets():
        assert leaked not in repr(obj)
        assert leaked not in request_bodies(kube)
        assert leaked not in caplog.text


async def test_a_file_that_is_not_a_model_is_a_badmodel_condition(kube, operator, nginx, api) -> None:
    url = nginx.put("operator/page.html", b"<html><body>Access denied</body></html>" * 10)
    await create_modelload(api, "html", {"source": url})
    obj = await failed(kube, "html", "BadModel")
    assert "HTML" in ready_condition(obj)["message"]
    assert obj["status"]["phase"] == "Failed"


async def test_a_decryption_key_of_the_wrong_size_is_refused_before_reading(
    kube, operator, model_url, api
) -> None:
    kube.objects["v1/secrets", NAMESPACE, "model-key"] = secret(
        "model-key", {"key": base64.b64encode(b"k" * 32)}
    )
    spec = {"source": model_url, "decryptionKeySecretRef": {"name": "model-key"}}
    await create_modelload(api, "badkey", spec)
    obj = await failed(kube, "badkey", "BadKey")
    assert "holds 44 bytes; a decryption key is exactly 32 raw bytes" in ready_condition(obj)["message"]


async def test_a_key_for_a_file_that_is_not_encrypted_is_refused(kube, operator, model_url, api) -> None:
    kube.objects["v1/secrets", NAMESPACE, "model-key"] = secret("model-key", {"key": bytes(range(32))})
    spec = {"source": model_url, "decryptionKeySecretRef": {"name": "model-key"}}
    await create_modelload(api, "plain", spec)
    await failed(kube, "plain", "NotEncrypted")


async def test_an_unreachable_store_is_retried_and_reported_as_transient(kube, operator, api) -> None:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {
        "source": "s3://bucket-x/model.tensors",
        "s3": {"endpoint": f"http://127.0.0.1:{port}", "unsigned": True},
    }
    await create_modelload(api, "offline", spec)
    obj = await failed(kube, "offline", "SourceUnreadable")
    assert obj["status"]["phase"] == "Retrying"
    assert "(retrying)" in ready_condition(obj)["message"]


async def test_a_spec_change_re_reads_the_model(kube, operator, model_url, nginx, api) -> None:

    await create_modelload(api, "moving", {"source": nginx.url("operator/absent.safetensors")})
    await failed(kube, "moving", "SourceNotFound")
    await patch_modelload(api, "moving", {"spec": {"source": model_url}})
    obj = await resolved(kube, "moving")
    assert ready_condition(obj)["status"] == "True"
    assert obj["status"]["tensors"] == 4


async def test_the_ready_transition_time_moves_only_when_the_status_flips() -> None:
    from modelload.operator.conditions import set_condition

    first = set_condition(None, type="Ready", status="False", reason="A", message="a", generation=1, now="t1")
    same = set_condition(first, type="Ready", status="False", reason="B", message="b", generation=2, now="t2")
    flipped = set_condition(
        same, type="Ready", status="True", reason="C", message="c", generation=2, now="t3"
    )
    assert [c["lastTransitionTime"] for c in (first[0], same[0], flipped[0])] == ["t1", "t1", "t3"]
    assert same[0]["reason"] == "B" and same[0]["observedGeneration"] == 2


async def test_a_priority_entry_matching_no_tensor_is_a_badspec_condition(
    kube, operator, model_url, api
) -> None:
    spec = {"source": model_url, "priority": ["layers.1.", "layer.2."]}
    await create_modelload(api, "typo-priority", spec)
    obj = await failed(kube, "typo-priority", "BadSpec")
    assert "spec.priority[1]: 'layer.2.' matches no tensor" in ready_condition(obj)["message"]


async def test_a_model_directory_is_sized_from_every_shard_and_its_small_files(
    kube, operator, moto_s3, api
) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=70, layers=3)
    content = hfdir.files(weights, shards=3)
    for name, data in content.items():
        moto_s3.put(BUCKET, f"hub/llama/{name}", data)
    with moto_s3.enforce_auth() as keys:
        kube.objects["v1/secrets", NAMESPACE, "s3-dir-reader"] = secret(
            "s3-dir-reader",
            {
                "AWS_ACCESS_KEY_ID": keys.reader.access_key.encode(),
                "AWS_SECRET_ACCESS_KEY": keys.reader.secret_key.encode(),
            },
        )
        await create_modelload(
            api,
            "llama-dir",
            {
                "source": f"s3://{BUCKET}/hub/llama/",
                "credentialsSecretRef": {"name": "s3-dir-reader"},
                "s3": {"endpoint": moto_s3.endpoint, "region": "us-east-1", "addressing": "path"},
            },
        )
        obj = await settled(kube, "llama-dir")
    status = obj["status"]
    assert ready_condition(obj)["status"] == "True", ready_condition(obj)
    assert status["tensors"] == len(weights)
    assert status["files"] == 3
    assert status["bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    shards = [data for name, data in content.items() if name.endswith(".safetensors")]
    assert status["fileBytes"] == sum(len(data) for data in shards)
    small = sum(len(data) for name, data in content.items() if name in hfdir.SMALL_FILES) + len(
        content["model.safetensors.index.json"]
    )
    assert status["segmentBytes"] >= status["bytes"] + small


async def test_a_directory_whose_index_names_a_missing_shard_is_retried_as_not_found(
    kube, operator, moto_s3, api
) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    for name, data in hfdir.files(models.state_dict(seed=71, layers=2), shards=2).items():
        if name != "model-00002-of-00002.safetensors":
            moto_s3.put(BUCKET, f"hub/broken/{name}", data, public=True)
    await create_modelload(
        api,
        "broken-dir",
        {
            "source": f"s3://{BUCKET}/hub/broken/",
            "s3": {
                "endpoint": moto_s3.endpoint,
                "region": "us-east-1",
                "addressing": "path",
                "unsigned": True,
            },
        },
    )
    obj = await failed(kube, "broken-dir", "SourceNotFound")
    assert "model-00002-of-00002.safetensors" in ready_condition(obj)["message"]


async def test_a_modelload_whose_name_no_label_can_hold_says_to_set_podlabelvalue(
    kube, operator, model_url, api
) -> None:
    long_name = "llama-3-8b-instruct-" + "q" * 50  # 70 characters: a valid name, too long for a label value
    await create_modelload(api, long_name, {"source": model_url})
    obj = await failed(kube, long_name, "BadSpec")
    message = ready_condition(obj)["message"]
    assert "spec.podLabelValue" in message and "63" in message
    assert obj["status"]["phase"] == "Failed"

    await create_modelload(api, long_name[:64], {"source": model_url, "podLabelValue": "llama"})
    await resolved(kube, long_name[:64])


async def test_a_failure_the_operator_does_not_know_is_a_condition_and_a_retry_not_silence(
    kube, operator, model_url, api, monkeypatch, caplog
) -> None:
    from modelload.operator import handlers

    async def broken(**_: Any) -> Any:
        raise RuntimeError("a bug, with text that may hold anything: s3cr3t")

    monkeypatch.setattr(handlers, "resolve", broken)
    await create_modelload(api, "tiny", {"source": model_url})
    obj = await failed(kube, "tiny", "OperatorError")
    message = ready_condition(obj)["message"]
    assert obj["status"]["phase"] == "Retrying"
    assert "RuntimeError" in message and "s3cr3t" not in message
    await wait_for(lambda: warnings_posted(kube, "OperatorError"), what="an OperatorError Event")
    assert any(r.exc_info and "tiny" in r.getMessage() for r in caplog.records)  # the traceback is logged

    monkeypatch.undo()  # the bug fixed: the next retry resolves it
    await resolved(kube, "tiny")


async def test_a_secret_of_thousands_of_keys_still_gives_a_condition_the_crd_accepts(
    kube, operator, moto_s3, api
) -> None:
    import jsonschema

    from tests.operator.test_crd import openapi_schema

    uri = moto_s3.put(BUCKET, "tiny.safetensors", model_bytes())
    keys = {f"unrelated-setting-number-{i:05d}": b"x" for i in range(3000)}  # a team's everything-Secret
    kube.objects["v1/secrets", NAMESPACE, "everything"] = secret("everything", keys)
    spec = {"source": uri, "credentialsSecretRef": {"name": "everything"}}
    await create_modelload(api, "crowded", {**spec, "s3": {"endpoint": moto_s3.endpoint}})
    obj = await failed(kube, "crowded", "SecretKeyMissing")
    # The API server refuses a status whose condition message passes the CRD's bound: the ModelLoad would
    # keep no condition at all (KMock does not check it: the test does).
    jsonschema.validate(obj["status"], openapi_schema()["properties"]["status"])
    message = ready_condition(obj)["message"]
    assert "it has: unrelated-setting-number-00000" in message and "more" in message


def test_a_condition_message_of_any_length_is_cut_to_what_the_crd_admits() -> None:
    from modelload.operator.conditions import set_condition
    from modelload.operator.status import MESSAGE_MAX_LENGTH

    message = "start " + "x" * 50_000 + " end"
    (condition,) = set_condition(
        None, type="Ready", status="False", reason="R", message=message, generation=1, now="t"
    )
    assert len(condition["message"]) <= MESSAGE_MAX_LENGTH
    assert condition["message"].startswith("start ") and condition["message"].endswith(" end")


async def test_a_source_that_never_finishes_its_index_is_a_retrying_condition_and_one_read_not_a_pile(
    kube, operator, model_url, api, monkeypatch, caplog
) -> None:
    import threading

    from modelload.operator import resolve as resolving

    real = resolving.read_summary
    release = threading.Event()
    calls: list[str] = []

    def dripping(spec: Any, **kwargs: Any) -> Any:  # an origin that trickles its index out
        calls.append(spec.source)
        release.wait(60)
        return real(spec, **kwargs)

    monkeypatch.setattr(resolving, "read_summary", dripping)
    monkeypatch.setattr(resolving, "READ_DEADLINE", 0.3, raising=False)
    await create_modelload(api, "drip", {"source": model_url})
    obj = await failed(kube, "drip", "SourceUnreadable")
    assert obj["status"]["phase"] == "Retrying"
    assert "has not given the model's index" in ready_condition(obj)["message"]
    await wait_for(lambda: len(warnings_posted(kube, "SourceUnreadable")) >= 1, what="a warning Event")

    def retries() -> int:
        return sum(1 for r in caplog.records if "Handler 'resolve' failed temporarily" in r.getMessage())

    await wait_for(lambda: retries() >= 3, what="three tries of the resolve")
    assert len(calls) == 1, "each retry waited on the one read in progress instead of starting another"
    release.set()
    await resolved(kube, "drip")  # the try after the read ends takes its result
