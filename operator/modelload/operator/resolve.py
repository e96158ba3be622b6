"""Resolving a ModelLoad: check its spec and Secrets, read its model's index, and say what happened.

:func:`resolve` does the work; :func:`classify_failure` sorts every way it can fail by what happens next,
which the handler turns into a condition, an Event and kopf's retry decision:

==================  ========  =======================================================================
reason              phase     next
==================  ========  =======================================================================
BadSpec/BadSource   Failed    stop (kopf.PermanentError): a change of the ModelLoad re-runs it
BadModel            Failed    stop: the file is not a model, or is corrupt; upload it again, then
                              touch the ModelLoad (``kubectl annotate ... modelload.dev/refresh=1``)
MissingKey,         Failed    stop: the file is encrypted and no key is referenced, or a key is
NotEncrypted                  referenced for a file that is not encrypted
SecretNotFound,     Failed    retry with backoff: the fix (creating the Secret, adding a key, fixing
SecretKeyMissing,             the key or the token, uploading the object, granting access, the
BadKey, BadHeaders,           chart's RBAC) happens outside this resource, so a permanent stop would
Forbidden,                    never notice it
SourceNotFound,
AccessDenied
SourceUnreadable    Retrying  retry with backoff, or after the source's Retry-After when longer
APIUnavailable      Retrying  the same
OperatorError       Retrying  the same: an error outside the project's tree, a bug (its traceback is logged)
==================  ========  =======================================================================

The backoff (:class:`~modelload.operator.settings.RetrySettings`) starts at 5 s and doubles to 2 minutes. It
is also how soon a spec change is noticed while a retry is pending (kopf re-runs a handler after its delay
with the object as it is then), which is why it stays short.

Messages never carry credentials, tokens, keys or query strings: the sources layer names objects by their
``display_uri``, and the Secrets' values never leave :func:`read_credentials` and :func:`read_headers`
(whose parse errors name the line, never the value) except as the source's settings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from modelload.loader.errors import ConfigError, ModelloadError, SourceUriError, TransientSourceError
from modelload.loader.sizes import format_bytes
from modelload.operator import hubs
from modelload.operator.cloud_sources import (
    CloudCredentials,
    CloudSecretError,
    read_cloud_credentials,
    scheme_of,
)
from modelload.operator.conditions import named, set_condition
from modelload.operator.hubs import HubAccess
from modelload.operator.injection import source_query_problem
from modelload.operator.kube import Kube, KubeNotFoundError
from modelload.operator.model_source import (
    ModelSummary,
    Network,
    RequestHeaders,
    S3Credentials,
    is_local,
    parse_headers,
    read_summary,
)
from modelload.operator.schema import ModelLoadSpec
from modelload.operator.settings import RetrySettings
from modelload.operator.sizing import Sizing, SizingDefaults, plan_sizing

__all__ = [
    "Failure",
    "IndexReads",
    "Resolution",
    "SecretProblemError",
    "classify_failure",
    "failure_status",
    "resolve",
    "success_status",
]

KEY_BYTES = 32


class SecretProblemError(ModelloadError):
    """A referenced Secret is missing, lacks a key, or holds a value of the wrong shape; ``condition`` is
    the reason (``SecretNotFound``, ``BadKey``...) the ModelLoad's condition gives."""

    def __init__(self, condition: str, message: str) -> None:
        self.condition = condition
        super().__init__(message)


@dataclass(frozen=True)
class Resolution:
    summary: ModelSummary | None
    """None for a local (``file://``) model: the operator does not read it."""
    sizing: Sizing


@dataclass(frozen=True)
class Failure:
    reason: str
    message: str
    phase: Literal["Failed", "Retrying"]
    retry_after: float | None
    """Seconds until the next try; None for a permanent failure that waits for a spec change."""


