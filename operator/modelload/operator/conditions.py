"""Status conditions in the Kubernetes convention: a transition time that moves only when the status does.

Several writers keep conditions of one ModelLoad (the resolve handler its ``Ready``, the pod watch its
``PodsScheduled``, the load reasons poller its ``Degraded``), and a merge patch replaces the ``conditions``
list whole. A writer other than a handler of the ModelLoad itself therefore writes with
:func:`write_condition`: the list read afresh, and written only if the ModelLoad is still that version.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from modelload.operator.kube import Kube, KubeConflictError
from modelload.operator.status import MESSAGE_MAX_LENGTH

__all__ = ["ATTEMPTS", "Verdict", "named", "now_rfc3339", "set_condition", "write_condition"]

Verdict = tuple[str, str, str]
"""A condition's ``(status, reason, message)``."""

ATTEMPTS = 3
"""Reads and conditional writes of a condition before giving up until the writer's next look."""


NAMED = 20
"""Names a message lists (a Secret's keys, a Docker config's registries) before it says how many more."""


def named(names: Iterable[str], *, none: str = "no keys") -> str:
    """``a, b, c`` in order, the first :data:`NAMED` of them and how many more: a Secret of thousands of
    keys must not make a message longer than a condition may be."""
    ordered = sorted(names)
    shown = ", ".join(ordered[:NAMED]) or none
    more = len(ordered) - NAMED
    return f"{shown} and {more} more" if more > 0 else shown


def _bounded(message: str) -> str:
    """``message`` within the CRD's bound on a condition's message, cut in the middle if it must be."""
    if len(message) <= MESSAGE_MAX_LENGTH:
        return message
    half = (MESSAGE_MAX_LENGTH - 5) // 2
    return f"{message[:half]} ... {message[-half:]}"


def now_rfc3339() -> str:
    return (
        datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    )


def set_condition(
    existing: Iterable[Mapping[str, Any]] | None,
    *,
    type: str,  # noqa: A002 - the condition's field name
    status: str,
    reason: str,
    message: str,
    generation: int | None,
    now: str,
) -> list[dict[str, Any]]:
    """``existing`` with the condition of ``type`` replaced (or added), keeping the others in order.

    ``lastTransitionTime`` keeps its old value when ``status`` did not change, so it says when the condition
    last flipped, not when the operator last looked.
    """
    out: list[dict[str, Any]] = []
    replaced = False
    for condition in existing or ():
        if condition.get("type") != type:
            out.append(dict(condition))
            continue
        replaced = True
        out.append(_build(type, status, reason, message, generation, _since(condition, status, now)))
    if not replaced:
        out.append(_build(type, status, reason, message, generation, now))
    return out


def _since(old: Mapping[str, Any], status: str, now: str) -> str:
    previous = old.get("lastTransitionTime")
    return str(previous) if old.get("status") == status and previous else now


def _build(
    type_: str, status: str, reason: str, message: str, generation: int | None, since: str
) -> dict[str, Any]:
    condition: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": _bounded(message),
        "lastTransitionTime": since,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


async def write_condition(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    type: str,  # noqa: A002 - the condition's field name
    decide: Callable[[Sequence[Mapping[str, Any]]], Verdict | None],
) -> tuple[bool, Verdict | None]:
    """Bring the ModelLoad's condition of ``type`` in line with ``decide`` (given the conditions as they are
    now; None: nothing to write). The ModelLoad is read afresh and the conditions are written with its
    resourceVersion as a precondition, so a condition another writer set meanwhile is never dropped: a
    conflict reads again, :data:`ATTEMPTS` times.

    Returns whether the condition now says what ``decide`` wanted (written, or already so), and that.
    KubeNotFoundError when the ModelLoad is gone.
    """
    wanted: Verdict | None = None
    for _ in range(ATTEMPTS):
        current = await kube.read_modelload(namespace, name)
        conditions = (current.get("status") or {}).get("conditions") or []
        wanted = decide(conditions)
        if wanted is None or _says(conditions, type, wanted):
            return True, wanted
        status, reason, message = wanted
        updated = set_condition(
            conditions, type=type, status=status, reason=reason, message=message, generation=None,
            now=now_rfc3339(),
        )  # fmt: skip
        version = (current.get("metadata") or {}).get("resourceVersion")
        try:
            await kube.patch_modelload_status(
                namespace, name, {"conditions": updated}, resource_version=version
            )
        except KubeConflictError:
            continue  # written meanwhile: read it again
        return True, wanted
    return False, wanted


def _says(conditions: Iterable[Mapping[str, Any]], type_: str, wanted: Verdict) -> bool:
    return any(
        c.get("type") == type_ and (c.get("status"), c.get("reason"), c.get("message")) == wanted
        for c in conditions
    )
