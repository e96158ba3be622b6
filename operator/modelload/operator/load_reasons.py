"""Why a pod's load is not ready: the operator asks the sidecar, and says it on the pod and the ModelLoad.

A pod's own status says only that the sidecar is not ready (the kubelet's probe Events carry a status code,
never the reason), so a load that failed for good or that the sidecar retries after an outage looks like a
load in progress. Every ``interval`` seconds, :class:`LoadReasons` asks each injected pod whose sidecar runs
and is not ready for its ``/status`` (the status port the webhook declared, at the pod's IP), and:

- posts an Event on the pod when what it says changes: ``LoadFailed`` (the load failed for good: the
  reason, and that it stays failed until the pod is replaced) or ``LoadRetrying`` (a transient failure:
  the reason, the attempt, and that the sidecar starts the whole load again);
- keeps a condition of the ModelLoad, ``Degraded``: True with reason ``LoadFailed`` or ``LoadRetrying`` and
  the pods and their reasons while any pod's load failed or retries, False (``LoadsHealthy``) otherwise.

A pod that does not answer (a NetworkPolicy, a sidecar still starting) is left out, never counted as
failed. The answer is read with a size bound and only its ``phase``, ``error`` and ``attempt`` are used:
the sidecar's reasons never hold credentials (the error tree's rule). This and the peer figures
(:mod:`modelload.operator.fleet`) are the only connections the operator opens to pods.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from modelload.operator.conditions import Verdict, now_rfc3339, write_condition
from modelload.operator.kube import Kube, KubeError, KubeNotFoundError
from modelload.operator.pods import PodLoad
from modelload.operator.polling import IndexPoller, Selector, answering_entry

__all__ = ["CONDITION", "LoadReasons", "PodReason", "degraded_condition"]

logger = logging.getLogger(__name__)

CONDITION = "Degraded"
TIMEOUT = 2.0
MAX_BODY = 1 << 16
MAX_MESSAGE = 1000
"""Event messages are cut here (the API server refuses those over 1024 bytes)."""


@dataclass(frozen=True)
class PodReason:
    """What one pod's sidecar says of a load that is not in progress: ``failed`` or ``retrying``."""

    pod: str
    uid: str
    phase: str
    error: str
    attempt: int = 1

    def event(self) -> tuple[str, str]:
        """The Event's reason and message."""
        if self.phase == "failed":
            return (
                "LoadFailed",
                f"the model load failed: {self.error}; it stays failed until the pod is replaced",
            )
        return (
            "LoadRetrying",
            f"load attempt {self.attempt} failed ({self.error}); the sidecar starts the whole load again",
        )


