"""``hf://`` and ``oci://`` ModelLoads: the spec's rules (the CRD's CEL and the parser agree), the operator's
index read through the Hub stand-in and a real token-authenticated registry with the ModelLoad's Secrets, and
the pod the webhook makes (the token or Docker config mounted in the sidecar only).
"""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest

from modelload.loader.errors import ConfigError
from modelload.operator.hubs import HUB_TOKEN_DIR, REGISTRY_AUTH_DIR
from modelload.operator.injection import build_patch
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import SPEC_RULES, parse_spec
from modelload.operator.settings import InjectedSidecar
from modelload.sidecar.sources.oci import push_directory
from tests.operator.conftest import NAMESPACE, create_modelload, model_bytes, posted_events, resolved, secret
from tests.operator.test_private_http import _cel
from tests.operator.test_resolving import failed, ready_condition
from tests.operator.test_webhook import pod
from tests.support.fixtures import REGISTRY_USERS
from tests.support.hub import HubServer
from tests.support.registry import RegistryServer

sidecar_settings = pytest.importorskip("modelload.sidecar.settings")

TOKEN = "hf_operator-token-EXAMPLE-0b7e"
USER, PASSWORD = next(iter(REGISTRY_USERS.items()))
OCI = "oci://registry.example:5000/models/llama:v1"


def docker_config(host: str, user: str = USER, password: str = PASSWORD) -> bytes:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": auth}}}).encode()


