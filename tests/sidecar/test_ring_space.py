"""Ring mode's admission bookkeeping: which ring bytes unreleased tensors hold, wrap included."""

from __future__ import annotations

import pytest

from modelload.loader.segment.geometry import Ring
from modelload.sidecar.memory.ring import RingSpace

DATA = 8192  # where the data region (the ring) starts in the segment
SIZE = 1000


def test_taken_bytes_block_every_later_lap_until_their_owner_is_freed() -> None:
    ring = RingSpace(Ring(DATA, SIZE))
    ring.take(0, DATA + 900, 200)  # [900, 1000) and [0, 100)
    ring.take(1, DATA + 1100, 300)  # [100, 400): right after, on the next lap
    assert ring.used == 500
    assert ring.holder(DATA + 2050, 10) == 0, "a later lap over the wrapped part"
    assert ring.holder(DATA + 2399, 1) == 1 and ring.holder(DATA + 2400, 500) is None
    with pytest.raises(ValueError, match="taken by 1"):
        ring.take(2, DATA + 2300, 10)
    assert ring.free(0) == 200 and ring.used == 300
    assert ring.holder(DATA + 2900, 200) is None, "freed on both sides of the wrap"
    assert ring.holder(DATA + 3000, 101) == 1
    assert ring.free(1) == 300 and ring.free(1) == 0 and ring.used == 0


def test_tensors_freed_out_of_order_leave_exactly_the_others_taken() -> None:
    ring = RingSpace(Ring(DATA, SIZE))
    for owner in range(10):
        ring.take(owner, DATA + owner * 100, 100)
    for owner in (3, 7, 0):
        ring.free(owner)
    free = [owner for owner in range(10) if ring.holder(DATA + SIZE + owner * 100, 100) is None]
    assert free == [0, 3, 7]
    assert ring.holder(DATA + 250, 100) == 2, "the first taken byte's owner"
