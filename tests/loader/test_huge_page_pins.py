"""The GPU copy pins a hugetlbfs segment's whole mapping once, in whole huge pages and in every memory mode,
and copies every tensor from inside it (``Model._pinnable`` and ``DeviceCopier``).

What is pinned and what each copy reads is checked on the CPU, against a real hugetlbfs segment, with the
copier's stand-in of the device (``tests/support/fake_gpu.py``: an overlapping registration is refused, a
copy must read from inside one registration). The copies themselves need a GPU: those tests skip without
one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelload.loader import attach
from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from tests.segment.helpers import expected_bytes, write_complete
from tests.support import fake_gpu
from tests.support.hugepages import HUGE_PAGE, hugetlbfs, hugetlbfs_volume

__all__ = ["hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

P = HUGE_PAGE
MiB = 1 << 20
SIZES = [MiB + 5, 3 * MiB, 4096, 7 * MiB]


@pytest.mark.parametrize("names", [None, ["t2"]], ids=["every-tensor", "one-tensor"])
def test_a_hugetlbfs_segment_is_pinned_once_whole_and_every_copy_reads_inside_it(
    hugetlbfs: Path, monkeypatch: pytest.MonkeyPatch, names: list[str] | None
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    layout = plan_layout(
        [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(SIZES)], page_size=P
    )
    path = hugetlbfs / "model.seg"
    write_complete(path, layout, seed=1)
    with attach(path, timeout=5, notify=False) as model:
        on_gpu = model.state_dict(device="cuda", names=names)
    for slot in layout.slots:
        if slot.name in on_gpu:
            assert bytes(on_gpu[slot.name].numpy()) == expected_bytes(1, slot.index, slot.nbytes), slot.name
    (gpu,) = gpus
    ((address, length),) = gpu.registered  # one registration, even for one tensor: huge pages are cheap
    assert address % P == 0 and length % P == 0, "whole huge pages"
    assert length >= sum(SIZES)
    assert gpu.pageable == 0, "every copy read inside the registration"
    assert not gpu.pins


def test_a_release_mode_hugetlbfs_segment_is_pinned_whole_and_consumed_as_each_copy_completes(
    hugetlbfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(SIZES)]
    layout = plan_layout(specs, page_size=P, memory_mode=MemoryMode.RELEASE)
    path = hugetlbfs / "model.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer, attach(path, notify=False) as model:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(3, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
        writer.mark_complete()  # the whole model is handed over once the load is finished
        on_gpu = model.state_dict(device="cuda")
        registration = model._registration
        assert registration is not None and all(registration.has(i) for i in range(len(SIZES)))
    for slot in layout.slots:
        assert bytes(on_gpu[slot.name].numpy()) == expected_bytes(3, slot.index, slot.nbytes), slot.name
    assert len(gpus[0].registered) == 1 and gpus[0].pageable == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_hugetlbfs_segment_copies_to_the_gpu_byte_exact_through_whole_page_pins(hugetlbfs: Path) -> None:
    sizes = [MiB + 5, 3 * MiB, 4096, 7 * MiB]
    layout = plan_layout(
        [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)], page_size=P
    )
    path = hugetlbfs / "model.seg"
    write_complete(path, layout, seed=2)
    with attach(path, timeout=5, notify=False) as model:
        on_gpu = model.state_dict(device="cuda")
        for slot in layout.slots:
            got = on_gpu[slot.name].cpu().numpy().tobytes()
            assert got == expected_bytes(2, slot.index, slot.nbytes), slot.name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_release_mode_hugetlbfs_segment_marks_each_tensor_consumed_once_copied_to_the_gpu(
    hugetlbfs: Path,
) -> None:
    from modelload.loader.segment import MemoryMode
    from modelload.loader.segment.consumers import ConsumerTable

    sizes = [MiB + 5, 3 * MiB, 4096, 2 * MiB]
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    layout = plan_layout(specs, page_size=P, memory_mode=MemoryMode.RELEASE)
    path = hugetlbfs / "model.seg"
    with SegmentWriter.create(path, layout, heartbeat=False) as writer, attach(path, notify=False) as model:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(3, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
        writer.mark_complete()  # the whole model is handed over once the load is finished
        on_gpu = model.state_dict(device="cuda")
        for slot in layout.slots:
            assert on_gpu[slot.name].cpu().numpy().tobytes() == expected_bytes(3, slot.index, slot.nbytes)
        table = ConsumerTable.open(path, load_id=writer.load_id, tensor_count=len(sizes), write=False)
        assert [entry.consumed for entry in table.entries()] == [len(sizes)]
        table.close()
