"""The keeper's wire protocol, driven over real Unix sockets with real file descriptors (memfds)."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import HandoffProtocolError
from modelload.loader.handoff import protocol
from modelload.loader.handoff.protocol import Manifest, TensorPlace
from tests.handoff.helpers import held, probe


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


PROBE = "protocol-probe"


def memfd(content: bytes) -> int:
    return probe(PROBE, content)


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def open_fds() -> int:
    """This process's descriptors of the test's memfds."""
    return held(PROBE)


def test_a_message_and_its_descriptors_arrive_together_and_the_descriptors_reach_the_same_memory(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    fds = [memfd(b"first block"), memfd(b"second block")]
    protocol.send(sender, {"op": "fds", "first": 0, "count": 2}, fds)
    got = protocol.receive(receiver)
    assert got is not None
    assert got.message == {"op": "fds", "first": 0, "count": 2}
    assert len(got.fds) == 2 and not set(got.fds) & set(fds)  # the receiver's own descriptors
    assert [os.pread(fd, 64, 0) for fd in got.fds] == [b"first block", b"second block"]
    got.close_fds()
    for fd in fds:
        os.close(fd)


def test_a_message_larger_than_the_socket_buffer_arrives_whole_with_its_descriptors(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    big = {"op": "manifest", "padding": "x" * (6 << 20)}
    fd = memfd(b"payload")
    thread = threading.Thread(target=protocol.send, args=(sender, big, [fd]))
    thread.start()
    got = protocol.receive(receiver)
    thread.join()
    assert got is not None and got.message == big
    assert os.pread(got.fds[0], 16, 0) == b"payload"
    got.close_fds()
    os.close(fd)


def test_messages_in_a_row_keep_their_own_descriptors(pair: tuple[socket.socket, socket.socket]) -> None:
    sender, receiver = pair
    fds = [memfd(b"a"), memfd(b"b")]
    protocol.send(sender, {"op": "loading"})
    protocol.send(sender, {"op": "fds", "n": 1}, fds[:1])
    protocol.send(sender, {"op": "fds", "n": 2}, fds[1:])
    first, second, third = (protocol.receive(receiver) for _ in range(3))
    assert first is not None and first.fds == []
    assert second is not None and [os.pread(fd, 1, 0) for fd in second.fds] == [b"a"]
    assert third is not None and [os.pread(fd, 1, 0) for fd in third.fds] == [b"b"]
    second.close_fds()
    third.close_fds()
    for fd in fds:
        os.close(fd)


def test_a_connection_closed_between_messages_is_none_and_inside_one_is_an_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    sender.sendall(struct.pack(">I", 100) + b'{"op":')
    sender.shutdown(socket.SHUT_WR)
    with pytest.raises(HandoffProtocolError, match="closed inside a message"):
        protocol.receive(receiver)
    a, b = socket.socketpair()
    a.close()
    assert protocol.receive(b) is None
    b.close()


def test_an_announced_length_over_the_limit_is_refused_before_reading_it(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    fd = memfd(b"x")
    socket.send_fds(sender, [struct.pack(">I", protocol.MAX_MESSAGE + 1)], [fd])
    before = open_fds()
    with pytest.raises(HandoffProtocolError, match="at most"):
        protocol.receive(receiver)
    assert open_fds() == before  # the descriptor that came with it was closed
    os.close(fd)


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"no": "op"}', b"\xff\xfe"])
def test_a_body_that_is_not_an_object_with_an_op_is_refused_and_its_descriptors_closed(
    pair: tuple[socket.socket, socket.socket], body: bytes
) -> None:
    sender, receiver = pair
    fd = memfd(b"x")
    socket.send_fds(sender, [struct.pack(">I", len(body)) + body], [fd])
    before = open_fds()
    with pytest.raises(HandoffProtocolError):
        protocol.receive(receiver)
    assert open_fds() == before
    os.close(fd)


def test_more_descriptors_than_the_receiver_allows_is_refused_without_leaking_any(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    fds = [memfd(b"x") for _ in range(3)]
    protocol.send(sender, {"op": "fds"}, fds)
    before = open_fds()
    with pytest.raises(HandoffProtocolError, match="more descriptors"):
        protocol.receive(receiver, max_fds=2)
    assert open_fds() == before
    for fd in fds:
        os.close(fd)


def test_a_sender_never_puts_more_than_the_limit_of_descriptors_in_one_message(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, _ = pair
    with pytest.raises(HandoffProtocolError, match="descriptors in one message"):
        protocol.send(sender, {"op": "fds"}, list(range(protocol.MAX_FDS_PER_MESSAGE + 1)))


def test_an_unexpected_message_is_a_protocol_error_that_closes_what_it_carried(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    sender, receiver = pair
    fd = memfd(b"x")
    protocol.send(sender, {"op": "fds"}, [fd])
    got = protocol.receive(receiver)
    assert got is not None
    received_fd = got.fds[0]
    with pytest.raises(HandoffProtocolError, match="'fds' message where a manifest message was due"):
        protocol.expect(got, "manifest")
    assert not is_open(received_fd)
    os.close(fd)


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        ([1], 1),
        ([1, 2, 3], 1),
        ([0, 1], 1),
        ([2], None),
        ([], None),
        ("1", None),
        ([True], None),
        (None, None),
    ],
)
def test_the_version_is_the_newest_both_ends_speak(offered: Any, chosen: int | None) -> None:
    assert protocol.choose_version(offered) == chosen


# --- the manifest ------------------------------------------------------------------------------------------


def manifest(tensors: list[list[Any]], blocks: list[int] | None = None) -> dict[str, Any]:
    return {
        "op": "manifest",
        "version": 1,
        "device": {"uuid": "GPU-1", "name": "test"},
        "blocks": [4096] if blocks is None else blocks,
        "tensors": tensors,
        "metadata": {"source": "s3://b/m/", "format": "safetensors"},
    }


def test_a_manifest_survives_the_wire_unchanged() -> None:
    original = Manifest(
        device={"uuid": "GPU-1", "name": "test"},
        blocks=(4096, 8192),
        tensors=(
            TensorPlace("embed.weight", by_name("bfloat16"), (16, 8), 0, 0, 256),
            TensorPlace("norm", by_name("float32"), (4,), 0, 512, 16),
            TensorPlace("empty", by_name("int64"), (0, 3), 1, 0, 0),
            TensorPlace("scalar", by_name("float8_e4m3fn"), (), 1, 512, 1),
        ),
        metadata={"source": "s3://b/m/"},
    )
    wire = json.loads(json.dumps(original.message(1)))
    assert Manifest.parse(wire) == original


@pytest.mark.parametrize(
    ("tensors", "blocks", "rule"),
    [
        ([["w", "float32", [2], 0, 4090, 8]], None, "outside block 0"),
        ([["w", "float32", [2], 1, 0, 8]], None, "block 1 of 1"),
        ([["w", "float32", [2], 0, 0, 4]], None, "takes 8"),
        ([["w", "complex4096", [2], 0, 0, 8]], None, "unknown to this loader"),
        ([["w", "float32", [2], 0, 0, 8], ["w", "float32", [2], 0, 512, 8]], None, "twice"),
        ([["a", "float32", [4], 0, 0, 16], ["b", "float32", [4], 0, 8, 16]], None, "overlap"),
        ([["w", "float32", [-2], 0, 0, 8]], None, "shape"),
        ([["w", "float32", [2], 0, True, 8]], None, "non-negative integers"),
        ([["w", "float32", [2], 0, 0]], None, "is not"),
        ([["", "float32", [2], 0, 0, 8]], None, "no usable name"),
        ([], [0], "positive sizes"),
        ([], [1.5], "positive sizes"),
    ],
)
def test_a_manifest_that_breaks_a_rule_is_refused_naming_it(
    tensors: list[list[Any]], blocks: list[int] | None, rule: str
) -> None:
    with pytest.raises(HandoffProtocolError, match=rule):
        Manifest.parse(manifest(tensors, blocks))


def test_a_manifest_without_a_device_or_with_odd_metadata_is_refused() -> None:
    no_device = manifest([]) | {"device": {"name": "x"}}
    with pytest.raises(HandoffProtocolError, match="device uuid"):
        Manifest.parse(no_device)
    with pytest.raises(HandoffProtocolError, match="metadata"):
        Manifest.parse(manifest([]) | {"metadata": {"n": 1}})
