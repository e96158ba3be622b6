"""The pod mutation: a JSON patch that adds the loader sidecar, its memory volume, mounts and environment.

Pure: a pod and a resolved ModelLoad in, RFC 6902 operations out. The webhook never returns a whole pod,
because a full replacement drops fields that the webhook's own libraries do not know (the failure that
strips ``restartPolicy`` from native sidecars, KEP-753's first rollout hazard).

What a pod gets (docs/contracts.md, "Pod wiring"):

* volume ``modelload``: ``emptyDir{medium: Memory, sizeLimit}`` sized from the model (:mod:`sizing`);
* with ``spec.memory.hugePages``, volume ``modelload-hugepages``: ``emptyDir{medium: HugePages-<size>}``
  at /run/modelload-hugepages in the sidecar and the targets, holding the segment (``MODELLOAD_SEGMENT``
  points there); the sidecar requests and limits ``hugepages-<size>`` for it (it takes every page), and the
  memory volume keeps the model directory and the notify socket, which hugetlbfs cannot hold;
* the sidecar ``modelload``: an init container with ``restartPolicy: Always`` (a native sidecar) or, where
  the cluster lacks them, a regular container that never exits; probes on /startupz, /readyz, /healthz;
  its status port is declared as ``metrics`` (what a PodMonitor scrapes: ``/metrics``). KNative's rule of
  one port across containers is checked on the Revision's template, never on the pods its Deployment makes,
  which is where this injection happens (as a service mesh's proxy declares its own port there);
* S3 and Azure credentials as the sidecar's env from the Secret (``secretKeyRef``), a GCS service-account key
  as a file (:mod:`cloud_sources`); the decryption key or password,
  and an HTTP(S) source's token or header lines (``MODELLOAD_HEADER_FILE``), as files mounted read-only in
  the sidecar only (a Secret volume holding the one key): no other container can read them;
* target containers (all of them, or those the pod's ``modelload.dev/containers`` annotation or the spec
  names) get the volume at /run/modelload and ``MODELLOAD_SEGMENT``/``_NOTIFY``/``_STATUS_URL``;
* who may read the segment: the sidecar writes it ``0640`` (it holds decrypted weights). A pod with an
  ``fsGroup`` needs nothing more (the volume's files belong to that group, which every container has). A
  pod without one gets the sidecar's ``runAsGroup`` set to the segment group (:class:`InjectedSidecar`
  ``segment_group``) and that group added to ``spec.securityContext.supplementalGroups``, so the app reads the
  segment whatever user it runs as, and processes outside the pod's containers do not.

A container already named ``modelload`` in a pod the webhook has not injected (no ``modelload.dev/injected``
annotation) is refused with a message that says to rename it: injecting beside it would clash, and treating it
as the sidecar would wire the app to a volume that never comes.

Idempotent: a pod that already has the sidecar gets only what its target containers still lack (empty for
a pod sent twice; the missing pieces for containers another webhook added when the API server re-invokes
this one under ``reinvocationPolicy: IfNeeded``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from modelload.loader.errors import ConfigError, ModelloadError
from modelload.loader.wiring import (
    HUGE_PAGES_MOUNT_PATH,
    HUGE_PAGES_SEGMENT_PATH,
    MOUNT_PATH,
    SEGMENT_PATH,
)
from modelload.operator import hubs
from modelload.operator.cloud_sources import cloud_mounts, cloud_volumes
from modelload.operator.peers import PEER_DIR, PEER_VOLUME, peer_volume
from modelload.operator.pods import GENERATION_ANNOTATION
from modelload.operator.quantity import parse_bytes
from modelload.operator.resource import ResolvedModel
from modelload.operator.schema import MODEL_LABEL
from modelload.operator.settings import InjectedSidecar
from modelload.operator.sidecar_env import (
    HEADERS_DIR,
    KEY_DIR,
    PASSWORD_DIR,
    huge_pages,
    sidecar_env,
    target_env,
)
from modelload.operator.sizing import Sizing, plan_sizing

__all__ = [
    "CONTAINERS_ANNOTATION",
    "INJECTED_ANNOTATION",
    "SIDECAR_NAME",
    "InjectionError",
    "build_patch",
    "has_sidecar",
    "pointer",
    "source_query_problem",
]

SIDECAR_NAME = "modelload"
VOLUME_NAME = "modelload"
HUGE_PAGES_VOLUME = "modelload-hugepages"
KEY_VOLUME = "modelload-key"
PASSWORD_VOLUME = "modelload-password"  # noqa: S105 - a volume name
HEADERS_VOLUME = "modelload-headers"
CONTAINERS_ANNOTATION = "modelload.dev/containers"
INJECTED_ANNOTATION = "modelload.dev/injected"
MODE_ANNOTATION = "modelload.dev/sidecar-mode"
METRICS_PORT_NAME = "metrics"
"""The sidecar's declared port (its status API, /metrics included): the chart's PodMonitor scrapes it."""
SECRET_FILE_MODE = 0o444
"""World-readable inside the one container that mounts it: the sidecar runs as a non-root user that does
not own the files, and no other container mounts the volume."""

Op = dict[str, Any]


class InjectionError(ModelloadError):
    """The pod cannot be given the model as asked (a bad annotation, a name clash); the message says why."""

    kind = "bad_pod"


def pointer(*parts: str | int) -> str:
    """A JSON pointer (RFC 6901) with ``~`` and ``/`` escaped in each part."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def has_sidecar(pod: Mapping[str, Any]) -> bool:
    """Whether this webhook already injected ``pod`` (its annotation, and the container it added)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    return INJECTED_ANNOTATION in annotations and _has_container_named(pod, SIDECAR_NAME)


def _has_container_named(pod: Mapping[str, Any], name: str) -> bool:
    spec = pod.get("spec") or {}
    containers = list(spec.get("containers") or []) + list(spec.get("initContainers") or [])
    return any(c.get("name") == name for c in containers)


def _check_own_name(pod: Mapping[str, Any]) -> None:
    if _has_container_named(pod, SIDECAR_NAME) and not has_sidecar(pod):
        raise InjectionError(
            f"the pod already has a container named {SIDECAR_NAME!r}, the name of modelload's sidecar: "
            "rename that container (the sidecar's name is fixed so that probes and the operator find it)"
        )


def build_patch(
    *, pod: Mapping[str, Any], model: ResolvedModel, sidecar: InjectedSidecar, native: bool
) -> list[Op]:
    """The JSON patch that gives ``pod`` the model; ``[]`` when it already has everything.

    Raises :class:`InjectionError` for a pod that cannot be injected as asked, and
    :class:`~modelload.loader.errors.ConfigError` when the model's overrides cannot hold it.
    """
    _check_own_name(pod)
    _check_injected_for(pod, model)
    _check_source(model)
    spec = pod.get("spec") or {}
    containers: list[Mapping[str, Any]] = list(spec.get("containers") or [])
    targets = _target_indices(pod, containers, model)
    _check_clashes(spec, containers, targets, huge=huge_pages(model.spec) is not None)
    ops: list[Op] = []
    if not has_sidecar(pod):
        _check_completes(spec, native=native)
        sizing = plan_sizing(
            model_bytes=model.bytes,
            tensors=model.tensors,
            spec=model.spec,
            defaults=sidecar.sizing,
            segment=model.segment_bytes,
        )
        volumes = _new_volumes(spec, _volumes(model, sizing), sizing)
        ops += _append(("spec", "volumes"), spec.get("volumes"), volumes)
        group = _segment_group(spec, sidecar)
        container = _sidecar_container(model, sidecar, sizing.resources, native=native, group=group)
        where = ("spec", "initContainers") if native else ("spec", "containers")
        ops += _append(where, spec.get(where[1]), [container])
        marks = {INJECTED_ANNOTATION: model.name, MODE_ANNOTATION: _mode(native)}
        if model.generation is not None:
            marks[GENERATION_ANNOTATION] = str(model.generation)
        ops += _annotations(pod, marks)
        if group is not None:
            ops += _supplemental_group(spec, group)
    huge = huge_pages(model.spec)
    for index in targets:
        ops += _wire_target(index, containers[index], huge=huge)
    return ops


def _mode(native: bool) -> str:
    return "native" if native else "regular"


def _segment_group(spec: Mapping[str, Any], sidecar: InjectedSidecar) -> int | None:
    """The group the sidecar writes the segment as; None when the pod's fsGroup already owns the volume."""
    if (spec.get("securityContext") or {}).get("fsGroup") is not None or not sidecar.segment_group:
        return None
    return sidecar.segment_group


