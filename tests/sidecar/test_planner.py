"""The load plan as arithmetic: which ranges are fetched, where each byte lands, in which order."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from modelload.loader.dtypes import by_name
from modelload.loader.errors import ConfigError
from modelload.loader.formats import ModelIndex, TensorEntry, merge_indexes
from modelload.sidecar.planner import LoadPlan, load_order, plan_load
from tests.support.counting import CountingName

KIB = 1 << 10


def index_of(sizes: list[int], *, start: int = 64, header: int = 0, name: str = "t") -> ModelIndex:
    """A file whose tensors follow each other from ``start``: uint8 tensors of ``sizes`` bytes, each record
    ``header`` bytes of header then its data (a tensorizer record; 0 for safetensors)."""
    tensors, at = [], start
    for i, size in enumerate(sizes):
        tensors.append(TensorEntry(f"{name}{i}", by_name("uint8"), (size,), at, at + header, size))
        at += header + size
    fmt = "tensorizer" if header else "safetensors"
    return ModelIndex(format=fmt, version=1, tensors=tuple(tensors), index_length=start, data_end=at)


def covered(plan: LoadPlan) -> dict[int, list[tuple[int, int, int]]]:
    """Per tensor, the ``(source offset, segment offset, length)`` of its pieces, in load order."""
    pieces = plan.pieces
    found: dict[int, list[tuple[int, int, int]]] = {}
    for i in range(len(pieces)):
        found.setdefault(int(pieces.tensor[i]), []).append(
            (int(pieces.src[i]), int(pieces.dst[i]), int(pieces.length[i]))
        )
    return found


def check_every_byte_once(plan: LoadPlan) -> None:
    """Every tensor's record is fetched exactly once and lands at its slot (header in the lead before it)."""
    pieces = covered(plan)
    for i, entry in enumerate(plan.index.tensors):
        header = entry.data_offset - entry.record_offset
        got = sorted(pieces.get(i, []))
        length = header + entry.data_length
        if not length:
            assert not got and plan.chunk_counts[i] == 0
            continue
        assert got[0][0] == entry.record_offset
        assert got[0][1] == plan.layout.slots[i].offset - header
        at = entry.record_offset
        for src, dst, size in got:  # contiguous in the file and in the segment
            assert src == at and dst - got[0][1] == src - entry.record_offset
            at += size
        assert at == entry.record_offset + length
        assert plan.chunk_counts[i] == len(got)


def check_chunks(plan: LoadPlan, chunk_size: int) -> None:
    """A chunk is one range of one file: its pieces follow each other in the file, within the chunk size
    (a big tensor's first piece may add its record header), their segment span within it too."""
    pieces = plan.pieces
    for seq, chunk in enumerate(plan.chunks):
        span = slice(chunk.first, chunk.first + chunk.count)
        src, length, dst = pieces.src[span], pieces.length[span], pieces.dst[span]
        assert (pieces.chunk[span] == seq).all()
        assert src[0] == chunk.src_offset and dst[0] == chunk.dst_offset
        assert (src[1:] == src[:-1] + length[:-1]).all(), "the pieces are one range of the file"
        assert chunk.length == int(length.sum()) and chunk.data_bytes == int(pieces.data[span].sum())
        header = int(length[0] - pieces.data[chunk.first])
        assert chunk.length <= chunk_size + header
        assert {plan.index.tensors[int(t)].file for t in pieces.tensor[span]} == {chunk.file}


