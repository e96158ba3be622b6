"""The kopf handlers: resolve ModelLoads, and fold their pods' states into their status.

:func:`build_registry` returns a fresh ``kopf.OperatorRegistry`` (never kopf's global one), so a test can run
the real handlers against an emulated API server in its own event loop, and two registries never mix.

* ``resolve`` (create, resume, and any change but the status: a spec change, or an annotation such as
  ``modelload.dev/refresh`` to re-read a re-uploaded file): :mod:`modelload.operator.resolve` does the work;
  this module turns its outcome into the status patch, an Event when the problem is new, and kopf's retry
  decision (``TemporaryError(delay=)`` or ``PermanentError``).
* Two in-memory indices: ModelLoads by the label value that selects their pods, and each labelled pod's
  load state (:mod:`modelload.operator.pods`). kopf updates an index before it calls handlers for the same
  event, so a pod event handler sees the pod's new state.
* A pod event (any change, including deletion) recomputes its ModelLoad's ``status.pods`` and patches it
  when it changed. Pods are never written to, and get no finalizers.
* For ModelLoads with ``spec.peers``, a task started with the operator (not a kopf timer: those add a
  finalizer to every object) asks the serving pods for their peer stats into ``status.fleet``
  (:mod:`modelload.operator.fleet`).

No handler needs a finalizer on ModelLoads: deleting one releases nothing outside it (running pods keep
their sidecar; new pods are refused by the webhook), so deletion is immediate.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import kopf

from modelload.operator.conditions import now_rfc3339
from modelload.operator.fleet import FleetPoller
from modelload.operator.kube import Kube, KubeError, KubeNotFoundError
from modelload.operator.load_reasons import LoadReasons
from modelload.operator.metrics import METRICS
from modelload.operator.peers import ensure_peer_objects
from modelload.operator.pods import PodLoad, aggregate, classify
from modelload.operator.polling import answering_entry
from modelload.operator.resolve import (
    OPERATOR_ERROR,
    IndexReads,
    classify_failure,
    failure_status,
    resolve,
    success_status,
)
from modelload.operator.resource import (
    check_label_free,
    check_selectable,
    label_value,
    precedence,
)
from modelload.operator.scheduling import write_condition
from modelload.operator.schema import GROUP, MODEL_LABEL, PLURAL, VERSION, parse_spec
from modelload.operator.settings import OperatorSettings
from modelload.operator.status import PodsStatus

__all__ = [
    "Handlers",
    "PodAggregator",
    "build_registry",
    "configure_kopf",
    "modelloads_by_label",
    "pod_loads",
]

logger = logging.getLogger(__name__)
ANNOTATION_PREFIX = "kopf.modelload.dev"

LoginFn = Callable[..., Any]


def configure_kopf(settings: kopf.OperatorSettings) -> None:
    """kopf's own settings: standalone, no cluster scanning, our annotation prefix, short watch timeouts."""
    settings.peering.standalone = True  # every replica serves; handlers are idempotent status writers
    settings.scanning.disabled = True  # no list/watch of CRDs and namespaces: RBAC stays minimal
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _changed(conditions: Any, reason: str, message: str) -> bool:
    """Whether the Ready condition did not already say this."""
    for condition in conditions or ():
        if condition.get("type") == "Ready":
            return bool(condition.get("reason") != reason or condition.get("message") != message)
    return True


def pods_body(status: PodsStatus) -> dict[str, Any]:
    """``status.pods`` as a merge patch: every field present, None deleting a stale value."""
    return {
        "injected": status.injected,
        "serving": status.serving,
        "loading": status.loading,
        "ready": status.ready,
        "failed": status.failed,
        "unschedulable": status.unschedulable,
        "outdated": status.outdated,
        "lastLoadSeconds": status.last_load_seconds,
        "medianLoadSeconds": status.median_load_seconds,
        "lastThroughputBytesPerSecond": status.last_throughput_bytes_per_second,
    }