async def resolve(
    *,
    kube: Kube,
    namespace: str,
    name: str = "",
    spec: ModelLoadSpec,
    sizing: SizingDefaults,
    networks: Sequence[Network] = (),
    reads: IndexReads | None = None,
) -> Resolution:
    """Check the Secrets, read the index (in a thread of ``reads``, or a default one without, from public
    addresses and ``networks`` only), and size the pods' volume and sidecar. A local (``file://``) model is
    not read (:func:`_local`)."""
    problem = source_query_problem(spec.source)
    if problem is not None:
        raise SourceUriError(problem, setting="spec.source")
    credentials = await read_credentials(kube, namespace, spec)
    cloud = await read_cloud_secret(kube, namespace, spec)
    headers = await read_headers(kube, namespace, spec)
    access = await read_hub_access(kube, namespace, spec)
    await check_decryption_secret(kube, namespace, spec)
    if is_local(spec.source):
        return _local(spec, sizing)
    read = functools.partial(
        read_summary,
        spec,
        credentials=credentials,
        headers=headers,
        cloud=cloud,
        access=access,
        networks=networks,
    )
    if reads is None:
        summary = await asyncio.to_thread(read)
    else:
        summary = await reads.read((namespace, name, repr(spec)), read, source=spec.source)
    has_key = spec.decryption_key_secret_ref is not None or spec.password_secret_ref is not None
    if summary.encrypted and not has_key:
        raise SecretProblemError(
            "MissingKey",
            "the model file is encrypted: reference its key with spec.decryptionKeySecretRef "
            "(or a password with spec.passwordSecretRef)",
        )
    if has_key and not summary.encrypted:
        raise SecretProblemError(
            "NotEncrypted",
            "a decryption key or password is referenced but the model file is not encrypted: "
            "remove the reference, or check that spec.source names the encrypted file",
        )
    planned = plan_sizing(
        model_bytes=summary.bytes,
        tensors=summary.tensors,
        spec=spec,
        defaults=sizing,
        segment=summary.segment_bytes,
    )
    return Resolution(summary=summary, sizing=planned)


SOURCE_READERS = 4
"""Threads that read models' indices, apart from asyncio's default executor."""
READ_DEADLINE = 120.0
"""Seconds one try of a resolve waits for the model's index before it says so (``SourceUnreadable``,
retried). The read goes on in its thread (a thread cannot be stopped): the next try waits for the same
read rather than starting another, so an origin that trickles its index out holds one reader, not one
more per retry."""


class IndexReads:
    """The operator's index reads: their own threads, and the reads in progress that a retry waits for.

    Apart from the default executor, which every API call (the webhook's look-up among them) runs in: a
    ModelLoad's origin is whoever wrote it, and a few that drip their index out held every thread there,
    so pods of every namespace were refused for want of a thread to list ModelLoads with. One per running
    operator, closed with it (a read still in progress is left to end on its own)."""

    def __init__(self, threads: int = SOURCE_READERS) -> None:
        self._threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="modelload-source-read"
        )
        self._reading: dict[tuple[str, str, str], concurrent.futures.Future[ModelSummary]] = {}
        """By (namespace, name, the spec read)."""

    async def read(
        self, key: tuple[str, str, str], read: Callable[[], ModelSummary], *, source: str
    ) -> ModelSummary:
        future = self._reading.get(key)
        if future is None:
            for stale in [k for k in self._reading if k[:2] == key[:2]]:
                del self._reading[stale]  # a read of an earlier spec: its result is of no use any more
            future = self._reading[key] = self._pool.submit(read)
        try:
            summary = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), READ_DEADLINE)
        except asyncio.TimeoutError:
            if future.running():
                raise TransientSourceError(
                    f"{source}: the source has not given the model's index in {READ_DEADLINE:g} s (it sends "
                    "it too slowly, or stopped sending); still reading",
                    uri=source,
                ) from None
            raise TransientSourceError(
                f"{source}: the model's index is not read yet: all {self._threads} of the operator's index "
                "readers are busy with other ModelLoads' sources",
                uri=source,
            ) from None
        except BaseException:
            self._reading.pop(key, None)
            raise
        self._reading.pop(key, None)
        return summary

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._reading.clear()


