"""Socket, TLS, HTTP-parsing and file errors of one HTTP exchange, translated into the error tree.

The one boundary where what ``http.client``, ``ssl`` and the socket raise during a request of
:class:`~._http.HttpObject` (and so of every store on the HTTP path) becomes a branch of
``modelload.loader.errors``: a wrong setting (an unverifiable certificate, TLS spoken to a plain-HTTP
server) a :class:`ConfigError`, a full destination volume its segment error, and everything else an
:class:`InterruptedReadError` that carries how many bytes landed, so the retry layer resumes where the
stream broke. Status codes are :mod:`._responses`' part.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

from modelload.loader.errors import ConfigError, ModelloadError, SegmentSpaceError
from modelload.loader.segment.volume import full_volume

from ._base import InterruptedReadError
from ._connections import Origin
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
        if isinstance(exc, socket.gaierror):
            reason = f"cannot resolve {connecting.host}"
        elif isinstance(exc, TimeoutError):
            reason = f"no connection to {connecting.netloc} within {settings.connect_timeout:g} s"
        else:
            reason = f"cannot connect to {connecting.netloc}: {_describe(exc)}"
        return InterruptedReadError(f"{uri}: {reason}", uri=uri)
    if isinstance(exc, SlowTransferError):
        reason = f"{exc} {where}: resuming on another connection"
    elif isinstance(exc, TimeoutError):
        reason = f"the stream stalled (no bytes for {settings.stall_timeout:g} s) {where}"
    elif isinstance(exc, EOFError):
        reason = f"the server closed the connection {where} (short body)"
    else:
        reason = f"the connection broke {where}: {_describe(exc)}"
    return InterruptedReadError(f"{uri}: {reason}", uri=uri, landed=landed)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
