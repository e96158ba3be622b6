"""``modelload stage`` onto huge pages: a real hugetlbfs and a tmpfs mounted ``huge=always``.

The volumes are mounted by ``tests/support/hugepages.py`` (root; the tests fail under ``make test`` when
the machine cannot). On huge pages stage reads every tensor into its slot of the mapping (hugetlbfs refuses
``copy_file_range``), plans the segment in whole pages, and puts a directory's small files elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.cli.main import main
from modelload.loader.segment import SegmentReader, TensorFlags
from tests.loader.test_cli_stage import MIN_ARGON2, assert_attached, cli, every_dtype
from tests.support.hugepages import HUGE_PAGE, huge_tmpfs, huge_tmpfs_volume, hugetlbfs, hugetlbfs_volume

__all__ = ["huge_tmpfs", "huge_tmpfs_volume", "hugetlbfs", "hugetlbfs_volume"]  # fixtures, used by name

safetensors_torch = pytest.importorskip("safetensors.torch")
tensorizer = pytest.importorskip("tensorizer")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("volume", ["hugetlbfs", "huge_tmpfs"])
def test_a_safetensors_file_stages_byte_exact_on_huge_pages_without_the_kernel_copy(
    volume: str,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder: Path = request.getfixturevalue(volume)
    calls: list[Any] = []
    real = os.copy_file_range
    monkeypatch.setattr(os, "copy_file_range", lambda *a: calls.append(a) or real(*a))
    tensors = every_dtype()
    source = tmp_path / "m.safetensors"
    safetensors_torch.save_file(tensors, str(source))
    segment = folder / "model.seg"
    code, _, err = cli(capsys, source, segment, "--threads", "3")
    assert code == 0, err
    assert calls == [], "huge pages land through the mapping: the kernel copy is not even tried"
    assert segment.stat().st_size % HUGE_PAGE == 0
    assert_attached(segment, tensors)


def test_an_encrypted_tensorizer_file_stages_decrypted_on_hugetlbfs(
    hugetlbfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.formats.tensorizer_support import tz_write

    tensors = every_dtype()
    del tensors["empty"]  # the real tensorizer cannot encrypt a tensor of zero elements
    source = tmp_path / "m.tensors"
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    tz_write(source, tensors, encryption=tensorizer.EncryptionParams.from_string("s3cret", *MIN_ARGON2))
    segment = hugetlbfs / "model.seg"
    code, out, err = cli(capsys, source, segment, "--password-file", password)
    assert code == 0, err
    assert "(tensorizer, decrypted, verified)" in out
    assert_attached(segment, tensors)
    with SegmentReader.open(segment) as reader:
        assert all(TensorFlags.DECRYPTED in reader.flags(s.index) for s in reader.slots if s.nbytes)


def test_a_model_directory_on_hugetlbfs_needs_its_small_files_elsewhere(
    hugetlbfs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.sidecar import models
    from tests.support import hfdir

    weights = models.state_dict(seed=61, layers=2)
    source = hfdir.write(tmp_path / "llama", hfdir.files(weights, shards=2))
    segment = hugetlbfs / "model.seg"
    assert main(["stage", "--no-progress", str(source), str(segment)]) == 2
    err = capsys.readouterr().err
    assert "hugetlbfs" in err and "--model-dir" in err and "Traceback" not in err
    code, _, err = cli(capsys, source, segment, "--model-dir", tmp_path / "cfg")
    assert code == 0, err
    models.assert_segment_matches(segment, weights)
    assert (tmp_path / "cfg" / "config.json").read_bytes() == hfdir.SMALL_FILES["config.json"]
