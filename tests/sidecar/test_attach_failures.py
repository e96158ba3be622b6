"""``attach()`` against a real sidecar: a load that fails before any segment exists reaches the app at once
(through the failure marker, or the sidecar's /status), and a long load is not cut off by the segment wait."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelload.loader import attach
from modelload.loader.errors import LoadFailedError
from modelload.loader.segment.failure import marker_path, write_failure
from modelload.sidecar.process import Sidecar, default_engine
from tests.sidecar.scripted import scripted, tensor_values
from tests.support.sidecars import Sidecars
from tests.support.waiting import wait_for


@pytest.fixture
def start_sidecar(sidecars: Sidecars) -> Callable[..., Sidecar]:
    def start(source: str, segment: Path, factory: Any = default_engine) -> Sidecar:
        return sidecars.start(source, segment, engine_factory=factory)

    return start


def test_a_load_that_fails_before_its_segment_exists_reaches_attach_at_once(
    start_sidecar: Callable[..., Sidecar], shm_dir: Path, tmp_path: Path
) -> None:
    start_sidecar(str(tmp_path / "missing.safetensors"), shm_dir / "model.seg")
    with pytest.raises(LoadFailedError, match=r"no file at .*missing\.safetensors") as failure:
        attach(shm_dir / "model.seg", timeout=8, notify=False)  # the failure, not the 8 s timeout
    assert "not_found" in failure.value.reason
    assert marker_path(shm_dir / "model.seg").exists()


def test_the_sidecars_status_reports_the_failure_when_the_marker_is_out_of_sight(
    start_sidecar: Callable[..., Sidecar], shm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (shm_dir / "sidecar").mkdir()
    sidecar = start_sidecar(str(tmp_path / "missing.safetensors"), shm_dir / "sidecar" / "model.seg")
    monkeypatch.setenv("MODELLOAD_STATUS_URL", sidecar.api.url)
    with pytest.raises(LoadFailedError, match=r"no file at .*missing\.safetensors"):
        attach(shm_dir / "model.seg", timeout=8, notify=False)  # a path the marker does not sit beside


def test_a_new_load_clears_the_marker_an_earlier_one_left(
    start_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    segment = shm_dir / "model.seg"
    write_failure(segment, "access denied (access_denied)")
    start_sidecar("scripted://model", segment, scripted(tensors=2))
    with attach(segment, timeout=10, notify=False) as model:
        assert np.array_equal(model.numpy("layer1.weight"), tensor_values(1))
    assert not marker_path(segment).exists()


def test_tensor_waits_are_not_bounded_by_the_segment_timeout(
    start_sidecar: Callable[..., Sidecar], shm_dir: Path
) -> None:
    gate = threading.Event()
    script = scripted(tensors=3, pause_at=1, gate=gate)
    sidecar = start_sidecar("scripted://model", shm_dir / "model.seg", script)
    # The segment is published before the short segment wait starts: only the tensor wait is at stake.
    wait_for(lambda: sidecar.tracker.snapshot().tensors_ready >= 1, timeout=30, what="the first tensor ready")
    model = attach(shm_dir / "model.seg", timeout=0.5, notify=False)
    opener = threading.Timer(1.5, gate.set)  # the rest of the load takes longer than the segment wait
    opener.start()
    try:
        assert np.array_equal(model.numpy("layer2.weight"), tensor_values(2))
    finally:
        opener.cancel()
        model.close()
