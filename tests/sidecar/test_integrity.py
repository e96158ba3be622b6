"""What the engine publishes is one version of the model, checkable later, and fits the volume it was given.

- A weight file replaced mid-load behind an unchanged validator (nginx's ETag is the mtime in seconds and
  the size) fails the load instead of publishing a mix of both versions.
- Every tensor's state entry records a CRC32, so ``modelload inspect --verify`` checks a sidecar's segment.
- A meta tensor's slot (no bytes in the file, zeros in the segment) is reserved before publishing on the
  splice path: a reader touching it on a volume that filled up later reads zeros, not SIGBUS; a file that
  declares an enormous one is refused before anything is published.
- A sidecar restarted after a crash mid-load loads again in a volume sized for one segment.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from modelload.loader.cli.main import main
from modelload.loader.errors import HashMismatchError, SegmentSpaceError, SourceChangedError
from modelload.loader.formats import read_index
from modelload.loader.segment import SegmentReader, SegmentWriter, TensorFlags, WriterState
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.planner import plan_load
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.sidecar import models
from tests.support.tmpfs import tmpfs

FAST = SourceSettings(
    http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0),
    retry=RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=10.0),
)


class _OnFirstData(LoadTracker):
    """A tracker that runs ``action`` once, when the first tensor with data is published."""

    def __init__(self, action: Callable[[], None]) -> None:
        super().__init__()
        self._action: Callable[[], None] | None = action

    def tensors_published(
        self, *, indices: Sequence[int], names: Sequence[str], nbytes: Sequence[int]
    ) -> None:
        super().tensors_published(indices=indices, names=names, nbytes=nbytes)
        action = self._action
        if action is not None and any(nbytes):
            self._action = None
            action()


def load(source: str, segment: Path, *, observer: LoadTracker | None = None, **settings: Any) -> LoadTracker:
    tracker = observer or LoadTracker()
    kwargs = {"readers": 1, "chunk_size": 64 << 10, **settings}
    Engine(LoadSettings(source=source, segment=segment, **kwargs), sources=FAST, observer=tracker).run()
    return tracker


def replace_keeping_validators(path: Path, data: bytes) -> None:
    """Overwrite ``path`` in place with same-size ``data`` and put its mtime back: nginx's ETag and
    Last-Modified (mtime seconds and size) stay what they were."""
    before = path.stat()
    assert len(data) == before.st_size
    with path.open("r+b") as file:
        file.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


@pytest.mark.parametrize("fmt", ["tensorizer", "safetensors"])
def test_a_file_replaced_behind_an_unchanged_etag_fails_the_load_instead_of_mixing_versions(
    fmt: str, nginx: Any, shm_dir: Path
) -> None:
    write = models.tensorizer_bytes if fmt == "tensorizer" else models.safetensors_bytes
    old, new = write(models.state_dict(seed=40)), write(models.state_dict(seed=41))
    url = nginx.put(f"mixed-{fmt}.bin", old)
    path = nginx.root / f"mixed-{fmt}.bin"
    tracker = _OnFirstData(lambda: replace_keeping_validators(path, new))
    with pytest.raises(SourceChangedError, match="without a change of its validator"):
        load(url, shm_dir / "model.seg", observer=tracker)
    with SegmentReader.open(shm_dir / "model.seg") as reader:
        assert reader.writer_state == WriterState.FAILED
        assert "mix two versions" in reader.error
    assert tracker.snapshot().phase == "failed"


def test_an_unchanged_model_is_published_complete_with_a_crc32_for_every_tensor(
    nginx: Any, shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = models.state_dict(seed=42, layers=2)
    url = nginx.put("crc.bin", models.tensorizer_bytes(tensors))
    segment = shm_dir / "model.seg"
    load(url, segment, readers=3)
    models.assert_segment_matches(segment, tensors)
    with SegmentReader.open(segment) as reader:
        assert all(reader.flags(s.index) & TensorFlags.CRC32 for s in reader.slots)

    assert main(["inspect", "--no-progress", "--json", "--verify", str(segment)]) == 0
    verify = json.loads(capsys.readouterr().out)["verify"]
    assert verify["ok"] is True and verify["checked"] == len(tensors)

    # One flipped byte in a published tensor: verify names it.
    with SegmentReader.open(segment) as reader:
        slot = next(s for s in reader.slots if s.name == "layers.1.attn.weight")
    with segment.open("r+b") as file:
        file.seek(slot.offset + 5)
        byte = file.read(1)
        file.seek(slot.offset + 5)
        file.write(bytes([byte[0] ^ 0x40]))
    assert main(["inspect", "--no-progress", "--json", "--verify", str(segment)]) == 1
    verify = json.loads(capsys.readouterr().out)["verify"]
    assert [f["name"] for f in verify["failures"]] == ["layers.1.attn.weight"]
    assert "CRC32" in verify["failures"][0]["error"]


def test_a_corrupt_encrypted_tensor_is_corruption_not_a_wrong_key_when_others_decrypt(
    nginx: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=43, layers=2)
    params = models.password_params("unused")
    data = models.corrupt_tensor(models.tensorizer_bytes(tensors, encryption=params), "embed.weight")
    url = nginx.put("corrupt-encrypted.bin", data)
    key_file = models.write_secret(shm_dir, "key", params.key)
    # One reader, file order: the corrupt tensor is the first to be decrypted, before the key proved right.
    with pytest.raises(HashMismatchError, match="corrupt"):
        load(url, shm_dir / "model.seg", key_file=key_file, chunk_size=1 << 20)


@pytest.fixture
def sized_tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mount tmpfs volumes of a given size (needs root: :mod:`tests.support.tmpfs`)."""
    names = itertools.count()
    with contextlib.ExitStack() as mounts:

        def mount(size: int) -> Path:
            return mounts.enter_context(tmpfs(tmp_path / f"volume{next(names)}", size=size))

        yield mount