def _supplemental_group(spec: Mapping[str, Any], group: int) -> list[Op]:
    """Give every container of the pod the segment's group, so the app can read a 0640 segment."""
    context = spec.get("securityContext")
    if context is None:
        return [
            {
                "op": "add",
                "path": pointer("spec", "securityContext"),
                "value": {"supplementalGroups": [group]},
            }
        ]
    existing = context.get("supplementalGroups")
    if existing is not None and group in existing:
        return []
    return _append(("spec", "securityContext", "supplementalGroups"), existing, [group])


def _check_completes(spec: Mapping[str, Any], *, native: bool) -> None:
    """A pod that runs to completion (a Job's) finishes when all its containers have: a regular sidecar,
    which never exits, would keep it running for good. A native sidecar is stopped with the pod."""
    policy = spec.get("restartPolicy")
    if not native and policy in ("Never", "OnFailure"):
        raise InjectionError(
            f"the pod has restartPolicy {policy} (a Job's pod runs to completion), and the sidecar would be "
            "a regular container, which never exits: the pod would never finish. Native sidecars (Kubernetes "
            "1.29 and later, the chart's sidecar.mode native or auto) stop with the pod; or run the model "
            "in a Deployment"
        )


def _check_injected_for(pod: Mapping[str, Any], model: ResolvedModel) -> None:
    """A pod already injected for another ModelLoad (a copy of a running pod, relabelled) keeps that model's
    sidecar and source: admitting it under this label would count it among this model's pods."""
    injected = ((pod.get("metadata") or {}).get("annotations") or {}).get(INJECTED_ANNOTATION)
    if has_sidecar(pod) and injected != model.name:
        raise InjectionError(
            f"the pod was injected for ModelLoad {injected!r} (annotation {INJECTED_ANNOTATION}, and its "
            f"sidecar loads that model) but its label {MODEL_LABEL} asks for ModelLoad {model.name!r}: "
            f"create it from its controller's template, or without the {SIDECAR_NAME!r} container and the "
            "modelload.dev/ annotations, so that it is injected for the model it names"
        )


