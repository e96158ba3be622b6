"""``headersSecretRef``: a private HTTP(S) source's token, from a Secret, for the operator's index read and
the sidecar only; ``credentialsSecretRef`` on an HTTP source and ``headersSecretRef`` elsewhere are refused.

The operator runs under kopf against KMock; the model sits behind nginx's ``/private/`` location, which
answers 401 to any request without ``Authorization: Bearer`` :data:`~tests.support.nginx.TOKEN`.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.injection import build_patch
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import SPEC_RULES, parse_spec, spec_schema
from modelload.operator.settings import InjectedSidecar
from modelload.operator.sidecar_env import HEADERS_DIR
from tests.operator.conftest import NAMESPACE, create_modelload, model_bytes, posted_events, resolved, secret
from tests.operator.test_resolving import failed, ready_condition, settled
from tests.operator.test_webhook import admit, pod, review
from tests.support.fixtures import nginx  # noqa: F401 - a fixture
from tests.support.nginx import TOKEN, NginxServer

sidecar_settings = pytest.importorskip("modelload.sidecar.settings")

WRONG = TOKEN.replace("EXAMPLE", "REVOKED")
HUB = "https://hub.example/org/model/resolve/main/model.safetensors"


# --- the spec ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"source": HUB, "credentialsSecretRef": {"name": "s3-reader"}},
            r"spec.credentialsSecretRef: .* reference it with headersSecretRef",
        ),
        (
            {"source": "s3://models/m.safetensors", "headersSecretRef": {"name": "hub-token"}},
            r"spec.headersSecretRef: headersSecretRef is for http\(s\):// sources: an s3:// source takes "
            "credentialsSecretRef",
        ),
        (
            {"source": "file:///models/m.safetensors", "headersSecretRef": {"name": "t"}},
            "spec.headersSecretRef",
        ),
        ({"source": HUB, "headersSecretRef": {"name": "Hub_Token"}}, r"spec.headersSecretRef.name"),
    ],
)
def test_a_secret_of_the_wrong_kind_for_the_source_is_refused_naming_the_right_field(
    spec: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_spec(spec)


def test_a_headers_secret_on_an_http_source_parses_with_its_default_key() -> None:
    ref = parse_spec({"source": HUB, "headersSecretRef": {"name": "hub-token"}}).headers_secret_ref
    assert ref is not None and (ref.name, ref.key) == ("hub-token", "token")


def _cel(rule: str, spec: dict[str, Any]) -> bool:
    """The spec's CEL rules use has(), startsWith(), !, && and || only: evaluate them as Python."""
    text = re.sub(r"has\(self\.(\w+)\)", r"('\1' in spec)", rule)
    text = re.sub(r"self\.source\.startsWith\(('[^']*')\)", r"spec['source'].startswith(\1)", text)
    text = text.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    return bool(eval(text, {"spec": spec}))  # our own rules, on test data


@pytest.mark.parametrize(
    "spec",
    [
        {"source": HUB, "headersSecretRef": {"name": "t"}},
        {"source": "http://artifacts.internal/m.tensors", "headersSecretRef": {"name": "t"}},
        {"source": HUB, "credentialsSecretRef": {"name": "c"}},
        {"source": "s3://models/m.tensors", "credentialsSecretRef": {"name": "c"}},
        {"source": "s3://models/m.tensors", "headersSecretRef": {"name": "t"}},
        {"source": "file:///m.tensors", "headersSecretRef": {"name": "t"}},
        {"source": HUB},
    ],
)
def test_the_crds_cel_rules_refuse_what_the_parser_refuses(spec: dict[str, Any]) -> None:
    try:
        parse_spec(spec)
        parser_accepts = True
    except ConfigError:
        parser_accepts = False
    assert all(_cel(rule, spec) for rule, _ in SPEC_RULES) == parser_accepts
    assert [r["rule"] for r in spec_schema()["x-kubernetes-validations"]] == [r for r, _ in SPEC_RULES]


# --- the pod -----------------------------------------------------------------------------------------------


def injected(spec: dict[str, Any]) -> dict[str, Any]:
    model = ResolvedModel(name="m", namespace=NAMESPACE, spec=parse_spec(spec), bytes=1 << 30, tensors=10)
    original = pod("m")
    original["spec"]["containers"].append({"name": "metrics", "image": "exporter:1"})
    ops = build_patch(pod=original, model=model, sidecar=InjectedSidecar(), native=True)
    return jsonpatch.apply_patch(copy.deepcopy(original), ops)


