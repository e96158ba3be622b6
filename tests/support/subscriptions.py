"""Waiting until a pyzmq subscription has reached its publisher, instead of sleeping for it.

A PUB socket drops what it sends before a subscriber's subscription arrives ("slow joiner"), and nothing
tells the subscriber when that is. So a test that needs every message publishes probes until the
subscriber hears one, then drains them, and only then starts what it observes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.waiting import wait_for

__all__ = ["PROBE", "heard_on", "receive", "until_heard"]

PROBE = 0xFFFF_FFFF
"""The tensor index of a probe sent as a ``ready`` message (no model has that many tensors)."""
_PROBE_FRAMES = [b"ready", PROBE.to_bytes(4, "little")]

LISTEN = 0.05
"""Seconds a look listens for a probe: short, so a probe lost before the subscription is sent again soon."""


def until_heard(
    probe: Callable[[], object], heard: Callable[[float], bool], *, timeout: float = 10.0
) -> None:
    """Call ``probe`` (publish one message) until ``heard(seconds)`` (listen that long) says one came."""

    def sent_and_heard() -> bool:
        probe()
        return heard(LISTEN)

    wait_for(sent_and_heard, timeout=timeout, what="the subscription to reach the publisher", interval=0)


def heard_on(sub: Any) -> Callable[[float], bool]:
    """``heard`` for a raw SUB socket: listen for a message, then drain every one queued (the probes; one
    still in flight is skipped by :func:`receive`)."""
    import zmq

    def heard(seconds: float) -> bool:
        if not sub.poll(int(seconds * 1000)):
            return False
        while sub.poll(0):
            sub.recv_multipart(zmq.NOBLOCK)
        return True

    return heard


def receive(sub: Any, count: int) -> list[list[bytes]]:
    """The next ``count`` messages on a raw SUB socket (its receive timeout applies), probes left out."""
    frames: list[list[bytes]] = []
    while len(frames) < count:
        message = sub.recv_multipart()
        if message != _PROBE_FRAMES:
            frames.append(message)
    return frames