def _new_volumes(
    spec: Mapping[str, Any], volumes: Sequence[dict[str, Any]], sizing: Sizing
) -> list[dict[str, Any]]:
    """The injected volumes the pod lacks. One it already has under the same name is used only when it is
    what the injection means: the memory volume with room for the model (a pod may size its own), the huge
    pages of the model's page size, or exactly the Secret volume the webhook adds (a pod copied from an
    injected one). Another volume under those names would be mounted in the sidecar in place of the
    ModelLoad's own: another key, token or set of headers."""
    present = {v.get("name"): v for v in spec.get("volumes") or ()}
    new = []
    for volume in volumes:
        name = volume["name"]
        own = present.get(name)
        if own is None:
            new.append(volume)
        elif name == VOLUME_NAME:
            _check_own_memory_volume(own, sizing)
        elif name == HUGE_PAGES_VOLUME:
            medium = (own.get("emptyDir") or {}).get("medium")
            if medium != volume["emptyDir"]["medium"]:
                raise InjectionError(
                    f"the pod's volume {name!r} has medium {medium}, and the model's segment takes "
                    f"{volume['emptyDir']['medium']} (its spec.memory.hugePages): remove that volume, or "
                    "change its medium"
                )
        elif own != volume:
            raise InjectionError(
                f"the pod already has a volume named {name!r}, which modelload's sidecar mounts for the "
                "ModelLoad's own Secret: rename that volume"
            )
    return new


def _check_own_memory_volume(volume: Mapping[str, Any], sizing: Sizing) -> None:
    limit = (volume.get("emptyDir") or {}).get("sizeLimit")
    try:
        size = None if limit is None else parse_bytes(limit)
    except ConfigError as exc:
        raise InjectionError(f"the pod's volume {VOLUME_NAME!r}: sizeLimit {exc}") from None
    if size is not None and size < sizing.volume_bytes:
        raise InjectionError(
            f"the pod's volume {VOLUME_NAME!r} has sizeLimit {limit}, below the {sizing.volume_size_limit} "
            "the model takes: remove that volume (the webhook adds one of the right size), or enlarge it"
        )


def _check_source(model: ResolvedModel) -> None:
    problem = source_query_problem(model.spec.source)
    if problem is not None:
        raise InjectionError(f"ModelLoad {model.name!r}: spec.source {problem}")


def source_query_problem(source: str) -> str | None:
    """Why a URL with a query string (a presigned URL, a SAS token) is refused, or None for other sources.

    The source reaches the sidecar as a plain environment value, so a signature in it would sit in clear in
    every pod's spec (readable by anyone who may read pods, and in audit logs); it also expires (a week at
    most for S3) while the ModelLoad lives on. The operator refuses it rather than hiding it in a Secret.
    """
    if not source.startswith(("http://", "https://")) or "?" not in source:
        return None
    return (
        "carries a query string (a presigned URL's signature, or a token), which would be copied in clear "
        "into every pod's spec and expires while the ModelLoad lives on: give the plain URL with its token "
        "in a Secret (spec.headersSecretRef), or an s3:// source with spec.credentialsSecretRef"
    )


