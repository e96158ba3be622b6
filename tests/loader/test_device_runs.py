"""Small neighbouring tensors copied to a GPU in runs: one host-to-device copy of the bytes a run spans, then
one batched clone of each tensor out of it (as integers: bits stay bits) into memory of its own, instead of
a copy, a stream switch and an event per tensor. Without a GPU: the stand-in of ``tests/support/fake_gpu.py``
runs each copy as late as it can, so a run handed back before its copy ran, or read from the wrong offset,
shows here; the GPU tests at the end run the same on a real device.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from modelload.loader import Model, attach
from modelload.loader._api import gpu_copy
from modelload.loader._api.gpu_copy import Region, copy_all, runs
from modelload.loader._api.torch import as_tensor
from modelload.loader.dtypes import by_name
from modelload.loader.segment import MemoryMode, SegmentWriter, Slot, TensorSpec, plan_layout
from tests.segment.helpers import expected_bytes
from tests.support import fake_gpu

DTYPES = [
    "float16", "float32", "bfloat16", "int8", "float64", "uint8", "bool", "int16", "int32", "int64",
    "complex64", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip
SIZES = {1, 2, 4, 8}
"""The element sizes among DTYPES: a run clones one batch per element size."""


def _specs(count: int) -> list[TensorSpec]:
    """``count`` small tensors of every dtype in turn, of rank 0, 1 or 2 (every seventh a scalar)."""
    rng = np.random.default_rng(5)
    specs = []
    for i in range(count):
        dtype = by_name(DTYPES[i % len(DTYPES)])
        shape: tuple[int, ...] = () if i % 7 == 3 else (int(rng.integers(1, 700)),)
        if i % 2:
            shape = (int(rng.integers(1, 9)), *shape)
        specs.append(TensorSpec(f"experts.{i}.w", dtype, shape))
    return specs


def _segment(path: Path, count: int, *, packed: bool = True, complete: bool = True) -> SegmentWriter:
    """A full-mode segment of :func:`_specs`, each tensor holding ``expected_bytes(13, index, nbytes)``:
    packed (each slot on its element size right after the last) or paged; complete, or with nothing landed
    yet (the caller lands it)."""
    layout = plan_layout(_specs(count), packed=packed)
    writer = SegmentWriter.create(path, layout, heartbeat=False)
    if complete:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(13, slot.index, slot.nbytes)
        writer.mark_ready_many(np.arange(len(layout.slots)))
        writer.mark_complete()
    return writer


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _check_every_tensor(model: Model, results: dict[str, torch.Tensor]) -> None:
    names = model.names
    assert sorted(results) == sorted(names)
    storages = set()
    for index, name in enumerate(names):
        got, host = results[name], model.tensor(name)
        assert got.dtype == host.dtype and got.shape == host.shape, name
        assert _bits(got) == expected_bytes(13, index, host.nbytes), f"{name} holds other bytes"
        assert got.untyped_storage().nbytes() == got.nbytes, f"{name} shares a storage"
        storages.add(got.untyped_storage().data_ptr())
    assert len(storages) == len(names), "each tensor has a storage of its own"


@pytest.mark.parametrize("in_place", [False, True], ids=["staged", "pinned-region"])
def test_a_packed_mixture_of_experts_is_copied_in_a_few_runs_bit_for_bit(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, in_place: bool
) -> None:
    if in_place:  # as on huge pages: the whole mapping pinned once, each run read from it
        monkeypatch.setattr("modelload.loader._api.model.Model._pins_in_place", lambda self: True)
    monkeypatch.setattr(gpu_copy, "_RUN_BYTES", 1 << 20)  # many runs, each on its own offset
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "moe.seg"
    count = 3000
    with _segment(path, count), attach(path, notify=False) as model:
        assert model._reader.header.layout_version == 5
        results = model.state_dict(device="cuda")
        _check_every_tensor(model, results)
        spanned = len(model._reader.data())
    (gpu,) = gpus
    assert sum(gpu.batched) == count, "every tensor came through a batched clone"
    most = (-(-spanned // gpu_copy._RUN_BYTES) + 1) * len(SIZES)
    assert len(gpu.batched) <= most, "a batch per element size of each run"
    host_copies = len(gpu.sources)
    assert host_copies <= 2 * len(gpu.batched), f"{host_copies} host copies for {count} tensors"
    if in_place:
        assert len(gpu.registered) == 1 and gpu.pageable == 0 and not gpu.buffers
    else:
        assert not gpu.registered and gpu.pageable == 0, "staged through the pinned buffers"


def test_a_paged_segment_runs_its_small_tensors_across_their_padding(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "paged.seg"
    with _segment(path, 600, packed=False), attach(path, notify=False) as model:
        assert model._reader.header.layout_version != 5
        _check_every_tensor(model, model.state_dict(device="cuda"))
    assert sum(gpus[0].batched) == 600 and len(gpus[0].batched) <= len(SIZES)  # one run


@pytest.mark.parametrize("mode", [MemoryMode.RELEASE, MemoryMode.RING])
def test_a_segment_that_gives_pages_back_copies_each_tensor_on_its_own(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: MemoryMode
) -> None:
    # Release and ring hand each tensor's pages back once it is consumed: a run held back until its next
    # neighbour lands could hold back the very landing (a ring) that neighbour waits for.
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "paged.seg"
    rng = np.random.default_rng(1)
    specs = [
        TensorSpec(f"t{i}", by_name("uint8"), (int(n),)) for i, n in enumerate(rng.integers(1, 4000, 50))
    ]
    layout = plan_layout(specs, memory_mode=mode, ring_size=1 << 20 if mode == MemoryMode.RING else 0)
    with SegmentWriter.create(path, layout, heartbeat=False) as writer:
        for slot in layout.slots:
            writer.slot(slot.index)[:] = expected_bytes(13, slot.index, slot.nbytes)
            writer.mark_ready(slot.index)
        writer.mark_complete()
        with attach(path, notify=False) as model:
            results = model.state_dict(device="cuda")
            for slot in layout.slots:
                assert _bits(results[slot.name]) == expected_bytes(13, slot.index, slot.nbytes), slot.name
    assert not gpus[0].batched, "no run"


def test_a_run_is_handed_back_only_once_its_copies_have_read_it(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on_done may hand the bytes back: scribbling over a run's host bytes from it must not reach the copies,
    # which the stand-in runs as late as it may (the batched clones after the host copy of the span).
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "moe.seg"
    with _segment(path, 500), attach(path, notify=False, register=False) as model:
        data = as_tensor(model._reader.data(), by_name("uint8"), (len(model._reader.data()),))
        items = list(model.state_dict().items())
        handed_back: list[str] = []

        def scribble(name: str) -> None:
            handed_back.append(name)
            model.tensor(name).reshape(-1).view(torch.uint8).fill_(0xAA)  # copy-on-write: this process only

        region = Region(data)  # read in place: the stand-in reads it only when the copy runs
        results = dict(copy_all(items, "cuda", on_done=scribble, region=region, data=data))
        assert sorted(handed_back) == sorted(model.names)
        for index, (name, _) in enumerate(items):
            assert _bits(results[name]) == expected_bytes(13, index, results[name].nbytes), name
    assert gpus[0].batched and gpus[0].registered and gpus[0].pageable == 0, "runs read in place"


def test_runs_take_small_neighbours_and_leave_the_rest_alone_in_order() -> None:
    buffer = bytearray(80 << 20)
    data = torch.frombuffer(buffer, dtype=torch.uint8)
    mib = 1 << 20

    def _host(offset: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        # as the segment's views are made: a storage of its own at any byte offset of the mapping
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.frombuffer(buffer, dtype=dtype, count=nbytes // size, offset=offset)

    items = [
        ("a", _host(0, 100)),
        ("b", _host(100, 200, torch.float16)),  # right after a
        ("c", _host(300 + 4096, 8)),  # a page of padding between: still the run
        ("d", _host(300 + 4096 + 8 + 4097, 8)),  # more than a page apart: a new run
        ("e", _host(5 * mib, mib)),  # not small: alone
        ("f", _host(6 * mib, 12)),
        ("g", torch.empty(0, dtype=torch.uint8)),  # empty (as the views make one): alone
        ("h", _host(6 * mib + 13, 4)),
        ("i", _host(6 * mib + 18, 4, torch.float32)),  # off its element size: alone
        ("j", _host(0, 8)),  # behind the run: a new one
    ]
    items += [(f"k{i}", _host(8 * mib + i * mib // 2, mib // 2)) for i in range(70)]  # 35 MiB
    items.append(("c128", _host(79 * mib, 32, torch.complex128)))  # no integer of its size: alone
    items.append(("other", torch.zeros(8, dtype=torch.uint8)))  # outside the mapping: alone
    grouped = [[name for name, _ in run] for run in runs(items, data)]
    assert [name for run in grouped for name in run] == [name for name, _ in items], "the order is kept"
    assert grouped[:8] == [["a", "b", "c"], ["d"], ["e"], ["f"], ["g"], ["h"], ["i"], ["j"]]
    spans = grouped[8:-2]
    assert [len(run) for run in spans] == [64, 6], "a run spans at most 32 MiB"
    assert grouped[-2:] == [["c128"], ["other"]]


def test_a_thousand_tensors_of_a_larger_segment_cost_a_few_copies_not_a_thousand(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost the runs remove: before them, each tensor was one host copy (and, for a consumer, one event).
    gpus = fake_gpu.install(monkeypatch)
    path = shm_dir / "moe.seg"
    with _segment(path, 2000), attach(path, notify=False) as model:
        model.state_dict(device="cuda", names=model.names[100:1100])
    assert sum(gpus[0].batched) == 1000
    assert len(gpus[0].sources) <= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "paged"])
def test_runs_of_mixed_dtypes_reach_a_real_gpu_bit_for_bit_each_in_its_own_memory(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, packed: bool
) -> None:
    monkeypatch.setattr(gpu_copy, "_RUN_BYTES", 1 << 20)  # many runs, each from its own offset
    path = shm_dir / "moe.seg"
    with _segment(path, 3000, packed=packed), attach(path, notify=False) as model:
        results = model.state_dict(device="cuda")
        assert all(tensor.device.type == "cuda" for tensor in results.values())
        assert (torch.ones(4, device="cuda") * 2).sum().item() == 8  # no error left for a later kernel
        _check_every_tensor(model, {name: tensor.cpu() for name, tensor in results.items()})
        storages = {tensor.untyped_storage().data_ptr() for tensor in results.values()}
        assert len(storages) == len(results), "each device tensor has a storage of its own"


def test_a_full_segment_still_landing_streams_its_runs_to_the_device(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run waits for the tensor after it; in memory mode full no landing waits for a consumer, so the copy
    # follows the load to its end: the first half lands, runs of it are cloned while the second half is still
    # to land, then the rest lands.
    monkeypatch.setattr(gpu_copy, "_RUN_BYTES", 256 << 10)
    gpus = fake_gpu.install(monkeypatch)
    cloned = threading.Event()
    clone_many = fake_gpu.FakeGpu.clone_many

    def clone_and_tell(
        self: fake_gpu.FakeGpu, sources: list[torch.Tensor], scratch: torch.Tensor
    ) -> list[torch.Tensor]:
        cloned.set()
        return clone_many(self, sources, scratch)

    monkeypatch.setattr(fake_gpu.FakeGpu, "clone_many", clone_and_tell)
    path = shm_dir / "moe.seg"
    writer = _segment(path, 1500, complete=False)
    slots = writer.layout.slots
    half = len(slots) // 2

    def land(landing: list[Slot]) -> None:
        for slot in landing:
            writer.slot(slot.index)[:] = expected_bytes(13, slot.index, slot.nbytes)
        writer.mark_ready_many([slot.index for slot in landing])

    def load() -> None:
        land(slots[:half])
        if cloned.wait(30):  # else the copy never began: the test fails on the flag below
            land(slots[half:])
            writer.mark_complete()

    with attach(path, notify=False, timeout=30) as model:
        lander = threading.Thread(target=load)
        lander.start()
        results = model.state_dict(device="cuda")
        lander.join()
        assert cloned.is_set(), "no run was copied while half the model was still to land"
        _check_every_tensor(model, results)
    writer.close()
    assert sum(gpus[0].batched) > 1000, "copied in runs"


def test_an_error_in_a_run_reaches_the_caller_with_every_pin_given_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("modelload.loader._api.model.Model._pins_in_place", lambda self: True)
    monkeypatch.setattr(gpu_copy, "_RUN_BYTES", 256 << 10)
    gpus = fake_gpu.install(monkeypatch)
    clone_many = fake_gpu.FakeGpu.clone_many
    calls = 0

    def failing(
        self: fake_gpu.FakeGpu, sources: list[torch.Tensor], scratch: torch.Tensor
    ) -> list[torch.Tensor]:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("CUDA error: out of memory (the stand-in's)")
        return clone_many(self, sources, scratch)

    monkeypatch.setattr(fake_gpu.FakeGpu, "clone_many", failing)
    path = shm_dir / "moe.seg"
    with (
        _segment(path, 1500),
        attach(path, notify=False) as model,
        pytest.raises(RuntimeError, match="the stand-in's"),
    ):
        model.state_dict(device="cuda")
    (gpu,) = gpus
    assert gpu.registered and not gpu.pins, "the mapping was pinned, and given back"
    assert gpu.ran == gpu.made, "the copies queued were waited for"
