"""The pod admission webhook: an AdmissionReview in, an AdmissionReview with a JSON patch (or a refusal) out.

The API server sends every pod CREATE whose labels carry ``modelload.dev/model`` (the configuration's
``objectSelector``). For each, :class:`PodWebhook` finds the ModelLoad the label names in the pod's
namespace and answers with :func:`~modelload.operator.injection.build_patch`'s operations. A pod that asks
for a model that does not exist, or whose index has not been read, is refused with a message that says so:
admitting it would start a pod without its weights (or with a volume too small for them). A controller that
owns the pod (a ReplicaSet, KNative's revision) retries, so its pods are created once the model is ready.

Served over HTTPS by aiohttp (:func:`serve`) on the port the chart's Service targets, next to ``/healthz``
and ``/readyz`` for the operator pod's own probes. kopf's built-in webhook servers are not used: they yield
``url`` client configurations for a kopf-managed configuration, while this one is the chart's
MutatingWebhookConfiguration with a ``service`` client config, a namespaceSelector and reinvocation.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from modelload.loader.errors import ConfigError, ModelloadError
from modelload.operator.injection import InjectionError, build_patch, has_sidecar, model_label
from modelload.operator.kube import Kube, KubeError
from modelload.operator.metrics import METRICS, OperatorMetrics
from modelload.operator.resource import NotResolvedError, ResolvedModel, answering, label_value
from modelload.operator.schema import MODEL_LABEL
from modelload.operator.settings import InjectedSidecar

__all__ = ["ModelLookup", "ModelNotFoundError", "PodWebhook", "kube_lookup", "serve"]

logger = logging.getLogger(__name__)

ModelLookup = Callable[[str, str], Awaitable[Mapping[str, Any]]]
"""``lookup(namespace, label_value)`` → the ModelLoad object, or :class:`ModelNotFoundError`."""


class ModelNotFoundError(ModelloadError):
    """No ModelLoad answers to a pod's label; the message says what to create or fix."""

    kind = "model_not_found"


def kube_lookup(kube: Kube) -> ModelLookup:
    """A lookup that lists the namespace's ModelLoads (one API call per admitted pod, always current)."""

    async def lookup(namespace: str, value: str) -> Mapping[str, Any]:
        items = [item for item in await kube.list_modelloads(namespace) if label_value(item) == value]
        if not items:
            raise ModelNotFoundError(
                f"the pod's label {MODEL_LABEL}={value} asks for a ModelLoad that does not exist in "
                f"namespace {namespace!r}: create a ModelLoad named {value!r} (or one with "
                f"spec.podLabelValue {value!r}), or fix the label"
            )
        return answering(items)  # of several, the oldest: the others' conditions say LabelTaken

    return lookup


class PodWebhook:
    """Answers AdmissionReviews for pods; holds no state but its settings and how to find ModelLoads."""

    def __init__(
        self,
        *,
        lookup: ModelLookup,
        sidecar: InjectedSidecar,
        native: bool,
        metrics: OperatorMetrics = METRICS,
    ) -> None:
        self._lookup = lookup
        self._sidecar = sidecar
        self.native = native
        self._metrics = metrics

    async def review(self, review: Mapping[str, Any]) -> dict[str, Any]:
        """The AdmissionReview response to ``review`` (admission.k8s.io/v1)."""
        request = review.get("request")
        if not isinstance(request, Mapping) or "uid" not in request:
            raise ValueError("not an AdmissionReview request: the 'request.uid' field is missing")
        uid = str(request["uid"])
        started = time.monotonic()
        try:
            patch, result = await self._patch_for(request)
        except (ModelNotFoundError, NotResolvedError, InjectionError, ConfigError) as exc:
            # A ConfigError here is the ModelLoad's spec (or its overrides) as the pod's patch reads it.
            reason = "bad_spec" if isinstance(exc, ConfigError) else exc.kind
            self._metrics.refused(reason=reason, seconds=time.monotonic() - started)
            return _response(review, uid, allowed=False, code=403, message=str(exc))
        except KubeError as exc:
            logger.warning("cannot admit a pod: %s", exc)
            self._metrics.refused(reason="api_unavailable", seconds=time.monotonic() - started)
            message = f"modelload cannot look up the model: {exc}"
            return _response(review, uid, allowed=False, code=503, message=message)
        except Exception:
            # A bug must not admit a pod half-wired, nor answer the API server with a bare HTTP 500.
            logger.exception("the pod webhook failed on request %s", uid)
            self._metrics.refused(reason="internal", seconds=time.monotonic() - started)
            message = (
                "modelload's webhook failed on this pod (see the operator's log); the pod was not changed"
            )
            return _response(review, uid, allowed=False, code=500, message=message)

        self._metrics.admitted(result=result, seconds=time.monotonic() - started)
        response = _response(review, uid, allowed=True)
        if patch:
            response["response"]["patchType"] = "JSONPatch"
            response["response"]["patch"] = base64.b64encode(json.dumps(patch).encode()).decode("ascii")
        return response

    async def _patch_for(self, request: Mapping[str, Any]) -> tuple[list[dict[str, Any]], str]:
        """The patch for the request, and the admission result to count (see :mod:`metrics`)."""
        kind = request.get("kind") or {}
        if kind.get("kind") != "Pod" or request.get("operation") != "CREATE":
            return [], "unchanged"
        pod = request.get("object") or {}
        value = model_label(pod)
        if value is None:
            return [], "unchanged"
        namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "default")
        body = await self._lookup(namespace, value)
        model = ResolvedModel.from_body(body)
        ops = build_patch(pod=pod, model=model, sidecar=self._sidecar, native=self.native)
        if not ops:
            return ops, "unchanged"
        topped_up = has_sidecar(pod)
        logger.info(
            "%s pod %s/%s with model %s (%d ops)",
            "tops up" if topped_up else "injects",
            namespace,
            _pod_name(pod),
            model.name,
            len(ops),
        )
        return ops, "topped_up" if topped_up else "injected"


def _pod_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("name") or f"{meta.get('generateName', '')}*")


def _response(
    review: Mapping[str, Any], uid: str, *, allowed: bool, code: int | None = None, message: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if message is not None:
        body["status"] = {"code": code or 403, "message": message}
    return {
        "apiVersion": review.get("apiVersion", "admission.k8s.io/v1"),
        "kind": review.get("kind", "AdmissionReview"),
        "response": body,
    }


# --- the HTTPS server --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serve(
    webhook: PodWebhook,
    *,
    host: str,
    port: int,
    path: str,
    ssl_context: ssl.SSLContext | None,
    ready: Callable[[], bool] = lambda: True,
) -> AsyncIterator[int]:
    """Serve ``webhook`` at ``path`` until the block exits; yields the bound port (``port=0`` picks one)."""
    from aiohttp import web

    async def mutate(request: web.Request) -> web.Response:
        try:
            review = await request.json()
            answer = await webhook.review(review)
        except (ValueError, json.JSONDecodeError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(answer)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        return web.Response(text="ok") if ready() else web.Response(text="starting", status=503)

    app = web.Application(client_max_size=8 << 20)  # pods with large specs; the API server caps requests
    app.add_routes([web.post(path, mutate), web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, ssl_context=ssl_context, reuse_address=True)
        await site.start()
        sockets = getattr(site._server, "sockets", None) or ()
        bound = sockets[0].getsockname()[1] if sockets else port
        logger.info("webhook listening on %s:%s%s", host, bound, path)
        yield int(bound)
    finally:
        await runner.cleanup()
