"""No asker can hold a sidecar's ports: connection caps, request deadlines, upload slots that cannot be kept.

A real ``modelload sidecar`` process on loopback gets thousands of idle unauthenticated connections on its
peer port and its status API (from 127.0.0.2, so that its per-address caps apply to them and not to the
honest requests from 127.0.0.1); the peer server in this process gets askers that stop reading, malformed
heads, replays and stale signatures. Everything waits on what it can observe (a socket closed by the server,
a 206, a count in the stats) within deadlines that only a broken run reaches.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.peerwire import PeerKey, Request
from modelload.sidecar.api import PER_ADDRESS
from modelload.sidecar.peers.server import PeerServer, ServerLimits, Slice
from tests.sidecar.models import safetensors_bytes
from tests.support.fixtures import nginx  # noqa: F401 - the fixture
from tests.support.nginx import NginxServer
from tests.support.peer_client import peer_get
from tests.support.ports import free_port
from tests.support.processes import stop_process
from tests.support.waiting import wait_for

from .test_loopback import TOKEN, _tensors

IDLE = 3000


def _open_many(port: int, count: int) -> list[socket.socket]:
    """``count`` connections to ``port`` from 127.0.0.2 that never send a byte."""
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.settimeout(5)
        with contextlib.suppress(OSError):  # refused or reset: the server is over its cap
            sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (non-blocking): what it sent before is read and dropped."""
    try:
        while sock.recv(65536):
            pass
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset, or never connected
        return True


def _counts(pid: int) -> tuple[int, int]:
    """The process's threads and open file descriptors."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def many_files() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 2 * IDLE + 4096), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_thousands_of_idle_connections_cost_neither_port_a_thread_and_are_closed(
    nginx: NginxServer,  # noqa: F811 - the fixture
    tmp_path: Path,
    many_files: None,
) -> None:
    (nginx.root / "limits.safetensors").write_bytes(safetensors_bytes(_tensors(3)))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    api_port, peer_port = free_port(), free_port()
    log = tmp_path / "sidecar.log"
    argv = [
        sys.executable, "-m", "modelload.loader.cli.main", "sidecar",
        "--source", nginx.url("limits.safetensors"), "--segment", str(tmp_path / "a.seg"), "--notify", "none",
        "--host", "127.0.0.1", "--port", str(api_port), "--peers", f"http://127.0.0.1:{peer_port}",
        "--peer-port", str(peer_port), "--peer-token-file", str(token_file), "--log-level", "debug",
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    peer = f"http://127.0.0.1:{peer_port}"
    sockets: list[socket.socket] = []
    try:
        wait_for(
            lambda: peer_get(peer, "/peer/v1/manifest", TOKEN).json()["phase"] == "complete",
            timeout=60, what="the sidecar's load complete", ignoring=(OSError,),
        )  # fmt: skip
        threads, files = _counts(process.pid)
        sockets = _open_many(peer_port, IDLE) + _open_many(api_port, IDLE)
        capped = ServerLimits().per_address + PER_ADDRESS
        wait_for(  # the flood absorbed: all but the connections within the per-address caps closed
            lambda: sum(not _closed_by_server(s) for s in sockets) <= capped,
            timeout=60, what="the sidecar closing the connections over its caps", interval=0.2,
        )  # fmt: skip
        # Both ports still answer honest requests (from another address) while the idle sockets are open ...
        answer = peer_get(peer, "/peer/v1/manifest", TOKEN)
        assert answer.status == 200 and answer.proven
        health = peer_get(f"http://127.0.0.1:{api_port}", "/healthz", None)
        assert health.status == 200
        # ... with no thread more, and a file descriptor only for the connections within the caps.
        now_threads, now_files = _counts(process.pid)
        assert now_threads <= threads + 2, f"{now_threads - threads} threads for idle connections"
        assert now_files <= files + capped + 16
        wait_for(
            lambda: all(_closed_by_server(s) for s in sockets),
            timeout=60, what="the sidecar closing every idle connection", interval=0.5,
        )  # fmt: skip
    finally:
        for sock in sockets:
            sock.close()
        stop_process(process)
    text = log.read_text()
    assert "Traceback" not in text
    assert "dropped a connection from 127.0.0.2 (over the connection cap)" in text
    assert "status API: dropped a connection from 127.0.0.2 (no request in time)" in text


class _File:
    """A Servable over one file: every range is READY (the server's limits are what is under test)."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.size = path.stat().st_size
        self.sent = 0

    def manifest(self) -> dict[str, Any]:
        return {"id": "0" * 16, "phase": "complete", "bytes_done": self.size}

    def stats(self) -> dict[str, Any]:
        return {"uploaded_bytes": self.sent}

    def file_info(self, file: int) -> tuple[str, int] | None:
        return ('"v1"', self.size) if file == 0 else None

    def locate(self, file: int, offset: int, length: int) -> Slice | None:
        return Slice(self.fd, offset, length)

    def uploaded(self, nbytes: int) -> None:
        self.sent += nbytes


@pytest.fixture
def server(tmp_path: Path) -> Iterator[PeerServer]:
    path = tmp_path / "weights"
    path.write_bytes(os.urandom(1 << 20) * 64)
    state = _File(path)
    limits = ServerLimits(idle_timeout=1.0, rate_window=1.0)
    peer_server = PeerServer(
        state, key=PeerKey(TOKEN), host="127.0.0.1", port=0, max_uploads=2, limits=limits
    )
    peer_server.start()
    try:
        yield peer_server
    finally:
        peer_server.stop()
        os.close(state.fd)


def _stuck_asker(port: int, size: int) -> socket.socket:
    """An asker that requests a large range, reads the head's first bytes and then nothing."""
    path = "/peer/v1/files/0"
    signed = PeerKey(TOKEN).sign(Request("GET", path, f"127.0.0.1:{port}", f"bytes=0-{size - 1}"))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nRange: bytes=0-{size - 1}\r\n"
        f"Authorization: {signed.authorization}\r\n\r\n".encode()
    )
    assert sock.recv(12).startswith(b"HTTP/1.1 206")
    return sock


