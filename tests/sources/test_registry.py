"""open_source picks a backend by scheme; the memory source behaves like a real one."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError, SourceChangedError, SourceNotFoundError, TruncatedError
from modelload.sidecar.sources import (
    FileSource,
    HttpSource,
    ObjectInfo,
    S3Source,
    Source,
    SourceBase,
    SourceSettings,
    open_source,
    register_source,
    registered_schemes,
)
from tests.support.memory_source import (
    MemorySource,
    put_memory_object,
    register_memory_scheme,
    remove_memory_object,
)


def test_builtin_schemes_are_registered() -> None:
    assert {"file", "http", "https", "s3"} <= set(registered_schemes())


def test_production_registers_no_in_memory_scheme() -> None:
    import subprocess
    import sys

    code = "from modelload.sidecar.sources import registered_schemes; print(','.join(registered_schemes()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().split(",") == ["file", "http", "https", "s3"]


def test_plain_paths_and_file_uris_open_file_sources(tmp_path: Path) -> None:
    path = tmp_path / "model bin"
    path.write_bytes(b"abc")
    for uri in (str(path), f"file://{str(path).replace(' ', '%20')}", f"file://localhost{path}"):
        with open_source(uri) as source:
            assert isinstance(source, FileSource)
            assert source.read_bytes(1, 2) == b"bc"


def test_http_and_s3_uris_open_without_network_io(aws_env: object) -> None:
    http = open_source("http://127.0.0.1:9/m.bin")  # port 9 (discard) is closed: nothing may connect yet
    assert isinstance(http, HttpSource)
    s3 = open_source("s3://bucket/key.bin", SourceSettings())
    assert isinstance(s3, S3Source)
    assert s3.display_uri == "s3://bucket/key.bin"
    assert isinstance(s3, Source)


def test_an_unknown_scheme_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"gs://.*file://, http://"):
        open_source("gs://bucket/key")


def test_a_registered_factory_serves_its_scheme() -> None:
    seen: list[str] = []

    def factory(uri: str, settings: SourceSettings) -> Source:
        seen.append(uri)
        return MemorySource(b"xyz", name=uri)

    register_source("test-scheme", factory)
    source = open_source("test-scheme://thing")
    assert seen == ["test-scheme://thing"]
    assert source.read_bytes(0, 3) == b"xyz"
    with pytest.raises(ConfigError):
        register_source("Bad Scheme", factory)


def test_memory_uris_open_published_objects() -> None:
    register_memory_scheme()
    uri = put_memory_object("test-object", b"0123456789")
    try:
        assert open_source(uri).read_bytes(3, 4) == b"3456"
    finally:
        remove_memory_object("test-object")
    with pytest.raises(SourceNotFoundError, match="test-object"):
        open_source(uri)


def test_memory_source_reports_size_and_checks_ranges() -> None:
    source = MemorySource(b"0123456789")
    assert source.stat() == ObjectInfo(size=10, etag='"v1"', accepts_ranges=True)
    assert source.read_bytes(10, 0) == b""
    with pytest.raises(TruncatedError, match=r"\[8, 12\)"):
        source.read_bytes(8, 4)
    with pytest.raises(ValueError, match="non-negative"):
        source.read_bytes(-1, 2)


def test_a_replaced_memory_object_fails_as_changed() -> None:
    source = MemorySource(b"0123456789")
    source.stat()
    source.replace(b"abcdefghij")
    with pytest.raises(SourceChangedError):
        source.read_bytes(0, 1)


def test_reads_after_close_fail_and_context_managers_close() -> None:
    with MemorySource(b"ab") as source:
        assert isinstance(source, SourceBase)
    assert "MemorySource" in repr(source)
