"""What a pod's own status says about its model load, and the sum over a model's pods.

The operator learns about loads from the pods alone: the kubelet records the sidecar's state, readiness and
start time, and the pod's Ready condition. The sidecar needs no RBAC and, for these figures, the operator
opens no connection to pods (NetworkPolicies often forbid one); only a peered model's byte figures
(:mod:`modelload.operator.fleet`) and a not-ready sidecar's reason (:mod:`modelload.operator.load_reasons`)
are asked of its pods, at the addresses noted here. A native sidecar reports in
``initContainerStatuses``, a regular one in ``containerStatuses``; both are read.

Load time is measured from the sidecar container's start to the pod's Ready transition. With a native
sidecar the pod is Ready only once the sidecar's readiness (every tensor in) and the app's are true, so this
is the time until the pod could serve with the model loaded: an upper bound of the sidecar's own load time
(the sidecar's /status has the exact figure).
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from modelload.loader.wiring import PEER_PORT, STATUS_PORT
from modelload.operator.peers import PEER_DNS_ENV, PEER_PORT_ENV
from modelload.operator.scheduling import huge_page_request, unschedulable
from modelload.operator.status import PodsStatus

__all__ = ["GENERATION_ANNOTATION", "PodLoad", "aggregate", "classify"]

SIDECAR_NAME = "modelload"
GENERATION_ANNOTATION = "modelload.dev/generation"
"""The ModelLoad's generation a pod was injected from (the webhook writes it)."""
STATUS_PORT_ENV = "MODELLOAD_PORT"
"""The sidecar's status API port variable (its ``--port``), which the webhook sets."""
FAILED_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)

State = Literal["pending", "loading", "ready", "failed"]


@dataclass(frozen=True)
class PodLoad:
    """One injected pod's load, as far as its status tells."""

    state: State
    load_seconds: float | None = None
    ready_at: str | None = None
    """The pod's Ready transition time (RFC 3339), to find the most recent load."""
    peers: bool = False
    """The sidecar was given peers (``spec.peers``): while it runs it serves what it holds to the others."""
    pod: str = ""
    address: str | None = None
    """``host:port`` of the sidecar's peer server (the pod's IP and its MODELLOAD_PEER_PORT), once the pod
    has an IP; None without peers."""
    unschedulable: str | None = None
    """The scheduler's message for a pending pod no node can take (:mod:`.scheduling`)."""
    huge_pages: str | None = None
    """The huge pages the sidecar asks for (``hugepages-2Mi: 1030Mi``), or None."""
    status_address: str | None = field(default=None, compare=False)
    """``host:port`` of the sidecar's status API (the pod's IP and its MODELLOAD_PORT), once the pod has an
    IP: where the operator asks a sidecar that is not ready why (:mod:`modelload.operator.load_reasons`)."""
    generation: int | None = None
    """The ModelLoad's generation the pod was injected from (its ``modelload.dev/generation`` annotation);
    None for a pod injected before the annotation existed."""
    name: str = field(default="", compare=False)
    uid: str = field(default="", compare=False)
    """The pod's name and uid, for Events about it."""

    @property
    def serving(self) -> bool:
        return self.peers and self.state in ("loading", "ready")


