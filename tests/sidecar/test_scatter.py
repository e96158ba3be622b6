"""A range of many small tensors lands through the segment's file descriptor with a ``pwritev`` a window:
each piece at its slot, the padding between neighbouring slots written as zeros in the same call, nothing
written where another piece might be, and each piece's CRC-32 taken on the way."""

from __future__ import annotations

import itertools
import os
import zlib
from pathlib import Path

import pytest

from modelload.loader.errors import SegmentSpaceError
from modelload.sidecar.load import scatter
from modelload.sidecar.load.scatter import ChunkScatter
from modelload.sidecar.planner import plan_load
from tests.sidecar.test_planner import index_of
from tests.sources.conftest import payload

SIZES = [4096, 6000, 1, 12_288, 10_000, 4097, 700]
"""Pieces of one range, in turn; each goes to its own 4096-aligned slot."""
FILL = 0xA5


def slots(base: int = 8192) -> list[int]:
    out, at = [], base
    for size in SIZES:
        out.append(at)
        at = -(-(at + size) // 4096) * 4096
    return out


def segment_file(path: Path, length: int = 1 << 17) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.pwrite(fd, bytes([FILL]) * length, 0)  # not zeros: what the sink wrote shows
    return fd


def pwritev_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each ``pwritev`` the sink makes from now on, as (its buffer count, its offset)."""
    calls: list[tuple[int, int]] = []
    real = os.pwritev

    def counted(fd: int, iovs: list[memoryview], offset: int) -> int:
        calls.append((len(iovs), offset))
        return real(fd, iovs, offset)

    monkeypatch.setattr(scatter.os, "pwritev", counted)
    return calls


def feed(sink: ChunkScatter, data: bytes, cuts: list[int]) -> None:
    """Hand ``data`` to ``sink`` in the pieces between ``cuts``, as a source's windows would."""
    edges = [0, *cuts, len(data)]
    for low, high in itertools.pairwise(edges):
        sink(memoryview(data)[low:high], low)


@pytest.mark.parametrize("cuts", [[], [1], [5000, 5001, 20_000], list(range(997, sum(SIZES), 997))])
def test_every_piece_lands_at_its_slot_and_the_padding_between_neighbours_is_zeros(
    cuts: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(sum(SIZES), seed=3)
    fd = segment_file(tmp_path / "segment")
    calls = pwritev_calls(monkeypatch)
    at = slots()
    sink = ChunkScatter(fd, dst=at, length=SIZES, joined=[True] * len(SIZES), hashed=[True] * len(SIZES))
    try:
        feed(sink, data, cuts)
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    start = 0
    for place, size in zip(at, SIZES, strict=True):
        assert landed[place : place + size] == data[start : start + size], f"the piece at {place}"
        start += size
    end = at[-1] + SIZES[-1]
    assert landed[: at[0]] == bytes([FILL]) * at[0], "nothing written before the first piece"
    assert landed[end:] == bytes([FILL]) * (len(landed) - end), "nothing written after the last piece"
    padding = [landed[a + n : b] for a, n, b in zip(at, SIZES, at[1:], strict=False)]
    assert all(gap == bytes(len(gap)) for gap in padding), "the padding between neighbours is zeros"
    assert len(calls) == len(cuts) + 1, "one pwritev a window"
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    expected = [zlib.crc32(data[s : s + n]) for s, n in zip(starts, SIZES, strict=True)]
    assert sink.crc_column().tolist() == expected


def test_a_gap_that_is_not_known_padding_is_never_written(tmp_path: Path) -> None:
    data = payload(sum(SIZES), seed=4)
    fd = segment_file(tmp_path / "segment")
    at = slots()
    joined = [True, False, True, True, False, True, True]  # after pieces 1 and 4: another tensor's slot
    hashed = [True, True, False, True, True, True, False]  # pieces 2 and 6: not to be hashed
    sink = ChunkScatter(fd, dst=at, length=SIZES, joined=joined, hashed=hashed)
    try:
        feed(sink, data, [3000])
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    for i in (1, 4):
        gap = landed[at[i] + SIZES[i] : at[i + 1]]
        assert gap == bytes([FILL]) * len(gap), f"the gap after piece {i} is left alone"
    for i in (0, 2, 3, 5):
        gap = landed[at[i] + SIZES[i] : at[i + 1]]
        assert gap == bytes(len(gap)), f"the padding after piece {i} is zeros"
    crcs = sink.crc_column().tolist()
    assert crcs[2] == -1 and crcs[6] == -1, "no CRC-32 for a piece not to be hashed"
    assert crcs[3] == zlib.crc32(data[sum(SIZES[:3]) : sum(SIZES[:4])])


def test_bytes_sent_again_after_a_resume_are_written_and_hashed_once(tmp_path: Path) -> None:
    data = payload(sum(SIZES), seed=5)
    fd = segment_file(tmp_path / "segment")
    at = slots()
    sink = ChunkScatter(fd, dst=at, length=SIZES, joined=[True] * len(SIZES), hashed=[True] * len(SIZES))
    try:
        sink(memoryview(data)[:9000], 0)
        sink(memoryview(data)[7000:], 7000)  # a source that resumed early: 2,000 bytes again
        with pytest.raises(ValueError, match="came before"):
            sink(memoryview(data)[:10], len(data) + 5)
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    assert landed[at[1] : at[1] + SIZES[1]] == data[4096 : 4096 + SIZES[1]]
    assert sink.crc_column()[1] == zlib.crc32(data[4096 : 4096 + SIZES[1]])


def test_the_crcs_wait_for_the_whole_range(tmp_path: Path) -> None:
    fd = segment_file(tmp_path / "segment")
    try:
        sink = ChunkScatter(fd, dst=slots(), length=SIZES, joined=[True] * 7, hashed=[True] * 7)
        sink(memoryview(payload(100, seed=1)), 0)
        with pytest.raises(RuntimeError, match="not all in"):
            sink.crc_column()
    finally:
        os.close(fd)


def test_a_full_volume_is_a_segment_space_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(fd: int, iovs: list[memoryview], offset: int) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(scatter.os, "pwritev", full)
    fd = segment_file(tmp_path / "segment")
    try:
        sink = ChunkScatter(fd, dst=slots(), length=SIZES, joined=[True] * 7, hashed=[True] * 7)
        with pytest.raises(SegmentSpaceError, match="no room left"):
            sink(memoryview(payload(sum(SIZES), seed=1)), 0)
    finally:
        os.close(fd)


def test_a_short_write_goes_on_from_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.pwritev

    def short(fd: int, iovs: list[memoryview], offset: int) -> int:
        total = sum(len(iov) for iov in iovs)
        if total <= 777:
            return real(fd, iovs, offset)
        first = bytearray(777)  # only the first 777 bytes, as a write cut by a signal
        at = 0
        for iov in iovs:
            take = min(len(iov), 777 - at)
            first[at : at + take] = iov[:take]
            at += take
            if at == 777:
                break
        return os.pwrite(fd, first, offset)

    monkeypatch.setattr(scatter.os, "pwritev", short)
    data = payload(sum(SIZES), seed=6)
    fd = segment_file(tmp_path / "segment")
    at = slots()
    try:
        sink = ChunkScatter(fd, dst=at, length=SIZES, joined=[True] * 7, hashed=[True] * 7)
        sink(memoryview(data), 0)
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    start = 0
    for place, size in zip(at, SIZES, strict=True):
        assert landed[place : place + size] == data[start : start + size]
        start += size


@pytest.mark.parametrize("cuts", [[], [1], [4096, 4097, 20_000], list(range(997, sum(SIZES), 997))])
def test_a_packed_chunk_is_one_write_a_window_whatever_its_tensor_count(
    cuts: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = payload(sum(SIZES), seed=8)
    fd = segment_file(tmp_path / "segment")
    calls = pwritev_calls(monkeypatch)
    base = 8192 + 3  # each slot right after the one before it, as a packed segment lays them out
    at = [base + sum(SIZES[:i]) for i in range(len(SIZES))]
    hashed = [True, True, True, False, True, True, True]
    sink = ChunkScatter(fd, dst=at, length=SIZES, joined=[True] * 7, hashed=hashed, contiguous=True)
    try:
        feed(sink, data, cuts)
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    edges = [0, *cuts]
    assert calls == [(1, base + edge) for edge in edges], "one buffer a window, at its place"
    assert landed[base : base + len(data)] == data
    assert landed[:base] == bytes([FILL]) * base and set(landed[base + len(data) :]) == {FILL}
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    wholes = [zlib.crc32(data[s : s + n]) for s, n in zip(starts, SIZES, strict=True)]
    expected = [crc if h else -1 for crc, h in zip(wholes, hashed, strict=True)]
    assert sink.crc_column().tolist() == expected


def test_a_packed_chunk_resumed_early_is_written_and_hashed_once(tmp_path: Path) -> None:
    data = payload(sum(SIZES), seed=9)
    fd = segment_file(tmp_path / "segment")
    at = [4096 + sum(SIZES[:i]) for i in range(len(SIZES))]
    sink = ChunkScatter(fd, dst=at, length=SIZES, joined=[True] * 7, hashed=[True] * 7, contiguous=True)
    try:
        sink(memoryview(data)[:9000], 0)
        sink(memoryview(data)[7000:], 7000)
        landed = os.pread(fd, 1 << 17, 0)
    finally:
        os.close(fd)
    assert landed[4096 : 4096 + len(data)] == data
    starts = [sum(SIZES[:i]) for i in range(len(SIZES))]
    wholes = [zlib.crc32(data[s : s + n]) for s, n in zip(starts, SIZES, strict=True)]
    assert sink.crc_column().tolist() == wholes


@pytest.mark.parametrize("packed", [True, False])
def test_only_a_packed_plans_chunks_are_written_as_one_buffer(packed: bool) -> None:
    plan = plan_load(index_of([3000, 5000, 8, 4096, 12_000] * 40), chunk_size=32 << 10, packed=packed)
    neighbours = scatter.Neighbours(plan)
    flags = [neighbours.sink(chunk, fd=-1)._contiguous for chunk in plan.chunks]
    pieces = plan.pieces
    touching = [
        all(
            pieces.dst[i] + pieces.length[i] == pieces.dst[i + 1]
            for i in range(chunk.first, chunk.first + chunk.count - 1)
        )
        for chunk in plan.chunks
    ]
    assert len(flags) > 1 and flags == touching
    assert all(flags) if packed else not all(flags)


@pytest.mark.parametrize("seed", range(6))
def test_any_windows_give_each_piece_its_crc_in_both_paths(seed: int, tmp_path: Path) -> None:
    import random

    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 7, 4096, 5121, 9000, 70_000]) for _ in range(40)]
    data = payload(sum(sizes), seed=seed)
    cuts = sorted(rng.sample(range(1, len(data)), 25))
    starts = list(itertools.accumulate([0, *sizes[:-1]]))
    hashed = [rng.random() < 0.8 for _ in sizes]
    expected = [
        zlib.crc32(data[s : s + n]) if h else -1 for s, n, h in zip(starts, sizes, hashed, strict=True)
    ]
    for contiguous in (True, False):
        fd = segment_file(tmp_path / f"segment-{contiguous}", length=len(data) + 8192)
        at = [4096 + s for s in starts]
        try:
            sink = ChunkScatter(
                fd, dst=at, length=sizes, joined=[True] * 40, hashed=hashed, contiguous=contiguous
            )
            feed(sink, data, cuts)
            assert os.pread(fd, len(data), 4096) == data
        finally:
            os.close(fd)
        assert sink.crc_column().tolist() == expected, f"contiguous={contiguous}"