def _local(spec: ModelLoadSpec, sizing: SizingDefaults) -> Resolution:
    """A ``file://`` model lives in the pods' own filesystem (an image, a volume), not the operator's: the
    operator reads nothing there (it would read its own files, on the ModelLoad author's behalf), so it
    cannot size the pods' volume from the model and needs ``spec.volumeSizeLimit``; the sidecar checks the
    model against the volume when it loads."""
    if spec.volume_size_limit is None:
        raise ConfigError(
            "a file:// model is read by the sidecar from the pod's own filesystem, never by the operator, so"
            " its size is not known here: set spec.volumeSizeLimit to at least the model's size plus 64Mi",
            setting="spec.volumeSizeLimit",
        )
    return Resolution(summary=None, sizing=plan_sizing(model_bytes=0, tensors=0, spec=spec, defaults=sizing))


async def _secret(kube: Kube, namespace: str, name: str, purpose: str) -> dict[str, bytes]:
    try:
        return await kube.read_secret(namespace, name)
    except KubeNotFoundError:
        raise SecretProblemError(
            "SecretNotFound",
            f"the Secret {name!r} ({purpose}) does not exist in namespace {namespace!r}: create it",
        ) from None


def _key(data: Mapping[str, bytes], secret: str, key: str, purpose: str) -> bytes:
    if key not in data:
        raise SecretProblemError(
            "SecretKeyMissing",
            f"the Secret {secret!r} has no key {key!r} ({purpose}); it has: {named(data)}",
        )
    return data[key]


async def read_cloud_secret(kube: Kube, namespace: str, spec: ModelLoadSpec) -> CloudCredentials | None:
    """A gs:// or az:// source's credentials from ``spec.credentialsSecretRef`` (:mod:`.cloud_sources`)."""
    ref = spec.credentials_secret_ref
    if ref is None or scheme_of(spec.source) not in ("gs", "az"):
        return None
    data = await _secret(kube, namespace, ref.name, f"{scheme_of(spec.source)}:// credentials")
    try:
        return read_cloud_credentials(spec, data, secret=ref.name)
    except CloudSecretError as exc:
        raise SecretProblemError(exc.reason, str(exc)) from None


async def read_credentials(kube: Kube, namespace: str, spec: ModelLoadSpec) -> S3Credentials | None:
    """The S3 keys of ``spec.credentialsSecretRef``, or None (unsigned, or the sidecar's own identity)."""
    ref = spec.credentials_secret_ref
    if ref is None or (spec.s3 is not None and spec.s3.unsigned) or scheme_of(spec.source) != "s3":
        return None
    data = await _secret(kube, namespace, ref.name, "S3 credentials")
    access = _key(data, ref.name, ref.access_key_id_key, "the access key id")
    secret = _key(data, ref.name, ref.secret_access_key_key, "the secret access key")
    token = data.get(ref.session_token_key)
    try:
        return S3Credentials(
            access_key_id=access.decode().strip(),
            secret_access_key=secret.decode().strip(),
            session_token=token.decode().strip() if token else None,
        )
    except UnicodeDecodeError:
        raise SecretProblemError(
            "BadCredentials", f"the Secret {ref.name!r} holds S3 credentials that are not text"
        ) from None


async def read_headers(kube: Kube, namespace: str, spec: ModelLoadSpec) -> RequestHeaders | None:
    """The token or header lines of ``spec.headersSecretRef``, parsed as the sidecar parses its header file,
    so a malformed value is reported on the ModelLoad (naming the Secret, the key and the line, never the
    value) before any pod mounts it."""
    ref = spec.headers_secret_ref
    if ref is None:
        return None
    purpose = "the source's token or headers"
    value = _key(await _secret(kube, namespace, ref.name, purpose), ref.name, ref.key, purpose)
    try:
        return parse_headers(value, where=f"the Secret {ref.name!r} key {ref.key!r}")
    except ConfigError as exc:
        raise SecretProblemError(
            "BadHeaders",
            f"{exc}. It must hold a token (one line) or header lines ('Name: value'): "
            f"kubectl create secret generic {ref.name} --from-literal={ref.key}=<token>",
        ) from None


