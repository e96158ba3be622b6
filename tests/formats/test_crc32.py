"""The package's one CRC-32: zlib's value for every size and buffer shape, and the GIL kept for the few-KiB
buffers a mixture of experts is made of (each ``crc32`` call of ISA-L or zlib lets it go above 5 KiB)."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from modelload.loader.formats.tensorizer import hashes
from modelload.loader.formats.tensorizer.hashes import crc32

SIZES = [0, 1, 5119, 5120, 5121, 8192, 10241, 65536, 65537, 1 << 20]


@pytest.mark.parametrize("size", SIZES)
def test_the_crc_is_zlibs_for_every_size_continued_or_not(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for start in (0, 0xDEADBEEF):
        assert crc32(data, start) == zlib.crc32(data, start)
        assert crc32(memoryview(data), start) == zlib.crc32(data, start)
        assert crc32(bytearray(data), start) == zlib.crc32(data, start)


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
