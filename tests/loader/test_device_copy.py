"""The copy from a segment to a GPU, each way ``DeviceCopier`` can make it, in each memory mode.

Pinned in place (``cuMemHostRegister`` read-only on the segment's own mapping: each tensor, or the whole
mapping or ring once) and through the pinned staging buffers; in memory mode full (a copy-on-write mapping),
release (each tensor marked consumed as its copy completes) and ring (a read-only mapping, mapped twice, with
a tensor that wraps the ring's end, and a ring smaller than the model streamed while a real engine loads).
Every device tensor must equal the bytes that were written. These run only where torch sees a CUDA device
(``make gpu-check``); ``tests/loader/test_device_copier.py`` runs the same logic on a CPU stand-in, and
``benchmarks/gpu_copy.py`` measures the paths for speed.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from modelload.loader import attach
from modelload.loader._api.gpu_copy import DeviceCopier, Region
from modelload.loader._api.torch import as_tensor
from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.release import Releaser
from modelload.sidecar.memory import MemorySettings
from tests.segment.helpers import expected_bytes, uint8_segment
from tests.sidecar import models
from tests.support.engine import EngineThread

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = [3 << 20, 5000, 1 << 20, 70 << 20, 12]  # one tensor larger than a staging buffer (64 MiB)


def _segment(path: Path, mode: MemoryMode) -> SegmentWriter:
    return uint8_segment(path, SIZES, mode)


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


@pytest.mark.parametrize("pin", ["each-tensor", "whole-ring"])
def test_a_ring_tensor_that_wraps_the_end_is_registered_and_copied_whole(shm_dir: Path, pin: str) -> None:
    # A ring of 4 pages: t0 takes [0, 10000); t1 starts at 12288 and wraps to [0, 4904) of t0's bytes, so it
    # lands only once t0 is copied and released, and its view crosses the reader's second mapping. Pinned
    # on its own, t1's registration spans both mappings; with the whole ring pinned (its first mapping),
    # t1 is copied in two pieces from it.
    ring = 4 * 4096
    sizes = [10000, 9000]
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    layout = plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=ring)
    path = shm_dir / "ring.seg"
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    releaser = Releaser(writer.fileno(), layout, punch=False)
    with attach(path, notify=False, register=False) as model:
        copier = DeviceCopier("cuda")
        if pin == "whole-ring":
            data = model._reader.data()
            assert copier.pin(Region(as_tensor(data, by_name("uint8"), (len(data),)), ring))
        results = {}
        released = [threading.Event() for _ in layout.slots]

        def release(index: int) -> None:
            releaser.release(index)
            released[index].set()

        for slot in layout.slots:
            if slot.index:  # a writer lands t1 over t0's bytes only once t0 is released
                assert released[slot.index - 1].wait(30), "the copy of the previous tensor never completed"
            writer.slot(slot.index)[:] = expected_bytes(9, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
            host = model.tensor(slot.name)
            results[slot.name] = copier.copy(host, on_done=lambda i=slot.index: release(i))
        copier.finish()
        assert copier.pins_in_place, "read-only registration of the ring's mapping was refused"
        for slot in layout.slots:
            expected = torch.frombuffer(
                bytearray(expected_bytes(9, slot.index, slot.nbytes)), dtype=torch.uint8
            )
            assert torch.equal(results[slot.name].cpu(), expected), slot.name
    releaser.close()
    writer.close()


def test_a_ring_smaller_than_the_model_streams_to_the_gpu_while_the_engine_loads(
    tmp_path: Path, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=3)
    source = tmp_path / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(tensors))
    segment = shm_dir / "ring.seg"
    load = EngineThread(source, segment, MemorySettings(mode="ring", ring_size=1 << 20, wait_timeout=20))
    with attach(segment, timeout=60, notify=False) as model:
        on_gpu = model.state_dict(device="cuda")
    load.finish()
    assert load.error is None, load.error
    for name, tensor in tensors.items():
        assert torch.equal(on_gpu[name].cpu(), tensor), name


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


def _packed_segment(path: Path, count: int) -> SegmentWriter:
    """A complete packed segment (layout version 5) of ``count`` float16 tensors of 4-16 KiB, each slot right
    after the one before it: a mixture of experts' small tensors share their pages."""
    rng = np.random.default_rng(3)
    specs = [
        TensorSpec(f"experts.{i}.weight", by_name("float16"), (int(n),))
        for i, n in enumerate(rng.integers(2048, 8193, count))
    ]
    layout = plan_layout(specs, packed=True)
    assert layout.layout_version == 5
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    for slot in layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(11, slot.index, slot.nbytes)
    writer.mark_ready_many(np.arange(len(layout.slots)))
    writer.mark_complete()
    return writer


def _same_bits(got: torch.Tensor, index: int) -> bool:
    want = torch.frombuffer(bytearray(expected_bytes(11, index, got.nbytes)), dtype=torch.uint8)
    return torch.equal(got.cpu().reshape(-1).view(torch.uint8), want)  # bits: random float16s hold NaNs


@pytest.mark.parametrize("way", ["state_dict", "each-tensor", "staging"])
def test_a_packed_segment_reaches_the_gpu_bit_for_bit_each_way(shm_dir: Path, way: str) -> None:
    # Packed slots share pages: pinning each tensor on its own registers pages a neighbour's registration
    # already holds, which the driver refuses; the copier must then stage, leaving no error behind.
    writer = _packed_segment(shm_dir / "packed.seg", 3000)
    with attach(shm_dir / "packed.seg", notify=False) as model:
        if way == "state_dict":
            results = model.state_dict(device="cuda")
        else:
            copier = DeviceCopier("cuda", pin_in_place=way == "each-tensor")
            results = {name: copier.copy(host) for name, host in model.state_dict().items()}
            copier.finish()
        assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # no error left for a later kernel
        for index, name in enumerate(model.names):
            assert results[name].device.type == "cuda", name
            assert results[name].dtype == torch.float16 and results[name].shape == model.tensor(name).shape
            assert _same_bits(results[name], index), name
    writer.close()