async def read_hub_access(kube: Kube, namespace: str, spec: ModelLoadSpec) -> HubAccess | None:
    """The hub token or the registry's Docker config a spec references (see :mod:`.hubs`), checked."""
    token, auths = None, {}
    if spec.hub is not None and spec.hub.token_secret_ref is not None:
        ref = spec.hub.token_secret_ref
        purpose = "the Hugging Face token"
        value = _key(await _secret(kube, namespace, ref.name, purpose), ref.name, ref.key, purpose)
        try:
            token = hubs.hub_token(value, where=f"the Secret {ref.name!r} key {ref.key!r}")
        except ConfigError as exc:
            raise SecretProblemError(
                "BadToken", f"{exc}: kubectl create secret generic {ref.name} --from-literal={ref.key}=hf_..."
            ) from None
    if spec.registry is not None and spec.registry.credentials_secret_ref is not None:
        auth = spec.registry.credentials_secret_ref
        purpose = "the registry's credentials"
        value = _key(await _secret(kube, namespace, auth.name, purpose), auth.name, auth.key, purpose)
        try:
            auths = hubs.registry_auths(
                value, where=f"the Secret {auth.name!r} key {auth.key!r}", source=spec.source
            )
        except ConfigError as exc:
            raise SecretProblemError("BadCredentials", str(exc)) from None
    if token is None and not auths:
        return None
    return HubAccess(hub_token=token, registry_auths=auths)


async def check_decryption_secret(kube: Kube, namespace: str, spec: ModelLoadSpec) -> None:
    """The key Secret exists and holds 32 bytes (a password: a non-empty value). The values are dropped."""
    if spec.decryption_key_secret_ref is not None:
        ref = spec.decryption_key_secret_ref
        value = _key(
            await _secret(kube, namespace, ref.name, "the decryption key"), ref.name, ref.key, "the key"
        )
        if len(value) != KEY_BYTES:
            raise SecretProblemError(
                "BadKey",
                f"the key {ref.key!r} in Secret {ref.name!r} holds {len(value)} bytes; a decryption key is "
                f"exactly {KEY_BYTES} raw bytes (create it with --from-file, not base64 text)",
            )
    if spec.password_secret_ref is not None:
        ref_p = spec.password_secret_ref
        data = await _secret(kube, namespace, ref_p.name, "the password")
        if not _key(data, ref_p.name, ref_p.key, "the password"):
            raise SecretProblemError(
                "BadKey", f"the password {ref_p.key!r} in Secret {ref_p.name!r} is empty"
            )


# --- outcomes ----------------------------------------------------------------------------------------------

_FIX_ELSEWHERE = frozenset(
    {
        "SecretNotFound",
        "SecretKeyMissing",
        "BadCredentials",
        "BadHeaders",
        "BadToken",
        "BadKey",
        "Forbidden",
        "SourceNotFound",
        "AccessDenied",
        "LabelTaken",
        "PeersSecretTaken",
        "PeersServiceTaken",
    }
)


def backoff(retry: int, policy: RetrySettings, retry_after: float | None = None) -> float:
    """``policy.first_delay`` doubled per retry up to ``policy.max_delay``, or the source's Retry-After."""
    delay = min(policy.max_delay, policy.first_delay * 2 ** min(retry, 20))
    return max(delay, retry_after or 0.0)


_ADVICE = {"BadModel": ". The file is not a readable model: upload it again, or fix spec.format"}
"""What a condition's message adds to the error's own, by reason."""


OPERATOR_ERROR = "OperatorError"
"""The reason of a failure no error of the project's tree describes: a bug, retried and said."""


