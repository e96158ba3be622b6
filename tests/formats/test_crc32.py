"""The package's one CRC-32: zlib's value for every size and buffer shape, and the GIL kept for the few-KiB
buffers a mixture of experts is made of (each ``crc32`` call of ISA-L or zlib lets it go above 5 KiB)."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

from modelload.loader.formats.tensorizer import hashes
from modelload.loader.formats.tensorizer.hashes import crc32, crc32_bytes

SIZES = [0, 1, 5119, 5120, 5121, 8192, 10241, 65536, 65537, 1 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_the_crc_is_zlibs_for_every_size_continued_or_not(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for start in (0, 0xDEADBEEF):
        assert crc32(data, start) == zlib.crc32(data, start)
        assert crc32(memoryview(data), start) == zlib.crc32(data, start)
        assert crc32(bytearray(data), start) == zlib.crc32(data, start)


@pytest.mark.parametrize("size", SIZES)
def test_the_byte_view_crc_is_the_same_crc_in_the_same_slices(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.random.default_rng(size + 1).integers(0, 256, size + 3, dtype=np.uint8).tobytes()
    view = memoryview(data)[3:]  # a slice of a reader's buffer, not at its start
    lengths: list[list[int]] = [[], []]
    for which, function in enumerate((crc32, crc32_bytes)):

        def recorded(part: memoryview, value: int = 0, into: list[int] = lengths[which]) -> int:
            into.append(memoryview(part).nbytes)
            return zlib.crc32(part, value)

        monkeypatch.setattr(hashes, "_crc32", recorded)
        for start in (0, 0xDEADBEEF):
            assert function(view, start) == zlib.crc32(data[3:], start)
    assert lengths[0] == lengths[1]


def test_a_typed_or_shaped_buffer_is_taken_as_its_bytes() -> None:
    array = np.random.default_rng(1).standard_normal((40, 50)).astype(np.float32)  # 8,000 bytes, 2-D
    assert crc32(array) == zlib.crc32(array.tobytes())
    assert crc32(memoryview(array)) == zlib.crc32(array.tobytes())


def test_small_buffers_go_in_slices_that_keep_the_gil_and_large_ones_in_one_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lengths: list[int] = []

    def recorded(data: memoryview, value: int = 0) -> int:
        lengths.append(memoryview(data).nbytes)
        return zlib.crc32(data, value)

    monkeypatch.setattr(hashes, "_crc32", recorded)
    crc32(bytes(12 << 10))
    assert lengths == [5 << 10, 5 << 10, 2 << 10]
    lengths.clear()
    crc32(bytes(1 << 20))
    assert lengths == [1 << 20]


@pytest.mark.parametrize(
    "first, second", [(0, 0), (0, 7), (7, 0), (1, 1), (5120, 3), (100_000, (1 << 20) + 5), (3, 1 << 22)]
)
def test_two_crcs_combine_into_the_crc_of_their_buffers_one_after_the_other(first: int, second: int) -> None:
    rng = np.random.default_rng(first * 7 + second)
    a = rng.integers(0, 256, first, dtype=np.uint8).tobytes()
    b = rng.integers(0, 256, second, dtype=np.uint8).tobytes()
    assert hashes.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_the_pieces_of_a_tensor_combine_in_order_into_its_crc_whatever_their_sizes() -> None:
    data = np.random.default_rng(9).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    cuts = [0, 1, 4096, 1 << 20, (1 << 20) + 3, 3 << 20]
    whole = zlib.crc32(data[: cuts[1]])
    for low, high in itertools.pairwise(cuts[1:]):
        whole = hashes.crc32_combine(whole, zlib.crc32(data[low:high]), high - low)
    assert whole == zlib.crc32(data)
    swapped = hashes.crc32_combine(zlib.crc32(data[4096:8192]), zlib.crc32(data[:4096]), 4096)
    assert swapped != zlib.crc32(data[:8192]), "the order of the pieces counts"
