"""Pods that no node can take: the scheduler's word on them, turned into a ModelLoad condition.

A pod whose sidecar asks for huge pages (``spec.memory.hugePages``) fits only nodes with that many free
pre-allocated huge pages in their allocatable resources. Where none has them the pod stays Pending, and the
only trace is on the pod: its ``PodScheduled`` condition turns ``False`` with reason ``Unschedulable`` and the
scheduler's message (``0/3 nodes are available: 3 Insufficient hugepages-2Mi.``), which is also the
``FailedScheduling`` event's. The operator already watches the injected pods (:mod:`.pods`), so it reads that
condition and says it on the ModelLoad: ``status.pods.unschedulable`` counts the pods, and the
``PodsScheduled`` condition gives the scheduler's message, the huge pages each pod asks for, and what to do.
The condition is written only once a pod could not be scheduled (then until none is left), so models whose
pods schedule normally carry no extra condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from modelload.operator.conditions import now_rfc3339, set_condition
from modelload.operator.kube import Kube, KubeConflictError

__all__ = [
    "CONDITION",
    "SchedulingVerdict",
    "huge_page_request",
    "unschedulable",
    "verdict",
    "write_condition",
]

CONDITION = "PodsScheduled"
INSUFFICIENT_HUGE_PAGES = "Insufficient hugepages-"


@dataclass(frozen=True)
class SchedulingVerdict:
    """What the ``PodsScheduled`` condition says."""

    status: str
    reason: str
    message: str


def unschedulable(status: Mapping[str, Any]) -> str | None:
    """The scheduler's message for a pod it could not place (``PodScheduled`` False, ``Unschedulable``)."""
    for condition in status.get("conditions") or ():
        refused = condition.get("type") == "PodScheduled" and condition.get("status") == "False"
        if refused and condition.get("reason") == "Unschedulable":
            return str(condition.get("message") or "no node can take the pod")
    return None


def huge_page_request(container: Mapping[str, Any]) -> str | None:
    """``hugepages-2Mi: 1030Mi`` when the container asks for huge pages, else None."""
    limits = (container.get("resources") or {}).get("limits") or {}
    asked = [
        f"{name}: {value}" for name, value in sorted(limits.items()) if str(name).startswith("hugepages-")
    ]
    return ", ".join(asked) or None


def verdict(
    pods: Iterable[tuple[str | None, str | None]], *, existing: Sequence[Mapping[str, Any]] | None
) -> SchedulingVerdict | None:
    """The condition for pods given as ``(scheduler message or None, huge pages asked or None)``; None when
    there is nothing to say (every pod placed, and no earlier condition to clear)."""
    stuck = [(message, huge) for message, huge in pods if message is not None]
    if not stuck:
        had = any(c.get("type") == CONDITION for c in existing or ())
        return SchedulingVerdict("True", "Scheduled", "every injected pod is on a node") if had else None
    message, huge = next(((m, h) for m, h in stuck if INSUFFICIENT_HUGE_PAGES in (m or "")), stuck[0])
    count = f"{len(stuck)} injected pod{'s' if len(stuck) > 1 else ''} cannot be scheduled"
    assert message is not None
    if INSUFFICIENT_HUGE_PAGES in message:
        return SchedulingVerdict(
            "False",
            "InsufficientHugePages",
            f"{count}: {message.strip()} Each pod's sidecar asks for {huge or 'huge pages'} "
            "(spec.memory.hugePages): give nodes that many free pre-allocated huge pages (vm.nr_hugepages, "
            "or hugepages= on the kernel command line; restart the kubelet after a change at runtime so "
            "that the node's allocatable shows them), or remove spec.memory.hugePages to use ordinary memory",
        )
    return SchedulingVerdict("False", "Unschedulable", f"{count}: {message.strip()}")


ATTEMPTS = 3
"""Reads and conditional writes of the condition before giving up until the next pod event."""


async def write_condition(
    kube: Kube,
    namespace: str,
    name: str,
    pods: Sequence[tuple[str | None, str | None]],
    *,
    shown: Sequence[Mapping[str, Any]] | None,
    flagged: bool = False,
) -> bool:
    """Bring the ModelLoad's ``PodsScheduled`` condition in line with ``pods`` (see :func:`verdict`); True
    while the condition may say False (a pod is stuck, or clearing it did not get through): the caller
    passes that back as ``flagged`` next time.

    ``shown`` is the status as last seen (the operator's index, possibly behind): nothing is read while no
    pod is stuck and neither it nor ``flagged`` says the condition is False. Otherwise the ModelLoad is read
    afresh and the conditions are written with its resourceVersion as a precondition, so a Ready condition
    written meanwhile is never dropped: a conflict reads again.
    """
    stuck = any(message is not None for message, _ in pods)
    flagged = flagged or any(c.get("type") == CONDITION and c.get("status") == "False" for c in shown or ())
    if not stuck and not flagged:
        return False
    for _ in range(ATTEMPTS):
        current = await kube.read_modelload(namespace, name)
        conditions = (current.get("status") or {}).get("conditions") or []
        said = verdict(pods, existing=conditions)
        if said is None or _says(conditions, said):
            return said is not None and said.status == "False"
        updated = set_condition(
            conditions, type=CONDITION, status=said.status, reason=said.reason, message=said.message,
            generation=None, now=now_rfc3339(),
        )  # fmt: skip
        version = (current.get("metadata") or {}).get("resourceVersion")
        try:
            await kube.patch_modelload_status(
                namespace, name, {"conditions": updated}, resource_version=version
            )
        except KubeConflictError:
            continue  # written meanwhile: read it again
        return said.status == "False"
    return True


def _says(conditions: Sequence[Mapping[str, Any]], said: SchedulingVerdict) -> bool:
    return any(
        c.get("type") == CONDITION
        and (c.get("status"), c.get("reason"), c.get("message")) == (said.status, said.reason, said.message)
        for c in conditions
    )
