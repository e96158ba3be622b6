"""The collector helpers: a load's long-lived objects are frozen out of the collector's passes, and the
collector is left as the caller had it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from modelload.loader.segment.collector import LongLived


@pytest.fixture
def collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_long_lived_objects_are_made_with_the_collector_off_then_frozen_until_the_block_ends(
    collector_on: None,
) -> None:
    before = gc.get_freeze_count()
    with LongLived() as kept:
        assert not gc.isenabled()
        plan = [{"tensor": i} for i in range(1000)]
        kept.built()
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(plan)
    assert gc.get_freeze_count() == 0
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off() -> None:
    was = gc.isenabled()
    gc.disable()
    try:
        with LongLived() as kept:
            kept.built()
            assert not gc.isenabled()
        assert not gc.isenabled()
        assert gc.get_freeze_count() == 0
    finally:
        (gc.enable if was else gc.disable)()


def test_a_block_left_early_turns_the_collector_back_on_without_freezing_anything(collector_on: None) -> None:
    with pytest.raises(RuntimeError), LongLived():
        raise RuntimeError("the model could not be opened")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_frozen_object_dropped_during_the_block_is_freed_at_once(collector_on: None) -> None:
    import weakref

    class Plan:
        pass

    with LongLived() as kept:
        plan = Plan()
        gone = weakref.ref(plan)
        kept.built()
        del plan
        assert gone() is None  # reference counting frees it; freezing only hides it from the cycle search
