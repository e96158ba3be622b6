"""Reading HTTP response headers: Content-Range, Retry-After, ETags, and status codes mapped to our errors.

Pure functions over header values, shared by the HTTP and S3 sources, so every rule about what a response
means is in one place and testable without a server.
"""

from __future__ import annotations

import email.utils
import http
import json
import math
import re
import time
from collections.abc import Mapping
from email.message import Message
from urllib.parse import urlsplit, urlunsplit

from modelload.loader.errors import (
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
)

from ._base import InterruptedReadError

__all__ = [
    "RETRYABLE_STATUSES",
    "display_url",
    "error_for_status",
    "redact_uri",
    "status_text",
    "json_body",
    "parse_content_range",
    "parse_retry_after",
    "same_etag",
]

RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)


def display_url(url: str) -> str:
    """``url`` without user info, query string or fragment: safe for logs even when presigned.

    A plain path (no scheme and host) is returned as it is.
    """
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    shown = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return f"{shown}?…" if parts.query else shown


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:?/*)([^/@?#\s]*)@")


def redact_uri(text: str) -> str:
    """A URI as a user wrote it, fit for a message even when it does not parse: a password in its user info
    shown as ``***`` (``https://alice:***@host/m``), a query string and fragment as ``?…``.

    For configuration values and sources that are refused (a typo, a wrong scheme): the message still shows
    what was written, less what could be a credential.
    """
    text = text.strip()
    cut = min((i for i in (text.find("?"), text.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        text = text[:cut] + "?…"
    userinfo = _USERINFO.match(text)
    if userinfo and ":" in userinfo.group(2):
        user = userinfo.group(2).partition(":")[0]
        text = f"{userinfo.group(1)}{user}:***@{text[userinfo.end() :]}"
    return text


def status_text(status: int) -> str:
    """``HTTP 403 Forbidden``: the status code with its standard phrase (none for a code without one).

    The server's own reason phrase is never shown: a server or gateway chooses it, and some echo the
    request (``403 Denied for Bearer <token>``) into it.
    """
    try:
        return f"HTTP {status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return f"HTTP {status}"


def json_body(body: bytes | str) -> object:
    """A service's JSON answer, parsed; ValueError for anything that is not JSON, nesting too deep to parse
    included (a hostile server's ``[[[[...`` would otherwise end in a RecursionError)."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def parse_content_range(value: str | None) -> tuple[int | None, int | None, int | None]:
    """``bytes a-b/n`` as ``(a, b, n)``; ``bytes */n`` as ``(None, None, n)``; unknown parts are None."""
    if not value:
        return None, None, None
    match = _CONTENT_RANGE.match(value)
    if match is None:
        return None, None, None
    first, last, total = match.groups()
    return (
        int(first) if first is not None else None,
        int(last) if last is not None else None,
        int(total) if total not in (None, "*") else None,
    )


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta seconds or an HTTP date); None when absent or bad."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)  # RFC 9110 says whole seconds; fractions are accepted
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    delay = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, delay)


def same_etag(a: str | None, b: str | None) -> bool:
    """Whether two ETags name the same version (weak comparison: ``W/"x"`` equals ``"x"``)."""
    if a is None or b is None:
        return True
    return a.removeprefix("W/") == b.removeprefix("W/")


def error_for_status(
    status: int, reason: str, headers: Mapping[str, str] | Message, *, uri: str, detail: str = ""
) -> SourceError:
    """The error for an HTTP status that is not a successful read, with what to do about it.

    ``reason`` (the server's reason phrase) is not shown: the standard phrase of ``status`` is (see
    :func:`status_text`).
    """
    del reason
    what = status_text(status) + (f" ({detail})" if detail else "")
    if status in (404, 410):
        return SourceNotFoundError(f"{uri} does not exist ({what}): check the URL", uri=uri)
    if status in (401, 403, 407):
        return SourceAccessDeniedError(
            f"{uri} refused access ({what}): check the URL's token or signature (a presigned URL may have"
            " expired) and the server's access rules",
            uri=uri,
        )
    if status in (412, 416):
        return SourceChangedError(
            f"{uri} changed while it was being read ({what}): the object was replaced; restart the load",
            uri=uri,
        )
    if 300 <= status < 400:
        return SourceError(
            f"{uri} redirects elsewhere ({what}) and the redirect was not followed: too many redirects, or"
            " none allowed (max_redirects)",
            uri=uri,
        )
    if status in RETRYABLE_STATUSES or status >= 500:
        return InterruptedReadError(
            f"{uri} failed with {what}", uri=uri, retry_after=parse_retry_after(headers.get("Retry-After"))
        )
    return SourceError(f"{uri} answered {what}, which this loader does not know how to handle", uri=uri)


def parse_byteranges(content_type: str | None, body: bytes) -> dict[tuple[int, int], bytes] | None:
    """The parts of a ``multipart/byteranges`` body (RFC 9110, 14.6) by ``(first, last)`` byte, or None when
    the body is not one, or a part is not whole (a part's length must be what its Content-Range says)."""
    kind, _, parameters = (content_type or "").partition(";")
    if kind.strip().lower() != "multipart/byteranges":
        return None
    boundary = next(
        (value.strip().strip('"') for key, _, value in (p.partition("=") for p in parameters.split(";"))
         if key.strip().lower() == "boundary"),
        "",
    )  # fmt: skip
    if not boundary:
        return None
    parts: dict[tuple[int, int], bytes] = {}
    delimiter = b"--" + boundary.encode("latin-1")
    for part in body.split(delimiter)[1:]:
        if part.startswith(b"--"):
            break  # the closing delimiter
        head, separator, data = part.partition(b"\r\n\r\n")
        if not separator:
            return None
        ranged = next(
            (
                line.split(b":", 1)[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-range:")
            ),
            None,
        )
        first, last, _ = parse_content_range(ranged.decode("latin-1").strip() if ranged else None)
        if first is None or last is None:
            return None
        if len(data) != last - first + 3 or not data.endswith(b"\r\n"):  # the part, then the CRLF before
            return None  # the next delimiter: anything else is a part cut short or overlong
        parts[(first, last)] = data[:-2]
    return parts
