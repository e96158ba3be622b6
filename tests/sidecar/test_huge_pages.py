"""The sidecar's engine loading onto huge pages: hugetlbfs and a tmpfs mounted ``huge=always``, for real.

The volumes are the kernel's own (``tests/support/hugepages.py`` sets ``nr_hugepages`` and mounts them as
root; without root these tests skip, and fail under ``make test``). The origins are the real servers: a
local file, nginx, moto's S3. On huge pages the bytes land through the segment's mapping (hugetlbfs takes
nothing else); the same guarantees hold as on the splice path: byte-exact tensors, decryption in place,
resume at the byte after a broken stream, ring mode reusing its pages, and a restarted sidecar that reuses a
complete segment or loads again over a crashed one.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from modelload.loader import attach
from modelload.loader.errors import ConfigError
from modelload.loader.formats import read_index
from modelload.loader.segment import SegmentReader, SegmentWriter, TensorFlags, WriterState
from modelload.loader.segment.pages import volume_of
from modelload.loader.segment.release import resident_bytes
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.load.landing import choose_landing
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.planner import plan_load
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import (
    HttpSettings,
    RetryPolicy,
    S3Settings,
    SourceSettings,
    open_source,
)
from tests.sidecar import models
from tests.support.fault_proxy import Reset, Stall
from tests.support.hugepages import (
    HUGE_PAGE,
    huge_tmpfs,
    huge_tmpfs_volume,
    hugetlbfs,
    hugetlbfs_volume,
    mounted,
)
from tests.support.ports import free_port
from tests.support.processes import start_sidecar, stop_sidecar
from tests.support.sidecars import BackgroundLoad
from tests.support.waiting import wait_for

__all__ = ["huge_tmpfs", "huge_tmpfs_volume", "hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0),
)
VOLUMES = ["hugetlbfs", "huge_tmpfs"]
MAPPING = "landing through the segment's mapping"
PASS = Stall(after=0, seconds=0.0)
"""A fault that changes nothing: queue it to let a request through."""


def load(source: str, segment: Path, *, sources: SourceSettings = FAST, **settings: Any) -> LoadTracker:
    tracker = LoadTracker()
    settings = {"readers": 3, "chunk_size": 64 << 10, **settings}
    Engine(LoadSettings(source=source, segment=segment, **settings), sources=sources, observer=tracker).run()
    return tracker


def _s3(endpoint: str) -> SourceSettings:
    return SourceSettings(
        s3=S3Settings(endpoint_url=endpoint, addressing="path"), http=FAST.http, retry=FAST.retry
    )


@pytest.mark.parametrize("volume", VOLUMES)
@pytest.mark.parametrize("origin", ["file", "http", "s3"])
def test_a_model_lands_byte_exact_on_huge_pages_from_every_origin_through_the_mapping(
    volume: str,
    origin: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder: Path = request.getfixturevalue(volume)
    tensors = models.state_dict(seed=21)
    data = models.tensorizer_bytes(tensors)
    sources = FAST
    if origin == "file":
        source = str(tmp_path / "model.tensors")
        Path(source).write_bytes(data)
    elif origin == "http":
        source = request.getfixturevalue("nginx").put(f"huge-{volume}.tensors", data)
    else:
        request.getfixturevalue("aws_env")
        moto = request.getfixturevalue("moto_s3")
        source = moto.put("huge-pages", f"{volume}/model.tensors", data)
        sources = _s3(moto.endpoint)
    segment = folder / "model.seg"
    with caplog.at_level(logging.INFO, logger="modelload.sidecar.load.landing"):
        tracker = load(source, segment, sources=sources)
    assert tracker.snapshot().phase == "complete"
    assert any(MAPPING in r.getMessage() for r in caplog.records), "huge pages land through the mapping"
    assert segment.stat().st_size % HUGE_PAGE == 0, "the segment is whole huge pages"
    models.assert_segment_matches(segment, tensors)


def test_an_encrypted_model_is_decrypted_in_place_on_hugetlbfs(
    nginx: Any, hugetlbfs: Path, tmp_path: Path
) -> None:
    tensors = models.state_dict(seed=22, layers=2)
    params = models.password_params("unused")
    url = nginx.put("huge-encrypted.tensors", models.tensorizer_bytes(tensors, encryption=params))
    key_file = models.write_secret(tmp_path, "key", params.key)
    load(url, hugetlbfs / "model.seg", key_file=key_file)
    with SegmentReader.open(hugetlbfs / "model.seg") as reader:
        decrypted = [TensorFlags.DECRYPTED in reader.flags(s.index) for s in reader.slots if s.nbytes]
        assert decrypted and all(decrypted), "every tensor was decrypted in place in the segment"
    models.assert_segment_matches(hugetlbfs / "model.seg", tensors)


def test_a_broken_stream_resumes_at_the_byte_where_it_broke_on_hugetlbfs(
    nginx: Any, nginx_proxy: Any, hugetlbfs: Path
) -> None:
    tensors = models.state_dict(seed=23, width=512, layers=1)  # the big embedding is the first data request
    nginx.put("huge-resume.tensors", models.tensorizer_bytes(tensors))
    nginx_proxy.push(PASS, PASS, Reset(after=30_000))  # the stat, the index, then the first data request
    load(nginx_proxy.url("huge-resume.tensors"), hugetlbfs / "model.seg", readers=1)
    ranges = nginx_proxy.ranges()
    broken, resumed = ranges[2], ranges[3]
    assert resumed == (broken[0] + 30_000, broken[1]), "only the missing tail is asked again"
    models.assert_segment_matches(hugetlbfs / "model.seg", tensors)


def test_splice_cannot_be_forced_onto_hugetlbfs_and_auto_chooses_by_the_volume(
    hugetlbfs: Path, huge_tmpfs: Path, shm_dir: Path, tmp_path: Path
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(models.safetensors_bytes(models.state_dict(seed=24, layers=1)))
    with open_source(str(path), SourceSettings()) as source:
        with pytest.raises(ConfigError, match=r"--landing splice cannot write .*hugetlbfs"):
            choose_landing("splice", hugetlbfs / "model.seg", [source])
        assert not choose_landing("auto", hugetlbfs / "model.seg", [source]).through_fd
        assert not choose_landing("auto", huge_tmpfs / "model.seg", [source]).through_fd
        assert choose_landing("splice", huge_tmpfs / "model.seg", [source]).through_fd, "forced, to compare"
        assert choose_landing("auto", shm_dir / "model.seg", [source]).through_fd, "4 KiB pages: splice"
        assert choose_landing("auto", shm_dir / "model.seg", [source]).page_size == 4096


# --- ring and release ---------------------------------------------------------------------------------------


def _consume(segment: Path) -> tuple[dict[str, bytes], list[int]]:
    copies, resident = {}, []
    with attach(segment, timeout=30, notify=False) as model:
        for name in model.iter_ready():
            copies[name] = bytes(model.numpy(name).tobytes())
            model.consumed(name)
            resident.append(segment.stat().st_blocks * 512)
    return copies, resident


@pytest.mark.parametrize("volume", VOLUMES)
@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_ring_mode_reuses_its_huge_pages_lap_after_lap_byte_exact(
    volume: str, fmt: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    folder: Path = request.getfixturevalue(volume)
    tensors = models.state_dict(seed=25, width=512)
    data = models.tensorizer_bytes(tensors) if fmt == "tensorizer" else models.safetensors_bytes(tensors)
    source = tmp_path / "model.bin"
    source.write_bytes(data)
    ring = 2 * HUGE_PAGE
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert nbytes > 3 * ring, "the model must lap the ring for this test to mean anything"
    segment = folder / "ring.seg"
    memory = MemorySettings(mode="ring", ring_size=ring + 4096, wait_timeout=20)  # rounded up to 3 pages
    load = BackgroundLoad(
        LoadSettings(source=str(source), segment=segment, readers=3, chunk_size=256 << 10, memory=memory),
        sources=FAST,
    )
    copies, resident = _consume(segment)  # attach() waits for the segment to be published
    load.finish()
    assert load.error is None, load.error
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}
    with SegmentReader.open(segment) as reader:
        assert reader.header.ring_size == 3 * HUGE_PAGE and reader.header.data_offset % HUGE_PAGE == 0
        tables = reader.header.data_offset
    assert max(resident) <= tables + 3 * HUGE_PAGE, "the volume never holds more than the tables and the ring"


def test_release_mode_on_hugetlbfs_gives_the_pool_its_pages_back(tmp_path: Path, hugetlbfs: Path) -> None:
    tensors = models.state_dict(seed=26, width=512, layers=4)
    source = tmp_path / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(tensors))
    segment = hugetlbfs / "release.seg"
    load = BackgroundLoad(
        LoadSettings(source=str(source), segment=segment, readers=2, memory=MemorySettings(mode="release")),
        sources=FAST,
    )
    copies, _ = _consume(segment)  # attach() waits for the segment to be published
    load.finish()
    assert load.error is None, load.error
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}
    wait_for(  # only the tables' page (and a shared one) stay
        lambda: resident_bytes_of(segment) <= 2 * HUGE_PAGE, timeout=10, what="the pool's pages given back"
    )


def resident_bytes_of(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_bytes(fd)
    finally:
        os.close(fd)


# --- restarts -----------------------------------------------------------------------------------------------


def test_a_restarted_sidecar_reuses_a_complete_hugetlbfs_segment_without_reading_the_model(
    nginx: Any, nginx_proxy: Any, hugetlbfs: Path
) -> None:
    tensors = models.state_dict(seed=27, layers=2)
    nginx.put("huge-reuse.tensors", models.tensorizer_bytes(tensors))
    url = nginx_proxy.url("huge-reuse.tensors")
    load(url, hugetlbfs / "model.seg")
    with SegmentReader.open(hugetlbfs / "model.seg") as reader:
        load_id = reader.load_id
    before = len(nginx_proxy.requests)
    tracker = load(url, hugetlbfs / "model.seg")
    assert tracker.snapshot().phase == "complete"
    assert len(nginx_proxy.requests) - before <= 1, "only the object's size and ETag are asked for"
    with SegmentReader.open(hugetlbfs / "model.seg") as reader:
        assert reader.load_id == load_id
    models.assert_segment_matches(hugetlbfs / "model.seg", tensors)


def test_a_sidecar_restarted_over_its_crashed_load_makes_room_in_a_volume_sized_for_one_segment(
    nginx: Any, hugetlbfs_volume: Path, tmp_path: Path
) -> None:
    tensors = models.state_dict(seed=28, width=512, layers=2)
    data = models.safetensors_bytes(tensors)
    url = nginx.put("huge-restart.safetensors", data)
    index = read_index(lambda offset, length: data[offset : offset + length])
    layout = plan_load(index, chunk_size=64 << 10, page_size=HUGE_PAGE).layout
    size = layout.segment_length + HUGE_PAGE  # one segment and its consumer-less headroom
    with mounted("hugetlbfs", tmp_path / "one", f"pagesize=2M,size={size}") as volume:
        assert volume_of(volume).kind == "hugetlbfs"
        # The crashed sidecar: a LOADING segment with every page taken and half its tensors in, no writer.
        crashed = SegmentWriter.create(volume / "model.seg", layout, reserve=True, heartbeat=False)
        for slot in layout.slots[: len(layout.slots) // 2]:
            crashed.slot(slot.index)[:] = b"\x01" * slot.nbytes
            crashed.mark_ready(slot.index)
        crashed.close()
        load(url, volume / "model.seg")
        models.assert_segment_matches(volume / "model.seg", tensors)
        # and the writer's lock file, empty on hugetlbfs (no page of the pool)
        assert sorted(p.name for p in volume.iterdir()) == ["model.seg", "model.seg.lock"]
        assert (volume / "model.seg.lock").stat().st_size == 0
        with SegmentReader.open(volume / "model.seg") as reader:
            assert reader.writer_state == WriterState.COMPLETE


def test_torch_tensors_over_a_hugetlbfs_segment_come_without_a_writable_buffer_warning(
    nginx: Any, hugetlbfs: Path
) -> None:
    tensors = models.state_dict(seed=29, layers=1)
    load(nginx.put("huge-torch.safetensors", models.safetensors_bytes(tensors)), hugetlbfs / "model.seg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with attach(hugetlbfs / "model.seg", timeout=5, notify=False) as model:
            state = model.state_dict()
            assert torch.equal(state["layers.0.attn.weight"], tensors["layers.0.attn.weight"])


def test_the_sidecar_command_killed_mid_load_on_hugetlbfs_loads_again_when_restarted(
    nginx: Any, nginx_proxy: Any, hugetlbfs: Path
) -> None:
    tensors = models.state_dict(seed=30, width=512, layers=4)
    nginx.put("huge-killed.safetensors", models.safetensors_bytes(tensors))
    nginx_proxy.always(Stall(after=0, seconds=0.3))  # every request waits: the load takes seconds
    segment = hugetlbfs / "model.seg"
    args = ["--segment", str(segment), "--host", "127.0.0.1", "--chunk-size", "1MiB", "--readers", "1"]
    port = free_port()
    source = ["--source", nginx_proxy.url("huge-killed.safetensors")]
    process = start_sidecar([*source, *args, "--port", str(port)], port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(
            lambda: httpx.get(url + "/status", timeout=5).json()["tensors_ready"] >= 1,
            timeout=30,
            what="a first tensor ready",
        )
    finally:
        process.kill()  # a crash: no SIGTERM, the segment stays LOADING with a dead writer
        process.communicate(timeout=20)
    with SegmentReader.open(segment) as reader:
        assert reader.writer_state == WriterState.LOADING
        crashed = reader.load_id
    port = free_port()
    source = ["--source", nginx.url("huge-killed.safetensors")]
    process = start_sidecar([*source, *args, "--port", str(port)], port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/readyz", timeout=5).status_code == 200, timeout=60, what="ready")
        with SegmentReader.open(segment) as reader:
            assert reader.load_id != crashed and reader.writer_state == WriterState.COMPLETE
        models.assert_segment_matches(segment, tensors)
    finally:
        code, stderr = stop_sidecar(process)
    assert code == 0, stderr
    assert "hugetlbfs" in stderr, "the log says which landing the volume got"
