"""The Kubernetes side of peers (``spec.peers: true``): a headless Service and a token Secret per ModelLoad.

Sidecars find each other through DNS: a headless Service selecting the model's pods with
``publishNotReadyAddresses`` resolves to every pod, loading ones included (a loading pod is not Ready, and
it is exactly the one that serves what it has so far). The pods need no RBAC for this, unlike listing
Endpoints. The token that peers present to each other is a random value in a Secret the operator creates
once; both objects are owned by the ModelLoad, so deleting it deletes them.

The webhook wires each sidecar to them (:func:`peer_env`, :func:`peer_volume`).
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from modelload.loader.errors import ModelloadError
from modelload.loader.wiring import PEER_PORT
from modelload.operator.kube import (
    Kube,
    KubeConflictError,
    KubeNotFoundError,
    KubeUnavailableError,
    owner_uids,
)
from modelload.operator.schema import GROUP, MODEL_LABEL, VERSION

__all__ = [
    "PeersSecretTakenError",
    "PeersServiceTakenError",
    "ensure_peer_objects",
    "peer_env",
    "peer_names",
    "peer_volume",
    "service_body",
    "token_secret_body",
]

T = TypeVar("T")

PEER_VOLUME = "modelload-peer-token"
PEER_DIR = "/var/run/secrets/modelload/peer"
TOKEN_KEY = "token"  # noqa: S105 - the Secret's key name
PEER_DNS_ENV = "MODELLOAD_PEER_DNS"
"""Set on peered sidecars only: :mod:`.pods` tells a pod's peering from it."""
PEER_PORT_ENV = "MODELLOAD_PEER_PORT"
"""Where a peered sidecar serves, and where :mod:`.fleet` asks it for its stats."""


_SERVICE_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A Service's name as the API server requires it: a DNS-1035 label (a letter first, no dots, 63 at most)."""
_DIGEST_CHARS = 12


def peer_names(name: str) -> str:
    """The Service's and the Secret's name for ModelLoad ``name``: ``<name>-peers`` when that is a valid
    Service name; else (a dot, a leading digit, a long name: all valid ModelLoad names) a Service name made
    of the name's legal characters and a digest of the whole name, so two ModelLoads never share a Service
    or a token however long or alike their names are."""
    plain = f"{name}-peers"
    if _SERVICE_NAME.match(plain):
        return plain
    digest = hashlib.sha256(name.encode()).hexdigest()[:_DIGEST_CHARS]
    suffix = f"-{digest}-peers"
    stem = re.sub(r"[^a-z0-9-]+", "-", name.lower())[: 63 - len(suffix) - 3].strip("-")
    if not stem[:1].isalpha():
        stem = f"ml-{stem}".rstrip("-")
    return f"{stem}{suffix}"


def _owner(name: str, uid: str) -> list[dict[str, Any]]:
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "ModelLoad", "name": name, "uid": uid}]


def service_body(*, name: str, uid: str, label_value: str) -> dict[str, Any]:
    """The headless Service over the model's pods; loading pods resolve too."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": peer_names(name), "ownerReferences": _owner(name, uid)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {MODEL_LABEL: label_value},
            "ports": [{"name": "peers", "port": PEER_PORT, "targetPort": PEER_PORT, "protocol": "TCP"}],
        },
    }


def token_secret_body(*, name: str, uid: str) -> dict[str, Any]:
    """A Secret with a fresh random token (256 bits)."""
    token = secrets.token_urlsafe(32)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": peer_names(name), "ownerReferences": _owner(name, uid)},
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode("ascii")},
    }


class PeersSecretTakenError(ModelloadError):
    """The peers' token Secret exists and is not this ModelLoad's; the message says whose and what to do.
    Retried: a ModelLoad deleted and created again meets its predecessor's until the collector takes it."""

    condition = "PeersSecretTaken"


class PeersServiceTakenError(ModelloadError):
    """The peers' Service exists and is not this ModelLoad's: its selector is someone else's, so sidecars
    would ask pods that are not the model's. Retried, as :class:`PeersSecretTakenError`."""

    condition = "PeersServiceTaken"


