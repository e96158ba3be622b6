"""Memory modes release and ring, end to end: the engine loads from a real file while a consumer attached with
the loader copies each tensor as it arrives; what the volume holds is read from the file's allocated blocks.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from modelload.loader import attach
from modelload.loader.errors import (
    ConfigError,
    LoadFailedError,
    MemoryWaitError,
    ModelloadError,
    SegmentSpaceError,
)
from modelload.loader.segment import SegmentReader, TensorState, WriterState, consumers
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.metrics import MetricsObserver
from modelload.sidecar.settings import parse_settings
from tests.sidecar import models
from tests.support import fake_gpu
from tests.support.sidecars import BackgroundLoad
from tests.support.waiting import wait_for

CHUNK = 64 << 10
RING = 1 << 20


def _model(tmp_path: Path, fmt: str = "safetensors", **kwargs: Any) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = models.state_dict(**kwargs)
    data = models.tensorizer_bytes(tensors) if fmt == "tensorizer" else models.safetensors_bytes(tensors)
    path = tmp_path / f"model.{fmt}"
    path.write_bytes(data)
    return path, tensors


class Load(BackgroundLoad):
    """The engine in a thread, with a tracker and metrics, as the sidecar runs it."""

    def __init__(
        self, source: Path, segment: Path, memory: MemorySettings, peers: Any = None, **settings: Any
    ) -> None:
        self.metrics = MetricsObserver()
        super().__init__(
            LoadSettings(source=str(source), segment=segment, chunk_size=CHUNK, memory=memory, **settings),
            observers=(self.metrics,),
            peers=peers,
        )

    def memory(self) -> dict[str, Any]:
        """The memory section of the load's status (empty before the first report)."""
        return self.tracker.snapshot().memory or {}


def _consume(segment: Path, *, sample: list[int] | None = None) -> dict[str, bytes]:
    """Attach (waiting for the segment to be published), copy every tensor as it arrives, mark it consumed."""
    copies = {}
    with attach(segment, timeout=30, notify=False) as model:
        for name in model.iter_ready():
            copies[name] = bytes(model.numpy(name).tobytes())
            model.consumed(name)
            if sample is not None:
                sample.append(os.stat(segment).st_blocks * 512)
    return copies


def _resident(segment: Path) -> int:
    return os.stat(segment).st_blocks * 512


@pytest.mark.parametrize(
    ("fmt", "how"),
    [
        ("tensorizer", {}),  # spliced through the descriptor, split where the ring wraps
        ("safetensors", {}),
        ("tensorizer", {"landing": "mapping"}),  # read into the writer's double mapping
        ("safetensors", {"landing": "mapping", "priority": ("layers.5.", "layers.2.mlp.")}),  # not file order
    ],
    ids=["tensorizer", "safetensors", "tensorizer-mapping", "safetensors-mapping-priority"],
)
def test_ring_mode_loads_byte_exact_while_the_volume_never_holds_more_than_the_ring(
    fmt: str, how: dict[str, Any], tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, fmt)
    segment = shm_dir / "ring.seg"
    model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert model_bytes > 3 * RING, "the model must be larger than the ring for this test to mean anything"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), readers=4, **how)
    sample: list[int] = []
    copies = _consume(segment, sample=sample)
    load.finish()
    assert load.error is None
    assert {name: copies[name] for name in tensors} == {
        name: models.as_bytes(t) for name, t in tensors.items()
    }
    control = 3 * 4096 + 4096 * -(-len(tensors) * 32 // 4096)  # header, manifest, state table
    assert max(sample) <= RING + control + 4096
    with SegmentReader.open(segment) as reader:
        data_offset = reader.header.data_offset
        assert os.stat(segment).st_size == data_offset + RING, "the file is the tables and the ring"
        wrapped = [s.name for s in reader.slots if (s.offset - data_offset) % RING + s.nbytes > RING]
        assert wrapped, "some tensor must run past the ring's end for this test to mean anything"
    wait_for(
        lambda: load.memory().get("released_tensors") == len(tensors),
        timeout=10,
        what="every tensor released",
    )
    assert _resident(segment) <= control
    with SegmentReader.open(segment) as reader:
        assert reader.writer_state == WriterState.COMPLETE
        assert {reader.state(i) for i in range(len(reader.slots))} == {TensorState.RELEASED}


def test_a_tensor_a_consumer_holds_keeps_its_bytes_while_the_ring_waits_for_it(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, seed=4)
    segment = shm_dir / "held.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), readers=4)
    held: dict[str, Any] = {}
    copies: dict[str, bytes] = {}
    model = attach(segment, timeout=30, notify=False)

    def consume() -> None:
        for name in model.iter_ready():
            if name == "embed.weight":  # the first in load order: every later lap needs its bytes
                held[name] = model.numpy(name)
                continue
            copies[name] = model.numpy(name).tobytes()
            model.consumed(name)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    wait_for(
        lambda: load.memory().get("waiting") and "embed.weight" in (load.memory().get("waiting_for") or ""),
        timeout=10,
        what="the ring waiting for the held tensor",
    )
    assert load.thread.is_alive() and not model.complete
    # The ring stalls rather than land newer bytes over the held tensor's.
    assert held["embed.weight"].tobytes() == models.as_bytes(tensors["embed.weight"])
    copies["embed.weight"] = held.pop("embed.weight").tobytes()
    model.consumed("embed.weight")
    consumer.join(30)
    load.finish()
    model.close()
    assert load.error is None
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}


