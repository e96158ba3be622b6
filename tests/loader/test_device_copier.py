"""``DeviceCopier``'s logic without a GPU: what it pins and when, which copy reads which bytes, when a tensor
is handed back (``on_done``), and how a copy streams through a ring that a real engine is still loading.

The CUDA calls are a stand-in (``tests/support/fake_gpu.py``) that runs each copy as late as it can and
keeps the driver's rules; the same paths run on a GPU in ``test_device_copy.py`` (``make gpu-check``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.loader import attach
from modelload.loader._api.gpu_copy import DeviceCopier, Region
from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, SegmentReader, SegmentWriter, TensorSpec, plan_layout
from modelload.sidecar.memory import MemorySettings
from tests.segment.helpers import expected_bytes, uint8_segment
from tests.sidecar import models
from tests.support import fake_gpu
from tests.support.engine import EngineThread

SIZES = [3 << 20, 5000, 0, 1 << 20, 150 << 20, 12]  # an empty tensor, one of three staging buffers' worth


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pin in place on 4 KiB pages too, as on huge pages: the tests of the in-place logic run on tmpfs."""
    monkeypatch.setattr("modelload.loader._api.model.Model._pins_in_place", lambda self: True)


def _segment(path: Path, mode: MemoryMode) -> SegmentWriter:
    return uint8_segment(path, SIZES, mode)


def _expected(index: int, sizes: list[int] = SIZES) -> torch.Tensor:
    data = expected_bytes(5, index, sizes[index])
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _all_equal(results: dict[str, torch.Tensor], sizes: list[int] = SIZES) -> None:
    for i in range(len(sizes)):
        assert torch.equal(results[f"t{i}"], _expected(i, sizes)), f"t{i}"


def test_a_complete_full_segment_is_pinned_once_whole_and_every_tensor_copied_from_it(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_place(monkeypatch)
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        _all_equal(model.state_dict(device="cuda"))
        data = len(model._reader.data())
    (gpu,) = gpus
    assert [nbytes for _, nbytes in gpu.registered] == [data], "the data region once, no tensor on its own"
    assert gpu.pageable == 0 and not gpu.buffers, "every copy read the pinned mapping in place"
    assert not gpu.pins, "unpinned once the copies are done"


def test_a_copy_of_a_few_tensors_pins_those_tensors_and_not_the_whole_segment(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_place(monkeypatch)
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        got = model.state_dict(device="cuda", names=["t0", "t1"])
    assert torch.equal(got["t0"], _expected(0)) and torch.equal(got["t1"], _expected(1))
    assert sorted(nbytes for _, nbytes in gpus[0].registered) == sorted([SIZES[0], SIZES[1]])
    assert not gpus[0].pins


def test_release_mode_pins_each_tensor_for_its_copy_only_and_consumes_it_once_copied(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _in_place(monkeypatch)
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.RELEASE), attach(path, notify=False) as model:
        _all_equal(model.state_dict(device="cuda"))
        registration = model._registration
        assert registration is not None
        assert all(registration.has(i) for i in range(len(SIZES))), "every tensor marked consumed"
    (gpu,) = gpus
    assert sorted(nbytes for _, nbytes in gpu.registered) == sorted(n for n in SIZES if n)
    assert sorted(gpu.unregistered) == sorted(address for address, _ in gpu.registered)
    assert gpu.pageable == 0


def test_on_done_comes_only_once_the_copy_has_read_the_host_bytes(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on_done hands the bytes back (a ring lands newer tensors there): scribbling over them from on_done
    # must not reach a copy, which the stand-in runs as late as it may; and they come back unpinned.
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    writer = _segment(path, MemoryMode.RELEASE)
    for pin_in_place in (True, False):
        with attach(path, notify=False, register=False) as model:  # a fresh mapping each time
            copier = DeviceCopier("cuda", pin_in_place=pin_in_place)
            results: dict[str, torch.Tensor] = {}
            handed_back: list[tuple[str, bool]] = []
            for name in model.iter_ready():
                host = model.tensor(name)  # copy-on-write: the scribbles stay in this process

                def scribble(
                    name: str = name, host: torch.Tensor = host, out: list[Any] = handed_back
                ) -> None:
                    out.append((name, host.data_ptr() in gpus[-1].pins))
                    host.fill_(0xAA)

                results[name] = copier.copy(host, on_done=scribble)
            copier.finish()
            assert sorted(name for name, _ in handed_back) == sorted(model.names)
            assert not any(pinned for _, pinned in handed_back), "handed back while still pinned"
            _all_equal(results)
    assert gpus[0].registered and not gpus[1].registered
    writer.close()


def test_a_refused_pin_falls_back_to_staging_buffers_with_the_same_bytes(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch, refuse=lambda address, nbytes: "CUDA_ERROR_NOT_SUPPORTED")
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        copier = DeviceCopier("cuda")
        results = {name: copier.copy(model.tensor(name)) for name in model.names}
        copier.finish()
        assert not copier.pins_in_place
        _all_equal(results)
    (gpu,) = gpus
    assert not gpu.registered and gpu.pageable == 0, "staged through the pinned buffers"
    assert len(gpu.buffers) == 2


def test_a_refused_whole_region_pins_each_tensor_instead(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    largest = max(SIZES)  # the whole region is larger: refused, as a driver out of pinnable memory would
    _in_place(monkeypatch)
    gpus = fake_gpu.install(monkeypatch, refuse=lambda address, n: "OUT_OF_MEMORY" if n > largest else None)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        _all_equal(model.state_dict(device="cuda"))
    assert sorted(nbytes for _, nbytes in gpus[0].registered) == sorted(n for n in SIZES if n)
    assert not gpus[0].pins and gpus[0].pageable == 0


def test_a_tensor_already_pinned_by_someone_else_is_staged_and_left_pinned_for_them(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        host = model.tensor("t0")
        copier = DeviceCopier("cuda")
        gpu = gpus[0]
        gpu.register(host.data_ptr(), host.nbytes)  # another copier's pin
        result = copier.copy(host)
        copier.finish()
        assert torch.equal(result, _expected(0)) and not copier.pins_in_place
        assert list(gpu.pins) == [host.data_ptr()], "the other pin is not taken away"


def test_an_error_in_on_done_reaches_the_caller_after_every_pin_is_given_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    called: list[str] = []

    def done(name: str) -> None:
        called.append(name)
        if name == "t1":
            raise RuntimeError("the consumer table is gone")

    with _segment(path, MemoryMode.RELEASE), attach(path, notify=False) as model:
        copier = DeviceCopier("cuda")
        for name in ("t0", "t1", "t3"):
            copier.copy(model.tensor(name), on_done=lambda n=name: done(n))
        with pytest.raises(RuntimeError, match="the consumer table is gone"):
            copier.finish()
    assert called == ["t0", "t1", "t3"], "later tensors are still handed back: a ring must not wait for them"
    assert not gpus[0].pins


def test_a_copy_into_a_given_tensor_lands_there_and_a_mismatched_one_is_refused(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modelload.loader.errors import ConfigError

    fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, MemoryMode.FULL), attach(path, notify=False) as model:
        copier = DeviceCopier("cuda")
        target = torch.empty(SIZES[0], dtype=torch.uint8)
        assert copier.copy(model.tensor("t0"), into=target) is target
        with pytest.raises(ConfigError, match="cannot copy"):
            copier.copy(model.tensor("t1"), into=target)
        copier.finish()
        assert torch.equal(target, _expected(0))


# --- a ring, loaded by a real engine while the copier consumes --------------------------------------------


def test_a_ring_smaller_than_the_model_streams_to_the_gpu_pinned_once_while_the_engine_loads(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller waits in iter_ready() for tensors the engine lands only once earlier ones are consumed:
    # a copier that hands tensors back only at its next copy (or at the end) never gets them.
    gpus = fake_gpu.install(monkeypatch)
    tensors = models.state_dict(seed=3)
    source = tmp_path / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(tensors))
    segment = shm_dir / "ring.seg"
    load = EngineThread(source, segment, MemorySettings(mode="ring", ring_size=1 << 20, wait_timeout=20))
    with attach(segment, timeout=60, notify=False) as model:
        on_gpu = model.state_dict(device="cuda")
        ring = model._reader.header.ring_size
        total = model.nbytes
    load.finish()
    assert load.error is None, load.error
    assert total > 3 * ring, "the model must go round the ring several times"
    for name, tensor in tensors.items():
        assert torch.equal(on_gpu[name], tensor), name
    (gpu,) = gpus
    assert [nbytes for _, nbytes in gpu.registered] == [ring], "the ring once, its first mapping only"
    assert gpu.pageable == 0, "every copy read pinned memory"
    nonempty = sum(1 for t in tensors.values() if t.numel())
    assert len(gpu.sources) > nonempty, "a tensor across the ring's end is copied in two pieces"
    assert not gpu.pins


def test_a_region_pin_copies_a_ring_tensor_across_the_end_from_the_first_mapping(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    ring = 4 * 4096
    sizes = [10000, 9000]  # t1 starts at 12288 and runs 4904 bytes past the ring's end
    specs = [TensorSpec(f"t{i}", by_name("uint8"), (n,)) for i, n in enumerate(sizes)]
    path = shm_dir / "ring.seg"
    layout = plan_layout(specs, memory_mode=MemoryMode.RING, ring_size=ring)
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    reader = SegmentReader.open(path)
    region = Region(_readonly_tensor(reader.data()), ring)
    slot = writer.layout.slots[1]
    writer.slot(1)[:] = expected_bytes(9, 1, slot.nbytes)
    writer.mark_ready(1)
    copier = DeviceCopier("cuda")
    assert copier.pin(region)
    host = _readonly_tensor(reader.view(1))
    result = copier.copy(host)
    copier.finish()
    assert bytes(result.numpy()) == expected_bytes(9, 1, slot.nbytes)
    gpu = gpus[0]
    start = region.bytes.data_ptr()
    assert gpu.registered == [(start, ring)]
    assert gpu.sources == [(start + 12288, ring - 12288), (start, 9000 - (ring - 12288))]
    del host, region
    reader.close()
    writer.close()


def _readonly_tensor(view: memoryview) -> Any:
    from modelload.loader._api.torch import as_tensor

    return as_tensor(view, by_name("uint8"), (len(view),))


@pytest.mark.parametrize("mode", [MemoryMode.FULL, MemoryMode.RELEASE])
def test_on_4_kib_pages_a_full_or_release_segment_is_copied_through_staging_buffers_not_pinned(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: MemoryMode
) -> None:
    # Pinning costs per page: 2.37 s for a 4.26 GiB model's 4 KiB pages on an H100, where staging copied the
    # same model at 19.8 GiB/s (docs/gpu.md). Huge pages and rings are pinned in place (other tests).
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "m.seg"
    with _segment(path, mode), attach(path, notify=False) as model:
        assert model._reader.volume.page_size == 4096
        _all_equal(model.state_dict(device="cuda"))
    (gpu,) = gpus
    assert not gpu.registered, "no page of the segment pinned"
    assert gpu.pageable == 0, "every copy went through a pinned staging buffer"
