"""One range, several destinations: a chunk of neighbouring tensors lands each tensor at its own slot from
one request (HTTP, S3 through nginx) or one system call (files); a look-up brings the first bytes with it;
the samples of a file come back in one multi-range request where the server answers one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from modelload.loader.errors import SourceChangedError
from modelload.sidecar.sources import (
    FileSource,
    HttpSource,
    open_source,
    read_range_into_sink,
    read_range_pieces,
    read_range_pieces_into_fd,
    stat_with_prefix,
    window_size,
)
from modelload.sidecar.sources._base import SMALLEST_WINDOW, WINDOW, WINDOWS
from modelload.sidecar.sources._responses import parse_byteranges
from tests.support.fault_proxy import FaultProxy, Reset
from tests.support.memory_source import Interrupt, MemorySource
from tests.support.nginx import NginxServer

from .conftest import FAST_SETTINGS, payload

DATA = payload(300_001, seed=7)
SIZES = [1, 4095, 4096, 7000, 100, 50_000, 3, 100_000]  # pieces of one range, in turn


def places(base: int = 0) -> list[tuple[int, int]]:
    """Each piece at its own 4096-aligned place, gaps between them (as slots in a segment)."""
    out, at = [], base
    for size in SIZES:
        out.append((at, size))
        at = -(-(at + size + 1) // 4096) * 4096
    return out


def scattered(buffer: bytearray, start: int) -> bytes:
    return b"".join(bytes(buffer[at : at + size]) for at, size in places(start))


def expected(offset: int) -> bytes:
    return DATA[offset : offset + sum(SIZES)]


@pytest.fixture(scope="module")
def url(nginx: NginxServer) -> str:
    return nginx.put("pieces/model.bin", DATA)


def test_one_request_lands_every_piece_at_its_place(
    nginx_proxy: FaultProxy, nginx: NginxServer, url: str
) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    source.stat()
    before = len(nginx_proxy.requests)
    out = bytearray(600_000)
    views = [memoryview(out)[at : at + size] for at, size in places()]
    read_range_pieces(source, 123, views, policy=FAST_SETTINGS.retry)
    assert scattered(out, 0) == expected(123)
    assert len(nginx_proxy.requests) - before == 1
    assert out[1:4096] == bytes(4095), "the gaps between the places are left alone"


def test_a_broken_stream_resumes_in_the_piece_where_it_broke(nginx_proxy: FaultProxy) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    source.stat()
    nginx_proxy.push(Reset(after=20_000))  # inside the sixth piece
    out = bytearray(600_000)
    read_range_pieces(
        source, 5, [memoryview(out)[at : at + size] for at, size in places()], policy=FAST_SETTINGS.retry
    )
    assert scattered(out, 0) == expected(5)
    assert nginx_proxy.ranges()[-1][0] == 5 + 20_000, "the retry asks only for the rest"


def test_pieces_spliced_into_a_file_from_one_response(nginx_proxy: FaultProxy, tmp_path: Path) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    source.stat()
    before = len(nginx_proxy.requests)
    fd = os.open(tmp_path / "segment", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        read_range_pieces_into_fd(source, 77, fd, places(8192), policy=FAST_SETTINGS.retry)
        landed = bytearray(os.pread(fd, 700_000, 0))
    finally:
        os.close(fd)
    assert scattered(landed, 8192) == expected(77)
    assert len(nginx_proxy.requests) - before == 1


@pytest.mark.parametrize("into_fd", [False, True])
def test_a_file_scatters_one_range_with_its_size_and_mtime_checked_around_it(
    into_fd: bool, tmp_path: Path
) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(DATA)
    with FileSource(str(path)) as source:
        assert source.every_read_validated, "a file's reads prove its version: no samples, no end look-up"
        if into_fd:
            fd = os.open(tmp_path / "segment", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                read_range_pieces_into_fd(source, 9, fd, places(4096), policy=FAST_SETTINGS.retry)
                landed = bytearray(os.pread(fd, 700_000, 0))
            finally:
                os.close(fd)
            assert scattered(landed, 4096) == expected(9)
        else:
            out = bytearray(600_000)
            read_range_pieces(
                source, 9, [memoryview(out)[a : a + n] for a, n in places()], policy=FAST_SETTINGS.retry
            )
            assert scattered(out, 0) == expected(9)


def test_a_source_of_another_shape_lands_pieces_from_one_read_of_its_own() -> None:
    source = MemorySource(DATA, faults=[Interrupt(landed=9_000), None])
    out = bytearray(600_000)
    read_range_pieces(
        source, 11, [memoryview(out)[a : a + n] for a, n in places()], policy=FAST_SETTINGS.retry
    )
    assert scattered(out, 0) == expected(11)
    assert source.calls == [(11, sum(SIZES)), (11 + 9_000, sum(SIZES) - 9_000)], "one read, resumed once"


class Collected:
    """A sink that keeps what it is handed, checking the bytes come in order."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.calls = 0

    def __call__(self, data: memoryview, at: int) -> None:
        assert at == len(self.data), f"bytes from {at} after {len(self.data)}"
        self.data += data
        self.calls += 1


def test_a_range_streams_to_a_sink_a_window_at_a_time_from_one_request(
    nginx_proxy: FaultProxy, nginx: NginxServer
) -> None:
    from modelload.sidecar.sources._base import WINDOW

    data = payload(3 * WINDOW + 12_345, seed=11)
    nginx.put("pieces/window.bin", data)
    source = HttpSource(nginx_proxy.url("pieces/window.bin"), FAST_SETTINGS.http)
    source.stat()
    before = len(nginx_proxy.requests)
    sink = Collected()
    read_range_into_sink(source, 99, len(data) - 99, sink, policy=FAST_SETTINGS.retry)
    assert bytes(sink.data) == data[99:]
    assert len(nginx_proxy.requests) - before == 1
    assert sink.calls == 4, "a window at a time"


