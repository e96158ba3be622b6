"""Segments of many tensors (MoE checkpoints carry 100,000): the manifest is encoded once and read column by
column, readiness is read a batch at a time, and none of it changes what is written or accepted."""

from __future__ import annotations

import copy
import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader import attach
from modelload.loader.dtypes import by_name
from modelload.loader.errors import SegmentLayoutError
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout
from modelload.loader.segment.layout import Header, MemoryMode
from modelload.loader.segment.validate import _parse_slot, _parse_slots_at_once, parse_header
from tests.segment.helpers import json_manifest

DTYPES = ["float16", "int8", "float64", "bfloat16", "float8_e4m3fn", "bool"]


def random_specs(rng: random.Random, count: int, files: int) -> list[TensorSpec]:
    specs = []
    for i in range(count):
        shape = tuple(rng.randrange(0, 300) for _ in range(rng.randrange(0, 4)))
        name = f"layers.{i}.w" if rng.random() < 0.7 else f'é"\\\n{i}{rng.random()}'
        sha = f"{rng.getrandbits(256):064x}" if rng.random() < 0.3 else None
        lead = rng.choice([0, 0, 100, 5000])
        specs.append(
            TensorSpec(
                name,
                by_name(rng.choice(DTYPES)),
                shape,
                sha256=sha,
                lead=lead,
                file=rng.randrange(files) if files else None,
            )
        )
    return specs


