"""A peer that answers only 429 is dropped once its 429s have lasted the stall timeout, by the fleet's own
clock, and a chunk it serves in between starts the count again. The hostile-peer suite shows the same with a
real fleet; this pins the rule itself, without waiting on a load's pace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from modelload.loader.peerwire import PeerKey
from modelload.sidecar.peers import fleet as fleet_module
from modelload.sidecar.peers.fleet import Fleet, Peer
from modelload.sidecar.peers.settings import PeerSettings


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(fleet_module.time, "monotonic", lambda: now[0])
    return now


@pytest.fixture
def fleet(clock: list[float]) -> Iterator[tuple[Fleet, list[tuple[str, str]]]]:
    """A fleet with a 2 s stall timeout on the test's clock, and the peers it drops: ``(url, why)``."""
    made = Fleet(PeerSettings(stall_timeout=2.0, wait_budget=60.0), self_id="me", key=PeerKey("token"))
    dropped: list[tuple[str, str]] = []
    made.on_exclude = lambda peer, why: dropped.append((peer.url, why))
    try:
        yield made, dropped
    finally:
        made.stop()


def test_a_peer_answering_only_busy_is_dropped_once_that_lasted_the_stall_timeout(
    fleet: tuple[Fleet, list[tuple[str, str]]], clock: list[float]
) -> None:
    peers, dropped = fleet
    peer = Peer("http://10.0.0.9:8480")
    peers.busy(peer)
    clock[0] += 1.9
    peers.busy(peer)
    assert not dropped and peer.excluded is None, "busy for less than the stall timeout: still asked"
    clock[0] += 0.2
    peers.busy(peer)
    assert dropped == [(peer.url, "it answered only busy (429) for 2.1 s")]
    assert peer.excluded is not None


def test_a_chunk_served_between_two_busy_answers_starts_the_count_again(
    fleet: tuple[Fleet, list[tuple[str, str]]], clock: list[float]
) -> None:
    peers, dropped = fleet
    peer = Peer("http://10.0.0.9:8480")
    peers.busy(peer)
    clock[0] += 1.5
    peers.served(peer, 1 << 20)
    clock[0] += 1.5
    peers.busy(peer)
    clock[0] += 1.5
    peers.busy(peer)
    assert not dropped, "busy for 1.5 s since it last served"
    clock[0] += 1.0
    peers.busy(peer)
    assert [why for _, why in dropped] == ["it answered only busy (429) for 2.5 s"]
