"""A mixture-of-experts checkpoint (thousands of tiny tensors in many shards) loads byte-exact from each kind
of source with a request count bounded by its files and bytes, never by its tensor count: at most 4 requests
per file plus 2 per chunk of weights, counted at the server (nginx's access log, a proxy in front of moto) or
around the file source's reads."""

from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.progress import LoadTracker, Observers
from modelload.sidecar.sources import (
    FileSource,
    HttpSettings,
    RetryPolicy,
    S3Settings,
    SourceSettings,
    open_model,
)
from tests.conftest import require
from tests.sidecar import models
from tests.support import hfdir
from tests.support.nginx import NginxServer, find_nginx
from tests.support.waiting import wait_for

CHUNK = 256 << 10
SHARDS = 24
FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=5.0),
    retry=RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=30.0),
)


def moe(seed: int = 0, experts: int = 800) -> dict[str, torch.Tensor]:
    """Embeddings and an output layer of 600 KiB, and between them ``experts`` experts of three tensors of
    256 B to 4 KiB each, as a mixture of experts names them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {"model.embed_tokens.weight": torch.randn(600, 512, generator=generator).bfloat16()}
    for expert in range(experts):
        layer, number = divmod(expert, 100)
        for which in ("gate", "up", "down"):
            size = int(torch.randint(128, 2049, (1,), generator=generator))
            name = f"model.layers.{layer}.mlp.experts.{number}.{which}_proj.weight"
            tensors[name] = torch.randn(size, generator=generator).half()
    tensors["lm_head.weight"] = torch.randn(600, 512, generator=generator).bfloat16()
    return tensors


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return moe()


@pytest.fixture(scope="module")
def content(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return hfdir.files(weights, shards=SHARDS)


def bound(content: dict[str, bytes]) -> int:
    """4 per file the load reads (weights, index, small files) + 2 per chunk of weight bytes."""
    fetched = [name for name in content if name not in hfdir.IGNORED_FILES]
    weight_bytes = sum(len(data) for name, data in content.items() if name.endswith(".safetensors"))
    return 4 * len(fetched) + 2 * -(-weight_bytes // CHUNK)


class Published:
    """Records the tensors published, in order, batch by batch."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.names: list[str] = []
        self._lock = threading.Lock()

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        with self._lock:
            self.order.extend(indices)
            self.names.extend(n for n, size in zip(names, nbytes, strict=True) if size)


def load(source: str, segment: Path, sources: SourceSettings = FAST, **settings: Any) -> Published:
    published = Published()
    engine = Engine(
        LoadSettings(source=source, segment=segment, chunk_size=CHUNK, **settings),
        sources=sources,
        observer=Observers(published, LoadTracker()),
    )
    engine.run()
    return published


