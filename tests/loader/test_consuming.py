"""Consuming tensors (memory modes release and ring): who registers, what gets marked, and when."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modelload.loader import attach
from modelload.loader.dtypes import from_torch
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.consumers import ConsumerTable, table_path


def _publish(path: Path, tensors: dict[str, torch.Tensor], mode: MemoryMode) -> SegmentWriter:
    specs = [TensorSpec(name, from_torch(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    writer = SegmentWriter.create(path, plan_layout(specs, memory_mode=mode), heartbeat=False)
    for i, tensor in enumerate(tensors.values()):
        writer.slot(i)[:] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        writer.mark_ready(i)
    writer.mark_complete()
    return writer


def _marked(path: Path, writer: SegmentWriter) -> list[list[int]]:
    table = ConsumerTable.open(
        path, load_id=writer.load_id, tensor_count=len(writer.layout.slots), write=False
    )
    try:
        return [list(table.consumed_bits(e.slot)) for e in table.entries() if e.active]
    finally:
        table.close()


def test_a_full_mode_segment_registers_nobody_and_consuming_does_nothing(shm_dir: Path) -> None:
    path = shm_dir / "full.seg"
    with _publish(path, {"w": torch.ones(4)}, MemoryMode.FULL), attach(path, notify=False) as model:
        assert model.memory_mode == "full"
        model.consumed("w")
        assert not table_path(path).exists()
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            model.consumed(["nope"])


def test_attach_registers_consumed_marks_and_close_leaves(shm_dir: Path) -> None:
    path = shm_dir / "release.seg"
    tensors = {"a": torch.ones(1024), "b": torch.zeros(8)}
    with _publish(path, tensors, MemoryMode.RELEASE) as writer:
        model = attach(path, notify=False)
        monitor = attach(path, notify=False, register=False)
        assert _marked(path, writer) == [[0]], "one consumer; the monitor holds nothing back"
        model.consumed(["b"])
        assert _marked(path, writer) == [[0b10]]
        model.consumed("a")
        assert _marked(path, writer) == [[0b11]]
        model.close()
        assert _marked(path, writer) == [], "a closed model needs nothing more"
        monitor.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_dict_to_the_gpu_marks_each_tensor_consumed_once_copied(shm_dir: Path) -> None:
    path = shm_dir / "gpu.seg"
    tensors = {f"t{i}": torch.randn(256, 1024) for i in range(6)}
    with _publish(path, tensors, MemoryMode.RELEASE) as writer, attach(path, notify=False) as model:
        on_gpu = model.state_dict(device="cuda")
        assert all(torch.equal(on_gpu[name].cpu(), tensor) for name, tensor in tensors.items())
        assert _marked(path, writer) == [[0b111111]]
