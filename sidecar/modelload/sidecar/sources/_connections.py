"""Persistent HTTP(S) connections: one per thread per origin, reused across requests (HTTP/1.1 keep-alive).

The standard library's ``http.client`` is used on purpose: its connections expose the socket, so a response
body can be read with ``recv_into`` straight into the caller's buffer (or spliced into a file), which runs at
2.5-3.3 GiB/s here against 0.9 for urllib3-based clients that read into a new bytes object and copy.

One connection per thread keeps the pool lock-free on the hot path and makes the pool exactly as large as the
reader count; the files of one model share a pool (``_store.shared_opener``), so that is one
connection per thread whatever the shard count. A pool remembers every connection it opened so
:meth:`ConnectionPool.close` can close them all.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._deadline import Deadline
from ._settings import HttpSettings

__all__ = ["ConnectionPool", "Origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Origin:
    """Scheme, host and port: what a connection is bound to."""

    scheme: str
    host: str
    port: int

    @property
    def netloc(self) -> str:
        """The Host header value: the port only when it is not the scheme's default."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        if self.port == _DEFAULT_PORTS[self.scheme]:
            return host
        return f"{host}:{self.port}"

    @property
    def is_tls(self) -> bool:
        return self.scheme == "https"

    @classmethod
    def parse(cls, scheme: str, host: str | None, port: int | None) -> Origin:
        if scheme not in _DEFAULT_PORTS:
            raise ValueError(f"not an http(s) scheme: {scheme!r}")
        if not host:
            raise ValueError("the URL has no host")
        return cls(scheme, host, port or _DEFAULT_PORTS[scheme])