# --- what goes where ---------------------------------------------------------------------------------------


def _append(path: Sequence[str | int], existing: Any, items: Sequence[Any]) -> list[Op]:
    """Add ``items`` to the array at ``path``: one ``add`` of a new array, or ``/-`` adds to an existing."""
    if not items:
        return []
    if existing is None:
        return [{"op": "add", "path": pointer(*path), "value": list(items)}]
    return [{"op": "add", "path": pointer(*path, "-"), "value": item} for item in items]


def _annotations(pod: Mapping[str, Any], values: Mapping[str, str]) -> list[Op]:
    existing = (pod.get("metadata") or {}).get("annotations")
    if existing is None:
        return [{"op": "add", "path": pointer("metadata", "annotations"), "value": dict(values)}]
    return [
        {"op": "add", "path": pointer("metadata", "annotations", k), "value": v} for k, v in values.items()
    ]


def _volumes(model: ResolvedModel, sizing: Sizing) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": VOLUME_NAME, "emptyDir": {"medium": "Memory", "sizeLimit": sizing.volume_size_limit}}
    ]
    if sizing.huge_pages is not None:  # bounded by the pod's hugepages request, which takes no sizeLimit
        volumes.append({"name": HUGE_PAGES_VOLUME, "emptyDir": {"medium": sizing.huge_pages.medium}})
    key_ref = model.spec.decryption_key_secret_ref
    if key_ref is not None:
        volumes.append(_secret_volume(KEY_VOLUME, key_ref.name, key_ref.key))
    password_ref = model.spec.password_secret_ref
    if password_ref is not None:
        volumes.append(_secret_volume(PASSWORD_VOLUME, password_ref.name, password_ref.key))
    headers_ref = model.spec.headers_secret_ref
    if headers_ref is not None:
        volumes.append(_secret_volume(HEADERS_VOLUME, headers_ref.name, headers_ref.key))
    volumes += hubs.volumes(model.spec, mode=SECRET_FILE_MODE)
    if model.spec.peers:
        volumes.append(peer_volume(name=model.name, mode=SECRET_FILE_MODE))
    volumes += cloud_volumes(model.spec, mode=SECRET_FILE_MODE)
    return volumes


def _secret_volume(name: str, secret: str, key: str) -> dict[str, Any]:
    return {
        "name": name,
        "secret": {
            "secretName": secret,
            "items": [{"key": key, "path": key}],
            "defaultMode": SECRET_FILE_MODE,
        },
    }