def test_the_windows_of_more_readers_are_smaller_so_that_together_they_hold_no_more() -> None:
    assert window_size(1) == window_size(8) == WINDOW
    assert window_size(16) == 512 << 10
    for readers in (9, 12, 16, 24, 32):
        size = window_size(readers)
        assert size % 4096 == 0 and readers * size <= WINDOWS
    assert window_size(1000) == SMALLEST_WINDOW, "never below a batch of the socket's low-water mark"


@pytest.mark.parametrize("origin", ["http", "file"])
def test_a_range_reaches_a_sink_in_windows_of_the_size_asked_for(
    origin: str, nginx: NginxServer, tmp_path: Path
) -> None:
    size = window_size(32)
    data = payload(3 * size + 777, seed=12)
    if origin == "http":
        nginx.put("pieces/windows.bin", data)
        source: HttpSource | FileSource = HttpSource(nginx.url("pieces/windows.bin"), FAST_SETTINGS.http)
    else:
        (tmp_path / "windows.bin").write_bytes(data)
        source = FileSource(str(tmp_path / "windows.bin"))
    sizes: list[int] = []

    def sink(view: memoryview, at: int) -> None:
        assert view == data[at : at + len(view)]
        sizes.append(len(view))

    with source:
        read_range_into_sink(source, 0, len(data), sink, policy=FAST_SETTINGS.retry, window=size)
        assert sizes == [size, size, size, 777]
        read_range_into_sink(source, 0, len(data), sink, policy=FAST_SETTINGS.retry)
        assert sizes[4:] == [len(data)], "the default window is the largest"


def test_a_broken_stream_hands_over_what_came_and_resumes_at_the_byte_where_it_broke(
    nginx_proxy: FaultProxy,
) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    source.stat()
    nginx_proxy.push(Reset(after=20_000))
    sink = Collected()
    read_range_into_sink(source, 5, 250_000, sink, policy=FAST_SETTINGS.retry)
    assert bytes(sink.data) == DATA[5:250_005]
    assert nginx_proxy.ranges()[-1][0] == 5 + 20_000, "the retry asks only for the rest"


def test_a_file_streams_to_a_sink_with_its_size_and_mtime_checked_around_it(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(DATA)
    sink = Collected()
    with FileSource(str(path)) as source:
        read_range_into_sink(source, 9, 290_000, sink, policy=FAST_SETTINGS.retry)
        assert bytes(sink.data) == DATA[9:290_009]
        os.utime(path, ns=(1, 1))  # the file changed under the load: refused, not mixed in
        with pytest.raises(SourceChangedError):
            read_range_into_sink(source, 0, 10, Collected(), policy=FAST_SETTINGS.retry)


def test_a_source_of_another_shape_streams_to_a_sink_from_one_read_of_its_own() -> None:
    source = MemorySource(DATA, faults=[Interrupt(landed=9_000), None])
    sink = Collected()
    read_range_into_sink(source, 3, 100_000, sink, policy=FAST_SETTINGS.retry)
    assert bytes(sink.data) == DATA[3:100_003]
    assert source.calls == [(3, 100_000), (9_003, 91_000)], "the retry resumes after what the sink had"


def test_a_look_up_brings_the_first_bytes_in_the_same_request(nginx_proxy: FaultProxy) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    info, head = stat_with_prefix(source, 65_536, policy=FAST_SETTINGS.retry)
    assert (info.size, head) == (len(DATA), DATA[:65_536])
    assert len(nginx_proxy.requests) == 1 and nginx_proxy.requests[0].range == (0, 65_535)
    assert source.stat() == info, "the look-up is the source's cached stat"
    small = HttpSource(nginx_proxy.url("pieces/small.bin"), FAST_SETTINGS.http)
    nginx_proxy.push()  # nothing scripted: what the server answers
    assert stat_with_prefix(small, 1 << 20, policy=FAST_SETTINGS.retry)[1] == SMALL


SMALL = b"a small file, asked for with a range past its end"


@pytest.fixture(autouse=True, scope="module")
def small_file(nginx: NginxServer) -> None:
    nginx.put("pieces/small.bin", SMALL)


def test_several_samples_come_back_in_one_multi_range_request(
    nginx_proxy: FaultProxy, nginx: NginxServer
) -> None:
    source = HttpSource(nginx_proxy.url("pieces/model.bin"), FAST_SETTINGS.http)
    source.stat()
    ranges = [(0, 10), (4096, 4096), (299_990, 11), (1000, 1)]
    got = source.read_ranges(ranges)
    assert got == [DATA[o : o + n] for o, n in ranges]
    assert len(nginx_proxy.requests) == 2
    ignoring = open_source(nginx.norange_url("pieces/model.bin"), FAST_SETTINGS)
    assert isinstance(ignoring, HttpSource)
    assert ignoring.read_ranges(ranges) is None, "a server that answers 200 leaves the samples to one by one"


def test_a_multipart_body_is_parsed_only_when_every_part_is_whole() -> None:
    body = (
        b"\r\n--B\r\nContent-Type: application/octet-stream\r\nContent-Range: bytes 0-2/10\r\n\r\nabc"
        b"\r\n--B\r\nContent-Range: bytes 5-6/10\r\n\r\nfg\r\n--B--\r\n"
    )
    assert parse_byteranges("multipart/byteranges; boundary=B", body) == {(0, 2): b"abc", (5, 6): b"fg"}
    assert parse_byteranges("application/octet-stream", body) is None
    assert parse_byteranges("multipart/byteranges; boundary=B", body.replace(b"fg\r\n", b"f\r\n")) is None
    assert parse_byteranges("multipart/byteranges", body) is None
