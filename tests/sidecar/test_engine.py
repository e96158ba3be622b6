"""The engine against real servers: nginx over HTTP with Range support, moto's S3 server, local files.

Models load byte-exact in both formats, plain and encrypted, while a separate process is attached and
waiting; the engine's events say what happened.
"""

from __future__ import annotations

import multiprocessing
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.loader import attach
from modelload.loader.errors import (
    HashMismatchError,
    MissingKeyError,
    NotEncryptedError,
    SegmentSpaceError,
    TruncatedError,
    WrongKeyError,
)
from modelload.loader.segment import SegmentReader, TensorFlags, WriterState
from modelload.loader.segment import writer as writer_module
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import LoadTracker, Observers
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings
from tests.sidecar import models
from tests.support.fault_proxy import Stall

FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=4, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0),
)


class Recorder:
    """An observer that keeps every event, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            with self._lock:
                self.events.append((name, {"args": args, **kwargs}))

        return record

    def tensors_published(self, *, indices: Any, names: Any, nbytes: Any) -> None:
        """The tensors of one range, recorded (and passed to a subclass's ``tensor_ready``) one by one."""
        for index, name, size in zip(indices, names, nbytes, strict=True):
            self.tensor_ready(index=index, name=name, nbytes=size)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kwargs for name, kwargs in self.events if name == event]


