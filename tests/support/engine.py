"""The sidecar's load engine in a thread of the test process, as the sidecar runs it, for tests that consume a
segment while it loads (memory modes release and ring) without a sidecar process between them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from modelload.sidecar.load import LoadSettings
from modelload.sidecar.load.engine import Engine
from modelload.sidecar.memory import MemorySettings
from modelload.sidecar.progress import LoadTracker
from modelload.sidecar.sources import SourceSettings


class EngineThread:
    """Loads ``source`` into ``segment``; returns once the segment exists (a reader may attach)."""

    def __init__(self, source: Path, segment: Path, memory: MemorySettings, *, timeout: float = 30) -> None:
        self.engine = Engine(
            LoadSettings(source=str(source), segment=segment, chunk_size=64 << 10, memory=memory, readers=2),
            sources=SourceSettings(),
            observer=LoadTracker(),
        )
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="test-engine", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not segment.exists():
            assert self.thread.is_alive(), f"the load ended before its segment appeared: {self.error!r}"
            assert time.monotonic() < deadline, f"no segment at {segment} after {timeout} s"
            time.sleep(0.002)

    def _run(self) -> None:
        try:
            self.engine.run()
        except BaseException as exc:
            self.error = exc

    def finish(self, timeout: float = 30) -> None:
        """Wait for the load to end; it must."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the load did not end in {timeout} s"