def segment_length(data: bytes, **kwargs: Any) -> int:
    index = read_index(lambda offset, length: data[offset : offset + length])
    return plan_load(index, chunk_size=64 << 10, **kwargs).layout.segment_length


_READ_META = """
import sys
from modelload.loader import attach
with attach(sys.argv[1], notify=False, timeout=10) as model:
    print(int((model.numpy("meta") != 0).sum()))
"""


def test_a_meta_tensor_is_reserved_on_the_splice_path_so_a_full_volume_is_no_sigbus(
    nginx: Any, sized_tmpfs: Callable[[int], Path]
) -> None:
    tensors = {"w": torch.arange(1000, dtype=torch.float32), "meta": torch.empty(256 << 10, device="meta")}
    data = models.tensorizer_bytes(tensors)
    url = nginx.put("meta.bin", data)
    volume = sized_tmpfs(segment_length(data) + (256 << 10))
    load(url, volume / "model.seg")  # plain HTTP: spliced through the file descriptor
    # The volume fills up after the load (another file, a log): the meta slot must already have its pages.
    with (volume / "filler").open("wb") as filler, pytest.raises(OSError):
        while True:
            filler.write(bytes(64 << 10))
            filler.flush()
    run = subprocess.run(
        [sys.executable, "-c", _READ_META, str(volume / "model.seg")], capture_output=True, check=False
    )
    assert run.returncode == 0, (
        f"reading the meta tensor died (status {run.returncode}): {run.stderr[-500:]!r}"
    )
    assert run.stdout.strip() == b"0"


def test_a_file_declaring_an_enormous_tensor_is_refused_before_anything_is_published(
    nginx: Any, sized_tmpfs: Callable[[int], Path]
) -> None:
    tensors = {"w": torch.ones(10), "meta": torch.empty(1 << 36, dtype=torch.uint8, device="meta")}
    url = nginx.put("enormous.bin", models.tensorizer_bytes(tensors))
    volume = sized_tmpfs(4 << 20)
    with pytest.raises(SegmentSpaceError, match="sizeLimit"):
        load(url, volume / "model.seg")
    assert list(volume.iterdir()) == [], "nothing was published or left behind"