@pytest.mark.parametrize("seed", range(12))
def test_the_manifest_encoded_once_is_byte_for_byte_the_json_of_the_whole_document(seed: int) -> None:
    rng = random.Random(seed)
    files = tuple(f'model-{i}-é"\\.safetensors' for i in range(rng.choice([0, 0, 1, 3])))
    specs = random_specs(rng, rng.choice([0, 1, 3, 40, 700]), len(files))
    layout = plan_layout(specs, metadata={"format": "safetensors", "ké": '"v\\'}, files=files)
    assert layout.manifest == json_manifest(layout)
    # The slots where the layout rules put them: each on the first boundary past the previous one's end
    # that leaves room for its lead, the first at the data offset.
    end = None
    for slot, spec in zip(layout.slots, specs, strict=True):
        expected = layout.data_offset if end is None else -(-(end + spec.lead) // 4096) * 4096
        assert slot.offset == expected
        end = slot.offset + spec.nbytes
    assert layout.state_offset == -(-(4096 + len(layout.manifest)) // 4096) * 4096


def test_a_manifest_of_many_batches_with_hashes_in_some_only_is_the_json_of_the_whole_document() -> None:
    # The manifest is made a batch of columns at a time: batches with and without hashes, files, odd names
    # and shapes, and a last batch cut short, must still join into the one document.
    from modelload.loader.segment.manifest_bytes import _BATCH

    rng = random.Random(7)
    count = 2 * _BATCH + 123
    specs = [
        TensorSpec(
            f"model.layers.{i}.mlp.experts.{i % 64}.w" if i % 97 else f'é"\\\n{i}',
            by_name(rng.choice(DTYPES)),
            tuple(rng.randrange(1, 40) for _ in range(i % 3)),
            sha256=f"{i:064x}" if _BATCH <= i < _BATCH + 50 else None,
            file=i % 3,
        )
        for i in range(count)
    ]
    files = ("a.safetensors", "b.safetensors", "c.safetensors")
    layout = plan_layout(specs, metadata={"format": "safetensors"}, files=files)
    assert layout.manifest == json_manifest(layout)
    assert len(layout.manifest) == layout.manifest_length


def test_the_layouts_lookup_by_name_made_on_first_use_answers_every_name() -> None:
    rng = random.Random(3)
    specs = random_specs(rng, 3000, 2)
    layout = plan_layout(specs, files=("a.safetensors", "b.safetensors"))
    assert "by_name" not in vars(layout)  # nothing on the load path asks for it: not made with the layout
    assert layout.by_name == {spec.name: i for i, spec in enumerate(specs)}
    assert all(layout.slots[layout.by_name[spec.name]].name == spec.name for spec in specs)
    assert layout.by_name is layout.by_name  # made once


def test_a_name_given_twice_is_refused_without_the_lookup_by_name() -> None:
    specs = [TensorSpec(n, by_name("uint8"), (2,)) for n in ("a", "b", "c", "b")]
    with pytest.raises(SegmentLayoutError, match="'b' appears twice"):
        plan_layout(specs)


def header_of(layout: Any) -> Header:
    return layout.header(load_id=1, created_ns=1)


def slow(entries: list[Any], header: Header, files: int) -> Any:
    from modelload.loader.segment.validate import _check_disjoint

    slots = tuple(_parse_slot(i, entry, header, files) for i, entry in enumerate(entries))
    _check_disjoint(slots)
    return slots


@pytest.mark.parametrize("seed", range(6))
def test_a_manifest_read_column_by_column_gives_the_slots_the_rule_by_rule_check_gives(seed: int) -> None:
    rng = random.Random(seed)
    files = ("a.safetensors", "b.safetensors") if seed % 2 else ()
    ring = seed % 3 == 2
    specs = random_specs(rng, 500, len(files))
    biggest = max(s.nbytes for s in specs)
    layout = plan_layout(specs, files=files, memory_mode=MemoryMode.RING if ring else MemoryMode.FULL,
                         ring_size=biggest + 4096 if ring else 0)  # fmt: skip
    entries = json.loads(layout.manifest)["tensors"]
    header = header_of(layout)
    assert _parse_slots_at_once(entries, header, len(files)) == slow(entries, header, len(files))
    assert _parse_slots_at_once(entries, header, len(files)) == layout.slots


MUTATIONS = {
    "a duplicate name": lambda e: e[1].update(name=e[0]["name"]),
    "an overlap": lambda e: e[1].update(offset=e[0]["offset"]),
    "an unaligned offset": lambda e: e[2].update(offset=e[2]["offset"] + 8),
    "a wrong size": lambda e: e[2].update(nbytes=e[2]["nbytes"] + 1),
    "a boolean dimension": lambda e: e[2].update(shape=[True, *e[2]["shape"][1:]]),
    "a negative dimension": lambda e: e[2].update(shape=[-1, *e[2]["shape"][1:]]),
    "a float offset": lambda e: e[2].update(offset=float(e[2]["offset"])),
    "an offset past 64 bits": lambda e: e[2].update(offset=2**70),
    "an unknown dtype": lambda e: e[2].update(dtype="float7"),
    "a dtype that is a list": lambda e: e[2].update(dtype=["float16"]),
    "a torch-prefixed dtype": lambda e: e[2].update(dtype="torch." + e[2]["dtype"]),
    "an extra key": lambda e: e[2].update(extra=1),
    "a missing key": lambda e: e[2].pop("nbytes"),
    "a name that is a number": lambda e: e[2].update(name=7),
    "an unpaired surrogate": lambda e: e[2].update(name="a\ud800"),
    "a bad sha256": lambda e: e[2].update(sha256="XYZ"),
    "a null sha256": lambda e: e[2].update(sha256=None),
    "a null file without files": lambda e: e[2].update(file=None),
    "a file without files": lambda e: e[2].update(file=0),
    "a slot past the data region": lambda e: e[-1].update(offset=e[-1]["offset"] + (1 << 40)),
    "a tensor that is a list": lambda e: e.__setitem__(2, [1, 2]),
    "too many dimensions": lambda e: e[2].update(shape=[1] * 65, nbytes=2),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_the_column_check_accepts_nothing_the_rule_by_rule_check_refuses(case: str) -> None:
    rng = random.Random(7)
    specs = [TensorSpec(f"t{i}", by_name("float16"), (rng.randrange(1, 50), 3)) for i in range(8)]
    layout = plan_layout(specs)
    entries = json.loads(layout.manifest)["tensors"]
    MUTATIONS[case](entries)
    header = header_of(layout)
    try:
        expected = slow(copy.deepcopy(entries), header, 0)
    except SegmentLayoutError:
        expected = None
    got = _parse_slots_at_once(entries, header, 0)
    assert got is None or got == expected, "the column check accepted what the rule-by-rule check refuses"


def test_a_segment_of_many_tensors_opens_with_every_slot_as_written(shm_dir: Path) -> None:
    specs = [TensorSpec(f"experts.{i}.w", by_name("bfloat16"), (i % 7 + 1, 64)) for i in range(20_000)]
    layout = plan_layout(specs, metadata={"format": "safetensors"})
    path = shm_dir / "many.seg"
    with SegmentWriter.create(path, layout, heartbeat=False):
        pass
    head = path.read_bytes()[:4096]
    assert parse_header(head, file_size=path.stat().st_size).tensor_count == 20_000
    with attach(path, notify=False, timeout=5) as model:
        assert model.names == tuple(s.name for s in specs)
        assert [model.shape(s.name) for s in specs[:50]] == [s.shape for s in specs[:50]]
        assert model.progress().bytes_total == layout.nbytes


def test_state_dict_over_tensors_published_in_batches_gets_each_as_a_view_of_its_slot(shm_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    count = 6_000
    specs = [TensorSpec(f"experts.{i}.w", by_name("float16"), (i % 5 + 1, 8)) for i in range(count)]
    layout = plan_layout(specs, metadata={"format": "safetensors"})
    path = shm_dir / "batches.seg"
    order = list(range(count))
    random.Random(3).shuffle(order)
    with SegmentWriter.create(path, layout) as writer, attach(path, notify=False, timeout=5) as model:
        started = threading.Event()

        def publish() -> None:
            started.wait()
            for start in range(0, count, 500):  # in batches, in an order that is not the file's
                for index in order[start : start + 500]:
                    np.frombuffer(writer.slot(index), dtype=np.float16)[:] = index % 1000
                    writer.mark_ready(index)
            writer.mark_complete()

        thread = threading.Thread(target=publish)
        thread.start()
        started.set()
        state = model.state_dict(timeout=60)
        thread.join()
        assert list(state) == [s.name for s in specs]
        for index in (0, 1, count // 2, count - 1):
            tensor = state[specs[index].name]
            assert tensor.dtype == torch.float16 and tuple(tensor.shape) == specs[index].shape
            assert bool((tensor == index % 1000).all())
            assert tensor.data_ptr() == model.tensor(specs[index].name).data_ptr(), "a view, not a copy"
        assert sorted(model.iter_ready(timeout=5)) == sorted(s.name for s in specs)