def test_the_token_is_a_read_only_file_of_one_key_in_the_sidecar_only() -> None:
    patched = injected({"source": HUB, "headersSecretRef": {"name": "hub-token", "key": "hf"}})
    kubernetes_validate.validate(patched, "1.31", strict=True)
    (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload-headers"]
    assert volume["secret"] == {
        "secretName": "hub-token",
        "items": [{"key": "hf", "path": "hf"}],
        "defaultMode": 0o444,
    }
    (sidecar,) = patched["spec"]["initContainers"]
    assert {"name": "modelload-headers", "mountPath": HEADERS_DIR, "readOnly": True} in sidecar[
        "volumeMounts"
    ]
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["MODELLOAD_HEADER_FILE"] == f"{HEADERS_DIR}/hf"
    assert not any(k.startswith("AWS_") for k in env)
    for app in patched["spec"]["containers"]:
        assert all(m["name"] != "modelload-headers" for m in app.get("volumeMounts", []))
        assert all(e["name"] != "MODELLOAD_HEADER_FILE" for e in app.get("env", []))


def test_the_sidecar_reads_the_mounted_file_the_webhook_names(tmp_path: Path) -> None:
    patched = injected({"source": HUB, "headersSecretRef": {"name": "hub-token"}})
    (sidecar,) = patched["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    mounted = tmp_path / Path(env["MODELLOAD_HEADER_FILE"]).relative_to("/")  # the kubelet's mount, here
    mounted.parent.mkdir(parents=True)
    mounted.write_text(TOKEN)
    settings = sidecar_settings.parse_settings([], {**env, "MODELLOAD_HEADER_FILE": str(mounted)})
    assert settings.engine.source == HUB
    assert settings.sources.http.headers.items() == (("Authorization", f"Bearer {TOKEN}"),)


# --- the operator, against KMock and nginx -------------------------------------------------------------


@pytest.fixture
def private_url(nginx: NginxServer) -> str:  # noqa: F811 - the fixture
    nginx.put("operator-private/tiny.safetensors", model_bytes(tensors=3, rows=32))
    return nginx.private_url("operator-private/tiny.safetensors")


def shown(kube: Any, obj: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join([repr(obj), repr(posted_events(kube)), caplog.text])


async def test_the_operator_reads_a_private_models_index_with_the_secrets_token_and_injects_it(
    kube, operator, api, private_url, caplog
) -> None:
    kube.objects["v1/secrets", NAMESPACE, "hub-token"] = secret(
        "hub-token", {"token": TOKEN.encode() + b"\n"}
    )
    await create_modelload(api, "private", {"source": private_url, "headersSecretRef": {"name": "hub-token"}})
    obj = await resolved(kube, "private")
    assert (obj["status"]["tensors"], obj["status"]["format"]) == (3, "safetensors")
    answer = await admit(operator, operator.ca_pem, review(pod("private")))
    patched = jsonpatch.JsonPatch.from_string(base64.b64decode(answer["response"]["patch"]).decode()).apply(
        pod("private")
    )
    (sidecar,) = patched["spec"]["initContainers"]
    assert {"name": "MODELLOAD_HEADER_FILE", "value": f"{HEADERS_DIR}/token"} in sidecar["env"]
    assert all(m["name"] != "modelload-headers" for m in patched["spec"]["containers"][0]["volumeMounts"])
    assert TOKEN not in shown(kube, obj, caplog) + repr(answer)


async def test_a_refused_token_is_an_accessdenied_condition_naming_the_url_not_the_token(
    kube, operator, api, private_url, caplog
) -> None:
    kube.objects["v1/secrets", NAMESPACE, "stale"] = secret(
        "stale", {"hf": f"Authorization: Bearer {WRONG}".encode()}
    )
    spec = {"source": private_url, "headersSecretRef": {"name": "stale", "key": "hf"}}
    await create_modelload(api, "refused", spec)
    obj = await failed(kube, "refused", "AccessDenied")
    message = ready_condition(obj)["message"]
    assert message.startswith(f"{private_url} refused the configured token or headers (HTTP 401")
    assert "Secret" in message
    assert WRONG not in shown(kube, obj, caplog)


async def test_a_malformed_secret_value_is_a_badheaders_condition_naming_the_line(
    kube, operator, api, caplog
) -> None:
    kube.objects["v1/secrets", NAMESPACE, "pasted"] = secret(
        "pasted", {"token": f"Bearer {TOKEN}\n".encode()}
    )
    await create_modelload(api, "pasted", {"source": HUB, "headersSecretRef": {"name": "pasted"}})
    obj = await failed(kube, "pasted", "BadHeaders")
    message = ready_condition(obj)["message"]
    assert message.startswith("the Secret 'pasted' key 'token', line 1: a bare token is one word")
    assert "kubectl create secret generic pasted --from-literal=token=<token>" in message
    assert TOKEN not in shown(kube, obj, caplog)


async def test_a_missing_headers_secret_is_named(kube, operator, api) -> None:
    await create_modelload(api, "nosecret", {"source": HUB, "headersSecretRef": {"name": "absent"}})
    obj = await failed(kube, "nosecret", "SecretNotFound")
    assert (
        "the Secret 'absent' (the source's token or headers) does not exist"
        in ready_condition(obj)["message"]
    )


async def test_s3_credentials_on_an_http_source_are_a_badspec_condition_naming_headerssecretref(
    kube, operator, api
) -> None:
    await create_modelload(api, "wrongref", {"source": HUB, "credentialsSecretRef": {"name": "s3-reader"}})
    obj = await settled(kube, "wrongref")
    condition = ready_condition(obj)
    assert (condition["status"], condition["reason"], obj["status"]["phase"]) == (
        "False",
        "BadSpec",
        "Failed",
    )
    assert "reference it with headersSecretRef" in condition["message"]