def test_a_local_directory_of_thousands_of_tensors_loads_byte_exact_with_few_reads(
    weights: dict[str, torch.Tensor],
    content: dict[str, bytes],
    tmp_path: Path,
    shm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    directory = hfdir.write(tmp_path / "moe", content)
    reads: list[str] = []
    for method in ("_stat_prefix", "read_into_pieces", "read_into_fd_pieces", "read_into_sink"):
        original = getattr(FileSource, method)

        def counted(
            self: FileSource, *args: Any, _original: Any = original, _name: str = method, **kwargs: Any
        ) -> Any:
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(FileSource, method, counted)
    load(str(directory), shm_dir / "moe.seg", readers=4)
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    assert len(weights) > 2000 and len(reads) <= bound(content), (len(reads), bound(content))


def test_the_shards_of_a_directory_share_one_tuple_per_distinct_shape_and_each_tensor_keeps_its_own(
    weights: dict[str, torch.Tensor], content: dict[str, bytes], tmp_path: Path
) -> None:
    # The experts' shapes repeat across shards: one tuple each for the whole model, not one per tensor.
    directory = hfdir.write(tmp_path / "moe", content)
    model = open_model(str(directory), FAST)
    try:
        table = model.index.table
    finally:
        model.close()
    expected = {name: tuple(tensor.shape) for name, tensor in weights.items()}
    assert dict(zip(table.names, table.shapes, strict=True)) == expected
    assert len({id(shape) for shape in table.shapes}) == len(set(table.shapes)) < len(table)


@pytest.mark.parametrize("slots", ["paged", "packed"])
@pytest.mark.parametrize("origin", ["file", "nginx"])
def test_small_tensors_land_through_the_descriptor_a_window_at_a_time_byte_exact(
    origin: str,
    slots: str,
    weights: dict[str, torch.Tensor],
    content: dict[str, bytes],
    tmp_path: Path,
    shm_dir: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through the descriptor, a range of many small tensors goes into the segment file with a ``pwritev`` a
    window, never through the mapping: every tensor byte-exact at its slot, with the CRC-32 its state
    entry records (taken on the way for whole tensors, from the slot for cut ones); in a segment whose slots
    are a page each, and in a packed one (layout version 5), where neighbours in the file are neighbours in
    the segment."""
    import zlib

    from modelload.loader.segment.reader import SegmentReader
    from modelload.sidecar.load import readers

    writes: list[int] = []
    real = os.pwritev

    def counted(fd: int, iovs: Sequence[memoryview], offset: int) -> int:
        writes.append(sum(len(iov) for iov in iovs))
        return real(fd, iovs, offset)

    def through_mapping(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a range of small tensors went through the mapping")

    monkeypatch.setattr(os, "pwritev", counted)
    monkeypatch.setattr(readers, "read_range_pieces", through_mapping)
    if origin == "file":
        source = str(hfdir.write(tmp_path / "moe", content))
    else:
        server, _ = request.getfixturevalue("logged_nginx")
        source = served(server, "window", content)
    load(source, shm_dir / "moe.seg", readers=4, landing="splice", slots=slots)
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    reader = SegmentReader.open(shm_dir / "moe.seg")
    try:
        recorded = {slot.name: reader.crc32(slot.index) for slot in reader.slots}
        assert reader.header.layout_version == (5 if slots == "packed" else 2)
        assert reader.header.alignment == (1 if slots == "packed" else 4096)
        assert not any(slot.offset % max(reader.header.alignment, 2) for slot in reader.slots)  # float16
    finally:
        reader.close()
    assert recorded == {name: zlib.crc32(models.as_bytes(t)) for name, t in weights.items()}
    weight_bytes = sum(len(data) for name, data in content.items() if name.endswith(".safetensors"))
    assert sum(writes) >= sum(t.numel() * t.element_size() for t in weights.values())
    assert len(writes) <= 2 * -(-weight_bytes // CHUNK) + SHARDS, "a few writes a range, not one a tensor"
    assert len(weights) > 10 * len(writes)


@pytest.fixture(scope="module")
def logged_nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NginxServer, Path]]:
    require(find_nginx() is not None, "nginx is not installed (apt-get install nginx-light)")
    root = tmp_path_factory.mktemp("moe-nginx")
    log = root.parent / f"{root.name}-access.log"
    server = NginxServer(root, access_log=log)
    try:
        yield server, log
    finally:
        server.stop()


def served(server: NginxServer, folder: str, content: dict[str, bytes]) -> str:
    """The URL of ``content`` (a model directory's files) put under ``folder`` of ``server``."""
    for name, data in content.items():
        server.put(f"{folder}/{name}", data)
    return server.url(f"{folder}/")


def requests_answered(log: Path, since: int, marker: str) -> tuple[list[str], int]:
    """The log's lines after its first ``since`` bytes and before the line of ``marker``, and how many of
    them answered 404."""
    with log.open("rb") as text:
        text.seek(since)
        lines = text.read().decode(errors="replace").splitlines()
    lines = lines[: next(i for i, line in enumerate(lines) if marker in line)]
    return lines, sum(1 for line in lines if '" 404 ' in line)


def test_a_packed_segment_lands_thousands_of_tensors_through_the_mapping_byte_exact(
    weights: dict[str, torch.Tensor], content: dict[str, bytes], logged_nginx: Any, shm_dir: Path
) -> None:
    # The mapping's scattering reads (huge pages, HTTPS) into slots next to one another, sharing pages.
    from modelload.loader.segment.reader import SegmentReader

    load(
        served(logged_nginx[0], "mapped", content),
        shm_dir / "moe.seg",
        readers=4,
        landing="mapping",
        slots="packed",
    )
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    with SegmentReader.open(shm_dir / "moe.seg") as reader:
        assert reader.header.layout_version == 5


def test_an_http_directory_of_thousands_of_tensors_loads_byte_exact_with_a_bounded_request_count(
    weights: dict[str, torch.Tensor], content: dict[str, bytes], logged_nginx: Any, shm_dir: Path
) -> None:
    server, log = logged_nginx
    source = served(server, "moe", content)
    before = log.stat().st_size if log.exists() else 0
    load(source, shm_dir / "moe.seg", readers=4)
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    # nginx writes a request's log line as its response ends, which may trail the load: one more request,
    # after the load, marks where the load's lines end.
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(server.url("moe/end-of-load"), timeout=10)
    wait_for(lambda: b"end-of-load" in log.read_bytes(), timeout=30, what="nginx's log line of the marker")
    lines, probes = requests_answered(log, before, "end-of-load")
    # An HTTP directory has no listing: each well-known small-file name it may hold is probed once, and
    # the absent ones answer 404 (a fixed cost, whatever the model); every other request counts.
    assert probes <= len(hfdir.SMALL_FILES) + 13
    assert len(lines) - probes <= bound(content), (len(lines), probes, bound(content))
    assert sum(1 for line in lines if ".safetensors " in line) < 6 * SHARDS, "a few requests a shard"


def test_an_s3_prefix_of_thousands_of_tensors_loads_byte_exact_with_a_bounded_request_count(
    weights: dict[str, torch.Tensor],
    content: dict[str, bytes],
    moto_s3: Any,
    moto_proxy: Any,
    aws_env: Any,
    shm_dir: Path,
) -> None:
    for name, data in content.items():
        moto_s3.put("many-tensors", f"moe/{name}", data)
    sources = SourceSettings(
        http=FAST.http, retry=FAST.retry, s3=S3Settings(endpoint_url=moto_proxy.endpoint, addressing="path")
    )
    load("s3://many-tensors/moe/", shm_dir / "moe.seg", sources=sources, readers=4)
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    assert len(moto_proxy.requests) <= bound(content), (len(moto_proxy.requests), bound(content))


def test_priority_tensors_are_published_first_when_ranges_hold_many(
    content: dict[str, bytes], tmp_path: Path, shm_dir: Path
) -> None:
    directory = hfdir.write(tmp_path / "moe", content)
    published = load(str(directory), shm_dir / "moe.seg", readers=1, priority=("lm_head.", "model.layers.3."))
    wanted = [n for n in published.names if n == "lm_head.weight" or n.startswith("model.layers.3.")]
    assert len(wanted) == 1 + 300
    assert published.names[: len(wanted)] == wanted, "every priority tensor before any other"
    assert published.names[0] == "lm_head.weight"


def test_ring_mode_loads_thousands_of_tensors_byte_exact_within_the_ring(
    weights: dict[str, torch.Tensor], content: dict[str, bytes], tmp_path: Path, shm_dir: Path
) -> None:
    from modelload.loader import attach

    directory = hfdir.write(tmp_path / "moe", content)
    segment = shm_dir / "ring.seg"
    ring = 4 * CHUNK
    assert sum(t.numel() * t.element_size() for t in weights.values()) > 4 * ring
    errors: list[BaseException] = []

    def run() -> None:
        try:
            load(str(directory), segment, readers=4, memory=MemorySettings(mode="ring", ring_size=ring))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(segment.exists, timeout=60, what="the ring segment created")
    held: list[int] = []
    copies: dict[str, bytes] = {}
    with attach(segment, timeout=30, notify=False) as model:
        for name in model.iter_ready(timeout=120):
            copies[name] = bytes(model.numpy(name).tobytes())
            model.consumed(name)
            held.append(os.stat(segment).st_blocks * 512)
    thread.join(60)
    assert not errors, errors
    assert copies == {name: models.as_bytes(t) for name, t in weights.items()}
    control = 3 * 4096 + 4096 * -(-len(weights) * 32 // 4096) + 4096 * -(-(len(weights) * 150) // 4096)
    assert max(held) <= ring + control + 4096, "the volume never holds more than the ring and the tables"


def test_a_hub_repository_of_thousands_of_tensors_is_proved_by_each_shards_digest(
    weights: dict[str, torch.Tensor],
    content: dict[str, bytes],
    hub: Any,
    shm_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The digest of a shard is taken over the pieces of each chunk in file order: thousands of tensors in
    a few hundred ranges prove every shard, and one flipped byte in one shard fails the load."""
    import hashlib
    import logging

    from modelload.loader.errors import HashMismatchError
    from modelload.sidecar.sources import HubSettings

    sources = SourceSettings(http=FAST.http, retry=FAST.retry, hub=HubSettings(endpoint=hub.url))
    hub.commit("org/moe", content)
    caplog.set_level(logging.INFO)
    load("hf://org/moe", shm_dir / "moe.seg", sources=sources, readers=4)
    models.assert_segment_matches(shm_dir / "moe.seg", weights)
    proved = [r.getMessage() for r in caplog.records if "matches its sha256 digest" in r.getMessage()]
    assert len(proved) == sum(name.endswith(".safetensors") for name in content), proved

    shard = next(name for name in content if name.endswith(".safetensors"))
    hub.cdn.corrupt.add(hashlib.sha256(content[shard]).hexdigest())
    with pytest.raises(HashMismatchError):
        load("hf://org/moe", shm_dir / "bad.seg", sources=sources, readers=4)
