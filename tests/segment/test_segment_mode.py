"""Who may read a segment: its owner and its group, never every user (it holds decrypted weights)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.segment.helpers import small_layout, write_complete

OTHER_USER = 43_210
POD_GROUP = 43_211
"""A volume group as kubelet sets it for a pod's fsGroup (the directory setgid and owned by the group)."""


def test_the_segment_is_readable_by_its_owner_and_group_only_whatever_the_umask(shm_dir: Path) -> None:
    old = os.umask(0)
    try:
        write_complete(shm_dir / "model.seg", small_layout())
    finally:
        os.umask(old)
    assert stat.S_IMODE((shm_dir / "model.seg").stat().st_mode) == 0o640


def _read_as(path: Path, *, groups: list[int]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["head", "-c", "8", str(path)],
        user=OTHER_USER,
        group=OTHER_USER,
        extra_groups=groups,
        capture_output=True,
        check=False,
        timeout=10,
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")
def test_a_container_in_the_pods_group_reads_the_segment_and_another_user_does_not(shm_dir: Path) -> None:
    volume = shm_dir / "volume"
    volume.mkdir()
    os.chown(volume, 0, POD_GROUP)
    volume.chmod(0o2777)  # what kubelet makes of a memory emptyDir under an fsGroup
    shm_dir.chmod(0o755)
    write_complete(volume / "model.seg", small_layout())
    assert (volume / "model.seg").stat().st_gid == POD_GROUP

    member = _read_as(volume / "model.seg", groups=[POD_GROUP])
    assert member.returncode == 0, member.stderr
    assert member.stdout == (volume / "model.seg").read_bytes()[:8]

    stranger = _read_as(volume / "model.seg", groups=[])
    assert stranger.returncode != 0
    assert b"Permission denied" in stranger.stderr
