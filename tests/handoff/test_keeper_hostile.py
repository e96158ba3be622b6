"""The keeper against a hostile peer on its socket: an attacker's look at the hand-off.

The socket is open to every user of the pod (mode 0666: the app container may run as another user), so any
process of the pod can connect. The keeper holds the model in GPU memory for the app's restarts, so a peer
must not be able to make it allocate without bound, hold its connection slots forever, or keep descriptors
it sent. These tests run the real keeper (memfd blocks stand in for GPU memory) and speak to it with raw
sockets.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelload.loader.errors import HandoffProtocolError
from modelload.loader.handoff import keeper as keeper_module
from modelload.loader.handoff import protocol
from modelload.loader.handoff.keeper import Keeper
from tests.handoff.memfd import MemfdMemory
from tests.support.waiting import wait_for

MiB = 1 << 20


@pytest.fixture
def keeper(sock_dir: Path) -> Iterator[Keeper]:
    """A keeper listening, its load not started: every request below is answered before any load."""
    serving = Keeper(MemfdMemory(), socket_path=sock_dir / "keeper.sock", block_size=MiB)
    serving.start()
    yield serving
    serving.close()


def _connect(keeper: Keeper) -> socket.socket:
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peer.settimeout(20)
    peer.connect(str(keeper.socket_path))
    return peer


def _closed_by_keeper(peer: socket.socket) -> bool:
    """Whether the keeper ended the connection (what it sent before, if anything, is read and dropped)."""
    try:
        while data := peer.recv(65536):
            del data
    except (ConnectionResetError, BrokenPipeError):
        pass
    return True


def test_a_request_announcing_more_than_a_request_holds_is_refused_before_any_byte_of_it(
    keeper: Keeper,
) -> None:
    """A request is a few hundred bytes; announcing 200 MiB made the keeper allocate 200 MiB for it and
    wait (256 such connections: 50 GiB in the process that holds the model)."""
    with _connect(keeper) as peer:
        peer.sendall(struct.pack(">I", 200 * MiB))
        answer = protocol.receive(peer)
    assert answer is not None and answer.message["code"] == "bad-request"
    assert f"at most {keeper_module.REQUEST_LIMIT}" in answer.message["message"]


def test_a_request_sent_a_byte_at_a_time_is_cut_off_at_the_request_deadline(
    keeper: Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timeout was per recv, so a peer sending a byte now and then held a connection slot for ever
    (256 of them, and the app itself was told ``busy``)."""
    monkeypatch.setattr(keeper_module, "REQUEST_TIMEOUT", 0.5)
    with _connect(keeper) as peer:
        peer.sendall(struct.pack(">I", 4000))
        deadline = time.monotonic() + 15
        cut = False
        while time.monotonic() < deadline:
            try:
                peer.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            time.sleep(0.05)
        assert cut, "the keeper still read the trickle after 15 s"


def test_a_request_carrying_descriptors_is_refused_and_the_keeper_keeps_none(keeper: Keeper) -> None:
    """Held: a request takes no descriptor; those sent with one are closed, not kept."""
    fds = [os.memfd_create("hostile") for _ in range(8)]
    before = len(os.listdir("/proc/self/fd"))
    with _connect(keeper) as peer:
        protocol.send(peer, {"op": "status", "versions": [1]}, fds)
        assert _closed_by_keeper(peer)
    wait_for(
        lambda: len(os.listdir("/proc/self/fd")) <= before,
        timeout=10,
        what=f"the descriptors sent closed again (at most {before} open)",
    )
    for fd in fds:
        os.close(fd)


GARBAGE = [b"\x00\x00\x00\x05hello", b"\x00\x00\x00\x02[]", b"GET / HTTP/1.1\r\n\r\n"]


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_is_answered_as_a_bad_request_and_the_keeper_serves_the_next_app(
    keeper: Keeper, garbage: bytes
) -> None:
    with _connect(keeper) as peer:
        peer.sendall(garbage)
        answer = protocol.receive(peer)
        assert answer is not None and answer.message["code"] == "bad-request"
    with _connect(keeper) as app:
        protocol.send(app, {"op": "status", "versions": [1]})
        status = protocol.receive(app)
    assert status is not None and status.op == "status" and status.message["state"] == "starting"


def test_a_receiver_refuses_a_message_over_its_own_limit_before_reading_it() -> None:
    sender, receiver = socket.socketpair()
    with sender, receiver:
        sender.sendall(struct.pack(">I", 70_000))
        with pytest.raises(HandoffProtocolError, match="at most 65536"):
            protocol.receive(receiver, limit=65536)