def load(
    source: str, segment: Path, *, sources: SourceSettings = FAST, **settings: Any
) -> tuple[Recorder, LoadTracker]:
    recorder, tracker = Recorder(), LoadTracker()
    engine = Engine(
        LoadSettings(source=source, segment=segment, **settings),
        sources=sources,
        observer=Observers(recorder, tracker),
    )
    engine.run()
    return recorder, tracker


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_a_model_over_http_loads_byte_exact(fmt: str, nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict()
    data = models.tensorizer_bytes(tensors) if fmt == "tensorizer" else models.safetensors_bytes(tensors)
    url = nginx.put(f"engine-{fmt}.bin", data)
    recorder, tracker = load(url, shm_dir / "model.seg", readers=4, chunk_size=64 << 10)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    status = tracker.snapshot()
    assert (status.phase, status.format, status.tensors_ready) == ("complete", fmt, len(tensors))
    assert (
        status.bytes_done == status.bytes_total == sum(t.numel() * t.element_size() for t in tensors.values())
    )
    assert len(recorder.named("tensor_ready")) == len(tensors)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.metadata["source"] == url
        assert reader.metadata["format"] == fmt
        verified = [TensorFlags.VERIFIED in reader.flags(i) for i in range(len(reader.slots))]
        assert all(verified) == (fmt == "tensorizer"), "tensorizer files carry hashes; safetensors none"


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_a_model_on_s3_loads_byte_exact(fmt: str, moto_s3: Any, aws_env: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=1)
    data = models.tensorizer_bytes(tensors) if fmt == "tensorizer" else models.safetensors_bytes(tensors)
    uri = moto_s3.put("engine-models", f"llm/{fmt}.bin", data)
    sources = SourceSettings(s3=S3Settings(endpoint_url=moto_s3.endpoint), http=FAST.http, retry=FAST.retry)
    _, tracker = load(uri, shm_dir / "model.seg", sources=sources, readers=4, chunk_size=128 << 10)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    assert tracker.snapshot().phase == "complete"


def test_an_encrypted_model_is_decrypted_in_place_with_a_key_file(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=2)
    params = models.password_params("unused")  # a raw key works for any file, derived or not
    url = nginx.put("engine-encrypted.bin", models.tensorizer_bytes(tensors, encryption=params))
    key_file = models.write_secret(shm_dir, "key", params.key)
    load(url, shm_dir / "model.seg", key_file=key_file, readers=3, chunk_size=64 << 10)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert all(TensorFlags.DECRYPTED in reader.flags(i) for i, s in enumerate(reader.slots) if s.nbytes)


def test_an_encrypted_model_opens_with_its_password(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=3, layers=2)
    url = nginx.put(
        "engine-password.bin", models.tensorizer_bytes(tensors, encryption=models.password_params("pw"))
    )
    password = models.write_secret(shm_dir, "password", b"pw")
    load(url, shm_dir / "model.seg", password_file=password)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_encryption_mistakes_fail_before_or_during_the_load_with_a_clear_error(
    nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=4, layers=1)
    params = models.password_params("pw")
    encrypted = nginx.put("engine-enc2.bin", models.tensorizer_bytes(tensors, encryption=params))
    plain = nginx.put("engine-plain2.bin", models.tensorizer_bytes(tensors))
    with pytest.raises(MissingKeyError, match="--key-file"):
        load(encrypted, shm_dir / "a.seg")
    assert not (shm_dir / "a.seg").exists(), "no segment is published for a load that cannot start"
    with pytest.raises(NotEncryptedError):
        load(plain, shm_dir / "b.seg", key_file=models.write_secret(shm_dir, "k1", params.key))
    wrong = models.write_secret(shm_dir, "k2", bytes(32))
    with pytest.raises(WrongKeyError):
        load(encrypted, shm_dir / "c.seg", key_file=wrong)
    with SegmentReader.open(shm_dir / "c.seg") as reader:
        assert reader.writer_state == WriterState.FAILED
        assert "wrong" in reader.error
        assert params.key.hex() not in reader.error


def test_a_corrupt_tensor_fails_the_load_and_marks_the_segment(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=5, layers=2)
    data = models.corrupt_tensor(models.tensorizer_bytes(tensors), "layers.1.attn.weight")
    url = nginx.put("engine-corrupt.bin", data)
    recorder = Recorder()
    engine = Engine(LoadSettings(source=url, segment=shm_dir / "model.seg"), sources=FAST, observer=recorder)
    with pytest.raises(HashMismatchError, match="CRC32"):
        engine.run()
    assert recorder.named("load_failed")[0]["kind"] == "hash_mismatch"
    with attach(shm_dir / "model.seg", notify=False) as model, pytest.raises(Exception, match="corrupt"):
        model.wait(timeout=5)


def test_without_verification_the_same_corrupt_file_loads(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=5, layers=2)
    data = models.corrupt_tensor(models.tensorizer_bytes(tensors), "layers.1.attn.weight")
    url = nginx.put("engine-corrupt-unverified.bin", data)
    _, tracker = load(url, shm_dir / "model.seg", verify=False)
    assert tracker.snapshot().phase == "complete"


def test_a_truncated_object_is_refused_before_a_segment_is_made(nginx: Any, shm_dir: Path) -> None:
    data = models.safetensors_bytes(models.state_dict(seed=6, layers=1))
    url = nginx.put("engine-truncated.bin", data[:-1000])
    with pytest.raises(TruncatedError):
        load(url, shm_dir / "model.seg")
    assert not (shm_dir / "model.seg").exists()


def test_priority_tensors_are_published_first(nginx: Any, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=7)
    url = nginx.put("engine-priority.bin", models.safetensors_bytes(tensors))
    recorder, _ = load(url, shm_dir / "model.seg", readers=1, priority=("layers.3.", "head.bias"))
    order = [event["name"] for event in recorder.named("tensor_ready") if event["nbytes"]]
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        file_order = [slot.name for slot in reader.slots]
    first = [n for n in file_order if n.startswith("layers.3.")] + ["head.bias"]
    assert order[: len(first)] == first


def test_a_restarted_sidecar_reuses_a_complete_segment_of_the_same_object(
    nginx_proxy: Any, nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=8, layers=2)
    nginx.put("engine-reuse.bin", models.tensorizer_bytes(tensors))
    url = nginx_proxy.url("engine-reuse.bin")
    load(url, shm_dir / "model.seg")
    requests_before = len(nginx_proxy.requests)
    recorder, tracker = load(url, shm_dir / "model.seg")
    assert tracker.snapshot().phase == "complete"
    assert len(nginx_proxy.requests) - requests_before <= 1, "only the object's size and ETag are asked for"
    assert len(recorder.named("tensor_ready")) == len(tensors)
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_stopping_mid_load_leaves_the_segment_failed_not_torn(
    nginx_proxy: Any, nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=9)
    nginx.put("engine-stop.bin", models.safetensors_bytes(tensors))
    nginx_proxy.always(Stall(after=0, seconds=0.2))
    engine = Engine(
        LoadSettings(
            source=nginx_proxy.url("engine-stop.bin"),
            segment=shm_dir / "model.seg",
            readers=1,
            chunk_size=64 << 10,
        ),
        sources=FAST,
        observer=LoadTracker(),
    )
    threading.Timer(0.5, engine.stop).start()
    from modelload.sidecar.load.engine import LoadStopped

    with pytest.raises(LoadStopped):
        engine.run()
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.writer_state == WriterState.FAILED
        assert "stopped" in reader.error
        assert reader.tensors_ready < len(tensors)


def _attach_and_checksum(path: str, queue: Any, started: Any) -> None:
    started.set()  # imports are done: the parent may start loading
    model = attach(path, notify=False, timeout=60)
    ready_at_attach = model.progress().tensors_ready
    sums = {name: zlib.crc32(model.numpy(name).tobytes()) for name in model.iter_ready()}
    queue.put((ready_at_attach, len(model), sums))


def test_a_separate_process_attaches_while_the_model_streams(
    nginx_proxy: Any, nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=10)
    nginx.put("engine-attach.bin", models.tensorizer_bytes(tensors))
    nginx_proxy.always(Stall(after=0, seconds=0.05))  # slow the load down so the child joins mid-way
    context = multiprocessing.get_context("spawn")
    queue, started = context.Queue(), context.Event()
    child = context.Process(target=_attach_and_checksum, args=(str(shm_dir / "model.seg"), queue, started))
    child.start()
    assert started.wait(timeout=60)
    load(nginx_proxy.url("engine-attach.bin"), shm_dir / "model.seg", readers=2, chunk_size=64 << 10)
    ready_at_attach, count, sums = queue.get(timeout=60)
    child.join(timeout=10)
    assert child.exitcode == 0
    assert ready_at_attach < count, "the child attached before the load had finished"
    assert sums == {n: zlib.crc32(models.as_bytes(t)) for n, t in tensors.items()}


def test_a_local_file_loads_through_splice_and_through_the_mapping(tmp_path: Path, shm_dir: Path) -> None:
    tensors = models.state_dict(seed=11)
    path = tmp_path / "model.safetensors"
    path.write_bytes(models.safetensors_bytes(tensors))
    for landing in ("splice", "mapping"):
        segment = shm_dir / f"model-{landing}.seg"
        load(str(path), segment, landing=landing, chunk_size=32 << 10)
        models.assert_segment_matches(segment, tensors)
    load(f"file://{path}", shm_dir / "uri.seg")
    models.assert_segment_matches(shm_dir / "uri.seg", tensors)


def test_a_volume_that_fills_up_mid_load_fails_it_with_what_to_raise(
    tiny_tmpfs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Without the up-front free-space check (another process can fill the volume after it), the splice
    # path meets a full volume mid-load: an ordinary ENOSPC, never a SIGBUS.
    monkeypatch.setattr(writer_module, "_check_space", lambda *_: None)
    path = tmp_path / "big.safetensors"
    path.write_bytes(models.safetensors_bytes({"w": torch.zeros(1 << 19)}))
    with pytest.raises(SegmentSpaceError, match="sizeLimit"):
        load(str(path), tiny_tmpfs / "model.seg")
    with SegmentReader.open(tiny_tmpfs / "model.seg") as reader:
        assert reader.writer_state == WriterState.FAILED
        assert "no room" in reader.error
