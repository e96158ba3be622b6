"""S3 error responses mapped to the error tree, each with what to check.

S3 answers errors with a small XML document whose ``<Code>`` names the problem (NoSuchKey, AccessDenied,
SlowDown...). Only the code, the bucket and key and the request id go into our messages: the server's own
``<Message>`` and the rest of the document are left out, since S3-compatible servers echo request details
(the access key id, the string to sign) there. The code and the request id are shown only when shaped like
one, and never when they share a run of characters with the credentials the request was signed with: a
short alphanumeric secret key (about one in four is) echoed there has the shape of both.
"""

from __future__ import annotations

import html
import re
from collections.abc import Collection, Mapping
from email.message import Message

from modelload.loader.errors import (
    ConfigError,
    ModelloadError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)

from ._base import InterruptedReadError
from ._responses import RETRYABLE_STATUSES, parse_retry_after

__all__ = ["error_code", "s3_error"]

_NOT_FOUND = frozenset({"NoSuchKey", "NoSuchBucket", "NoSuchVersion", "NotFound"})
_CHANGED = frozenset({"PreconditionFailed", "InvalidRange"})
_RETRYABLE = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "OperationAborted",
    }
)
_WRONG_REGION = frozenset(
    {"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}
)
_DENIED_HINTS = {
    "InvalidAccessKeyId": "the access key id is unknown to this endpoint: check AWS_ACCESS_KEY_ID in the"
    " Secret and that the endpoint is the store that issued it",
    "SignatureDoesNotMatch": "the secret key does not match the access key id: check AWS_SECRET_ACCESS_KEY",
    "ExpiredToken": "the temporary credentials expired: check that the role's token is refreshed (IRSA token"
    " file, pod identity) or renew AWS_SESSION_TOKEN",
    "TokenRefreshRequired": "the temporary credentials expired: check the role's token refresh",
    "InvalidToken": "the session token is malformed or not valid here: check AWS_SESSION_TOKEN",
    "RequestTimeTooSkewed": "this machine's clock is too far from the server's: fix the clock (NTP)",
    "AllAccessDisabled": "all access to this bucket or object has been disabled by its owner",
    "AccountProblem": "the bucket owner's account has a problem that blocks access",
}


_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9.]{0,63}$")
_NOT_A_CODE = re.compile(r"[A-Z]{7}|[0-9]{4}")
"""A run no code has (codes are CamelCase words, acronyms such as SHA256 at most): a token's, not a code's."""
_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
"""AWS's request ids are 16 hex digits, MinIO's alike, Ceph's ``tx…-…-zone``: letters, digits and '-'."""


_ECHO_RUN = 8
"""Characters in a row that a shown code or request id may not share with a credential."""


def error_code(body: bytes, secrets: Collection[str] | None = ()) -> str | None:
    """The ``<Code>`` of an S3 XML error body, only when it has an error code's shape (letters and digits,
    as ``NoSuchKey``) and echoes none of ``secrets`` (None: the secrets are unknown, so nothing is shown);
    else None: a gateway that echoes the request (a session token) into it gets nothing shown."""
    if secrets is None:
        return None
    match = re.search(rb"<Code>([^<]{1,128})</Code>", body)
    if match is None:
        return None
    code = html.unescape(match.group(1).decode("utf-8", "replace")).strip()
    if not _CODE.match(code) or _NOT_A_CODE.search(code) or _echoes(code, secrets):
        return None
    return code


def _request_id(headers: Mapping[str, str] | Message, secrets: Collection[str] | None) -> str | None:
    """``x-amz-request-id``, only when it has a request id's shape and echoes none of ``secrets`` (what else
    a server puts there is not shown: some echo the request's Authorization)."""
    if secrets is None:
        return None
    value = (headers.get("x-amz-request-id") or "").strip()
    return value if _REQUEST_ID.match(value) and not _echoes(value, secrets) else None


def _echoes(text: str, secrets: Collection[str]) -> bool:
    """Whether ``text`` holds :data:`_ECHO_RUN` characters in a row of any of ``secrets`` (or all of a
    shorter one): a part of a credential shows as much as the whole."""
    return any(
        secret[at : at + _ECHO_RUN] in text
        for secret in secrets
        if secret
        for at in range(max(len(secret) - _ECHO_RUN, 0) + 1)
    )


def s3_error(
    status: int,
    headers: Mapping[str, str] | Message,
    body: bytes,
    *,
    bucket: str,
    key: str,
    unsigned: bool,
    secrets: Collection[str] | None = (),
) -> ModelloadError:
    """The error for an S3 response that is not a successful read of ``s3://bucket/key``; ``secrets`` are
    the credentials the request was signed with, none of which the message may echo (None when they are
    not known: the message then shows no code or request id)."""
    uri = f"s3://{bucket}/{key}"
    code = error_code(body, secrets)
    request_id = _request_id(headers, secrets)
    tail = (
        f" (HTTP {status}{', ' + code if code else ''}{', request id ' + request_id if request_id else ''})"
    )
    if code in _NOT_FOUND or (code is None and status == 404):
        if code == "NoSuchBucket":
            text = f"bucket {bucket!r} does not exist: check the bucket name, the endpoint and the region"
        elif code is None:
            text = f"no object {key!r} in bucket {bucket!r} (or no such bucket): check the URI"
        else:
            text = f"no object {key!r} in bucket {bucket!r}: check the key"
        return SourceNotFoundError(f"{uri}: {text}{tail}", uri=uri)
    if code in _WRONG_REGION or status == 301:
        region = headers.get("x-amz-bucket-region") or _region_in(body)
        where = f"region {region}" if region else "another region or endpoint"
        return ConfigError(
            f"{uri}: bucket {bucket!r} is in {where}: set the S3 region (--s3-region) to match{tail}"
        )
    if code in _DENIED_HINTS or code == "AccessDenied" or status in (401, 403):
        if code in _DENIED_HINTS:
            hint = _DENIED_HINTS[code]
        elif unsigned:
            hint = (
                "anonymous access was refused, the object is not public: drop --s3-unsigned and provide"
                " credentials"
            )
        else:
            hint = (
                f"the credentials are not allowed to read it: grant s3:GetObject on"
                f" arn:aws:s3:::{bucket}/{key} to the role or user, and check the bucket policy"
            )
        return SourceAccessDeniedError(f"{uri}: access denied, {hint}{tail}", uri=uri)
    if code in _CHANGED or status in (412, 416):
        return SourceChangedError(
            f"{uri} changed while it was being read (replaced or shortened); restart the load{tail}", uri=uri
        )
    if code in _RETRYABLE or status in RETRYABLE_STATUSES or status >= 500:
        return InterruptedReadError(
            f"{uri}: the store asked to retry{tail}",
            uri=uri,
            retry_after=parse_retry_after(headers.get("Retry-After")),
        )
    return SourceError(f"{uri}: the store refused the request{tail}", uri=uri)


def _region_in(body: bytes) -> str | None:
    match = re.search(rb"<Region>([a-z0-9-]{1,64})</Region>", body)
    return match.group(1).decode("ascii") if match else None
