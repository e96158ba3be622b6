"""HTTP(S) sources against a real nginx: exact ranges, keep-alive, ETag checks, redirects, TLS, splice."""

from __future__ import annotations

import array
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from modelload.loader.errors import (
    ConfigError,
    RangeNotSupportedError,
    SourceAccessDeniedError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    TruncatedError,
)
from modelload.sidecar.sources import HttpSettings, HttpSource, SourceSettings, open_source, store_for
from tests.support.fault_proxy import FaultProxy, Respond
from tests.support.nginx import NginxServer

from .conftest import FAST_SETTINGS, payload

DATA = payload(2_500_001, seed=2)
CHUNK = 256 * 1024


@pytest.fixture(scope="module")
def model_url(nginx: NginxServer) -> str:
    return nginx.put("http/model.bin", DATA)


def _read_all(source: HttpSource, *, threads: int = 1, chunk: int = CHUNK) -> bytes:
    out = bytearray(len(DATA))
    offsets = range(0, len(DATA), chunk)

    def read(offset: int) -> None:
        source.read_into(offset, memoryview(out)[offset : offset + chunk])

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, offsets))
    return bytes(out)


def test_ranges_are_byte_exact_including_the_last_partial_one(model_url: str) -> None:
    with open_source(model_url, FAST_SETTINGS) as source:
        assert isinstance(source, HttpSource)
        info = source.stat()
        assert (info.size, info.accepts_ranges) == (len(DATA), True)
        assert info.etag and info.etag.startswith('"')
        assert _read_all(source) == DATA
        assert source.read_bytes(len(DATA) - 1, 1) == DATA[-1:]


def test_a_typed_buffer_is_filled_by_bytes(model_url: str) -> None:
    halves = array.array("H", bytes(20_000))
    with open_source(model_url, FAST_SETTINGS) as source:
        source.read_into(3, memoryview(halves))
    assert halves.tobytes() == DATA[3:20_003]


def test_zero_length_reads_need_no_request_and_past_the_end_fails_before_one(model_url: str) -> None:
    with open_source(model_url, FAST_SETTINGS) as source:
        source.stat()
        source.read_into(len(DATA), memoryview(bytearray(0)))
        with pytest.raises(TruncatedError):
            source.read_bytes(len(DATA) - 10, 11)
        assert source.connections_opened == 1


def test_an_empty_object_has_size_zero(nginx: NginxServer) -> None:
    with open_source(nginx.put("http/empty.bin", b""), FAST_SETTINGS) as source:
        assert source.stat().size == 0
        assert source.read_bytes(0, 0) == b""


