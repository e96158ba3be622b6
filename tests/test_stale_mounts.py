"""Volumes a killed run of the suite left mounted are unmounted as a run starts (``support/stale_mounts.py``).

Real tmpfs mounts (root only: without root the test skips, and fails under ``make test``, as every mount
test does), in run folders laid out as pytest lays them out: one whose run is over (no ``.lock``), one whose
``.lock`` names a process that has exited, one whose ``.lock`` names this live process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.stale_mounts import unmount_stale
from tests.support.tmpfs import tmpfs


def test_a_dead_runs_volumes_are_unmounted_and_a_live_runs_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "pytest-of-someone"
    ended, killed, live = root / "pytest-7", root / "pytest-8", root / "pytest-9"
    for run in (ended, killed, live):
        run.mkdir(parents=True)
    code = "import os; print(os.getpid())"
    exited = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (killed / ".lock").write_text(exited.stdout.strip())
    (live / ".lock").write_text(str(os.getpid()))
    with tmpfs(ended / "huge", size="1m"), tmpfs(killed / "full", size="1m"), tmpfs(live / "full", size="1m"):
        done = unmount_stale(root)
        assert sorted(done) == sorted([(ended / "huge").resolve(), (killed / "full").resolve()])
        assert not os.path.ismount(ended / "huge") and not os.path.ismount(killed / "full")
        assert os.path.ismount(live / "full"), "a run going on beside this one keeps its volumes"
    assert unmount_stale(root) == [], "nothing is left to unmount"
