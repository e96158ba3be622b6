"""The manifest is made from columns of texts (a text per tensor for its name and offset, one per kind of
tensor or per file for the rest) and its length from arithmetic over them: whatever the names, hashes, files
and dtypes, its bytes are json.dumps of the whole document, as every earlier writer wrote them, and the rules
plan_layout checks still name the first tensor that breaks one."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentLayoutError
from modelload.loader.formats import Names
from modelload.loader.segment import MemoryMode, TensorSpec, TensorSpecs, plan_layout
from modelload.loader.segment.kinds import Kinds
from modelload.loader.segment.layout import Layout
from modelload.loader.segment.manifest_bytes import _BATCH
from tests.segment.helpers import json_manifest

ODD_NAMES = [
    "",
    "é",
    "中文.权重",
    "emoji.🙂.w",
    'quote"d',
    "back\\slash",
    "new\nline",
    "tab\tbell\x07nul\x00",
    "\x1f\x7f\u2028\u2029",
    "/",
    "a" * 300,
]


def columns(
    names: list[str], rng: random.Random, *, dtypes: list[str], files: int, hashes: bool
) -> TensorSpecs:
    """Specs as the sidecar's planner gives them: names as one text, shapes shared between tensors."""
    shapes = [(), (0,), (3,), (2, 5), (7, 1, 4)]
    count = len(names)
    return TensorSpecs(
        names=Names(names),
        dtypes=[by_name(rng.choice(dtypes)) for _ in range(count)],
        shapes=[rng.choice(shapes) for _ in range(count)],
        leads=[rng.choice([0, 0, 64, 5000]) for _ in range(count)],
        files=[rng.randrange(files) for _ in range(count)] if files else [None] * count,
        sha256=[
            f"{rng.getrandbits(256):064x}" if hashes and rng.random() < 0.4 else None for _ in range(count)
        ],
    )


def assert_the_json_of_the_whole_document(layout: Layout) -> None:
    expected = json_manifest(layout)
    assert layout.manifest == expected
    assert layout.manifest_length == len(expected)
    written = bytearray(len(expected))
    assert layout.write_manifest(memoryview(written)) == zlib.crc32(expected)
    assert bytes(written) == expected


@pytest.mark.parametrize("count", [0, 1, 2, _BATCH - 1, _BATCH, _BATCH + 1, 2 * _BATCH + 5])
@pytest.mark.parametrize("files", [0, 1, 3])
def test_a_manifest_of_plain_names_is_the_json_of_the_whole_document(count: int, files: int) -> None:
    rng = random.Random(count * 7 + files)
    names = [f"model.layers.{i // 64}.mlp.experts.{i % 64}.down_proj.weight" for i in range(count)]
    specs = columns(names, rng, dtypes=["bfloat16"], files=files, hashes=False)
    shards = tuple(f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(files))
    assert_the_json_of_the_whole_document(
        plan_layout(specs, metadata={"format": "safetensors"}, files=shards)
    )


@pytest.mark.parametrize("seed", range(6))
def test_odd_names_hashes_and_mixed_dtypes_in_some_batches_only_still_make_the_one_document(
    seed: int,
) -> None:
    # Each batch decides alone whether its names need escaping: the odd names land in some batches only.
    rng = random.Random(seed)
    count = rng.choice([1, 5, _BATCH + 40, 2 * _BATCH + 1])
    names = [f"w{i}" for i in range(count)]
    for odd, at in zip(ODD_NAMES, rng.sample(range(count), min(count, len(ODD_NAMES))), strict=False):
        names[at] = odd + f"#{at}"
    dtypes = rng.choice([["float32"], ["float16", "int8", "float64", "bool"]])
    specs = columns(names, rng, dtypes=dtypes, files=rng.choice([0, 2]), hashes=seed % 2 == 1)
    shards = ("a.safetensors", 'b-é"\\.safetensors')[: 2 if specs.files[0] is not None else 0]
    metadata = {"format": "safetensors", "ké": '"v\\\n', "中": ""}
    assert_the_json_of_the_whole_document(plan_layout(specs, metadata=metadata, files=shards))


def test_a_manifest_of_one_odd_name_is_the_json_of_the_whole_document() -> None:
    for name in ODD_NAMES:
        layout = plan_layout([TensorSpec(name, by_name("float16"), (3,), sha256="ab" * 32)])
        assert_the_json_of_the_whole_document(layout)


def test_a_layout_given_its_slots_writes_the_manifest_its_planned_twin_writes() -> None:
    # A layout made from Slot objects (the slot table groups its tensors on first use, and its file numbers
    # are a plain list) encodes what the planned layout it was copied from encodes.
    rng = random.Random(4)
    names = [f"t{i}" if i % 9 else f'é"{i}' for i in range(300)]
    planned = plan_layout(
        columns(names, rng, dtypes=["float16", "uint8"], files=2, hashes=True), files=("a", "b")
    )
    copied = Layout(
        slots=list(planned.slots), metadata=planned.metadata, manifest_length=planned.manifest_length,
        state_offset=planned.state_offset, data_offset=planned.data_offset, data_length=planned.data_length,
        files=planned.files,
    )  # fmt: skip
    assert copied.manifest == planned.manifest == json_manifest(planned)


