"""attach() and the Model handle, against real segments written by the segment writer."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from modelload.loader import LoadFailedError, LoadTimeoutError, Model, attach
from modelload.loader.dtypes import by_name, names
from modelload.loader.errors import ModelClosedError, SegmentLayoutError, SidecarUnavailableError
from modelload.loader.formats.safetensors import save_file
from modelload.loader.formats.tensorizer import TensorizerWriter
from modelload.loader.segment import SegmentWriter, TensorSpec, plan_layout


def _segment(path: Path, tensors: dict[str, torch.Tensor]) -> SegmentWriter:
    specs = [TensorSpec(n, by_name(str(t.dtype)), tuple(t.shape)) for n, t in tensors.items()]
    return SegmentWriter.create(path, plan_layout(specs, metadata={"format": "test"}))


def _fill(writer: SegmentWriter, index: int, tensor: torch.Tensor) -> None:
    if tensor.numel():
        writer.slot(index)[:] = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    writer.mark_ready(index)


def _publish_all(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with _segment(path, tensors) as writer:
        for i, tensor in enumerate(tensors.values()):
            _fill(writer, i, tensor)
        writer.mark_complete()


@contextlib.contextmanager
def _every_tensor_ready(path: Path, tensors: dict[str, torch.Tensor]) -> Iterator[SegmentWriter]:
    """A segment whose tensors are all READY while its writer, yielded, has not finished the load."""
    with _segment(path, tensors) as writer:
        for i, tensor in enumerate(tensors.values()):
            _fill(writer, i, tensor)
        yield writer


def _every_dtype() -> dict[str, torch.Tensor]:
    result = {}
    generator = torch.Generator().manual_seed(0)
    for name in names():
        dtype = getattr(torch, name)
        raw = torch.randint(0, 256, (3, 4 * by_name(name).itemsize), dtype=torch.uint8, generator=generator)
        result[name] = raw.view(dtype)
    return result


def test_every_dtype_comes_back_as_a_zero_copy_tensor_of_the_right_type(shm_dir: Path) -> None:
    tensors = _every_dtype()
    path = shm_dir / "model.seg"
    _publish_all(path, tensors)
    with attach(path, notify=False) as model:
        assert model.names == tuple(tensors)
        for name, expected in tensors.items():
            got = model.tensor(name)
            assert got.dtype == expected.dtype
            assert got.shape == expected.shape
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
            array = model.numpy(name)
            assert array.dtype == by_name(name).numpy
            assert got.data_ptr() == array.ctypes.data, "torch and numpy views share the segment's memory"
            assert array.tobytes() == expected.view(torch.uint8).numpy().tobytes()


def test_views_are_the_segment_not_a_copy(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    _publish_all(path, {"w": torch.arange(8, dtype=torch.float32)})
    with attach(path, notify=False) as model:
        first, second = model.numpy("w"), model.numpy("w")
        assert first.ctypes.data == second.ctypes.data
        assert first.ctypes.data % 4096 == 0, "slots are page-aligned, for pinned DMA"


def test_tensors_are_yielded_in_the_order_they_become_ready(shm_dir: Path) -> None:
    tensors = {f"t{i}": torch.full((4,), float(i)) for i in range(4)}
    path = shm_dir / "model.seg"
    writer = _segment(path, tensors)
    model = attach(path, notify=False, timeout=10)
    ready = model.iter_ready()
    for i in [2, 0, 3, 1]:
        _fill(writer, i, tensors[f"t{i}"])
        assert next(ready) == f"t{i}", "each tensor as it becomes ready, whatever its place in the file"
    writer.mark_complete()
    assert list(ready) == []
    model.close()
    writer.close()


def test_a_tensor_is_usable_before_the_rest_arrives(shm_dir: Path) -> None:
    tensors = {"layers.0.w": torch.ones(2), "layers.1.w": torch.zeros(2)}
    path = shm_dir / "model.seg"
    with _segment(path, tensors) as writer:
        _fill(writer, 0, tensors["layers.0.w"])
        with attach(path, notify=False, tensor_timeout=0.05) as model:
            model.wait(prefix="layers.0.")
            assert model.tensor("layers.0.w").tolist() == [1.0, 1.0]
            assert not model.is_ready("layers.1.w")
            with pytest.raises(LoadTimeoutError, match=r"layers\.1\.w"):
                model.tensor("layers.1.w")
            with pytest.raises(LoadTimeoutError):
                model.tensor("layers.1.w", wait=False)
            progress = model.progress()
            assert (progress.tensors_ready, progress.tensors_total, progress.state) == (1, 2, "loading")


def test_a_failed_load_reaches_the_waiting_inference_process(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    with _segment(path, {"w": torch.ones(2)}) as writer:
        model = attach(path, notify=False, timeout=10)
        threading.Timer(0.05, writer.mark_failed, args=("s3://models/llama: access denied",)).start()
        with pytest.raises(LoadFailedError, match="access denied"):
            model.state_dict()
        model.close()


def test_the_whole_model_is_handed_over_only_once_the_load_is_proven(shm_dir: Path) -> None:
    """Every tensor READY, the load not finished (its files' end-of-load proofs still run): a tensor or a
    subset streams at once, the whole model waits for the end, and a proof that then fails is an error,
    never weights the sidecar refused."""
    path = shm_dir / "model.seg"
    with (
        _every_tensor_ready(path, {"a": torch.ones(4), "b": torch.zeros(4)}) as writer,
        attach(path, notify=False, timeout=30) as model,
    ):
        assert model.tensor("a").tolist() == [1.0] * 4  # streaming is not held back
        assert list(model.state_dict(names=["b"])) == ["b"]
        outcome: list[object] = []
        taker = threading.Thread(target=lambda: outcome.append(_outcome(model.state_dict)))
        taker.start()
        writer.mark_failed("model.safetensors: its SHA-256 is not the one the origin publishes")
        taker.join(timeout=30)
        assert not taker.is_alive()
        assert isinstance(outcome[0], LoadFailedError) and "SHA-256" in str(outcome[0])
        with pytest.raises(LoadFailedError, match="SHA-256"):
            model.wait_complete()


def test_once_the_load_failed_no_tensor_it_published_is_handed_out_any_more(shm_dir: Path) -> None:
    """Tensors stream before their file's end-of-load proof; once the writer declares the load FAILED (a
    file that did not match its proof), every way to a tensor refuses, not only the whole model's."""
    path = shm_dir / "model.seg"
    with (
        _every_tensor_ready(path, {"a": torch.ones(4), "b": torch.zeros(4)}) as writer,
        attach(path, notify=False, timeout=30) as model,
    ):
        assert model.numpy("a").tolist() == [1.0] * 4
        writer.mark_failed("model.safetensors: its SHA-256 is not the one the origin publishes")
        calls = {
            "numpy": lambda: model.numpy("a"),
            "numpy, no wait": lambda: model.numpy("a", wait=False),
            "tensor": lambda: model.tensor("b"),
            "tensor, no wait": lambda: model.tensor("b", wait=False),
            "state_dict of names": lambda: model.state_dict(names=["a", "b"]),
            "iter_ready": lambda: list(model.iter_ready()),
            "wait": model.wait,
        }
        for call, made in calls.items():
            with pytest.raises(LoadFailedError, match="SHA-256"):
                made()
                pytest.fail(f"{call} handed out a tensor of a failed load")


