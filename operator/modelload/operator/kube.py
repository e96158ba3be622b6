"""The operator's own calls to the Kubernetes API, and the one place their exceptions are translated.

kopf owns the watches and the patches of the objects it handles. Everything else the operator asks the API
(a Secret's keys, the ModelLoads a pod's label may mean, another object's status, the webhook
configuration's caBundle, the server's version) goes through :class:`Kube`, a thin async face over the
official client's blocking calls (run in threads). Its errors are sorted by what the caller does next::

    ModelloadError (modelload.loader.errors)
    └── KubeError
        ├── KubeNotFoundError      the object does not exist
        ├── KubeForbiddenError     RBAC refuses the call: a chart or role is missing a rule
        ├── KubeConflictError      the object exists already (create)
        ├── KubeInvalidError       the API server refused the request's content: a bug to report
        └── KubeUnavailableError   worth retrying: a 5xx, a timeout, a refused connection

They are branches of the project's one error tree, with its classification: a ModelLoad whose resolving
fails on ``KubeForbiddenError`` says ``Forbidden``, on ``KubeUnavailableError`` ``APIUnavailable`` (and
retries). Messages name the object and the verb; a Secret's data never appears in one.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from modelload.loader.errors import ModelloadError
from modelload.operator.schema import GROUP, PLURAL, VERSION

__all__ = [
    "REQUEST_TIMEOUT",
    "Kube",
    "KubeConflictError",
    "KubeError",
    "KubeForbiddenError",
    "KubeInvalidError",
    "KubeNotFoundError",
    "KubeUnavailableError",
    "load_configuration",
    "owner_uids",
]

REQUEST_TIMEOUT = 8.0
"""Seconds each of the operator's own calls may take to connect, and then to answer. The webhook's lookup is
one of them, so it must give up, and refuse the pod with a reason, before the API server's own deadline
for the webhook (the chart's ``webhook.timeoutSeconds``, 10): a hung server or a half-open connection
would otherwise hold the call, and the thread it runs in, for good."""

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class KubeError(ModelloadError):
    """A Kubernetes API call failed; the subclass says whether to fix, wait or retry."""


class KubeNotFoundError(KubeError):
    pass


class KubeForbiddenError(KubeError):
    condition = "Forbidden"


class KubeConflictError(KubeError):
    pass


class KubeInvalidError(KubeError):
    pass


class KubeUnavailableError(KubeError):
    condition = "APIUnavailable"
    transient = True


def load_configuration() -> Any:
    """The client configuration of the pod's service account, or of ``$KUBECONFIG`` outside a cluster."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


def owner_uids(obj: Mapping[str, Any]) -> list[str]:
    """The uids in an object's ``metadata.ownerReferences``."""
    owners = (obj.get("metadata") or {}).get("ownerReferences") or []
    return [str(owner.get("uid")) for owner in owners if isinstance(owner, Mapping)]


class Kube:
    """Async calls to the API server through one ``kubernetes.client.ApiClient``.

    Responses are read as plain JSON (``_preload_content=False``): the client's strict models refuse objects
    that leave optional fields out (as an emulator or an older server may), and the operator wants dicts.
    """

    def __init__(self, configuration: Any, *, timeout: float = REQUEST_TIMEOUT) -> None:
        from kubernetes import client

        self._timeout = timeout
        self._api = client.ApiClient(configuration)
        self._core = client.CoreV1Api(self._api)
        self._custom = client.CustomObjectsApi(self._api)
        self._admission = client.AdmissionregistrationV1Api(self._api)
        self._version = client.VersionApi(self._api)

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)

    async def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        # The call gives up after the timeout; the thread too, a few urllib3 retries of it later at most.
        call = asyncio.to_thread(fn, *args, _preload_content=False, _request_timeout=self._timeout, **kwargs)
        try:
            response = await asyncio.wait_for(call, self._timeout)
        except ApiException as exc:
            raise _translate(what, exc.status, exc.reason) from None
        except asyncio.TimeoutError:
            reason = f"the API server did not answer within {self._timeout:g} s"
            raise KubeUnavailableError(f"{what}: {reason}") from None
        except Exception as exc:
            # urllib3's connection errors (refused, reset, timed out, TLS) are OSError or urllib3's own.
            if isinstance(exc, OSError) or type(exc).__module__.startswith("urllib3"):
                reason = f"the API server is unreachable ({type(exc).__name__})"
                raise KubeUnavailableError(f"{what}: {reason}") from exc
            raise
        try:
            result = json.loads(response.data or b"{}")
        except ValueError as exc:
            raise KubeUnavailableError(f"{what}: the API server's answer is not JSON") from exc
        if not isinstance(result, dict):
            raise KubeUnavailableError(
                f"{what}: the API server answered {type(result).__name__}, not an object"
            )
        return result

    # --- Secrets -------------------------------------------------------------------------------------------

    async def read_secret(self, namespace: str, name: str) -> dict[str, bytes]:
        """A Secret's data, decoded. Keep the values out of logs: callers pass them on and drop them."""
        what = f"get Secret {namespace}/{name}"
        secret = await self._call(what, self._core.read_namespaced_secret, name, namespace)
        data = secret.get("data") or {}
        return {key: base64.b64decode(value) for key, value in data.items()}

    async def secret_owners(self, namespace: str, name: str) -> list[str]:
        """The uids in a Secret's ownerReferences (its data is not kept)."""
        secret = await self._call(
            f"get Secret {namespace}/{name}", self._core.read_namespaced_secret, name, namespace
        )
        return owner_uids(secret)

    async def create_secret(self, namespace: str, body: Mapping[str, Any]) -> None:
        what = f"create Secret {namespace}/{body['metadata']['name']}"
        await self._call(what, self._core.create_namespaced_secret, namespace, dict(body))

    async def patch_secret(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        what = f"patch Secret {namespace}/{name}"
        await self._call(
            what, self._core.patch_namespaced_secret, name, namespace, dict(body), _content_type=MERGE_PATCH
        )

    # --- Services ------------------------------------------------------------------------------------------

    async def create_service(self, namespace: str, body: Mapping[str, Any]) -> None:
        what = f"create Service {namespace}/{body['metadata']['name']}"
        await self._call(what, self._core.create_namespaced_service, namespace, dict(body))

    async def read_service(self, namespace: str, name: str) -> dict[str, Any]:
        what = f"get Service {namespace}/{name}"
        return await self._call(what, self._core.read_namespaced_service, name, namespace)

    async def patch_service(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        what = f"patch Service {namespace}/{name}"
        await self._call(
            what, self._core.patch_namespaced_service, name, namespace, dict(body), _content_type=MERGE_PATCH
        )

    # --- Events --------------------------------------------------------------------------------------------

    async def create_event(self, namespace: str, body: Mapping[str, Any]) -> None:
        """Post a core/v1 Event (outside a kopf handler, where kopf's own posting queue is not set up)."""
        await self._call(
            f"create an Event in {namespace}", self._core.create_namespaced_event, namespace, dict(body)
        )

    # --- ModelLoads ----------------------------------------------------------------------------------------

    async def list_modelloads(self, namespace: str) -> list[dict[str, Any]]:
        what = f"list ModelLoads in {namespace}"
        result = await self._call(
            what, self._custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL
        )
        items: list[dict[str, Any]] = result.get("items") or []
        return [i for i in items if (i.get("metadata") or {}).get("namespace", namespace) == namespace]

    async def read_modelload(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._call(
            f"read ModelLoad {namespace}/{name}",
            self._custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
        )

    async def patch_modelload_status(
        self, namespace: str, name: str, status: Mapping[str, Any], *, resource_version: str | None = None
    ) -> None:
        """Merge ``status`` into the ModelLoad's status; with ``resource_version``, only if the object is
        still that version (:class:`KubeConflictError` otherwise): a list such as ``conditions`` is replaced
        whole by a merge patch, so one computed from an older read must not land."""
        body: dict[str, Any] = {"status": dict(status)}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        await self._call(
            f"patch ModelLoad {namespace}/{name} status",
            self._custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            body,
            _content_type=MERGE_PATCH,
        )

    # --- the webhook's configuration -----------------------------------------------------------------------

    async def read_mutating_webhook_configuration(self, name: str) -> dict[str, Any]:
        what = f"get MutatingWebhookConfiguration {name}"
        return await self._call(what, self._admission.read_mutating_webhook_configuration, name)

    async def json_patch_mutating_webhook_configuration(
        self, name: str, ops: Sequence[Mapping[str, Any]]
    ) -> None:
        await self._call(
            f"patch MutatingWebhookConfiguration {name}",
            self._admission.patch_mutating_webhook_configuration,
            name,
            [dict(op) for op in ops],
            _content_type=JSON_PATCH,
        )

    # --- the server ----------------------------------------------------------------------------------------

    async def server_version(self) -> tuple[int, int]:
        """(major, minor) of the API server; a minor such as ``29+`` (EKS, GKE) counts as 29."""
        info = await self._call("get /version", self._version.get_code)
        return _number(info.get("major")), _number(info.get("minor"))


def _number(text: Any) -> int:
    match = re.match(r"\d+", str(text or ""))
    return int(match.group(0)) if match else 0


def _translate(what: str, status: int | None, reason: str | None) -> KubeError:
    detail = f"{what}: HTTP {status} {reason or ''}".rstrip()
    if status == 404:
        return KubeNotFoundError(detail)
    if status in (401, 403):
        return KubeForbiddenError(f"{detail}: the operator's service account lacks this permission")
    if status == 409:
        return KubeConflictError(detail)
    if status in (400, 422):
        return KubeInvalidError(detail)
    return KubeUnavailableError(detail)
