"""How much host memory a load may keep: the memory mode and its bounds (the sidecar's ``--memory-*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from modelload.loader.errors import ConfigError
from modelload.loader.rules import Between, OneOf, Positive, check_fields, rule
from modelload.loader.segment import MemoryMode, consumers
from modelload.loader.segment.consumers import EXPIRY

__all__ = ["MemorySettings", "Mode"]

Mode = Literal["full", "release", "ring"]


def _seconds(value: float) -> str:
    return f"{value:g} seconds"


EXPIRY_HEARTBEATS = 2.5
"""The shortest consumer expiry, in the consumers' heartbeat intervals (``consumers.HEARTBEAT_INTERVAL``)."""


class _OutlastsHeartbeats:
    """The consumer expiry's rule: at least :data:`EXPIRY_HEARTBEATS` of the consumers' heartbeat intervals
    (5 s with their 2 s beat), so a live consumer never counts as gone between two of its beats. The floor
    follows the interval: code whose consumers beat faster (a test) may set a sub-second expiry."""

    def _rule(self) -> Between:
        floor = EXPIRY_HEARTBEATS * consumers.HEARTBEAT_INTERVAL
        return Between(floor, what="the consumer expiry", show=_seconds)

    def problem(self, value: float) -> str | None:
        return self._rule().problem(value)

    def describe(self) -> str:
        return self._rule().describe()

    def show(self, value: float) -> str:
        return _seconds(value)


@dataclass(frozen=True)
class MemorySettings:
    """How much host memory the load may keep: ``full`` keeps it all, ``release`` and ``ring`` give tensors'
    pages back as consumers copy them (:mod:`modelload.sidecar.memory.manager`)."""

    mode: Mode = field(default="full", metadata=rule(OneOf(get_args(Mode))))
    """``full`` (default: every page stays, for CPU consumers that keep zero-copy views), ``release`` (pages
    go once every consumer copied the tensor) or ``ring`` (at most ``ring_size`` bytes at once)."""

    ring_size: int = 0
    """Ring mode's bound on tensor data in memory, bytes, rounded up to a page of the volume (4096, or 2 MiB
    on huge pages; and down to the model's data, when that is smaller); set exactly in ring mode. It must
    hold the largest tensor with its record header; a few times the chunk size keeps the readers busy while
    the app copies."""

    wait_timeout: float | None = field(default=None, metadata=rule(Positive("a positive number of seconds")))
    """Seconds ring mode may wait for room before failing the load; None waits as long as it takes (the
    status shows the wait)."""

    consumers: int = field(default=1, metadata=rule(Between(1, 64)))
    """Consumers that must have registered before anything is released (tensor-parallel workers that attach
    one by one: set it to their count). Default 1. Once they have, a tensor is released when every *live*
    consumer has consumed it: one that left (``Model.close()``) or whose heartbeat expired (it died) needs
    nothing more."""

    expiry: float = field(default=EXPIRY, metadata=rule(_OutlastsHeartbeats()))
    """Seconds without a heartbeat after which a consumer counts as gone. Default 30; at least 5 (2.5 of the
    consumers' 2 s heartbeats)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.mode == "ring") != (self.ring_size > 0):
            raise ConfigError(
                "a ring size (--ring-size/MODELLOAD_RING_SIZE) is needed with --memory-mode ring, and only "
                "then"
            )

    @property
    def layout_mode(self) -> MemoryMode:
        return MemoryMode[self.mode.upper()]
