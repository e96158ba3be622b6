"""The Hugging Face Hub and OCI registries in the operator: their Secrets, and how the sidecar gets them.

- ``hf://`` sources: ``spec.hub.endpoint`` (a mirror) and ``spec.hub.tokenSecretRef`` (a user access token).
  The operator reads the token to list the repository; the webhook mounts the key as a file in the sidecar
  only (``MODELLOAD_HF_TOKEN_FILE``), as it does every other credential.
- ``oci://`` sources: ``spec.registry.credentialsSecretRef``, a ``kubernetes.io/dockerconfigjson`` Secret
  (the one a pod's ``imagePullSecrets`` names), and ``spec.registry.plainHttp``. The operator reads the Docker
  config to resolve the artifact; the webhook mounts it in the sidecar only
  (``MODELLOAD_REGISTRY_AUTH_FILE``).

Values are parsed here as the sidecar parses them, so a malformed Secret is reported on the ModelLoad
(naming the Secret and the key, never the value) before any pod mounts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from modelload.loader.errors import ConfigError
from modelload.operator.conditions import named
from modelload.operator.schema import ModelLoadSpec
from modelload.sidecar.sources import auths_from_docker_config, parse_oci_uri

__all__ = [
    "HUB_TOKEN_DIR",
    "REGISTRY_AUTH_DIR",
    "HubAccess",
    "hub_token",
    "registry_auths",
    "sidecar_env",
    "sidecar_mounts",
    "volumes",
]

HUB_TOKEN_VOLUME = "modelload-hub-token"  # noqa: S105 - a volume name
HUB_TOKEN_DIR = "/var/run/secrets/modelload/hub"  # noqa: S105 - a path
REGISTRY_AUTH_VOLUME = "modelload-registry-auth"
REGISTRY_AUTH_DIR = "/var/run/secrets/modelload/registry"


@dataclass(frozen=True)
class HubAccess:
    """What the operator's own index read needs from a ModelLoad's hub or registry Secret."""

    hub_token: str | None = field(default=None, repr=False)
    registry_auths: Mapping[str, Mapping[str, str]] = field(default_factory=dict, repr=False)


def hub_token(value: bytes, *, where: str) -> str:
    """The token a Secret key holds: one word of printable ASCII (a ConfigError names ``where``, not it)."""
    try:
        token = value.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not text: it must hold a Hugging Face token") from None
    if not token or any(c.isspace() for c in token) or not token.isprintable() or not token.isascii():
        raise ConfigError(f"{where} must hold one token (hf_...), one word of printable ASCII")
    return token


def registry_auths(value: bytes, *, where: str, source: str) -> dict[str, dict[str, str]]:
    """The ``auths`` of a dockerconfigjson value; a ConfigError when it has none for ``source``'s registry
    (a Secret for another registry is almost always a mistake, and would pull anonymously)."""
    auths = auths_from_docker_config(value, where=where)
    registry = parse_oci_uri(source).registry
    if registry not in auths:
        known = named(auths, none="none")
        raise ConfigError(
            f"{where} has no credentials for {registry} (it has: {known}): create it with kubectl create "
            f"secret docker-registry NAME --docker-server={registry} --docker-username=... "
            "--docker-password=..."
        )
    return auths


def _secret_volume(name: str, secret: str, key: str, mode: int) -> dict[str, Any]:
    return {
        "name": name,
        "secret": {"secretName": secret, "items": [{"key": key, "path": key}], "defaultMode": mode},
    }


def volumes(spec: ModelLoadSpec, *, mode: int) -> list[dict[str, Any]]:
    """The pod's volumes for the hub token or the registry credentials (none for other sources)."""
    found = []
    if spec.hub is not None and spec.hub.token_secret_ref is not None:
        ref = spec.hub.token_secret_ref
        found.append(_secret_volume(HUB_TOKEN_VOLUME, ref.name, ref.key, mode))
    if spec.registry is not None and spec.registry.credentials_secret_ref is not None:
        auth = spec.registry.credentials_secret_ref
        found.append(_secret_volume(REGISTRY_AUTH_VOLUME, auth.name, auth.key, mode))
    return found


def sidecar_mounts(spec: ModelLoadSpec) -> list[dict[str, Any]]:
    """Where the sidecar (and only the sidecar) mounts them."""
    found = []
    if spec.hub is not None and spec.hub.token_secret_ref is not None:
        found.append({"name": HUB_TOKEN_VOLUME, "mountPath": HUB_TOKEN_DIR, "readOnly": True})
    if spec.registry is not None and spec.registry.credentials_secret_ref is not None:
        found.append({"name": REGISTRY_AUTH_VOLUME, "mountPath": REGISTRY_AUTH_DIR, "readOnly": True})
    return found


def sidecar_env(spec: ModelLoadSpec) -> list[dict[str, Any]]:
    """The sidecar's hub and registry variables (docs/contracts.md)."""
    env: list[dict[str, Any]] = []
    hub = spec.hub
    if hub is not None and hub.endpoint:
        env.append({"name": "MODELLOAD_HF_ENDPOINT", "value": hub.endpoint})
    if hub is not None and hub.token_secret_ref is not None:
        path = f"{HUB_TOKEN_DIR}/{hub.token_secret_ref.key}"
        env.append({"name": "MODELLOAD_HF_TOKEN_FILE", "value": path})
    registry = spec.registry
    if registry is not None and registry.credentials_secret_ref is not None:
        path = f"{REGISTRY_AUTH_DIR}/{registry.credentials_secret_ref.key}"
        env.append({"name": "MODELLOAD_REGISTRY_AUTH_FILE", "value": path})
    if registry is not None and registry.plain_http:
        env.append({"name": "MODELLOAD_REGISTRY_PLAIN_HTTP", "value": parse_oci_uri(spec.source).registry})
    return env


def source_settings(spec: ModelLoadSpec, access: HubAccess | None) -> dict[str, Any]:
    """The ``hub`` and ``registry`` fields of the operator's own SourceSettings for ``spec``."""
    from modelload.sidecar.sources import DEFAULT_HUB_ENDPOINT, HubSettings, RegistrySettings, parse_oci_uri

    access = access or HubAccess()
    endpoint = (spec.hub.endpoint if spec.hub else None) or DEFAULT_HUB_ENDPOINT
    plain: tuple[str, ...] = ()
    if spec.registry is not None and spec.registry.plain_http:
        plain = (parse_oci_uri(spec.source).registry,)
    return {
        "hub": HubSettings(endpoint=endpoint, token=access.hub_token),
        "registry": RegistrySettings(auths=access.registry_auths, plain_http=plain),
    }