def test_a_restarted_sidecar_loads_again_in_a_volume_sized_for_one_segment(
    nginx: Any, sized_tmpfs: Callable[[int], Path]
) -> None:
    tensors = models.state_dict(seed=44, layers=4)
    data = models.safetensors_bytes(tensors)
    url = nginx.put("restart.bin", data)
    length = segment_length(data)
    volume = sized_tmpfs(length + (256 << 10))  # the operator's sizeLimit: one segment and a little headroom
    index = read_index(lambda offset, length: data[offset : offset + length])
    layout = plan_load(index, chunk_size=64 << 10).layout
    # The crashed sidecar: a LOADING segment with all its pages taken and half its tensors in, and no writer.
    crashed = SegmentWriter.create(volume / "model.seg", layout, reserve=True, heartbeat=False)
    for slot in layout.slots[: len(layout.slots) // 2]:
        crashed.slot(slot.index)[:] = b"\x01" * slot.nbytes
        crashed.mark_ready(slot.index)
    crashed.close()

    load(url, volume / "model.seg", readers=3)
    models.assert_segment_matches(volume / "model.seg", tensors)
    assert sorted(p.name for p in volume.iterdir()) == ["model.seg"]


def test_inspect_verify_calls_a_corrupt_encrypted_tensor_corrupt_when_the_key_opens_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    params = models.password_params("unused")
    data = models.tensorizer_bytes(models.state_dict(seed=45, layers=2), encryption=params)
    path = tmp_path / "model.tensors"
    path.write_bytes(models.corrupt_tensor(data, "embed.weight"))  # the first tensor verify opens
    key_file = models.write_secret(tmp_path, "key", params.key)
    assert (
        main(["inspect", "--no-progress", "--json", "--verify", "--key-file", str(key_file), str(path)]) == 1
    )
    verify = json.loads(capsys.readouterr().out)["verify"]
    assert [f["name"] for f in verify["failures"]] == ["embed.weight"]
    error = verify["failures"][0]["error"]
    assert "corrupt" in error and "the key is right" in error and "wrong" not in error


def test_a_staged_segment_records_a_crc32_for_every_tensor_and_inspect_verify_checks_them(
    shm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tensors = models.state_dict(seed=46, layers=2)
    source = shm_dir / "model.safetensors"
    source.write_bytes(models.safetensors_bytes(tensors))
    segment = shm_dir / "staged.seg"
    assert main(["stage", "--no-progress", str(source), str(segment)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--no-progress", "--json", "--verify", str(segment)]) == 0
    verify = json.loads(capsys.readouterr().out)["verify"]
    assert verify["ok"] is True and verify["checked"] == len(tensors)


def test_the_end_of_load_look_up_retries_a_transient_error_instead_of_failing_a_complete_load() -> None:
    from modelload.sidecar.load.integrity import check_unchanged
    from modelload.sidecar.sources import InterruptedReadError, ObjectInfo, OpenedModel, RetryPolicy

    info = ObjectInfo(size=10, etag='"v1"')

    class Flaky:
        display_uri = "http://origin/model.safetensors"
        supports_fd = False
        calls = 0

        def stat(self) -> ObjectInfo:
            return info

        def restat(self) -> ObjectInfo:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise InterruptedReadError("HTTP 500", uri=self.display_uri)
            return info

        def close(self) -> None:
            pass

    model = OpenedModel(uri=Flaky.display_uri, sources=[Flaky()], infos=[info], format="safetensors")  # type: ignore[list-item]
    policy = RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.01, jitter=0.0, deadline=5.0)
    assert check_unchanged(model, None, None, policy=policy, readers=1, sample=False) == 0  # type: ignore[arg-type]
    assert Flaky.calls == 2, "one failed look-up, retried once"
