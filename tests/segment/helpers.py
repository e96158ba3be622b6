"""Small builders shared by the segment tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.layout import Layout


def expected_bytes(seed: int, index: int, nbytes: int) -> bytes:
    """Deterministic content for tensor ``index`` of a test segment, reproducible in another process."""
    return np.random.default_rng([seed, index]).integers(0, 256, nbytes, dtype=np.uint8).tobytes()


def uint8_segment(
    path: Path, sizes: list[int], mode: MemoryMode = MemoryMode.FULL, seed: int = 5
) -> SegmentWriter:
    """A complete segment of uint8 tensors ``t0``, ``t1``, ... of ``sizes`` bytes, each holding
    :func:`expected_bytes` of ``seed``."""
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    writer = SegmentWriter.create(path, plan_layout(specs, memory_mode=mode), heartbeat=False)
    for slot in writer.layout.slots:
        writer.slot(slot.index)[:] = expected_bytes(seed, slot.index, slot.nbytes)
        writer.mark_ready(slot.index)
    writer.mark_complete()
    return writer


def small_layout() -> Layout:
    return plan_layout(
        [
            TensorSpec("embed.weight", by_name("bfloat16"), (2, 3)),
            TensorSpec("bias", by_name("float32"), (2,)),
        ],
        metadata={"format": "safetensors"},
    )


def sharded_layout() -> Layout:
    """A layout-2 segment: two tensors from two weight files."""
    return plan_layout(
        [
            TensorSpec("embed.weight", by_name("bfloat16"), (2, 3), file=0),
            TensorSpec("bias", by_name("float32"), (2,), file=1),
        ],
        metadata={"format": "safetensors"},
        files=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"),
    )


def write_complete(path: Path, layout: Layout, *, seed: int = 0) -> None:
    """A finished segment whose tensor ``i`` holds ``expected_bytes(seed, i, ...)``."""
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(seed, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
        writer.mark_complete()


def json_manifest(layout: Any) -> bytes:
    """The manifest as every earlier writer encoded it: one json.dumps of the whole document."""
    tensors = []
    for s in layout.slots:
        entry: dict[str, Any] = {"name": s.name, "dtype": s.dtype.name, "shape": list(s.shape),
                                 "offset": s.offset, "nbytes": s.nbytes}  # fmt: skip
        if s.sha256 is not None:
            entry["sha256"] = s.sha256
        if s.file is not None:
            entry["file"] = s.file
        tensors.append(entry)
    document: dict[str, Any] = {"tensors": tensors, "metadata": dict(layout.metadata)}
    if layout.files:
        document["files"] = list(layout.files)
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
