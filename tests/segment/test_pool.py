"""run_in_order: the threads the sidecar's engine and ``modelload stage`` fill a segment with."""

from __future__ import annotations

import threading

import pytest

from modelload.loader.segment import run_in_order


@pytest.mark.parametrize("threads", [1, 4])
def test_every_item_is_worked_once_and_one_thread_takes_them_in_order(threads: int) -> None:
    done: list[int] = []
    run_in_order(30, done.append, threads=threads)
    assert sorted(done) == list(range(30))
    if threads == 1:
        assert done == list(range(30))


def test_the_first_failure_stops_the_others_and_is_raised_once_they_have_returned() -> None:
    running = 0
    done: list[int] = []
    lock = threading.Lock()
    stop = threading.Event()  # run_in_order sets it at the first failure
    never_stopped: list[int] = []

    def work(i: int) -> None:
        nonlocal running
        with lock:
            running += 1
        try:
            if i == 3:
                raise ValueError("item 3 is bad")
            if i > 3 and not stop.wait(30):  # the items after the bad one are in hand when it fails
                never_stopped.append(i)
                raise RuntimeError(f"item {i}: the failure never stopped the work")
            done.append(i)
        finally:
            with lock:
                running -= 1

    with pytest.raises(ValueError, match="item 3"):
        run_in_order(1000, work, threads=3, stop=stop)
    assert running == 0, "no thread still working when the error is raised"
    assert not never_stopped, "the failure did not stop the other threads"
    # Items 0-2, and at most the one item each of the two other threads held when item 3 failed.
    assert set(done) >= {0, 1, 2} and len(done) <= 5, done


def test_a_callers_stop_ends_the_work_without_an_error() -> None:
    stop = threading.Event()
    done: list[int] = []

    def work(i: int) -> None:
        done.append(i)
        if i == 5:
            stop.set()

    run_in_order(1000, work, threads=1, stop=stop)
    assert done == list(range(6))


def test_no_items_start_no_threads() -> None:
    before = threading.active_count()
    run_in_order(0, lambda i: None, threads=8)
    assert threading.active_count() == before
