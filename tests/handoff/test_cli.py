"""``modelload keeper`` as an operator meets it: a probe, a bad flag, a container without a GPU."""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modelload.loader import _cuda
from modelload.loader.errors import DeviceError

ROOT = Path(__file__).resolve().parents[2]


def keeper(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "modelload.loader.cli.main", "keeper", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def test_the_status_probe_without_a_keeper_fails_in_one_line(tmp_path: Path) -> None:
    done = keeper("--status", "--socket", str(tmp_path / "k.sock"))
    assert done.returncode == 1
    assert done.stderr.strip().startswith("modelload keeper: no keeper answers at")
    assert "Traceback" not in done.stderr


def test_a_block_size_under_a_mebibyte_is_a_configuration_error() -> None:
    done = keeper("--block-size", "4096")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--block-size: a block size must be at least 1MiB, got 4KiB" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_a_keeper_without_a_gpu_says_what_it_needs_without_a_traceback(tmp_path: Path) -> None:
    done = keeper("--socket", str(tmp_path / "k.sock"), "--segment", str(tmp_path / "m.seg"))
    assert done.returncode == 1
    assert "sees no CUDA device" in done.stderr and "the hand-off needs the GPU" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "k.sock").exists()


def test_the_driver_structures_have_the_layout_of_cuda_h() -> None:
    # cuda.h (CUDA 10.2 to 13): CUmemLocation {int type; int id}; CUmemAllocationProp {type,
    # requestedHandleTypes, location, void *win32HandleMetaData, allocFlags (8 bytes)}; CUmemAccessDesc
    # {location, flags}. A wrong layout would hand the driver garbage, so it is pinned here, off the GPU.
    assert ctypes.sizeof(_cuda.CUmemLocation) == 8
    assert ctypes.sizeof(_cuda.CUmemAllocationProp) == 32
    assert _cuda.CUmemAllocationProp.location.offset == 8
    assert _cuda.CUmemAllocationProp.win32HandleMetaData.offset == 16
    assert _cuda.CUmemAllocationProp.allocFlags.offset == 24
    assert ctypes.sizeof(_cuda.CUmemAccessDesc) == 12
    assert ctypes.sizeof(_cuda.CUuuid) == 16


def test_a_missing_driver_library_is_a_device_error_saying_what_the_hand_off_needs() -> None:
    with pytest.raises(
        DeviceError, match=r"cannot load the CUDA driver library libcuda-absent\.so\.1 .*NVIDIA"
    ):
        _cuda.Driver("libcuda-absent.so.1")


def test_each_setting_comes_from_its_flag_or_else_its_variable() -> None:
    from modelload.loader.cli.keeper import KeeperSettings, parse_settings

    flags = argparse.Namespace(segment=None, socket="/tmp/k.sock", device=None, block_size=None, timeout=None)
    environ = {"MODELLOAD_SEGMENT": "/run/m.seg", "MODELLOAD_KEEPER": "/ignored.sock",
               "MODELLOAD_KEEPER_BLOCK_SIZE": "256MiB", "MODELLOAD_KEEPER_TIMEOUT": ""}  # fmt: skip
    assert parse_settings(flags, environ) == KeeperSettings(
        segment="/run/m.seg", socket="/tmp/k.sock", block_size=256 << 20
    )
