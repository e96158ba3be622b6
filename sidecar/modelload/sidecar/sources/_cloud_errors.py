"""Error answers of Google Cloud Storage and Azure Blob Storage, mapped to the error tree with what to do.

Both stores explain a refusal in their answer: GCS's JSON error names the identity and the permission it
lacks (``... does not have storage.objects.get access to ...``), Azure's XML error carries a code
(``AuthorizationPermissionMismatch``, ``ContainerNotFound``...). Messages keep what helps (the store's code,
the identity, at most a few hundred characters of the store's own sentence, scrubbed of anything shaped like
a token) and add what to check. Signatures, SAS tokens and bearer tokens never reach a message: requests are
named by their display URI, and the store's text is scrubbed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from email.message import Message

from modelload.loader.errors import (
    ModelloadError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)

from ._base import InterruptedReadError
from ._responses import RETRYABLE_STATUSES, json_body, parse_retry_after

__all__ = ["azure_error", "gcs_error", "scrub"]

_TOKENISH = re.compile(r"[A-Za-z0-9+/_=%\-]{32,}")
_SAS_FIELDS = re.compile(
    r"\b(sig|se|sp|sv|st|skoid|sktid|skt|ske|sks|skv|spr|srt|ss|sr)=[^&\s]*", re.IGNORECASE
)
_STORE_TEXT_MAX = 300
_GCS_REASON = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


def scrub(text: str) -> str:
    """A store's own sentence, fit for a message: one line, bounded, with every run that could be a token,
    key or signature (32+ characters of base64 or URL-safe text, a SAS field) replaced by ``…``."""
    text = " ".join(text.split())
    text = _SAS_FIELDS.sub(lambda m: f"{m.group(1)}=…", text)
    text = _TOKENISH.sub("…", text)
    return text[:_STORE_TEXT_MAX] + ("…" if len(text) > _STORE_TEXT_MAX else "")


def _retry(status: int, headers: Mapping[str, str] | Message, uri: str, tail: str) -> InterruptedReadError:
    return InterruptedReadError(
        f"{uri}: the store asked to retry{tail}",
        uri=uri,
        retry_after=parse_retry_after(headers.get("Retry-After")),
    )


# --- Google Cloud Storage ----------------------------------------------------------------------------------


def _gcs_message(body: bytes) -> tuple[str, str]:
    """``(reason, message)`` of a GCS JSON error body; empty strings when it is not one."""
    try:
        error = json_body(body.decode("utf-8", "replace")).get("error", {})  # type: ignore[attr-defined]
    except (ValueError, AttributeError):
        return "", body.decode("utf-8", "replace") if body and len(body) < 512 else ""
    if not isinstance(error, dict):
        return "", ""
    reasons = [e.get("reason", "") for e in error.get("errors", []) if isinstance(e, dict)]
    reason = reasons[0] if reasons and isinstance(reasons[0], str) else ""
    # GCS's reasons are words (notFound, forbidden, rateLimitExceeded); anything else is not shown
    return (reason if _GCS_REASON.match(reason) else ""), str(error.get("message", ""))


def gcs_error(
    status: int,
    headers: Mapping[str, str] | Message,
    body: bytes,
    *,
    bucket: str,
    name: str,
    identity: str,
    pinned: str | None,
) -> ModelloadError:
    """The error for a GCS answer that is not a successful read of ``gs://bucket/name``.

    ``pinned`` is the generation the load reads, once known: a 404 or 412 then means that generation is no
    longer the object's (replaced or deleted during the load).
    """
    uri = f"gs://{bucket}/{name}"
    reason, said = _gcs_message(body)
    store = f": {scrub(said)}" if said else ""
    tail = f" (HTTP {status}{', ' + reason if reason else ''}{store})"
    if pinned is not None and status in (404, 412):
        return SourceChangedError(
            f"{uri} changed while it was being read: generation {pinned} is no longer the object's (replaced"
            f" or deleted); restart the load once the model is stable{tail}",
            uri=uri,
        )
    if status == 404:
        if "bucket" in said.lower() or not name or name.endswith("/"):  # a listing's 404: no such bucket
            text = f"bucket {bucket!r} does not exist: check the bucket name (and the endpoint)"
        else:
            text = f"no object {name!r} in bucket {bucket!r}: check the path"
        return SourceNotFoundError(f"{uri}: {text}{tail}", uri=uri)
    if status in (401, 403):
        return SourceAccessDeniedError(
            f"{uri}: access denied to {identity}: grant it storage.objects.get on bucket {bucket!r} (the role"
            f" roles/storage.objectViewer; listing a directory also needs storage.objects.list){tail}",
            uri=uri,
        )
    if status == 412:
        return SourceChangedError(f"{uri} changed while it was being read{tail}", uri=uri)
    if status in RETRYABLE_STATUSES or status >= 500:
        return _retry(status, headers, uri, tail)
    return SourceError(f"{uri}: the store refused the request{tail}", uri=uri)


# --- Azure Blob Storage ------------------------------------------------------------------------------------

_AZURE_NOT_FOUND = {
    "ContainerNotFound": "container {container!r} does not exist in account {account!r}: check the URI",
    "BlobNotFound": "no blob {blob!r} in container {container!r}: check the path",
    "ResourceNotFound": "no blob {blob!r} in container {container!r} (or no such container): check the URI",
}
_AZURE_DENIED_HINTS = {
    "AuthenticationFailed": "the signature or token was refused: check the account key, connection string or"
    " SAS token in the Secret (an expired SAS fails so), and this machine's clock",
    "InvalidAuthenticationInfo": "the bearer token is not valid for this account: check the identity's tenant"
    " and that the token's audience is https://storage.azure.com",
    "AuthorizationFailure": "the credentials may not read this: check the SAS token's permissions (read, and"
    " list for a directory), the network rules of the account, or grant {identity} Storage Blob Data Reader",
    "AuthorizationPermissionMismatch": "{identity} has no data access: grant it the role Storage Blob Data"
    " Reader on the container or account (control-plane roles such as Reader do not read blobs)",
    "AuthorizationResourceTypeMismatch": "the SAS token does not cover objects: create it with resource types"
    " container and object",
    "NoAuthenticationInformation": "the blob is not public and no credentials were sent: give a SAS token,"
    " connection string or account key in the Secret, or bind a workload identity",
    "PublicAccessNotPermitted": "anonymous access is disabled on this account: give credentials",
}
_AZURE_CHANGED = frozenset({"ConditionNotMet", "InvalidRange", "TargetConditionNotMet"})
_AZURE_RETRY = frozenset({"ServerBusy", "InternalError", "OperationTimedOut"})


_AZURE_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,63}$")
_REQUEST_ID = re.compile(r"^[0-9A-Fa-f]{8}(-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}$")


def _xml_code(body: bytes) -> str | None:
    match = re.search(rb"<Code>([^<]{1,128})</Code>", body)
    return match.group(1).decode("utf-8", "replace").strip() if match else None


def _azure_code(headers: Mapping[str, str] | Message, body: bytes) -> str | None:
    """The answer's error code (``x-ms-error-code``, else the XML's ``<Code>``), only when it has an error
    code's shape: a gateway that echoes the request (a SAS's ``sig=``) into it gets nothing shown."""
    for code in (headers.get("x-ms-error-code"), _xml_code(body)):
        if code is not None:
            return code.strip() if _AZURE_CODE.match(code.strip()) else None
    return None


def azure_error(
    status: int,
    headers: Mapping[str, str] | Message,
    body: bytes,
    *,
    account: str,
    container: str,
    blob: str,
    identity: str,
) -> ModelloadError:
    """The error for an Azure Blob answer that is not a successful read of ``az://account/container/blob``."""
    uri = f"az://{account}/{container}/{blob}"
    code = _azure_code(headers, body)
    request_id = headers.get("x-ms-request-id")
    if request_id is not None and not _REQUEST_ID.match(request_id.strip()):
        request_id = None  # Azure's are GUIDs; anything else is not shown
    tail = (
        f" (HTTP {status}{', ' + code if code else ''}{', request id ' + request_id if request_id else ''})"
    )
    if code in _AZURE_NOT_FOUND or status == 404:
        text = _AZURE_NOT_FOUND.get(code or "ResourceNotFound", _AZURE_NOT_FOUND["ResourceNotFound"])
        return SourceNotFoundError(
            f"{uri}: " + text.format(account=account, container=container, blob=blob) + tail, uri=uri
        )
    if code in _AZURE_DENIED_HINTS or status in (401, 403):
        hint = _AZURE_DENIED_HINTS.get(
            code or "",
            "the credentials may not read this blob: grant {identity}"
            " Storage Blob Data Reader, or check the SAS token or key",
        )
        return SourceAccessDeniedError(
            f"{uri}: access denied, {hint.format(identity=identity)}{tail}", uri=uri
        )
    if code in _AZURE_CHANGED or status in (412, 416):
        return SourceChangedError(
            f"{uri} changed while it was being read (replaced or shortened); restart the load{tail}", uri=uri
        )
    if code in _AZURE_RETRY or status in RETRYABLE_STATUSES or status >= 500:
        return _retry(status, headers, uri, tail)
    return SourceError(f"{uri}: the store refused the request{tail}", uri=uri)