def classify(pod: Mapping[str, Any]) -> PodLoad | None:
    """The load state of an injected pod, or None for a pod without the sidecar, terminating, or done."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    declared = list(spec.get("initContainers") or []) + list(spec.get("containers") or [])
    sidecars = [c for c in declared if c.get("name") == SIDECAR_NAME]
    if not sidecars:
        return None
    env = {e.get("name"): e.get("value") for e in sidecars[0].get("env") or ()}
    load = _classify(meta, status)
    if load is None:
        return None
    load = replace(
        load,
        generation=_generation(meta),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        status_address=_address(status, env.get(STATUS_PORT_ENV), STATUS_PORT),
    )
    if load.state == "pending":
        stuck = unschedulable(status)
        if stuck is not None:
            load = replace(load, unschedulable=stuck, huge_pages=huge_page_request(sidecars[0]))
    if PEER_DNS_ENV not in env:
        return load
    return replace(
        load, peers=True, pod=load.name, address=_address(status, env.get(PEER_PORT_ENV), PEER_PORT)
    )


def _generation(meta: Mapping[str, Any]) -> int | None:
    value = str((meta.get("annotations") or {}).get(GENERATION_ANNOTATION) or "")
    return int(value) if value.isdigit() else None


def _address(status: Mapping[str, Any], port_value: Any, default: int) -> str | None:
    ip = status.get("podIP")
    port = str(port_value or default)
    if not isinstance(ip, str) or not ip or not port.isdigit():
        return None
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _classify(meta: Mapping[str, Any], status: Mapping[str, Any]) -> PodLoad | None:
    if meta.get("deletionTimestamp") or status.get("phase") == "Succeeded":
        return None
    if status.get("phase") == "Failed":
        return PodLoad("failed")
    sidecar = _sidecar_status(status)
    if sidecar is None:
        return PodLoad("pending")
    state = sidecar.get("state") or {}
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in FAILED_WAITING_REASONS or "terminated" in state:
        return PodLoad("failed")
    if sidecar.get("ready"):
        ready_at = _ready_transition(status)
        started = (state.get("running") or {}).get("startedAt")
        return PodLoad("ready", load_seconds=_seconds_between(started, ready_at), ready_at=ready_at)
    if "running" in state:
        return PodLoad("loading")
    return PodLoad("pending")


def _sidecar_status(status: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for key in ("initContainerStatuses", "containerStatuses"):
        for entry in status.get(key) or ():
            if entry.get("name") == SIDECAR_NAME:
                return entry
    return None


def _ready_transition(status: Mapping[str, Any]) -> str | None:
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            value = condition.get("lastTransitionTime")
            return str(value) if value else None
    return None


_RFC3339 = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def _parse_time(value: str) -> datetime:
    """An RFC 3339 time (Kubernetes writes whole seconds; MicroTime has six digits; any count is read)."""
    match = _RFC3339.match(value)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {value!r}")
    base, fraction, zone = match.groups()
    parsed = datetime.fromisoformat(base + ("+00:00" if zone == "Z" else zone))
    return parsed + timedelta(microseconds=int((fraction or "0")[:6].ljust(6, "0")))


def _seconds_between(start: str | None, end: str | None) -> float | None:
    if not start or not end:
        return None
    try:
        seconds = (_parse_time(end) - _parse_time(start)).total_seconds()
    except ValueError:
        return None
    return round(seconds, 3) if seconds >= 0 else None


def aggregate(
    loads: Iterable[PodLoad], *, model_bytes: int | None, generation: int | None = None
) -> PodsStatus:
    """The ``status.pods`` of a ModelLoad from its pods' loads; ``generation``: its spec's (pods injected
    from another are outdated)."""
    items = list(loads)
    counts = {state: sum(1 for p in items if p.state == state) for state in ("loading", "ready", "failed")}
    timed = [p for p in items if p.state == "ready" and p.load_seconds is not None and p.ready_at]
    last = max(timed, key=lambda p: _parse_time(p.ready_at or ""), default=None)
    last_seconds = last.load_seconds if last is not None else None
    median = round(statistics.median(p.load_seconds or 0.0 for p in timed), 3) if timed else None
    throughput = None
    if last_seconds and model_bytes:
        throughput = int(model_bytes / last_seconds)
    return PodsStatus(
        injected=len(items),
        serving=sum(1 for p in items if p.serving),
        loading=counts["loading"],
        ready=counts["ready"],
        failed=counts["failed"],
        unschedulable=sum(1 for p in items if p.unschedulable is not None),
        outdated=sum(
            1 for p in items if None not in (p.generation, generation) and p.generation != generation
        ),
        last_load_seconds=last_seconds,
        median_load_seconds=median,
        last_throughput_bytes_per_second=throughput,
    )