def _consume_elsewhere(segment: str, results: Any) -> None:
    results.put({name: hashlib.sha256(data).hexdigest() for name, data in _consume(Path(segment)).items()})


def test_two_consumers_in_two_processes_copy_a_model_larger_than_the_ring_byte_exact(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, "tensorizer", seed=6)
    segment = shm_dir / "two.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING, consumers=2), readers=4)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    other = context.Process(target=_consume_elsewhere, args=(str(segment), results))
    other.start()
    here = _consume(segment)  # the ring waits for both: neither may see a lap the other has not released
    elsewhere = results.get(timeout=60)
    other.join(30)
    load.finish()
    assert load.error is None
    expected = {name: models.as_bytes(t) for name, t in tensors.items()}
    assert here == expected
    assert elsewhere == {name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}


def test_a_meta_tensor_in_a_ring_reads_as_zeros_not_as_an_older_tensor_s_bytes(
    tmp_path: Path, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=8)
    tensors["zeros"] = torch.empty(64 << 10, device="meta")  # landed after the ring has wrapped
    source = tmp_path / "meta.tensorizer"
    source.write_bytes(models.tensorizer_bytes(tensors))
    segment = shm_dir / "meta.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), readers=4)
    copies = _consume(segment)
    load.finish()
    assert load.error is None
    assert copies["zeros"] == bytes(256 << 10)
    assert copies["embed.weight"] == models.as_bytes(tensors["embed.weight"])


class _Peers:
    """A peer hook (the engine's PeerHook) that records what the engine offers it."""

    verified_by_peers: frozenset[int] = frozenset()

    def __init__(self) -> None:
        self.share: bool | None = None

    def begin(self, *, model: Any, plan: Any, writer: Any, segment: Path, share: bool = True) -> Any:
        self.share = share
        return plan

    def finish(self, tensor: int) -> int | None:
        return None


def test_a_ring_serves_no_peers(tmp_path: Path, shm_dir: Path) -> None:
    source, _ = _model(tmp_path, seed=9)
    segment = shm_dir / "peers.seg"
    peers = _Peers()
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING), peers=peers)
    _consume(segment)
    load.finish()
    assert load.error is None, load.error
    assert peers.share is False, "a ring reuses its bytes: it cannot serve a tensor to a peer"


def test_release_mode_empties_the_volume_once_the_consumer_is_done(tmp_path: Path, shm_dir: Path) -> None:
    source, tensors = _model(tmp_path, seed=3)
    segment = shm_dir / "release.seg"
    load = Load(source, segment, MemorySettings(mode="release"), readers=4)
    copies = _consume(segment)
    load.finish()
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}
    wait_for(lambda: _resident(segment) <= 64 << 10, timeout=10, what="the volume emptied")
    total = sum(t.numel() * t.element_size() for t in tensors.values())

    def released() -> float:
        # The manager reports after it punches: the metric may trail the volume by a moment.
        scraped = generate_latest(load.metrics.registry).decode()
        lines = [line for line in scraped.splitlines() if line.startswith("modelload_memory_released_bytes ")]
        return float(lines[0].split()[1]) if lines else 0.0

    wait_for(lambda: released() >= total, timeout=10, what="every released byte in the metrics")


def test_a_ring_smaller_than_the_largest_tensor_is_refused_before_anything_is_created(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, _ = _model(tmp_path)  # embed.weight: 1024 x 256 bfloat16 = 512 KiB
    segment = shm_dir / "small.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=256 << 10))
    load.finish()
    assert isinstance(load.error, ConfigError)
    assert "'embed.weight' needs 524288 bytes" in str(load.error)
    assert "set --ring-size (ModelLoad spec.memory.ringSize) to at least 1MiB" in str(load.error)
    assert not segment.exists()


def test_a_consumer_that_never_releases_makes_the_ring_wait_and_the_timeout_names_it(
    tmp_path: Path, shm_dir: Path
) -> None:
    source, _ = _model(tmp_path)
    segment = shm_dir / "stuck.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING, wait_timeout=1.5), readers=2)
    hoarder = attach(segment, timeout=5, notify=False)  # registers, reads, never marks anything consumed

    def waiting_for_the_hoarder() -> dict[str, Any] | None:
        memory = load.memory()
        return (
            memory if memory.get("waiting") and "has not consumed" in (memory["waiting_for"] or "") else None
        )

    memory = wait_for(waiting_for_the_hoarder, timeout=5, what="the ring waiting for the hoarder")
    assert f"pid {os.getpid()}" in memory["waiting_for"] and memory["consumers"][0]["pid"] == os.getpid()
    load.finish()
    assert isinstance(load.error, MemoryWaitError)
    assert "ring mode waited" in str(load.error) and "has not consumed" in str(load.error)
    with pytest.raises(LoadFailedError, match=r"ring mode waited .* has not consumed"):
        hoarder.wait(timeout=5)
    hoarder.close()


def test_a_ring_with_no_consumer_attached_says_so_when_it_times_out(tmp_path: Path, shm_dir: Path) -> None:
    source, _ = _model(tmp_path)
    load = Load(source, shm_dir / "alone.seg", MemorySettings(mode="ring", ring_size=RING, wait_timeout=0.5))
    load.finish()
    assert isinstance(load.error, MemoryWaitError)
    assert "0 consumer(s) attached, 1 needed" in str(load.error)


def _hold_and_die(segment: str, ready: Any) -> None:
    consumers.HEARTBEAT_INTERVAL = 0.05  # alive, it beats as often as the test's live consumer
    model = attach(segment, timeout=10, notify=False)
    model.numpy(model.names[0])
    ready.set()
    time.sleep(60)


def test_a_reader_that_died_holding_tensors_stops_counting_when_its_heartbeat_expires(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source, tensors = _model(tmp_path, seed=5)
    segment = shm_dir / "dead.seg"
    # A short expiry, for the test's sake: the live consumer (this process) beats 40 times within it, so a
    # busy machine that holds its heartbeat back for a moment does not take it for dead.
    monkeypatch.setattr(consumers, "HEARTBEAT_INTERVAL", 0.05)
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=RING, expiry=2.0), readers=2)
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    reader = context.Process(target=_hold_and_die, args=(str(segment), ready))
    reader.start()
    assert ready.wait(30)
    os.kill(reader.pid, signal.SIGKILL)  # type: ignore[arg-type]
    reader.join()
    copies = _consume(segment)  # waits through the dead reader's expiry, then the ring moves on
    load.finish()
    assert load.error is None
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}


def test_the_consumer_expiry_outlasts_a_few_heartbeats_and_follows_a_faster_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    floor = r"the consumer expiry must be at least 5 seconds, got 4.9 seconds"
    with pytest.raises(ConfigError, match=floor):
        MemorySettings(mode="release", expiry=4.9)
    assert MemorySettings(mode="release", expiry=5.0).expiry == 5.0
    monkeypatch.setattr(consumers, "HEARTBEAT_INTERVAL", 0.05)  # consumers that beat 40 times faster
    assert MemorySettings(mode="release", expiry=0.125).expiry == 0.125


def test_a_volume_too_small_for_the_ring_is_a_clear_error(tmp_path: Path, tiny_tmpfs: Path) -> None:
    source, _ = _model(tmp_path)
    load = Load(source, tiny_tmpfs / "model.seg", MemorySettings(mode="ring", ring_size=4 << 20))
    load.finish()
    assert isinstance(load.error, SegmentSpaceError)
    assert "ring mode needs" in str(
        load.error
    ) and "raise the volume's sizeLimit or lower --ring-size" in str(load.error)
    assert not (tiny_tmpfs / "model.seg").exists()


def test_the_memory_flags_and_variables_parse_into_settings() -> None:
    settings = parse_settings(
        ["--source", "s3://b/m.safetensors", "--memory-mode", "ring", "--ring-size", "256MiB"],
        environ={"MODELLOAD_MEMORY_WAIT_TIMEOUT": "90", "MODELLOAD_CONSUMERS": "2"},
    )
    assert settings.engine.memory == MemorySettings(
        mode="ring", ring_size=256 << 20, wait_timeout=90.0, consumers=2
    )
    assert parse_settings(["--source", "x.safetensors"], environ={}).engine.memory.mode == "full"
    with pytest.raises(ConfigError, match=r"ring size .* is needed with --memory-mode ring"):
        parse_settings(["--source", "x", "--memory-mode", "ring"], environ={})
    with pytest.raises(ConfigError, match="MODELLOAD_MEMORY_MODE: expected one of full, release, ring"):
        parse_settings(["--source", "x"], environ={"MODELLOAD_MEMORY_MODE": "tiny"})
    with pytest.raises(ConfigError, match="--ring-size: a ring must be at least 1MiB"):
        parse_settings(["--source", "x", "--memory-mode", "ring", "--ring-size", "4096"], environ={})


def test_a_sidecar_restarting_over_its_unfinished_ring_reuses_the_room_of_the_old_one(
    tmp_path: Path, tiny_tmpfs: Path
) -> None:
    from modelload.loader.dtypes import by_name
    from modelload.loader.segment import MemoryMode, SegmentWriter, TensorSpec, plan_layout

    ring = 600 << 10  # two rings do not fit the 1 MiB volume: the old one must make room for the new
    segment = tiny_tmpfs / "model.seg"
    crashed = plan_layout(
        [TensorSpec("w", by_name("uint8"), (ring,))], memory_mode=MemoryMode.RING, ring_size=ring
    )
    old = SegmentWriter.create(segment, crashed, heartbeat=False)  # a sidecar that died mid-load
    old.close()
    source, tensors = _model(tmp_path, seed=10)
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=ring), readers=2)

    def replaced() -> bool:
        assert load.thread.is_alive() or load.error is None, load.error
        with SegmentReader.open(segment) as reader:
            return reader.load_id != old.load_id

    wait_for(replaced, timeout=10, what="the new ring published", ignoring=(ModelloadError,))
    copies = _consume(segment)
    load.finish()
    assert load.error is None, load.error
    assert copies == {name: models.as_bytes(t) for name, t in tensors.items()}


@pytest.mark.parametrize("mode", ["ring", "release"])
def test_a_sidecar_restarted_after_a_complete_load_keeps_the_segment_its_app_already_consumed(
    mode: str, tmp_path: Path, shm_dir: Path
) -> None:
    source, tensors = _model(tmp_path, seed=11)
    segment = shm_dir / "done.seg"
    memory = (
        MemorySettings(mode=mode, ring_size=RING, wait_timeout=2.0)
        if mode == "ring"
        else MemorySettings(mode="release")
    )
    first = Load(source, segment, memory, readers=2)
    assert _consume(segment) == {name: models.as_bytes(t) for name, t in tensors.items()}
    first.finish()
    assert first.error is None
    with SegmentReader.open(segment) as reader:
        load_id = reader.load_id
    # The app has everything and does not attach again: a new load would wait for it (a ring) or hold the
    # whole model again (release); the restarted sidecar reports the finished load instead.
    again = Load(source, segment, memory, readers=2)
    again.finish()
    assert again.error is None, again.error
    assert again.tracker.snapshot().phase == "complete"
    with SegmentReader.open(segment) as reader:
        assert reader.load_id == load_id
        assert reader.writer_state == WriterState.COMPLETE


def test_a_ring_that_gave_up_waiting_no_longer_reports_a_wait(tmp_path: Path, shm_dir: Path) -> None:
    source, _ = _model(tmp_path)
    settings = MemorySettings(mode="ring", ring_size=RING, wait_timeout=0.5)
    load = Load(source, shm_dir / "gave-up.seg", settings)
    load.finish()
    assert isinstance(load.error, MemoryWaitError)
    # The memory thread's last report says the wait is over.
    memory = wait_for(
        lambda: load.memory() if not load.memory().get("waiting", True) else None,
        timeout=5,
        what="a report without a wait",
    )
    assert memory["waiting_for"] is None, memory
    waited = memory["wait_seconds_total"]
    assert 0.5 <= waited < 5, memory
    assert "modelload_memory_waiting 0.0" in generate_latest(load.metrics.registry).decode()


class _Tied(torch.nn.Module):
    """Tied input and output embeddings, with layers between them larger than the ring."""

    def __init__(self, layers: int = 6, width: int = 256) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(1024, width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = torch.nn.Linear(width, 1024, bias=False)
        self.head.weight = self.embed.weight


def test_a_module_with_tied_weights_loads_into_a_ring_smaller_than_the_span_between_the_twins(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(11)
    tensors = {name: t.detach().clone() for name, t in _Tied().state_dict().items()}
    assert "embed.weight" in tensors and "head.weight" in tensors, "the file stores both names of the tie"
    source = tmp_path / "tied.tensorizer"
    source.write_bytes(models.tensorizer_bytes(tensors))
    segment = shm_dir / "tied.seg"
    ring = 1536 << 10  # holds the embedding (1 MiB), not the embedding and every layer after it
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=ring, wait_timeout=10), readers=2)

    fake_gpu.install(monkeypatch)  # the copier's own logic, on a stand-in of the device
    with torch.device("meta"):
        module = _Tied()
    with attach(segment, timeout=30, notify=False) as model:
        model.load_into_module(module, device="cuda")
    load.finish()
    assert load.error is None, load.error
    assert module.head.weight is module.embed.weight
    assert torch.equal(module.embed.weight, tensors["embed.weight"])
    assert torch.equal(module.layers[5].weight, tensors["layers.5.weight"])


