"""Socket, TLS, HTTP-parsing and file errors of one HTTP exchange, translated into the error tree.

The one boundary where what ``http.client``, ``ssl`` and the socket raise during a request of
:class:`~._http.HttpObject` (and so of every store on the HTTP path) becomes a branch of
``modelload.loader.errors``: a wrong setting (an unverifiable certificate, TLS spoken to a plain-HTTP
server) a :class:`ConfigError`, a full destination volume its segment error, and everything else an
:class:`InterruptedReadError` that carries how many bytes landed, so the retry layer resumes where the
stream broke. Status codes are :mod:`._responses`' part.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from collections.abc import Callable

from modelload.loader.errors import ConfigError, ModelloadError, SegmentSpaceError, SourceError
from modelload.loader.segment.volume import full_volume

from ._base import InterruptedReadError
from ._connections import Origin
from ._deadline import DeadlineError
from ._settings import HttpSettings
from ._splice import SlowTransferError

__all__ = ["PLAIN_HTTP_REPLIES", "translate_transport_error"]

PLAIN_HTTP_REPLIES = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"})
"""OpenSSL's reasons for a TLS handshake answered in plain HTTP (a server without TLS at an https:// URL):
a wrong setting, not worth a retry."""


def translate_transport_error(
    exc: BaseException,
    *,
    uri: str,
    settings: HttpSettings,
    plain_http_advice: Callable[[Origin], str],
    landed: int = 0,
    total: int = 0,
    connecting: Origin | None = None,
) -> ModelloadError:
    """Map a socket, TLS, HTTP-parsing or file error to the error tree, with the bytes that landed.

    ``connecting`` is the origin a connection was being opened to (no request sent yet);
    ``plain_http_advice`` says what to do when that origin, reached over TLS, answered in plain HTTP.
    """
    where = f"after {landed} of {total} bytes" if total else "before the response"
    if isinstance(exc, SegmentSpaceError):
        return exc
    if isinstance(exc, http.client.InvalidURL | UnicodeError):
        # http.client refuses a request path with a space, a control character or a character outside ASCII
        # (a server's redirect to one) before sending it; its exception quotes the path, query (a signature)
        # included, or the header value (a token), and a retry would fail the same way
        if connecting is not None:
            return SourceError(f"{uri}: {connecting.host!r} is not a host name that can be reached", uri=uri)
        if isinstance(exc, UnicodeEncodeError) and exc.encoding != "ascii":
            return SourceError(
                f"{uri}: a header of this read (a token a service issued) holds a character HTTP cannot send",
                uri=uri,
            )
        return SourceError(
            f"{uri}: a URL of this read (the source's, or one a server redirected to) holds a space, a"
            " control character or a character outside ASCII, which HTTP does not allow in a request:"
            " percent-encode it (%20 for a space)",
            uri=uri,
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return ConfigError(
            f"{uri}: the server's TLS certificate cannot be verified ({exc.verify_message});"
            " set the CA bundle for a private CA"
        )
    full = (
        full_volume(exc, f"no room left in the destination while reading {uri}")
        if isinstance(exc, OSError)
        else None
    )
    if full is not None:
        return full
    if connecting is not None:
        if isinstance(exc, ssl.SSLError) and exc.reason in PLAIN_HTTP_REPLIES:
            return ConfigError(
                f"{uri}: {connecting.netloc} answered in plain HTTP, not TLS: "
                + plain_http_advice(connecting)
            )
        # Through a proxy the connection that failed is the proxy's: name it, not the origin behind it.
        via = settings.proxy.for_origin(connecting.scheme, connecting.host) if settings.proxy else None
        target = f"the proxy {via[0]}:{via[1]} (for {connecting.netloc})" if via else connecting.netloc
        if isinstance(exc, DeadlineError):
            reason = f"{target}: {exc}"
        elif isinstance(exc, socket.gaierror):
            reason = f"cannot resolve {f'the proxy {via[0]}' if via else connecting.host}"
        elif isinstance(exc, TimeoutError):
            reason = f"no connection to {target} within {settings.connect_timeout:g} s"
        else:
            reason = f"cannot connect to {target}: {_describe(exc)}"
        return InterruptedReadError(f"{uri}: {reason}", uri=uri)
    if isinstance(exc, DeadlineError):
        reason = f"{exc}: retrying on another connection"
    elif isinstance(exc, SlowTransferError):
        reason = f"{exc} {where}: resuming on another connection"
    elif isinstance(exc, TimeoutError):
        reason = f"the stream stalled (no bytes for {settings.stall_timeout:g} s) {where}"
    elif isinstance(exc, EOFError):
        reason = f"the server closed the connection {where} (short body)"
    else:
        reason = f"the connection broke {where}: {_describe(exc)}"
    return InterruptedReadError(f"{uri}: {reason}", uri=uri, landed=landed)


_HTTP_PARSING = {
    http.client.RemoteDisconnected: "the server closed the connection without a response",
    http.client.BadStatusLine: "the server's status line is malformed",
    http.client.LineTooLong: "a line of the response is too long",
    http.client.UnknownProtocol: "the response is not HTTP/1.x",
    http.client.IncompleteRead: "the body ended early",
}
"""What each ``http.client`` parsing error means. Their own text quotes what the server sent (a status line,
a protocol version), which a hostile server or a gateway can fill with the request's credentials."""


def _describe(exc: BaseException) -> str:
    name = type(exc).__name__
    if isinstance(exc, http.client.HTTPException | ValueError):
        # by type only: the text of these quotes the response (or the request's URL)
        for kind, meaning in _HTTP_PARSING.items():
            if isinstance(exc, kind):
                return f"{name}: {meaning}"
        return name
    if isinstance(exc, OSError) and exc.strerror:
        return f"{name}: {exc.strerror}"
    text = str(exc)
    return f"{name}: {text}" if text else name