def test_tensors_of_one_shape_and_different_dtypes_are_kinds_of_their_own() -> None:
    f16, f32, u8 = by_name("float16"), by_name("float32"), by_name("uint8")
    kinds = Kinds([f16, f32, f16, u8, f32], [(4,), (4,), (4,), (4,), (2, 2)])
    assert [(kinds.dtypes[k], kinds.shapes[k]) for k in kinds.of] == [
        (f16, (4,)), (f32, (4,)), (f16, (4,)), (u8, (4,)), (f32, (2, 2))
    ]  # fmt: skip
    assert [kinds.nbytes[k] for k in kinds.of] == [8, 16, 8, 4, 16]
    assert kinds.of[0] == kinds.of[2] and len(kinds) == 4
    assert kinds.counts().tolist() == [np.count_nonzero(kinds.of == k) for k in range(len(kinds))]
    assert kinds.first_tensor([kinds.dtypes[k] is u8 for k in range(len(kinds))]) == 3
    assert kinds.first_tensor([False] * len(kinds)) is None


def test_sizes_and_offsets_follow_each_tensors_own_dtype_and_shape() -> None:
    f16, f64 = by_name("float16"), by_name("float64")
    specs = [TensorSpec(f"t{i}", f16 if i % 2 else f64, (3, 1000 + i % 3)) for i in range(30)]
    layout = plan_layout(specs)
    assert [slot.nbytes for slot in layout.slots] == [spec.nbytes for spec in specs]
    assert [slot.dtype for slot in layout.slots] == [spec.dtype for spec in specs]
    assert all(b.offset >= a.offset + a.nbytes for a, b in zip(layout.slots, layout.slots[1:], strict=False))


def many(count: int, **odd: TensorSpec) -> list[TensorSpec]:
    """``count`` well-formed tensors of a few shapes, with the ones named by index (``t12=...``) replaced."""
    specs = [TensorSpec(f"t{i}", by_name("float16"), (i % 4 + 1, 8), lead=64) for i in range(count)]
    for key, spec in odd.items():
        specs[int(key[1:])] = spec
    return specs


def test_an_invalid_shape_names_the_first_tensor_that_has_one() -> None:
    bad = (5, -1)
    specs = many(
        50, t20=TensorSpec("late", by_name("float16"), bad), t7=TensorSpec("early", by_name("int8"), bad)
    )
    with pytest.raises(SegmentLayoutError, match=r"tensor 'early' has an invalid shape \(5, -1\)"):
        plan_layout(specs)
    with pytest.raises(SegmentLayoutError, match="tensor 'deep' has an invalid shape"):
        plan_layout(many(50, t30=TensorSpec("deep", by_name("float16"), (1,) * 65)))


def test_a_negative_lead_names_the_first_tensor_that_asks_for_one() -> None:
    specs = many(50, t31=TensorSpec("late", by_name("float16"), (1, 8), lead=-2),
                 t12=TensorSpec("early", by_name("float16"), (1, 8), lead=-1))  # fmt: skip
    with pytest.raises(SegmentLayoutError, match="tensor 'early' asks for a negative lead -1"):
        plan_layout(specs)


def test_a_tensor_larger_than_the_ring_is_named_first_of_those_that_are() -> None:
    # Tensors of one shape (one kind) at two places: the earlier is named, with its size.
    huge = (3000,)
    specs = many(
        40,
        t33=TensorSpec("later", by_name("float16"), huge),
        t9=TensorSpec("first", by_name("float16"), huge),
    )
    with pytest.raises(
        SegmentLayoutError, match=r"tensor 'first': 6000 bytes do not fit in the ring of 4096"
    ):
        plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=4096)


def test_leads_and_files_given_as_arrays_place_what_the_same_lists_place() -> None:
    # The sidecar passes its index's own columns; the layout is the one the lists make, rules included.
    rng = random.Random(9)
    listed = columns([f"t{i}" for i in range(500)], rng, dtypes=["float16", "int8"], files=3, hashes=False)
    arrays = TensorSpecs(listed.names, listed.dtypes, listed.shapes, np.asarray(listed.leads, dtype=np.int64),
                         np.asarray(listed.files, dtype=np.int32), listed.sha256)  # fmt: skip
    shards = ("a", "b", "c")
    expected = plan_layout(listed, files=shards)
    got = plan_layout(arrays, files=shards)
    assert got.manifest == expected.manifest and got.slots == expected.slots
    assert (got.data_offset, got.data_length) == (expected.data_offset, expected.data_length)
    for numbers, message in [
        (np.where(np.arange(500) == 77, 3, arrays.files), "tensor 't77' names no file of the 3 given"),
        (np.where(np.arange(500) == 5, -1, arrays.files), "tensor 't5' names no file of the 3 given"),
        (arrays.files.astype(np.float64), "tensor 't0' names no file of the 3 given"),
    ]:
        with pytest.raises(SegmentLayoutError, match=message):
            plan_layout(TensorSpecs(listed.names, listed.dtypes, listed.shapes, arrays.leads, numbers,
                                    listed.sha256), files=shards)  # fmt: skip
    negative = np.where(np.arange(500) == 300, -8, arrays.leads)
    with pytest.raises(SegmentLayoutError, match="tensor 't300' asks for a negative lead -8"):
        plan_layout(TensorSpecs(listed.names, listed.dtypes, listed.shapes, negative, arrays.files,
                                listed.sha256), files=shards)  # fmt: skip