class ConnectionPool:
    """Thread-local persistent connections to any number of origins.

    :meth:`acquire` returns this thread's connection to an origin, connected, with ``stall_timeout`` as its
    socket timeout, and whether it was reused (a reused connection may have been closed by the server while
    idle, so a failure before any response byte on it is worth one immediate retry on a fresh one).

    The sources of one model's files share one pool (:meth:`share`): a reader thread then carries every
    file's requests to an origin on one connection, where a pool per file opened one per file and thread
    (502 connections for the 666 requests of 160 shards from nginx). Over HTTPS each connection is a TLS
    handshake, about 1.1 ms of CPU here (160 files from nginx over TLS, two small reads each from 4 threads:
    0.29 CPU-s with a pool per file, 0.11 shared). Only the transport is shared: each source sends its own
    headers and credentials to its own origin, and connections are kept per origin.
    """

    def __init__(self, settings: HttpSettings, *, ca_bundle: str | None = None) -> None:
        self._settings = settings
        self._ca_bundle = settings.ca_bundle or ca_bundle
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: set[http.client.HTTPConnection] = set()
        self._ssl_context: ssl.SSLContext | None = None
        self._closed = False
        self._users = 1
        self.connections_opened = 0

    def share(self) -> ConnectionPool | None:
        """This pool, for one more source made with the same settings (each of them calls :meth:`close`,
        and the last one closes the connections); None when every source using it has closed it already
        (a model's small file, read and closed before the next file was opened): make a new one then."""
        with self._lock:
            if self._closed:
                return None
            self._users += 1
        return self

    def _context(self) -> ssl.SSLContext:
        with self._lock:
            if self._ssl_context is None:
                if self._settings.verify_tls:
                    context = ssl.create_default_context(cafile=self._ca_bundle)
                else:
                    context = ssl.create_default_context()
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
                self._ssl_context = context
            return self._ssl_context

    def _connections(self) -> dict[Origin, http.client.HTTPConnection]:
        conns: dict[Origin, http.client.HTTPConnection] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        return conns

    def acquire(self, origin: Origin) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``origin`` and whether it was already open."""
        if self._closed:
            raise RuntimeError("the source is closed")
        conns = self._connections()
        conn = conns.get(origin)
        if conn is not None and conn.sock is not None:
            return conn, True
        if conn is None:
            conn = self._new(origin)
            conns[origin] = conn
        settings = self._settings
        # A proxy's answer to CONNECT is read line by line, for as long as bytes come: bounded as a whole.
        handshake = Deadline(lambda: conn.sock, settings.connect_timeout + settings.stall_timeout)
        try:
            with handshake:
                conn.connect()  # raises OSError / ssl.SSLError; the caller translates
        except BaseException as exc:
            # A failed TLS handshake leaves conn.sock set to the socket it detached: kept, the next request
            # would take it for an open connection and fail with EBADF.
            self.discard(origin, conn)
            if handshake.fired:
                raise handshake.error("the proxy's answer to CONNECT") from exc
            raise
        assert conn.sock is not None
        conn.sock.settimeout(self._settings.stall_timeout)
        with self._lock:
            self.connections_opened += 1
        return conn, False

    def request_path(self, origin: Origin, path: str) -> str:
        """The request target: ``path``, or the absolute URL when a plain-HTTP origin goes through a proxy."""
        if not origin.is_tls and self._proxy(origin) is not None:
            return f"http://{origin.netloc}{path}"
        return path

    def _proxy(self, origin: Origin) -> tuple[str, int] | None:
        proxy = self._settings.proxy
        return proxy.for_origin(origin.scheme, origin.host) if proxy is not None else None

    def _new(self, origin: Origin) -> http.client.HTTPConnection:
        timeout = self._settings.connect_timeout
        conn: http.client.HTTPConnection
        proxy = self._proxy(origin)
        if proxy is not None:
            host, port = proxy
            if origin.is_tls:
                conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._context())
                conn.set_tunnel(origin.host, origin.port)  # CONNECT; TLS end to end with the origin
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout)
        elif origin.is_tls:
            conn = http.client.HTTPSConnection(
                origin.host, origin.port, timeout=timeout, context=self._context()
            )
        else:
            conn = http.client.HTTPConnection(origin.host, origin.port, timeout=timeout)
        # Every connection's address is checked as it connects (where a policy is set), and its socket keeps
        # urgent data in line (_urgent_in_line).
        connect = self._settings.addresses.connect if self._settings.addresses is not None else None
        conn._create_connection = _urgent_in_line(connect or socket.create_connection)  # type: ignore[attr-defined]
        with self._lock:
            self._open.add(conn)
        return conn

    def discard(self, origin: Origin, conn: http.client.HTTPConnection) -> None:
        """Close a connection whose state is unknown (an error mid-request, an unread body)."""
        conn.close()
        conns = self._connections()
        if conns.get(origin) is conn:
            del conns[origin]
        with self._lock:
            self._open.discard(conn)

    def close(self) -> None:
        """Close every connection of every thread once every source sharing the pool has called this. Call
        when no thread is reading any more."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self._closed = True
            conns, self._open = list(self._open), set()
        for conn in conns:
            conn.close()


def socket_of(conn: http.client.HTTPConnection) -> socket.socket:
    """The connected socket of ``conn``, taken before ``getresponse`` (which drops it on close)."""
    sock = conn.sock
    if sock is None:  # pragma: no cover - acquire() always returns a connected connection
        raise ConnectionError("the connection is not open")
    return sock


def _urgent_in_line(connect: Callable[..., socket.socket]) -> Callable[..., socket.socket]:
    """``connect`` whose sockets take TCP urgent data in line (``SO_OOBINLINE``): a server has no business
    sending any, and one that does must not make a body lose a byte out of band (a receive would skip it
    and shift every byte after it) nor stop a splice for good (the kernel's splice stops at an urgent byte;
    ``_splice.splice_socket`` reads past it with a plain read, which in line takes it as a body byte)."""

    def connected(*args: Any, **kwargs: Any) -> socket.socket:
        sock = connect(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_OOBINLINE, 1)
        return sock

    return connected