def classify_failure(exc: BaseException, *, retry: int, policy: RetrySettings) -> Failure:
    """What a failure of :func:`resolve` means, from the error's own classification (its ``condition`` and
    ``transient``: :mod:`modelload.loader.errors`). An unexpected error (a bug: the caller logs its
    traceback) is retried with backoff as ``OperatorError``, naming only its type, whose text may hold
    anything; the ModelLoad says why it is not ready rather than keeping its last condition."""
    if not isinstance(exc, ModelloadError):
        message = (
            f"the operator failed on this ModelLoad ({type(exc).__name__}): a bug; its log has the "
            "traceback, please report it (retrying)"
        )
        return Failure(OPERATOR_ERROR, message, "Retrying", backoff(retry, policy))
    reason = exc.condition
    message = f"{exc}{_ADVICE.get(reason, '')}"
    if exc.transient:
        retry_after = exc.retry_after if isinstance(exc, TransientSourceError) else None
        return Failure(reason, f"{message} (retrying)", "Retrying", backoff(retry, policy, retry_after))
    if reason in _FIX_ELSEWHERE:
        return Failure(reason, message, "Failed", backoff(retry, policy))
    return Failure(reason, message, "Failed", None)


# --- status bodies -----------------------------------------------------------------------------------------


def success_status(
    resolution: Resolution, *, generation: int | None, conditions: Any, now: str
) -> dict[str, Any]:
    s = resolution.summary
    if s is None:
        return _local_status(resolution, generation=generation, conditions=conditions, now=now)
    message = (
        f"{s.tensors} tensors, {format_bytes(s.bytes)} ({s.format} v{s.format_version}"
        f"{', encrypted' if s.encrypted else ''}); "
        f"pods get a {resolution.sizing.volume_size_limit} memory volume"
    )
    return {
        "phase": "Ready",
        "observedGeneration": generation,
        "format": s.format,
        "formatVersion": s.format_version,
        "tensors": s.tensors,
        "bytes": s.bytes,
        "size": format_bytes(s.bytes),
        "fileBytes": s.file_bytes,
        "files": s.files,
        "encrypted": s.encrypted,
        "segmentBytes": s.segment_bytes,
        "volumeSizeLimit": resolution.sizing.volume_size_limit,
        "resolvedAt": now,
        "conditions": set_condition(
            conditions,
            type="Ready",
            status="True",
            reason="Resolved",
            message=message,
            generation=generation,
            now=now,
        ),
    }


LOCAL_REASON = "LocalSource"
"""The Ready condition's reason for a file:// model, which the operator does not read."""


def _local_status(
    resolution: Resolution, *, generation: int | None, conditions: Any, now: str
) -> dict[str, Any]:
    """Ready, without the fields only a read would give (format, tensors, bytes: deleted, not guessed)."""
    limit = resolution.sizing.volume_size_limit
    message = (
        "a file:// model: the sidecar reads it from the pod's own filesystem and the operator reads no"
        " local file, so tensors and size are not shown here; pods get a"
        f" {limit} memory volume (spec.volumeSizeLimit)"
    )
    status: dict[str, Any] = dict.fromkeys(RESOLVED_FIELDS)
    status.update(
        {
            "phase": "Ready",
            "observedGeneration": generation,
            "volumeSizeLimit": limit,
            "resolvedAt": now,
            "conditions": set_condition(
                conditions,
                type="Ready",
                status="True",
                reason=LOCAL_REASON,
                message=message,
                generation=generation,
                now=now,
            ),
        }
    )
    return status


RESOLVED_FIELDS = (
    "format",
    "formatVersion",
    "tensors",
    "bytes",
    "size",
    "fileBytes",
    "files",
    "encrypted",
    "segmentBytes",
    "volumeSizeLimit",
)


def failure_status(
    failure: Failure, *, generation: int | None, conditions: Any, keep_resolved: bool, now: str
) -> dict[str, Any]:
    """The status after a failure.

    A transient failure to re-read the model of a generation that was already resolved (an operator restart
    during an S3 outage) changes nothing: the last good index still describes the file, and pods keep being
    admitted. Every other failure clears the resolved fields, so the webhook refuses pods until it is fixed.
    """
    if keep_resolved and failure.phase == "Retrying":
        return {}
    status: dict[str, Any] = {
        "conditions": set_condition(
            conditions,
            type="Ready",
            status="False",
            reason=failure.reason,
            message=failure.message,
            generation=generation,
            now=now,
        )
    }
    status["phase"] = failure.phase
    status["observedGeneration"] = generation
    status.update(dict.fromkeys(RESOLVED_FIELDS))  # None deletes the field in a merge patch
    return status
