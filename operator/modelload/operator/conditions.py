"""Status conditions in the Kubernetes convention: a transition time that moves only when the status does."""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["now_rfc3339", "set_condition"]


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
        "message": message,
        "lastTransitionTime": since,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition
