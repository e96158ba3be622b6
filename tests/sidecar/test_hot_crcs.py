"""Each tensor's CRC-32 taken as its bytes land through the segment's mapping (``load/hot_crcs.py``).

The watcher is fed the parts of the segment a receive has just filled; it must give a piece's CRC only when
it saw every byte of the range land once and in order, and nothing otherwise (the finisher then reads the
slot again). The loads below go through real nginx, into a segment landed through its mapping (a 4 KiB tmpfs
with the landing forced, and hugetlbfs), with a broken stream among them: every recorded CRC equals the
slot's, and none had to be taken a second time.
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.loader.segment import SegmentReader
from modelload.loader.segment import finish as finish_module
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.load.hot_crcs import LandedCrcs
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from modelload.sidecar.sources._http import HttpObject
from tests.sidecar import models
from tests.support.fault_proxy import Reset, Stall
from tests.support.hugepages import hugetlbfs, hugetlbfs_volume

__all__ = ["hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0),
)
PASS = Stall(after=0, seconds=0.0)


def _pieces(memory: bytearray, lengths: list[int], gap: int = 4096) -> list[memoryview]:
    """Views of ``memory`` of ``lengths`` bytes, ``gap`` bytes apart (slots with padding between them)."""
    views, at = [], 0
    for length in lengths:
        views.append(memoryview(memory)[at : at + length])
        at += length + gap
    return views


def _fill(views: list[memoryview], payload: bytes, step: int, watcher: LandedCrcs) -> None:
    """Land ``payload`` across ``views`` in order, ``step`` bytes a receive, telling the watcher each part."""
    at = 0
    for view in views:
        done = 0
        while done < len(view):
            part = view[done : done + step]
            part[:] = payload[at : at + len(part)]
            watcher(part)
            done += len(part)
            at += len(part)


def test_each_whole_piece_gets_the_crc_of_the_bytes_that_landed_in_it() -> None:
    lengths = [100_000, 0, 3, 70_001]
    payload = bytes(range(256)) * 700
    memory = bytearray(sum(lengths) + 4096 * len(lengths))
    views = _pieces(memory, lengths)
    watcher = LandedCrcs(views, [True, True, True, False])
    _fill(views, payload, 65_536, watcher)
    column = watcher.crc_column().tolist()
    assert column[0] == zlib.crc32(views[0]) and column[2] == zlib.crc32(views[2])
    assert column[1] == zlib.crc32(b""), "an empty piece is whole: its CRC is that of nothing"
    assert column[3] == -1, "a piece that is not its tensor's whole slot gets none"


def test_a_range_received_in_small_parts_is_left_to_the_finisher() -> None:
    # A receive over TLS brings one record (16 KiB at most): a CRC per record costs three times the pass
    # the finisher makes over the slot once the range is in.
    memory = bytearray(4 << 20)
    views = [memoryview(memory)]
    watcher = LandedCrcs(views, [True])
    _fill(views, bytes(range(256)) * 4096 * 4, 16_384, watcher)
    assert watcher.crc_column().tolist() == [-1]
    watcher = LandedCrcs(views, [True])
    _fill(views, bytes(range(256)) * 4096 * 4, 262_144, watcher)
    assert watcher.crc_column().tolist() == [zlib.crc32(memory)], "big receives are hashed as they land"


@pytest.mark.parametrize("fault", ["skipped", "again", "short", "elsewhere"])
def test_bytes_out_of_order_again_missing_or_elsewhere_give_no_crc_at_all(fault: str) -> None:
    lengths = [50_000, 50_000]
    memory = bytearray(120_000)
    views = _pieces(memory, lengths)
    other = memoryview(bytearray(50_000))
    watcher = LandedCrcs(views, [True, True])
    watcher(views[0][:20_000])
    if fault == "skipped":  # a gap: bytes 20,000-29,999 never reported
        watcher(views[0][30_000:])
        watcher(views[1])
    elif fault == "again":  # a retry that went back over bytes already counted
        watcher(views[0][10_000:])
        watcher(views[1])
    elif fault == "short":
        watcher(views[0][20_000:])
        watcher(views[1][:-1])
    else:  # bytes that landed somewhere that is not the next piece
        watcher(views[0][20_000:])
        watcher(other)
        watcher(views[1])
    assert watcher.crc_column().tolist() == [-1, -1]


def test_a_read_only_view_is_never_trusted() -> None:
    memory = bytearray(10_000)
    watcher = LandedCrcs([memoryview(memory)], [True])
    watcher(memoryview(memory).toreadonly())  # the same bytes, at the same address, but read-only
    assert watcher.crc_column().tolist() == [-1]
    watcher = LandedCrcs([memoryview(memory).toreadonly()], [True])
    watcher(memoryview(memory))
    assert watcher.crc_column().tolist() == [-1], "pieces it cannot place are never trusted either"


def _tensors(seed: int, count: int, rows: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of ``rows`` x 256 and up (each at least 64 KiB: big enough to be watched)."""
    generator = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(rows + i, 256, generator=generator) for i in range(count)}


def _load(source: str, segment: Path, **settings: Any) -> None:
    tracker = LoadTracker()
    settings = {"readers": 3, "chunk_size": 1 << 20, "landing": "mapping", **settings}
    Engine(LoadSettings(source=source, segment=segment, **settings), sources=FAST, observer=tracker).run()
    assert tracker.snapshot().phase == "complete"


def _assert_crcs_recorded_right(segment: Path) -> int:
    """Every tensor's recorded CRC-32 is its slot's; returns how many tensors have one."""
    with SegmentReader.open(segment) as reader:
        recorded = 0
        for slot in reader.slots:
            crc = reader.crc32(slot.index)
            assert crc is not None, f"tensor {slot.index} has no CRC recorded"
            assert crc == zlib.crc32(reader.view(slot.index)), f"tensor {slot.index}'s CRC is not its slot's"
            recorded += 1
    return recorded


@pytest.fixture
def counted_crcs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes of each CRC the finisher takes itself, reading a slot again after it landed."""
    taken: list[int] = []
    crc32_of = finish_module.crc32_of

    def counting(data: Any, value: int = 0) -> int:
        taken.append(len(data))
        return crc32_of(data, value)

    monkeypatch.setattr(finish_module, "crc32_of", counting)
    return taken


@pytest.mark.parametrize("volume", ["tmpfs", "hugetlbfs"])
def test_a_safetensors_load_through_the_mapping_records_each_crc_as_it_lands(
    volume: str, nginx: Any, shm_dir: Path, request: pytest.FixtureRequest, counted_crcs: list[int]
) -> None:
    folder = shm_dir if volume == "tmpfs" else request.getfixturevalue("hugetlbfs")
    tensors = _tensors(41, count=12, rows=64)
    url = nginx.put(f"landed-{volume}.safetensors", models.safetensors_bytes(tensors))
    _load(url, folder / "model.seg")
    models.assert_segment_matches(folder / "model.seg", tensors)
    assert _assert_crcs_recorded_right(folder / "model.seg") == len(tensors)
    assert sum(counted_crcs) == 0, "every CRC was taken as its bytes landed, none read back from the segment"


def test_over_https_the_crcs_come_from_the_slots_a_record_at_a_time_being_too_small_to_hash(
    nginx: Any, shm_dir: Path, counted_crcs: list[int]
) -> None:
    if nginx.ca_cert is None:
        pytest.skip("openssl is not installed: nginx serves no HTTPS")
    tensors = _tensors(49, count=4, rows=1024)
    nginx.put("landed-tls.safetensors", models.safetensors_bytes(tensors))
    sources = SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0, ca_bundle=str(nginx.ca_cert))
    )
    settings = LoadSettings(
        source=nginx.https_url("landed-tls.safetensors"), segment=shm_dir / "model.seg", readers=3,
        chunk_size=4 << 20, landing="mapping",
    )  # fmt: skip
    tracker = LoadTracker()
    Engine(settings, sources=sources, observer=tracker).run()
    assert tracker.snapshot().phase == "complete"
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    assert sum(counted_crcs) == sum(t.numel() * 4 for t in tensors.values()), "every slot was read back once"


def test_a_broken_stream_resumed_at_the_byte_still_records_crcs_taken_as_they_landed(
    nginx: Any, nginx_proxy: Any, shm_dir: Path, counted_crcs: list[int]
) -> None:
    tensors = _tensors(42, count=4, rows=1024)
    nginx.put("landed-resume.safetensors", models.safetensors_bytes(tensors))
    # The header (the stat comes with it), then the first data request breaks after 300,000 bytes.
    nginx_proxy.push(PASS, Reset(after=300_000))
    _load(nginx_proxy.url("landed-resume.safetensors"), shm_dir / "model.seg", readers=1, chunk_size=4 << 20)
    ranges = nginx_proxy.ranges()
    assert any(after == (start + 300_000, end) for (start, end), after in itertools.pairwise(ranges)), ranges
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    assert sum(counted_crcs) == 0, "the resumed range went on at the byte: its CRCs were taken as it landed"


def test_a_tensor_cut_across_chunks_through_the_mapping_gets_the_crc_of_its_whole_slot_after_it_is_all_in(
    nginx: Any, shm_dir: Path, counted_crcs: list[int]
) -> None:
    tensors = _tensors(43, count=3, rows=256)
    tensors["big.weight"] = torch.randn(3 << 10, 256, generator=torch.Generator().manual_seed(44))  # 3 MiB
    url = nginx.put("landed-cut.safetensors", models.safetensors_bytes(tensors))
    _load(url, shm_dir / "model.seg", chunk_size=1 << 20)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    big = tensors["big.weight"].numel() * 4
    assert counted_crcs == [big], "only the cut tensor's CRC is read back, over its whole slot, once"


def test_a_source_that_goes_back_over_landed_bytes_leaves_the_crcs_to_the_finisher(
    nginx: Any, nginx_proxy: Any, shm_dir: Path, counted_crcs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = _tensors(45, count=4, rows=1024)
    nginx.put("landed-back.safetensors", models.safetensors_bytes(tensors))
    nginx_proxy.push(PASS, Reset(after=300_000))
    translate = HttpObject._translate

    def going_back(self: HttpObject, exc: BaseException, *, landed: int = 0, **kwargs: Any) -> Any:
        # A source that resumes 5,000 bytes before where its bytes stopped (it lands some of them twice).
        return translate(self, exc, landed=max(landed - 5_000, 0), **kwargs)

    monkeypatch.setattr(HttpObject, "_translate", going_back)
    _load(nginx_proxy.url("landed-back.safetensors"), shm_dir / "model.seg", readers=1, chunk_size=4 << 20)
    ranges = nginx_proxy.ranges()
    assert any(after == (start + 295_000, end) for (start, end), after in itertools.pairwise(ranges)), ranges
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    assert sum(counted_crcs) > 0, "the range that went back had its CRCs taken from the segment"


def _counting_splices(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The bytes each splice of a range into the segment's file carried."""
    from modelload.sidecar.load import readers

    spliced: list[int] = []
    for name in ("read_range_into_fd", "read_range_pieces_into_fd"):
        real = getattr(readers, name)

        def counting(source: Any, offset: int, *args: Any, _real: Any = real, **kwargs: Any) -> None:
            spliced.append(offset)
            _real(source, offset, *args, **kwargs)

        monkeypatch.setattr(readers, name, counting)
    return spliced


