"""Packed segments (layout version 5): a model of thousands of small tensors gets slots on 64-byte boundaries
rather than pages, so its padding costs the writer no extra pages; readers take them as any other segment,
and refuse a packed segment that breaks the rules of its alignment."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentLayoutError
from modelload.loader.segment import MemoryMode, SegmentReader, TensorSpec, plan_layout
from modelload.loader.segment.layout import ALIGNMENT, PACKED_ALIGNMENT, PACKING_MIN, TensorSpecs
from tests.segment.helpers import expected_bytes, write_complete

MIB = 1 << 20


def _moe(count: int, *, files: int = 1) -> list[TensorSpec]:
    """``count`` float16 tensors of 4-16 KiB (a mixture of experts' experts), spread over ``files``."""
    rng = np.random.default_rng(3)
    sizes = rng.integers(2048, 8193, count).tolist()
    per = -(-count // files)
    return [
        TensorSpec(
            f"model.layers.{i // 384}.mlp.experts.{i % 384}.weight",
            by_name("float16"),
            (n,),
            file=i // per if files > 1 else None,
        )
        for i, n in enumerate(sizes)
    ]


def test_thousands_of_small_tensors_are_packed_and_dense_models_are_not() -> None:
    moe = plan_layout(_moe(10_000))
    assert moe.layout_version == 5 and moe.slot_alignment == PACKED_ALIGNMENT
    offsets, sizes = moe.table.offsets, moe.table.nbytes
    assert not (offsets % PACKED_ALIGNMENT).any()
    gaps = offsets[1:] - (offsets[:-1] + sizes[:-1])
    assert gaps.min() >= 0 and gaps.max() < PACKED_ALIGNMENT  # in order, never overlapping, no page padding
    paged = plan_layout(_moe(10_000), packed=False)
    assert paged.layout_version == 1 and not (paged.table.offsets % ALIGNMENT).any()
    assert paged.data_length - moe.data_length > PACKING_MIN  # what packing saves: more than 8 MiB of pages
    # A dense model's big tensors (and a few small ones) pad its bytes by far less than 1%: pages, as before.
    dense = [TensorSpec(f"w{i}", by_name("bfloat16"), (2048, 2048)) for i in range(64)]
    dense += [TensorSpec(f"norm{i}", by_name("bfloat16"), (2048,)) for i in range(64)]
    assert plan_layout(dense).layout_version == 1
    # A small model is never packed for its few pages: older loaders read it.
    assert plan_layout(_moe(100)).layout_version == 1


def test_only_a_full_memory_mode_segment_is_packed() -> None:
    # Release and ring give a tensor's pages back when it is consumed: a tensor must own its pages.
    assert plan_layout(_moe(10_000), memory_mode=MemoryMode.RELEASE).layout_version == 3
    with pytest.raises(SegmentLayoutError, match="only a memory mode full segment is packed"):
        plan_layout(_moe(100), memory_mode=MemoryMode.RELEASE, packed=True)


def test_tensors_with_leads_keep_room_for_them_when_packed() -> None:
    specs = TensorSpecs.of(
        [TensorSpec(f"t{i}", by_name("uint8"), (100 + i,), lead=40 + i) for i in range(50)]
    )
    layout = plan_layout(specs, packed=True)
    offsets, sizes = layout.table.offsets, layout.table.nbytes
    room = offsets[1:] - (offsets[:-1] + sizes[:-1])
    assert (room >= np.arange(41, 90)).all() and offsets[0] - 40 >= layout.state_offset


def test_a_packed_multi_file_segment_reads_back_every_tensor_exactly(shm_dir: Path) -> None:
    specs = _moe(3000, files=3)
    layout = plan_layout(specs, files=("a.safetensors", "b.safetensors", "c.safetensors"), packed=True)
    path = shm_dir / "packed.seg"
    write_complete(path, layout, seed=7)
    with SegmentReader.open(path) as reader:
        reader.wait(timeout=0)
        assert reader.header.layout_version == 5 and reader.header.alignment == PACKED_ALIGNMENT
        assert [s.file for s in reader.slots][::1000] == [0, 1, 2]
        for slot in reader.slots:
            assert bytes(reader.view(slot.index)) == expected_bytes(7, slot.index, slot.nbytes), slot.name


@pytest.fixture
def packed(shm_dir: Path) -> bytes:
    path = shm_dir / "packed.seg"
    write_complete(path, plan_layout(_moe(20), packed=True))
    data = path.read_bytes()
    path.unlink()
    return data


@pytest.mark.parametrize(
    ("alignment", "message"),
    [(48, "alignment 48, expected a power of two from 64"), (32, "alignment 32"), (8192, "alignment 8192")],
)
def test_a_packed_segment_with_an_alignment_out_of_bounds_is_refused(
    packed: bytes, shm_dir: Path, alignment: int, message: str
) -> None:
    data = bytearray(packed)
    struct.pack_into("<I", data, 44, alignment)
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentLayoutError, match=message):
        SegmentReader.open(path)


def test_a_packed_segment_whose_slots_break_their_alignment_is_refused(packed: bytes, shm_dir: Path) -> None:
    # Declared 128-byte slots, where the writer placed them on 64: some offset is not a multiple of 128.
    data = bytearray(packed)
    struct.pack_into("<I", data, 44, 128)
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentLayoutError, match="not a multiple of 128"):
        SegmentReader.open(path)


def test_a_packed_segment_that_claims_a_memory_mode_is_refused(packed: bytes, shm_dir: Path) -> None:
    data = bytearray(packed)
    struct.pack_into("<I", data, 96, int(MemoryMode.RELEASE))  # version 5 is memory mode full
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentLayoutError, match="reserved header bytes"):
        SegmentReader.open(path)