class PodAggregator:
    """Writes ``status.pods`` of one ModelLoad at a time, only when it changed.

    A lock per ModelLoad makes each computation read the index after the previous write, so two pods'
    events cannot land an older sum after a newer one.
    """

    def __init__(self, kube: Kube) -> None:
        self._kube = kube
        self._locks: collections.defaultdict[tuple[str, str], asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )
        self._written: dict[tuple[str, str], dict[str, Any]] = {}
        self._flagged: set[tuple[str, str]] = set()
        """ModelLoads whose PodsScheduled condition may say False (:func:`scheduling.write_condition`)."""

    async def refresh(
        self,
        namespace: str,
        name: str,
        loads: Callable[[], Iterable[PodLoad]],
        *,
        model_bytes: int | None,
        generation: int | None = None,
        conditions: Sequence[Mapping[str, Any]] | None = None,
        force: bool = False,
    ) -> None:
        key = (namespace, name)
        async with self._locks[key]:
            items = list(loads())
            body = pods_body(aggregate(items, model_bytes=model_bytes, generation=generation))
            try:
                flagged = await write_condition(
                    self._kube, namespace, name, [(p.unschedulable, p.huge_pages) for p in items],
                    shown=conditions, flagged=key in self._flagged,
                )  # fmt: skip
                if flagged:
                    self._flagged.add(key)
                else:
                    self._flagged.discard(key)
                if not force and self._written.get(key) == body:
                    return
                await self._kube.patch_modelload_status(namespace, name, {"pods": body})
            except KubeNotFoundError:
                self._written.pop(key, None)  # deleted meanwhile: nothing to report to
                return
            self._written[key] = body


def modelloads_by_label(
    *, namespace: str | None, name: str, body: kopf.Body, status: kopf.Status, **_: Any
) -> Any:
    """Index: the ModelLoad (its model's bytes, whether it has peers, its conditions, its precedence among
    ModelLoads of the same label: :func:`.resource.precedence`, its spec's generation) that each pod
    label value in a namespace selects."""
    nbytes = status.get("bytes")
    peers = (body.get("spec") or {}).get("peers") is True
    conditions = [dict(c) for c in status.get("conditions") or ()]
    generation = (body.get("metadata") or {}).get("generation")
    entry = (
        name,
        nbytes if isinstance(nbytes, int) else None,
        peers,
        conditions,
        precedence(body),
        generation if isinstance(generation, int) else None,
    )
    return {(namespace, label_value(body)): entry}


def pod_loads(*, namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any) -> Any:
    """Index: each injected pod's load state, under its namespace and label value."""
    load = classify(body)
    return None if load is None else {(namespace, labels[MODEL_LABEL]): load}


