"""A signed peer request is good only at the address it was signed for.

The asker signs the ``Host`` it sends (the peer's own ``host:port``); the server compares it with the address
the connection came in on. So a process without the token that got itself asked (a pod that took a departed
peer's address, a relay in the middle) cannot pass the asker's requests on to a real peer and read the
model from the answers. A real peer server in this process, on 127.0.0.1; the relay is a plain TCP relay on
127.0.0.2, as something that does not speak the protocol would be.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelload.loader.errors import PeerAnswerError
from modelload.loader.peerwire import PeerKey, split_authority
from modelload.sidecar.peers.client import PeerFile, get_document
from modelload.sidecar.peers.server import MANIFEST_PATH, PeerServer
from modelload.sidecar.sources import HttpSettings, ObjectInfo
from tests.support.peer_client import peer_get

from .test_limits import _File
from .test_loopback import TOKEN


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[PeerServer, _File]]:
    path = tmp_path / "weights"
    path.write_bytes(os.urandom(1 << 20) * 4)
    state = _File(path)
    server = PeerServer(state, key=PeerKey(TOKEN), host="127.0.0.1", port=0, max_uploads=4)
    server.start()
    try:
        yield server, state
    finally:
        server.stop()
        os.close(state.fd)


class _Relay:
    """Passes every byte between its askers and ``port`` on 127.0.0.1, both ways, and keeps what came back."""

    def __init__(self, port: int) -> None:
        self._upstream = port
        self._listener = socket.create_server(("127.0.0.2", 0))
        self.port = self._listener.getsockname()[1]
        self.answers = bytearray()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                asker, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self._upstream))
                for source, sink, keep in ((asker, upstream, False), (upstream, asker, True)):
                    thread = threading.Thread(target=self._pump, args=(source, sink, keep), daemon=True)
                    thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, keep: bool) -> None:
        with contextlib.suppress(OSError), source, sink:
            while data := source.recv(65536):
                if keep:
                    with self._lock:
                        self.answers += data
                sink.sendall(data)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def relay(served: tuple[PeerServer, _File]) -> Iterator[_Relay]:
    middle = _Relay(served[0].port)
    try:
        yield middle
    finally:
        middle.close()


def test_a_request_with_a_valid_signature_for_another_address_is_refused(
    served: tuple[PeerServer, _File],
) -> None:
    server, _ = served
    base = f"http://127.0.0.1:{server.port}"
    assert peer_get(base, MANIFEST_PATH, TOKEN).proven  # signed for 127.0.0.1:port, the address it came in on
    for elsewhere in (f"127.0.0.2:{server.port}", f"127.0.0.1:{server.port + 1}", "127.0.0.1", "[::1]:1"):
        answer = peer_get(base, MANIFEST_PATH, TOKEN, headers={"Host": elsewhere})
        assert answer.status == 421, elsewhere
        assert f"signed for {elsewhere} and came in at 127.0.0.1:{server.port}" in answer.json()["error"]
        assert not answer.proven and b"phase" not in answer.body
    assert server.refused == 4


def test_a_host_that_is_no_address_is_refused_and_a_name_of_the_servers_address_is_accepted(
    served: tuple[PeerServer, _File],
) -> None:
    server, _ = served
    base = f"http://127.0.0.1:{server.port}"
    for malformed in ("", "a b:1", f"[127.0.0.1]:{server.port}", "x:99999"):
        answer = peer_get(base, MANIFEST_PATH, TOKEN, headers={"Host": malformed})
        assert answer.status == 421 and "does not name an address" in answer.json()["error"], malformed
    # A static peer list may name a peer: the name counts when it resolves to the server's address.
    named = peer_get(base, MANIFEST_PATH, TOKEN, headers={"Host": f"localhost:{server.port}"})
    assert named.status == 200 and named.proven
    unknown = peer_get(base, MANIFEST_PATH, TOKEN, headers={"Host": f"no-such-peer.invalid:{server.port}"})
    assert unknown.status == 421


def test_a_relay_in_the_middle_gets_no_answer_it_can_read(
    served: tuple[PeerServer, _File], relay: _Relay
) -> None:
    server, state = served
    key, through = PeerKey(TOKEN), f"http://127.0.0.2:{relay.port}"
    with pytest.raises(PeerAnswerError, match=r"passed the request on \(HTTP 421\)"):
        get_document(through, MANIFEST_PATH, key, max_bytes=1 << 20, timeout=10)
    source = PeerFile(through, 0, HttpSettings(max_redirects=0), ObjectInfo(state.size, '"v1"'), key)
    try:
        with pytest.raises(PeerAnswerError, match="421"):
            source.read_into(0, memoryview(bytearray(1 << 20)))
    finally:
        source.close()
    assert b"421 Misdirected Request" in relay.answers
    assert b" 200 " not in relay.answers and b" 206 " not in relay.answers
    assert state.sent == 0, "the peer sent bytes of the model to the relay"
    assert server.refused >= 2
    # The same requests, asked at the peer's own address, are answered.
    assert get_document(f"http://127.0.0.1:{server.port}", MANIFEST_PATH, key, max_bytes=1 << 20, timeout=10)


def _dual_stack() -> bool:
    if not socket.has_dualstack_ipv6():
        return False
    try:
        with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True):
            return True
    except OSError:
        return False


@pytest.mark.skipif(not _dual_stack(), reason="this kernel has no dual-stack IPv6 sockets")
def test_an_ipv4_asker_of_a_dual_stack_server_is_checked_against_its_ipv4_address(tmp_path: Path) -> None:
    path = tmp_path / "weights"
    path.write_bytes(b"\0" * 4096)
    state = _File(path)
    server = PeerServer(state, key=PeerKey(TOKEN), host="::", port=0, max_uploads=1)
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        assert peer_get(base, MANIFEST_PATH, TOKEN).proven  # came in at ::ffff:127.0.0.1, the same address
        assert peer_get(base, MANIFEST_PATH, TOKEN, headers={"Host": f"10.9.9.9:{server.port}"}).status == 421
    finally:
        server.stop()
        os.close(state.fd)


def test_a_host_header_splits_into_the_address_it_names() -> None:
    assert split_authority("10.0.0.7:8480") == ("10.0.0.7", 8480)
    assert split_authority("[fd00::7]:8480") == ("fd00::7", 8480)
    assert split_authority("[::ffff:10.0.0.7]:8480") == ("10.0.0.7", 8480)
    assert split_authority("[fe80::1%eth0]:8480") == ("fe80::1", 8480)
    assert split_authority("Pod-A.peers.ns.svc") == ("pod-a.peers.ns.svc", 80)
    for bad in ("", ":80", "[10.0.0.7]:1", "[zz::1]:1", "a:0", "a:65536", "a b", "é:1", "a:1:2"):
        assert split_authority(bad) is None, bad
