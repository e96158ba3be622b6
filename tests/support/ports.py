"""Loopback ports and readiness checks for the test servers."""

from __future__ import annotations

import socket

from tests.support.waiting import wait_for

__all__ = ["free_port", "wait_for_port"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, release it).

    Another process may take it before the server binds: servers started with it retry on a bind error.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, *, timeout: float = 10.0, alive: object = None) -> bool:
    """Wait until something accepts connections on 127.0.0.1:``port``; False on timeout.

    ``alive``, when given, is a ``subprocess.Popen``: the wait stops early (False) if it exits.
    """

    def accepting() -> bool:
        if alive is not None and alive.poll() is not None:  # type: ignore[attr-defined]
            raise _Exited
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True

    try:
        wait_for(accepting, timeout=timeout, what=f"port {port}", interval=0.02, ignoring=(OSError,))
    except (AssertionError, _Exited):
        return False
    return True


class _Exited(Exception):
    """The server's process exited while the port was awaited."""