class Handlers:
    """The handlers' shared state: the settings, the API client and the pod aggregation."""

    def __init__(self, *, settings: OperatorSettings, kube: Kube) -> None:
        self._settings = settings
        self._kube = kube
        self._aggregator = PodAggregator(kube)
        self.reads = IndexReads()
        self.fleet = FleetPoller(kube, interval=settings.fleet_interval)
        self.reasons = LoadReasons(kube, interval=settings.fleet_interval)

    async def start_fleet(self, **kwargs: Any) -> None:
        """Start reading peered models' pod stats, over kopf's live indices (filled as kopf watches)."""
        self.fleet.start(models=kwargs["modelloads_by_label"], pods=kwargs["pod_loads"])
        self.reasons.start(models=kwargs["modelloads_by_label"], pods=kwargs["pod_loads"])

    async def stop_fleet(self, **_: Any) -> None:
        await self.fleet.stop()
        await self.reasons.stop()
        self.reads.close()

    async def resolve_model(
        self,
        *,
        body: kopf.Body,
        meta: kopf.Meta,
        status: kopf.Status,
        namespace: str | None,
        name: str,
        patch: kopf.Patch,
        retry: int,
        **kwargs: Any,
    ) -> None:
        """Read the model's index into the status, or say why not (and when kopf tries again)."""
        namespace = namespace or "default"
        generation = meta.get("generation")
        conditions = status.get("conditions")
        now = now_rfc3339()
        try:
            spec = parse_spec(body.get("spec"))
            check_selectable(body)
            owners = kwargs["modelloads_by_label"].get((namespace, label_value(body)), [])
            check_label_free(body, [entry[4] for entry in owners])
            sizing = self._settings.sidecar.sizing
            with METRICS.resolving():
                resolution = await resolve(
                    kube=self._kube,
                    namespace=namespace,
                    name=name,
                    spec=spec,
                    sizing=sizing,
                    networks=self._settings.source_networks,
                    reads=self.reads,
                )
            if spec.peers:  # a refusal (RBAC, a name) is the ModelLoad's condition, as any other failure
                await ensure_peer_objects(
                    self._kube, namespace=namespace, body=body, label_value=label_value(body)
                )
        except Exception as exc:
            failure = classify_failure(exc, retry=retry, policy=self._settings.retry)
            if failure.reason == OPERATOR_ERROR:
                logger.exception("resolving ModelLoad %s/%s failed unexpectedly", namespace, name)
            keep = isinstance(status.get("bytes"), int) and status.get("observedGeneration") == generation
            patch.status.update(
                failure_status(
                    failure, generation=generation, conditions=conditions, keep_resolved=keep, now=now
                )
            )
            if _changed(conditions, failure.reason, failure.message):  # one Event per new problem
                kopf.warn(body, reason=failure.reason, message=failure.message)
            if failure.retry_after is None:
                raise kopf.PermanentError(f"{failure.reason}: {failure.message}") from None
            raise kopf.TemporaryError(
                f"{failure.reason}: {failure.message}", delay=failure.retry_after
            ) from None
        new_status = success_status(resolution, generation=generation, conditions=conditions, now=now)
        patch.status.update(new_status)
        if not spec.peers and status.get("fleet") is not None:
            patch.status["fleet"] = None  # peers turned off: no fleet figures to keep showing
        kopf.info(body, reason="Resolved", message=new_status["conditions"][-1]["message"])
        selector, index = (namespace, label_value(body)), kwargs["pod_loads"]
        try:
            await self._aggregator.refresh(
                namespace,
                name,
                lambda: index.get(selector, []),
                model_bytes=resolution.summary.bytes if resolution.summary is not None else None,
                generation=generation,
                conditions=new_status["conditions"],
                force=True,
            )
        except KubeError as exc:  # the next pod event writes them: the model's read stands, not redone
            logger.warning("cannot write ModelLoad %s/%s's pod figures yet: %s", namespace, name, exc)

    async def pod_changed(self, *, namespace: str | None, labels: Mapping[str, str], **kwargs: Any) -> None:
        """Fold a pod's change (or deletion) into its ModelLoad's ``status.pods``."""
        namespace = namespace or "default"
        selector = (namespace, str(labels.get(MODEL_LABEL)))
        owner = answering_entry(kwargs["modelloads_by_label"].get(selector, []))
        if owner is None:
            return  # no ModelLoad (the webhook refused such pods): nothing to report
        name, model_bytes, _, conditions, _, generation = owner
        index = kwargs["pod_loads"]
        try:
            await self._aggregator.refresh(
                namespace,
                name,
                lambda: index.get(selector, []),
                model_bytes=model_bytes,
                generation=generation,
                conditions=conditions,
            )
        except KubeError as exc:  # kopf retries no event handler: the pod's next event, or the resolve's
            logger.warning("cannot write ModelLoad %s/%s's pod figures: %s", namespace, name, exc)


def build_registry(
    *, settings: OperatorSettings, kube: Kube, login: LoginFn | None = None
) -> kopf.OperatorRegistry:
    """The operator's handlers on a new registry. ``login`` replaces kopf's client-based login (tests)."""
    registry = kopf.OperatorRegistry()
    handlers = Handlers(settings=settings, kube=kube)

    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        configure_kopf(settings)

    def log_in(**kwargs: Any) -> Any:
        return login(**kwargs) if login is not None else kopf.login_via_client(**kwargs)

    model_loads = (GROUP, VERSION, PLURAL)
    labelled = {MODEL_LABEL: kopf.PRESENT}
    kopf.on.startup(id="configure", registry=registry)(configure)
    kopf.on.login(id="login", registry=registry)(log_in)
    kopf.on.startup(id="fleet", registry=registry)(handlers.start_fleet)
    kopf.on.cleanup(id="fleet", registry=registry)(handlers.stop_fleet)
    kopf.index(*model_loads, id="modelloads_by_label", registry=registry)(modelloads_by_label)
    kopf.index("v1", "pods", id="pod_loads", labels=labelled, registry=registry)(pod_loads)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*model_loads, id="resolve", registry=registry)(handlers.resolve_model)
    kopf.on.event("v1", "pods", id="pod_changed", labels=labelled, registry=registry)(handlers.pod_changed)
    return registry