def test_neighbouring_small_tensors_share_ranges_up_to_the_chunk_size() -> None:
    index = index_of([3000, 5000, 100, 9000, 4096, 7] * 50)
    plan = plan_load(index, chunk_size=64 * KIB)
    check_every_byte_once(plan)
    check_chunks(plan, 64 * KIB)
    total = sum(t.data_length for t in index.tensors)
    assert len(plan.chunks) <= -(-total // (64 * KIB)) * 2, "about one request per chunk of bytes"
    assert len(plan.chunks) < len(index.tensors) // 10


def test_a_tensor_larger_than_a_chunk_is_cut_and_its_neighbours_still_share() -> None:
    index = index_of([100, 200, 300 * KIB, 50, 60, 70])
    plan = plan_load(index, chunk_size=64 * KIB)
    check_every_byte_once(plan)
    check_chunks(plan, 64 * KIB)
    assert plan.chunk_counts[2] == 5  # 300 KiB in pieces of 64 KiB
    assert [c.count for c in plan.chunks] == [2, 1, 1, 1, 1, 1, 3]


def test_the_last_readers_chunks_are_cut_in_half_so_the_readers_finish_together() -> None:
    index = index_of([3000, 5000, 100, 9000, 4096, 7, 200 * KIB] * 40)
    one = plan_load(index, chunk_size=64 * KIB)
    four = plan_load(index, chunk_size=64 * KIB, readers=4)
    for plan in (one, four):
        check_every_byte_once(plan)
        check_chunks(plan, 64 * KIB)
    assert list(four.order) == list(one.order), "the load order stays"
    total = sum(t.record_length for t in index.tensors)
    lengths = [c.length for c in four.chunks]
    tail = 4 * 64 * KIB  # readers x chunk size, here under a fifth of the model
    assert tail <= total // 5
    at, cut = 0, 0
    for length in lengths:  # every chunk wholly in the last `tail` bytes is at most half a chunk
        if at >= total - tail + 64 * KIB:
            assert length <= 32 * KIB
            cut += 1
        at += length
    assert cut >= 6
    assert max(lengths[: -(tail // (32 * KIB))]) > 32 * KIB, "the rest keeps full chunks"
    assert len(four.chunks) <= len(one.chunks) + tail // (32 * KIB) + 2, "a few more requests only"


def test_a_small_model_cuts_at_most_a_fifth_of_its_bytes_finer() -> None:
    index = index_of([40 * KIB] * 20)  # 800 KiB: 16 readers x 64 KiB would be all of it
    plan = plan_load(index, chunk_size=64 * KIB, readers=16)
    check_every_byte_once(plan)
    fine = [c for c in plan.chunks if c.length <= 32 * KIB]
    assert 0 < sum(c.length for c in fine) <= 800 * KIB // 5


def test_a_tensorizer_header_lands_in_the_lead_and_counts_as_no_data() -> None:
    index = index_of([10, 20 * KIB, 5 * KIB], header=300)
    plan = plan_load(index, chunk_size=16 * KIB)
    check_every_byte_once(plan)
    assert sum(c.data_bytes for c in plan.chunks) == sum(t.data_length for t in index.tensors)
    assert sum(c.length for c in plan.chunks) == sum(t.record_length for t in index.tensors)


def test_ranges_never_cross_files_or_gaps() -> None:
    first, second = index_of([1000] * 20, name="a"), index_of([1000] * 20, name="b")
    merged = merge_indexes([("a.safetensors", first), ("b.safetensors", second)], where="dir/")
    plan = plan_load(merged, chunk_size=1 << 20)
    check_every_byte_once(plan)
    assert len(plan.chunks) == 2 and {c.file for c in plan.chunks} == {0, 1}
    gapped = index_of([100, 100, 100])
    entries = list(gapped.tensors)
    moved = entries[2]
    entries[2] = TensorEntry(moved.name, moved.dtype, moved.shape, moved.record_offset + 8,
                             moved.data_offset + 8, moved.data_length)  # fmt: skip
    plan = plan_load(ModelIndex("safetensors", 1, tuple(entries), 64, 400), chunk_size=1 << 20)
    assert [c.count for c in plan.chunks] == [2, 1], "bytes between two records are never fetched"


def test_priority_tensors_come_first_and_file_order_follows() -> None:
    index = index_of([1000] * 30)
    plan = plan_load(index, chunk_size=4 * KIB, priority=["t20", "t5"])
    check_every_byte_once(plan)
    first_tensors = [int(t) for c in plan.chunks for t in plan.tensors_of(c)]
    assert first_tensors[:2] == [20, 5]
    assert first_tensors[2:] == [i for i in range(30) if i not in (20, 5)]
    assert list(plan.order[:2]) == [20, 5]


def test_a_priority_prefix_takes_its_tensors_in_file_order_and_a_later_entry_only_what_is_left() -> None:
    index = index_of([10] * 30)
    order = load_order(index, ["t2", "t1", "t21", "t0"])
    assert order[:23] == (2, *range(20, 30), 1, *range(10, 20), 0)
    assert order[23:] == tuple(range(3, 10))
    assert sorted(order) == list(range(30))
    with pytest.raises(ConfigError, match="priority entry 't3x' matches no tensor name or prefix"):
        load_order(index, ["t1", "t3x"])


def test_a_long_priority_list_against_many_tensors_costs_no_product_of_the_two() -> None:
    count, entries = 5000, 1000  # ModelLoads allow 4,096 entries; mixtures of experts carry 100,000 tensors
    names = [CountingName(f"model.layers.{i}.mlp.experts.weight") for i in range(count)]
    index = SimpleNamespace(tensors=names, table=SimpleNamespace(names=names))
    priority = [f"model.layers.{count - 1 - i}." for i in range(entries)]  # each matches one, near the end
    CountingName.calls = 0
    order = load_order(index, priority)  # type: ignore[arg-type]
    assert order[:entries] == tuple(range(count - 1, count - 1 - entries, -1))
    # Each entry against every name made 5,000,000 comparisons; the sorted names' look-ups about 100,000.
    assert CountingName.calls < 20 * (count + entries)


def test_a_span_limit_keeps_every_chunk_inside_it() -> None:
    index = index_of([1000] * 200)  # each tensor takes a 4 KiB slot: the segment span grows 4x the bytes
    plan = plan_load(index, chunk_size=1 << 20, span_limit=64 * KIB)
    check_every_byte_once(plan)
    for chunk in plan.chunks:
        last = chunk.first + chunk.count - 1
        assert int(plan.pieces.dst[last] + plan.pieces.length[last]) - chunk.dst_offset <= 64 * KIB


def test_empty_tensors_have_no_chunk() -> None:
    index = index_of([100, 0, 100, 0])
    plan = plan_load(index, chunk_size=64 * KIB)
    check_every_byte_once(plan)
    assert list(plan.chunk_counts) == [1, 0, 1, 0]


def test_cut_per_tensor_and_reordered_plans_land_the_same_bytes() -> None:
    index = index_of([3000, 200 * KIB, 40, 40, 40])
    plan = plan_load(index, chunk_size=64 * KIB)
    cut = plan.per_tensor()
    check_every_byte_once(cut)
    assert all(c.count == 1 for c in cut.chunks) and len(cut.chunks) == len(cut.pieces)
    assert list(cut.chunk_counts) == list(plan.chunk_counts)
    reordered = cut.reordered(list(reversed(cut.chunks)))
    check_every_byte_once(reordered)
    for seq, chunk in enumerate(reordered.chunks):
        assert (reordered.pieces.chunk[chunk.first : chunk.first + chunk.count] == seq).all()
    with pytest.raises(ValueError, match="same chunks"):
        cut.reordered(cut.chunks[1:])


def test_a_reordered_plan_takes_its_own_chunks_only_each_once() -> None:
    plan = plan_load(index_of([3000, 200 * KIB, 40, 40, 40]), chunk_size=64 * KIB)
    chunks = list(plan.chunks)
    twice = [chunks[0], *chunks[:-1]]  # as many chunks, one of them twice, one missing
    lookalike = [dataclasses.replace(chunks[0]), *chunks[1:]]  # an equal chunk that is not the plan's
    for wrong in (twice, lookalike, [*chunks, chunks[0]]):
        with pytest.raises(ValueError, match="same chunks"):
            plan.reordered(wrong)
    moved = plan.reordered([*chunks[2:], *chunks[:2]])
    owners = [moved.chunks[seq] for seq in moved.pieces.chunk.tolist()]
    assert all(c.first <= i < c.first + c.count for i, c in enumerate(owners)), "each piece names its chunk"


def test_each_tensors_chunks_are_those_that_hold_its_pieces_in_their_order() -> None:
    # A big tensor cut in several chunks, small ones sharing one, empty ones in none: per tensor, what a
    # piece-by-piece walk finds, in the cut plan too and after a reorder.
    index = index_of([3000, 300 * KIB, 0, 40, 40, 100 * KIB, 0])
    plan = plan_load(index, chunk_size=64 * KIB)
    cut = plan.per_tensor()
    for each in (plan, cut, cut.reordered(list(reversed(cut.chunks)))):
        expected: list[list[Any]] = [[] for _ in index.tensors]
        for tensor, chunk in zip(each.pieces.tensor.tolist(), each.pieces.chunk.tolist(), strict=True):
            expected[tensor].append(each.chunks[chunk])
        assert [list(group) for group in each.chunks_by_tensor] == expected
        assert all(a is b for got, want in zip(each.chunks_by_tensor, expected, strict=True)
                   for a, b in zip(got, want, strict=True))  # fmt: skip
    assert [len(group) for group in cut.chunks_by_tensor] == list(plan.chunk_counts)


def test_a_plan_of_many_tensors_is_arrays_not_objects() -> None:
    index = index_of([2000 + i % 7 for i in range(20_000)])
    plan = plan_load(index, chunk_size=1 << 20)
    check_chunks(plan, 1 << 20)
    assert len(plan.chunks) < 200
    for column in (plan.pieces.tensor, plan.pieces.src, plan.pieces.dst, plan.chunk_counts, plan.order):
        assert isinstance(column, np.ndarray)


def test_the_record_columns_are_each_tensors_record() -> None:
    # Tensorizer-like records (a header before each tensor's data), a meta tensor (no data in the file) and
    # a tensor larger than a chunk: the columns say what record() says of each.
    entries = [
        TensorEntry("a", by_name("float32"), (10,), 64, 64 + 120, 40),
        TensorEntry("meta", by_name("float32"), (300,), 224, 224 + 90, 0),
        TensorEntry("big", by_name("uint8"), (100 * KIB,), 314, 314 + 200, 100 * KIB),
    ]
    index = ModelIndex(format="tensorizer", version=4, tensors=tuple(entries), index_length=64,
                       data_end=514 + 100 * KIB)  # fmt: skip
    plan = plan_load(index, chunk_size=32 * KIB)
    starts, lengths = plan.footprints()
    records = [plan.record(i) for i in range(len(entries))]
    assert plan.headers.tolist() == [r.header for r in records] == [120, 90, 200]
    assert list(zip(starts.tolist(), lengths.tolist(), strict=True)) == [r.footprint for r in records]