async def ensure_peer_objects(
    kube: Kube, *, namespace: str, body: Mapping[str, Any], label_value: str
) -> None:
    """Create the Service and the Secret when missing; existing ones are kept (a token never rotates under
    running pods) when they are this ModelLoad's. A Secret of that name that is not (its predecessor's,
    not collected yet; one of the team's own) is :class:`PeersSecretTakenError`: pods would mount it, and
    a token that is not the model's, or none."""
    meta = body.get("metadata") or {}
    name, uid = str(meta.get("name")), str(meta.get("uid") or "")
    secret = token_secret_body(name=name, uid=uid)
    owners = await _create_or_read(
        lambda: kube.create_secret(namespace, secret),
        lambda: kube.secret_owners(namespace, secret["metadata"]["name"]),
    )
    if owners is not None and uid and uid not in owners:
        whose = (
            "owned by another ModelLoad (one deleted and not collected yet, when this one was created again)"
            if owners
            else "not the operator's (a Secret of the namespace's own)"
        )
        raise PeersSecretTakenError(
            f"the Secret {secret['metadata']['name']!r}, which this model's sidecars would take their "
            f"peer token from, exists and is {whose}: retrying; if it stays, delete it (or rename this "
            "ModelLoad)"
        )
    await _ensure_service(kube, namespace, service_body(name=name, uid=uid, label_value=label_value), uid=uid)


_CREATE_TRIES = 3


async def _create_or_read(
    create: Callable[[], Awaitable[None]], read: Callable[[], Awaitable[T]]
) -> T | None:
    """Create an object, or read the one already there: None when this call made it. A create refused as
    existing and a read that then finds nothing means the object was deleted in between (a team removing
    its own Service, the collector taking a predecessor's): create again rather than fail the handler on a
    404 that no longer says anything about the object; one that keeps coming and going is retried later."""
    for _ in range(_CREATE_TRIES):
        try:
            await create()
            return None
        except KubeConflictError:  # made earlier (by this operator, or another replica), or not ours
            pass
        try:
            return await read()
        except KubeNotFoundError:
            continue
    raise KubeUnavailableError("the object was deleted each time it was found to exist: retrying")


async def _ensure_service(kube: Kube, namespace: str, service: Mapping[str, Any], *, uid: str) -> None:
    """Create the Service, or bring an existing one of this ModelLoad's to select the pods that ask for the
    model now: ``spec.podLabelValue`` may have changed since it was made, and a Service still selecting the
    old value would give the sidecars no peer (or pods that no longer ask for this model)."""
    name = service["metadata"]["name"]
    existing = await _create_or_read(
        lambda: kube.create_service(namespace, service), lambda: kube.read_service(namespace, name)
    )
    if existing is None:
        return
    owners = owner_uids(existing)
    if uid and uid not in owners:
        whose = "owned by another ModelLoad (not collected yet)" if owners else "not the operator's"
        raise PeersServiceTakenError(
            f"the Service {name!r}, through which this model's sidecars find each other, exists and is "
            f"{whose}: retrying; if it stays, delete it (or rename this ModelLoad)"
        )
    wanted = service["spec"]["selector"]
    selector = (existing.get("spec") or {}).get("selector") or {}
    if selector != wanted:  # a merge patch: keys no longer wanted are removed by a null
        patch = {**dict.fromkeys(set(selector) - set(wanted)), **wanted}
        try:
            await kube.patch_service(namespace, name, {"spec": {"selector": patch}})
        except KubeNotFoundError:  # deleted since the read: the retry creates it
            raise KubeUnavailableError(
                f"the Service {name!r} was deleted while being updated: retrying"
            ) from None


def peer_env(*, name: str, namespace: str) -> list[dict[str, str]]:
    """The sidecar's peer variables: the Service's DNS name, the port and the token file."""
    return [
        {"name": PEER_DNS_ENV, "value": f"{peer_names(name)}.{namespace}.svc"},
        {"name": PEER_PORT_ENV, "value": str(PEER_PORT)},
        {"name": "MODELLOAD_PEER_TOKEN_FILE", "value": f"{PEER_DIR}/{TOKEN_KEY}"},
    ]


def peer_volume(*, name: str, mode: int) -> dict[str, Any]:
    return {
        "name": PEER_VOLUME,
        "secret": {
            "secretName": peer_names(name),
            "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
            "defaultMode": mode,
        },
    }
