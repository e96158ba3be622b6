"""A writer process fills segments while reader processes attach and check every tensor they see READY.

The readers recompute each tensor's expected bytes independently; a torn tensor (READY before its bytes are
in) shows as a mismatch. The negative control runs a writer that publishes half-filled slots, to show the
check can fail.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from pathlib import Path

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.segment import (
    Layout,
    SegmentReader,
    SegmentWriter,
    TensorSpec,
    WriterState,
    plan_layout,
)
from tests.segment.helpers import expected_bytes
from tests.support.waiting import wait_for

ROUNDS = 12
READERS = 3


def _layout(round_: int) -> Layout:
    rng = random.Random(round_)
    sizes = [rng.choice([1, 17, 4096, 4097, 65536, 300_000, 1 << 20]) for _ in range(24)]
    return plan_layout([TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)])


def _writer(directory: str, torn: bool) -> None:
    for round_ in range(ROUNDS):
        layout = _layout(round_)
        order = list(range(len(layout.slots)))
        random.Random(round_ + 1000).shuffle(order)
        with SegmentWriter.create(Path(directory) / f"r{round_}.seg", layout) as writer:
            for i in order:
                view, content = writer.slot(i), expected_bytes(round_, i, layout.slots[i].nbytes)
                half = len(content) // 2
                view[:half] = content[:half]
                if torn:
                    writer.mark_ready(i)  # the bug under test: published before the rest is in
                # The window a torn tensor shows in: wide enough for the negative control's readers to be
                # scheduled inside it on a busy machine.
                time.sleep(0.005 if torn else 0.0005)
                view[half:] = content[half:]
                if not torn:
                    writer.mark_ready(i)
            writer.mark_complete()


class _Checker:
    """One reader's look at one round's segment: each call checks every tensor newly READY."""

    def __init__(self, reader: SegmentReader, round_: int) -> None:
        self.reader, self.round = reader, round_
        self.seen: set[int] = set()
        self.checked = self.mismatched = 0

    def __call__(self) -> bool:
        """One pass over the state table; True once every tensor is checked and the writer is done."""
        reader = self.reader
        done = reader.writer_state == WriterState.COMPLETE
        for i in map(int, reader.ready_mask().nonzero()[0]):
            if i in self.seen:
                continue
            self.seen.add(i)
            self.checked += 1
            if bytes(reader.view(i)) != expected_bytes(self.round, i, reader.slots[i].nbytes):
                self.mismatched += 1
        return done and len(self.seen) == len(reader.slots)


def _reader(directory: str, results: multiprocessing.Queue) -> None:
    checked = mismatched = 0
    for round_ in range(ROUNDS):
        path = Path(directory) / f"r{round_}.seg"
        try:  # polled tightly: the reader must be looking while the writer fills the first slots
            wait_for(path.exists, timeout=30, what=f"round {round_}'s segment", interval=0.0005)
            with SegmentReader.open(path) as reader:
                checker = _Checker(reader, round_)
                # No pause between passes: a torn tensor shows only in the instant it is published.
                wait_for(checker, timeout=60, what=f"round {round_} complete", interval=0)
        except AssertionError:
            results.put(("timeout", round_))
            return
        checked += checker.checked
        mismatched += checker.mismatched
    results.put((checked, mismatched))


def _run(directory: Path, *, torn: bool) -> list[tuple[int, int]]:
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue = context.Queue()
    readers = [context.Process(target=_reader, args=(str(directory), results)) for _ in range(READERS)]
    for process in readers:
        process.start()
    writer = context.Process(target=_writer, args=(str(directory), torn))
    writer.start()
    outcomes = [results.get(timeout=120) for _ in readers]
    writer.join(timeout=60)
    for process in readers:
        process.join(timeout=10)
    assert writer.exitcode == 0
    return outcomes


@pytest.mark.slow
def test_readers_in_other_processes_never_see_a_torn_tensor(shm_dir: Path) -> None:
    outcomes = _run(shm_dir, torn=False)
    expected_checks = ROUNDS * 24
    assert outcomes == [(expected_checks, 0)] * READERS


@pytest.mark.slow
def test_the_check_catches_a_writer_that_publishes_too_early(shm_dir: Path) -> None:
    outcomes = _run(shm_dir, torn=True)
    assert all(isinstance(checked, int) for checked, _ in outcomes)
    assert sum(mismatched for _, mismatched in outcomes) > 0
