"""How the keeper packs a model's tensors into blocks of GPU memory."""

from __future__ import annotations

import random

import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError
from modelload.loader.handoff.placement import ALIGNMENT, place
from modelload.loader.handoff.protocol import Manifest

MiB = 1 << 20
F16 = by_name("float16")


def checked(blocks: list[int], places: list) -> Manifest:
    """The placement as a manifest, through every rule an app checks (bounds, overlaps, sizes)."""
    message = Manifest({"uuid": "GPU-x"}, tuple(blocks), tuple(places)).message(1)
    return Manifest.parse(message)


def test_tensors_are_packed_in_order_aligned_into_blocks_of_whole_granules() -> None:
    tensors = [(f"t{i}", F16, (1000 + i,)) for i in range(50)]
    blocks, places = place(tensors, block_size=16 << 10, granularity=4096)
    checked(blocks, places)
    assert [p.name for p in places] == [name for name, _, _ in tensors]
    assert all(p.offset % ALIGNMENT == 0 for p in places)
    assert all(size % 4096 == 0 and size <= 16 << 10 for size in blocks)
    assert [p.block for p in places] == sorted(p.block for p in places)
    assert len(blocks) < len(tensors)


def test_a_tensor_larger_than_a_block_gets_a_block_of_its_own() -> None:
    tensors = [("small", F16, (10,)), ("huge", F16, (5 * MiB,)), ("after", F16, (10,))]
    blocks, places = place(tensors, block_size=2 * MiB, granularity=2 * MiB)
    checked(blocks, places)
    assert [p.block for p in places] == [0, 1, 2]
    assert blocks == [2 * MiB, 10 * MiB, 2 * MiB]


def test_the_block_size_is_rounded_up_to_the_granularity() -> None:
    blocks, _ = place([(f"t{i}", F16, (MiB,)) for i in range(3)], block_size=3 * MiB, granularity=2 * MiB)
    assert blocks == [4 * MiB, 2 * MiB]


def test_random_models_always_make_a_valid_manifest() -> None:
    rng = random.Random(7)
    dtypes = [by_name(n) for n in ("float32", "bfloat16", "int8", "float64", "float8_e5m2")]
    for _ in range(50):
        tensors = [
            (f"t{i}", rng.choice(dtypes), tuple(rng.randint(0, 300) for _ in range(rng.randint(0, 3))))
            for i in range(rng.randint(0, 40))
        ]
        blocks, places = place(tensors, block_size=rng.choice([4096, 65536, 1 << 20]), granularity=4096)
        manifest = checked(blocks, places)
        assert len(manifest.tensors) == len(tensors)


def test_an_empty_model_needs_no_block() -> None:
    assert place([], block_size=MiB, granularity=4096) == ([], [])


def test_a_size_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ConfigError, match="positive"):
        place([], block_size=0, granularity=4096)
