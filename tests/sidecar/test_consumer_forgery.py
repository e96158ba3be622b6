"""The consumer table is writable by every container of the pod: what a forger does to it must end in an
error for the consumer, never in another tensor's bytes taken for data, and never in a crash.

A real load in ring mode (a model of 3.5 MiB through a 1 MiB ring) and a real consumer (``attach``) in this
process; the forger writes the table file as any container could, with plain file writes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelload.loader import attach
from modelload.loader.errors import TensorReleasedError
from modelload.loader.segment import SegmentReader, WriterState
from modelload.loader.segment.consumers import ENTRY_HEADER, HEADER_LENGTH, table_path
from modelload.sidecar.memory import MemorySettings
from tests.sidecar import models
from tests.support.waiting import wait_for

from .test_memory import RING, Load, _model


def _complete(segment: Path) -> bool:
    with SegmentReader.open(segment) as reader:
        return reader.writer_state == WriterState.COMPLETE


def test_a_forged_consumed_bit_makes_a_ring_consumer_fail_instead_of_reading_another_tensor(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, seed=11)
    segment = shm_dir / "forged.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), readers=2)
    with attach(segment, timeout=30, notify=False) as model:
        first = next(name for name in model.iter_ready() if tensors[name].nbytes >= 64 << 10)
        view = model.numpy(first)  # READY now: the consumer starts to use it
        # Another container sets every consumed bit of this consumer's entry (slot 0): the sidecar now
        # believes it done with every tensor, releases them as they land, and the ring reuses their bytes.
        count = len(model.names)
        with open(table_path(segment), "r+b") as forged:
            forged.seek(HEADER_LENGTH + ENTRY_HEADER)
            forged.write(b"\xff" * -(-count // 8))
        wait_for(lambda: _complete(segment), timeout=60, what="the load complete through the released ring")
        copy = view.tobytes()  # what the view holds now: bytes of the tensors landed after it
        assert copy != models.as_bytes(tensors[first]), "the test must overwrite the first tensor's bytes"
        with pytest.raises(TensorReleasedError, match=repr(first)):
            model.consumed(first)
    load.finish()
    assert load.error is None


def test_a_truncated_consumer_table_crashes_neither_the_sidecar_nor_the_consumer(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, seed=12)
    segment = shm_dir / "truncated.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), readers=2)
    copies: dict[str, bytes] = {}
    refused: list[str] = []
    with attach(segment, timeout=30, notify=False) as model:
        # Once the sidecar counts the consumer, another container truncates the table: mapped, it would
        # kill both processes with SIGBUS. (Truncated before the sidecar ever saw a consumer, the ring waits
        # for one to attach, as for an app not yet started: what /status says and wait_timeout bounds.)
        wait_for(lambda: load.memory().get("consumers"), timeout=30, what="the sidecar to count the consumer")
        os.truncate(table_path(segment), 0)
        for name in model.names:
            try:
                data = bytes(model.numpy(name).tobytes())
                model.consumed(name)
            except TensorReleasedError:
                refused.append(name)
            else:
                copies[name] = data
    load.finish()
    assert load.error is None
    for name, data in copies.items():
        assert data == models.as_bytes(tensors[name]), f"{name} was taken with wrong bytes"
    assert len(copies) + len(refused) == len(tensors)
