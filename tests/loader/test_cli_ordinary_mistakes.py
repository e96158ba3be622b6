"""Ordinary mistakes end in one clear line, never a traceback: a full disk, a read-only volume (also a small
one, which is not "full"), no Kubernetes configuration, an API server out of reach."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from modelload.loader.cli.main import main
from modelload.loader.formats.safetensors import save_file
from tests.support.ports import free_port
from tests.support.sidecars import Sidecars
from tests.support.tmpfs import tmpfs


@pytest.fixture
def read_only_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A small tmpfs mounted read-only (needs root: :mod:`tests.support.tmpfs`)."""
    with tmpfs(tmp_path / "ro", size="1m", read_only=True) as mount:
        yield mount


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A 2 MiB safetensors file: more than the 1 MiB volumes below hold."""
    path = tmp_path / "m.safetensors"
    save_file({"w": np.ones((512, 1024), dtype=np.float32)}, path)
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str]:
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


@pytest.mark.parametrize("to", ["m.tensors", "m.safetensors"])
def test_serialize_onto_a_full_disk_says_so_and_leaves_nothing(
    model: Path, tiny_tmpfs: Path, to: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(capsys, "serialize", "--no-progress", model, tiny_tmpfs / to)
    assert status == 2
    assert f"no room for {tiny_tmpfs / to} in {tiny_tmpfs}" in err and "free space" in err
    assert "Traceback" not in err
    assert list(tiny_tmpfs.iterdir()) == []  # no partial file left behind


def test_stage_onto_a_read_only_volume_says_read_only_not_full(
    model: Path, read_only_tmpfs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = run(capsys, "stage", "--no-progress", model, read_only_tmpfs / "m.seg")
    assert status == 1
    assert f"cannot create a segment in {read_only_tmpfs}: it is on a read-only file system" in err
    assert "bytes and" not in err  # not the free-space message of a full volume


def test_a_sidecar_on_a_read_only_volume_is_refused_at_start_with_a_segment_error(
    model: Path, read_only_tmpfs: Path, sidecars: Sidecars
) -> None:
    from modelload.loader.errors import SegmentError

    with pytest.raises(SegmentError, match=r"(?i)read-only file system") as refused:
        # the segment's lock cannot be taken: nothing to load into
        sidecars.start(str(model), read_only_tmpfs / "m.seg", "--notify", "none")
    assert refused.value.kind == "segment"


def operator(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``modelload operator`` in a process of its own: the Kubernetes client reads KUBECONFIG on import."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("KUBE", "MODELLOAD_"))}
    command = [sys.executable, "-m", "modelload.loader.cli.main", "operator"]
    environ.update(env)
    return subprocess.run(command, env=environ, capture_output=True, text=True, timeout=60, check=False)


def test_the_operator_without_a_kubeconfig_says_what_to_configure(tmp_path: Path) -> None:
    pytest.importorskip("kopf")
    done = operator({"KUBECONFIG": str(tmp_path / "missing-kubeconfig"), "HOME": str(tmp_path)})
    assert done.returncode == 1
    assert "no Kubernetes configuration" in done.stderr and "KUBECONFIG" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_operator_with_an_unreachable_api_server_says_so(tmp_path: Path) -> None:
    pytest.importorskip("kopf")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'https://127.0.0.1:{free_port()}'}}}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
        "users: [{name: u, user: {token: not-a-real-token}}]\n"
    )
    done = operator({"KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)})
    assert done.returncode == 1
    assert "cannot reach the Kubernetes API server" in done.stderr
    assert "Traceback" not in done.stderr and "not-a-real-token" not in done.stderr


@pytest.fixture
def hugetlbfs_without_pages(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs of 1 GiB pages mounted with room for two, on a node whose pool of such pages is empty:
    what a pod asking for huge pages the node never set aside meets (skipped where the machine cannot mount
    it, or has 1 GiB pages free)."""
    pool = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages")
    if os.geteuid() != 0 or not pool.exists() or int(pool.read_text()) != 0:
        pytest.skip("needs root and an empty pool of 1 GiB huge pages")
    mount = tmp_path / "huge"
    mount.mkdir()
    command = ["mount", "-t", "hugetlbfs", "-o", "pagesize=1G,size=2G", "none", str(mount)]
    if subprocess.run(command, capture_output=True, check=False).returncode != 0:
        pytest.skip("mounting a hugetlbfs of 1 GiB pages is not allowed here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_stage_onto_huge_pages_the_node_lacks_says_to_set_them_aside_not_to_raise_a_tmpfs_limit(
    model: Path, hugetlbfs_without_pages: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    segment = hugetlbfs_without_pages / "m.seg"
    status, err = run(capsys, "stage", "--no-progress", model, segment, "--model-dir", tmp_path / "dir")
    assert status == 1
    assert "hugetlbfs" in err and "nr_hugepages" in err and "0 free" in err
    assert "tmpfs pages count" not in err and "sizeLimit" not in err  # the advice of a tmpfs volume
    assert "[Errno" not in err and "Traceback" not in err
    # Nothing holding pages stays: only the writers' empty lock file, which outlives writers by design.
    left = {path.name: path.stat().st_size for path in hugetlbfs_without_pages.iterdir()}
    assert left in ({}, {"m.seg.lock": 0}), left


@pytest.fixture
def both_formats(tmp_path: Path) -> Path:
    """A folder holding a model twice: as safetensors and as the tensorizer file serialize made of it."""
    folder = tmp_path / "both"
    folder.mkdir()
    save_file({"w": np.arange(16, dtype=np.float32)}, folder / "model.safetensors")
    assert (
        main(["serialize", "--no-progress", str(folder / "model.safetensors"), str(folder / "m.tensors")])
        == 0
    )
    return folder


@pytest.mark.parametrize(("command", "flag"), [("inspect", "--format"), ("serialize", "--from")])
def test_a_folder_of_both_formats_names_the_flag_the_command_has_and_that_flag_chooses(
    both_formats: Path, tmp_path: Path, command: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    extra = [tmp_path / "out.safetensors"] if command == "serialize" else []
    status, err = run(capsys, command, "--no-progress", both_formats, *extra)
    assert status == 2 and "Traceback" not in err
    assert f"holds both safetensors and tensorizer weights: choose one with {flag}" in err
    for chosen in ("tensorizer", "safetensors"):
        out = tmp_path / f"from-{chosen}.safetensors"
        extra = [out] if command == "serialize" else []
        status = main([command, "--no-progress", flag, chosen, str(both_formats), *map(str, extra)])
        printed = capsys.readouterr()
        assert status == 0, printed.err
        if command == "inspect":
            assert f"format      {chosen}" in printed.out
        else:
            assert out.stat().st_size > 0


@pytest.mark.parametrize("command", ["inspect", "stage"])
def test_a_format_the_file_is_not_is_refused_saying_what_it_is_not_that_it_is_corrupt(
    both_formats: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = [tmp_path / "m.seg"] if command == "stage" else []
    status, err = run(capsys, command, "--format", "safetensors", both_formats / "m.tensors", *extra)
    assert status == 2
    assert "m.tensors is a tensorizer file, not safetensors: give --format tensorizer" in err
    assert "corrupt" not in err


def test_a_folder_without_the_named_format_says_which_format_it_holds(
    both_formats: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (both_formats / "m.tensors").unlink()
    status, err = run(capsys, "stage", "--format", "tensorizer", both_formats, tmp_path / "m.seg")
    assert status == 2
    assert "holds no tensorizer weight files, only safetensors ones: set --format to safetensors" in err


@pytest.mark.parametrize("command", ["inspect", "stage"])
def test_a_folder_of_pickled_weights_names_them_and_how_to_convert_them(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # before the fix: "holds no weight files (...): point the source at the model's directory", which the
    # user had done; older Hub models ship pytorch_model.bin only
    folder = tmp_path / "old-model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "gpt2"}')
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a zip of pickles")
    extra = [tmp_path / "m.seg"] if command == "stage" else []
    status, err = run(capsys, command, folder, *extra)
    assert status == 2
    assert "holds no safetensors or tensorizer weights, only pytorch_model.bin" in err
    assert f"modelload serialize {folder}/pytorch_model.bin {folder}/model.safetensors" in err
    assert "point the source at the model's directory" not in err


def test_staging_a_model_folder_into_a_segment_beside_it_leaves_the_folder_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /data/model -> /data/model.seg: the default model directory (model/ beside the segment) is the source
    # itself. Before the fix it was replaced whole, deleting every weight file, then stage died with a
    # FileNotFoundError traceback.
    source = tmp_path / "model"
    source.mkdir()
    save_file({"w": np.arange(16, dtype=np.float32)}, source / "model.safetensors")
    (source / "config.json").write_text('{"model_type": "llama"}')
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    status, err = run(capsys, "stage", "--no-progress", source, tmp_path / "model.seg")
    assert status == 2 and "Traceback" not in err
    assert f"the model directory {source} already holds files modelload did not write" in err
    assert "--model-dir" in err
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before
    assert not (tmp_path / "model.seg").exists()


def test_a_model_directory_modelload_wrote_is_replaced_by_the_next_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, kind in ((first, "llama"), (second, "gpt2")):
        folder.mkdir()
        save_file({"w": np.arange(16, dtype=np.float32)}, folder / "model.safetensors")
        (folder / "config.json").write_text(f'{{"model_type": "{kind}"}}')
    segments = tmp_path / "segments"
    segments.mkdir()
    assert run(capsys, "stage", "--no-progress", first, segments / "a.seg")[0] == 0
    status, err = run(capsys, "stage", "--no-progress", second, segments / "b.seg")
    assert status == 0, err
    assert "gpt2" in (segments / "model" / "config.json").read_text()
