"""A TCP proxy that adds a round trip before every request reaches the origin, for kernels without netem.

``python delay_proxy.py LISTEN_HOST LISTEN_PORT UPSTREAM_HOST UPSTREAM_PORT DELAY_MS``

Bytes from the client are held ``DELAY_MS`` before they are forwarded (a request waits one round trip before
the origin sees it, as over a link with that round-trip time); bytes from the origin go back with
``os.splice`` through a pipe, so the response never crosses user space and the proxy costs little CPU. It
runs inside the S3-like origin's network namespace (``origins.s3_like``), beside nginx.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time

SPLICE = 1 << 20


def _requests(client: socket.socket, upstream: socket.socket, delay: float) -> None:
    try:
        while data := client.recv(65536):
            time.sleep(delay)
            upstream.sendall(data)
    except OSError:
        pass
    finally:
        _close(upstream)


def _responses(upstream: socket.socket, client: socket.socket) -> None:
    read_end, write_end = os.pipe()
    try:
        while True:
            moved = os.splice(upstream.fileno(), write_end, SPLICE)
            if moved == 0:
                return
            while moved:
                moved -= os.splice(read_end, client.fileno(), moved)
    except OSError:
        pass
    finally:
        os.close(read_end)
        os.close(write_end)
        _close(client)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def main() -> None:
    host, port, up_host, up_port, delay_ms = sys.argv[1:6]
    delay = float(delay_ms) / 1000
    listener = socket.create_server((host, int(port)), backlog=1024)
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection((up_host, int(up_port)))
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_requests, args=(client, upstream, delay), daemon=True).start()
        threading.Thread(target=_responses, args=(upstream, client), daemon=True).start()


if __name__ == "__main__":
    main()
