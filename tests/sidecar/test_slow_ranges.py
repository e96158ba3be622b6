"""A slow range does not hold a load: a connection that trickles is given up and its range resumed on
another, and ``/status``'s ETA says "unknown" rather than "under a second" while nothing lands."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.progress import RATE_WINDOW, LoadTracker
from modelload.sidecar.sources import HttpSettings, RetryPolicy, SourceSettings
from tests.sidecar import models
from tests.support.clock import FakeClock
from tests.support.fault_proxy import Stall, Trickle

PASS = Stall(after=0, seconds=0.0)


@pytest.mark.parametrize("landing", ["splice", "mapping"])
def test_a_trickling_range_moves_to_another_connection_and_resumes_where_it_stopped(
    landing: str, nginx: Any, nginx_proxy: Any, shm_dir: Path
) -> None:
    tensors = models.state_dict(seed=50, width=256, layers=1)
    nginx.put("trickle.bin", models.tensorizer_bytes(tensors))
    # The stat and the index go through; the first data request sends 5,000 bytes, then 64 bytes every 20
    # ms (3 KB/s): never silent for the 2 s stall timeout, never done.
    nginx_proxy.push(PASS, PASS, Trickle(after=5_000, piece=64, interval=0.02))
    sources = SourceSettings(
        http=HttpSettings(connect_timeout=2.0, stall_timeout=2.0, min_rate=256 << 10, slow_window=0.5),
        retry=RetryPolicy(attempts=3, initial_backoff=0.01, max_backoff=0.05, jitter=0.0, deadline=20.0),
    )
    tracker = LoadTracker()
    engine = Engine(
        LoadSettings(
            source=nginx_proxy.url("trickle.bin"),
            segment=shm_dir / "model.seg",
            readers=1,
            chunk_size=1 << 20,
            landing=landing,
        ),
        sources=sources,
        observer=tracker,
    )
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    if thread.is_alive():
        engine.stop()
        pytest.fail("the load is still held by the trickling range after 20 s")
    status = tracker.snapshot()
    assert status.phase == "complete" and status.retries == 1 and status.errors == {"timeout": 1}
    slow, resumed = nginx_proxy.ranges()[2:4]
    assert slow[0] < resumed[0] < slow[1] and resumed[1] == slow[1], "only the rest is asked again"
    assert resumed[0] - slow[0] >= 5_000, "the resume starts after the bytes that landed"
    models.assert_segment_matches(shm_dir / "model.seg", tensors)


def test_a_minimum_rate_must_be_a_number_of_bytes_per_second() -> None:
    with pytest.raises(ConfigError, match="min_rate"):
        HttpSettings(min_rate=-1)
    HttpSettings(min_rate=0)  # 0 turns the check off


def test_the_eta_follows_recent_progress_and_is_unknown_while_nothing_lands() -> None:
    clock = FakeClock()
    tracker = LoadTracker(clock=clock)
    tracker.load_started(source="s3://bucket/model", segment="/dev/shm/model.seg")
    tracker.manifest_published(model_format="safetensors", tensors=26, nbytes=26 << 20, notify=None)
    for _ in range(25):  # 25 of 26 MiB in 5 s: 5 MiB/s
        clock.advance(0.2)
        tracker.bytes_loaded(1 << 20)
    eta = tracker.snapshot().eta
    assert eta is not None and 0.1 < eta < 0.3  # 1 MiB left at 5 MiB/s

    clock.advance(RATE_WINDOW + 1)  # the last range trickles: nothing lands for a whole window
    status = tracker.snapshot()
    assert status.eta is None, "an ETA from the average since the start would say 'under a second'"
    assert status.recent_throughput == 0.0
    assert status.as_dict()["eta_s"] is None

    clock.advance(1.0)
    tracker.bytes_loaded(1 << 20)  # it finally lands (a retry on another connection)
    tracker.load_finished(seconds=30.0, nbytes=26 << 20)
    assert tracker.snapshot().eta == 0.0