def test_a_segment_overwritten_in_place_under_an_attached_app_is_refused_not_served(shm_dir: Path) -> None:
    """A new load is a new file (renamed into place); bytes copied over the attached file in place (what
    ``cp`` does) would be another load's weights under this load's names."""
    path, other = shm_dir / "model.seg", shm_dir / "other.seg"
    _publish_all(path, {"w": torch.ones(4)})
    _publish_all(other, {"w": torch.full((4,), 7.0)})
    with attach(path, notify=False, timeout=5) as model:
        assert model.numpy("w").tolist() == [1.0] * 4
        with path.open("r+b") as into:
            into.write(other.read_bytes())
        for made in (
            lambda: model.numpy("w"),
            model.state_dict,
            lambda: model.tensor("w", wait=False),
        ):
            with pytest.raises(LoadFailedError, match="another load"):
                made()


def test_a_closed_model_says_so_and_one_name_is_one_tensor(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    _publish_all(path, {"a": torch.ones(2), "b": torch.zeros(2), "ab": torch.full((2,), 5.0)})
    model = attach(path, notify=False, timeout=5)
    assert list(model.state_dict(names="ab")) == ["ab"], "a name is not a sequence of names"
    kept = model.tensor("a")
    model.close()
    assert kept.tolist() == [1.0, 1.0], "tensors handed out stay valid"
    for use in (lambda: model.numpy("a"), lambda: model.tensor("a"), model.progress, lambda: model.complete):
        with pytest.raises(ModelClosedError, match="closed; attach"):
            use()
    assert repr(model).endswith(": closed>")
    model.close()  # again: nothing


def test_a_heartbeat_from_the_future_is_no_live_writer_and_a_timeout_says_how_far_the_load_got(
    shm_dir: Path,
) -> None:
    from modelload.loader.segment.layout import OFF_HEARTBEAT_NS

    path = shm_dir / "model.seg"
    specs = [TensorSpec(n, by_name("float32"), (2,)) for n in ("a", "b")]
    with SegmentWriter.create(path, plan_layout(specs), heartbeat=False) as writer:
        _fill(writer, 0, torch.ones(2))
        with attach(path, notify=False, timeout=5) as model:
            with pytest.raises(LoadTimeoutError, match=r"not finished after 0.2 s: 1/2 tensors are ready"):
                model.wait_complete(timeout=0.2)
            with path.open("r+b") as header:  # a heartbeat no writer on this clock could have written
                header.seek(OFF_HEARTBEAT_NS)
                header.write(((1 << 63) - 1).to_bytes(8, "little"))
            with pytest.raises(LoadFailedError, match="ahead of this clock"):
                model.wait(["b"], timeout=5)


def test_a_module_is_filled_once_the_load_completes(shm_dir: Path) -> None:
    state = {"weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "bias": torch.ones(2)}
    path = shm_dir / "model.seg"
    with _segment(path, state) as writer:
        for i, tensor in enumerate(state.values()):
            _fill(writer, i, tensor)
        with attach(path, notify=False, timeout=30) as model:
            with torch.device("meta"):
                net = torch.nn.Linear(3, 2)
            outcome: list[object] = []
            taker = threading.Thread(
                target=lambda: outcome.append(_outcome(lambda: model.load_into_module(net)))
            )
            taker.start()
            writer.mark_complete()
            taker.join(timeout=30)
            assert not taker.is_alive() and not isinstance(outcome[0], BaseException), outcome
            assert torch.equal(net.weight, state["weight"]) and net.weight.device.type == "cpu"


def _outcome(call: object) -> object:
    try:
        return call()  # type: ignore[operator]
    except Exception as exc:
        return exc


def test_attach_finds_the_segment_from_the_environment(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = shm_dir / "model.seg"
    _publish_all(path, {"w": torch.ones(1)})
    monkeypatch.setenv("MODELLOAD_SEGMENT", str(path))
    monkeypatch.delenv("MODELLOAD_NOTIFY", raising=False)
    with attach(notify=False) as model:
        assert model.path == str(path)


def test_attach_without_a_path_or_environment_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MODELLOAD_SEGMENT", raising=False)
    with pytest.raises(SidecarUnavailableError, match="MODELLOAD_SEGMENT is not set"):
        attach()


def test_attach_waits_for_a_segment_that_is_still_being_created(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    threading.Timer(0.1, _publish_all, args=(path, {"w": torch.ones(1)})).start()
    with attach(path, timeout=5, notify=False) as model:
        assert model.tensor("w").item() == 1.0


def test_attach_gives_up_on_a_segment_that_never_appears(shm_dir: Path) -> None:
    with pytest.raises(SidecarUnavailableError, match="no segment appeared"):
        attach(shm_dir / "never.seg", timeout=0.05)


def test_attach_in_a_folder_that_does_not_exist_says_so_at_once_instead_of_waiting_out_its_timeout(
    shm_dir: Path,
) -> None:
    # No sidecar creates the folder (it refuses to start in a missing one), so waiting cannot help; before
    # the fix this waited out the whole timeout, then blamed the sidecar.
    missing = shm_dir / "no-such-volume"
    with pytest.raises(SidecarUnavailableError, match=r"folder .*no-such-volume does not exist") as raised:
        attach(missing / "model.seg", timeout=5, notify=False)
    assert "MODELLOAD_SEGMENT" in str(raised.value) and "mounted" in str(raised.value)


@pytest.mark.parametrize("kind", ["tensorizer", "safetensors"])
def test_attach_to_a_model_file_names_its_format_and_how_to_make_a_segment_of_it(
    shm_dir: Path, kind: str
) -> None:
    path = shm_dir / f"model-{kind}.bin"
    tensors = {"w": np.arange(2048, dtype=np.float32)}
    if kind == "safetensors":
        save_file(tensors, path)
    else:
        with path.open("wb") as out:
            writer = TensorizerWriter(out)
            writer.write_state_dict(tensors)
            writer.close()
    with pytest.raises(SegmentLayoutError) as raised:
        attach(path, timeout=1, notify=False)
    message = str(raised.value)
    assert f"is a {kind} file, not a modelload segment" in message
    assert "modelload stage" in message and "modelload sidecar" in message


def test_attach_to_some_other_file_does_not_show_its_bytes(shm_dir: Path) -> None:
    path = shm_dir / "token"
    path.write_bytes(b"hf_SECRETSECRETSECRET" * 300)
    with pytest.raises(SegmentLayoutError, match="not a modelload segment") as raised:
        attach(path, timeout=1, notify=False)
    assert "SECRET" not in str(raised.value) and b"hf_SECR".hex(" ")[:8] not in str(raised.value)


def test_state_dict_and_module_loading_assign_without_copying(shm_dir: Path) -> None:
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    reference.register_buffer("scale", torch.tensor([2.0]))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    path = shm_dir / "model.seg"
    _publish_all(path, state)
    with attach(path, notify=False) as model:
        with torch.device("meta"):
            net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
            net.register_buffer("scale", torch.empty(1))
        model.load_into_module(net)
        assert net[0].weight.device.type == "cpu"
        assert net[0].weight.data_ptr() == model.tensor("0.weight").data_ptr()
        x = torch.randn(5, 4)
        assert torch.equal(net(x), reference(x))
        assert torch.equal(net.scale, reference.scale)
        sd = model.state_dict(names=["2.bias"])
        assert list(sd) == ["2.bias"]


def test_strict_loading_reports_a_mismatch_and_lenient_loading_skips_it(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    _publish_all(path, {".weight": torch.ones(2, 2), ".bias": torch.zeros(2), "extra": torch.ones(1)})
    with attach(path, notify=False) as model:
        with torch.device("meta"):
            net = torch.nn.Linear(2, 2)
        with pytest.raises(RuntimeError, match="extra"):
            model.load_into_module(net)
        with torch.device("meta"):
            net = torch.nn.Linear(2, 2)
        result = model.load_into_module(net, strict=False)
        assert result.missing_keys == []
        assert torch.equal(net.weight, torch.ones(2, 2)), "root names written as '.weight' match 'weight'"


def _checksum_in_child(path: str, queue: multiprocessing.Queue) -> None:
    model = attach(path, notify=False, timeout=30)
    model.wait()
    queue.put({name: zlib.crc32(model.numpy(name).tobytes()) for name in model.names})


def test_several_processes_attach_to_one_segment_at_once(shm_dir: Path) -> None:
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(8)}
    path = shm_dir / "model.seg"
    context = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue = context.Queue()
    children = [context.Process(target=_checksum_in_child, args=(str(path), queue)) for _ in range(3)]
    with _segment(path, tensors) as writer:
        for child in children:
            child.start()
        for i, tensor in enumerate(tensors.values()):
            _fill(writer, i, tensor)
            time.sleep(0.01)
        writer.mark_complete()
    expected = {n: zlib.crc32(t.numpy().tobytes()) for n, t in tensors.items()}
    assert [queue.get(timeout=60) for _ in children] == [expected] * 3
    for child in children:
        child.join(timeout=10)
        assert child.exitcode == 0


def test_importing_the_loader_pulls_in_neither_torch_nor_zmq() -> None:
    code = "import sys, modelload.loader; print(sorted({'torch', 'zmq', 'boto3'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_public_surface_is_small_sorted_and_complete() -> None:
    import modelload.loader as loader

    assert loader.__all__ == sorted(loader.__all__)
    for name in loader.__all__:
        assert hasattr(loader, name), name
    # Complete: every public name the package defines is exported (submodules aside), nothing by accident.
    public = {n for n, v in vars(loader).items() if not n.startswith("_") and not isinstance(v, ModuleType)}
    assert public == set(loader.__all__) - {"errors"}
    assert len(loader.__all__) <= 12, f"the loader's public surface grew to {len(loader.__all__)} names"
    assert isinstance(loader.Model, type)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_state_dict_copies_to_the_gpu_through_pinned_memory(shm_dir: Path) -> None:
    tensors = {f"t{i}": torch.randn(256, 1024) for i in range(6)} | {"bf": torch.randn(64).bfloat16()}
    path = shm_dir / "model.seg"
    _publish_all(path, tensors)
    with attach(path, notify=False) as model:
        on_gpu = model.state_dict(device="cuda")
        for name, tensor in tensors.items():
            assert on_gpu[name].device.type == "cuda"
            assert torch.equal(on_gpu[name].cpu(), tensor)


def test_model_repr_names_the_segment(shm_dir: Path) -> None:
    path = shm_dir / "model.seg"
    _publish_all(path, {"w": torch.ones(1)})
    with attach(path, notify=False) as model:
        assert isinstance(model, Model)
        assert "1 tensors, 1 ready, complete" in repr(model)


def test_attach_to_a_folder_asks_for_the_segment_file_in_it_before_saying_to_remove_it(shm_dir: Path) -> None:
    # before the fix: "the segment ... is a directory, not a regular file: ... something else put it there;
    # remove it", advice to delete what is the volume when MODELLOAD_SEGMENT names its folder
    folder = shm_dir / "volume"
    folder.mkdir()
    with pytest.raises(SegmentLayoutError) as raised:
        attach(folder, timeout=1, notify=False)
    message = str(raised.value)
    assert f"if it is the folder the segment is in, name the file in it ({folder}/model.seg" in message


def test_a_long_wait_for_a_segment_says_where_it_looks_while_it_waits(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # before the fix a mistyped segment name (models.seg for model.seg) waited out its 600 s in silence
    import modelload.loader._api.attach as attaching

    monkeypatch.setattr(attaching, "SAY_WAITING_AFTER", 0.05)
    with caplog.at_level(logging.WARNING, logger="modelload"), pytest.raises(SidecarUnavailableError):
        attach(shm_dir / "models.seg", timeout=1, notify=False)
    said = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert said, caplog.text
    assert (
        f"no segment at {shm_dir / 'models.seg'} yet" in said[0]
        and "is the modelload sidecar running" in said[0]
    )
