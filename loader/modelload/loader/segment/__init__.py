"""The shared-memory segment: the versioned layout a sidecar writes and loaders attach to.

SPEC.md beside this file is the contract, byte by byte. ``layout`` plans and validates it, ``writer`` fills
it, ``reader`` maps it and waits for tensors.
"""

from modelload.loader.segment.finish import TensorFinisher
from modelload.loader.segment.layout import (
    ALIGNMENT,
    LAYOUT_VERSION,
    LAYOUT_VERSIONS,
    MODEL_DIR_KEY,
    PACKED_ALIGNMENT,
    Layout,
    MemoryMode,
    Slot,
    TensorFlags,
    TensorSpec,
    TensorSpecs,
    TensorState,
    WriterState,
    plan_layout,
)
from modelload.loader.segment.pool import run_in_order
from modelload.loader.segment.reader import SegmentReader, Waiter
from modelload.loader.segment.writer import SegmentWriter

__all__ = [
    "ALIGNMENT",
    "LAYOUT_VERSION",
    "LAYOUT_VERSIONS",
    "MODEL_DIR_KEY",
    "PACKED_ALIGNMENT",
    "Layout",
    "MemoryMode",
    "SegmentReader",
    "SegmentWriter",
    "Slot",
    "TensorFinisher",
    "TensorFlags",
    "TensorSpec",
    "TensorSpecs",
    "TensorState",
    "Waiter",
    "WriterState",
    "plan_layout",
    "run_in_order",
]