def test_a_module_that_takes_not_every_tensor_of_the_file_loads_through_a_ring(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(12)
    tensors = {name: t.detach().clone() for name, t in _Tied().state_dict().items()}
    tensors = {"attn.rotary.inv_freq": torch.rand(128), **tensors}  # older checkpoints hold such leftovers
    source = tmp_path / "extra.safetensors"
    source.write_bytes(models.safetensors_bytes(tensors))
    segment = shm_dir / "extra.seg"
    load = Load(source, segment, MemorySettings(mode="ring", ring_size=1536 << 10, wait_timeout=10))

    fake_gpu.install(monkeypatch)  # the copier's own logic, on a stand-in of the device
    with torch.device("meta"):
        module = _Tied()
    with attach(segment, timeout=30, notify=False) as model:
        _, unexpected = model.load_into_module(module, device="cuda", strict=False)
    load.finish()
    assert load.error is None, load.error  # the ring did not wait for a tensor nobody will copy
    assert list(unexpected) == ["attn.rotary.inv_freq"]
    assert torch.equal(module.layers[5].weight, tensors["layers.5.weight"])


def test_a_ring_s_wait_names_the_tensor_whose_bytes_it_waits_for(tmp_path: Path, shm_dir: Path) -> None:
    source, _ = _model(tmp_path, seed=13)
    segment = shm_dir / "blocker.seg"
    # head.bias lands first (ring bytes [0, 296)), then layers.5.*: layers.5.mlp.weight needs the ring bytes
    # layers.5.attn.weight holds, and nothing of head.bias's.
    settings = MemorySettings(mode="ring", ring_size=RING, wait_timeout=2)
    load = Load(source, segment, settings, readers=2, priority=("head.bias", "layers.5."))
    model = attach(segment, timeout=30, notify=False)
    with SegmentReader.open(segment) as reader:  # the layout, read while the segment is there
        data_offset = reader.header.data_offset
        ring = {s.name: (s.offset - data_offset) % RING for s in reader.slots}
    with pytest.raises(LoadFailedError, match="ring mode waited"):
        for name in model.iter_ready():
            if name not in ("head.bias", "layers.5.attn.weight"):  # held, never consumed
                model.consumed(name)
    load.finish()
    model.close()
    assert isinstance(load.error, MemoryWaitError)
    assert ring["head.bias"] == 0 and ring["layers.5.attn.weight"] > 4096, "the layout this test relies on"
    assert "to land tensor 'layers.5.mlp.weight'" in str(load.error)
    assert "has not consumed 'layers.5.attn.weight'" in str(load.error), load.error
    assert "head.bias" not in str(load.error), "a held tensor the ring does not wait for is not the reason"


def test_a_volume_too_small_for_a_ring_cut_to_the_model_names_the_ring_it_needs(
    tmp_path: Path, tiny_tmpfs: Path
) -> None:
    source, _ = _model(tmp_path)  # about 3.5 MiB of data: a 64 MiB ring is cut to the model's size
    load = Load(source, tiny_tmpfs / "model.seg", MemorySettings(mode="ring", ring_size=64 << 20))
    load.finish()
    assert isinstance(load.error, SegmentSpaceError)
    assert str(64 << 20) not in str(load.error), "the error names a ring that is not the one it needs"


def test_a_ring_too_small_names_the_first_of_its_largest_tensors_and_the_size_to_set() -> None:
    # Checked for every tensor at once: of two tensors of the same largest size, the first is named.
    from modelload.loader.dtypes import by_name
    from modelload.loader.formats import ModelIndex, TensorEntry
    from modelload.sidecar.memory.manager import plan_memory
    from modelload.sidecar.planner import plan_load

    sizes = [(1 << 20), 3 << 20, 2 << 20, 3 << 20]
    entries, at = [], 64
    for i, size in enumerate(sizes):
        entries.append(TensorEntry(f"t{i}", by_name("uint8"), (size,), at, at, size))
        at += size
    index = ModelIndex(format="safetensors", version=1, tensors=tuple(entries), index_length=64, data_end=at)
    plan = plan_load(index, chunk_size=1 << 20, span_limit=2 << 20)
    with pytest.raises(
        ConfigError, match=r"tensor 't1' needs 3145728 bytes \(3.0 MiB\) in the ring.*at least 3MiB"
    ):
        plan_memory(plan, MemorySettings(mode="ring", ring_size=2 << 20))
    assert plan_memory(plan, MemorySettings(mode="ring", ring_size=3 << 20)).layout.ring_size == 3 << 20
