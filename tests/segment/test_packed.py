"""Packed segments (layout version 5): a model of thousands of small tensors gets each slot right after the
one before it, on its element size, rather than on a page: no page of padding per tensor, and a weight file's
neighbouring tensors as contiguous as in the file. Readers take them as any other segment, and refuse a
packed segment that breaks the rules of its alignment."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentLayoutError
from modelload.loader.segment import MemoryMode, SegmentReader, TensorSpec, plan_layout
from modelload.loader.segment.layout import TensorSpecs
from modelload.loader.segment.placing import ALIGNMENT, PACKED_ALIGNMENT, PACKING_MIN
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
    assert moe.layout_version == 5 and moe.slot_alignment == PACKED_ALIGNMENT == 1
    offsets, sizes = moe.table.offsets, moe.table.nbytes
    assert offsets[0] % ALIGNMENT == 0 and not (offsets % 2).any()  # float16: on two bytes
    assert (offsets[1:] == offsets[:-1] + sizes[:-1]).all()  # contiguous, as the file holds them
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


def test_a_packed_slot_keeps_its_elements_natural_alignment() -> None:
    # A tensor of three float16 (6 bytes) before a float64: the float64 moves on to a multiple of 8, and so
    # on; the rest follow one another.
    specs = [
        TensorSpec("a", by_name("float16"), (3,)),
        TensorSpec("b", by_name("float64"), (2,)),
        TensorSpec("c", by_name("uint8"), (3,)),
        TensorSpec("d", by_name("complex128"), (1,)),
        TensorSpec("e", by_name("float32"), (1,)),
    ]
    layout = plan_layout(specs, packed=True)
    relative = [slot.offset - layout.data_offset for slot in layout.slots]
    assert relative == [0, 8, 24, 32, 48]


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
    [
        (64, "alignment 64, expected 1 in a version-5"),
        (4096, "alignment 4096, expected 1"),
        (0, "alignment 0"),
    ],
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


def test_a_packed_slot_off_its_elements_alignment_is_refused(packed: bytes, shm_dir: Path) -> None:
    from tests.segment.test_hostile import tensor

    data = tensor(1, offset=json_offset(packed, 1) + 1)(bytearray(packed))  # a float16 on an odd byte
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentLayoutError, match=r"offset \d+ is not a multiple of 2"):
        SegmentReader.open(path)


def json_offset(segment: bytes, index: int) -> int:
    import json

    length = struct.unpack_from("<Q", segment, 32)[0]
    return int(json.loads(segment[4096 : 4096 + length])["tensors"][index]["offset"])


def test_a_packed_segment_that_claims_a_memory_mode_is_refused(packed: bytes, shm_dir: Path) -> None:
    data = bytearray(packed)
    struct.pack_into("<I", data, 96, int(MemoryMode.RELEASE))  # version 5 is memory mode full
    path = shm_dir / "hostile.seg"
    path.write_bytes(bytes(data))
    with pytest.raises(SegmentLayoutError, match="reserved header bytes"):
        SegmentReader.open(path)
