"""open_source picks a backend by scheme; the memory source behaves like a real one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from modelload.loader.errors import ConfigError, SourceChangedError, SourceNotFoundError, TruncatedError
from modelload.sidecar.sources import (
    Directory,
    FileSource,
    HttpSource,
    ListedFile,
    ObjectInfo,
    Opener,
    S3Source,
    Source,
    SourceBase,
    SourceSettings,
    Store,
    is_directory,
    list_directory,
    open_model,
    open_source,
    register_source,
    register_store,
    registered_schemes,
)
from tests.support import hfdir
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
    assert out.strip().split(",") == ["az", "file", "gs", "hf", "http", "https", "oci", "s3"]


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
    with pytest.raises(ConfigError, match=r"ftp://.*az://, file://, gs://, hf://, http://"):
        open_source("ftp://bucket/key")


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


class _BlobStore(Store):
    """A store whose directory files live under other URIs (as a registry's blobs do), each opened once
    through one shared opener: the shape a new origin implements."""

    schemes = ("blobs",)

    def __init__(self, files: dict[str, bytes]) -> None:
        self.blobs = {f"blobs://sha/{i}": data for i, data in enumerate(files.values())}
        self.names = dict(zip(files, self.blobs, strict=True))
        self.opened: list[str] = []
        self.openers = 0

    def open(self, uri: str, settings: SourceSettings) -> Source:
        self.opened.append(uri)
        return MemorySource(self.blobs[uri], name=uri)

    def list(self, uri: str, settings: SourceSettings, *, files: Sequence[str] = ()) -> Directory:
        listed = {
            name: ListedFile(size=len(self.blobs[blob]), uri=blob, version=f"v-{name}")
            for name, blob in self.names.items()
        }
        directory = Directory(uri, uri, listed)
        return directory.only(files) if files else directory

    def opener(self, settings: SourceSettings) -> Opener:
        self.openers += 1
        return super().opener(settings)


def test_a_registered_store_lists_a_directory_whose_files_live_elsewhere_and_opens_each_once() -> None:
    tensors = {f"layer.{i}.weight": torch.full((64,), float(i)) for i in range(6)}
    files = hfdir.files(tensors, shards=2)
    store = _BlobStore(files)
    register_store(store)
    assert is_directory("blobs://registry/model/")
    model = open_model("blobs://registry/model/", SourceSettings())
    try:
        assert store.openers == 1
        assert sorted(model.weights) == sorted(n for n in files if n.endswith(".safetensors"))
        weights = {name: store.names[name] for name in model.weights}
        assert sorted(store.opened) == sorted(
            {store.names["model.safetensors.index.json"], *weights.values()}
        )
        assert {t.name for t in model.index.tensors} == set(tensors)
    finally:
        model.close()


def test_a_store_that_cannot_list_refuses_a_directory_with_a_clear_message() -> None:
    register_source("single", lambda uri, settings: MemorySource(b"x", name=uri))
    assert not is_directory("single://bucket/dir/")
    with pytest.raises(ConfigError, match="cannot be listed"):
        list_directory("single://bucket/dir/", SourceSettings())


def _imported_after_prepare(uri: str) -> bool:
    """Whether botocore is imported once ``prepare_source(uri)`` ran, in a fresh interpreter."""
    import subprocess
    import sys

    code = (
        "import sys; from modelload.sidecar.sources import prepare_source; "
        f"prepare_source({uri!r}); print('botocore.session' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip() == "True"


def test_an_s3_source_has_botocore_imported_when_the_sidecar_starts_and_a_file_source_does_not(
    tmp_path: Path,
) -> None:
    assert _imported_after_prepare("s3://bucket/model.safetensors")
    assert not _imported_after_prepare(str(tmp_path / "model.safetensors"))
