"""The sidecar's environment in an injected pod, and the loader's in its target containers.

What the operator tells the sidecar is its configuration (docs/contracts.md, "Variables"): the ModelLoad's
spec as ``MODELLOAD_*`` variables, credentials as ``secretKeyRef`` references (never their values), and the
paths of the Secret files :mod:`.injection` mounts. What a target container gets is where the segment, the
notify socket, the status API and the model directory are.
"""

from __future__ import annotations

from typing import Any

from modelload.loader.sizes import parse_size
from modelload.loader.wiring import (
    HUGE_PAGES_SEGMENT_PATH,
    MODEL_DIR_ENV,
    MODEL_DIR_PATH,
    NOTIFY_ENDPOINT,
    NOTIFY_ENV,
    SEGMENT_ENV,
    SEGMENT_PATH,
    STATUS_PORT,
    STATUS_URL_ENV,
    status_url,
)
from modelload.operator import hubs
from modelload.operator.cloud_sources import cloud_env, scheme_of
from modelload.operator.peers import peer_env
from modelload.operator.quantity import parse_bytes
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import ModelLoadSpec

__all__ = [
    "HEADERS_DIR",
    "KEY_DIR",
    "PASSWORD_DIR",
    "huge_pages",
    "segment_path",
    "sidecar_env",
    "target_env",
]

KEY_DIR = "/var/run/secrets/modelload/key"
PASSWORD_DIR = "/var/run/secrets/modelload/password"  # noqa: S105 - a path
HEADERS_DIR = "/var/run/secrets/modelload/headers"


def huge_pages(spec: ModelLoadSpec) -> str | None:
    """The huge page size of the model's segment (``spec.memory.hugePages``), or None."""
    return spec.memory.huge_pages if spec.memory is not None else None


def segment_path(spec: ModelLoadSpec) -> str:
    """Where the segment is in a pod: on the huge-page volume when the spec asks for huge pages."""
    return HUGE_PAGES_SEGMENT_PATH if huge_pages(spec) else SEGMENT_PATH


def _memory_env(spec: ModelLoadSpec) -> list[dict[str, Any]]:
    """The sidecar's memory mode and slots (spec.memory); nothing for the defaults, full and auto."""
    memory = spec.memory
    if memory is None:
        return []
    slots = [] if memory.slots == "auto" else [{"name": "MODELLOAD_SLOTS", "value": memory.slots}]
    if memory.mode == "full":
        return slots
    env = [
        *slots,
        {"name": "MODELLOAD_MEMORY_MODE", "value": memory.mode},
        {"name": "MODELLOAD_CONSUMERS", "value": str(memory.consumers)},
    ]
    if memory.ring_size is not None:
        env.append({"name": "MODELLOAD_RING_SIZE", "value": str(parse_bytes(memory.ring_size))})
    if memory.wait_timeout_seconds is not None:
        env.append({"name": "MODELLOAD_MEMORY_WAIT_TIMEOUT", "value": str(memory.wait_timeout_seconds)})
    return env


def sidecar_env(model: ResolvedModel, *, port: int) -> list[dict[str, Any]]:
    """The sidecar's configuration (docs/contracts.md, "Variables") and credential references."""
    spec = model.spec
    env: list[dict[str, Any]] = [
        {"name": "MODELLOAD_SOURCE", "value": spec.source},
        {"name": SEGMENT_ENV, "value": segment_path(spec)},
        {"name": NOTIFY_ENV, "value": NOTIFY_ENDPOINT},
        {"name": MODEL_DIR_ENV, "value": MODEL_DIR_PATH},
        {"name": "MODELLOAD_FORMAT", "value": spec.format},
        {"name": "MODELLOAD_READERS", "value": str(spec.readers)},
        {"name": "MODELLOAD_CHUNK_SIZE", "value": str(parse_size(spec.chunk_size))},
        {"name": "MODELLOAD_VERIFY", "value": "true" if spec.verify_hashes else "false"},
        {"name": "MODELLOAD_PORT", "value": str(port)},
        {"name": "MODELLOAD_HOST", "value": "0.0.0.0"},  # noqa: S104 - kubelet probes come from outside the pod
    ]
    if spec.priority:
        env.append({"name": "MODELLOAD_PRIORITY", "value": ",".join(spec.priority)})
    env += _memory_env(spec)
    if spec.files:
        env.append({"name": "MODELLOAD_FILES", "value": ",".join(spec.files)})
    s3 = spec.s3
    if s3 is not None:
        if s3.endpoint:
            env.append({"name": "MODELLOAD_S3_ENDPOINT", "value": s3.endpoint})
        if s3.region:
            env.append({"name": "MODELLOAD_S3_REGION", "value": s3.region})
        if s3.addressing != "auto":
            env.append({"name": "MODELLOAD_S3_ADDRESSING", "value": s3.addressing})
        if s3.unsigned:
            env.append({"name": "MODELLOAD_S3_UNSIGNED", "value": "true"})
    env += cloud_env(spec)
    creds = spec.credentials_secret_ref
    if creds is not None and scheme_of(spec.source) == "s3" and not (s3 is not None and s3.unsigned):
        env += [
            _secret_env("AWS_ACCESS_KEY_ID", creds.name, creds.access_key_id_key, optional=False),
            _secret_env("AWS_SECRET_ACCESS_KEY", creds.name, creds.secret_access_key_key, optional=False),
            _secret_env("AWS_SESSION_TOKEN", creds.name, creds.session_token_key, optional=True),
        ]
    if spec.decryption_key_secret_ref is not None:
        env.append({"name": "MODELLOAD_KEY_FILE", "value": f"{KEY_DIR}/{spec.decryption_key_secret_ref.key}"})
    if spec.password_secret_ref is not None:
        path = f"{PASSWORD_DIR}/{spec.password_secret_ref.key}"
        env.append({"name": "MODELLOAD_PASSWORD_FILE", "value": path})
    if spec.headers_secret_ref is not None:
        path = f"{HEADERS_DIR}/{spec.headers_secret_ref.key}"
        env.append({"name": "MODELLOAD_HEADER_FILE", "value": path})
    env += hubs.sidecar_env(spec)
    if spec.peers:
        env += peer_env(name=model.name, namespace=model.namespace)
    return env


def _secret_env(name: str, secret: str, key: str, *, optional: bool) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}}


def target_env(port: int = STATUS_PORT, *, segment: str = SEGMENT_PATH) -> list[dict[str, str]]:
    """What the loader library in an inference container reads (docs/contracts.md, "Variables")."""
    return [
        {"name": SEGMENT_ENV, "value": segment},
        {"name": NOTIFY_ENV, "value": NOTIFY_ENDPOINT},
        {"name": STATUS_URL_ENV, "value": status_url(port)},
        {"name": MODEL_DIR_ENV, "value": MODEL_DIR_PATH},
    ]
