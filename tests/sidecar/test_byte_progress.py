"""Progress moves as bytes land: a tensor that is one long range shows its bytes in /status while it streams,
not only once it is whole, and every chunk still counts exactly its tensor bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modelload.loader.formats.safetensors import save_file
from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.meter import ChunkMeter
from modelload.sidecar.sources import HttpSettings, SourceSettings
from tests.support.fault_proxy import FaultProxy, Stall
from tests.support.nginx import NginxServer
from tests.support.sidecars import BackgroundLoad
from tests.support.waiting import wait_for

MiB = 1 << 20


def test_a_long_range_shows_its_bytes_while_it_streams(
    nginx: NginxServer, nginx_proxy: FaultProxy, tmp_path: Path, shm_dir: Path
) -> None:
    file = tmp_path / "one.safetensors"
    save_file({"big": np.arange(MiB, dtype=np.float32)}, file)  # one 4 MiB tensor: one range
    nginx.put("progress/one.safetensors", file.read_bytes())
    # Every GET stops for 2 s after 2 MiB (the small index reads never get that far).
    nginx_proxy.always(Stall(after=2 * MiB, seconds=2.0), path="progress/one.safetensors")
    load = BackgroundLoad(
        LoadSettings(
            source=nginx_proxy.url("progress/one.safetensors"),
            segment=shm_dir / "model.seg",
            readers=1,
            chunk_size=32 * MiB,
        ),
        sources=SourceSettings(http=HttpSettings(stall_timeout=10.0)),
    )
    try:
        midway = wait_for(
            lambda: load.tracker.snapshot() if load.tracker.snapshot().bytes_done else None,
            timeout=10,
            what="bytes counted while the range streams",
        )
        assert midway.tensors_ready == 0 and midway.phase == "loading"
        assert 0 < midway.bytes_done < midway.bytes_total == 4 * MiB
    finally:
        load.finish(20)
    done = load.tracker.snapshot()
    assert (done.phase, done.bytes_done, done.tensors_ready) == ("complete", 4 * MiB, 1)


def test_a_chunk_meter_scales_landed_bytes_to_tensor_bytes_and_counts_each_once() -> None:
    counted: list[int] = []
    meter = ChunkMeter(counted.append, data=900, length=1000)  # 100 bytes of headers in the range
    for _ in range(3):
        meter(250)
    assert sum(counted) == 675
    meter(600)  # a source that reports past the range is capped at it
    meter.finish()
    meter.finish()
    assert sum(counted) == 900 and all(n > 0 for n in counted)