def _with_a_cut_tensor(seed: int) -> dict[str, torch.Tensor]:
    tensors = _tensors(seed, count=3, rows=256)
    tensors["big.weight"] = torch.randn(3 << 10, 256, generator=torch.Generator().manual_seed(seed))  # 3 MiB
    return tensors


def test_a_local_file_lands_its_big_tensors_through_a_window_with_every_crc_taken_on_the_way(
    tmp_path: Path, shm_dir: Path, counted_crcs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Spliced, each slot would be read back for its CRC-32: a second pass over every byte of the model.
    spliced = _counting_splices(monkeypatch)
    tensors = _with_a_cut_tensor(47)
    path = tmp_path / "local.safetensors"
    path.write_bytes(models.safetensors_bytes(tensors))
    _load(path.as_uri(), shm_dir / "model.seg", landing="splice")
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    assert spliced == [], "nothing of a local file was spliced"
    assert sum(counted_crcs) == 0, "no slot was read back for its CRC-32"


def test_a_socket_still_splices_its_big_tensors_and_the_slots_give_their_crcs(
    nginx: Any, shm_dir: Path, counted_crcs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # From a socket a splice spares the copy into this process, which costs more than reading the slots back.
    spliced = _counting_splices(monkeypatch)
    tensors = _with_a_cut_tensor(48)
    url = nginx.put("spliced-cut.safetensors", models.safetensors_bytes(tensors))
    _load(url, shm_dir / "model.seg", landing="splice")
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert _assert_crcs_recorded_right(shm_dir / "model.seg") == len(tensors)
    assert len(spliced) >= 3, "the big tensor's three chunks were spliced"
    assert tensors["big.weight"].numel() * 4 in counted_crcs
