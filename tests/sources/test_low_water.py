"""Long bodies are received in batches (the socket's low-water mark), and a slow or stalled sender is treated
exactly as before: read as it comes, or failed after the stall timeout and resumed at the byte."""

from __future__ import annotations

import contextlib
import fcntl
import socket
import struct
import termios
from collections.abc import Iterator

import pytest

from modelload.sidecar.sources import RetryEvent, Source, open_source, read_range
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


def _read_all(source: Source) -> tuple[bytes, list[RetryEvent]]:
    events: list[RetryEvent] = []
    buf = bytearray(len(DATA))
    read_range(source, 0, memoryview(buf), policy=FAST_RETRY, on_retry=events.append)
    return bytes(buf), events


def test_a_sender_slower_than_a_batch_per_probe_is_read_as_it_comes_without_a_retry(
    source: Source, nginx_proxy: FaultProxy
) -> None:
    # 100 KB every 0.2 s after the first 100 KB: the 1.1 MB the body still owes (its mark) would come only
    # after four stall timeouts, so a reader waiting for the mark would give the connection up.
    nginx_proxy.push(Trickle(after=100_000, piece=100_000, interval=0.2))
    data, events = _read_all(source)
    assert data == DATA
    assert events == [], "a sender that keeps sending is not a stalled one"
    assert nginx_proxy.ranges()[1:] == [(0, len(DATA) - 1)], "one request after the look-up"


def test_a_sender_that_goes_quiet_still_fails_after_the_stall_timeout_and_resumes_at_the_byte(
    source: Source, nginx_proxy: FaultProxy
) -> None:
    nginx_proxy.push(Stall(after=400_000, seconds=STALL * 4))
    data, events = _read_all(source)
    assert data == DATA
    assert [(e.landed, e.resume_at) for e in events] == [(400_000, 400_000)]
    assert nginx_proxy.ranges()[-2:] == [(0, len(DATA) - 1), (400_000, len(DATA) - 1)]


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
