"""Builders shared by the hand-off tests: a model, its segment, a short folder for sockets."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from modelload.loader.dtypes import from_torch
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout


def model_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return {
        "embed.weight": torch.randn(64, 32, generator=generator).bfloat16(),
        "layers.0.weight": torch.randn(32, 32, generator=generator),
        "layers.0.bias": torch.randn(32, generator=generator).half(),
        "positions": torch.arange(64, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "scale": torch.tensor(0.5, dtype=torch.float64),
    }


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def write_segment(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    mode: MemoryMode = MemoryMode.FULL,
    ready: int | None = None,
    page_size: int = 4096,
) -> SegmentWriter:
    """A segment of ``tensors``, the first ``ready`` of them published (all, and complete, by default);
    ``page_size``: the volume's (2 MiB on hugetlbfs)."""
    specs = [TensorSpec(name, from_torch(t.dtype), tuple(t.shape)) for name, t in tensors.items()]
    layout = plan_layout(
        specs,
        memory_mode=mode,
        page_size=page_size,
        metadata={"source": "file:///model", "format": "safetensors"},
    )
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    publish(writer, tensors, range(len(tensors) if ready is None else ready))
    if ready is None:
        writer.mark_complete()
    return writer


def publish(writer: SegmentWriter, tensors: dict[str, torch.Tensor], indices: range) -> None:
    values = list(tensors.values())
    for i in indices:
        writer.slot(i)[:] = values[i].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        writer.mark_ready(i)


def probe(name: str, content: bytes = b"") -> int:
    """A memfd named ``name``: :func:`held` counts this process's descriptors of it."""
    fd = os.memfd_create(name)
    os.write(fd, content)
    return fd


def held(name: str) -> int:
    """How many descriptors of this process point to memfds named ``name`` (robust to other threads'
    descriptors, which a count of every open descriptor is not)."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{entry}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, another thread's)
        count += target.startswith(f"/memfd:{name} ")
    return count