def test_eight_threads_share_a_source_with_one_connection_each(
    nginx_proxy: FaultProxy, model_url: str
) -> None:
    with open_source(nginx_proxy.url("http/model.bin"), FAST_SETTINGS) as source:
        source.stat()
        assert _read_all(source, threads=8, chunk=64 * 1024) == DATA
        gets = len(nginx_proxy.requests)
        assert gets == 1 + -(-len(DATA) // (64 * 1024))
        assert nginx_proxy.connections <= 9  # the stat's thread plus one per reader thread
        assert source.connections_opened == nginx_proxy.connections


def test_sequential_reads_reuse_one_connection(nginx_proxy: FaultProxy, model_url: str) -> None:
    with open_source(nginx_proxy.url("http/model.bin"), FAST_SETTINGS) as source:
        _read_all(source)
    assert nginx_proxy.connections == 1
    assert len(nginx_proxy.requests) > 5


def test_a_connection_the_server_closed_while_idle_is_replaced_silently(
    nginx_proxy: FaultProxy, model_url: str
) -> None:
    with open_source(nginx_proxy.url("http/model.bin"), FAST_SETTINGS) as source:
        assert source.read_bytes(0, 10) == DATA[:10]
        nginx_proxy.drop_connections()
        assert source.read_bytes(10, 10) == DATA[10:20]
    assert nginx_proxy.connections == 2


def test_a_missing_url_is_not_found(nginx: NginxServer) -> None:
    with pytest.raises(SourceNotFoundError, match=r"http/absent\.bin does not exist \(HTTP 404"):
        open_source(nginx.url("http/absent.bin"), FAST_SETTINGS).stat()


def test_a_forbidden_url_is_access_denied(nginx: NginxServer) -> None:
    with pytest.raises(SourceAccessDeniedError, match="403"):
        open_source(nginx.url("forbidden/model.bin"), FAST_SETTINGS).stat()


def test_a_file_replaced_during_the_load_fails_as_changed(nginx: NginxServer) -> None:
    url = nginx.put("http/replaced.bin", DATA[:100_000])
    with open_source(url, FAST_SETTINGS) as source:
        source.stat()
        path = nginx.root / "http/replaced.bin"
        path.write_bytes(DATA[1:100_001])
        os.utime(path, (1_000_000, 1_000_000))  # a new mtime: nginx's ETag changes, If-Match fails
        with pytest.raises(SourceChangedError, match="412"):
            source.read_bytes(0, 1000)


def test_a_server_that_ignores_range_fails_clearly_for_partial_reads(
    nginx: NginxServer, model_url: str
) -> None:
    with open_source(nginx.norange_url("http/model.bin"), FAST_SETTINGS) as source:
        info = source.stat()
        assert info.size == len(DATA) and not info.accepts_ranges
        with pytest.raises(RangeNotSupportedError, match=r"ignored the Range header.*--range-fallback"):
            source.read_bytes(100, 10)
        assert source.read_bytes(0, len(DATA)) == DATA  # a whole-object read works anyway


def test_the_single_stream_fallback_reads_any_range_and_warns(
    nginx: NginxServer, model_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = SourceSettings(http=HttpSettings(range_fallback=True))
    with open_source(nginx.norange_url("http/model.bin"), settings) as source:
        assert source.read_bytes(0, 5) == DATA[:5]
        assert source.read_bytes(1_000_000, 70_000) == DATA[1_000_000:1_070_000]
    assert "ignores Range" in caplog.text


def test_redirects_are_followed_once_and_remembered(nginx_proxy: FaultProxy, model_url: str) -> None:
    with open_source(nginx_proxy.url("moved/http/model.bin"), FAST_SETTINGS) as source:
        assert source.display_uri.endswith("/moved/http/model.bin")
        assert source.read_bytes(0, 100) == DATA[:100]
        assert source.read_bytes(200, 100) == DATA[200:300]
    paths = [r.path for r in nginx_proxy.requests]
    assert paths == ["/moved/http/model.bin", "/http/model.bin", "/http/model.bin", "/http/model.bin"]


def test_a_redirect_target_that_stops_accepting_is_asked_for_again_from_the_source_url(
    nginx_proxy: FaultProxy, model_url: str
) -> None:
    """A signed redirect URL (a CDN's, a release download's) expires within minutes; the reads that went
    straight to it then got 403 and the load failed for good, though the source URL gives a fresh one."""
    with open_source(nginx_proxy.url("moved/http/model.bin"), FAST_SETTINGS) as source:
        assert source.read_bytes(0, 100) == DATA[:100]
        nginx_proxy.push(Respond(403), path="/http/model.bin")
        assert source.read_bytes(200, 100) == DATA[200:300]
    paths = [r.path for r in nginx_proxy.requests]
    assert paths[3:] == ["/http/model.bin", "/moved/http/model.bin", "/http/model.bin"]


def test_too_many_redirects_fail_with_the_http_status(nginx: NginxServer, model_url: str) -> None:
    settings = SourceSettings(http=HttpSettings(max_redirects=0))
    with pytest.raises(SourceError, match=r"HTTP 302 Found.*not followed"):
        open_source(nginx.url("moved/http/model.bin"), settings).stat()


def test_credentials_in_the_url_are_sent_as_basic_auth_and_never_shown(
    nginx_proxy: FaultProxy, model_url: str
) -> None:
    url = nginx_proxy.url("http/model.bin").replace("http://", "http://loader:s3cr%40t@")
    with open_source(url, FAST_SETTINGS) as source:
        assert "s3cr" not in source.display_uri and "loader" not in source.display_uri
        assert source.read_bytes(0, 10) == DATA[:10]
    assert nginx_proxy.requests[-1].headers["authorization"] == "Basic bG9hZGVyOnMzY3JAdA=="


def test_presigned_query_strings_are_sent_but_never_shown(nginx_proxy: FaultProxy, model_url: str) -> None:
    url = nginx_proxy.url("http/absent.bin?X-Amz-Signature=deadbeef&X-Amz-Security-Token=tok3n")
    with pytest.raises(SourceNotFoundError) as caught:
        open_source(url, FAST_SETTINGS).stat()
    assert "deadbeef" not in str(caught.value) and "tok3n" not in str(caught.value)
    assert nginx_proxy.requests[-1].path.endswith("X-Amz-Signature=deadbeef&X-Amz-Security-Token=tok3n")


def test_splice_lands_exact_bytes_at_an_offset_of_a_shm_file(model_url: str, shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    with open_source(model_url, FAST_SETTINGS) as source, segment.open("w+b") as handle:
        assert source.supports_fd
        source.read_into_fd(0, 1_000_000, handle.fileno(), 8192)
        source.read_into_fd(1_000_000, len(DATA) - 1_000_000, handle.fileno(), 8192 + 1_000_000)
        source.read_into_fd(5, 0, handle.fileno(), 0)
        handle.seek(0)
        written = handle.read()
    assert written == bytes(8192) + DATA


def test_splice_from_eight_threads_into_one_file(model_url: str, shm_dir: Path) -> None:
    segment = shm_dir / "model.seg"
    chunk = 100_000
    with open_source(model_url, FAST_SETTINGS) as source, segment.open("w+b") as handle:
        fd = handle.fileno()
        with ThreadPoolExecutor(8) as pool:
            list(
                pool.map(
                    lambda off: source.read_into_fd(off, min(chunk, len(DATA) - off), fd, off),
                    range(0, len(DATA), chunk),
                )
            )
        handle.seek(0)
        assert handle.read() == DATA


def _https(nginx: NginxServer) -> None:
    if nginx.tls_port is None:
        pytest.skip("openssl is not installed: no HTTPS server")


def test_https_reads_are_exact_with_the_servers_ca(nginx: NginxServer, model_url: str, shm_dir: Path) -> None:
    _https(nginx)
    settings = SourceSettings(http=HttpSettings(ca_bundle=str(nginx.ca_cert)))
    with open_source(nginx.https_url("http/model.bin"), settings) as source:
        assert not source.supports_fd
        assert _read_all(source, threads=4) == DATA
        with (shm_dir / "tls.seg").open("w+b") as handle:  # no splice over TLS: bounced through a buffer
            source.read_into_fd(10, 2_000_000, handle.fileno(), 0)
            handle.seek(0)
            assert handle.read() == DATA[10:2_000_010]


def test_an_untrusted_certificate_is_a_config_error(nginx: NginxServer, model_url: str) -> None:
    _https(nginx)
    with pytest.raises(ConfigError, match="certificate"):
        open_source(nginx.https_url("http/model.bin"), FAST_SETTINGS).stat()


def test_verification_can_be_turned_off(nginx: NginxServer, model_url: str) -> None:
    _https(nginx)
    settings = SourceSettings(http=HttpSettings(verify_tls=False))
    with open_source(nginx.https_url("http/model.bin"), settings) as source:
        assert source.read_bytes(7, 3) == DATA[7:10]


def test_an_https_source_that_redirects_to_plain_http_is_refused_before_a_byte_is_read_in_clear(
    nginx: NginxServer, model_url: str
) -> None:
    """The weights asked for over TLS are never read in clear (where anything on the way could change them),
    whatever the server redirects to; the http:// URL named as the source is read as asked."""
    _https(nginx)
    settings = SourceSettings(http=HttpSettings(ca_bundle=str(nginx.ca_cert)), retry=FAST_SETTINGS.retry)
    with pytest.raises(
        SourceError, match=r"redirects to http://127\.0\.0\.1:\d+/http/model\.bin, plain HTTP"
    ):
        open_source(nginx.https_url("to-http/http/model.bin"), settings).stat()
    with open_source(nginx.url("http/model.bin"), settings) as source:
        assert source.read_bytes(0, 100) == DATA[:100]


def test_a_closed_port_is_a_transient_error(nginx: NginxServer) -> None:
    from modelload.sidecar.sources import InterruptedReadError
    from tests.support.ports import free_port

    with pytest.raises(InterruptedReadError, match="cannot connect"):
        open_source(f"http://127.0.0.1:{free_port()}/m.bin", FAST_SETTINGS).stat()


def test_a_url_without_a_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="URL"):
        open_source("http:///model.bin")


@pytest.mark.parametrize("store", ["http", "s3"])
def test_the_files_of_one_model_share_a_connection_per_thread_and_close_it_with_the_last(
    store: str, nginx: NginxServer, nginx_proxy: FaultProxy
) -> None:
    # A directory of 160 shards opened a connection per shard and thread: 502 for 666 requests.
    names = [f"shared/model-{i}.bin" for i in range(4)]
    for number, name in enumerate(names):
        nginx.put(name, payload(5_000, seed=number))
    settings, uris = FAST_SETTINGS, [nginx_proxy.url(name) for name in names]
    if store == "s3":
        pytest.importorskip("botocore")
        from modelload.sidecar.sources import S3Settings

        s3 = S3Settings(endpoint_url=nginx_proxy.endpoint, addressing="path", unsigned=True)
        settings = SourceSettings(http=FAST_SETTINGS.http, s3=s3, retry=FAST_SETTINGS.retry)
        uris = [f"s3://{nginx.bucket}/{name}" for name in names]
    open_one = store_for(uris[0]).opener(settings)
    sources = [open_one(uri) for uri in uris]
    for number, source in enumerate(sources):
        assert source.read_bytes(10, 100) == payload(5_000, seed=number)[10:110]
    assert nginx_proxy.connections == 1, "one connection carried every file's requests"
    *others, last = sources
    for source in others:
        source.close()
        with pytest.raises(RuntimeError, match="closed"):
            source.read_bytes(0, 1)
    assert last.read_bytes(0, 5) == payload(5_000, seed=3)[:5], "its siblings' close left it connected"
    assert nginx_proxy.connections == 1
    last.close()
    later = open_one(uris[0])  # after the last close: connections of its own, which the next ones share
    again = open_one(uris[1])
    try:
        assert later.read_bytes(0, 5) == payload(5_000, seed=0)[:5]
        assert again.read_bytes(0, 5) == payload(5_000, seed=1)[:5]
        assert nginx_proxy.connections == 2
    finally:
        later.close()
        again.close()
