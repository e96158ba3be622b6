"""Model directories as the Hub has them, staged into segments with a model directory beside them."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".tensors", ".pt", ".pth")

StageDir = Callable[[Path], Path]


@pytest.fixture
def stage_dir(shm_dir: Path) -> StageDir:
    """``stage_dir(directory) -> segment``: every safetensors shard of ``directory`` into one segment, every
    other file into a model directory beside it, named in the segment's ``model_dir`` metadata.

    A stand-in for ``modelload stage DIR SEGMENT`` until directories can be staged; tests use only this
    interface.
    """
    safetensors = pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")

    def stage(directory: Path) -> Path:
        segment = shm_dir / f"{directory.name}.seg"
        model_dir = shm_dir / f"{directory.name}.model"
        model_dir.mkdir()
        for item in sorted(directory.iterdir()):
            if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES):
                shutil.copy2(item, model_dir / item.name)
        tensors = {}
        for shard in sorted(directory.glob("*.safetensors")):
            with safetensors.safe_open(shard, framework="pt") as file:
                for name in file.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    assert name not in tensors, f"{name} is in two shards"
                    tensors[name] = file.get_tensor(name)
        assert tensors, f"no safetensors shard in {directory}"
        specs = [
            TensorSpec(name, by_name(str(t.dtype).removeprefix("torch.")), tuple(t.shape))
            for name, t in tensors.items()
        ]
        metadata = {"format": "safetensors", "source": str(directory), "model_dir": str(model_dir)}
        with SegmentWriter.create(segment, plan_layout(specs, metadata=metadata), heartbeat=False) as writer:
            for i, tensor in enumerate(tensors.values()):
                if tensor.numel():
                    writer.slot(i)[:] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                writer.mark_ready(i)
            writer.mark_complete()
        return segment

    return stage