def test_askers_that_stop_reading_lose_their_upload_slots_to_the_next(server: PeerServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    stuck = [_stuck_asker(server.port, 32 << 20) for _ in range(2)]  # both upload slots
    try:
        wait_for(
            lambda: server.dropped["idle or too slow"] >= 2,
            timeout=30, what="the server cutting both askers that stopped reading",
        )  # fmt: skip
        for sock in stuck:
            sock.setblocking(False)
        wait_for(lambda: all(_closed_by_server(s) for s in stuck), timeout=30, what="both connections closed")
        served = wait_for(
            lambda: (a := peer_get(base, "/peer/v1/files/0", TOKEN, headers={"Range": "bytes=0-1048575"}))
            .status == 206 and a,
            timeout=30, what="an upload slot freed from the askers that stopped reading",
        )  # fmt: skip
        assert served.proven
    finally:
        for sock in stuck:
            sock.close()


def test_bad_request_heads_are_refused_in_one_line_each(
    server: PeerServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="modelload.sidecar.peers.server")
    for raw in (
        b"NOT HTTP AT ALL\r\n\r\n",
        b"GET /peer/v1/manifest HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
        b"GET /peer/v1/manifest HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",
        b"GET /peer/v1/manifest HTTP/1.1\r\nRange: bytes=0-1\r\nRange: bytes=2-3\r\n\r\n",
    ):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(raw)
            assert sock.recv(64).startswith(b"HTTP/1.1 400")
    assert server.dropped and sum(server.dropped.values()) >= 4
    assert not any(record.exc_info for record in caplog.records)
    assert all("\n" not in record.getMessage() for record in caplog.records)


def test_a_signed_request_is_good_once_and_only_near_the_servers_clock(server: PeerServer) -> None:
    base = f"http://127.0.0.1:{server.port}"
    here = f"127.0.0.1:{server.port}"
    key = PeerKey(TOKEN)
    signed = key.sign(Request("GET", "/peer/v1/manifest", here))
    header = {"Authorization": signed.authorization}
    assert peer_get(base, "/peer/v1/manifest", None, headers=header).status == 200
    again = peer_get(base, "/peer/v1/manifest", None, headers=header)
    assert again.status == 401 and b"already used" in again.body
    import time

    stale = key.sign(Request("GET", "/peer/v1/manifest", here), now=time.time() - 300)
    old = peer_get(base, "/peer/v1/manifest", None, headers={"Authorization": stale.authorization})
    assert old.status == 401 and b"off this peer's clock" in old.body
    other = key.sign(Request("GET", "/peer/v1/files/0", here, "bytes=0-9"))  # signed for another range
    moved = peer_get(
        base, "/peer/v1/files/0", None, headers={"Authorization": other.authorization, "Range": "bytes=0-99"}
    )
    assert moved.status == 401 and b"does not match" in moved.body
    assert server.refused >= 3