def _sidecar_container(
    model: ResolvedModel,
    sidecar: InjectedSidecar,
    resources: Mapping[str, Any],
    *,
    native: bool,
    group: int | None,
) -> dict[str, Any]:
    options = model.spec.sidecar
    mounts = _model_mounts(huge=huge_pages(model.spec))
    if model.spec.decryption_key_secret_ref is not None:
        mounts.append({"name": KEY_VOLUME, "mountPath": KEY_DIR, "readOnly": True})
    if model.spec.password_secret_ref is not None:
        mounts.append({"name": PASSWORD_VOLUME, "mountPath": PASSWORD_DIR, "readOnly": True})
    if model.spec.headers_secret_ref is not None:
        mounts.append({"name": HEADERS_VOLUME, "mountPath": HEADERS_DIR, "readOnly": True})
    mounts += hubs.sidecar_mounts(model.spec)
    if model.spec.peers:
        mounts.append({"name": PEER_VOLUME, "mountPath": PEER_DIR, "readOnly": True})
    mounts += cloud_mounts(model.spec)
    probe = {"port": sidecar.port, "scheme": "HTTP"}
    container: dict[str, Any] = {
        "name": SIDECAR_NAME,
        "image": (options.image if options and options.image else None) or sidecar.image,
        "imagePullPolicy": (options.image_pull_policy if options else None) or sidecar.image_pull_policy,
        "command": ["modelload", "sidecar"],
        "env": sidecar_env(model, port=sidecar.port)
        + (
            [{"name": "MODELLOAD_LOG_FORMAT", "value": sidecar.log_format}]
            if sidecar.log_format != "text"
            else []
        ),
        "resources": {k: dict(v) for k, v in resources.items()},
        "volumeMounts": mounts,
        "ports": [{"name": METRICS_PORT_NAME, "containerPort": sidecar.port, "protocol": "TCP"}],
        # Passes once the segment header and manifest are published: a native sidecar then lets the app
        # start while the weights stream. 600 tries a second cover a slow first byte from object storage.
        "startupProbe": {
            "httpGet": {"path": "/startupz", **probe},
            "periodSeconds": 1,
            "timeoutSeconds": 2,
            "failureThreshold": 600,
        },
        # Ready as soon as one probe passes; unready only after three misses in a row, so a status API slowed
        # by readers saturating the CPU does not take a loaded pod out of its Service.
        "readinessProbe": {
            "httpGet": {"path": "/readyz", **probe},
            "periodSeconds": 2,
            "timeoutSeconds": 2,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", **probe},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if group is not None:
        container["securityContext"]["runAsGroup"] = group
    if native:
        container["restartPolicy"] = "Always"
    return container


def _model_mounts(*, huge: str | None) -> list[dict[str, Any]]:
    """The model's volumes as the sidecar and the targets mount them."""
    mounts: list[dict[str, Any]] = [{"name": VOLUME_NAME, "mountPath": MOUNT_PATH}]
    if huge is not None:
        mounts.append({"name": HUGE_PAGES_VOLUME, "mountPath": HUGE_PAGES_MOUNT_PATH})
    return mounts


def _wire_target(index: int, container: Mapping[str, Any], *, huge: str | None) -> list[Op]:
    mounts = container.get("volumeMounts")
    ops: list[Op] = []
    present = {m.get("name") for m in mounts or ()}
    missing = [m for m in _model_mounts(huge=huge) if m["name"] not in present]
    ops += _append(("spec", "containers", index, "volumeMounts"), mounts, missing)
    env = container.get("env")
    defined = {e.get("name") for e in env or ()}
    segment = HUGE_PAGES_SEGMENT_PATH if huge else SEGMENT_PATH
    wanted = [e for e in target_env(segment=segment) if e["name"] not in defined]
    ops += _append(("spec", "containers", index, "env"), env, wanted)
    return ops


# --- which containers, and what could clash ----------------------------------------------------------------


def _target_indices(
    pod: Mapping[str, Any], containers: Sequence[Mapping[str, Any]], model: ResolvedModel
) -> list[int]:
    names = [str(c.get("name")) for c in containers]
    annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get(CONTAINERS_ANNOTATION)
    if annotation is not None:
        wanted = [n.strip() for n in str(annotation).split(",") if n.strip()]
        origin = f"the pod's annotation {CONTAINERS_ANNOTATION}"
    else:
        wanted = list(model.spec.containers)
        origin = f"ModelLoad {model.name!r} spec.containers"
    if not wanted:
        return [i for i, n in enumerate(names) if n != SIDECAR_NAME]
    missing = [n for n in wanted if n not in names]
    if missing:
        raise InjectionError(
            f"{origin} names container(s) {', '.join(missing)} that the pod does not have "
            f"(it has: {', '.join(names) or 'none'})"
        )
    return [i for i, n in enumerate(names) if n in wanted and n != SIDECAR_NAME]


def _check_clashes(
    spec: Mapping[str, Any], containers: Sequence[Mapping[str, Any]], targets: Sequence[int], *, huge: bool
) -> None:
    for volume in spec.get("volumes") or ():
        medium = str((volume.get("emptyDir") or {}).get("medium"))
        if volume.get("name") == VOLUME_NAME and medium != "Memory":
            raise InjectionError(
                f"the pod already has a volume named {VOLUME_NAME!r} that is not a memory emptyDir; rename it"
            )
        if volume.get("name") == HUGE_PAGES_VOLUME and not medium.startswith("HugePages"):
            raise InjectionError(
                f"the pod already has a volume named {HUGE_PAGES_VOLUME!r} that is not a huge-page emptyDir; "
                "rename it"
            )
    ours = {MOUNT_PATH: VOLUME_NAME, HUGE_PAGES_MOUNT_PATH: HUGE_PAGES_VOLUME}
    paths = {name: path for path, name in ours.items() if huge or name == VOLUME_NAME}
    for index in targets:
        container = containers[index]
        for mount in container.get("volumeMounts") or ():
            path, name = mount.get("mountPath"), mount.get("name")
            if path in ours and name != ours[path]:
                raise InjectionError(
                    f"container {container.get('name')!r} already mounts {name!r} at "
                    f"{path}, where the model's volume goes; move that mount"
                )
            if name in paths and path != paths[name]:
                # The loader's variables point under paths[name]: it would wait for a segment never there.
                raise InjectionError(
                    f"container {container.get('name')!r} mounts {name!r} at {path}, and the loader finds "
                    f"the model at {paths[name]}: remove that mount (the webhook adds it where the loader "
                    "looks)"
                )


def model_label(pod: Mapping[str, Any]) -> str | None:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(MODEL_LABEL)
    return str(value) if value else None
