"""The copy from a segment to a GPU, each way ``DeviceCopier`` can make it, in each memory mode.

Pinned in place (``cudaHostRegister`` read-only on the segment's own mapping) and through the pinned
staging buffers; in memory mode full (a copy-on-write mapping), release (each tensor marked consumed as its
copy completes) and ring (a read-only mapping, mapped twice, with a tensor that wraps the ring's end). Every
device tensor must equal the bytes that were written. These run only where torch sees a CUDA device
(``make gpu-check``); ``benchmarks/gpu_copy.py`` measures the same paths for speed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelload.loader import attach
from modelload.loader._api.torch import DeviceCopier
from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.release import Releaser
from tests.segment.helpers import expected_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [3 << 20, 5000, 1 << 20, 70 << 20, 12]  # one tensor larger than a staging buffer (64 MiB)


def _segment(path: Path, mode: MemoryMode) -> SegmentWriter:
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(SIZES)]
    writer = SegmentWriter.create(path, plan_layout(specs, memory_mode=mode), heartbeat=False)
    for slot in writer.layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(5, slot.index, slot.nbytes)
        writer.mark_ready(slot.index)
    writer.mark_complete()
    return writer


def _expected(index: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(expected_bytes(5, index, SIZES[index])), dtype=torch.uint8).cuda()


@pytest.mark.parametrize("mode", [MemoryMode.FULL, MemoryMode.RELEASE])
@pytest.mark.parametrize("pin_in_place", [True, False], ids=["in-place", "staging"])
def test_every_tensor_reaches_the_gpu_bit_for_bit(
    shm_dir: Path, mode: MemoryMode, pin_in_place: bool
) -> None:
    path = shm_dir / "m.seg"
    writer = _segment(path, mode)
    with attach(path, notify=False) as model:
        copier = DeviceCopier("cuda", pin_in_place=pin_in_place)
        consumed: list[str] = []

        def consume(name: str) -> None:
            model.consumed(name)
            consumed.append(name)

        results = {}
        for name in model.iter_ready():
            done = None if mode == MemoryMode.FULL else (lambda n=name: consume(n))
            results[name] = copier.copy(model.tensor(name, wait=False), on_done=done)
        copier.finish()
        assert copier.pins_in_place is pin_in_place, "registration on the segment's mapping was refused"
        for i in range(len(SIZES)):
            assert torch.equal(results[f"t{i}"], _expected(i)), f"t{i}"
        assert sorted(consumed) == ([] if mode == MemoryMode.FULL else sorted(results))
    writer.close()


def test_state_dict_to_the_gpu_in_each_mode_comes_back_bit_for_bit(shm_dir: Path) -> None:
    for mode in (MemoryMode.FULL, MemoryMode.RELEASE):
        path = shm_dir / f"{mode.name}.seg"
        writer = _segment(path, mode)
        with attach(path, notify=False) as model:
            on_gpu = model.state_dict(device="cuda")
            for i in range(len(SIZES)):
                assert torch.equal(on_gpu[f"t{i}"], _expected(i)), (mode, i)
        writer.close()


def test_a_ring_tensor_that_wraps_the_end_is_registered_and_copied_whole(shm_dir: Path) -> None:
    # A ring of 4 pages: t0 takes [0, 10000); t1 starts at 12288 and wraps to [0, 4904) of t0's bytes, so it
    # lands only once t0 is copied and released, and its view crosses the reader's second mapping.
    ring = 4 * 4096
    sizes = [10000, 9000]
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    layout = plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=ring)
    path = shm_dir / "ring.seg"
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    releaser = Releaser(writer.fileno(), layout, punch=False)
    with attach(path, notify=False, register=False) as model:
        copier = DeviceCopier("cuda")
        results = {}
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(9, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
            host = model.tensor(slot.name)
            results[slot.name] = copier.copy(host, on_done=lambda i=slot.index: releaser.release(i))
        copier.finish()
        assert copier.pins_in_place, "read-only registration of the ring's mapping was refused"
        for slot in layout.slots:
            expected = torch.frombuffer(
                bytearray(expected_bytes(9, slot.index, slot.nbytes)), dtype=torch.uint8
            )
            assert torch.equal(results[slot.name].cpu(), expected), slot.name
    releaser.close()
    writer.close()


def test_a_copy_into_a_given_tensor_lands_there_and_a_mismatched_one_is_refused(shm_dir: Path) -> None:
    path = shm_dir / "m.seg"
    writer = _segment(path, MemoryMode.FULL)
    with attach(path, notify=False) as model:
        copier = DeviceCopier("cuda")
        target = torch.empty(SIZES[0], dtype=torch.uint8, device="cuda")
        assert copier.copy(model.tensor("t0"), into=target) is target
        copier.finish()
        assert torch.equal(target, _expected(0))
        with pytest.raises(ConfigError, match="cannot copy"):
            copier.copy(model.tensor("t1"), into=target)
    writer.close()


def test_a_refused_registration_falls_back_to_staging_and_leaves_no_error_for_the_next_kernel(
    shm_dir: Path,
) -> None:
    path = shm_dir / "m.seg"
    writer = _segment(path, MemoryMode.FULL)
    with attach(path, notify=False) as model:
        host = model.tensor("t0")
        cudart = torch.cuda.cudart()
        assert int(cudart.cudaHostRegister(host.data_ptr(), host.nbytes, 8)) == 0  # taken: the copier's fails
        try:
            copier = DeviceCopier("cuda")
            result = copier.copy(host)
            copier.finish()
            assert not copier.pins_in_place
            assert torch.equal(result, _expected(0))
            assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # no error left for a later kernel
        finally:
            cudart.cudaHostUnregister(host.data_ptr())
    writer.close()