# --- the spec ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "hf://org/model"},
        {"source": "hf://org/model@v1.0", "hub": {"tokenSecretRef": {"name": "hf"}}},
        {"source": "hf://org/model", "hub": {"endpoint": "https://mirror.internal"}},
        {"source": OCI, "registry": {"credentialsSecretRef": {"name": "pull"}, "plainHttp": True}},
        {"source": "oci://ghcr.io/org/m@sha256:" + "a" * 64},
        {"source": "hf://org/model", "credentialsSecretRef": {"name": "s3"}},
        {"source": OCI, "credentialsSecretRef": {"name": "s3"}},
        {"source": "s3://models/m.tensors", "hub": {"tokenSecretRef": {"name": "hf"}}},
        {"source": "hf://org/model", "registry": {"plainHttp": True}},
        {"source": OCI, "hub": {"endpoint": "https://mirror.internal"}},
        {"source": "http://h/m.safetensors", "registry": {}},
    ],
)
def test_the_crds_cel_rules_refuse_what_the_parser_refuses(spec: dict[str, Any]) -> None:
    try:
        parse_spec(spec)
        parser_accepts = True
    except ConfigError:
        parser_accepts = False
    assert all(_cel(rule, spec) for rule, _ in SPEC_RULES) == parser_accepts


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("oci://reg.example/m@sha256:abc", "spec.source: .*sha256"),
        ("hf://org/model@%20v1", "spec.source: .*revision"),
        ("oci://reg.example/Model:v1", "spec.source"),
    ],
)
def test_a_uri_the_pattern_lets_through_is_refused_by_the_sidecars_own_parser(
    source: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_spec({"source": source})


# --- the pod -----------------------------------------------------------------------------------------------


def injected(spec: dict[str, Any]) -> dict[str, Any]:
    model = ResolvedModel(name="m", namespace=NAMESPACE, spec=parse_spec(spec), bytes=1 << 30, tensors=10)
    original = pod("m")
    ops = build_patch(pod=original, model=model, sidecar=InjectedSidecar(), native=True)
    return jsonpatch.apply_patch(copy.deepcopy(original), ops)


def test_the_hub_token_is_a_file_in_the_sidecar_only_and_the_sidecar_reads_it(tmp_path: Path) -> None:
    spec = {
        "source": "hf://org/model@v1.0",
        "hub": {"endpoint": "https://mirror.internal", "tokenSecretRef": {"name": "hf", "key": "hf-token"}},
    }
    patched = injected(spec)
    kubernetes_validate.validate(patched, "1.31", strict=True)
    (sidecar,) = patched["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    assert env["MODELLOAD_HF_TOKEN_FILE"] == f"{HUB_TOKEN_DIR}/hf-token"
    assert env["MODELLOAD_HF_ENDPOINT"] == "https://mirror.internal"
    for app in patched["spec"]["containers"]:
        assert all(m["name"] != "modelload-hub-token" for m in app.get("volumeMounts", []))
    mounted = tmp_path / Path(env["MODELLOAD_HF_TOKEN_FILE"]).relative_to("/")
    mounted.parent.mkdir(parents=True)
    mounted.write_text(TOKEN + "\n")
    settings = sidecar_settings.parse_settings([], {**env, "MODELLOAD_HF_TOKEN_FILE": str(mounted)})
    assert (settings.sources.hub.token, settings.sources.hub.endpoint) == (TOKEN, "https://mirror.internal")


def test_the_registry_credentials_are_a_file_in_the_sidecar_only_and_the_sidecar_reads_them(
    tmp_path: Path,
) -> None:
    spec = {"source": OCI, "registry": {"credentialsSecretRef": {"name": "pull"}, "plainHttp": True}}
    patched = injected(spec)
    kubernetes_validate.validate(patched, "1.31", strict=True)
    (volume,) = [v for v in patched["spec"]["volumes"] if v["name"] == "modelload-registry-auth"]
    assert volume["secret"]["items"] == [{"key": ".dockerconfigjson", "path": ".dockerconfigjson"}]
    (sidecar,) = patched["spec"]["initContainers"]
    env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
    assert env["MODELLOAD_REGISTRY_AUTH_FILE"] == f"{REGISTRY_AUTH_DIR}/.dockerconfigjson"
    assert env["MODELLOAD_REGISTRY_PLAIN_HTTP"] == "registry.example:5000"
    mounted = tmp_path / "dockerconfigjson"
    mounted.write_bytes(docker_config("registry.example:5000"))
    settings = sidecar_settings.parse_settings([], {**env, "MODELLOAD_REGISTRY_AUTH_FILE": str(mounted)})
    assert settings.sources.registry.uses_plain_http("registry.example:5000")
    assert "registry.example:5000" in settings.sources.registry.auths
    assert PASSWORD not in repr(settings)


# --- the operator, against KMock, the Hub stand-in and a real registry -----------------------------------


def shown(kube: Any, obj: dict[str, Any], caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join([repr(obj), repr(posted_events(kube)), caplog.text])


async def test_a_private_hub_repository_resolves_with_the_secrets_token(
    kube,
    operator,
    api,
    hub: HubServer,
    caplog,
) -> None:
    hub.commit("org/tiny", {"model.safetensors": model_bytes(tensors=3, rows=32), "config.json": b"{}"},
               private=True, readers={TOKEN})  # fmt: skip
    kube.objects["v1/secrets", NAMESPACE, "hf"] = secret("hf", {"token": TOKEN.encode()})
    spec = {"source": "hf://org/tiny", "hub": {"endpoint": hub.url, "tokenSecretRef": {"name": "hf"}}}
    await create_modelload(api, "hubbed", spec)
    obj = await resolved(kube, "hubbed")
    assert (obj["status"]["tensors"], obj["status"]["format"]) == (3, "safetensors")
    assert TOKEN not in shown(kube, obj, caplog)


async def test_a_gated_repository_is_an_accessdenied_condition_saying_how_to_get_access(
    kube,
    operator,
    api,
    hub: HubServer,
    caplog,
) -> None:
    hub.commit("org/gated", {"model.safetensors": model_bytes()}, gated=True, readers={"hf_someone"})
    await create_modelload(api, "gated", {"source": "hf://org/gated", "hub": {"endpoint": hub.url}})
    obj = await failed(kube, "gated", "AccessDenied")
    message = ready_condition(obj)["message"]
    assert "gated" in message and "accept the repository's terms" in message


async def test_an_oci_artifact_resolves_with_the_dockerconfigjson_secret(
    kube,
    operator,
    api,
    token_registry: RegistryServer,
    tmp_path: Path,
    caplog,
) -> None:
    from modelload.sidecar.sources import RegistrySettings, SourceSettings, auths_from_docker_config

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(model_bytes(tensors=4, rows=16))
    (folder / "config.json").write_bytes(b"{}")
    config = docker_config(token_registry.host)
    auths = auths_from_docker_config(config, where="test")
    registry = RegistrySettings(auths=auths, plain_http=(token_registry.host,))
    push_directory(folder, token_registry.uri("operator/tiny", "v1"), SourceSettings(registry=registry))
    kube.objects["v1/secrets", NAMESPACE, "pull"] = secret("pull", {".dockerconfigjson": config})
    spec = {
        "source": token_registry.uri("operator/tiny", "v1"),
        "registry": {"credentialsSecretRef": {"name": "pull"}, "plainHttp": True},
    }
    await create_modelload(api, "pulled", spec)
    obj = await resolved(kube, "pulled")
    assert obj["status"]["tensors"] == 4
    assert PASSWORD not in shown(kube, obj, caplog)


async def test_a_dockerconfigjson_for_another_registry_is_a_badcredentials_condition(
    kube, operator, api
) -> None:
    kube.objects["v1/secrets", NAMESPACE, "other"] = secret(
        "other", {".dockerconfigjson": docker_config("ghcr.io")}
    )
    spec = {"source": OCI, "registry": {"credentialsSecretRef": {"name": "other"}}}
    await create_modelload(api, "other", spec)
    obj = await failed(kube, "other", "BadCredentials")
    message = ready_condition(obj)["message"]
    assert "no credentials for registry.example:5000" in message and "ghcr.io" in message
    assert PASSWORD not in message
