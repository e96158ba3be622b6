"""The GPU copy pins a hugetlbfs segment's whole mapping once, and each tensor elsewhere (``_api/pins.py``).

The bookkeeping is checked on the CPU against a registry that behaves as the CUDA driver does (an overlapping
registration is refused, an unregistration must name a registered address, a copy must read from inside one
registration), and the mapping against a real hugetlbfs segment's. The copies themselves need a GPU: those
tests skip without one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelload.loader import attach
from modelload.loader._api.pins import Mapping, Pinner
from modelload.loader.dtypes import by_name
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout
from tests.segment.helpers import expected_bytes, write_complete
from tests.support.hugepages import HUGE_PAGE, hugetlbfs, hugetlbfs_volume

__all__ = ["hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

P = HUGE_PAGE
MiB = 1 << 20


class Driver:
    """What cudaHostRegister/Unregister enforce: no byte registered twice, unregister what was registered,
    and a copy reads from inside one registration."""

    def __init__(self, *, refuse: int | None = None) -> None:
        self.spans: dict[int, int] = {}
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse
        """A length the driver refuses to register."""

    def register(self, address: int, length: int) -> bool:
        self.calls.append((address, length))
        if length == self.refuse:
            return False
        for start, size in self.spans.items():
            assert address + length <= start or start + size <= address, "overlapping registration"
        self.spans[address] = length
        return True

    def unregister(self, address: int) -> None:
        assert address in self.spans, "unregistering what was never registered"
        del self.spans[address]

    def copyable(self, pointer: int, nbytes: int) -> bool:
        return any(s <= pointer and pointer + nbytes <= s + n for s, n in self.spans.items())


def pinner(driver: Driver, mapping: Mapping | None = None) -> Pinner:
    return Pinner(register=driver.register, unregister=driver.unregister, mapping=mapping)


def test_a_hugetlbfs_mapping_is_registered_once_whole_and_every_copy_reads_inside_it() -> None:
    driver = Driver()
    mapping = Mapping(10 * P, 20 * P, P)
    pins = pinner(driver, mapping)
    tensors = [(10 * P + 4096, 3 * MiB), (11 * P + MiB, 4 * MiB), (13 * P, 100), (19 * P, P)]
    unpins = [pins.pin(pointer, nbytes) for pointer, nbytes in tensors]
    assert driver.calls == [(10 * P, 10 * P)], "one registration: the whole mapping, whole huge pages"
    assert all(driver.copyable(pointer, nbytes) for pointer, nbytes in tensors)
    for unpin in unpins:
        assert unpin is not None
        unpin()
    assert driver.spans == {10 * P: 10 * P}, "held until the copier finishes"
    pins.close()
    assert driver.spans == {}


def test_without_a_mapping_each_tensor_is_pinned_and_unpinned_on_its_own() -> None:
    driver = Driver()
    pins = pinner(driver)
    first, second = pins.pin(4096, 100), pins.pin(8192, 5000)
    assert driver.spans == {4096: 100, 8192: 5000}
    assert first is not None and second is not None
    first()
    second()
    pins.close()
    assert driver.spans == {}


def test_a_refused_whole_mapping_falls_back_to_pinning_each_tensor() -> None:
    driver = Driver(refuse=10 * P)
    pins = pinner(driver, Mapping(10 * P, 20 * P, P))
    unpin = pins.pin(11 * P, 100)
    assert unpin is not None and driver.spans == {11 * P: 100} and not pins.whole
    unpin()
    assert pins.pin(12 * P, 100) is not None and len(driver.calls) == 3, "the whole mapping is asked once"


def test_a_range_outside_the_mapping_is_pinned_on_its_own() -> None:
    driver = Driver()
    pins = pinner(driver, Mapping(10 * P, 12 * P, P))
    unpin = pins.pin(12 * P - 10, 100)  # runs past the mapping's end
    assert unpin is not None and driver.spans == {12 * P - 10: 100}


def test_a_hugetlbfs_segment_offers_its_whole_mapping_in_huge_pages(hugetlbfs: Path) -> None:
    layout = plan_layout(
        [TensorSpec("a", by_name("uint8"), (MiB + 5,)), TensorSpec("b", by_name("uint8"), (3 * MiB,))],
        page_size=P,
    )
    path = hugetlbfs / "model.seg"
    write_complete(path, layout, seed=1)
    with attach(path, timeout=5, notify=False) as model:
        mapping = model._pinnable()
        assert mapping is not None and mapping.page == P
        assert mapping.start % P == 0 and (mapping.end - mapping.start) % P == 0, "whole huge pages"
        for name in ("a", "b"):
            tensor = model.tensor(name)
            assert mapping.holds(tensor.data_ptr(), tensor.nbytes), name


def test_a_segment_on_small_pages_pins_each_tensor_on_its_own(shm_dir: Path) -> None:
    layout = plan_layout([TensorSpec("a", by_name("uint8"), (100,))])
    with SegmentWriter.create(shm_dir / "model.seg", layout, heartbeat=False) as writer:
        writer.slot(0)[:] = b"\x01" * 100
        writer.mark_ready(0)
        writer.mark_complete()
    with attach(shm_dir / "model.seg", timeout=5, notify=False) as model:
        assert model._pinnable() is None


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
        on_gpu = model.state_dict(device="cuda")
        for slot in layout.slots:
            assert on_gpu[slot.name].cpu().numpy().tobytes() == expected_bytes(3, slot.index, slot.nbytes)
        table = ConsumerTable.open(path, load_id=writer.load_id, tensor_count=len(sizes), write=False)
        assert [entry.consumed for entry in table.entries()] == [len(sizes)]
        table.close()