async def ask(session: aiohttp.ClientSession, load: PodLoad) -> PodReason | None:
    """The pod's reason when its sidecar reports a failed or retrying load; None otherwise (or silent)."""
    try:
        async with session.get(f"http://{load.status_address}/status") as response:
            if response.status != 200:
                return None
            doc = json.loads(await response.content.read(MAX_BODY))
    except (asyncio.TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("phase") not in ("failed", "retrying"):
        return None
    error, attempt = doc.get("error"), doc.get("attempt")
    return PodReason(
        pod=load.name,
        uid=load.uid,
        phase=str(doc["phase"]),
        error=str(error)[:MAX_MESSAGE] if error else "no reason given",
        attempt=attempt if isinstance(attempt, int) and not isinstance(attempt, bool) else 1,
    )


def degraded_condition(reasons: Iterable[PodReason]) -> tuple[str, str, str]:
    """The ModelLoad's ``Degraded`` condition (status, reason, message) from its pods' reasons."""
    found = sorted(reasons, key=lambda r: r.pod)
    if not found:
        return "False", "LoadsHealthy", "no pod reports a failed or retrying load"
    failed = [r for r in found if r.phase == "failed"]
    reason, what = ("LoadFailed", "failed") if failed else ("LoadRetrying", "retrying")
    named = failed or found
    shown = "; ".join(f"{r.pod}: {r.error}" for r in named[:3])
    more = f" (and {len(named) - 3} more)" if len(named) > 3 else ""
    return "True", reason, f"{len(named)} of the pods report a {what} load: {shown}{more}"[:MAX_MESSAGE]


class LoadReasons(IndexPoller):
    """Every ``interval`` seconds, the reasons of the not-ready pods of every ModelLoad (see the module)."""

    task_name = "modelload-load-reasons"
    what = "asking the pods why their loads are not ready"

    def __init__(self, kube: Kube, *, interval: float, timeout: float = TIMEOUT) -> None:
        super().__init__(interval=interval)
        self._kube = kube
        self._timeout = timeout
        self._told: dict[str, tuple[str, str]] = {}
        """(phase, error) last posted per pod uid."""

    async def poll(self, models: Mapping[Selector, Any], pods: Mapping[Selector, Any]) -> None:
        """One round: the ModelLoad that answers to each label, its not-ready pods asked concurrently."""
        timeout = aiohttp.ClientTimeout(total=self._timeout)
        connector = aiohttp.TCPConnector(limit=16, force_close=True)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector, trust_env=False) as session:
            for selector, owners in list(models.items()):
                owner = answering_entry(owners)
                if owner is None:
                    continue  # no ModelLoad: nothing to report to
                waiting = [p for p in pods.get(selector, []) if p.state == "loading" and p.status_address]
                answers = await asyncio.gather(*(ask(session, p) for p in waiting))
                reasons = [r for r in answers if r is not None]
                for reason in reasons:
                    await self._tell_pod(selector[0], reason)
                await self._write(selector, owner[0], owner[3], reasons)
        # What was told of pods that left is of no use: forgotten, or pod churn would grow it for good.
        alive = {load.uid for loads in list(pods.values()) for load in loads}
        for uid in [uid for uid in self._told if uid not in alive]:
            del self._told[uid]

    async def _tell_pod(self, namespace: str, reason: PodReason) -> None:
        said = (reason.phase, reason.error)
        if self._told.get(reason.uid) == said:
            return
        event_reason, message = reason.event()
        now = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{reason.pod}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": reason.pod,
                "namespace": namespace,
                "uid": reason.uid,
                "fieldPath": "spec.initContainers{modelload}",
            },
            "type": "Warning",
            "reason": event_reason,
            "message": message[:MAX_MESSAGE],
            "source": {"component": "modelload-operator"},
            "reportingComponent": "modelload-operator",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._kube.create_event(namespace, body)
        except KubeError as exc:
            logger.warning("cannot post an Event on pod %s/%s: %s", namespace, reason.pod, exc)
            return
        self._told[reason.uid] = said

    async def _write(self, selector: Selector, name: str, shown: Any, reasons: list[PodReason]) -> None:
        """Keep the Degraded condition in line with ``reasons``. ``shown`` is the ModelLoad's conditions as
        the index last saw them: when they already say it, nothing is read; otherwise the conditions are
        written from a fresh read (:func:`.conditions.write_condition`), never over one written meanwhile."""
        wanted = degraded_condition(reasons)

        def decide(conditions: Sequence[Mapping[str, Any]]) -> Verdict | None:
            current = next((c for c in conditions if c.get("type") == CONDITION), None)
            said = (current.get("status"), current.get("reason"), current.get("message")) if current else None
            if said == wanted or (current is None and wanted[0] == "False"):
                return None  # no condition to write: nothing ever went wrong, or it already says so
            return wanted

        if decide(shown or ()) is None:
            return
        try:
            done, _ = await write_condition(self._kube, selector[0], name, type=CONDITION, decide=decide)
        except KubeNotFoundError:
            return
        except KubeError as exc:
            logger.warning(
                "cannot write ModelLoad %s/%s's %s condition: %s", selector[0], name, CONDITION, exc
            )
            return
        if not done:
            logger.info(
                "ModelLoad %s/%s changed while its %s condition was written: next round",
                selector[0],
                name,
                CONDITION,
            )
