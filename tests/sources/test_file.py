"""Local files: positional reads straight into the buffer, change detection, and splice into /dev/shm."""

from __future__ import annotations

import array
import errno
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from modelload.loader.errors import (
    ConfigError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceNotFoundError,
    TruncatedError,
)
from modelload.sidecar.sources import FileSource, InterruptedReadError, open_source, read_range_into_fd
from modelload.sidecar.sources._file import _translate

from .conftest import FAST_RETRY, payload

DATA = payload(1_000_003, seed=1)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "model.bin"
    path.write_bytes(DATA)
    return path


def test_ranges_are_byte_exact_including_the_last_partial_one(model: Path) -> None:
    chunk = 65536
    with open_source(str(model)) as source:
        assert source.stat().size == len(DATA)
        out = bytearray(len(DATA))
        for offset in range(0, len(DATA), chunk):
            view = memoryview(out)[offset : offset + chunk]
            source.read_into(offset, view)
    assert out == DATA


def test_zero_length_reads_at_the_end_succeed_and_past_the_end_fail(model: Path) -> None:
    with open_source(str(model)) as source:
        source.read_into(len(DATA), memoryview(bytearray(0)))
        with pytest.raises(TruncatedError, match="past the end"):
            source.read_bytes(len(DATA) - 1, 2)


def test_small_reads_are_exact_and_a_short_read_is_never_taken_as_whole(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_source(str(model)) as source:
        for offset, length in [(0, 8), (0, 512 << 10), (999_000, 1003), (len(DATA), 0)]:
            assert source.read_bytes(offset, length) == DATA[offset : offset + length]
        real = os.pread
        monkeypatch.setattr(os, "pread", lambda fd, n, at: real(fd, max(n // 2, 0), at))  # cut short
        assert source.read_bytes(100, 70_000) == DATA[100:70_100]


def test_eight_threads_read_one_source_concurrently(model: Path) -> None:
    out = bytearray(len(DATA))
    chunk = 40_000
    with open_source(str(model)) as source, ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda off: source.read_into(off, memoryview(out)[off : off + chunk]),
                range(0, len(DATA), chunk),
            )
        )
    assert out == DATA


def test_a_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match=r"no file at .*nothing\.bin"):
        open_source(str(tmp_path / "nothing.bin"))


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises((ConfigError, SourceNotFoundError), match=r"directory|not a regular file"):
        open_source(str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_access_denied(model: Path) -> None:
    model.chmod(0)
    with pytest.raises(SourceAccessDeniedError, match="permission"):
        open_source(str(model))


def test_a_file_rewritten_during_the_load_fails_as_changed(model: Path) -> None:
    with open_source(str(model)) as source:
        source.stat()
        with model.open("r+b") as handle:
            handle.write(b"X")
        os.utime(model, ns=(0, 1))
        with pytest.raises(SourceChangedError, match="changed"):
            source.read_bytes(0, 10)


def test_a_file_uri_with_a_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="local path"):
        open_source("file://server/share/model.bin")


def test_splice_lands_exact_bytes_at_an_offset_of_a_shm_file(model: Path, shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    with open_source(str(model)) as source, segment.open("w+b") as handle:
        assert isinstance(source, FileSource) and source.supports_fd
        fd = handle.fileno()
        source.read_into_fd(10, 500_000, fd, 4096)
        read_range_into_fd(source, 500_010, len(DATA) - 500_010, fd, 4096 + 500_000, policy=FAST_RETRY)
        handle.seek(0)
        written = handle.read()
    assert written[:4096] == bytes(4096)
    assert written[4096:] == DATA[10:]


@pytest.mark.parametrize(
    ("number", "error"),
    [
        (errno.ENOENT, SourceNotFoundError),
        (errno.EACCES, SourceAccessDeniedError),
        (errno.EPERM, SourceAccessDeniedError),
        (errno.EIO, InterruptedReadError),
    ],
)
def test_os_errors_map_to_what_the_caller_does_next(number: int, error: type[Exception]) -> None:
    # Root reads any file, so EACCES is pinned here at the translation boundary as well.
    result = _translate(OSError(number, os.strerror(number)), "/models/m.bin", "read", landed=7)
    assert type(result) is error
    assert "/models/m.bin" in str(result)
    if isinstance(result, InterruptedReadError):
        assert result.landed == 7


def test_buffers_of_any_item_type_count_bytes(model: Path) -> None:
    words = array.array("I", bytes(4000))  # 1000 four-byte items
    with open_source(str(model)) as source:
        source.read_into(8, memoryview(words))
        assert words.tobytes() == DATA[8:4008]
        with pytest.raises(TypeError, match="read-only"):
            source.read_into(0, memoryview(b"immutable"))
