"""Long bodies are received in batches (the socket's low-water mark), and a slow or stalled sender is treated
exactly as before: read as it comes, or failed after the stall timeout and resumed at the byte."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import termios
import threading
from collections.abc import Iterator

import pytest

from modelload.sidecar.sources import (
    HttpSettings,
    RetryEvent,
    Source,
    SourceSettings,
    _body,
    _low_water,
    _splice,
    open_source,
    read_range,
    read_range_into_fd,
    read_range_into_sink,
)
from modelload.sidecar.sources._low_water import BATCH, PROBE, LowWater
from tests.support.fault_proxy import FaultProxy, Stall, Trickle
from tests.support.nginx import NginxServer
from tests.support.waiting import wait_for

from .conftest import FAST_RETRY, FAST_SETTINGS, payload

DATA = payload(1_200_000, seed=11)
STALL = FAST_SETTINGS.http.stall_timeout


@pytest.fixture
def source(nginx: NginxServer, nginx_proxy: FaultProxy) -> Source:
    nginx.put("low-water/model.bin", DATA)
    src = open_source(nginx_proxy.url("low-water/model.bin"), FAST_SETTINGS)
    src.stat()
    return src


@pytest.fixture(params=["mapping", "splice", "sink"])
def landing(request: pytest.FixtureRequest) -> str:
    """Where the body lands: received into memory (a segment's mapping), spliced into a file, or handed to a
    sink a window at a time (a chunk of many small tensors, received by way of a pipe)."""
    if request.param == "splice" and not _splice.HAVE_SPLICE:
        pytest.skip("os.splice is Linux-only")
    return str(request.param)


def _read_all(
    source: Source, landing: str = "mapping", size: int = len(DATA)
) -> tuple[bytes, list[RetryEvent]]:
    events: list[RetryEvent] = []
    if landing == "mapping":
        buf = bytearray(size)
        read_range(source, 0, memoryview(buf), policy=FAST_RETRY, on_retry=events.append)
        return bytes(buf), events
    if landing == "sink":
        landed = bytearray(size)

        def sink(data: memoryview, at: int) -> None:
            landed[at : at + len(data)] = data

        read_range_into_sink(source, 0, size, sink, policy=FAST_RETRY, on_retry=events.append)
        return bytes(landed), events
    fd = os.memfd_create("low-water")
    try:
        os.ftruncate(fd, size)
        read_range_into_fd(source, 0, size, fd, 0, policy=FAST_RETRY, on_retry=events.append)
        return os.pread(fd, size, 0), events
    finally:
        os.close(fd)


def test_a_sender_slower_than_a_batch_per_probe_is_read_as_it_comes_without_a_retry(
    source: Source, nginx_proxy: FaultProxy, landing: str
) -> None:
    # 100 KB every 0.2 s after the first 100 KB: the 1.1 MB the body still owes (its mark) would come only
    # after four stall timeouts, so a reader waiting for the mark would give the connection up.
    nginx_proxy.push(Trickle(after=100_000, piece=100_000, interval=0.2))
    data, events = _read_all(source, landing)
    assert data == DATA
    assert events == [], "a sender that keeps sending is not a stalled one"
    assert nginx_proxy.ranges()[1:] == [(0, len(DATA) - 1)], "one request after the look-up"


def test_a_sender_that_goes_quiet_still_fails_after_the_stall_timeout_and_resumes_at_the_byte(
    source: Source, nginx_proxy: FaultProxy, landing: str
) -> None:
    nginx_proxy.push(Stall(after=400_000, seconds=STALL * 4))
    data, events = _read_all(source, landing)
    assert data == DATA
    assert [(e.landed, e.resume_at) for e in events] == [(400_000, 400_000)]
    assert nginx_proxy.ranges()[-2:] == [(0, len(DATA) - 1), (400_000, len(DATA) - 1)]


def _sent_in_small_writes(
    name: str, seed: int, nginx: NginxServer, nginx_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> tuple[Source, bytes, int]:
    """A source whose next body (3 batches) the proxy sends in writes of 64 KiB, as s3rver does; the
    source, the body, and how many writes it takes."""
    body = payload(3 * BATCH, seed=seed)
    nginx.put(f"low-water/{name}", body)
    settings = SourceSettings(http=HttpSettings(connect_timeout=2.0, stall_timeout=10.0), retry=FAST_RETRY)
    source = open_source(nginx_proxy.url(f"low-water/{name}"), settings)
    source.stat()
    nginx_proxy.push(Trickle(piece=64 << 10, interval=0.002))
    # A probe long enough that a loaded machine's proxy still sends each 4 MiB within one (past a probe
    # with bytes queued below the mark, batching is off for the rest of the body, by design).
    monkeypatch.setattr(_low_water, "PROBE", 5.0)
    return source, body, len(body) // (64 << 10)


def test_a_body_sent_in_small_writes_is_spliced_in_batches_not_per_write(
    nginx: NginxServer, nginx_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # s3rver (Node) writes a body 64 KiB at a time. Spliced as it came, each write woke the reader for a
    # poll, a splice into the pipe and one out of it: 1.26 CPU-s per GiB against 0.87 in batches.
    if not _splice.HAVE_SPLICE:
        pytest.skip("os.splice is Linux-only")
    source, body, pieces = _sent_in_small_writes("pieces.bin", 12, nginx, nginx_proxy, monkeypatch)
    real_splice, from_socket = os.splice, []

    def counting(src: int, dst: int, count: int, *args: object, **kwargs: object) -> int:
        if kwargs.get("flags") == _splice._SOCKET_FLAGS:
            from_socket.append(count)
        return real_splice(src, dst, count, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "splice", counting)
    fd = os.memfd_create("pieces")
    try:
        os.ftruncate(fd, len(body))
        read_range_into_fd(source, 0, len(body), fd, 0, policy=FAST_RETRY)
        assert os.pread(fd, len(body), 0) == body
    finally:
        os.close(fd)
    # In batches: a few splices per 4 MiB queued (the pipe takes 1 MiB), each wait ending on a full batch.
    # As it came: a wait and at least one splice per 64 KiB write (192 here).
    assert len(from_socket) < pieces // 3, f"{len(from_socket)} splices from the socket for {pieces} writes"


def test_a_body_handed_to_a_sink_is_received_a_window_at_a_time_not_per_write(
    nginx: NginxServer, nginx_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A range of many small tensors goes to a sink (the scatter into their slots) through a 1 MiB window:
    # received as it came, each 64 KiB write of a server like s3rver was a wake-up and a receive.
    source, body, writes = _sent_in_small_writes("sink.bin", 14, nginx, nginx_proxy, monkeypatch)
    receives: list[int] = []
    real_receive = _body.Body._receive_window

    def counting(self: _body.Body, view: memoryview) -> int:
        got = real_receive(self, view)
        receives.append(got)
        return got

    monkeypatch.setattr(_body.Body, "_receive_window", counting)
    landed = bytearray(len(body))

    def sink(data: memoryview, at: int) -> None:
        landed[at : at + len(data)] = data

    read_range_into_sink(source, 0, len(body), sink, policy=FAST_RETRY)
    assert landed == body
    # A window (1 MiB) at a time: a receive or two each. As it came: one a write at least (192 here).
    assert len(receives) < writes // 3, f"{len(receives)} receives for {writes} writes"


def test_the_connection_carries_the_next_request_at_once_after_a_batched_body(nginx: NginxServer) -> None:
    # Straight from nginx, a warm connection brings a body in a few large receives. Were the last mark left
    # up, the next answer (a few hundred bytes of headers and a short body) would never reach it: the read
    # would stall and be retried on a new connection.
    nginx.put("low-water/direct.bin", DATA)
    source = open_source(nginx.url("low-water/direct.bin"), FAST_SETTINGS)
    events: list[RetryEvent] = []
    for _ in range(5):
        data, more = _read_all(source)
        assert data == DATA
        events += more
        small = bytearray(100)
        read_range(source, 5, memoryview(small), policy=FAST_RETRY, on_retry=events.append)
        assert bytes(small) == DATA[5:105]
    assert events == []


@contextlib.contextmanager
def _connected() -> Iterator[tuple[socket.socket, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            client.settimeout(STALL)
            yield client, peer


def _mark(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def _queued(sock: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])


def test_the_mark_is_a_batch_of_what_the_body_owes_and_short_bodies_are_read_as_they_come() -> None:
    with _connected() as (client, _):
        low = LowWater(client, STALL)
        low.expect(100 << 20)
        assert _mark(client) == BATCH
        assert client.gettimeout() == min(PROBE, STALL / 4), "while the mark is up, waits are probes"
        low.expect(1 << 20)
        assert _mark(client) == 1 << 20, "never more than the body still owes"
        low.expect(100 << 10)
        assert _mark(client) == 1
        assert client.gettimeout() == STALL
        low.expect(8 << 20)
        low.reset()
        assert (_mark(client), client.gettimeout()) == (1, STALL), "the next answer's headers wake the reader"


def test_waits_with_nothing_queued_add_up_to_the_stall_timeout() -> None:
    with _connected() as (client, _):
        low = LowWater(client, STALL * 2)
        low.expect(8 << 20)
        probes = 0
        while low.waited():
            probes += 1
        probe = min(PROBE, STALL * 2 / 4)
        assert (probes + 1) * probe == pytest.approx(STALL * 2), "the waits add up to the stall timeout"
        assert _mark(client) == 1 and client.gettimeout() == STALL * 2


def test_bytes_queued_below_the_mark_turn_batching_off_for_the_rest_of_the_body() -> None:
    with _connected() as (client, peer):
        low = LowWater(client, STALL)
        low.expect(8 << 20)
        peer.sendall(b"x" * 1000)
        wait_for(lambda: _queued(client) == 1000, timeout=5, what="the bytes to be queued")
        assert low.waited(), "bytes came: read them now"
        assert _mark(client) == 1
        low.expect(8 << 20)
        assert _mark(client) == 1, "a sender slower than a batch per probe gains nothing from batches"
        assert client.recv(2000) == b"x" * 1000


class _UrgentServer:
    """An HTTP/1.1 server on loopback that answers every GET of its one object with the asked range, and
    sends one byte of each body over 1,000 bytes as TCP urgent data (``MSG_OOB``): no real server does, and
    a hostile one must not make a body lose that byte nor a splice stop at it for good."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/model.bin"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as requests:
            while True:
                line = requests.readline()
                if not line:
                    return
                method, headers = line.split()[0], {}
                while (header := requests.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = header.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                start, end = 0, len(self.data) - 1
                if "range" in headers:
                    first, _, last = headers["range"].removeprefix("bytes=").partition("-")
                    start, end = int(first), min(int(last), end)
                body = self.data[start : end + 1]
                status = "206 Partial Content" if "range" in headers else "200 OK"
                head = (
                    f'HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nETag: "v1"\r\n'
                    f"Content-Range: bytes {start}-{end}/{len(self.data)}\r\nAccept-Ranges: bytes\r\n\r\n"
                )
                conn.sendall(head.encode())
                if method == b"HEAD":
                    continue
                if len(body) <= 1000:
                    conn.sendall(body)
                    continue
                middle = len(body) // 2
                conn.sendall(body[:middle])
                conn.send(body[middle : middle + 1], socket.MSG_OOB)
                conn.sendall(body[middle + 1 :])

    def close(self) -> None:
        self._server.close()


@pytest.mark.parametrize("size", [100_000, 3 * BATCH], ids=["short body", "batched body"])
def test_a_byte_sent_as_urgent_data_lands_in_line_on_either_landing(landing: str, size: int) -> None:
    # Before: received into memory, the urgent byte was taken out of the stream (every later byte landed one
    # place early); spliced, the kernel's splice stopped at it and the reader spun at full CPU for good.
    data = payload(size, seed=13)
    server = _UrgentServer(data)
    try:
        source = open_source(server.url, FAST_SETTINGS)
        source.stat()
        outcome: list[object] = []

        def read() -> None:
            try:
                outcome.append(_read_all(source, landing, size))
            except Exception as exc:
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout=60)
        assert not reader.is_alive(), "the read never ended"
        got, events = outcome[0]  # type: ignore[misc]
        assert got == data, "the bytes landed as they were sent, the urgent one in its place"
        assert events == []
    finally:
        server.close()
